"""Sweeps: spo.py for a list of variants x seeds at an equal budget, resumable, with one summary and the plots.

One seed of an RL run on the toy moves the held-out accuracy by a few points, so comparing variants needs several
seeds and paired differences (analysis.py). This runs the grid, one torchrun at a time, into OUT/runs/NAME (NAME:
<variant>-s<seed>), OUT/logs/NAME.log and OUT/sweep.json, packs each finished run's logs into OUT/records.tar.gz
(commit it) and writes OUT/summary.{json,md} and OUT/plots/ (plots.py). docs/experiments.md ("Sweeps") says what
each file holds, how the budget is checked, and how a rerun resumes, skips and retries runs.

    python -m experiments.sweep --variants spo:0-4 grpo:0-4 rloo dr_grpo --seeds 0-2 --out experiments/mine
    python -m experiments.sweep --summary_only --out experiments/toy  # summary and plots again (runs or records)
"""
import argparse
import functools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time

import numpy as np

from experiments.analysis import (archive, covers, eval_curve, mean_ci, paired_difference, pct, prediction_interval,
                                  read_run, read_sweep, record_names, sweep_runs, write_archive)
from experiments.plots import make_plots
from machinery.errors import shown
from machinery.run_dir import take_lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: spo.py runs from there

# The ablations: each changes one thing of the default SPO run (docs/variants.md). Dr. GRPO here is its
# advantage only (the loss aggregation stays the token mean: one change per ablation; add --loss_agg token_sum
# with --define for the paper's full recipe).
VARIANTS = {
    "spo": [],
    "grpo": ["--algo", "grpo"],
    "rloo": ["--algo", "rloo"],
    "dr_grpo": ["--algo", "dr_grpo"],
    "no_baseline": ["--baseline", "none"],
    "no_offline": ["--offline_values", "none"],
    "uniform": ["--sampler", "uniform"],
    "rho_constant": ["--rho", "constant"],
    "rho_none": ["--rho", "none"],  # rho = 1: nothing forgotten
    "adv_token": ["--adv_norm", "token"],  # SPO++'s token measure in Eq. 9
    "k3": ["--divergence", "k3"],  # D_half 3e-4, calibrated to abs (docs/algorithm.md)
    "k3_dhalf0.06": ["--divergence", "k3", "--d_half", "0.06"],  # the earlier default (docs/LOG.md)
}
OWNED = {"--seed", "--run_dir", "--resume"}  # the sweep sets these per run


def parse_seeds(text):
    """'0-4' -> [0, 1, 2, 3, 4]; '0,2,5' -> [0, 2, 5]; '3' -> [3]."""
    seeds = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds += list(range(int(low), int(high) + 1)) if high else [int(low)]
    return seeds


def flag_value(flags, name, default=None):
    """The value of the last `name VALUE` in a flag list (argparse's rule: the last one wins)."""
    values = [flags[i + 1] for i in range(len(flags) - 1) if flags[i] == name]
    return values[-1] if values else default


def plan(args, extra):
    """[(run name, variant, seed, spo.py flags without --seed / --run_dir)], or SystemExit with one line."""
    variants = dict(VARIANTS)
    for definition in args.define:
        name, _, flags = definition.partition("=")
        variants[name] = shlex.split(flags)
    runs = []
    for spec in args.variants:
        name, _, seeds = spec.partition(":")
        if name not in variants:
            raise SystemExit(f"error: unknown variant {name!r}; known: {', '.join(variants)} (or --define NAME=FLAGS)")
        flags = variants[name] + extra
        if OWNED & set(flags):
            raise SystemExit(f"error: {name}: {', '.join(sorted(OWNED & set(flags)))} is set by the sweep per run")
        if flag_value(flags, "--algo", "spo") == "spo" and args.probe_every:
            flags += ["--probe_every", str(args.probe_every), "--probe_prompts", str(args.probe_prompts),
                      "--probe_samples", str(args.probe_samples)]
        runs += [(f"{name}-s{seed}", name, seed, flags + ["--pool_seed", str(seed)] * args.pool_per_seed)
                 for seed in parse_seeds(seeds or args.seeds)]
    return sorted(runs, key=lambda run: run[2])  # seed by seed: a sweep cut short still has whole, paired seeds


def run_state(run_dir, steps_wanted, record_dir=None):
    """'new', 'finished' (latest checkpoint at the run's last step, which is the --steps asked for; or, without
    the run directory, a record of a run that logged that step), 'resume' (an earlier checkpoint) or 'restart' (a
    directory without a checkpoint: the run died before its first)."""
    from machinery.checkpoint import latest_step
    if not os.path.isdir(run_dir):
        record = read_run(record_dir) if record_dir else None
        done = record and record["config"].get("steps") == steps_wanted and steps_wanted in record["rows"]
        return "finished" if done else "new"
    latest = latest_step(run_dir)
    if latest is None:
        return "restart"
    steps = read_run(run_dir)["config"].get("steps")
    return "finished" if latest == steps == steps_wanted else "resume"


def settings_differ(config, flags):
    """How a run's config.json differs from the settings spo.py's parser makes of the plan's flags (seed included):
    ['--lr 1e-05 (the run: 2e-05)', ...], [] where they agree. Left out: what --resume may change, the paths, and
    what the parser leaves to spo.py's start (None, 'auto')."""
    import spo
    from machinery.resume import LOCATIONS, RESUME_MAY_CHANGE
    planned = vars(spo.parse_args(list(flags)))
    return [f"--{k} {v} (the run: {config[k]})" for k, v in sorted(planned.items())
            if k in config and config[k] != v and v is not None and v != "auto" and k != "steps"
            and k not in RESUME_MAY_CHANGE | LOCATIONS]


def check_runs_are_the_plans(runs, out):
    """One line for the first run under OUT (its directory or its record) made with settings the plan does not
    have (a sweep restarted with another plan): it would be skipped as finished, or resumed, and counted."""
    for name, _, seed, flags in runs:
        for where in (os.path.join(out, "runs", name), os.path.join(out, "records", name)):  # ({}: none there)
            if differ := settings_differ(read_run(where)["config"], (*flags, "--seed", str(seed))):
                raise SystemExit(f"error: {shown(where)} was made with other settings than this plan's: "
                                 f"{'; '.join(differ)}; give this plan another --out, or move that run away")


def start_flags(run_dir, state):
    """spo.py's flags that continue a run_state() (deleting a run that died before its first checkpoint)."""
    if state == "restart":
        shutil.rmtree(run_dir)
    return ["--resume", run_dir] if state == "resume" else ["--run_dir", run_dir]


@functools.cache
def steps_of(flags):
    """The --steps a run with these spo.py flags trains for: spo.py's own parser decides (its default, or a
    --preset's), never a copy of it."""
    import spo
    return spo.parse_args(list(flags)).steps


def write_record(run_dir, record_dir):
    """A finished run's logs (no checkpoints) as NAME/ in its sweep's one archive (record_dir OUT/records/NAME: in
    OUT/records.tar.gz), replacing an older record of NAME: committed, it stands in for the run elsewhere."""
    path, name = os.path.dirname(record_dir) + ".tar.gz", os.path.basename(record_dir)
    members = {k: v for k, v in archive(path).items() if not k.startswith(name + "/")}
    for log in ("config.json", "metrics.jsonl", "probe.jsonl"):
        if os.path.exists(os.path.join(run_dir, log)):
            with open(os.path.join(run_dir, log), "rb") as f:
                members[f"{name}/{log}"] = f.read()
    write_archive(path, members)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc, program, flags):
    """The command of one program: a plain python process for one rank (no rendezvous to wait for), else torchrun."""
    if nproc == 1:
        return [sys.executable, program, *flags]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            program, *flags]


def run_logged(cmd, log_path, env=None):
    """Run cmd from the repository, everything it prints in log_path after the command itself; its exit code."""
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env).returncode


def error_lines(log_path, tail=30):
    """What a failed run said, escaped (a log holds model output): its `error:` lines (spo.py's one-line refusals),
    else the exception lines of a traceback (torchrun's ChildFailedError report left out), else its last lines."""
    with open(log_path, errors="replace") as f:
        lines = [shown(line.rstrip()) for line in f if line.strip()]
    refusals = [line for line in lines if line.lstrip().startswith("error:")]
    raised = [line for line in lines if re.match(r"^\s*[\w.]*(Error|Exception|Exit)\b", line)
              and "ChildFailedError" not in line]
    return (refusals or raised or lines)[-tail:]


def acquire_lock(out):
    """One sweep per --out at a time (two would run the same runs); a killed sweep's lock is taken over."""
    if busy := take_lock(lock := os.path.join(out, ".sweep.lock"), "sweep"):
        raise SystemExit(f"error: {out} is {busy}")
    return lock


def save_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def run_sweep(args, extra):
    runs = plan(args, extra)
    check_runs_are_the_plans(runs, args.out)  # (before the lock: a refused plan leaves nothing behind)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    lock = acquire_lock(args.out)
    sweep_path = os.path.join(args.out, "sweep.json")
    sweep = json.load(open(sweep_path)) if os.path.exists(sweep_path) else {"runs": {}}
    sweep["reference"] = args.reference
    for name, variant, seed, flags in runs:  # all of the plan first: a sweep cut short shows what it did not run
        sweep["runs"].setdefault(name, {}).update(name=name, variant=variant, seed=seed, flags=flags)
    failed = []
    try:
        for k, (name, _, seed, flags) in enumerate(runs, 1):
            run_dir, record_dir = os.path.join(args.out, "runs", name), os.path.join(args.out, "records", name)
            entry, state = sweep["runs"][name], run_state(run_dir, steps_of(tuple(flags)), record_dir)
            if state == "finished":
                entry["status"] = "finished"
                if os.path.isdir(run_dir) and name not in record_names(os.path.dirname(record_dir)):
                    write_record(run_dir, record_dir)
                print(f"{name}: finished, skipped", flush=True)
                continue
            print(f"{name}: running, {k} of {len(runs)} ({state})", flush=True)
            cmd = launch(args.nproc, "spo.py", [*flags, "--seed", str(seed), *start_flags(run_dir, state)])
            log_path = os.path.join(args.out, "logs", f"{name}.log")
            t0 = time.time()
            code = run_logged(cmd, log_path)
            entry.update(command=cmd, returncode=code, seconds=round(time.time() - t0, 1),
                         log=os.path.relpath(log_path, args.out), resumed=state == "resume")
            if code == 0 and run_state(run_dir, steps_of(tuple(flags))) == "finished":
                write_record(run_dir, record_dir)
                entry.update(status="finished", error=None)
                print(f"{name}: finished in {entry['seconds']:.0f} s", flush=True)
            else:
                entry.update(status="failed", error=error_lines(log_path))
                failed.append(name)
                print(f"{name}: FAILED (exit {code}), left out of the summary: {entry['error'][-1]} "
                      f"(log: {log_path})", flush=True)
            save_json(sweep_path, sweep)
    finally:
        save_json(sweep_path, sweep)
        os.remove(lock)
    write_summary(args.out, sweep, only={name for name, *_ in runs})
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)} (see {args.out}/summary.md)", flush=True)
    return 1 if failed else 0


def summarize(out, sweep, only=None):
    """The summary dict from the finished runs in sweep.json (only: run names to include; None: all)."""
    entries = [e for e in sweep["runs"].values() if only is None or e["name"] in only]
    groups = sweep_runs(out, sweep, only)
    curves = {variant: {seed: eval_curve(run) for seed, run in runs.items()}  # {seed: {step: (generated, acc)}}
              for variant, runs in groups.items()}
    variants = list(dict.fromkeys(e["variant"] for e in entries))
    reference = sweep.get("reference", "spo")
    ref = curves.get(reference, {})
    summary = {"reference": reference, "variants": {}, "failed": [
        {"run": e["name"], **{k: e.get(k) for k in ("variant", "seed", "returncode", "error", "log")}}
        for e in entries if e.get("status") == "failed"],
        "not_run": [e["name"] for e in entries if e.get("status") not in ("finished", "failed")],
        "covers": covers([run["config"] for runs in groups.values() for run in runs.values()])}
    budgets = set()
    for variant in variants:
        runs = curves.get(variant, {})
        steps = sorted({s for c in runs.values() for s in c})
        mine = [e for e in entries if e["variant"] == variant]
        row = {"seeds_used": sorted(runs),
               "seeds_failed": sorted(e["seed"] for e in mine if e.get("status") == "failed"),
               "seeds_not_run": sorted(e["seed"] for e in mine if e.get("status") not in ("finished", "failed")),
               "steps": {}}
        for step in steps:
            acc = {seed: c[step][1] for seed, c in runs.items() if step in c}
            mean, low, high, n = mean_ci(acc.values())
            cell = {"generated": float(np.mean([c[step][0] for c in runs.values() if step in c])), "n": n,
                    "accuracy_mean": mean, "accuracy_ci95": [low, high],
                    "accuracy_pi95": list(prediction_interval(acc.values())), "per_seed": acc}
            if variant != reference and ref:
                ref_acc = {seed: c[step][1] for seed, c in ref.items() if step in c}
                d_mean, d_low, d_high, d_n = paired_difference(acc, ref_acc)
                cell["paired_diff"] = {"mean": d_mean, "ci95": [d_low, d_high], "n": d_n}
            row["steps"][str(step)] = cell
        budgets |= {(max(c), c[max(c)][0]) for c in runs.values() if c}
        summary["variants"][variant] = row
    summary["budgets"] = sorted([int(s), g] for s, g in budgets)  # (last step, generated samples) over the runs
    return summary


def markdown(summary):
    """summary.md: held-out accuracy per variant and evaluation step, paired differences, budgets, failed runs."""
    ref, variants = summary["reference"], summary["variants"]
    steps = sorted({int(s) for v in variants.values() for s in v["steps"]})
    lines = [f"# Sweep summary\n\nHeld-out accuracy (%) at each evaluation step: mean [95% t-interval over seeds] "
             f"of the seeds that finished (n: seeds used). Paired difference: variant minus `{ref}` on the seeds "
             f"both finished, in points, with its own 95% t-interval. No interval with fewer than 2 seeds. The "
             f"intervals cover {summary['covers']}.\n"]
    if len(summary["budgets"]) == 1:
        lines.append(f"Budget: every run generated {summary['budgets'][0][1]:.0f} samples in "
                     f"{summary['budgets'][0][0]} steps (equal budget).\n")
    elif summary["budgets"]:
        lines.append("**Budgets differ** (last step, generated samples): " +
                     ", ".join(f"({s}, {g:.0f})" for s, g in summary["budgets"]) + "\n")
    header = "| variant | n | " + " | ".join(f"step {s}" for s in steps) + " |\n" + "|---" * (len(steps) + 2) + "|"
    for title, interval in (("## Held-out accuracy\n", "accuracy_ci95"),
                            ("\n## A single run's range (95% prediction interval over seeds)\n", "accuracy_pi95")):
        lines += [title, header]
        for name, v in variants.items():
            cells = [pct(c["accuracy_mean"], *c[interval]) if (c := v["steps"].get(str(s))) else "" for s in steps]
            used = f"{len(v['seeds_used'])}"
            if interval == "accuracy_ci95":  # the first table says which seeds are missing, and why
                used += ((f" ({len(v['seeds_failed'])} failed)" if v["seeds_failed"] else "")
                         + (f" ({len(v['seeds_not_run'])} not run yet)" if v.get("seeds_not_run") else ""))
            lines.append(f"| {name} | {used} | " + " | ".join(cells) + " |")
    if ref in variants and len(variants) > 1:
        lines += [f"\n## Paired difference to {ref} (points)\n", header]
        for name, v in variants.items():
            if name == ref:
                continue
            diffs = [v["steps"].get(str(s), {}).get("paired_diff") for s in steps]
            n = max((d["n"] for d in diffs if d), default=0)
            lines.append(f"| {name} | {n} | " + " | ".join(pct(d["mean"], *d["ci95"]) if d else "" for d in diffs)
                         + " |")
    if summary["failed"]:
        lines += ["\n## Failed runs (left out of every mean)\n", "| run | exit | error | log |", "|---|---|---|---|"]
        for f in summary["failed"]:
            error = (f["error"] or ["no error line"])[-1].replace("|", "\\|")
            lines.append(f"| {f['run']} | {f['returncode']} | {error} | {f['log']} |")
    if summary.get("not_run"):
        lines.append(f"\nNot run yet (rerun the sweep's command to go on): {', '.join(summary['not_run'])}")
    return "\n".join(lines) + "\n"


def write_summary(out, sweep, only=None):
    summary = summarize(out, sweep, only)
    save_json(os.path.join(out, "summary.json"), summary)
    text = markdown(summary)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    groups = {variant: list(runs.values()) for variant, runs in sweep_runs(out, sweep, only).items()}
    written, skipped = make_plots(groups, os.path.join(out, "plots"))
    print(f"plots: {', '.join(written.values()) or 'none'}" + (f" (no data for: {', '.join(skipped)})"
                                                                 if skipped else ""), flush=True)
    return summary


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # flags after -- go to every run
    argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description="spo.py over variants x seeds; flags after -- go to every run")
    p.add_argument("--variants", nargs="+", default=["spo", "grpo"],
                   help=f"NAME or NAME:SEEDS (e.g. spo:0-4); known: {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default="0-2", help="seeds of variants given without their own: 0-2, or 0,3,4")
    p.add_argument("--define", action="append", default=[], help="NAME='spo.py flags': a variant of your own")
    p.add_argument("--out", required=True, help="the sweep's directory (runs, logs, summary, plots)")
    p.add_argument("--reference", default="spo", help="variant the paired differences are taken against")
    p.add_argument("--nproc", type=int, default=2, help="torchrun --nproc_per_node of every run")
    p.add_argument("--probe_every", type=int, default=10, help="SPO variants: tracker probe period (0: off)")
    p.add_argument("--probe_prompts", type=int, default=64, help="SPO variants: prompts the probe follows")
    p.add_argument("--probe_samples", type=int, default=16, help="SPO variants: fresh samples per probed prompt")
    p.add_argument("--pool_per_seed", action="store_true", help="each seed's --train_prompts pool drawn by the "
                   "seed (--pool_seed), the same for every variant: intervals that cover the pool too")
    p.add_argument("--summary_only", action="store_true", help="run nothing: summary and plots of what is there")
    args = p.parse_args(argv)
    if args.summary_only:
        write_summary(args.out, {**read_sweep(args.out), "reference": args.reference})
        return 0
    return run_sweep(args, extra)


if __name__ == "__main__":
    sys.exit(main())
