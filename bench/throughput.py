"""Group-free throughput (paper section 4.4, Appendix B, Fig. 5): SPO can train on the first B trajectories to
finish and leave the long tail behind; a group (GRPO) is usable only when its slowest member is done.

Three measurements, printed by `python -m bench throughput`: the time-to-batch ratio simulated over 10,000 draws
(where the paper shows one); the real time to a batch on the tool toy with tool latency injected from the same
distribution; and the accuracy cost of over-sampling in short training runs with that latency.

    .venv/bin/python -m bench throughput                     # all three (about 15 minutes on 2 cores)
    .venv/bin/python -m bench throughput --throughput_steps 0  # without the training runs
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from machinery.data import load_dataset, load_tokenizer
from sandbox import SandboxPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: programs run from there
PAPER_GROUP_S = (74, 87, 90, 114, 117, 409, 444, 508)  # the one group of 8 the paper's Fig. 5 shows (s)


def _trajectory_times(rng, shape, straggler_share, fast=(95.0, 0.19), slow=(451.0, 0.11)):
    """Seconds per trajectory: a two-part lognormal mixture fitted to PAPER_GROUP_S (fast, slow: median and sd of
    log), stragglers 3/8 there. The paper publishes no distribution; this is the assumption, its share varied."""
    straggler = rng.random(shape) < straggler_share
    return np.where(straggler, rng.lognormal(np.log(slow[0]), slow[1], shape),
                    rng.lognormal(np.log(fast[0]), fast[1], shape))


def time_to_batch(times, keep, group_size):
    """(S,) seconds until `keep` usable trajectories exist, for times (S, N) of N trajectories started at once.
    group_size 1 (SPO): the keep-th fastest trajectory. G > 1: trajectories n*G..n*G+G-1 form a group, usable
    when its slowest member is done; the (keep / G)-th fastest group."""
    done = times if group_size == 1 else times.reshape(len(times), -1, group_size).max(-1)  # (S, N / G)
    return np.sort(done, axis=1)[:, keep // group_size - 1]


def bench_throughput_simulation(seeds=10_000, keep=24, group_size=8):
    """The paper's Fig. 5 (group-free SPO keeps the first `keep` of f x keep single trajectories; GRPO keeps the
    first keep/G complete groups of f x keep/G), over `seeds` draws: the time ratio's mean and 95% interval, by
    straggler share and over-sampling factor f. The paper's single draw: f = 2, 486 s vs 112 s (4.35x)."""
    rng = np.random.default_rng(0)
    print(f"Fig. 5 as a simulation: {keep} trajectories kept, G = {group_size}; the ratio GRPO time / SPO time over "
          f"{seeds} draws (mean [2.5%, 97.5%]); trajectory times: the mixture fitted to the published group")
    shares, sizes = (0.05, 0.125, 0.25, 0.375, 0.5), [keep * f for f in (1, 4 / 3, 5 / 3, 2, 3)]
    sizes = [int(n) // group_size * group_size for n in sizes]  # whole groups for GRPO, the same count for SPO
    print(f"{'straggler share':>16} " + " ".join(f"{f'f = {n}/{keep}':>22}" for n in sizes))
    results = {}
    for share in shares:
        cells = []
        for n in sizes:
            f = n / keep
            times = _trajectory_times(rng, (seeds, n), share)
            ratio = time_to_batch(times, keep, group_size) / time_to_batch(times, keep, 1)
            results[share, f] = ratio
            cells.append(f"{ratio.mean():5.2f} [{np.percentile(ratio, 2.5):4.2f}, {np.percentile(ratio, 97.5):5.2f}]")
        print(f"{share:>16.3f} " + " ".join(f"{c:>22}" for c in cells))
    paper = results[3 / 8, 2.0]
    times = _trajectory_times(rng, (seeds, 2 * keep), 3 / 8)
    grpo, spo = (np.median(time_to_batch(times, keep, g)) for g in (group_size, 1))
    print(f"at the published group's share (3/8) and f = 2: GRPO {grpo:.0f} s vs SPO {spo:.0f} s (medians), ratio "
          f"{paper.mean():.2f} "
          f"[{np.percentile(paper, 2.5):.2f}, {np.percentile(paper, 97.5):.2f}]; paper, one draw: 486 s vs 112 s, "
          f"4.35x", flush=True)
    return results


class _SlowTools:
    """A SandboxPool whose every snippet first sleeps for a drawn time: heavy-tailed tool latency, injected by the
    benchmark only (a prefix of the snippet, so the sandbox itself runs it). Times: the Fig. 5 mixture in seconds
    of a hundredth of the paper's (fast median 0.95 s, stragglers 4.5 s, 3/8 of calls)."""

    def __init__(self, pool, seed, share=3 / 8, scale=0.01):
        self.pool, self.rng, self.share, self.scale = pool, np.random.default_rng(seed), share, scale

    def slowed(self, code):
        delay = min(float(_trajectory_times(self.rng, (), self.share)) * self.scale, 20.0)  # under the timeout
        return f"import time; time.sleep({delay:.3f})\n{code}"

    def submit(self, code):
        return self.pool.submit(self.slowed(code))


def bench_throughput_real(toy_dir=None, batch=64, group_size=8, f=2, repeats=10, max_tokens=160):
    """Time to a batch of `batch` on the tool toy with _SlowTools, same engine, one after another per repeat:
    SPO over-sampled (f x batch single trajectories, keep the first batch), GRPO over-sampled (keep the first
    batch / G complete groups of f x batch / G), and both without over-sampling."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from tasks import toy
    from machinery import trainer
    from machinery.console import quiet_vllm
    from rollout import Engine, Tools
    quiet_vllm()
    _, _, device = trainer.setup_distributed()
    model, train, _ = toy.ensure_toy(toy_dir, tools=True)
    data = load_dataset(train, load_tokenizer(model), 64, False)
    engine = Engine(model, seed=0, max_model_len=64 + max_tokens, device=device)
    ways = {f"SPO f={f}": (1, f), f"GRPO f={f}": (group_size, f), "SPO f=1": (1, 1), "GRPO f=1": (group_size, 1)}
    times, kept_calls = {name: [] for name in ways}, {name: [] for name in ways}
    print(f"time to a batch of {batch} on the tool toy, tool latency injected (fast 0.95 s, stragglers 4.5 s, 3/8 of "
          f"calls), {repeats} repeats:", flush=True)
    engine.generate(data.prompt_ids[:16], np.arange(16), max_tokens=max_tokens)  # warm-up, not timed
    for r in range(repeats):
        for w, (name, (g, factor)) in enumerate(ways.items()):
            n = factor * batch
            rng = np.random.default_rng([r, w])
            prompts = np.repeat(rng.choice(len(data.keys), n // g, replace=False), g)
            seeds = np.random.SeedSequence([r, w]).generate_state(n)
            with SandboxPool(workers=n) as pool:  # a worker per trajectory: latency, not a queue, sets the pace
                t0 = time.perf_counter()
                rollouts = engine.generate([data.prompt_ids[i] for i in prompts], seeds, max_tokens=max_tokens,
                                           tools=Tools(_SlowTools(pool, seed=[r, w])), group_size=g,
                                           keep_first=batch if factor > 1 else None)
                times[name].append(time.perf_counter() - t0)
            kept_calls[name] += [x.tool_calls for x in rollouts if x is not None]
        print(f"  repeat {r + 1}: " + ", ".join(f"{name} {t[-1]:.2f} s" for name, t in times.items()), flush=True)
    med = {name: float(np.median(t)) for name, t in times.items()}
    for name, t in times.items():
        print(f"  {name:10s} median {med[name]:5.2f} s  [{min(t):.2f}, {max(t):.2f}]  tool calls per kept "
              f"trajectory {np.mean(kept_calls[name]):.2f}", flush=True)
    spo = np.array(times[f"SPO f={f}"])
    for other in (f"GRPO f={f}", "GRPO f=1"):
        ratio = np.array(times[other]) / spo
        print(f"  {other} / SPO f={f}: median {np.median(ratio):.2f}x [{ratio.min():.2f}, {ratio.max():.2f}] over "
              f"{repeats} repeats (paper, simulated: 4.35x)", flush=True)
    engine.shutdown()
    return times


def bench_throughput_training(steps=40, nproc=2, f=2, workers=64):
    """The accuracy cost: short tool-toy runs of spo.py with the same injected latency (_slow_tools_training),
    SPO without and with over-sampling and GRPO over-sampled; held-out accuracy at the end and wall time."""
    ways = {"SPO f=1": [], f"SPO f={f}": ["--oversample", str(f)],
            f"GRPO f={f}": ["--algo", "grpo", "--oversample", str(f)]}
    print(f"{steps}-step tool-toy runs with the injected latency ({nproc} ranks, {workers} sandbox workers per rank, "
          f"seed 0, held-out accuracy on 200 prompts x 2 samples at step {steps}):", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in ways.items():
            run = os.path.join(tmp, name.replace(" ", "").replace("=", ""))
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "-m",
                   "bench.throughput", "_slow_tools_training", "--tools", "--steps", str(steps), "--eval_every",
                   str(steps), "--save_every", "0", "--sandbox_workers", str(workers), "--eval_max_prompts", "200",
                   "--run_dir", run, *flags]
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
            subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
            metrics = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
            train = [m for m in metrics if "time/step" in m]
            row = {"accuracy": metrics[-1]["eval/accuracy"],
                   "step_s": float(np.median([m["time/step"] for m in train])),
                   "generate_s": float(np.median([m["time/generate"] for m in train])),
                   "train_s": float(sum(m["time/step"] for m in train)),
                   "never_trained": train[-1].get("oversample/never_trained_share", 0.0),
                   "kept_length": float(np.mean([m.get("oversample/kept_length_mean", m["response/length_mean"])
                                                 for m in train]))}
            rows[name] = row
            print(f"  {name:10s} held-out {row['accuracy']:.3f} (step 0: {metrics[0]['eval/accuracy']:.3f})  step "
                  f"{row['step_s']:.2f} s (generate {row['generate_s']:.2f} s, median)  {steps} steps "
                  f"{row['train_s']:.0f} s  kept length {row['kept_length']:.1f}  prompts drawn but never trained "
                  f"on {row['never_trained']:.1%}", flush=True)
    return rows


def main(train_steps):
    """Fig. 5 simulated, then for real on this machine (the engine in its own process), then the accuracy cost."""
    bench_throughput_simulation()
    subprocess.run([sys.executable, "-m", "bench.throughput", "_throughput_real"], check=True, cwd=ROOT)
    if train_steps:
        bench_throughput_training(train_steps)


def _slow_tools_training(argv):
    """torchrun worker: spo.py with every tool run slowed as in _SlowTools (a different latency stream per rank)."""
    import sandbox
    import spo
    slow, submit = _SlowTools(None, seed=[int(os.environ.get("RANK", 0)), 99]), sandbox.SandboxPool.submit
    sandbox.SandboxPool.submit = lambda pool, code: submit(pool, slow.slowed(code))
    spo.main(argv)


if __name__ == "__main__":  # the worker processes of main(); run the benchmark through `python -m bench throughput`
    if sys.argv[1:2] == ["_slow_tools_training"]:  # under torchrun
        _slow_tools_training(sys.argv[2:])
    elif sys.argv[1:2] == ["_throughput_real"]:
        bench_throughput_real()
    else:
        sys.exit("run `python -m bench throughput` (this file holds its parts)")
