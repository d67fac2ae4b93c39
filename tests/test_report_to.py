"""--report_to: a tracker shows metrics.jsonl's scalars and samples.jsonl's generations, one history per run even
across a kill and --resume; a tracker that is not installed is one line before anything heavy; the run's tracker
ids survive a resume.

    .venv/bin/python -m pytest tests/test_report_to.py -q
"""
import json
import math
import subprocess
import sys

import pytest

from common import ENV, ROOT, ok, toy_args, torchrun
from machinery.trackers import SAMPLES_PER_STEP, TRACKER_IDS, _markdown, tracker_ids

# spo.py with a package made unimportable the way Python spells it (a None in sys.modules: import raises
# ImportError, find_spec answers None), whether or not it is installed here
WITHOUT = "import runpy, sys; sys.modules[sys.argv[1]] = None; sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], " \
          "run_name='__main__')"


@pytest.mark.parametrize("name", ["tensorboard", "trackio", "wandb"])
def test_a_tracker_not_installed_is_one_line_naming_pip(name, tmp_path):
    proc = subprocess.run([sys.executable, "-c", WITHOUT, name, "spo.py", "--report_to", "none", name, "--run_dir",
                           str(tmp_path / "run")], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines == [f"error: --report_to {name}: {name} is not installed; pip install "
                                              f"{name}"], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # said before the run directory, the model or the engine


def test_tracker_ids_are_kept_on_resume_and_new_otherwise(tmp_path):
    first = tracker_ids(str(tmp_path), resumed=False)
    assert json.loads((tmp_path / TRACKER_IDS).read_text()) == first
    assert tracker_ids(str(tmp_path), resumed=True) == first
    assert tracker_ids(str(tmp_path), resumed=False)["wandb"] != first["wandb"]  # a new run: a new wandb run
    (tmp_path / TRACKER_IDS).write_text('{"wandb": "../x"')  # cut off, as by a crash: new ids, never a failure
    again = tracker_ids(str(tmp_path), resumed=True)
    assert again["wandb"].isalnum() and json.loads((tmp_path / TRACKER_IDS).read_text()) == again


def _tensorboard_history(run, text=False):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    history = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    if text:  # the samples table, one markdown text per step
        return [(e.step, e.tensor_proto.string_val[0].decode()) for e in history.Tensors("samples/text_summary")]
    return {tag: [(e.step, e.value) for e in history.Scalars(tag)] for tag in history.Tags()["scalars"]}


@pytest.mark.slow
def test_tensorboard_keeps_one_history_through_a_kill_and_resume(small_toy, tmp_path):
    """Killed after logging step 4 and before its checkpoint landed, the run resumes from step 2 and logs steps 3-4
    again: TensorBoard's reader shows each step once, with exactly metrics.jsonl's numbers, and samples.jsonl holds
    each step's few generations once, as TensorBoard's samples table does."""
    run = tmp_path / "run"
    args = toy_args(small_toy, run, "--steps", "4", "--save_every", "2", "--report_to", "tensorboard", "--resume",
                    "auto")  # a new run: its directory is empty
    proc = torchrun(2, "tests/test_end_to_end.py", "crash_before_rename", *args[1:])
    assert proc.returncode != 0 and (run / "checkpoints" / "latest").read_text() == "step_000002"
    killed = _tensorboard_history(run)
    assert max(step for points in killed.values() for step, _ in points) == 4  # steps 3-4 were logged, then lost
    assert [json.loads(line)["step"] for line in open(run / "samples.jsonl")][-1] == 4
    ids = (run / TRACKER_IDS).read_text()
    ok(torchrun(2, *toy_args(small_toy, run, "--steps", "4", "--save_every", "2", "--resume", "auto")))  # resumed
    assert (run / TRACKER_IDS).read_text() == ids
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    expected = {}
    for r in rows:
        for key, value in r.items():
            if key not in ("step", "time"):
                expected.setdefault(key, []).append((r["step"], value))
    history = _tensorboard_history(run)
    assert set(history) == set(expected)
    for key, points in expected.items():
        assert [s for s, _ in history[key]] == [s for s, _ in points], key  # each step once, in order
        assert all(math.isclose(got, float(want), rel_tol=1e-6, abs_tol=1e-30) for (_, got), (_, want)
                   in zip(history[key], points)), key  # float32 in the event file
    samples = [json.loads(line) for line in open(run / "samples.jsonl")]
    assert [r["step"] for r in samples] == [step for step in (1, 2, 3, 4) for _ in range(SAMPLES_PER_STEP)]
    for r in samples:  # SPO's columns beside the text, each a number
        assert isinstance(r["prompt"], str) and isinstance(r["response"], str) and isinstance(r["truncated"], bool)
        assert r["reward"] in (0.0, 1.0) and 0.875 <= r["rho"] <= 0.96 and r["divergence"] >= 0.0
        assert math.isclose(r["advantage"], r["reward"] - r["value"], abs_tol=1e-6)  # Eq. 8
    # TensorBoard's samples table: the last of each step is samples.jsonl's (its readers drop a replayed step's
    # scalars, not its text: the killed run's tables of steps 3-4 stay beside the resumed run's, docs/flags.md)
    tables = dict(_tensorboard_history(run, text=True))
    assert sorted(tables) == [1, 2, 3, 4]
    for step, text in tables.items():
        assert text == _markdown([r for r in samples if r["step"] == step]), step


@pytest.mark.slow
@pytest.mark.parametrize("case", ["wandb missing", "tensorboard a file"])
def test_resume_says_what_is_wrong_with_its_trackers_before_anything_heavy(spo_run, tmp_path, case):
    """--resume takes --report_to from the run's config.json, which the parser never saw: a tracker not installed
    there, or a run whose tensorboard/ is a file, is one line before the memory estimate, the policy or the engine."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(spo_run[0], run)
    config = json.loads((run / "config.json").read_text())
    config["report_to"] = ["wandb"] if case == "wandb missing" else ["tensorboard"]
    (run / "config.json").write_text(json.dumps(config))
    if case == "tensorboard a file":
        shutil.rmtree(run / "tensorboard", ignore_errors=True)
        (run / "tensorboard").write_text("not a folder")
    proc = subprocess.run([sys.executable, "-c", WITHOUT, "wandb", "spo.py", "--resume", str(run), "--steps", "6"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --report_to "), proc.stderr[-3000:]
    assert ("wandb is not installed" if case == "wandb missing" else "is not a directory") in lines[0]
    assert "memory per rank" not in proc.stdout and "Traceback" not in proc.stderr
