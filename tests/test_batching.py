"""How the trainer cuts its work (machinery/batching.py): micro-batches within the token budget, and sequences
dealt to the ranks by tokens. The same plan under torchrun is tested in tests/test_trainer.py.

    .venv/bin/python -m pytest tests/test_batching.py -q
"""
import numpy as np

from machinery import batching


def test_token_budget_micro_batches_cover_every_sequence_once_within_the_budget():
    lengths = [5, 17, 3, 9, 9, 30, 1, 12]
    plan = batching.plan_micro_batches(lengths, max_sequences=3, max_tokens=20)
    assert sorted(i for group in plan for i in group) == list(range(len(lengths)))
    for group in plan:
        longest = max(lengths[i] for i in group)  # sequences are padded to the micro-batch's longest
        assert len(group) <= 3 and (len(group) * longest <= 20 or len(group) == 1)
        assert [lengths[i] for i in group] == sorted((lengths[i] for i in group), reverse=True)
    assert plan[0] == [5]  # 30 tokens: over the budget, alone
    assert batching.plan_micro_batches(lengths, max_sequences=3) == [[0, 1, 2], [3, 4, 5], [6, 7]]  # no budget


def test_ranks_get_tokens_not_counts():
    """Longest first to the least-loaded rank: no rank ends with more than the lightest one plus the longest
    sequence, where slicing by count (first half / second half) gives one rank nearly all the tokens."""
    lengths = [16000, 15000, 14000, 900, 800, 700, 600, 500]
    owner = batching.assign_by_tokens(lengths, world=2)
    load = np.bincount(owner, weights=lengths, minlength=2)
    assert load.max() - load.min() <= max(lengths) and load.max() < 0.6 * sum(lengths)
    assert list(batching.assign_by_tokens([5, 5, 5, 5], world=2)) == [0, 1, 0, 1]  # ties: in order, lowest rank


def _qwen3(**sliding):
    """A tiny Qwen3 (GQA: 4 query heads on 2 key-value heads), fp32, dropout off."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from machinery import trainer
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, **sliding)
    return trainer.prepare_for_training(Qwen3ForCausalLM(config), gradient_checkpointing=False)


def _sequences(seed, lengths):
    """(B, T) right-padded ids and the (B, T-1) response mask of prompt + response pairs of these lengths."""
    rng = np.random.default_rng(seed)
    return batching.pack([(rng.integers(1, 64, p).tolist(), rng.integers(1, 64, r).tolist(), [1] * r)
                          for p, r in lengths], "cpu")


def _logprobs_and_grads(model, ids, mask):
    import torch
    from machinery import trainer
    rows, cols = mask.nonzero(as_tuple=True)
    model.zero_grad(set_to_none=True)
    logp, _ = trainer.response_logprobs(model, ids, rows, cols, 1.0)
    (logp * torch.linspace(-1, 1, len(logp))).sum().backward()  # positions weighed unequally
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_row_keeps_each_sequence_up_to_its_last_target_and_finds_every_position():
    import torch
    ids, mask = _sequences(0, [(5, 3), (2, 9), (4, 0), (7, 1)])  # the third asks for nothing
    mask[1, 6:] = 0  # the second's last 4 response tokens are not asked for: cut after position 5's target
    rows, cols = mask.nonzero(as_tuple=True)
    flat, positions, bounds, index = batching.packed_row(ids, rows, cols)
    assert bounds.tolist() == [0, 8, 15, 23]  # 5 + 3 whole; 7: up to position 5's target; the third left out; 7 + 1
    assert torch.equal(flat[0, index], ids[rows, cols]) and torch.equal(flat[0, index + 1], ids[rows, cols + 1])
    assert torch.equal(positions[0, index], cols)  # each sequence counts its positions from 0


def test_packed_log_probs_and_gradients_are_the_padded_ones_and_no_sequence_sees_another():
    """The decoder on one packed row (packed_attention) against the same model on right-padded rows (torch's own
    causal sdpa): the same log-probs and gradients up to the attention's sum order. And a sequence's log-probs do
    not move, bit for bit, when the other sequences of its micro-batch change (same lengths: same shapes), which
    attention across sequences would break."""
    import torch
    from machinery import trainer
    lengths = [(6, 9), (3, 2), (11, 5), (4, 12)]
    ids, mask = _sequences(1, lengths)
    model = _qwen3()
    padded = _logprobs_and_grads(model, ids, mask)
    trainer.attach_logprob_forward(model)
    assert model.config._attn_implementation == batching.PACKED_ATTENTION
    packed = _logprobs_and_grads(model, ids, mask)
    torch.testing.assert_close(packed[0], padded[0], atol=1e-5, rtol=0)
    for name, grad in padded[1].items():
        torch.testing.assert_close(packed[1][name], grad, atol=1e-5, rtol=1e-4)
    others, _ = _sequences(2, lengths)  # every sequence's tokens different...
    others[2] = ids[2]  # ...but the third's
    rows, cols = mask.nonzero(as_tuple=True)
    with torch.no_grad():
        again, _ = trainer.response_logprobs(model, others, rows, cols, 1.0)
    third = rows == 2
    assert torch.equal(again[third], packed[0][third]) and not torch.equal(again[~third], packed[0][~third])


def test_packed_attention_keeps_a_sliding_window_and_refuses_an_unpacked_call():
    """A model with a sliding window (here 4 tokens on every layer): transformers builds it into the mask of the
    padded call; packed_attention rebuilds it per sequence. The window matters (without it the numbers differ),
    and a call without sequence bounds (the model's own forward) raises instead of attending across sequences."""
    import pytest
    import torch
    from machinery import trainer
    ids, mask = _sequences(3, [(7, 8), (2, 3), (9, 6)])
    windowed, full = _qwen3(use_sliding_window=True, sliding_window=4, max_window_layers=0), _qwen3()
    padded = _logprobs_and_grads(windowed, ids, mask)[0]
    assert not torch.allclose(padded, _logprobs_and_grads(full, ids, mask)[0], atol=1e-3)
    trainer.attach_logprob_forward(windowed)
    torch.testing.assert_close(_logprobs_and_grads(windowed, ids, mask)[0], padded, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="packed_attention"):
        windowed(input_ids=ids)
