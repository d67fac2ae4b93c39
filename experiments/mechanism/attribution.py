"""Where SPO's lead over GRPO comes from (PLAN.md beside this file): the paired comparisons of the mechanism sweep,
with the earlier tracker_keeps_up sweep's spo and no_baseline records beside them (older code: marked).

    python -m experiments.mechanism.attribution            # prints the markdown tables of attribution.md
"""
import os

import numpy as np

from experiments.analysis import finished_run_dir, mean_ci, paired_difference, read_run

HERE = os.path.dirname(os.path.abspath(__file__))
EARLIER = os.path.join(os.path.dirname(HERE), "paper_regime")
SEEDS = range(5)
# (variant, against, what the difference isolates); "*" marks runs of the earlier sweep (older code)
COMPARISONS = [("rpp_g8", "grpo", "group z-score -> batch whitening, at 8 x 8"),
               ("rpp_g1", "rpp_g8", "8 x 8 -> 64 x 1, batch whitening"),
               ("spo*", "rpp_g1", "SPO's tracker baseline, sampler and offline values (cross-code)"),
               ("no_baseline*", "rpp_g1", "SPO's sampler and offline values alone (cross-code)"),
               ("spo*", "grpo", "the whole gap, today's grpo against the earlier spo (cross-code)"),
               ("spo*", "grpo*", "the whole gap in the earlier sweep")]


def load(variant, seed):
    folder = EARLIER if variant.endswith("*") else HERE
    run = read_run(finished_run_dir(folder, f"{variant.rstrip('*')}-s{seed}"))
    return run if 600 in run["rows"] else None  # finished runs only


def at(run, key, step=600):
    row = run["rows"].get(step, {}) if run else {}
    return row.get(key, float("nan"))


def mean_of(run, key, first=0):
    """The mean of `key` over the run's rows from step `first` on. For eval/* (logged at steps 0, 50, ..., 600, with
    equal generated samples between them) it is the area under the curve against samples, over the run's samples."""
    if not run:
        return float("nan")
    values = [row[key] for step, row in run["rows"].items() if step >= first and key in row]
    return float(np.mean(values)) if values else float("nan")


def fmt(ci, scale=100.0):
    mean, low, high, n = ci
    return f"{scale * mean:+.1f} [{scale * low:+.1f}, {scale * high:+.1f}] (n {n})"


def main():
    variants = sorted({v for c in COMPARISONS for v in c[:2]})
    runs = {v: {s: load(v, s) for s in SEEDS} for v in variants}
    metrics = {"held-out avg@2, step 600": lambda r: at(r, "eval/accuracy"),
               "exact, step 600": lambda r: at(r, "eval/exact"),
               "exact, mean over evaluations": lambda r: mean_of(r, "eval/exact"),
               "avg@2, mean over evaluations": lambda r: mean_of(r, "eval/accuracy")}
    print("| variant | seeds | " + " | ".join(metrics) + " | zero-advantage share | all-agree share |")
    print("| --- | --- |" + " --- |" * (len(metrics) + 2))
    for v in variants:
        have = [s for s in SEEDS if runs[v][s]]
        cells = []
        for fn in metrics.values():
            mean, low, high, n = mean_ci([fn(runs[v][s]) for s in have])
            cells.append(f"{100 * mean:.1f} [{100 * low:.1f}, {100 * high:.1f}]" if n > 1 else
                         (f"{100 * mean:.1f}" if n else ""))
        zero = mean_ci([mean_of(runs[v][s], "signal/zero_advantage", 1) for s in have])[0]
        agree = mean_ci([mean_of(runs[v][s], "zero_signal/degenerate_groups", 1) for s in have])[0]
        print(f"| {v} | {','.join(map(str, have))} | " + " | ".join(cells) +
              f" | {100 * zero:.1f}% | " + (f"{100 * agree:.1f}% |" if np.isfinite(agree) else "|"))
    print("\n| difference | isolates | " + " | ".join(metrics) + " | paired sd, step 600 (points) |")
    print("| --- | --- |" + " --- |" * (len(metrics) + 1))
    for a, b, what in COMPARISONS:
        cells = []
        for fn in metrics.values():
            values = {s: fn(runs[a][s]) for s in SEEDS if runs[a][s]}
            reference = {s: fn(runs[b][s]) for s in SEEDS if runs[b][s]}
            cells.append(fmt(paired_difference(values, reference)) if paired_difference(values, reference)[3]
                         else "")
        first = metrics["held-out avg@2, step 600"]
        d = [first(runs[a][s]) - first(runs[b][s]) for s in SEEDS if runs[a][s] and runs[b][s]]
        sd = f"{100 * np.std(d, ddof=1):.2f}" if len(d) > 1 else ""
        print(f"| {a} - {b} | {what} | " + " | ".join(cells) + f" | {sd} |")


if __name__ == "__main__":
    main()
