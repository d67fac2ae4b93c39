"""Tool output is tokenised as plain text (machinery/data.py:plain_text_ids, used by rollout.py's tool loop): no
added token, special or not, comes from what a snippet prints. Qwen3's <tool_call> and </tool_response> are added
tokens not marked special, which split_special_tokens keeps whole.

    .venv/bin/python -m pytest tests/test_tool_text_tokens.py -q
"""
import pytest

from common import SNIPPET_TIMEOUT_S

QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def qwen_like():
    """A tiny byte-level BPE (Qwen's kind: NFC, byte-level pre-tokeniser) with Qwen3's non-special added tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["print the tool_call output", "<tool_call> and <think> tags"] * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tokenizer.add_tokens(QWEN_ADDED)
    return tokenizer


def toy_with_added(tmp_path):
    """The toy's character-level tokenizer (its special tokens are in the model's vocabulary) plus the same."""
    from tasks.toy import build_tokenizer
    tokenizer = build_tokenizer(tmp_path)
    tokenizer.add_tokens(QWEN_ADDED)
    return tokenizer


@pytest.mark.parametrize("make", [lambda tmp: qwen_like(), toy_with_added], ids=["byte_level_bpe", "char_level"])
def test_printed_added_tokens_stay_text_in_the_tool_loop(make, tmp_path):
    """The real tool loop (run_trajectories, a real sandbox) with a scripted policy whose snippet prints every added
    token's text: the tool's ids hold no added token and decode back to exactly the text between the turns."""
    from rollout import CODE_STOP, Segment, Tools, run_trajectories
    from sandbox import SandboxPool
    tokenizer = make(tmp_path)
    added = tokenizer.get_added_vocab()
    assert set(QWEN_ADDED) <= set(added) and not set(QWEN_ADDED) & set(tokenizer.all_special_tokens)
    segments = [f"<code>\n```python\nprint({''.join(added)!r})\n```\n{CODE_STOP}", "\\boxed{7}"]
    pending = []

    def start(ids, room, seed):
        pending.append(segments[len(pending)])
        return len(pending) - 1

    def step():
        text = pending[-1]
        ids = tokenizer.encode(text, add_special_tokens=False)
        return [(len(pending) - 1, Segment(ids, [0.0] * len(ids), text, "stop",
                                           CODE_STOP if text.endswith(CODE_STOP) else None))]
    with SandboxPool(workers=1, timeout_s=SNIPPET_TIMEOUT_S) as pool:
        [r] = run_trajectories(start, step, lambda ids: None, tokenizer, [[1]], [0], max_tokens=1000,
                               max_model_len=1200, tools=Tools(pool))
    assert r.tool_calls == 1 and r.tool_errors == 0, r.text
    tool_ids = [t for t, m in zip(r.response_ids, r.response_mask) if m == 0]
    tool_text = r.text[len(segments[0]): -len(segments[1])]
    assert "<tool_call></tool_call><tool_response></tool_response>" in tool_text, r.text  # <think>: escaped
    assert not set(tool_ids) & set(added.values()), [tokenizer.convert_ids_to_tokens(t) for t in tool_ids]
    assert tokenizer.decode(tool_ids) == tool_text
