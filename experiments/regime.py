"""Is a toy setting in the paper's regime, and can SPO's tracker keep up in it? Measured from runs or records:
the calibration targets (issue 41) from an SPO and a GRPO run of one seed, each beside the paper's value (PAPER,
targets()); and the tracker's lag from a run's probe (--probe_every): per interval between two probes, the change
of p(x) per visit of a prompt, delta, and the lag a steady drift leaves an exponential average with forgetting
factor rho, -delta rho / (1 - rho), beside the bounds (docs/experiments.md, "What decides whether a tracker keeps
up").

    python -m experiments.regime targets experiments/calibrated/round2      # one column per seed of spo and grpo
    python -m experiments.regime probe RUN_DIR [RUN_DIR ...] [--brief]      # --brief: one row per run, then misses
"""
import argparse
import os

import numpy as np

from experiments.analysis import load, pool_size, read_run, record_names

PAPER = {"drawn": "7-15% (1,024-2,048 of ~14k)", "samples": "~22-36", "all_agree": "~60% rising past 80%",
         "mastered": "many, growing", "between": "~0.5 (a 'nearly 50%' cut)", "clip": "> 0 (8 mini-batches)",
         "window": "adaptive by design", "bias": "tracks (premise)", "rising": "rising", "minutes": "-"}


def measure(run):
    """{quantity: value} of one run (read_run's; nan where the run did not log it)."""
    config, rows = run["config"], [run["rows"][s] for s in sorted(run["rows"])]
    pool, steps = pool_size(config), max(run["rows"])
    evals = [r for r in rows if "pool/exact" in r]
    col = lambda key, rs=rows: np.array([r[key] for r in rs if key in r], np.float64)  # noqa: E731
    tenth = max(1, steps // 10)
    agree = [r for r in rows if "zero_signal/degenerate_groups" in r]
    first, last = ([np.mean([r["zero_signal/degenerate_groups"] for r in part]) if part else np.nan
                    for part in (agree[:tenth], agree[-tenth:])])
    revisits = [r for r in rows if r.get("tracker/revisit_share", 0) > 0]
    weights = col("tracker/revisit_share", revisits)
    inside = 1 - col("tracker/rho_at_min", revisits) - col("tracker/rho_at_max", revisits)
    probes = [p for s, p in sorted(run["probe"].items()) if s > 50]
    bias_key = "probe/bias_exact" if probes and all("probe/bias_exact" in p for p in probes) else "probe/bias"
    exact = col("eval/exact")
    times = col("time")
    return {
        "drawn": config["batch_size"] / config["group_size"] / pool,
        "samples": config["batch_size"] * steps / pool,
        "all_agree_first": first, "all_agree_last": last,
        "mastered_first": evals[0]["pool/mastered"] if evals else np.nan,
        "mastered_last": evals[-1]["pool/mastered"] if evals else np.nan,
        "between": float(np.mean(col("pool/between_share", evals))) if evals else np.nan,
        "clip": float(np.mean(col("policy/clip_fraction"))),
        "window": float(np.sum(inside * weights) / np.sum(weights)) if len(revisits) else np.nan,
        "bias": float(np.max(np.abs([p[bias_key] for p in probes]))) if probes else np.nan,
        "rising": float(exact[-1] - exact[-2]) if len(exact) > 1 else np.nan,
        "minutes": float(times[-1] - times[0]) / 60 if len(times) > 1 else np.nan}


def targets(spo, grpo):
    """[(target, paper value, measured text, met: bool)] from measure() of an SPO run and a GRPO run."""
    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    both = lambda key: max(spo[key], grpo[key])  # noqa: E731
    return [
        ("prompts drawn per step (share of the pool)", PAPER["drawn"],
         f"SPO {pct(spo['drawn'])}, GRPO {pct(grpo['drawn'])}", both("drawn") <= 0.15),
        ("samples per prompt over the run", PAPER["samples"], f"{spo['samples']:.0f}", 20 <= spo["samples"] <= 60),
        ("GRPO's all-agree share (first -> last tenth of the run)", PAPER["all_agree"],
         f"{pct(grpo['all_agree_first'])} -> {pct(grpo['all_agree_last'])}",
         grpo["all_agree_first"] >= 0.6 and grpo["all_agree_last"] > grpo["all_agree_first"]),
        ("mastered prompts, p(x) >= 0.9 (first -> last evaluation)", PAPER["mastered"],
         f"SPO {pct(spo['mastered_first'])} -> {pct(spo['mastered_last'])}, GRPO {pct(grpo['mastered_first'])} -> "
         f"{pct(grpo['mastered_last'])}", min(spo["mastered_last"] - spo["mastered_first"],
                                              grpo["mastered_last"] - grpo["mastered_first"]) > 0),
        ("share of reward variance between prompts (mean over evaluations)", PAPER["between"],
         f"SPO {spo['between']:.2f}, GRPO {grpo['between']:.2f}", min(spo["between"], grpo["between"]) >= 0.5),
        ("PPO-clip clip fraction (mean over steps)", PAPER["clip"],
         f"SPO {spo['clip']:.4f}, GRPO {grpo['clip']:.4f}", min(spo["clip"], grpo["clip"]) > 0),
        ("SPO revisits with D inside rho's window", PAPER["window"], pct(spo["window"]), spo["window"] >= 0.5),
        ("SPO tracker's largest abs(bias) after step 50", PAPER["bias"], f"{spo['bias']:.3f}", spo["bias"] <= 0.05),
        ("exact success still rising at the end (last evaluation minus the one before)", PAPER["rising"],
         f"SPO {100 * spo['rising']:+.1f}, GRPO {100 * grpo['rising']:+.1f} points",
         min(spo["rising"], grpo["rising"]) > 0),
        ("minutes per run on this machine", PAPER["minutes"], f"SPO {spo['minutes']:.1f}, GRPO {grpo['minutes']:.1f}",
         both("minutes") <= 16),
    ]


def sweep_report(out):
    """One column per seed of a sweep's spo-sS and grpo-sS runs (or records): each target's measured value, and
    how many seeds met it."""
    names = record_names(os.path.join(out, "records"))
    seeds = sorted(int(name[5:]) for name in names if name.startswith("spo-s") and f"grpo-s{name[5:]}" in names)
    if not seeds:
        raise SystemExit(f"error: {out}: no seed with both an spo and a grpo record")
    columns = [targets(measure(load(out, f"spo-s{s}")), measure(load(out, f"grpo-s{s}")))
               for s in seeds]
    lines = ["| target | the paper | " + " | ".join(f"seed {s}" for s in seeds) + " | seeds met |",
             "| --- | --- | " + "--- | " * len(seeds) + "--- |"]
    for i, (name, paper, _, _) in enumerate(columns[0]):
        cells = [c[i][2] + ("" if c[i][3] else " (**no**)") for c in columns]
        lines.append(f"| {name} | {paper} | " + " | ".join(cells) + f" | {sum(c[i][3] for c in columns)} of "
                     f"{len(seeds)} |")
    return "\n".join(lines)


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("targets", help="the calibration targets of a sweep's spo-sS and grpo-sS runs").add_argument(
        "out", help="a sweep's directory (its runs or records)")
    a = sub.add_parser("probe", help="the tracker's regime from runs made with --probe_every")
    a.add_argument("runs", nargs="+", help="spo.py run directories (or a sweep's records/NAME)")
    a.add_argument("--brief", action="store_true", help="one row per run instead of each run's tables")
    args = p.parse_args(argv)
    if args.what == "targets":
        print(sweep_report(args.out))
        return
    runs = {os.path.basename(path.rstrip("/")): regime(path) for path in args.runs}
    for name, r in runs.items():
        if not r["probes"]:
            raise SystemExit(f"error: {name}: no probe rows (run spo.py with --probe_every)")
    print(brief(runs) if args.brief else "\n".join(report(name, r) for name, r in runs.items()))


if __name__ == "__main__":
    main()
