"""Evaluation: avg@k, pass@k and maj@k, and the command that samples a model (--engine: vLLM or transformers)
and scores it, writing every sample (JSONL) and the summary (JSON and markdown); docs/evaluation.md.

maj@k is a single vote (ties go to the answer whose first sample comes earliest; an unparsed answer never wins) and
a bootstrap expectation over resamples: the paper's maj@32 values on 30-problem sets are not multiples of 1/30, so
they look like one.

    torchrun --nproc_per_node=2 eval.py --model runs/<run> --data aime24.parquet aime25.parquet
    python eval.py                                            # the toy's test set, one process
"""
import contextlib
import json
import os
from pathlib import Path

import numpy as np

from machinery.collectives import all_gather_objects
from machinery.errors import fail
from machinery.run_dir import atomic_write, checkpoint_model, open_output
from probes import EVAL_DEFAULTS, check_sampling_flags, sample_and_score

# ---------------------------------------------------------------------------------------------- metrics
def pass_at_k(n, c, k: int):
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k) for n samples, c correct, as 1 - prod_{i=n-c+1}^{n} (1 - k/i)
    (no huge binomials). n, c: scalars or arrays (P,)."""
    n, c = np.asarray(n), np.asarray(c)
    if k < 1 or np.any(k > n):
        raise ValueError(f"pass@k needs 1 <= k <= n samples, got k={k}, n={int(np.min(n))}")
    i = np.arange(1, int(np.max(n)) + 1)                                     # (M,)
    in_product = (i > (n - c)[..., None]) & (i <= n[..., None])               # (P, M)
    # when n - c < k the product contains the factor at i = k, which is exactly 0: pass@k = 1.0 exactly
    p = 1.0 - np.where(in_product, 1.0 - k / i, 1.0).prod(axis=-1)            # (P,)
    return float(p) if p.ndim == 0 else p


def _encode(answers) -> tuple[np.ndarray, int]:
    """Answers -> integer codes numbered by first appearance; None / empty after strip -> -1 (no vote)."""
    index: dict[str, int] = {}
    codes = [-1 if a is None or not str(a).strip() else index.setdefault(str(a).strip(), len(index)) for a in answers]
    return np.array(codes, dtype=np.int64), len(index)


def _votes(codes: np.ndarray, correct: np.ndarray, n_unique: int) -> np.ndarray:
    """One majority vote per row of codes (R, k) -> (R,) correctness of the winner, scored by its first sample
    (all samples of one answer agree under the verifier). A row with no parsed answer is wrong."""
    R, k = codes.shape
    if n_unique == 0:
        return np.zeros(R, dtype=bool)
    onehot = codes[:, :, None] == np.arange(n_unique)                        # (R, k, U)
    counts = onehot.sum(axis=1)                                               # (R, U)
    first = np.where(counts > 0, onehot.argmax(axis=1), k)                    # (R, U) first position
    rank = counts * (k + 1) + (k - first)     # more votes first, then earlier; absent answers rank 0
    winner = rank.argmax(axis=1)                                              # (R,)
    rows = np.arange(R)
    return (counts[rows, winner] > 0) & correct[rows, first[rows, winner].clip(max=k - 1)]


def majority_vote(answers, correct_flags) -> float:
    """maj@k of one problem: 1.0 if the most frequent parsed answer is correct (ties: earliest sample wins)."""
    codes, n_unique = _encode(answers)
    correct = np.asarray(correct_flags, dtype=bool)
    if len(codes) == 0 or correct.shape != codes.shape:
        raise ValueError(f"majority_vote needs as many answers as flags (> 0), got {len(codes)}, {correct.size}")
    return float(_votes(codes[None], correct[None], n_unique)[0])


def bootstrap_maj_at_k(answers_per_problem, correct_per_problem, k: int, n_boot: int = 1000,
                       seed: int = 0) -> tuple[float, float]:
    """Mean and std of the benchmark's maj@k over n_boot resamples of k samples per problem, with replacement."""
    rng = np.random.default_rng(seed)
    maj = np.zeros((len(answers_per_problem), n_boot))                        # (P, B)
    for p, (answers, flags) in enumerate(zip(answers_per_problem, correct_per_problem)):
        codes, n_unique = _encode(answers)
        correct = np.asarray(flags, dtype=bool)
        draw = rng.integers(0, len(codes), size=(n_boot, k))                  # (B, k)
        maj[p] = _votes(codes[draw], correct[draw], n_unique)
    per_resample = maj.mean(axis=0)                                           # (B,)
    return float(per_resample.mean()), float(per_resample.std())


def summarize(samples, ks=(1, 2, 4, 8, 16, 32), n_boot: int = 1000, seed: int = 0) -> dict:
    """One benchmark; samples[p] lists the n (answer or None, correct[, truncated]) of problem p. Returns fractions:
    avg@n, pass@k for each k <= n, maj@n (one vote and bootstrapped), and why samples fail without being wrong:
    the shares with no parsed answer and (when the samples say) cut by the token budget."""
    n = len(samples[0]) if samples else 0
    if n == 0 or any(len(s) != n for s in samples):
        raise ValueError(f"summarize needs n > 0 samples for every problem, got {sorted({len(s) for s in samples})}")
    answers = [[sample[0] for sample in s] for s in samples]
    correct = np.array([[bool(sample[1]) for sample in s] for s in samples])  # (P, n)
    out = {"problems": len(samples), "samples": n, f"avg@{n}": float(correct.mean())}
    out.update({f"pass@{k}": float(pass_at_k(n, correct.sum(axis=1), k).mean()) for k in ks if k <= n})
    out[f"maj@{n}"] = float(np.mean([majority_vote(a, c) for a, c in zip(answers, correct)]))
    out[f"maj@{n}_boot_mean"], out[f"maj@{n}_boot_std"] = bootstrap_maj_at_k(answers, correct, n, n_boot, seed)
    out["unparsed"] = float(np.mean([a is None for s in answers for a in s]))
    if all(len(sample) > 2 for s in samples for sample in s):
        out["truncated"] = float(np.mean([bool(sample[2]) for s in samples for sample in s]))
    return out


SHARES = ("unparsed", "truncated")  # summary entries without "@" that are fractions too (shown in percent)


def markdown_table(summaries: dict[str, dict]) -> str:
    """Benchmarks as rows (plus their unweighted average, as in the paper's Table 1), metrics in percent."""
    columns = list(dict.fromkeys(c for summary in summaries.values() for c in summary if not c.endswith("_boot_std")))
    rows = dict(summaries)
    if len(summaries) > 1:
        rows["average"] = {c: float(np.mean([s[c] for s in summaries.values()])) for c in columns
                           if "@" in c and all(c in s for s in summaries.values())}

    def cell(summary, column):
        if column not in summary:
            return ""
        if "@" not in column and column not in SHARES:
            return str(summary[column])
        std = summary.get(column.replace("_boot_mean", "_boot_std")) if column.endswith("_boot_mean") else None
        return f"{100 * summary[column]:.1f}" + (f" ± {100 * std:.1f}" if std is not None else "")

    lines = ["| benchmark | " + " | ".join(c.replace("_boot_mean", " (boot)") for c in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(cell(s, c) for c in columns) + " |" for name, s in rows.items()]
    return "\n".join(lines)


def write_samples(path, data, samples, rollouts, n, rank, world, block=64):
    """One JSONL line per sample, problems in data order, written by rank 0 from what every rank sends, `block`
    problems of each rank per collective (no shared filesystem needed; a benchmark's responses never all in memory).
    Problem p is rank p % world's."""

    def lines(p):  # problem p's n lines, on the rank that sampled it
        return [json.dumps({"prompt_key": data.keys[p], "sample": i, "answer": samples[p][i][0],
                            "correct": samples[p][i][1], "ground_truth": data.answers[p],
                            "finish_reason": r.finish_reason, "response_tokens": len(r.response_ids),
                            "response": r.text}) + "\n" for i, r in enumerate(rollouts[p])]
    with writing(path) if rank == 0 else contextlib.nullcontext() as out:
        for start in range(0, len(data.keys), block * world):
            problems = range(start, min(start + block * world, len(data.keys)))
            mine = [lines(p) for p in problems if p % world == rank]
            sent = all_gather_objects([mine]) if world > 1 else [mine]  # (rank r's list is the r-th)
            if rank == 0:
                for p in problems:
                    out.writelines(sent[p % world][(p - start) // world])


@contextlib.contextmanager
def writing(path):
    """atomic_write into --out_dir; a write that fails (a full disk, a quota) is one line (and leaves none of it)."""
    try:
        with atomic_write(path) as f:
            yield f
    except OSError as e:
        fail(f"--out_dir {os.path.dirname(path) or '.'}: cannot write {os.path.basename(path)} "
             f"({e.strerror or e}); nothing of it is left: free space and rerun")


def parse_args(argv=None):
    import argparse
    p = argparse.ArgumentParser(description="Evaluate a model or an spo.py checkpoint: avg@n, pass@k, maj@n")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, help="HF model, or spo.py run / checkpoint dir (default: the toy)")
    g.add_argument("--data", nargs="+", default=None, help="benchmarks: parquet or JSONL files, or hub datasets "
                   "owner/name[:config][@split] (default: toy test)")
    g.add_argument("--toy_dir", default=None,
                   help="the built-in toy's directory (default: the shipped tasks/built/toy, toy_tools with --tools)")
    g.add_argument("--max_prompt_len", type=int, default=4096, help="longer prompts are left out (counted)")
    g = p.add_argument_group("sampling (defaults: the paper's evaluation)")
    # Not `--n`: torchrun's own parser rejects it as an ambiguous abbreviation of --nnodes / --nproc_per_node.
    g.add_argument("--n_samples", type=int, default=EVAL_DEFAULTS["n"], help="samples per problem (n of avg@n)")
    g.add_argument("--temperature", type=float, default=EVAL_DEFAULTS["temperature"], help="sampling temperature")
    g.add_argument("--top_p", type=float, default=EVAL_DEFAULTS["top_p"], help="nucleus sampling")
    g.add_argument("--top_k", type=int, default=EVAL_DEFAULTS["top_k"], help="top-k sampling (-1: off)")
    from reward import add_reward_flags
    from hf_engine import add_engine_flags
    from rollout import add_budget_flag, add_tool_flags, response_budget
    add_budget_flag(g)  # --max_response_len (alias --max_tokens), as spo.py's; the paper evaluates with 32768
    g.add_argument("--seed", type=int, default=0, help="per-request seeds derive from (seed, prompt key, sample)")
    add_reward_flags(g, truncation=False)  # --reward, --think_format: score as training does
    g = p.add_argument_group("output and engine")
    g.add_argument("--out_dir", default="eval_out", help="<benchmark>.samples.jsonl, summary.json, summary.md")
    g.add_argument("--n_boot", type=int, default=1000, help="bootstrap resamples for maj@n mean and std")
    add_engine_flags(g, gpu_share=0.9)  # --engine, --gpu_memory_utilization (an engine alone), --compile
    add_tool_flags(p)
    args = p.parse_args(argv)
    args.max_response_len = response_budget(args.max_response_len, args.tools)
    if args.n_samples < 1 or args.max_response_len < 1:
        p.error("--n_samples and --max_response_len (--max_tokens) must be at least 1")
    check_sampling_flags(vars(args), {"seed": 0, "n_boot": 1, "max_prompt_len": 1})
    return args


def main(argv=None):
    """Ctrl-C or kill -TERM: one line, exit code 130, none of this evaluation's files left (its lock and hold go at
    exit)."""
    import signal
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # raises KeyboardInterrupt, as Ctrl-C does
    written = []
    try:
        evaluate(args, written)
    except KeyboardInterrupt:
        for path in written:
            with contextlib.suppress(OSError):
                os.remove(path)
        with contextlib.suppress(SystemExit):
            fail(f"eval.py: interrupted; nothing of this evaluation is left in --out_dir {args.out_dir}", once=True)
        raise SystemExit(130) from None


def evaluate(args, written):
    from machinery.data import check_context, find_model, load_dataset, load_tokenizer
    from hf_engine import start_engine
    from machinery.device import start_program
    from rollout import TOOL_INSTRUCTION, make_tools
    from tasks import toy
    rank, world, device, args.engine = start_program(args.engine)  # as spo.py
    open_output(args.out_dir, "--out_dir", "eval.py")  # first: of two eval.py into one --out_dir, one goes on
    args.toy_dir, args.model, args.data, _ = toy.fill_in(args.toy_dir, args.tools, args.model, args.data, "test")
    args.data = [args.data] if isinstance(args.data, str) else args.data  # --data takes several files
    args.model, source, error = all_gather_objects([checkpoint_model(args.model) if rank == 0 else None])[0]
    if error:  # source: where the model loads from (a checkpoint's hold), args.model: what it is
        fail(error, once=True)
    source = find_model(source)  # a hub name without a hub: its cached copy, or one line
    tokenizer = load_tokenizer(source)
    benchmarks = {}
    for path in args.data:  # names from file stems; a repeated stem gets a suffix
        name, k = Path(path).stem, 1
        while name in benchmarks:
            name, k = f"{Path(path).stem}_{k}", k + 1
        benchmarks[name] = load_dataset(path, tokenizer, args.max_prompt_len, rank == 0,
                                        TOOL_INSTRUCTION if args.tool_instruction else None)
    longest = max(len(p) for data in benchmarks.values() for p in data.prompt_ids) + args.max_response_len
    check_context(source, longest, "--max_response_len + the longest prompt")
    # An earlier evaluation there (of any model) moves to earlier_K/ rather than being refused, now that the input is
    # checked: experiments/paper.py reruns its stage into the same directory once training goes further.
    open_output(args.out_dir, "--out_dir", "eval.py", (".samples.jsonl", "summary.json", "summary.md"), locked=True)
    tools = make_tools(args.tools, args.max_turns, args.sandbox_workers, args.sandbox_timeout, args.sandbox_memory_mb,
                       args.max_tool_output_chars, {**{path: "data" for path in args.data}, args.out_dir: "out_dir"})
    engine = start_engine(args.engine, source, seed=args.seed, max_model_len=longest, device=device,
                          gpu_memory_utilization=args.gpu_memory_utilization, engine_compile=args.compile)
    n = args.n_samples
    ks = sorted({2 ** i for i in range(n.bit_length())} | {n})  # pass@1, 2, 4, ... and pass@n
    summaries = {}
    for name, data in benchmarks.items():
        samples, rollouts = sample_and_score(engine, data, n, args.seed, temperature=args.temperature,
                                             top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_response_len,
                                             rank=rank, world=world, think_format=args.think_format, tools=tools,
                                             reward=args.reward, reward_timeout=args.reward_timeout)
        written.append(os.path.join(args.out_dir, f"{name}.samples.jsonl"))
        write_samples(written[-1], data, samples, rollouts, n, rank, world)
        if rank == 0:
            summaries[name] = summarize(samples, ks=ks, n_boot=args.n_boot, seed=args.seed)
    if rank == 0:
        table = markdown_table(summaries)
        texts = {"summary.json": json.dumps({"config": vars(args), "results": summaries}, indent=1),
                 "summary.md": f"model `{args.model}`, n = {n}, temperature {args.temperature}, top_p {args.top_p}, "
                               f"top_k {args.top_k}, max_response_len {args.max_response_len}, reward {args.reward}"
                               f"\n\n{table}\n"}
        for name, text in texts.items():
            written.append(os.path.join(args.out_dir, name))
            with writing(written[-1]) as f:
                f.write(text)
        print(table, flush=True)
    written.clear()  # whole: kept from here on, however it ends
    if tools:
        tools.pool.close()
    engine.shutdown()  # also tears down the process group


if __name__ == "__main__":
    main()
