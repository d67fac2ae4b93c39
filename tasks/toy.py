"""The built-in toy: a verifiable arithmetic task and a tiny model, so that the default run works offline. Nothing
here is special to SPO: it is what a real user brings, train / test parquet files in the verl schema used for DAPO
and a Hugging Face model directory (Qwen3 config, hidden 128, 4 layers, char-level vocabulary: about 0.8M
parameters), warm-started on "a+b=" with 30% of the answers given one wrong digit: without that noise the model is
as good sampled at temperature 1.0 as greedy and RL has little to sharpen (docs/experiments.md). The tool toy (shipped
built, its recipe at commit 2d63bad) is the same model on "a*b=" with a Python tool.

The toys ship built in tasks/built/ (toy/, toy_tools/): a build is deterministic only on one kind of CPU (800
warm-start steps amplify float differences), so the bytes ship, listed in each folder's SHA256SUMS (the tool toy's
offline values for the README's `spo.py --tools` run too), and loading checks them.

    python -m tasks.toy --toy_dir tasks/built/toy                # rebuild the shipped toy (this CPU's bytes)
    python -m tasks.toy --toy_dir mytoy --steps 400               # another toy; then spo.py --toy_dir mytoy
"""
import argparse
import json
import os
import shutil
import time

import numpy as np
import torch

from tasks.paper import sha256

TOY_VERSION = 1  # bump when the recipe below changes, so cached toys are rebuilt
BUILT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "built")  # the shipped toys: toy/, toy_tools/
CHECKSUMS = "SHA256SUMS"  # in each built toy: `sha256sum -c SHA256SUMS` reads it too
SPECIAL_TOKENS = ["<|pad|>", "<|im_end|>", "<|unk|>"]
# The chat template is what a real model ships; ours puts the question on one line and the answer after it.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}{% endif %}"


def make_problems(seed, n_train, n_test):
    """Disjoint train / test sets of (a, b) pairs, 0 <= a, b <= 99."""
    rng = np.random.default_rng(seed)
    pairs = rng.permutation(100 * 100)[: n_train + n_test]
    a, b = pairs // 100, pairs % 100
    return list(zip(a[:n_train], b[:n_train])), list(zip(a[n_train:], b[n_train:]))


def write_parquet(path, problems, split, op="+", source=None):
    """The verl / DAPO schema: prompt as chat messages, the answer (a+b, or a*b for the tool toy) in
    reward_model.ground_truth, data_source by source(a, b) where given. No tool instruction in the tool toy's prompt:
    its warm start teaches the format."""
    import pyarrow as pa  # here: only building a toy writes parquet
    import pyarrow.parquet as pq
    solve = (lambda a, b: a + b) if op == "+" else (lambda a, b: a * b)
    pq.write_table(pa.table({
        "data_source": [source(a, b) for a, b in problems] if source else
                       ["toy_add" if op == "+" else "toy_mul_tool"] * len(problems),
        "prompt": [[{"role": "user", "content": f"{a}{op}{b}="}] for a, b in problems],
        "ability": ["math"] * len(problems),
        "reward_model": [{"style": "rule", "ground_truth": str(solve(a, b))} for a, b in problems],
        "extra_info": [{"split": split, "index": i} for i in range(len(problems))],
    }), path)


def build_tokenizer(out_dir):
    """A character-level tokenizer (printable ASCII + newline) saved in Hugging Face format."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                        unk_token="<|unk|>")
    tokenizer.add_special_tokens({"additional_special_tokens": []})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_model(tokenizer, seed):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(
        vocab_size=128, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32")
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


# The toy's only correct response, {answer} for the sum: its probability is the exact success probability.
ONLY_CORRECT = "\\boxed{{answer}}"


def boxed(answer):
    """A response that is only the boxed answer, as (text, in the loss) pieces."""
    return [(f"\\boxed{{{answer}}}", True)]


def encode_segments(tokenizer, prompts, responses, end_of_turn=True):
    """Right-padded (B, T) input ids and a (B, T) mask, 1 on the response pieces in the loss (not the tool's output)."""
    seqs, masks = [], []
    for prompt, pieces in zip(prompts, responses):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        seq = tokenizer.encode(text, add_special_tokens=False)
        mask = [0] * len(seq)
        for piece, trained in pieces:
            ids = tokenizer.encode(piece, add_special_tokens=False)
            seq, mask = seq + ids, mask + [int(trained)] * len(ids)
        seqs.append(seq + [tokenizer.eos_token_id] * end_of_turn)
        masks.append(mask + [1] * end_of_turn)
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), tokenizer.pad_token_id)
    mask = torch.zeros(len(seqs), T)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
    return ids, mask


def response_logprob(model, ids, mask):
    """(B,) log-probability of the masked response tokens: log pi(response | prompt) at temperature 1."""
    logits = model(input_ids=ids).logits[:, :-1]  # (B, T-1, V)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (logp * mask[:, 1:]).sum(-1)


@torch.no_grad()
def success_probability(model, tokenizer, problems, response=lambda a, b: boxed(a + b)):
    """Exact probability of sampling response(a, b) (as pieces; by default the only correct one) at temperature 1.0,
    per problem of a+b."""
    out = []
    for i in range(0, len(problems), 256):
        chunk = problems[i: i + 256]
        ids, mask = encode_segments(tokenizer, [f"{a}+{b}=" for a, b in chunk], [response(a, b) for a, b in chunk])
        out.append(response_logprob(model, ids, mask).exp())
    return torch.cat(out).numpy()


def noisy_answer(a, b, rng, noise):
    answer = list(str(a + b))
    if rng.random() < noise:
        answer[rng.integers(len(answer))] = str(rng.integers(10))  # (the digit is drawn before its position)
    return "".join(answer)


def warm_started(tmp, train, test, op, seed, steps, lr, batch_size, response, warm=None, source=None):
    """A toy's data, tokenizer and model written into tmp, the model warm-started on response(a, b, rng) for the
    problems of `warm` (by default all of train)."""
    warm = train if warm is None else warm
    for split, problems in (("train", train), ("test", test)):
        write_parquet(f"{tmp}/{split}.parquet", problems, split, op, source)
    tokenizer = build_tokenizer(f"{tmp}/model")
    model = build_model(tokenizer, seed)
    t0, rng = time.time(), np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    for _ in range(steps):
        batch = [warm[j] for j in rng.integers(len(warm), size=batch_size)]
        ids, mask = encode_segments(tokenizer, [f"{a}{op}{b}=" for a, b in batch],
                                    [response(a, b, rng) for a, b in batch])
        loss = -response_logprob(model, ids, mask).sum() / mask[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
    model.eval()
    model.save_pretrained(f"{tmp}/model", safe_serialization=True)
    return model, tokenizer, loss.item(), time.time() - t0


def build_atomically(toy_dir, build, info_file="toy.json"):
    """build(tmp) in a fresh sibling directory, renamed over toy_dir: a half-built toy is never taken as finished."""
    tmp = f"{toy_dir}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(f"{tmp}/model")
    info = build(tmp)
    with open(f"{tmp}/{info_file}", "w") as f:
        json.dump(info, f, indent=1)
    write_checksums(tmp)
    shutil.rmtree(toy_dir, ignore_errors=True)
    os.replace(tmp, toy_dir)
    return info


def write_checksums(toy_dir):
    """SHA256SUMS in sha256sum's format."""
    files = sorted(os.path.relpath(os.path.join(d, f), toy_dir).replace(os.sep, "/")
                   for d, _, names in os.walk(toy_dir) for f in names if f != CHECKSUMS)
    with open(os.path.join(toy_dir, CHECKSUMS), "w", newline="\n") as f:
        f.writelines(f"{sha256(os.path.join(toy_dir, name))}  {name}\n" for name in files)


def checksum_error(toy_dir, tools=False):
    """None if every file SHA256SUMS lists is there with its digest; else one line naming the first file that is
    missing or differs, and how to restore or rebuild the toy. Files it does not list (cached offline values) pass."""
    with open(os.path.join(toy_dir, CHECKSUMS)) as f:
        expected = [line.rstrip("\n").split("  ", 1) for line in f if line.strip()]
    for digest, name in expected:
        path = os.path.join(toy_dir, name)
        found = sha256(path)
        if found != digest:
            here = os.path.relpath(toy_dir)
            shipped = os.path.abspath(toy_dir).startswith(BUILT)
            how = [f"restore it with `git checkout -- {here}`"] if shipped or tools else []
            if not tools:  # (the tool toy's recipe is not here: it ships built)
                how.append(f"rebuild it with `python -m tasks.toy --toy_dir {here}` (on another kind of CPU a rebuild "
                           "gives other bytes and other numbers)")
            problem = "missing" if found is None else "checksum mismatch"
            return f"{path}: {problem} against {CHECKSUMS}: {', or '.join(how)}"
    return None


def default_toy_dir(tools=False):
    return os.path.join(BUILT, "toy_tools" if tools else "toy")


def build_toy(toy_dir, seed=0, n_train=2000, n_test=500, steps=800, lr=3e-3, batch_size=64, noise=0.3):
    def build(tmp):
        train, test = make_problems(seed, n_train, n_test)
        model, tokenizer, loss, seconds = warm_started(tmp, train, test, "+", seed, steps, lr, batch_size,
                                                       lambda a, b, rng: boxed(noisy_answer(a, b, rng, noise)))
        p_train, p_test = (success_probability(model, tokenizer, split) for split in (train, test))
        return {"version": TOY_VERSION, "seed": seed, "n_train": n_train, "n_test": n_test, "steps": steps,
                "lr": lr, "noise": noise, "final_sft_loss": loss, "warm_start_seconds": round(seconds, 1),
                "test_accuracy_t1": float(p_test.mean()),
                "train_success_histogram": np.histogram(p_train, bins=np.linspace(0, 1, 11))[0].tolist()}
    return build_atomically(toy_dir, build)


def ensure_toy(toy_dir=None, tools=False):
    """(model_dir, train, test) of the toy (tools: the tool toy), the plain toy built first where unfinished or of
    an older recipe; a finished one must match its SHA256SUMS (one line and exit 2 if not). The tool toy ships
    built only: its recipe is at commit 2d63bad (docs/tools.md)."""
    from machinery.errors import fail
    toy_dir = toy_dir or default_toy_dir(tools)
    marker = os.path.join(toy_dir, "toy.json")
    info = json.load(open(marker)) if os.path.exists(marker) else {}
    if not tools and "recipe" not in info and info.get("version") != TOY_VERSION:  # (another recipe: thinking.py)
        print(f"building the toy into {toy_dir}/ (first use, about 2 minutes)", flush=True)
        info = build_toy(toy_dir)
        print(f"toy built: base test accuracy at temperature 1.0 = {info['test_accuracy_t1']:.1%}", flush=True)
    if not os.path.exists(os.path.join(toy_dir, CHECKSUMS)):
        fail(f"{toy_dir}: a toy without its {CHECKSUMS}" + ("" if tools else f"; rebuild it with `python -m tasks.toy "
             f"--toy_dir {toy_dir}`"), once=True)
    if error := checksum_error(toy_dir, tools):
        fail(error, once=True)
    return os.path.join(toy_dir, "model"), os.path.join(toy_dir, "train.parquet"), os.path.join(toy_dir, "test.parquet")


def toy_paths(toy_dir=None, tools=False):
    """ensure_toy for a torchrun job: rank 0 builds the toy on first use while the others wait."""
    import torch.distributed as dist
    from machinery.collectives import barrier
    if dist.get_rank() == 0:
        # torchrun gives each rank one thread, but the other ranks only wait here: build on every core (the
        # toy's bytes do not depend on the thread count; checked for both toys at 1 and 2 threads).
        threads = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or 1)
        try:
            ensure_toy(toy_dir, tools=tools)
        finally:
            torch.set_num_threads(threads)
    barrier()  # (collectives: if rank 0 stopped building, one line here too)
    return ensure_toy(toy_dir, tools=tools)  # (built by now) every rank checks the bytes it will load


# Named defaults (spo.py --preset), each chosen by measurement (docs/flags.md says what each is for and where it was
# measured): tracker_keeps_up, the toy where default SPO's tracker keeps up; calibrated, the sharper toy set to the
# paper's measured statistics; thinking, the toy whose responses think, where adaptive forgetting and PPO-clip act;
# mixed, the thinking toy of mixed difficulty, where the between-prompt share and D's window are both the paper's.
SHARP_TOY, THINK_TOY, MIXED_TOY = (os.path.join(BUILT, name) for name in ("toy_sharp", "toy_think", "toy_mixed"))
PRESETS = {"tracker_keeps_up": {"train_prompts": 128, "lr": 1.5e-5, "n0": 16, "steps": 600, "eval_every": 50,
                                "probe_every": 50, "probe_prompts": 128, "probe_samples": 32},
           "calibrated": {"toy_dir": SHARP_TOY, "train_prompts": 1024, "batch_size": 128, "ppo_steps": 8,
                          "lr": 3e-7, "temperature": 0.5, "eval_temperature": 0.5, "steps": 300, "eval_every": 25,
                          "probe_every": 25, "probe_prompts": 128, "probe_samples": 16},
           "thinking": {"toy_dir": THINK_TOY, "max_response_len": 64, "train_prompts": 64, "batch_size": 64,
                        "ppo_steps": 8, "lr": 4e-5, "steps": 100, "eval_every": 25, "probe_every": 25,
                        "probe_prompts": 64, "probe_samples": 16},
           "mixed": {"toy_dir": MIXED_TOY, "max_response_len": 64, "train_prompts": 512, "batch_size": 64,
                     "ppo_steps": 8, "lr": 2e-5, "steps": 300, "eval_every": 50, "eval_samples": 8, "probe_every": 50,
                     "probe_prompts": 256, "probe_samples": 16}}


def preset_values(preset, given, algo):
    """--preset: its values for the flags the command line did not give (`given`); the probe only for spo."""
    return {flag: value for flag, value in PRESETS.get(preset, {}).items()
            if flag not in given and not (flag.startswith("probe") and algo != "spo")}  # no tracker to probe


# The default run's held-out accuracy at its last step (%), the range one run falls in: the README's 95% prediction
# interval over seeds 0-4 (docs/experiments.md has the runs); spo.py's last line shows it beside the run's own number.
DEFAULT_RUN_RANGE = (46.2, 59.0)


def fill_in(toy_dir, tools, model, data, split, test=None):
    """(toy_dir, model, data, test): what a program left unset filled in from the toy's `split` and test files."""
    if model is not None and data is not None:
        return toy_dir, model, data, test
    toy_dir = toy_dir or default_toy_dir(tools)
    toy_model, train_path, test_path = toy_paths(toy_dir, tools=tools)
    return toy_dir, model or toy_model, data or {"train": train_path, "test": test_path}[split], test or test_path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toy_dir", default=None, help="where to build the toy (default: the shipped one)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data split and the warm start")
    parser.add_argument("--steps", type=int, default=800, help="warm-start optimiser steps")
    parser.add_argument("--noise", type=float, default=0.3, help="share of warm-start answers with a wrong digit")
    args = parser.parse_args()
    info = build_toy(args.toy_dir or default_toy_dir(), seed=args.seed, steps=args.steps, noise=args.noise)
    print(json.dumps(info, indent=1))
