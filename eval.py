"""Evaluation: avg@k, pass@k and maj@k, and the command that samples a model (--engine: vLLM or transformers)
and scores it.

1. Metrics: avg@k, the unbiased pass@k of Chen et al. (2021) in its stable product form, maj@k as a single vote
   (ties go to the answer whose first sample comes earliest; an empty or unparsed answer never wins) and as a
   bootstrap expectation over resamples (the paper's maj@32 values on 30-problem sets are not multiples of 1/30,
   so they look like one), a per-benchmark summary and a markdown table.
2. Sampling: `sample_and_score`, which spo.py's held-out evaluation (`heldout_metrics`) calls too; every
   request's seed derives from (seed, prompt key, sample index), so a sample does not depend on the world size,
   batch or order. Responses are scored by reward.py, the same verifier as training (--reward); the summary
   also counts the samples with no parsed answer and those cut by the budget (--max_response_len).
3. The tracker probe spo.py runs with --probe_every (`tracker_probe`): the value tracker's v(x) against the current
   policy's success rate, measured with fresh samples on a fixed subset of training prompts (does it track?).
4. The command line (paper defaults: n 32, temperature 0.6, top_p 0.95, top_k 20); --model also takes an spo.py
   run or checkpoint directory, of a live run too (machinery/run_dir.py:checkpoint_model); --tools as training.

    torchrun --nproc_per_node=2 eval.py --model runs/<run> --data aime24.parquet aime25.parquet
    python eval.py                                            # the toy's test set, one process
"""
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from machinery.metrics import POOL_PROMPTS, pool_statistics, probe_stats
from reward import DEFAULT_REWARD, VERIFIER_TIMEOUT_S, reward_and_answer

# ---------------------------------------------------------------------------------------------- metrics
def pass_at_k(n, c, k: int):
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k) for n samples, c correct (Chen et al. 2021), in the stable
    product form 1 - prod_{i=n-c+1}^{n} (1 - k/i) (no huge binomials). n, c: scalars or arrays (P,)."""
    n, c = np.asarray(n), np.asarray(c)
    if k < 1 or np.any(k > n):
        raise ValueError(f"pass@k needs 1 <= k <= n samples, got k={k}, n={int(np.min(n))}")
    if np.any((c < 0) | (c > n)):
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    i = np.arange(1, int(np.max(n)) + 1)                                     # (M,)
    in_product = (i > (n - c)[..., None]) & (i <= n[..., None])               # (P, M)
    # when n - c < k the product contains the factor at i = k, which is exactly 0: pass@k = 1.0 exactly
    p = 1.0 - np.where(in_product, 1.0 - k / i, 1.0).prod(axis=-1)            # (P,)
    return float(p) if p.ndim == 0 else p


def _encode(answers) -> tuple[np.ndarray, int]:
    """Answers -> integer codes numbered by first appearance; None / empty after strip -> -1 (no vote)."""
    index: dict[str, int] = {}
    codes = [-1 if a is None or not str(a).strip() else index.setdefault(str(a).strip(), len(index))
             for a in answers]
    return np.array(codes, dtype=np.int64), len(index)


def _votes(codes: np.ndarray, correct: np.ndarray, n_unique: int) -> np.ndarray:
    """One majority vote per row of codes (R, k) -> (R,) correctness of the winner. Tie-break: among the most
    frequent answers, the one whose first sample comes EARLIEST in the row wins; the winner is scored by that
    sample (all samples of one answer agree under the verifier). A row with no parsed answer is wrong."""
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
    """Mean and std of the benchmark's maj@k over n_boot resamples; each draws, per problem, k of its n samples
    with replacement (seeded numpy Generator) and votes."""
    rng = np.random.default_rng(seed)
    maj = np.zeros((len(answers_per_problem), n_boot))                        # (P, B)
    for p, (answers, flags) in enumerate(zip(answers_per_problem, correct_per_problem)):
        codes, n_unique = _encode(answers)
        correct = np.asarray(flags, dtype=bool)
        if not 1 <= k <= len(codes) or correct.shape != codes.shape:
            raise ValueError(f"bootstrap maj@{k}: problem {p} has {len(codes)} answers, {correct.size} flags")
        draw = rng.integers(0, len(codes), size=(n_boot, k))                  # (B, k)
        maj[p] = _votes(codes[draw], correct[draw], n_unique)
    per_resample = maj.mean(axis=0)                                           # (B,)
    return float(per_resample.mean()), float(per_resample.std())


def summarize(samples, ks=(1, 2, 4, 8, 16, 32), n_boot: int = 1000, seed: int = 0) -> dict:
    """One benchmark; samples[p] lists the n (answer or None, correct[, truncated]) of problem p. Returns fractions
    in [0, 1]: avg@n, pass@k for each k <= n, maj@n (one vote) and maj@n_boot_mean / _std; then why samples fail
    without being wrong: the share with no parsed answer (`unparsed`: no final box) and, when the samples say,
    the share cut by the token budget (`truncated`: a budget too small for the model shows here first)."""
    n = len(samples[0]) if samples else 0
    if n == 0 or any(len(s) != n for s in samples):
        raise ValueError(f"summarize needs n > 0 samples for every problem, got {sorted({len(s) for s in samples})}")
    answers = [[sample[0] for sample in s] for s in samples]
    correct = np.array([[bool(sample[1]) for sample in s] for s in samples])  # (P, n)
    out = {"problems": len(samples), "samples": n, f"avg@{n}": float(correct.mean())}
    for k in ks:
        if k <= n:
            out[f"pass@{k}"] = float(pass_at_k(n, correct.sum(axis=1), k).mean())
    out[f"maj@{n}"] = float(np.mean([majority_vote(a, c) for a, c in zip(answers, correct)]))
    out[f"maj@{n}_boot_mean"], out[f"maj@{n}_boot_std"] = bootstrap_maj_at_k(answers, correct, n, n_boot, seed)
    out["unparsed"] = float(np.mean([a is None for s in answers for a in s]))
    if all(len(sample) > 2 for s in samples for sample in s):
        out["truncated"] = float(np.mean([bool(sample[2]) for s in samples for sample in s]))
    return out


SHARES = ("unparsed", "truncated")  # summary entries without "@" that are fractions too (shown in percent)


def markdown_table(summaries: dict[str, dict]) -> str:
    """Benchmarks as rows (plus their unweighted average, as in the paper's Table 1), metrics in percent."""
    columns = []
    for summary in summaries.values():
        columns += [c for c in summary if c not in columns and not c.endswith("_boot_std")]
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


# ---------------------------------------------------------------------------------------------- evaluation
# Each rank's engine takes problems rank, rank + world, ...; every request has its own seed, derived from (seed,
# prompt key, sample index) only, so a sample is the same whatever the world size, batch or order.
EVAL_DEFAULTS = {"n": 32, "temperature": 0.6, "top_p": 0.95, "top_k": 20}  # the paper's evaluation sampling


def request_seeds(base, prompt_key: str, n: int) -> np.ndarray:
    """(n,) per-request seeds for samples 0..n-1 of one prompt; base: an int or a sequence of ints (>= 0).
    The first k seeds do not depend on n, so asking for more samples later keeps the earlier ones."""
    key = int(hashlib.sha1(prompt_key.encode("utf-8")).hexdigest()[:16], 16)
    return np.random.SeedSequence([*np.atleast_1d(base).tolist(), key]).generate_state(n)


def sample_and_score(engine, data, n, seeds_base, *, temperature, top_p, top_k, max_tokens, rank, world,
                     think_format=False, tools=None, reward=DEFAULT_REWARD, reward_timeout=VERIFIER_TIMEOUT_S,
                     progress=True):
    """n samples of every problem of `data` (data.Dataset: keys, prompt_ids, answers), sharded over ranks.

    Returns (samples, rollouts). samples[p] lists the n (answer or None, correct, truncated) of problem p, for
    EVERY problem in data order and on every rank (gathered: call it on all ranks), ready for summarize().
    rollouts maps this rank's problems p to their n Rollouts (responses to write out). tools: a rollout.Tools for
    the tool loop; reward: the --reward verifier (correct: it returned 1). A truncated sample is scored as it is
    (the verifier reads what is there): evaluation does not apply training's --truncated_reward.
    progress: a bar on rank 0 counting its finished samples while they generate (False: none)."""
    mine = list(range(rank, len(data.keys), world))
    outputs = []
    if mine:  # a rank with no problem (more ranks than problems) still joins the gather below
        seeds = np.concatenate([request_seeds(seeds_base, data.keys[p], n) for p in mine])
        bar = None
        if progress and rank == 0:
            from tqdm import tqdm
            bar = tqdm(total=len(mine) * n, desc=f"sampling (rank 0 of {world})", unit="sample", dynamic_ncols=True)
        outputs = engine.generate([data.prompt_ids[p] for p in mine for _ in range(n)], seeds,
                                  max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  **({"tools": tools} if tools is not None else {}),
                                  **({"progress": bar.update} if bar is not None else {}))
        if bar is not None:
            bar.close()
    rollouts = {p: outputs[j * n:(j + 1) * n] for j, p in enumerate(mine)}
    local = {p: [(answer, bool(score), r.finish_reason == "length") for r, (score, answer) in
                 ((r, reward_and_answer(r.text, data.answers[p], think_format, reward, reward_timeout)) for r in rs)]
             for p, rs in rollouts.items()}
    parts = [local]
    if world > 1:  # answers and flags only: responses stay on their rank
        from machinery.collectives import all_gather_objects
        parts = all_gather_objects([local])  # (a rank stopped by its verifier: one line here too, not a traceback)
    merged = {p: s for part in parts for p, s in part.items()}
    return [merged[p] for p in range(len(data.keys))], rollouts


def evaluations(engine, test, data, tracker, args, tools, step, exact=None):
    """What spo.py measures between steps (step 0: before training; then after each step's weight push), when due
    (every --eval_every / --probe_every steps and at the end): held-out accuracy and the tracker probe, with
    `exact_metric`'s function where given. Neither touches training's random state (their own request seeds)."""
    metrics = {}
    if test is not None and args.eval_every and (step % args.eval_every == 0 or step == args.steps):
        metrics.update(heldout_metrics(engine, test, args, tools, exact))
        if exact:  # the training pool's regime, for every algorithm (docs/experiments.md: the calibrated regime)
            pool = probe_subset(len(data.keys), POOL_PROMPTS, args.seed)
            metrics.update(pool_statistics(exact(data, pool, args.temperature)))
    if args.probe_every and (step % args.probe_every == 0 or step == args.steps):
        metrics.update(tracker_probe(engine, data, tracker, args, step, tools, exact))
    return metrics


def heldout_metrics(engine, test, args, tools, exact=None):
    """spo.py's held-out evaluation: accuracy (avg@n at the evaluation temperature, sample_and_score), the shares
    of samples with no parsed answer and cut by the budget, with tools the share that called the tool, with `exact`
    the mean exact success probability. Seeds independent of the step: every evaluation scores the same draws."""
    import torch.distributed as dist
    from machinery.collectives import all_reduce_np
    samples, rollouts = sample_and_score(engine, test, args.eval_samples, [args.seed, 1],
                                         temperature=args.eval_temperature, top_p=args.eval_top_p,
                                         top_k=args.eval_top_k, max_tokens=args.max_response_len,
                                         rank=dist.get_rank(), world=dist.get_world_size(),
                                         think_format=args.think_format, tools=tools, reward=args.reward,
                                         reward_timeout=args.reward_timeout, progress=False)
    flat = [sample for problem in samples for sample in problem]  # (answer, correct, truncated)
    metrics = {"eval/accuracy": float(np.mean([correct for _, correct, _ in flat])),
               "eval/unparsed": float(np.mean([answer is None for answer, _, _ in flat])),
               "eval/truncated": float(np.mean([truncated for _, _, truncated in flat]))}
    if tools:
        used = all_reduce_np([sum(r.tool_calls > 0 for rs in rollouts.values() for r in rs)])[0]
        metrics["eval/tool_use"] = used / (len(test.keys) * args.eval_samples)
    if exact:
        metrics["eval/exact"] = float(exact(test, range(len(test.keys)), args.eval_temperature).mean())
    return metrics


# ---------------------------------------------------------------------------------------------- exact metric
def exact_template(flag, on_toy, top_p, top_k):
    """--eval_reference resolved: auto is the toy's only correct response on the toy's data (no tools), else
    off (None). With --eval_top_p or --eval_top_k the probability would not be the sampler's: one line."""
    from tasks.toy import ONLY_CORRECT
    template = {"auto": ONLY_CORRECT if on_toy else None, "off": None}.get(flag, flag)
    if template and (top_p < 1 or top_k > 0):
        from machinery.errors import fail
        fail(f"--eval_reference {flag}: the exact probability is of sampling at the temperature alone; pass "
             f"--eval_top_p 1 --eval_top_k -1 (now {top_p}, {top_k}) or --eval_reference off", once=True)
    return template


def exact_metric(policy, tokenizer, template, micro_batch_size, max_tokens):
    """None without a template, else `exact(data, indices, temperature)` -> (K,): the probability that the policy,
    sampling at `temperature`, answers each prompt with `template` ({answer}: its ground truth) and ends its turn,
    exp of the summed log-probs of the trainer's no-grad pass (step 4's). Where that response is the only one
    scored correct, the success probability without sampling noise; elsewhere a lower bound. Call on every rank."""
    if template is None:
        return None
    import torch.distributed as dist
    from machinery.collectives import all_gather_objects
    from machinery.trainer import old_logprobs

    def exact(data, indices, temperature):
        indices = list(indices)
        mine = indices[dist.get_rank()::dist.get_world_size()]  # each rank scores its share, then all gather
        responses = [tokenizer.encode(template.replace("{answer}", str(data.answers[i])), add_special_tokens=False)
                     + [tokenizer.eos_token_id] for i in mine]
        scored = old_logprobs(policy, [], [(data.prompt_ids[i], r, np.ones(len(r))) for i, r in zip(mine, responses)],
                              temperature, micro_batch_size, max_tokens)["revisited"]
        local = {i: float(np.exp(np.sum(lp, dtype=np.float64))) for i, lp in zip(mine, scored)}
        merged = {i: p for part in all_gather_objects([local]) for i, p in part.items()}
        return np.array([merged[i] for i in indices])
    return exact


# ---------------------------------------------------------------------------------------------- tracker probe
# Does the tracker track? Its v(x) is meant to be the current policy's success rate on x (Eq. 5 with rho
# forgetting what older policies did). The probe measures that rate directly on a fixed random subset of training
# prompts with fresh samples, so the gap between the two (and its noise floor) is visible over training.
def add_eval_flags(p):
    """spo.py's flags for its evaluations between steps (eval.py's own command does not use them): held-out accuracy
    and the tracker probe."""
    p.add_argument("--eval_every", type=int, default=25, help="held-out evaluation every N steps and at the end "
                   "(0: off)")
    p.add_argument("--eval_samples", type=int, default=2, help="samples per held-out prompt (avg@n's n)")
    p.add_argument("--eval_temperature", type=float, default=1.0, help="evaluation temperature")
    p.add_argument("--eval_top_p", type=float, default=1.0, help="evaluation top-p (paper: 0.95)")
    p.add_argument("--eval_top_k", type=int, default=-1, help="evaluation top-k (-1: off; paper: 20)")
    p.add_argument("--eval_max_prompts", type=int, default=500, help="held-out prompts used, the first N (0: all)")
    p.add_argument("--eval_reference", default="auto",
                   help="the only correct response, {answer} for the ground truth: evaluations and the probe also log "
                        "its exact probability (eval/exact, probe/*_exact); auto: the toy's \\boxed{{answer}} on the "
                        "toy, else off")
    p.add_argument("--probe_every", type=int, default=0,
                   help="tracker probe every N steps and at the end (0: off; spo only): v(x) of a fixed subset of "
                        "training prompts against the policy's success rate from fresh samples (probe.jsonl)")
    p.add_argument("--probe_prompts", type=int, default=64, help="training prompts the probe follows")
    p.add_argument("--probe_samples", type=int, default=16, help="fresh samples per probed prompt")


def probe_subset(n_prompts, k, seed):
    """(min(k, n),) sorted prompt indices the probe follows for the whole run: drawn from a generator of their
    own (seed, 3), so they depend only on the seed and the training set, and training's draws are untouched."""
    return np.sort(np.random.default_rng([seed, 3]).choice(n_prompts, size=min(k, n_prompts), replace=False))


def tracker_probe(engine, data, tracker, args, step, tools, exact=None):
    """--probe_every: for the fixed subset of training prompts, the tracker's v(x) as it stands now (after this
    step's tracker update: the baseline that x's next visit would use) against the success rate of the current
    policy (after this step's update: the one that would act at that visit), from --probe_samples fresh samples
    per prompt at the training temperature, scored with training's reward. Sampled on every rank (prompts
    rank, rank + world, ...), with request seeds from (seed, 2, step, prompt key): never training's or the held-out
    evaluation's. Rank 0 appends one line per probe to <run_dir>/probe.jsonl (a resumed run may repeat a step: the
    last line of a step wins). Returns probe_stats (the same on every rank); with `exact`, v(x) also against the
    exact success probability at the training temperature (probe/mae_exact, probe/bias_exact: no sampling noise)."""
    import torch.distributed as dist
    from reward import rewards
    from machinery.collectives import all_gather_objects
    rank, world, n = dist.get_rank(), dist.get_world_size(), args.probe_samples
    index = probe_subset(len(data.keys), args.probe_prompts, args.seed)  # (K,)
    value, n_eff = tracker.value_at(index), tracker.n_eff_at(index)  # (K,) read before any further update
    mine = index[rank::world]
    success = {}
    if len(mine):  # a rank with no probed prompt still joins the gather
        seeds = np.concatenate([request_seeds([args.seed, 2, step], data.keys[i], n) for i in mine])
        rollouts = engine.generate([data.prompt_ids[i] for i in mine for _ in range(n)], seeds,
                                   max_tokens=args.max_response_len, temperature=args.temperature, tools=tools)
        reward = rewards(rollouts, [data.answers[i] for i in mine for _ in range(n)], args.think_format,
                         args.truncated_reward, args.reward, args.reward_timeout).reshape(len(mine), n)
        success = {int(i): float(r.mean()) for i, r in zip(mine, reward)}
    merged = {i: s for part in all_gather_objects([success]) for i, s in part.items()}
    measured = np.array([merged[int(i)] for i in index])  # (K,)
    stats, exact_p = probe_stats(value, measured, n, n_eff), {}
    if exact:
        exact_p = {"exact": exact(data, index, args.temperature).tolist()}
        stats.update({"probe/mae_exact": float(np.mean(np.abs(value - exact_p["exact"]))),
                      "probe/bias_exact": float(np.mean(value - exact_p["exact"]))})
    if rank == 0:
        with open(os.path.join(args.run_dir, "probe.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "prompt": index.tolist(), "value": value.tolist(),
                                "success": measured.tolist(), **exact_p, "n_eff": n_eff.tolist(),
                                "visits": tracker.visits[index].tolist(), "n_samples": n, **stats}) + "\n")
    return stats


def write_samples(path, data, samples, rollouts, n, rank, world):
    """One JSONL line per sample, problems in data order. Each rank writes its shard, then rank 0 interleaves
    the shards (problem p is the (p // world)-th problem of rank p % world) without holding them in memory."""
    import torch.distributed as dist
    from machinery.run_dir import atomic_write
    with open(f"{path}.rank{rank}", "w") as f:
        for p, rs in rollouts.items():
            for i, r in enumerate(rs):
                answer, correct, _ = samples[p][i]
                f.write(json.dumps({"prompt_key": data.keys[p], "sample": i, "answer": answer, "correct": correct,
                                    "ground_truth": data.answers[p], "finish_reason": r.finish_reason,
                                    "response_tokens": len(r.response_ids), "response": r.text}) + "\n")
    dist.barrier()
    if rank == 0:
        shards = [open(f"{path}.rank{r}") for r in range(world)]
        with atomic_write(path) as out:
            for p in range(len(data.keys)):
                out.writelines(shards[p % world].readline() for _ in range(n))
        for r, shard in enumerate(shards):
            shard.close()
            os.remove(f"{path}.rank{r}")
    dist.barrier()


def parse_args(argv=None):
    import argparse
    p = argparse.ArgumentParser(description="Evaluate a model or an spo.py checkpoint: avg@n, pass@k, maj@n")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, help="HF model, or spo.py run / checkpoint dir (default: the toy)")
    g.add_argument("--data", nargs="+", default=None, help="benchmark files, parquet or JSONL (default: toy test)")
    g.add_argument("--toy_dir", default=None, help="the built-in toy's directory (default: the shipped tasks/built/toy, "
                                                   "toy_tools with --tools)")
    g.add_argument("--max_prompt_len", type=int, default=4096, help="longer prompts are left out (counted)")
    g = p.add_argument_group("sampling (defaults: the paper's evaluation)")
    # Not `--n`: torchrun's own parser rejects it as an ambiguous abbreviation of --nnodes / --nproc_per_node.
    g.add_argument("--n_samples", type=int, default=EVAL_DEFAULTS["n"], help="samples per problem (n of avg@n)")
    g.add_argument("--temperature", type=float, default=EVAL_DEFAULTS["temperature"], help="sampling temperature")
    g.add_argument("--top_p", type=float, default=EVAL_DEFAULTS["top_p"], help="nucleus sampling")
    g.add_argument("--top_k", type=int, default=EVAL_DEFAULTS["top_k"], help="top-k sampling (-1: off)")
    from reward import add_reward_flags, check_reward_flag
    from rollout import add_budget_flag, add_engine_flags, add_tool_flags, response_budget
    add_budget_flag(g)  # --max_response_len (alias --max_tokens), as spo.py's; the paper evaluates with 32768
    g.add_argument("--seed", type=int, default=0, help="per-request seeds derive from (seed, prompt key, sample)")
    add_reward_flags(g, truncation=False)  # --reward, --think_format: score as training does
    g = p.add_argument_group("output and engine")
    g.add_argument("--out_dir", default="eval_out", help="<benchmark>.samples.jsonl, summary.json, summary.md")
    g.add_argument("--n_boot", type=int, default=1000, help="bootstrap resamples for maj@n mean and std")
    add_engine_flags(g, gpu_share=0.9)  # --engine, --cpu_kv_cache_gib, --gpu_memory_utilization (an engine alone)
    add_tool_flags(p)
    args = p.parse_args(argv)
    args.max_response_len = response_budget(args.max_response_len, args.tools)
    if args.n_samples < 1 or args.max_response_len < 1:
        p.error("--n_samples and --max_response_len (--max_tokens) must be at least 1")
    from machinery.errors import check_finite, check_sampling
    check_finite(vars(args))
    check_sampling(args.temperature, args.top_p, args.top_k)
    check_reward_flag(args.reward, args.reward_timeout)
    return args


def main(argv=None):
    from machinery.data import check_context, find_model, load_dataset, load_tokenizer
    from hf_engine import start_engine
    from rollout import TOOL_INSTRUCTION, make_tools, start_program
    from tasks import toy
    args = parse_args(argv)
    rank, world, device, args.engine = start_program(args.engine, args.cpu_kv_cache_gib)  # as spo.py
    args.toy_dir, args.model, args.data, _ = toy.fill_in(args.toy_dir, args.tools, args.model, args.data, "test")
    args.data = [args.data] if isinstance(args.data, str) else args.data  # --data takes several files
    from machinery.collectives import all_gather_objects
    from machinery.errors import fail
    from machinery.run_dir import atomic_write, checkpoint_model, open_output
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
    # One eval.py per --out_dir at a time; an earlier evaluation there (of any model) moves to earlier_K/ rather than
    # being refused: experiments/paper.py reruns its stage into the same directory once training goes further.
    open_output(args.out_dir, "--out_dir", "eval.py", earlier=(".samples.jsonl", "summary.json", "summary.md"))
    tools = make_tools(args.tools, args.max_turns, args.sandbox_workers, args.sandbox_timeout, args.sandbox_memory_mb,
                       args.max_tool_output_chars, {**{path: "data" for path in args.data}, args.out_dir: "out_dir"})
    engine = start_engine(args.engine, source, seed=args.seed, max_model_len=longest, device=device,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          engine_compile=args.engine_compile)
    n = args.n_samples
    ks = sorted({2 ** i for i in range(n.bit_length())} | {n})  # pass@1, 2, 4, ... and pass@n
    summaries = {}
    for name, data in benchmarks.items():
        samples, rollouts = sample_and_score(engine, data, n, args.seed, temperature=args.temperature,
                                             top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_response_len,
                                             rank=rank, world=world, think_format=args.think_format, tools=tools,
                                             reward=args.reward, reward_timeout=args.reward_timeout)
        write_samples(os.path.join(args.out_dir, f"{name}.samples.jsonl"), data, samples, rollouts, n, rank, world)
        if rank == 0:
            summaries[name] = summarize(samples, ks=ks, n_boot=args.n_boot, seed=args.seed)
    if rank == 0:
        table = markdown_table(summaries)
        with atomic_write(os.path.join(args.out_dir, "summary.json")) as f:
            json.dump({"config": vars(args), "results": summaries}, f, indent=1)
        with atomic_write(os.path.join(args.out_dir, "summary.md")) as f:
            f.write(f"model `{args.model}`, n = {n}, temperature {args.temperature}, top_p {args.top_p}, "
                    f"top_k {args.top_k}, max_response_len {args.max_response_len}, reward {args.reward}\n\n{table}\n")
        print(table, flush=True)
    if tools:
        tools.pool.close()
    engine.shutdown()  # also tears down the process group


if __name__ == "__main__":
    main()
