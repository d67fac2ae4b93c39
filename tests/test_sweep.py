"""experiments/sweep.py and experiments/plots.py: the statistics on hand-made numbers, the summary and plots on
hand-written run directories (fast), and one real sweep of two tiny runs on the small toy (slow): a half-finished
sweep resumed (the finished run skipped, the interrupted one continued from its checkpoint), a failed run reported
and left out, the plots written, and the tracker probe leaving training's metrics exactly as they are without it.

    python -m pytest tests/test_sweep.py -q              # everything here
    python -m pytest tests/test_sweep.py -q -m "not slow"
"""
import argparse
import json
import math
import os
import shutil
import socket
import subprocess

import numpy as np
import pytest

from experiments import analysis
from experiments import plots
from experiments import sweep
from common import ENV, PYTHON, ROOT, toy_args


# ------------------------------------------------------------------------------------------------ statistics
def test_t_quantiles_match_the_tables():
    assert analysis.t975(1) == 12.706 and analysis.t975(4) == 2.776 and analysis.t975(30) == 2.042
    # past the table its last value: never narrower than the printed 2.040 (31), 2.021 (40), 1.960 (infinity)
    for df, table in ((31, 2.040), (40, 2.021), (10 ** 6, 1.960)):
        assert table <= analysis.t975(df) <= 2.042, (df, analysis.t975(df))
    assert math.isnan(analysis.t975(0))


def test_mean_ci_by_hand():
    mean, low, high, n = analysis.mean_ci([1.0, 2.0, 3.0])  # sd 1, half-width 4.303 / sqrt(3)
    assert (mean, n) == (2.0, 3) and low == pytest.approx(2 - 4.303 / 3 ** 0.5) and high == pytest.approx(
        2 + 4.303 / 3 ** 0.5)
    mean, low, high, n = analysis.mean_ci([0.5, float("nan"), None])  # one finite value: no interval, not a zero one
    assert (mean, n) == (0.5, 1) and math.isnan(low) and math.isnan(high)
    assert analysis.mean_ci([])[3] == 0


def test_prediction_interval_by_hand():
    """One more run's 95% range: mean +- t_{0.975, 4} sd sqrt(1 + 1/5) for 1..5 (2.776 x 1.581 x 1.095 = 4.808):
    sqrt(n + 1) times the mean's interval; none from one value."""
    low, high = analysis.prediction_interval([1, 2, 3, 4, 5])
    assert abs(high - 3 - 4.808) < 2e-3 and abs((3 - low) - (high - 3)) < 1e-12
    mean, ci_low, _, _ = analysis.mean_ci([1, 2, 3, 4, 5])
    assert abs((high - mean) / (mean - ci_low) - math.sqrt(6)) < 1e-9
    assert all(math.isnan(x) for x in analysis.prediction_interval([0.4]))


def test_paired_difference_uses_common_seeds_only():
    values, reference = {0: 0.5, 1: 0.6, 2: 0.7}, {0: 0.4, 1: 0.4, 3: 0.9}  # seeds 0 and 1 in both: diffs .1, .2
    mean, low, high, n = analysis.paired_difference(values, reference)
    half = 12.706 * np.std([0.1, 0.2], ddof=1) / 2 ** 0.5
    assert n == 2 and mean == pytest.approx(0.15) and (low, high) == pytest.approx((0.15 - half, 0.15 + half))
    # pairing removes what the seeds share: a constant offset has a zero-width interval
    assert analysis.paired_difference({0: 0.3, 1: 0.8}, {0: 0.2, 1: 0.7})[1:3] == pytest.approx((0.1, 0.1))


# ------------------------------------------------------------------------------------------------ planning
def args_for(*argv):
    """sweep.py's parsed flags and pass-through args, as main() would see them (without running)."""
    extra = list(argv[argv.index("--") + 1:]) if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    captured = {}
    original = sweep.run_sweep
    sweep.run_sweep = lambda args, extra_: captured.update(args=args, extra=extra_) or 0
    try:
        sweep.main(list(argv) + (["--", *extra] if extra else []))
    finally:
        sweep.run_sweep = original
    return captured["args"], captured["extra"]


def test_plan_seeds_probe_and_owned_flags():
    args, extra = args_for("--variants", "spo:0-1", "grpo", "k3", "--seeds", "3,5", "--out", "x", "--", "--steps", "4")
    runs = {name: flags for name, _, _, flags in sweep.plan(args, extra)}
    assert list(runs) == ["spo-s0", "spo-s1", "grpo-s3", "k3-s3", "grpo-s5", "k3-s5"]  # seed by seed
    assert runs["grpo-s3"] == ["--algo", "grpo", "--steps", "4"]  # no probe: GRPO has no tracker
    assert runs["k3-s5"][:4] == ["--divergence", "k3", "--steps", "4"] and "--probe_every" in runs["k3-s5"]
    assert sweep.parse_seeds("0-2,7") == [0, 1, 2, 7] and sweep.flag_value(["--a", "1", "--a", "2"], "--a") == "2"
    for bad in (("--variants", "nope"), ("--variants", "spo", "--", "--seed", "1")):
        args, extra = args_for(*bad[:2], "--out", "x", *bad[2:])
        with pytest.raises(SystemExit, match="unknown variant|set by the sweep"):
            sweep.plan(args, extra)
    args, extra = args_for("--variants", "mine:0", "--define", "mine=--lr 1e-3 --algo rloo", "--out", "x")
    assert sweep.plan(args, extra) == [("mine-s0", "mine", 0, ["--lr", "1e-3", "--algo", "rloo"])]


def test_a_seeded_pool_is_the_same_for_its_seed_another_for_another_and_in_file_order(tmp_path):
    """--train_prompts N --pool_seed S: N prompts drawn by S (a sweep's intervals then cover the pool), kept in the
    file's order; without a pool seed, the first N."""
    from machinery.data import load_tokenizer, load_train_and_test
    from tasks.toy import BUILT
    path, tokenizer = tmp_path / "p.jsonl", load_tokenizer(f"{BUILT}/toy/model")
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)})
                            + "\n" for i in range(40)))
    pool = lambda seed: load_train_and_test(tokenizer, str(path), None, max_prompt_len=64, train_prompts=8,  # noqa
                                            test_prompts=0, min_prompts=1, system_prompt=None, verbose=False,
                                            pool_seed=seed)[0].answers
    assert pool(3) == pool(3) != pool(4) and len(set(pool(3))) == 8
    assert pool(3) == sorted(pool(3), key=int) and pool(-1) == [str(i + 1) for i in range(8)]


def test_pool_per_seed_gives_every_variant_of_a_seed_that_seeds_pool():
    args, extra = args_for("--variants", "spo", "grpo", "--seeds", "3-4", "--pool_per_seed", "--probe_every", "0",
                           "--out", "x")
    runs = {name: flags for name, _, _, flags in sweep.plan(args, extra)}
    assert runs["spo-s3"] == ["--pool_seed", "3"] and runs["grpo-s4"] == ["--algo", "grpo", "--pool_seed", "4"]


# ------------------------------------------------------------------------------------------------ hand-written runs
def fake_run(run_dir, accuracy, steps=4, generated=16, checkpoint=None, metrics=None):
    """A run directory as spo.py leaves it: config.json, metrics.jsonl (accuracy: {step: value} at evaluation
    steps), checkpoints/latest at `checkpoint` (default: the last step), and per-step `metrics` {key: value}."""
    os.makedirs(os.path.join(run_dir, "checkpoints"), exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"steps": steps, "batch_size": generated, "baseline": "tracker", "lr": 2e-5, "n0": 8, "seed": 0,
                   "offline_values": "tasks/built/toy/offline_values.json"}, f)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step in range(steps + 1):
            row = {"step": step, **({"eval/accuracy": accuracy[step]} if step in accuracy else {})}
            if step > 0:
                row.update({"sampling/generated": generated, **(metrics or {})})
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(run_dir, "checkpoints", "latest"), "w") as f:
        f.write(f"step_{checkpoint or steps:06d}")


def test_run_state(tmp_path):
    assert sweep.run_state(str(tmp_path / "none"), 4) == "new"
    os.makedirs(tmp_path / "died")  # died before its first checkpoint
    assert sweep.run_state(str(tmp_path / "died"), 4) == "restart"
    fake_run(str(tmp_path / "half"), {0: 0.1}, checkpoint=2)
    assert sweep.run_state(str(tmp_path / "half"), 4) == "resume"
    fake_run(str(tmp_path / "done"), {0: 0.1})
    assert sweep.run_state(str(tmp_path / "done"), 4) == "finished"
    assert sweep.run_state(str(tmp_path / "done"), 8) == "resume"  # the sweep now asks for more steps


def test_a_run_of_another_plan_is_one_line_not_a_finished_run(tmp_path):
    """A sweep restarted under the same --out with another plan (here another --lr, then another --n0 in a record
    only): one line naming the run and the setting, before anything runs, and its lock given back."""
    out = str(tmp_path)
    fake_run(os.path.join(out, "runs", "spo-s0"), {0: 0.1}, steps=150, generated=64)
    argv = ["--out", out, "--variants", "spo:0", "--", "--lr", "1e-05"]
    with pytest.raises(SystemExit, match=r"runs/spo-s0 was made with other settings than this plan's: --lr 1e-05 "
                                         r"\(the run: 2e-05\);"):
        sweep.main(argv)
    assert not os.path.exists(os.path.join(out, ".sweep.lock"))
    assert sweep.settings_differ(json.load(open(os.path.join(out, "runs", "spo-s0", "config.json"))),
                                 ("--lr", "2e-05", "--seed", "0")) == []  # (what the parser leaves to start: not)
    sweep.write_record(os.path.join(out, "runs", "spo-s0"), os.path.join(out, "records", "spo-s0"))
    shutil.rmtree(os.path.join(out, "runs"))
    with pytest.raises(SystemExit, match=r"records/spo-s0 was made with .*: --n0 4 \(the run: 8\)"):
        sweep.main(["--out", out, "--variants", "spo:0", "--", "--lr", "2e-05", "--n0", "4"])


def test_a_killed_sweeps_lock_is_taken_over_a_live_ones_refuses(tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / ".sweep.lock").write_text(f"{socket.gethostname()} {dead.pid}\n")
    lock = sweep.acquire_lock(str(tmp_path))
    assert "removing a stale lock" in capsys.readouterr().out
    live = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / ".sweep.lock").write_text(f"{socket.gethostname()} {live.pid}\n")
        with pytest.raises(SystemExit, match=f"is in use by another job \\(pid {live.pid} on"):
            sweep.acquire_lock(str(tmp_path))
    finally:
        live.kill()
    assert lock == str(tmp_path / ".sweep.lock")


def test_a_record_stands_in_for_its_run(tmp_path):
    """A finished run's record (config and logs in the sweep's one archive, committed) is read like the run: on a
    machine without the
    run directory the sweep counts it finished and the summary is the same; a record of a shorter run is not."""
    out = str(tmp_path)
    run_dir, record = os.path.join(out, "runs", "spo-s0"), os.path.join(out, "records", "spo-s0")
    fake_run(run_dir, {0: 0.1, 2: 0.3, 4: 0.5})
    with open(os.path.join(run_dir, "probe.jsonl"), "w") as f:
        f.write(json.dumps({"step": 4, "value": [0.5], "success": [0.5], "probe/mae": 0.0}) + "\n")
    state = {"reference": "spo", "runs": {"spo-s0": {"name": "spo-s0", "variant": "spo", "seed": 0,
                                                      "status": "finished"}}}
    from_run = sweep.summarize(out, state)
    sweep.write_record(run_dir, record)
    first = open(os.path.join(out, "records.tar.gz"), "rb").read()
    sweep.write_record(run_dir, record)
    assert open(os.path.join(out, "records.tar.gz"), "rb").read() == first  # the same bytes: commits stay quiet
    shutil.rmtree(run_dir)
    assert sweep.run_state(run_dir, 4, record) == "finished" and sweep.run_state(run_dir, 8, record) == "new"
    assert json.dumps(sweep.summarize(out, state)) == json.dumps(from_run)  # (NaN intervals: compare as text)
    assert analysis.read_run(record)["probe"][4]["success"] == [0.5]
    assert sweep.read_sweep(out)["runs"] == state["runs"]  # no sweep.json here: the records say what finished
    with pytest.raises(SystemExit, match="neither a sweep.json nor records"):
        sweep.read_sweep(str(tmp_path / "empty"))


def test_summary_and_plots_on_hand_written_runs(tmp_path):
    out = str(tmp_path)
    signal = {"signal/adv_var_raw": 0.2, "signal/adv_var_effective": 0.3, "zero_signal/abs_adv_le_0.02": 0.1,
              "zero_signal/abs_adv_le_1e-4": 0.0, "tracker/rho_p10": 0.88, "tracker/rho_p50": 0.9,
              "tracker/rho_p90": 0.95, "tracker/rho_at_min": 0.5, "tracker/rho_at_max": 0.1}
    runs = {"spo-s0": ("spo", 0, {0: 0.1, 2: 0.3, 4: 0.5}), "spo-s1": ("spo", 1, {0: 0.1, 2: 0.4, 4: 0.6}),
            "grpo-s0": ("grpo", 0, {0: 0.1, 2: 0.2, 4: 0.4}), "grpo-s1": ("grpo", 1, {0: 0.1, 2: 0.2, 4: 0.4})}
    for name, (variant, seed, acc) in runs.items():
        fake_run(os.path.join(out, "runs", name), acc, metrics=signal if variant == "spo" else
                 {"signal/adv_var_raw": 1.0, "signal/adv_var_effective": 1.2, "zero_signal/degenerate_groups": 0.4})
    with open(os.path.join(out, "runs", "spo-s0", "probe.jsonl"), "w") as f:
        for step in (0, 2, 4, 4):  # a resumed run repeats step 4: the last line wins
            f.write(json.dumps({"step": step, "value": [0.2, 0.5], "success": [0.25, 0.5 + step / 100],
                                "probe/mae": step / 200, "probe/mae_floor": 0.05}) + "\n")
    state = {"reference": "spo", "runs": {name: {"name": name, "variant": v, "seed": s, "status": "finished"}
                                          for name, (v, s, _) in runs.items()}}
    state["runs"]["grpo-s2"] = {"name": "grpo-s2", "variant": "grpo", "seed": 2, "status": "failed",
                                "returncode": 2, "error": ["error: --lr must be positive, got -1.0"],
                                "log": "logs/grpo-s2.log"}
    state["runs"]["spo-s2"] = {"name": "spo-s2", "variant": "spo", "seed": 2}  # planned, not started: not a failure
    summary = sweep.write_summary(out, state)
    spo_4, grpo_4 = summary["variants"]["spo"]["steps"]["4"], summary["variants"]["grpo"]["steps"]["4"]
    assert spo_4["accuracy_mean"] == pytest.approx(0.55) and spo_4["n"] == 2 and spo_4["generated"] == 64
    assert spo_4["accuracy_ci95"] == pytest.approx([0.55 - 12.706 * 0.05, 0.55 + 12.706 * 0.05])
    assert grpo_4["paired_diff"]["mean"] == pytest.approx(-0.15) and grpo_4["paired_diff"]["n"] == 2
    assert summary["variants"]["grpo"]["seeds_used"] == [0, 1] and summary["variants"]["grpo"]["seeds_failed"] == [2]
    assert summary["budgets"] == [[4, 64]] and [f["run"] for f in summary["failed"]] == ["grpo-s2"]
    assert summary["variants"]["spo"]["seeds_not_run"] == [2] and summary["not_run"] == ["spo-s2"]
    text = open(os.path.join(out, "summary.md")).read()
    assert "| grpo | 2 (1 failed) |" in text and "--lr must be positive" in text and "equal budget" in text
    assert "| spo | 2 (1 not run yet) |" in text
    for name in ("accuracy", "zero_signal", "adv_variance", "tracker_probe", "rho"):
        assert os.path.getsize(os.path.join(out, "plots", f"{name}.png")) > 10_000, name
    assert analysis.read_run(os.path.join(out, "runs", "spo-s0"))["probe"][4]["success"][1] == pytest.approx(0.54)


def test_the_intervals_say_they_cover_the_pool_where_each_seed_drew_its_own(tmp_path):
    """With --pool_per_seed every seed trains on its own pool: the summary's and the primary's headers say their
    intervals cover the pool's draw; with one pool for every seed, training randomness only."""
    for per_seed in (False, True):
        out, runs = str(tmp_path / str(per_seed)), {}
        for variant, seed in [("spo", 0), ("spo", 1), ("grpo", 0), ("grpo", 1)]:
            name = f"{variant}-s{seed}"
            runs[name] = {"name": name, "variant": variant, "seed": seed, "status": "finished"}
            fake_run(os.path.join(out, "runs", name), {0: 0.1, 4: 0.3 + seed / 10 + (variant == "spo") / 20})
            with open(os.path.join(out, "runs", name, "config.json"), "w") as f:
                json.dump({"steps": 4, "batch_size": 16, "train": "gone", "train_prompts": 8,
                           "pool_seed": seed if per_seed else -1}, f)
        sweep.save_json(os.path.join(out, "sweep.json"), {"reference": "spo", "runs": runs})
        text = (sweep.markdown(sweep.summarize(out, sweep.read_sweep(out))) +
                analysis.primary_markdown(analysis.analyse(out, "spo", key="eval/accuracy")))
        assert text.count("the pool's draw") == 2 * per_seed and text.count("same model, pool") == 2 * (not per_seed)


# ------------------------------------------------------------------------------------------------ a real sweep
def sweep_cmd(out, small_toy, *argv):
    """sweep.py on the small toy: the flags of conftest's spo_run (4 steps, checkpoints every 2), so the SPO run
    here, probed, can be compared with it."""
    flags = toy_args(small_toy, "unused", "--steps", "4", "--save_every", "2")[1:]
    at = flags.index("--run_dir")
    flags = flags[:at] + flags[at + 2:]
    return [PYTHON, "-m", "experiments.sweep", "--out", str(out), "--seeds", "0", "--probe_every", "2",
            "--probe_prompts", "8",
            "--probe_samples", "4", *argv, "--", *flags]


def comparable(rows):
    """Training's metrics of each step: what the probe must not change (times, the process's peak memory and the
    probe's own left out)."""
    return {row["step"]: {k: v for k, v in row.items()
                          if not k.startswith(("time", "throughput", "memory/", "probe/"))}
            for row in rows}


@pytest.mark.slow
def test_sweep_resumes_reports_failures_and_leaves_training_alone(small_toy, spo_run, tmp_path):
    import subprocess
    out = tmp_path / "sweep"
    first = subprocess.run(sweep_cmd(out, small_toy, "--variants", "spo", "grpo"), cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=1200)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # Make GRPO's run look interrupted after its step-2 checkpoint (as a killed sweep leaves it).
    grpo = out / "runs" / "grpo-s0"
    shutil.rmtree(grpo / "checkpoints" / "step_000004")
    (grpo / "checkpoints" / "latest").write_text("step_000002")
    spo_metrics = (out / "runs" / "spo-s0" / "metrics.jsonl").stat().st_mtime
    second = subprocess.run(sweep_cmd(out, small_toy, "--variants", "spo", "grpo", "bad", "--define", "bad=--lr -1"),
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1200)
    assert second.returncode == 1, second.stdout[-3000:] + second.stderr[-3000:]
    console = second.stdout + second.stderr
    assert "spo-s0: finished, skipped" in console
    assert (out / "runs" / "spo-s0" / "metrics.jsonl").stat().st_mtime == spo_metrics
    assert "bad-s0: FAILED (exit" in console and "--lr must be at least 0" in console
    state = json.loads((out / "sweep.json").read_text())
    assert state["runs"]["grpo-s0"]["resumed"] and state["runs"]["grpo-s0"]["status"] == "finished"
    assert state["runs"]["bad-s0"]["status"] == "failed"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["variants"]["spo"]["seeds_used"] == [0] and summary["variants"]["bad"]["seeds_used"] == []
    assert summary["failed"][0]["run"] == "bad-s0" and summary["budgets"] == [[4, 64]]
    assert set(summary["variants"]["grpo"]["steps"]) == {"0", "2", "4"}
    assert "bad-s0" in (out / "summary.md").read_text()
    assert analysis.record_names(str(out / "records")) == ["grpo-s0", "spo-s0"]  # one archive, the resumed run in it
    assert sorted(os.listdir(out / "plots")) == sorted(f"{name}.png" for name in
                                                       ("accuracy", "zero_signal", "adv_variance", "tracker_probe",
                                                        "rho"))
    # The probe samples with its own seeds: training's metrics equal conftest's run without it, step by step.
    probed = [json.loads(line) for line in open(out / "runs" / "spo-s0" / "metrics.jsonl")]
    plain = [json.loads(line) for line in open(spo_run[0] / "metrics.jsonl")]
    assert comparable(probed) == comparable(plain)
    assert [row["step"] for row in probed if "probe/mae" in row] == [0, 2, 4]
    probe = [json.loads(line) for line in open(out / "runs" / "spo-s0" / "probe.jsonl")]
    assert len(probe[-1]["value"]) == 8 and all(0 <= s <= 1 for s in probe[-1]["success"])


def test_the_mixed_sweeps_records_agree_with_their_plans():
    """The plan check on real runs: every record of experiments/mixed (the sweep and its addendum, made at
    50177b3) against the flags its PLAN.md's commands give it, parsed by today's spo.py: no setting differs (a
    check that refused its own sweep would stop every restart)."""
    from experiments.analysis import read_run, record_names
    out = os.path.join(ROOT, "experiments", "mixed")
    planned = [argparse.Namespace(variants=variants, define=define, seeds="10-17", probe_every=50, probe_prompts=256,
                                  probe_samples=16, pool_per_seed=True)
               for variants, define in ((["spo", "grpo", "uniform", "no_baseline", "rho_none"], []),
                                        (["no_offline", "spo_g8"], ["spo_g8=--group_size 8"]))]
    runs = {name: (seed, flags) for args in planned for name, _, seed, flags in sweep.plan(args, ["--preset", "mixed"])}
    records = record_names(os.path.join(out, "records"))
    assert len(records) >= 49 and set(records) <= set(runs)
    for name in records:
        seed, flags = runs[name]
        config = read_run(os.path.join(out, "records", name))["config"]
        assert sweep.settings_differ(config, (*flags, "--seed", str(seed))) == [], name
