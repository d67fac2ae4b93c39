"""A preregistered sweep's analysis on the toy: the primary metric of each run, paired differences with intervals
over seeds, the power of the comparison, and the seeds a power calculation asks for.

Primary metric: the exact success probability on the held-out set (eval/exact: no sampling noise) averaged over an
equal budget of generated samples, i.e. the area under its curve against generated samples divided by the budget.
The offline values' generations (n0 per pool prompt, SPO variants with --offline_values) count: such a run's curve
starts at that many samples, spent at the base model's value (step 0's). The curve is linear between evaluations
(trapezoids) and read up to the budget, the smallest total any run reached. Secondary: eval/exact at the run's
last evaluation. Power (two-sided paired t-test at 5%): the smallest true difference detected with 80% power by n
seeds, (t_{0.975, n-1} + t_{0.80, n-1}) sd / sqrt(n), sd the paired differences' standard deviation.

    python -m experiments.primary experiments/calibrated --reference grpo
    python -m experiments.primary experiments/calibrated --reference grpo --power_sd 0.004   # seeds for 1 point
"""
import argparse
import json
import os

import numpy as np

from experiments.plots import finished_run_dir, mean_ci, read_run, t975
from experiments.sweep import read_sweep

# One-sided 80% quantiles t_{0.80, df} of Student's t, df = 1..30 (standard tables), then the normal's 0.8416.
T80 = [1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873, 0.870, 0.868, 0.866,
       0.865, 0.863, 0.862, 0.861, 0.860, 0.859, 0.858, 0.858, 0.857, 0.856, 0.856, 0.855, 0.855, 0.854, 0.854]


def t80(df):
    return T80[int(df) - 1] if df <= 30 else 0.8416


def detectable(sd, n):
    """The smallest true paired difference that n seeds detect with 80% power (two-sided 5% t-test), for a paired
    standard deviation sd: (t_{0.975, n-1} + t_{0.80, n-1}) sd / sqrt(n). NaN below 2 seeds."""
    return (t975(n - 1) + t80(n - 1)) * sd / np.sqrt(n) if n >= 2 else float("nan")


def seeds_for(effect, sd, most=30):
    """The fewest seeds (at least 2) whose detectable() difference is at most `effect`; None if more than `most`."""
    return next((n for n in range(2, most + 1) if detectable(sd, n) <= effect), None)


def offline_samples(config, pool):
    """Generations spent on the offline values before step 1: n0 per pool prompt for SPO with --offline_values."""
    return config.get("n0", 0) * pool if config.get("algo") == "spo" and config.get("offline_values") != "none" else 0


def exact_curve(run, pool):
    """[(generated samples, eval/exact)] at the run's evaluations, the offline values' samples counted first."""
    generated, curve = float(offline_samples(run["config"], pool)), []
    for step in sorted(run["rows"]):
        row = run["rows"][step]
        generated += row.get("sampling/generated", 0.0) if step > 0 else 0.0
        if "eval/exact" in row:
            curve.append((generated if step > 0 else 0.0, row["eval/exact"]))
    if curve and curve[0][0] == 0.0 and len(curve) > 1 and offline_samples(run["config"], pool):
        curve.insert(1, (float(offline_samples(run["config"], pool)), curve[0][1]))  # the budget v0 spent: flat
    return curve


def area_mean(curve, budget):
    """The mean of a piecewise-linear curve [(x, y)] over x in [0, budget] (the curve must reach the budget)."""
    x, y = map(np.asarray, zip(*curve))
    if x[-1] < budget - 1e-9:
        raise ValueError(f"the curve ends at {x[-1]:.0f} samples, before the budget {budget:.0f}")
    grid = np.append(x[x < budget], budget)
    values = np.interp(grid, x, y)
    return float(np.sum((grid[1:] - grid[:-1]) * (values[1:] + values[:-1]) / 2) / budget)


def analyse(out, reference, budget=None):
    """{"budget", "variants": {name: {"primary": {seed: v}, "final": {seed: v}}}, "paired": {name: {...}}}."""
    from experiments.calibration import pool_size
    sweep = read_sweep(out)
    runs, zero = {}, {}
    for e in sweep["runs"].values():
        if e.get("status") == "finished":
            run = read_run(finished_run_dir(out, e["name"]))
            runs[(e["variant"], e["seed"])] = exact_curve(run, pool_size(run["config"]))
            shares = [r["signal/zero_advantage"] for r in run["rows"].values() if "signal/zero_advantage" in r]
            zero[(e["variant"], e["seed"])] = float(np.mean(shares)) if shares else float("nan")
    if not runs:
        raise SystemExit(f"error: {out}: no finished run with eval/exact")
    budget = budget or min(curve[-1][0] for curve in runs.values())
    variants = {}
    for (variant, seed), curve in sorted(runs.items()):
        v = variants.setdefault(variant, {"primary": {}, "final": {}, "zero_advantage": {}})
        v["primary"][seed], v["final"][seed] = area_mean(curve, budget), curve[-1][1]
        v["zero_advantage"][seed] = zero[(variant, seed)]  # Fig. 3a: training samples with no signal
    paired = {}
    for name, v in variants.items():
        if name == reference or reference not in variants:
            continue
        paired[name] = {}
        for metric in ("primary", "final"):
            ref = variants[reference][metric]
            diffs = [v[metric][s] - ref[s] for s in sorted(set(v[metric]) & set(ref))]
            mean, low, high, n = mean_ci(diffs)
            sd = float(np.std(diffs, ddof=1)) if n > 1 else float("nan")
            paired[name][metric] = {"mean": mean, "ci95": [low, high], "n": n, "sd": sd,
                                    "detectable": detectable(sd, n)}
    return {"budget": budget, "reference": reference, "variants": variants, "paired": paired}


def markdown(result):
    pts = lambda x: f"{100 * x:+.2f}" if np.isfinite(x) else "-"  # noqa: E731
    lines = [f"Primary metric: held-out exact success averaged over {result['budget']:.0f} generated samples "
             f"(offline values counted); secondary: exact success at the last evaluation. Mean [95% t-interval] "
             f"over seeds, %; paired difference to `{result['reference']}` in points, its sd and the smallest "
             f"difference its seeds detect with 80% power; zero-advantage: the share of training samples with no "
             f"signal (Fig. 3a), mean over steps and seeds.\n",
             "| variant | seeds | primary | final | primary - ref | sd | detectable | final - ref | detectable | "
             "zero-advantage |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, v in result["variants"].items():
        cells = []
        for metric in ("primary", "final"):
            mean, low, high, n = mean_ci(v[metric].values())
            cells.append(f"{100 * mean:.2f}" + (f" [{100 * low:.2f}, {100 * high:.2f}]" if n > 1 else ""))
        d = result["paired"].get(name)
        diff = ["", "", "", "", ""] if d is None else [
            f"{pts(d['primary']['mean'])} [{pts(d['primary']['ci95'][0])}, {pts(d['primary']['ci95'][1])}]",
            f"{100 * d['primary']['sd']:.2f}", f"{100 * d['primary']['detectable']:.2f}",
            f"{pts(d['final']['mean'])} [{pts(d['final']['ci95'][0])}, {pts(d['final']['ci95'][1])}]",
            f"{100 * d['final']['detectable']:.2f}"]
        zero_share = f"{100 * np.mean(list(v['zero_advantage'].values())):.1f}%"
        lines.append(f"| {name} | {len(v['primary'])} | " + " | ".join(cells + diff + [zero_share]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="a sweep's directory (experiments/sweep.py --out): its runs or records")
    p.add_argument("--reference", default="spo", help="the variant paired differences are taken against")
    p.add_argument("--budget", type=float, default=None, help="generated samples to average over (default: the "
                   "smallest total of any run)")
    p.add_argument("--power_sd", type=float, default=None, help="instead: the seeds that detect --effect with 80%% "
                   "power for this paired sd (a fraction, e.g. 0.004 = 0.4 points)")
    p.add_argument("--effect", type=float, default=0.01, help="with --power_sd: the effect to detect (0.01: 1 point)")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    if args.power_sd is not None:
        n = seeds_for(args.effect, args.power_sd)
        print(f"paired sd {100 * args.power_sd:.2f} points: {n or 'more than 30'} seeds detect "
              f"{100 * args.effect:.1f} points with 80% power" + (f" (detectable with {n}: "
              f"{100 * detectable(args.power_sd, n):.2f})" if n else ""))
        return
    if not os.path.isdir(args.out):
        raise SystemExit(f"error: {args.out}: not a sweep directory")
    result = analyse(args.out, args.reference, args.budget)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
