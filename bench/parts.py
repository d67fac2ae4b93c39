"""The benchmarks of the project's parts (`python -m bench [NAME ...]`), each measured side by side in one run and
printed as ratios; each function's docstring says what it measures.
"""
import argparse
import functools
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.peer import spo_metrics
from sampler import PromptSampler, priority_weights
from sandbox import SandboxPool, isolation, run_code
from tracker import ValueTracker


def _spo_step(tracker, sampler, rng, batch_size):
    index = sampler.draw(batch_size)  # (B,) Eq. 11
    baseline = tracker.value_at(index)  # (B,) v_{-1}, before the update (Eq. 8)
    reward = rng.integers(0, 2, batch_size).astype(np.float64)
    reward - baseline  # the advantage, as the trainer computes it
    tracker.update(index, reward, tracker.rho(rng.random(batch_size) * 0.1))  # Eq. 5
    sampler.set_weights(priority_weights(tracker.value_at(index), tracker.n_eff_at(index)), index)


def _dict_step(alpha, beta, rng, legacy, batch_size, eps=0.05, d_half=0.06):
    # Every step recomputes every prompt's weight (prompts are int keys here; the authors key by text,
    # which would be slower still).
    weights = {p: math.sqrt(a / (a + beta[p]) * (1 - a / (a + beta[p]))) + eps for p, a in alpha.items()}
    prompts = list(weights)
    w = np.fromiter(weights.values(), dtype=np.float64, count=len(prompts))
    chosen = legacy.choice(len(prompts), batch_size, replace=False, p=w / w.sum())
    batch = [prompts[i] for i in chosen]
    baseline = [alpha[p] / (alpha[p] + beta[p]) for p in batch]
    reward = rng.integers(0, 2, batch_size).astype(np.float64)
    reward - np.array(baseline)  # the advantage
    for p, r, d in zip(batch, reward, rng.random(batch_size) * 0.1):
        rho = min(max(2.0 ** (-d / d_half), 0.875), 0.96)
        alpha[p] = rho * alpha[p] + r
        beta[p] = rho * beta[p] + (1 - r)


def _median_ms(step, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def bench_tracker_sampler(sizes=(14_000, 10**6, 10**7), batch_size=1024, repeats=21, dict_max_size=10**7):
    """Median ms of SPO's bookkeeping step (Eq. 5, 8, 11: draw B prompts, read values, absorb rewards, refresh the
    changed weights), vectorised tracker + sampler against the dict version (per-prompt dicts, every weight
    recomputed, numpy choice without replacement)."""
    rows = []
    for n in sizes:
        rng = np.random.default_rng(0)
        v0 = rng.integers(0, 9, n)  # offline successes out of 8, like Algorithm 2
        row = {"n_prompts": n}
        tracker, sampler = ValueTracker(n), PromptSampler(n, seed=0)
        tracker.init_from_scores(np.arange(n), v0, np.full(n, 8))
        start = time.perf_counter()
        sampler.set_weights(priority_weights(tracker.value, tracker.n_eff))
        row["full_weights_ms"] = 1e3 * (time.perf_counter() - start)
        _spo_step(tracker, sampler, rng, batch_size)  # warm-up
        row["ours_ms"] = _median_ms(functools.partial(_spo_step, tracker, sampler, rng, batch_size), repeats)
        del tracker, sampler
        if n <= dict_max_size:
            n0 = 8.0
            alpha = {p: n0 * (s + 0.5) / 9 for p, s in enumerate(v0.tolist())}
            beta = {p: n0 - a for p, a in alpha.items()}
            legacy = np.random.RandomState(0)
            dict_reps = 1 if n >= 5 * 10**6 else 3 if n >= 5 * 10**5 else repeats
            row["dict_ms"] = _median_ms(lambda: _dict_step(alpha, beta, rng, legacy, batch_size), dict_reps)
            row["dict_reps"] = dict_reps
            del alpha, beta
        rows.append(row)

    print(f"SPO bookkeeping step, B = {batch_size} (median ms per step)")
    print(f"{'prompts':>10} {'ours':>8} {'dict':>10} {'dict/ours':>10} {'full weights':>13}")
    for row in rows:
        dict_ms = row.get("dict_ms", float("nan"))
        print(f"{row['n_prompts']:>10,} {row['ours_ms']:>8.2f} {dict_ms:>10.1f} "
              f"{dict_ms / row['ours_ms']:>9.1f}x {row['full_weights_ms']:>12.1f}")
    return rows


def bench_sandbox(n_runs: int = 200, worker_counts=(1, 2, 8), code: str = "print(1+1)"):
    """Runs per second and p50/p99 latency of one run (spawn to reaped) for a trivial snippet."""
    print(f"sandbox: {isolation()}, {n_runs} runs of {code!r} per row")
    assert run_code(code).stdout == "2\n"  # warm up: probe done, interpreter files in the page cache
    latency_ms = []
    for _ in range(n_runs // 4):  # reference: a bare `python -I -c` subprocess, no isolation at all
        start = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, check=True)
        latency_ms.append(1000 * (time.perf_counter() - start))
    print(f"bare subprocess, 1 at a time:  p50 {np.percentile(latency_ms, 50):6.1f} ms"
          f"   p99 {np.percentile(latency_ms, 99):6.1f} ms")
    for workers in worker_counts:
        with SandboxPool(workers=workers) as pool:
            start = time.perf_counter()
            results = pool.map([code] * n_runs)
            elapsed = time.perf_counter() - start
        assert all(r.exit_code == 0 and r.stdout == "2\n" for r in results)
        latency_ms = 1000 * np.array([r.duration_s for r in results])
        p50, p99 = np.percentile(latency_ms, [50, 99])
        print(f"workers={workers}: {n_runs / elapsed:6.1f} runs/s   latency p50 {p50:6.1f} ms   p99 {p99:6.1f} ms")


def bench_steps(steps=40, warmup=5, nproc=2):
    """Mean seconds per phase of spo.py's default toy run, 64 responses a step, spo against grpo, after `warmup`."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = {algo: spo_metrics(os.path.join(tmp, algo), nproc, "--algo", algo, "--steps", str(steps))[warmup:]
                for algo in ("spo", "grpo")}
    rows = {algo: {k: float(np.mean([m[k] for m in ms])) for k in ms[0] if k.startswith("time/")}
            for algo, ms in runs.items()}
    phases = [k for k in rows["spo"] if k != "time/step"] + ["time/step"]
    print(f"spo.py step time, 64 responses per step, {nproc} rank(s), mean of steps {warmup + 1}-{steps} (s)")
    print(f"{'phase':>18} {'spo':>8} {'grpo':>8} {'spo/grpo':>9}")
    for k in phases:
        print(f"{k[5:]:>18} {rows['spo'][k]:>8.3f} {rows['grpo'][k]:>8.3f} {rows['spo'][k] / rows['grpo'][k]:>8.2f}x")
    return rows


def main(argv=None):
    """`python -m bench [NAME ...]`: the benchmarks named (default: all), each printed as it ends."""
    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description="spo benchmarks (also: bench peer, throughput, gpu --help)")
    parser.add_argument("which", nargs="*", choices=list(BENCHMARKS), default=list(BENCHMARKS),
                        help="which benchmarks: " + ", ".join(BENCHMARKS))
    parser.add_argument("--sizes", type=int, nargs="+", default=[14_000, 10**6, 10**7], help="tracker: prompts")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2],
                        help="steps: spo.py's ranks (torchrun --nproc_per_node), each measured")
    args = parser.parse_args(argv)
    for name in args.which:
        print(f"\n== {name}", flush=True)
        {"tracker": lambda: bench_tracker_sampler(args.sizes),
         "steps": lambda: [bench_steps(nproc=n) for n in args.ranks], "sandbox": bench_sandbox}[name]()


BENCHMARKS = ("tracker", "steps", "sandbox")
