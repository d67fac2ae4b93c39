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
PAPER = {"between": "~0.6-0.8 (all-agree 60-80% under a Beta model)", "all_agree": "~60% rising past 80%",
         "ends": "many mastered, some unsolved", "pool": "7-15% of ~14k drawn; ~22-36 samples a prompt",
         "window": "adaptive by design", "lag": "- (forgetting's channel)", "rising": "rising"}
LEARNING = (0.1, 0.9)  # a probed prompt still being learned: p strictly between these
GROUP = 8  # GRPO's group size: the all-agree share a probe predicts is of groups of this many


def between_share(p, n):
    """Var_x p(x) over the total reward variance from a probe's sampled success p of n samples a prompt, the
    binomial noise's share taken out."""
    p = np.asarray(p, np.float64)
    return (np.var(p) - np.mean(p * (1 - p)) / max(n - 1, 1)) / (np.mean(p) * (1 - np.mean(p)))


def between_share_free(v0, p, n0, smoothing):
    """The same without a noise model: the covariance over prompts of two independent estimates of p(x) at step 0,
    the tracker's v0 (n0 offline samples, kt: (s + 0.5) / (n0 + 1), which scales the covariance by n0 / (n0 + 1))
    and the probe's success, over the reward variance."""
    v0, p = np.asarray(v0, np.float64), np.asarray(p, np.float64)
    scale = (n0 + 1) / n0 if smoothing == "kt" else 1.0
    return float(np.mean((v0 - v0.mean()) * (p - p.mean())) * scale / (np.mean(p) * (1 - np.mean(p))))


def all_agree_estimate(p, n, group=GROUP):
    """The share of groups of `group` samples that would all agree, unbiased from n >= group samples a prompt with
    success share p: (C(s, G) + C(n - s, G)) / C(n, G), s = p n, averaged over prompts."""
    from math import comb
    s = np.rint(np.asarray(p, np.float64) * n).astype(int)
    return float(np.mean([(comb(k, group) + comb(n - k, group)) / comb(n, group) for k in s]))


def lag_share(probe, key="success", shared=False):
    """Eq. 9 centres the advantages r - v over the batch: the lag v - p all prompts share goes (shared: its
    square), its prompt-specific part adds Var_x (v - p) to the advantage's variance; each over the reward noise an
    exact baseline leaves, E[p (1 - p)], the probe's sampling noise taken out of both."""
    p, v, n = np.asarray(probe[key], np.float64), np.asarray(probe["value"], np.float64), probe.get("n_samples", 1)
    noise = 0 if key == "exact" else np.mean(p * (1 - p)) / max(n - 1, 1)  # the sampled p's own variance
    return float((np.mean(v - p) ** 2 if shared else np.var(v - p) - noise) / (np.mean(p * (1 - p)) + noise))


def measure(run, after=20, lag_by=100):
    """{quantity: value} of one run (read_run's; nan where the run did not log it). p(x) is the probe's exact
    probability where it logged one, else its sampled success (which leaves sampling noise in the lag)."""
    config, rows = run["config"], [run["rows"][s] for s in sorted(run["rows"])]
    pool, steps, nan = pool_size(config), max(run["rows"]), np.nan
    col = lambda key, rs=rows: np.array([r[key] for r in rs if key in r], np.float64)  # noqa: E731
    agree, tenth = col("zero_signal/degenerate_groups"), max(1, steps // 10)
    revisits = [r for r in rows if r.get("tracker/revisit_share", 0) > 0]
    weights = col("tracker/revisit_share", revisits)
    share = lambda key: float(np.sum(col(key, revisits) * weights) / np.sum(weights)) if revisits else nan  # noqa
    mean = lambda xs: float(np.mean(xs)) if len(xs) else nan  # noqa: E731  (nan, not numpy's warning, for none)
    largest = lambda xs: float(np.max(np.abs(xs))) if len(xs) else nan  # noqa: E731
    probes = [run["probe"][s] for s in sorted(run["probe"])]
    key = "exact" if probes and all("exact" in p for p in probes) else "success"
    p_of = lambda probe: np.asarray(probe[key], np.float64)  # noqa: E731
    late = [p for p in probes if p["step"] > after]
    learning = lambda p: (p_of(p) > LEARNING[0]) & (p_of(p) < LEARNING[1])  # noqa: E731
    lag = [np.mean((np.asarray(p["value"]) - p_of(p))[learning(p)]) for p in late if learning(p).any()]
    first, n = (probes[0], probes[0].get("n_samples", 1)) if probes else (None, 1)
    by = [p for p in late if p["step"] <= lag_by]
    accuracy, times = col("eval/exact"), col("time")
    accuracy = accuracy if len(accuracy) else col("eval/accuracy")  # the sampled avg@n where no exact success
    at_min, at_max = share("tracker/rho_at_min"), share("tracker/rho_at_max")
    return {"drawn": config["batch_size"] / config["group_size"] / pool, "samples": config["batch_size"] * steps / pool,
            "pool": pool, "batch": config["batch_size"], "steps": steps,
            "all_agree": (mean(agree[:tenth]), mean(agree[-tenth:])),
            "all_agree_probe": all_agree_estimate(p_of(first), n) if first and n >= GROUP else nan,
            "mastered": tuple(np.mean(p_of(p) >= 0.9) for p in (probes[0], probes[-1])) if probes else (nan, nan),
            "unsolved": tuple(np.mean(p_of(p) <= 0.1) for p in (probes[0], probes[-1])) if probes else (nan, nan),
            "between": float(between_share(p_of(first), n)) if first else nan,
            "between_free": between_share_free(first["value"], p_of(first), config.get("n0", 8),
                                               config.get("init_smoothing", "kt")) if first and first["step"] == 0
            and config.get("offline_values") != "none" else nan,
            "clip": mean(col("policy/clip_fraction")),
            "window": 1 - at_min - at_max, "above": at_min, "below": at_max,  # D above the window: rho at rho_min
            "d_mean": mean(col("tracker/divergence_revisit_mean", revisits)),
            "lag_by": mean([lag_share(p, key) for p in by]), "lag_share": mean([lag_share(p, key) for p in late]),
            "lag_shared": mean([lag_share(p, key, True) for p in late]),
            "bias": largest([p["probe/bias"] for p in late]), "bias_mean": mean([p["probe/bias"] for p in late]),
            "lag": largest(lag), "lag_mean": mean(lag),
            "rising": float(accuracy[-1] - accuracy[-2]) if len(accuracy) > 1 else nan,
            "minutes": float(np.ptp(times)) / 60 if len(times) > 1 else nan}


def targets(spo, grpo, rho_none=None, minutes=12):
    """[(target, paper value, measured text, met: bool)]: the mixed preset's eight, from measure() of an SPO run, a
    GRPO run and (for the manipulation check, left out without it) an SPO run without forgetting (--rho none);
    minutes: the plan's longest run."""
    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    lag_none = rho_none["lag_by"] if rho_none else np.nan
    ratio = lag_none / spo["lag_by"] if spo["lag_by"] > 0 else np.nan
    return [row for row in [
        ("between-prompt share of reward variance at step 0: noise-free (v0 x probe covariance); probe less "
         "binomial noise", PAPER["between"], f"{spo['between_free']:.2f}; {spo['between']:.2f}",
         spo["between_free"] >= 0.4),
        ("GRPO's all-agree groups, first -> last tenth (SPO's step-0 probe predicts)", PAPER["all_agree"],
         " -> ".join(map(pct, grpo["all_agree"])) + f" ({pct(spo['all_agree_probe'])})",
         0.5 <= grpo["all_agree"][0] < grpo["all_agree"][1]),
        ("pool prompts mastered (p >= 0.9); unsolved (p <= 0.1): step 0 -> last probe", PAPER["ends"],
         " -> ".join(map(pct, spo["mastered"])) + "; " + " -> ".join(map(pct, spo["unsolved"])),
         spo["mastered"][0] >= 0.2 and spo["unsolved"][0] >= 0.15),
        ("pool, batch, steps (share drawn a step; samples a prompt)", PAPER["pool"],
         f"{spo['pool']}, {spo['batch']}, {spo['steps']} ({pct(spo['drawn'])}; {spo['samples']:.1f})",
         0.07 <= spo["drawn"] <= 0.15),
        ("SPO revisits with D inside rho's window (at rho_min; at rho_max; D's mean; clip fraction)", PAPER["window"],
         f"{pct(spo['window'])} ({pct(spo['above'])}; {pct(spo['below'])}; {spo['d_mean']:.4f}; "
         f"{spo['clip']:.3%})", spo["window"] >= 0.4),
        ("reward variance the lag adds after Eq. 9's centring, probes after step 20 to 100: rho none / spo (ratio)",
         PAPER["lag"], f"{lag_none:.1%} / {spo['lag_by']:.1%} ({ratio:.1f}x)", ratio >= 3) if rho_none else None,
        ("held-out accuracy still rising at the end (last evaluation minus the one before, points)", PAPER["rising"],
         f"SPO {100 * spo['rising']:+.1f}, GRPO {100 * grpo['rising']:+.1f}", min(spo['rising'], grpo['rising']) > 0),
        ("minutes a run on this machine", "-", f"SPO {spo['minutes']:.1f}, GRPO {grpo['minutes']:.1f}",
         max(spo["minutes"], grpo["minutes"]) <= minutes)] if row]


def sweep_report(out, after=20, minutes=12):
    """The targets, one column per seed with both an spo and a grpo run, then the tracker's bias and lag per
    variant that has a probe (mean [95% interval] over its seeds)."""
    names = record_names(os.path.join(out, "records"))
    seeds = sorted(int(n[5:]) for n in names if n.startswith("spo-s") and f"grpo-s{n[5:]}" in names)
    if not seeds:
        raise SystemExit(f"error: {out}: no seed with both an spo and a grpo run")
    measured = {n: measure(load(out, n), after) for n in names}  # each run once, for both tables
    columns = [targets(measured[f"spo-s{s}"], measured[f"grpo-s{s}"], measured.get(f"rho_none-s{s}"), minutes)
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
        runs = [measured[n] for n in names if n.rsplit("-s", 1)[0] == variant]
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
    rows = [{"step": p["step"], "bias": p["probe/bias"], "mae": p["probe/mae"],
             "mae_unbiased": p.get("probe/mae_unbiased", np.nan),
             "mae_ratio": p["probe/mae"] / p["probe/mae_unbiased"] if p.get("probe/mae_unbiased") else np.nan,
             **{k: float(np.mean(p[k])) for k in ("success", "value", "n_eff", "visits")},
             "bias_exact": p.get("probe/bias_exact", np.nan)} for p in probes]
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
    a = sub.add_parser("targets", help="the calibration targets of a sweep's spo-sS and grpo-sS runs, and the "
                       "tracker's lag per variant")
    a.add_argument("out", help="a sweep's directory (runs or records)")
    a.add_argument("--minutes", type=float, default=12, help="the longest run the sweep's plan allows")
    args = p.parse_args(argv)
    if args.what == "targets":
        print(sweep_report(args.out, minutes=args.minutes))
        return
    runs = {os.path.basename(path.rstrip("/")): regime(path) for path in args.runs}
    for name, r in runs.items():
        if not r["probes"]:
            raise SystemExit(f"error: {name}: no probe rows (run spo.py with --probe_every)")
    print("\n".join(report(name, r) for name, r in runs.items()))


if __name__ == "__main__":
    main()
