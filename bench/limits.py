"""This machine's ceilings, and how far each phase of a spo.py run is from them (`python -m bench limits`).

The ceilings, measured in this process, the fastest of `--repeats` calls after one untimed call:
- matmul: FLOP/s of torch.matmul, 2 m k n FLOPs for (m x k) @ (k x n), in fp32 on each model's own shapes
  ((T x hidden) @ (hidden x intermediate): the MLP, T = `--tokens`, spo.py's default micro-batch token budget;
  (C x hidden) @ (hidden x vocab): the log-prob head over one of the trainer's chunks of C response positions) and
  on a 1024-cube, at the threads one rank uses and at all the cores this process may use; in bf16 on the cube, with
  whether the CPU has bf16 instructions (avx512_bf16 or amx_bf16 on x86, bf16 on Arm, from /proc/cpuinfo).
- memory: bytes/s of a sum over an fp32 tensor of `--memory_mib` (each byte read once: "read") and of a copy of it
  into another (the tensor's bytes over the time, each byte read once and written once: "copy"), larger than the
  caches.
A rank's ceiling is the lower of what its own threads reach alone and an equal share (1 / ranks) of what all the
cores reach: the ranks run at once and share the cores and the memory bus. The matmul ceiling is the best fp32
rate of all the shapes measured (the shapes' own rates are printed, so a small model's loss to its shapes shows).

Each phase of a run (`--run DIR`: its config.json and metrics.jsonl, means over the steps after `--warmup`), per
rank: rank 0's timings, its share of the batch B / ranks. P: the mean prompt length of the training set (its
tokenised prompts), L and L_max: response/length_mean and response/length_max.
- update: F = bench/gpu.py:_forward_flops of one forward over B / ranks sequences of P + L tokens (2 FLOPs per
  weight of the decoder's matrices per token, causal attention included, the output projection at response
  positions only, as the trainer's log-prob pass), H its output projection's share. Two rows, against the matmul
  ceiling: model FLOPs 3F / time/update (the backward costs two forwards: 6N per token in the usual notation), and
  what the cores ran: 3F' + 4H, F' the decoder's share of F at the tokens it really ran (policy/decoder_tokens:
  packed rows, each shared prefix once; runs from before that metric: every token), the log-prob chunks always
  recomputed in the backward; with gradient checkpointing 4(F' + H) (every decoder layer runs forward again: 8N).
  Model FLOPs count every token of every sequence, so that row passes the ceiling where shared prefixes spare
  more than the rest costs. Sequences at their mean length: the attention term of a spread of lengths is
  slightly larger.
- old log-probs: model FLOPs, F over policy/rescored_sequences / ranks sequences (SPO's D(x) pass), of P + L
  tokens (shared prefixes computed once there too).
- generate: throughput/tokens_per_second (policy tokens of the step over ranks, over time/generate) against the
  rate of the fastest generation the ceilings allow: the rank's N tokens over the prefill's time plus L_max
  decoding steps, N / (F_prefill / matmul + L_max * max(W * 4 bytes / read, 2 W c / matmul)). F_prefill: one
  forward over the rank's B / ranks prompts of P tokens, the output projection at the last one (vLLM computes
  each prompt once: no prefix cache on CPU); W: the weights a decoding step multiplies by (every nn.Linear of the
  model, the output projection included), fp32 on CPU (both engines); c = N / L_max, tokens per decoding step
  (the longest response sets how many steps run). Left out, so the bound is loose: the decoding steps' attention
  and KV-cache reads, the sampler, tool calls.
- weight push: all the model's parameters (tied ones once) * 4 bytes (fp32 on CPU: trainer.full_parameters(policy,
  None)) over time/weight_push, against the copy rate (the push copies every weight at least once).

A run made with --bf16 on (its config.json says so) is set against the bf16 matmul ceiling (measured on every
shape where the CPU has bf16 instructions), with 2 bytes per weight for generation and the push.

    python -m bench limits                                   # the ceilings, on the toy's and SmolLM2-135M's shapes
    python -m bench limits --run RUN_DIR [RUN_DIR ...] --ranks 2   # and each phase of those spo.py runs
"""
import argparse
import contextlib
import dataclasses
import json
import os
import time

import numpy as np

from machinery.errors import fail
from machinery.device import native_bf16

# When no run is given: the shapes of tasks/toy.py:build_model and of SmolLM2-135M (tasks/smollm.py), as configs.
SHAPES = {
    "toy": ("qwen3", dict(vocab_size=128, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    "smollm2-135m": ("llama", dict(vocab_size=49_152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                   tie_word_embeddings=True)),
}
BYTES = 4  # fp32: the CPU engines' and the CPU weight push's element size
CUBE = "1024-cube"


# ------------------------------------------------------------------------------------------------ the ceilings
@contextlib.contextmanager
def threads(n):
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def best_rate(op, work, repeats):
    """work / the fastest of `repeats` timed calls of op, after one untimed call (allocations, kernel choice)."""
    op()
    fastest = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        op()
        fastest = min(fastest, time.perf_counter() - t0)
    return work / max(fastest, 1e-9)


def matmul_rate(m, k, n, dtype, n_threads, repeats):
    """FLOP/s of (m x k) @ (k x n) in dtype on n_threads threads."""
    import torch
    with threads(n_threads):
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        out = torch.empty(m, n, dtype=dtype)
        return best_rate(lambda: torch.matmul(a, b, out=out), 2.0 * m * k * n, repeats)


def memory_rates(n_bytes, n_threads, repeats):
    """(read, copy) bytes/s over an fp32 tensor of n_bytes: a sum reads it; a copy reads it and writes another,
    counted as the tensor's bytes once."""
    import torch
    with threads(n_threads):
        x = torch.ones(n_bytes // 4)  # written, so its pages exist before the timing
        y = torch.zeros_like(x)
        return best_rate(x.sum, x.numel() * 4, repeats), best_rate(lambda: y.copy_(x), x.numel() * 4, repeats)


def shapes_of(name, config, tokens):
    """The model's matmul shapes (m, k, n): its MLP over `tokens` tokens, and its log-prob head over one of the
    trainer's chunks of response positions (trainer.response_logprobs: LOGIT_CHUNK_BYTES of fp32 logits)."""
    from machinery.batching import LOGIT_CHUNK_BYTES
    h, chunk = config.hidden_size, min(tokens, LOGIT_CHUNK_BYTES // (4 * config.vocab_size))
    return {f"{name} MLP {tokens}x{h}x{config.intermediate_size}": (tokens, h, config.intermediate_size),
            f"{name} head {chunk}x{h}x{config.vocab_size}": (chunk, h, config.vocab_size)}


def measure(shapes, thread_counts, memory_bytes, repeats, bf16_shapes=False):
    """{"matmul": {(label, "float32" or "bfloat16", threads): FLOP/s}, "read" / "copy": {threads: bytes/s}}. bf16
    on the cube only unless bf16_shapes (a CPU with bf16 instructions: runs with --bf16 on compute in it): without
    them it is emulated, far slower than fp32, and a model's head in it would take minutes."""
    import torch
    out = {"matmul": {}, "read": {}, "copy": {}}
    for n in sorted(set(thread_counts)):
        for label, (m, k, n_) in shapes.items():
            out["matmul"][label, "float32", n] = matmul_rate(m, k, n_, torch.float32, n, repeats)
            if bf16_shapes or label == CUBE:
                out["matmul"][label, "bfloat16", n] = matmul_rate(m, k, n_, torch.bfloat16, n, repeats)
        out["read"][n], out["copy"][n] = memory_rates(memory_bytes, n, repeats)
    return out


@dataclasses.dataclass
class Ceilings:
    """One rank's ceilings: FLOP/s (fp32 matmul), bytes/s (read, copy)."""
    matmul: float
    read: float
    copy: float


def rank_ceilings(measured, rank_threads, all_threads, ranks, dtype="float32"):
    """The lower of a rank's threads alone and 1 / ranks of all cores; matmul: the best shape in dtype."""
    def share(rates):
        return min(rates[rank_threads], rates[all_threads] / ranks)
    matmul = {}
    for (label, kind, n), rate in measured["matmul"].items():
        if kind == dtype:
            matmul.setdefault(n, {})[label] = rate
    best = share({n: max(rates.values()) for n, rates in matmul.items()})
    return Ceilings(best, share(measured["read"]), share(measured["copy"]))


def threads_per_rank(ranks, default_threads):
    """torch's threads in one rank of `torchrun --nproc_per_node=ranks`: OMP_NUM_THREADS when set (torchrun passes
    it on), else 1 with more than one rank (torchrun sets it), else torch's default."""
    if os.environ.get("OMP_NUM_THREADS"):
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return 1 if ranks > 1 else default_threads


# ------------------------------------------------------------------------------------------------ the phases
def matrix_weights(config):
    """(W, all): the elements of the weights a decoding step multiplies by (every nn.Linear, the output projection
    included), and of all the parameters (a tied embedding once), from a model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
                 for m in model.modules() if isinstance(m, torch.nn.Linear))
    return linear, sum(p.numel() for p in model.parameters())  # (parameters(): shared tensors once)


def phase_means(rows, warmup):
    """Means over the step rows after `warmup` (rows without time/update, like step 0's evaluation, skipped)."""
    steps = [row for row in rows if row.get("step", 0) > warmup and "time/update" in row]
    keys = ("time/update", "time/old_logprobs", "time/generate", "time/weight_push", "response/length_mean",
            "response/length_max", "throughput/tokens_per_second", "policy/rescored_sequences",
            "policy/decoder_tokens")
    return {k: float(np.mean([row.get(k, 0.0) for row in steps])) for k in keys}, len(steps)


def phase_table(means, config, prompt_len, batch_size, ranks, checkpointing, ceilings, weights, element=BYTES):
    """[(phase, achieved, ceiling)] per rank (module docstring's formulas). weights: matrix_weights(config);
    element: bytes per weight in the engine and the push (4: fp32; 2: a --bf16 on run)."""
    from bench.gpu import _forward_flops
    linear, n_params = weights
    length = round(prompt_len + means["response/length_mean"])

    def forward(n_sequences, head_from=round(prompt_len)):  # head_from = length: the head left out
        return _forward_flops(config, [length] * max(1, round(n_sequences)), head_from)
    update_s = max(means["time/update"], 1e-9)
    full, head = forward(batch_size / ranks), forward(batch_size / ranks) - forward(batch_size / ranks, length)
    # the decoder's share of F at the tokens it really ran (packed rows, shared prefixes once; runs before
    # policy/decoder_tokens existed: every token of every sequence)
    ran = means["policy/decoder_tokens"] or length * max(1, round(batch_size / ranks))
    decoder = (full - head) * ran / (length * max(1, round(batch_size / ranks)))
    rows = [("update, model FLOPs 3F (6N), GFLOP/s", 3 * full / update_s / 1e9, ceilings.matmul / 1e9),
            ("update, hardware FLOPs " + ("4F' (8N)" if checkpointing else "3F' + head") + ", GFLOP/s",
             (4 * (decoder + head) if checkpointing else 3 * decoder + 4 * head) / update_s / 1e9,
             ceilings.matmul / 1e9)]
    if means["policy/rescored_sequences"] > 0 and means["time/old_logprobs"] > 0:
        rows.append(("old log-probs, 1 forward, GFLOP/s",
                     forward(means["policy/rescored_sequences"] / ranks) / means["time/old_logprobs"] / 1e9,
                     ceilings.matmul / 1e9))
    tokens_per_s, steps = means["throughput/tokens_per_second"], max(means["response/length_max"], 1.0)
    tokens = tokens_per_s * means["time/generate"]  # the rank's tokens of the step
    per_decode_step = tokens / steps
    prompt = round(prompt_len)  # the prefill: each prompt once (no prefix cache on CPU), logits at its last token
    prefill = _forward_flops(config, [prompt] * max(1, round(batch_size / ranks)), prompt - 1) / ceilings.matmul
    decode = steps * max(linear * element / ceilings.read, 2 * linear * per_decode_step / ceilings.matmul)
    bound = tokens / (prefill + decode)
    rows.append((f"generate, tokens/s ({per_decode_step:.1f} per decoding step)", tokens_per_s, bound))
    rows.append(("weight push, GB/s", n_params * element / max(means["time/weight_push"], 1e-9) / 1e9,
                 ceilings.copy / 1e9))
    return rows


def print_table(title, rows):
    print(title)
    print(f"{'phase':>48} {'achieved':>10} {'ceiling':>10} {'fraction':>9}")
    for phase, achieved, ceiling in rows:
        print(f"{phase:>48} {achieved:>10.4g} {ceiling:>10.4g} {achieved / ceiling:>9.3f}", flush=True)


def read_run(run_dir, warmup):
    """(config.json, step rows) of a spo.py run directory; one line and exit 2 for what is missing."""
    paths = [os.path.join(run_dir, name) for name in ("config.json", "metrics.jsonl")]
    for path in paths:
        if not os.path.isfile(path):
            fail(f"--run {run_dir}: no {os.path.basename(path)} there (a spo.py --run_dir is needed)")
    from machinery.metrics import _row
    with open(paths[1]) as f:
        rows = [row for row in map(_row, f) if row is not None]
    if not any(row["step"] > warmup and "time/update" in row for row in rows):
        fail(f"--run {run_dir}: metrics.jsonl has no training step after --warmup {warmup}")
    with open(paths[0]) as f:
        return json.load(f), rows


def mean_prompt_len(run_config):
    from machinery.data import load_dataset, load_tokenizer
    from rollout import TOOL_INSTRUCTION
    data = load_dataset(run_config["train"], load_tokenizer(run_config["model"]), run_config["max_prompt_len"], False,
                        TOOL_INSTRUCTION if run_config.get("tool_instruction") else None)
    return float(np.mean([len(ids) for ids in data.prompt_ids]))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench limits",
                                     description="this CPU's matmul and memory ceilings, and each phase of spo.py "
                                                 "runs against them (formulas: bench/limits.py, docs/benchmarks.md)")
    parser.add_argument("--run", nargs="+", default=[], help="spo.py run directories (config.json, metrics.jsonl)")
    parser.add_argument("--ranks", type=int, default=2, help="the runs' torchrun --nproc_per_node (config.json "
                                                             "does not record it)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the means")
    parser.add_argument("--tokens", type=int, default=2048, help="the matmul shapes' rows (tokens)")
    parser.add_argument("--memory_mib", type=int, default=1024, help="the bandwidth tensor's size (MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (the fastest counts)")
    args = parser.parse_args(argv)
    for name in ("ranks", "tokens", "memory_mib", "repeats"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be at least 1, got {getattr(args, name)}")
    runs = [(run_dir, *read_run(run_dir, args.warmup)) for run_dir in args.run]  # bad input first, in one line
    import torch
    from transformers import AutoConfig
    configs = ([(f"run {i + 1}", AutoConfig.from_pretrained(c["model"])) for i, (_, c, _) in enumerate(runs)]
               or [(name, AutoConfig.for_model(kind, **shape)) for name, (kind, shape) in SHAPES.items()])
    shapes = {CUBE: (1024, 1024, 1024)}
    for name, config in configs:
        shapes.update(shapes_of(name, config, args.tokens))
    all_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rank_threads = threads_per_rank(args.ranks, torch.get_num_threads())
    bf16 = native_bf16()
    print(f"torch {torch.__version__}, {all_threads} cores, {rank_threads} thread(s) per rank with {args.ranks} "
          f"rank(s); bf16 instructions: {', '.join(bf16) if bf16 else 'none (torch emulates bf16)'}",
          flush=True)
    measured = measure(shapes, (rank_threads, all_threads), args.memory_mib * 2**20, args.repeats, bool(bf16))
    columns = [(d, n) for n in sorted({rank_threads, all_threads}) for d in ("float32", "bfloat16")]
    print(f"\nmatmul GFLOP/s, fastest of {args.repeats}")
    print(f"{'shape (m x k x n)':>40} " + " ".join(f"{f'{d[0]}{d[-2:]}, {n} thread(s)':>18}" for d, n in columns))
    for label in shapes:
        print(f"{label:>40} " + " ".join(f"{measured['matmul'][label, d, n] / 1e9:>18.2f}"
                                         if (label, d, n) in measured["matmul"] else f"{'-':>18}" for d, n in columns))
    for n in sorted({rank_threads, all_threads}):
        print(f"memory, {n} thread(s): read {measured['read'][n] / 1e9:.2f} GB/s, copy {measured['copy'][n] / 1e9:.2f} "
              f"GB/s ({args.memory_mib} MiB fp32)", flush=True)
    ceilings = {d: rank_ceilings(measured, rank_threads, all_threads, args.ranks, d)
                for d in ("float32", "bfloat16") if any(k[1] == d and k[0] != CUBE for k in measured["matmul"])}
    print(f"one rank's ceilings (the lower of {rank_threads} thread(s) alone and 1/{args.ranks} of {all_threads}): "
          + ", ".join(f"matmul {d} {c.matmul / 1e9:.2f} GFLOP/s" for d, c in ceilings.items())
          + f", read {ceilings['float32'].read / 1e9:.2f} GB/s, copy {ceilings['float32'].copy / 1e9:.2f} GB/s",
          flush=True)
    from machinery.device import use_gradient_checkpointing
    for i, ((run_dir, run_config, rows), (_, config)) in enumerate(zip(runs, configs)):
        means, n_steps = phase_means(rows, args.warmup)
        prompt_len = mean_prompt_len(run_config)
        checkpointing = use_gradient_checkpointing(run_config.get("gradient_checkpointing", "auto"), False)
        bf16_run = run_config.get("bf16") == "on"  # its matmuls against the bf16 ceiling, 2 bytes per weight
        if bf16_run and "bfloat16" not in ceilings:
            fail(f"--run {run_dir}: a --bf16 on run, and this CPU has no bf16 instructions to set it against")
        table = phase_table(means, config, prompt_len, run_config["batch_size"], args.ranks, checkpointing,
                            ceilings["bfloat16" if bf16_run else "float32"], matrix_weights(config),
                            2 if bf16_run else BYTES)
        print_table(f"\nrun {i + 1}, {run_dir}: {n_steps} steps after {args.warmup}, per rank ({args.ranks} ranks, "
                    f"{run_config['batch_size'] / args.ranks:g} sequences of {prompt_len:.1f} + "
                    f"{means['response/length_mean']:.1f} tokens; gradient checkpointing "
                    f"{'on' if checkpointing else 'off'}; {'bf16' if bf16_run else 'fp32'})", table)


if __name__ == "__main__":
    main()
