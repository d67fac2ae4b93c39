"""Can the tracker keep up? The two quantities that decide it, measured from a run's tracker probe.

SPO's tracker averages a prompt's last few rewards: with forgetting factor rho it remembers about 1 / (1 - rho)
visits (8 at rho_min = 0.875, 25 at rho_max = 0.96). If the policy's success probability p(x) moves by delta
between two visits of x, an exponential average lags a steady drift: the tracker's bias is about
-delta * rho / (1 - rho). So what matters is not how fast the policy learns per step but per visit of a prompt:
    revisits per prompt over the run        (batch size x steps / prompts, uneven under prioritised sampling)
    change of p(x) between two visits       (delta; against the memory 1 / (1 - rho))
This reads both from a run made with --probe_every (spo.py): the probe follows a fixed subset of training
prompts and records, at each probe step, the tracker's v(x), N_eff(x), visit count and the success rate measured
from fresh samples (probes.py:tracker_probe), and on the toy the exact success probability (probes.py:exact_metric),
which then replaces the sampled rate in delta (no sampling noise). Per interval between two probes:
    delta     = mean over probed prompts of (success change) / mean (visits in between)   (signed drift per visit)
    memory    = 1 / (1 - rho), rho the mean forgetting factor over the interval's steps (metrics.jsonl)
    lag       = -delta * rho / (1 - rho)                                    (the bias a steady drift predicts)
and per probe the tracker's bias and MAE against the MAE an unbiased tracker with N_eff samples would show beside
the probe's own sampling noise (probe/mae_unbiased, machinery/metrics.py:probe_stats). The bounds it checks (docs/experiments.md):
|bias| <= 0.05 at every probe, and MAE <= 1.5 x probe/mae_unbiased.

    python -m experiments.regime RUN_DIR [RUN_DIR ...]
    python -m experiments.regime --brief experiments/paper_regime/records/spo-s*   # one row per run, then the misses
"""
import argparse
import os

import numpy as np

from experiments.plots import read_run

BIAS_BOUND, MAE_RATIO_BOUND = 0.05, 1.5


def regime(run_dir):
    """{"probes": [per-probe dict], "intervals": [per-interval dict], "visits_per_prompt": mean visits over all
    prompts at the end, "held_out": ((step, accuracy) first, last), "passes": both bounds at every probe}."""
    run = read_run(run_dir)  # {step: row}: for a step logged twice (a resumed run) the last row wins
    probes = [run["probe"][s] for s in sorted(run["probe"]) if "visits" in run["probe"][s]]
    metrics = [run["rows"][s] for s in sorted(run["rows"])]
    rho_at = {m["step"]: m["tracker/rho_mean"] for m in metrics if "tracker/rho_mean" in m}
    p_key = "exact" if probes and all("exact" in p for p in probes) else "success"  # exact: no sampling noise
    rows = []
    for p in probes:
        ratio = p["probe/mae"] / p["probe/mae_unbiased"] if p.get("probe/mae_unbiased") else float("nan")
        rows.append({"step": p["step"], "bias": p["probe/bias"], "mae": p["probe/mae"],
                     "mae_unbiased": p.get("probe/mae_unbiased", float("nan")), "mae_ratio": ratio,
                     "success": float(np.mean(p["success"])), "value": float(np.mean(p["value"])),
                     "n_eff": float(np.mean(p["n_eff"])), "visits": float(np.mean(p["visits"])),
                     "bias_exact": p.get("probe/bias_exact", float("nan"))})
    intervals = []
    whole = [(probes[0], probes[-1])] if len(probes) > 2 else []
    for a, b in list(zip(probes, probes[1:])) + whole:
        visits = np.mean(np.subtract(b["visits"], a["visits"]))
        rho = np.mean([rho_at[s] for s in range(a["step"] + 1, b["step"] + 1) if s in rho_at] or [np.nan])
        delta = np.mean(np.subtract(b[p_key], a[p_key])) / visits if visits > 0 else np.nan
        # rho = 1 (--rho none) forgets nothing: an unbounded memory, and a lag that grows with the run (inf)
        memory = 1 / (1 - rho) if rho < 1 else np.inf
        intervals.append({"steps": f"{a['step']}-{b['step']}" + (" (whole run)" if [(a, b)] == whole else ""),
                          "visits": float(visits), "delta": float(delta), "rho": float(rho), "memory": float(memory),
                          "lag": float(-delta * rho * memory)})
    held = [(m["step"], m["eval/accuracy"]) for m in metrics if "eval/accuracy" in m]
    last = metrics[-1] if metrics else {}
    passes = bool(rows) and all(abs(r["bias"]) <= BIAS_BOUND and r["mae_ratio"] <= MAE_RATIO_BOUND for r in rows)
    return {"probes": rows, "intervals": intervals, "visits_per_prompt": last.get("tracker/visits_mean"),
            "held_out": (held[0], held[-1]) if held else None, "passes": passes}


def report(run_dir, r):
    """The measurement as markdown: two tables and one line."""
    lines = [f"### {run_dir}", "", "| probe step | success | v(x) | bias | MAE | unbiased MAE | ratio | N_eff | visits "
             "| bias against the exact p |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {p['step']} | {p['success']:.3f} | {p['value']:.3f} | {p['bias']:+.3f} | {p['mae']:.3f} | "
              f"{p['mae_unbiased']:.3f} | {p['mae_ratio']:.2f} | {p['n_eff']:.1f} | {p['visits']:.1f} | "
              f"{p['bias_exact']:+.3f} |" for p in r["probes"]]
    lines += ["", "| steps | visits between probes | delta p per visit | mean rho | memory 1/(1-rho) | predicted bias |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {i['steps']} | {i['visits']:.1f} | {i['delta']:+.4f} | {i['rho']:.3f} | {i['memory']:.1f} | "
              f"{i['lag']:+.3f} |" for i in r["intervals"]]
    held = r["held_out"]
    held = "n/a" if held is None else f"{held[0][1]:.1%} (step {held[0][0]}) -> {held[1][1]:.1%} (step {held[1][0]})"
    visits = "n/a" if r["visits_per_prompt"] is None else f"{r['visits_per_prompt']:.1f}"
    verdict = "met" if r["passes"] else "NOT met"
    lines += ["", f"visits per prompt over the run: {visits}; held-out accuracy {held}; bounds (|bias| <= "
              f"{BIAS_BOUND}, MAE <= {MAE_RATIO_BOUND} x unbiased) at every probe: {verdict}", ""]
    return "\n".join(lines)


def brief(runs):
    """One markdown row per run ({name: regime(...)}): the worst probe per bound and the verdict; then every miss."""
    lines = ["| run | probes | worst bias (step) | worst MAE / unbiased (step) | visits per prompt | held-out | "
             "bounds met |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in runs.items():
        bias = max(r["probes"], key=lambda p: abs(p["bias"]))
        ratio = max(r["probes"], key=lambda p: p["mae_ratio"])
        held = r["held_out"]
        lines.append(f"| {name} | {len(r['probes'])} | {bias['bias']:+.3f} ({bias['step']}) | "
                     f"{ratio['mae_ratio']:.2f} ({ratio['step']}) | {r['visits_per_prompt'] or float('nan'):.1f} | "
                     + (f"{held[0][1]:.1%} -> {held[1][1]:.1%}" if held else "n/a")
                     + f" | {'yes' if r['passes'] else 'NO'} |")
    missed = [(name, p) for name, r in runs.items() for p in r["probes"]  # the worst alone hides the first miss
              if abs(p["bias"]) > BIAS_BOUND or not p["mae_ratio"] <= MAE_RATIO_BOUND]
    lines += ["", f"Probes that miss a bound (|bias| > {BIAS_BOUND} or MAE > {MAE_RATIO_BOUND} x unbiased): "
              f"{len(missed) or 'none'}"]
    if missed:
        lines += ["", "| run | step | bias | MAE / unbiased |", "| --- | --- | --- | --- |"]
        lines += [f"| {name} | {p['step']} | {p['bias']:+.3f} | {p['mae_ratio']:.2f} |" for name, p in missed]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="spo.py run directories made with --probe_every (or a sweep's records)")
    p.add_argument("--brief", action="store_true", help="one row per run instead of each run's tables")
    args = p.parse_args()
    for run_dir in args.runs:
        if not any(os.path.exists(os.path.join(run_dir, name)) for name in ("probe.jsonl", "probe.jsonl.gz")):
            raise SystemExit(f"error: {run_dir}: no probe.jsonl (run spo.py with --probe_every)")
    if args.brief:
        print(brief({os.path.basename(run_dir.rstrip("/")): regime(run_dir) for run_dir in args.runs}))
        return
    for run_dir in args.runs:
        print(report(run_dir, regime(run_dir)))


if __name__ == "__main__":
    main()
