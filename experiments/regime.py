"""Can SPO's tracker keep up? Measured from a run's probe (--probe_every), in runs or records: per interval between
two probes, the change of p(x) per visit of a prompt, delta, and the lag a steady drift leaves an exponential
average with forgetting factor rho, -delta rho / (1 - rho), beside the bounds (docs/experiments.md, "What decides
whether a tracker keeps up"); and a sweep's calibration targets, one column per seed of its spo and grpo runs, each
beside the paper's value, with the tracker's bias and lag per variant (`targets`; the sharp toy's last tables are
in experiments/calibrated/calibration.md).

    python -m experiments.regime probe RUN_DIR [RUN_DIR ...]
    python -m experiments.regime targets experiments/forgetting       # a sweep's directory (runs or records)
"""
import argparse
import os

import numpy as np

from experiments.analysis import load, mean_ci, pool_size, read_run, record_names

BIAS_BOUND, MAE_RATIO_BOUND = 0.05, 1.5
PAPER = {"drawn": "7-15% (1,024-2,048 of ~14k)", "samples": "~22-36", "all_agree": "~60% rising past 80%",
         "mastered": "many, growing", "between": "~0.5 (a 'nearly 50%' cut)", "clip": "0.1-2% (8 mini-batches)",
         "window": "adaptive by design (>= 50% asked)", "bias": "tracks (premise; 0.05 asked)", "rising": "rising"}
LEARNING = (0.1, 0.9)  # a probed prompt still being learned: p strictly between these


def measure(run, after=20):
    """{quantity: value} of one run (read_run's; nan where the run did not log it). p(x) is the probe's exact
    probability where it logged one, else its sampled success (which leaves sampling noise in the lag)."""
    config, rows = run["config"], [run["rows"][s] for s in sorted(run["rows"])]
    pool, steps, nan = pool_size(config), max(run["rows"]), float("nan")
    col = lambda key, rs=rows: np.array([r[key] for r in rs if key in r], np.float64)  # noqa: E731
    agree, tenth = col("zero_signal/degenerate_groups"), max(1, steps // 10)
    revisits = [r for r in rows if r.get("tracker/revisit_share", 0) > 0]
    weights = col("tracker/revisit_share", revisits)
    share = lambda k: float(np.sum(col(k, revisits) * weights) / np.sum(weights)) if revisits else nan  # noqa: E731
    above, below = share("tracker/rho_at_min"), share("tracker/rho_at_max")  # D above the window: rho at rho_min
    probes = [run["probe"][s] for s in sorted(run["probe"])]
    key = "exact" if probes and all("exact" in p for p in probes) else "success"
    p_of = lambda probe: np.asarray(probe[key], np.float64)  # noqa: E731
    late = [p for p in probes if p["step"] > after]
    lag = [np.mean((np.asarray(p["value"]) - p_of(p))[(p_of(p) > LEARNING[0]) & (p_of(p) < LEARNING[1])])
           for p in late if ((p_of(p) > LEARNING[0]) & (p_of(p) < LEARNING[1])).any()]

    def between(probe):  # Var_x p(x) over the total reward variance; the sampling noise's share taken out
        p, n = p_of(probe), probe.get("n_samples", 1)
        noise = 0 if key == "exact" else np.mean(p * (1 - p)) / max(n - 1, 1)
        return (np.var(p) - noise) / (np.mean(p) * (1 - np.mean(p)))

    # Eq. 9 centres the advantages r - v over the batch: the lag v - p that all prompts share goes (shared: its
    # square), its prompt-specific part adds Var_x(v - p); each over the reward noise an exact baseline leaves
    def lag_share(probe, shared=False):
        p, n = p_of(probe), probe.get("n_samples", 1)
        noise = 0 if key == "exact" else np.mean(p * (1 - p)) / max(n - 1, 1)  # the sampled p's own variance
        lag = np.asarray(probe["value"]) - p
        return (np.mean(lag) ** 2 if shared else np.var(lag) - noise) / (np.mean(p * (1 - p)) + noise)
    accuracy, times = col("eval/exact"), col("time")
    accuracy = accuracy if len(accuracy) else col("eval/accuracy")  # the sampled avg@n where no exact success
    return {"drawn": config["batch_size"] / config["group_size"] / pool, "samples": config["batch_size"] * steps / pool,
            "all_agree": (np.mean(agree[:tenth]), np.mean(agree[-tenth:])) if len(agree) else (nan, nan),
            "mastered": tuple(np.mean(p_of(p) >= 0.9) for p in (probes[0], probes[-1])) if probes else (nan, nan),
            "between": float(np.mean([between(p) for p in probes])) if probes else nan,
            "clip": float(np.mean(col("policy/clip_fraction"))),
            "window": 1 - above - below, "above": above, "below": below,
            "lag_share": float(np.mean([lag_share(p) for p in late])) if late else nan,
            "lag_shared": float(np.mean([lag_share(p, True) for p in late])) if late else nan,
            "d_mean": float(np.mean(col("tracker/divergence_revisit_mean", revisits))) if revisits else nan,
            "bias": float(np.max(np.abs([p["probe/bias"] for p in late]))) if late else nan,
            "bias_mean": float(np.mean([p["probe/bias"] for p in late])) if late else nan,
            "lag": float(np.max(np.abs(lag))) if lag else nan, "lag_mean": float(np.mean(lag)) if lag else nan,
            "rising": float(accuracy[-1] - accuracy[-2]) if len(accuracy) > 1 else nan,
            "minutes": float(np.ptp(times)) / 60 if len(times) > 1 else nan}


def targets(spo, grpo, after=20):
    """[(target, paper value, measured text, met: bool)] from measure() of an SPO run and a GRPO run."""
    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    return [
        ("prompts drawn per step (share of the pool)", PAPER["drawn"],
         f"SPO {pct(spo['drawn'])}, GRPO {pct(grpo['drawn'])}", max(spo["drawn"], grpo["drawn"]) <= 0.15),
        ("samples per prompt over the run", PAPER["samples"], f"{spo['samples']:.0f}", 20 <= spo["samples"] <= 60),
        ("GRPO's all-agree share (first -> last tenth of the run)", PAPER["all_agree"],
         " -> ".join(map(pct, grpo["all_agree"])), 0.6 <= grpo["all_agree"][0] < grpo["all_agree"][1]),
        ("mastered prompts, p(x) >= 0.9 (SPO's probe: first -> last)", PAPER["mastered"],
         " -> ".join(map(pct, spo["mastered"])), spo["mastered"][1] > spo["mastered"][0]),
        ("share of reward variance between prompts (SPO's probe, mean)", PAPER["between"], f"{spo['between']:.2f}",
         spo["between"] >= 0.5),
        ("PPO-clip clip fraction (mean over steps)", PAPER["clip"], f"SPO {spo['clip']:.2%}, GRPO {grpo['clip']:.2%}",
         0.001 <= spo["clip"] <= 0.02),
        ("SPO revisits with D inside rho's window (D's mean)", PAPER["window"],
         f"{pct(spo['window'])} ({spo['d_mean']:.4f})", spo["window"] >= 0.5),
        (f"SPO tracker's largest abs(bias) after step {after}", PAPER["bias"], f"{spo['bias']:.3f}",
         spo["bias"] <= BIAS_BOUND),
        (f"its largest lag on prompts with {LEARNING[0]} < p < {LEARNING[1]}", PAPER["bias"], f"{spo['lag']:.3f}",
         spo["lag"] <= BIAS_BOUND),
        ("success still rising at the end (last evaluation minus the one before, points)", PAPER["rising"],
         f"SPO {100 * spo['rising']:+.1f}, GRPO {100 * grpo['rising']:+.1f}", min(spo['rising'], grpo['rising']) > 0),
        ("minutes per run on this machine", "-", f"SPO {spo['minutes']:.1f}, GRPO {grpo['minutes']:.1f}",
         max(spo["minutes"], grpo["minutes"]) <= 20)]


def sweep_report(out, after=20):
    """The targets, one column per seed with both an spo and a grpo run, then the tracker's bias and lag per
    variant that has a probe (mean [95% interval] over its seeds)."""
    names = record_names(os.path.join(out, "records"))
    seeds = sorted(int(n[5:]) for n in names if n.startswith("spo-s") and f"grpo-s{n[5:]}" in names)
    if not seeds:
        raise SystemExit(f"error: {out}: no seed with both an spo and a grpo run")
    columns = [targets(measure(load(out, f"spo-s{s}"), after), measure(load(out, f"grpo-s{s}"), after), after)
               for s in seeds]
    lines = ["| target | the paper | " + " | ".join(f"seed {s}" for s in seeds) + " | seeds met |",
             "| --- | --- | " + "--- | " * len(seeds) + "--- |"]
    for i, (name, paper, _, _) in enumerate(columns[0]):
        cells = [c[i][2] + ("" if c[i][3] else " (**no**)") for c in columns]
        lines.append(f"| {name} | {paper} | " + " | ".join(cells) + f" | {sum(c[i][3] for c in columns)} of "
                     f"{len(seeds)} |")
    lines += ["", f"| variant | seeds | bias, mean after step {after} | largest abs(bias) | lag on prompts being "
              "learned, mean | largest abs(lag) | D inside rho's window | above it | below it | the lag's "
              "variance after centring / the reward noise | its shared part, squared / the reward noise |",
              "|---" * 11 + "|"]
    for variant in sorted({n.rsplit("-s", 1)[0] for n in names}):
        runs = [measure(load(out, n), after) for n in names if n.rsplit("-s", 1)[0] == variant]
        if all(np.isnan(m["bias"]) for m in runs):
            continue  # no probe: a group estimator
        cell = lambda k: "{:+.3f} [{:+.3f}, {:+.3f}]".format(*mean_ci([m[k] for m in runs])[:3])  # noqa: E731
        lines.append(f"| {variant} | {len(runs)} | " + " | ".join(cell(k) for k in (
            "bias_mean", "bias", "lag_mean", "lag", "window", "above", "below", "lag_share", "lag_shared")) + " |")
    return "\n".join(lines)


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
    sub.add_parser("targets", help="the calibration targets of a sweep's spo-sS and grpo-sS runs, and the "
                   "tracker's lag per variant").add_argument("out", help="a sweep's directory (runs or records)")
    args = p.parse_args(argv)
    if args.what == "targets":
        print(sweep_report(args.out))
        return
    runs = {os.path.basename(path.rstrip("/")): regime(path) for path in args.runs}
    for name, r in runs.items():
        if not r["probes"]:
            raise SystemExit(f"error: {name}: no probe rows (run spo.py with --probe_every)")
    print("\n".join(report(name, r) for name, r in runs.items()))


if __name__ == "__main__":
    main()
