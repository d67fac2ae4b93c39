"""How the notebook's numbers are computed: statistics over seeds, reading the records, the preregistered primary
metric and its power. The regime targets and the tracker's lag: regime.py; figures: plots.py; running a sweep:
sweep.py.

Records: a folder of runs D/NAME/ may be packed as one archive D.tar.gz of NAME/config.json, NAME/metrics.jsonl and
NAME/probe.jsonl; read_run(D/NAME) reads either. Intervals are over training seeds: every seed starts from the
same model and is evaluated on the same test set; with --pool_per_seed each seed also draws its own pool.

    python -m experiments.analysis primary experiments/calibrated --reference spo --budget 46592
    python -m experiments.analysis contrasts experiments/mixed --metric eval/accuracy \\
        --family spo-grpo:total spo-grpo:training uniform-spo:total  # A - B at its accounting, Holm over the family
    python -m experiments.analysis power 0.0057          # the seeds for 1 point at a paired sd of 0.57 points
"""
import functools
import gzip
import io
import json
import os
import re
import tarfile

import numpy as np

from machinery.errors import shown

ROOT = os.path.dirname(os.path.abspath(__file__))

# Two-sided 95% quantiles t_{0.975, df} of Student's t, df = 1..30 (standard tables; scipy is not a dependency).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
# One-sided 80% quantiles t_{0.80, df}, df = 1..30, then the normal's 0.8416.
T80 = [1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873, 0.870, 0.868, 0.866,
       0.865, 0.863, 0.862, 0.861, 0.860, 0.859, 0.858, 0.858, 0.857, 0.856, 0.856, 0.855, 0.855, 0.854, 0.854]


# ------------------------------------------------------------------------------------------------ statistics
def t975(df):
    """t_{0.975, df} from the table; past 30 degrees of freedom (no sweep here has half as many seeds) its last value,
    which only widens an interval (t falls to 1.96)."""
    return T975[min(int(df), 30) - 1] if df >= 1 else np.nan


def _finite(values):
    return np.asarray([v for v in values if v is not None and np.isfinite(v)], np.float64)


def mean_ci(values):
    """(mean, low, high, n) of the finite values with a 95% t-interval; with fewer than two values there is no
    interval (low = high = NaN), never a fake zero width."""
    x = _finite(values)
    mean = float(x.mean()) if x.size else np.nan
    half = t975(x.size - 1) * float(x.std(ddof=1)) / np.sqrt(x.size) if x.size > 1 else np.nan
    return mean, mean - half, mean + half, x.size


def prediction_interval(values):
    """(low, high): where ONE more run falls with 95% probability (normal model), mean +- t_{0.975, n-1} sd
    sqrt(1 + 1/n), sqrt(n + 1) times the mean's: what a single run on another machine is checked against. NaN with
    fewer than two values."""
    mean, low, _, n = mean_ci(values)
    return mean - (mean - low) * np.sqrt(n + 1), mean + (mean - low) * np.sqrt(n + 1)


def paired_difference(values, reference):
    """mean_ci of values[s] - reference[s] ({seed: number}) over the seeds both have: runs of one seed share the
    start and the held-out samples' seeds, and pairing removes what they share (a NaN difference: left out)."""
    return mean_ci([values[s] - reference[s] for s in sorted(set(values) & set(reference))])


def pct(mean, low=np.nan, high=np.nan, spec=".1f"):
    """100 x mean and its interval as text, "12.3 [11.0, 13.6]": no interval where there is none, "" for no mean."""
    if not np.isfinite(mean):
        return ""
    return f"{100 * mean:{spec}}" + (f" [{100 * low:{spec}}, {100 * high:{spec}}]" if np.isfinite(low) else "")


def detectable(sd, n):
    """The smallest true paired difference that n seeds detect with 80% power (two-sided 5% t-test), for a paired
    standard deviation sd: (t_{0.975, n-1} + t_{0.80, n-1}) sd / sqrt(n). NaN below 2 seeds."""
    return (t975(n - 1) + (T80[n - 2] if n <= 31 else 0.8416)) * sd / np.sqrt(n) if n >= 2 else np.nan


def t_test_p(diffs):
    """Two-sided p of the paired t-test (n - 1 degrees of freedom) without scipy: with t = sqrt(n - 1) tan(theta)
    the t density is proportional to cos(theta)^(n - 2) on [0, pi/2), so p is that curve's area beyond |t|'s angle
    over its whole area (the trapezoid rule; no normalising constant, no infinite tail)."""
    d = np.asarray(list(diffs), np.float64)
    if d.size < 2 or not d.std(ddof=1) > 0:
        return np.nan

    def area(low):
        theta = np.linspace(low, np.pi / 2, 100001)
        return np.trapezoid(np.cos(theta) ** (d.size - 2), theta)
    return float(area(np.arctan(abs(d.mean()) / d.std(ddof=1) * np.sqrt(d.size / (d.size - 1)))) / area(0.0))


def sign_flip_p(diffs):
    """Two-sided p of the exact paired sign-flip test: the share of the 2^n assignments of signs to the paired
    differences whose |sum| is at least the one observed (no normal model; at 8 seeds its smallest p is 1/128)."""
    d = np.asarray(list(diffs), np.float64)
    signs = 1 - 2 * ((np.arange(2 ** d.size)[:, None] >> np.arange(d.size)) & 1)  # (2^n, n) of +-1
    return float(np.mean(np.abs(signs @ d) >= abs(d.sum()) * (1 - 1e-12))) if d.size else np.nan


def holm(p_values):
    """Holm's step-down adjustment of {contrast: p} over the family (the smallest p times the family's size, the
    next times one less, ..., kept non-decreasing, at most 1)."""
    adjusted, running = {}, 0.0
    for k, name in enumerate(sorted(p_values, key=p_values.get)):
        running = max(running, min(1.0, (len(p_values) - k) * p_values[name]))
        adjusted[name] = running
    return adjusted


def seeds_for(effect, sd, most=30):
    """The fewest seeds (at least 2) whose detectable() difference is at most `effect`; None if more than `most`."""
    return next((n for n in range(2, most + 1) if detectable(sd, n) <= effect), None)


# ------------------------------------------------------------------------------------------------ reading records
@functools.lru_cache(maxsize=16)
def _archive(path, stamp):
    """{member name: bytes} of a tar.gz (stamp: its mtime and size, so a rewritten archive is read again)."""
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


def archive(path):
    return _archive(path, (os.stat(path).st_mtime_ns, os.stat(path).st_size)) if os.path.isfile(path) else {}


def write_archive(path, members):
    """{member name: bytes} as a tar.gz, the same bytes for the same members (sorted, mtime 0, no owner or name)."""
    with open(path + ".tmp", "wb") as raw, gzip.GzipFile("", "wb", 9, raw, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size = len(members[name])
            tar.addfile(info, io.BytesIO(members[name]))
    os.replace(path + ".tmp", path)


def _text(run_dir, name):
    """A run file's text: RUN/NAME, or NAME of RUN in its folder's archive (D.tar.gz); None if neither."""
    path = os.path.join(run_dir, name)
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    folder, run = os.path.split(os.path.normpath(run_dir))
    data = archive(folder + ".tar.gz").get(f"{run}/{name}")
    return None if data is None else data.decode()


def _jsonl_by_step(text):
    """{step: row}; a resumed run may repeat steps (probe.jsonl keeps old lines): the last line of a step wins."""
    rows = [json.loads(line) for line in io.StringIO(text or "") if line.strip()]
    return {row["step"]: row for row in rows}


def read_run(run_dir):
    """An spo.py run directory or a sweep's record of one: its config, metrics rows and probe rows ({step: row})."""
    config = _text(run_dir, "config.json")
    return {"dir": run_dir, "config": json.loads(config) if config else {},
            "rows": _jsonl_by_step(_text(run_dir, "metrics.jsonl")),
            "probe": _jsonl_by_step(_text(run_dir, "probe.jsonl"))}


def record_names(folder):
    """The runs of a folder of runs: its sub-directories, or the runs its archive FOLDER.tar.gz holds."""
    loose = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return loose or sorted({name.split("/")[0] for name in archive(folder + ".tar.gz")})


def read_sweep(out):
    """sweep.json, or on a machine without it (it is not committed) the finished runs its records stand for."""
    if os.path.exists(os.path.join(out, "sweep.json")):
        with open(os.path.join(out, "sweep.json")) as f:
            return json.load(f)
    names = record_names(os.path.join(out, "records"))
    if not names:
        raise SystemExit(f"error: {out}: neither a sweep.json nor records/ to summarise")
    return {"runs": {name: {"name": name, "variant": name.rsplit("-s", 1)[0], "seed": int(name.rsplit("-s", 1)[1]),
                            "status": "finished"} for name in names}}


def load(out, name):
    """A sweep's run: its run directory where this machine ran it, else its committed record (OUT/records/NAME)."""
    run_dir = os.path.join(out, "runs", name)
    return read_run(run_dir if os.path.isdir(run_dir) else os.path.join(out, "records", name))


def sweep_runs(out, sweep=None, only=None):
    """{variant: {seed: run}} of a sweep's finished runs (sweep: default read_sweep(out); only: run names, or all)."""
    groups = {}
    for e in (sweep or read_sweep(out))["runs"].values():
        if e.get("status") == "finished" and (only is None or e["name"] in only):
            groups.setdefault(e["variant"], {})[e["seed"]] = load(out, e["name"])
    return groups


def eval_curve(run, key="eval/accuracy"):
    """{step: (generated samples so far, held-out `key`)} at the run's evaluation steps (step 0: 0 samples)."""
    out, generated = {}, 0.0
    per_step = run["config"].get("batch_size", np.nan)  # runs from before sampling/generated was logged
    for step, row in sorted(run["rows"].items()):
        generated += row.get("sampling/generated", per_step) if step > 0 else 0.0
        if key in row:
            out[step] = (generated, row[key])
    return out


def run_mean(run, key):
    """The mean of a per-step metric over the run's steps that logged it (NaN where none did)."""
    values = [row[key] for row in run["rows"].values() if key in row]
    return float(np.mean(values)) if values else np.nan


# ------------------------------------------------------------------------------------------------ the primary metric
def pool_size(config):
    """The number of training prompts a run drew from: its --train_prompts, at most its training file's rows."""
    if not os.path.exists(config["train"]):  # a record read on another machine: its --train_prompts, if it said
        if config.get("train_prompts"):
            return config["train_prompts"]
        raise SystemExit(f"error: {shown(config['train'])} (the run's --train) is not here: its pool size is unknown")
    from machinery.data import load_prompts  # parquet or JSONL, as spo.py reads it
    rows = load_prompts(config["train"]).n_rows
    return min(rows, config["train_prompts"]) if config.get("train_prompts") else rows


def exact_curve(run, pool, key="eval/exact"):
    """[(generated samples, key)] at the run's evaluations, the offline values' samples counted first (spent at the
    base model's value, step 0's): the primary metric's curve."""
    config = run["config"]  # the offline values' generations: n0 per pool prompt, for SPO with --offline_values
    offline = float(config.get("n0", 0) * pool if config.get("algo") == "spo" and config.get("offline_values") != "none"
                    else 0)
    curve = [(generated + offline if step > 0 else 0.0, exact)
             for step, (generated, exact) in sorted(eval_curve(run, key).items())]
    if len(curve) > 1 and offline:
        curve.insert(1, (offline, curve[0][1]))  # the budget v0 spent: flat
    return curve


def area_mean(curve, budget):
    """The mean of a piecewise-linear curve [(x, y)] over x in [0, budget] (the curve must reach the budget)."""
    x, y = map(np.asarray, zip(*curve))
    if x[-1] < budget - 1e-9:
        raise ValueError(f"the curve ends at {x[-1]:.0f} samples, before the budget {budget:.0f}")
    grid = np.append(x[x < budget], budget)
    return float(np.trapezoid(np.interp(grid, x, y), grid) / budget)


def covers(configs):
    """What a sweep's intervals cover: training randomness, and the pool's draw where each seed drew its own."""
    per_seed = len({c.get("pool_seed", -1) for c in configs}) > 1
    return "training randomness and the pool's draw (a pool per seed; the same model and test set)" if per_seed \
        else "training randomness only: same model, pool and test set"


def paired_test(values, reference):
    """values[s] - reference[s] ({seed: number}) over the seeds both have: mean, 95% t-interval, n, paired sd, the
    difference those seeds detect with 80% power, the t-test's p and the exact sign-flip test's p."""
    diffs = [values[s] - reference[s] for s in sorted(set(values) & set(reference))]
    mean, low, high, n = mean_ci(diffs)
    sd = float(np.std(diffs, ddof=1)) if n > 1 else np.nan
    return {"mean": mean, "ci95": [low, high], "n": n, "sd": sd, "detectable": detectable(sd, n), "p": t_test_p(diffs),
            "p_sign_flip": sign_flip_p(diffs)}


def analyse(out, reference, budget=None, key="eval/exact", offline=True, family=()):
    """The preregistered analysis: primary metric = exact success (key: or another evaluation's metric, where no
    exact success exists) averaged over an equal budget of generated samples (offline values counted); secondary =
    the same at the last evaluation; each paired with `reference` by seed, with its sd and the difference its seeds
    detect at 80% power; Fig. 3a's zero-advantage share. offline=False: over training samples only (the offline
    values' not counted). family: the contrasts whose primary p-values (the paired t-test's) are Holm-adjusted.
    {"budget", "reference", "variants": {name: {metric: {seed: v}}}, "paired": {name: {metric: {...}}}}."""
    runs = {(variant, seed): run for variant, seeds in sweep_runs(out).items() for seed, run in seeds.items()}
    curves = {name: exact_curve(run, pool_size(run["config"]) if offline else 0, key) for name, run in runs.items()}
    if not curves or not all(curves.values()):
        raise SystemExit(f"error: {out}: no finished run with {key}")
    budget = budget or min(curve[-1][0] for curve in curves.values())
    variants = {}
    for (variant, seed), curve in sorted(curves.items()):
        v = variants.setdefault(variant, {"primary": {}, "final": {}, "zero_advantage": {}})
        v["primary"][seed], v["final"][seed] = area_mean(curve, budget), curve[-1][1]
        v["zero_advantage"][seed] = run_mean(runs[(variant, seed)], "signal/zero_advantage")
    paired = {name: {metric: paired_test(v[metric], variants[reference][metric]) for metric in ("primary", "final")}
              for name, v in variants.items() if name != reference and reference in variants}
    for name, p in holm({name: paired[name]["primary"]["p"] for name in family if name in paired}).items():
        paired[name]["primary"]["p_holm"] = p
    return {"budget": budget, "reference": reference, "variants": variants, "paired": paired, "key": key,
            "offline": offline, "family": list(family), "covers": covers([run["config"] for run in runs.values()])}


def cells(d, keys):
    """A paired_test() entry's `keys` as table cells: the mean with its 95% t-interval, the sd and the detectable
    difference in points, p's to three decimals ("" for a p it lacks)."""
    return [pct(d["mean"], *d["ci95"], "+.2f") if k == "mean" else pct(d[k], spec=".2f") if k in ("sd", "detectable")
            else f"{d[k]:.3f}" if k in d else "" for k in keys]


def primary_markdown(result):
    lines = [f"Primary metric: held-out `{result['key']}` averaged over {result['budget']:.0f} generated samples "
             f"(offline values {'counted' if result['offline'] else 'not counted'}); secondary: the same at the last "
             f"evaluation. Mean [95% t-interval] over seeds ({result['covers']}), %; paired difference to "
             f"`{result['reference']}` in points, its sd and the smallest difference its seeds detect with 80% power; "
             f"zero-advantage: the share of training samples with no signal (Fig. 3a), mean over steps and seeds; p: "
             f"the paired t-test of the primary difference, Holm's adjustment over the family "
             f"{', '.join(result['family']) or '(none named)'}, and the exact sign-flip test's p.\n",
             "| variant | seeds | primary | final | primary - ref | sd | detectable | final - ref | detectable | "
             "zero-advantage | p | Holm p | sign-flip p |", "| --- " * 13 + "|"]
    for name, v in result["variants"].items():
        means = [pct(*mean_ci(v[metric].values())[:3], ".2f") for metric in ("primary", "final")]
        d = result["paired"].get(name)
        diff = [""] * 5 if d is None else (cells(d["primary"], ("mean", "sd", "detectable"))
                                            + cells(d["final"], ("mean", "detectable")))
        zero_share = f"{100 * np.mean(list(v['zero_advantage'].values())):.1f}%"
        p = cells(d["primary"], ("p", "p_holm", "p_sign_flip")) if d else [""] * 3
        lines.append(f"| {name} | {len(v['primary'])} | " + " | ".join(means + diff + [zero_share] + p) + " |")
    return "\n".join(lines) + "\n"


def contrasts(out, family, key="eval/exact"):
    """A planned family of paired differences by seed, each member A-B:total (offline values counted, the primary's
    default) or A-B:training (training samples only, as --training_samples): analyse()'s arithmetic with B as the
    reference, so A's paired entry is A - B, over analyse()'s budget (the smallest total of any run in the sweep at
    that accounting, as for the primary); Holm's adjustment over the family's primary t-test p's.
    {"key", "covers", "rows": {member: {"budget", "primary": paired_test(...), "final": paired_test(...)}}}."""
    rows = {}
    for member in family:
        match = re.fullmatch(r"([^-:]+)-([^-:]+):(total|training)", member)
        if not match:
            raise SystemExit(f"error: {member!r}: a contrast is A-B:total or A-B:training, arm names without '-'")
        a, b, accounting = match.groups()
        result = analyse(out, b, key=key, offline=accounting == "total")
        if a not in result["paired"]:
            raise SystemExit(f"error: {member}: {out} has no runs of {a} to pair with runs of {b}")
        rows[member] = {**result["paired"][a], "budget": result["budget"]}
    for member, p in holm({member: row["primary"]["p"] for member, row in rows.items()}).items():
        rows[member]["primary"]["p_holm"] = p
    return {"key": key, "covers": result["covers"], "rows": rows}


def contrasts_markdown(result):
    lines = [f"Planned contrasts A - B, paired by seed: held-out `{result['key']}` averaged over an equal budget of "
             f"generated samples (the smallest total of any run in the sweep at the row's accounting: total, offline "
             f"values counted; training, training samples only), and at the last evaluation (the same at either "
             f"accounting). Mean [95% t-interval] over seeds ({result['covers']}) in points, the paired sd and the "
             f"smallest difference the seeds detect with 80% power; p: the paired t-test, Holm's adjustment over the "
             f"family's averages (none at the last evaluation, a secondary), and the exact sign-flip test's p.\n",
             "| contrast A-B:accounting | budget | seeds | A - B | sd | detectable | p | Holm p | sign-flip p | "
             "final A - B | sd | detectable | p | Holm p | sign-flip p |", "| --- " * 15 + "|"]
    for member, row in result["rows"].items():
        row_cells = [cell for d in (row["primary"], row["final"])  # no Holm p at the final evaluation: ""
                     for cell in cells(d, ("mean", "sd", "detectable", "p", "p_holm", "p_sign_flip"))]
        lines.append(f"| {member} | {row['budget']:.0f} | {row['primary']['n']} | " + " | ".join(row_cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    a, family = (sub.add_parser("primary", help="the preregistered analysis of a sweep's runs or records"),
                 sub.add_parser("contrasts", help="a planned family of paired differences A - B, Holm-adjusted"))
    for parser in (a, family):
        parser.add_argument("out", help="a sweep's directory (experiments/sweep.py --out)")
        parser.add_argument("--metric", default="eval/exact", help="the evaluation's metric (eval/accuracy: avg@n)")
    family.add_argument("--family", nargs="+", required=True,
                        help="A-B:total (offline values counted) or A-B:training (training samples only), each")
    a.add_argument("--reference", default="spo", help="the variant paired differences are taken against")
    a.add_argument("--budget", type=float, help="samples to average over (default: the smallest total of any run)")
    a.add_argument("--training_samples", action="store_true", help="count training samples only (no offline values)")
    a.add_argument("--family", nargs="*", default=[], help="the planned contrasts with --reference, Holm-adjusted")
    a = sub.add_parser("power", help="the seeds that detect --effect with 80%% power for a paired sd")
    a.add_argument("sd", type=float, help="the paired sd, a fraction (0.004 = 0.4 points)")
    a.add_argument("--effect", type=float, default=0.01, help="the effect to detect (0.01: 1 point)")
    args = p.parse_args(argv)
    if args.what == "power":
        n = seeds_for(args.effect, args.sd)
        print(f"paired sd {100 * args.sd:.2f} points: {n or 'more than 30'} seeds detect {100 * args.effect:.1f} "
              f"points with 80% power" + (f" (detectable with {n}: {100 * detectable(args.sd, n):.2f})" if n else ""))
    elif not os.path.isdir(args.out):
        raise SystemExit(f"error: {args.out}: not a sweep directory")
    elif args.what == "contrasts":
        print(contrasts_markdown(contrasts(args.out, args.family, args.metric)))
    else:
        print(primary_markdown(analyse(args.out, args.reference, args.budget, args.metric,
                                       not args.training_samples, args.family)))


if __name__ == "__main__":
    main()
