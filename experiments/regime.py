"""Can SPO's tracker keep up? Measured from a run's probe (--probe_every), in runs or records: per interval between
two probes, the change of p(x) per visit of a prompt, delta, and the lag a steady drift leaves an exponential
average with forgetting factor rho, -delta rho / (1 - rho), beside the bounds (docs/experiments.md, "What decides
whether a tracker keeps up"). The calibration targets (issue 41, `regime targets`) were measured here until commit
2d63bad; their last tables are in experiments/calibrated/calibration.md, as `probe --brief`'s (one row per run)
are in experiments/paper_regime/regime.md.

    python -m experiments.regime probe RUN_DIR [RUN_DIR ...]
"""
import argparse
import os

import numpy as np

from experiments.analysis import read_run

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
    lines += ["", "| steps | visits between probes | delta p per visit | mean rho | memory 1/(1-rho) | "
              "predicted bias |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {i['steps']} | {i['visits']:.1f} | {i['delta']:+.4f} | {i['rho']:.3f} | {i['memory']:.1f} | "
              f"{i['lag']:+.3f} |" for i in r["intervals"]]
    held = r["held_out"]
    held = "n/a" if held is None else f"{held[0][1]:.1%} (step {held[0][0]}) -> {held[1][1]:.1%} (step {held[1][0]})"
    visits = "n/a" if r["visits_per_prompt"] is None else f"{r['visits_per_prompt']:.1f}"
    verdict = "met" if r["passes"] else "NOT met"
    lines += ["", f"visits per prompt over the run: {visits}; held-out accuracy {held}; bounds (|bias| <= "
              f"{BIAS_BOUND}, MAE <= {MAE_RATIO_BOUND} x unbiased) at every probe: {verdict}", ""]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("probe", help="the tracker's regime from runs made with --probe_every")
    a.add_argument("runs", nargs="+", help="spo.py run directories (or a sweep's records/NAME)")
    args = p.parse_args(argv)
    runs = {os.path.basename(path.rstrip("/")): regime(path) for path in args.runs}
    for name, r in runs.items():
        if not r["probes"]:
            raise SystemExit(f"error: {name}: no probe rows (run spo.py with --probe_every)")
    print("\n".join(report(name, r) for name, r in runs.items()))


if __name__ == "__main__":
    main()
