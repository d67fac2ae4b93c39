"""bench/peer.py (`python -m bench peer`): spo.py against TRL's GRPOTrainer on the toy or SmolLM2-135M. TRL is a
benchmark-only dependency in its own interpreter (--trl_python or SPO_TRL_PYTHON); without it the benchmark says
how to install it and stops. The comparison itself is a benchmark, not a test (the test environment has no TRL); a
quick run of it: `python -m bench peer --trl_python /tmp/trlvenv/bin/python --steps 3`.

    .venv/bin/python -m pytest tests/test_bench_peer.py -q
"""
import os
import subprocess

import pytest

from common import PYTHON, ROOT, ok, python


def test_without_trl_the_benchmark_says_how_to_install_it_and_skips():
    if subprocess.run([PYTHON, "-c", "import trl"], capture_output=True).returncode == 0:
        pytest.skip("this interpreter has trl")
    toy = os.path.join(ROOT, "tasks", "built", "toy")  # a task that is there: the TRL check is the one that stops
    proc = ok(python("-m", "bench", "peer", "--trl_python", PYTHON, "--toy_dir", toy, "--steps", "1"))
    assert "skipped: TRL is not installed" in proc.stdout and "pip install torch==2.13.0 trl" in proc.stdout


def test_a_task_not_built_says_how_to_build_it_before_anything_starts(tmp_path):
    proc = ok(python("-m", "bench", "peer", "--task", "smollm", "--data_dir", str(tmp_path), "--steps", "1"))
    assert f"skipped: no smollm in {tmp_path}" in proc.stdout and "python -m tasks.smollm" in proc.stdout


def _row(step, stamp, phases_sum=None):
    row = {"step": step, "time": stamp}
    if step > 0:
        row["time/step"] = phases_sum
    return row


def test_step_seconds_are_the_gaps_between_stamps_and_the_evaluated_last_is_left_out():
    from bench.peer import step_seconds
    rows = [_row(0, 100.0), _row(1, 103.0, 2.5), _row(2, 104.5, 1.4), _row(3, 110.0, 1.5)]  # step 3 evaluated
    assert step_seconds(rows, evaluated_last=True) == [3.0, 1.5]


def test_without_a_step_0_row_the_first_step_is_its_phases_sum_not_zero():
    from bench.peer import step_seconds
    rows = [_row(1, 103.0, 2.5), _row(2, 104.5, 1.4)]  # --eval_every 0: no step-0 evaluation row
    assert step_seconds(rows, evaluated_last=False) == [2.5, 1.5]
