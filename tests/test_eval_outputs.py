"""eval.py's --out_dir under a real eval.py: stopped while it samples (Ctrl-C, kill -TERM) it says one line and leaves
nothing of its evaluation and no lock; of two at once into one --out_dir one writes, the other stops in one line.

    .venv/bin/python -m pytest tests/test_eval_outputs.py -q
"""
import json
import os
import signal
import socket
import subprocess
import time

import pytest

from common import ENV, PYTHON, ROOT, python


def _small(tmp_path):
    """Two toy problems in plain JSONL: a benchmark sampled in moments."""
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps({"problem": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in (1, 2)))
    return str(path)


def _start(*args):
    return subprocess.Popen([PYTHON, "eval.py", "--engine", "hf", *args], cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(path, proc, timeout=300):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_evaluation_says_one_line_and_leaves_nothing(tmp_path, sig):
    """Stopped while it samples its second benchmark: the first's samples file (written) is removed too."""
    out = tmp_path / "eval"
    proc = _start("--data", _small(tmp_path), os.path.join(ROOT, "tasks/built/toy/test.parquet"),
                  "--n_samples", "64", "--out_dir", str(out))
    try:
        _wait_for(out / "small.samples.jsonl", proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: eval.py: interrupted; nothing of this evaluation is left in --out_dir {out}"], err[-3000:]
    assert os.listdir(out) == [] and not (tmp_path / "eval.lock").exists()
    rerun = python("eval.py", "--engine", "hf", "--data", _small(tmp_path), "--n_samples", "1", "--out_dir", str(out))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["small.samples.jsonl", "summary.json", "summary.md"]


def test_of_two_evaluations_into_one_out_dir_the_second_stops_in_one_line(tmp_path):
    """The second starts while the first samples: into the same directory by another name (a link) it is refused,
    as it is, before it reads its model, by the plain name (its model here does not exist)."""
    out, alias = tmp_path / "eval", tmp_path / "alias"
    alias.symlink_to(out)
    first = _start("--n_samples", "64", "--out_dir", str(out))
    try:
        _wait_for(out, first)  # made once its lock is held and its input checked
        seconds = [_start("--data", _small(tmp_path), "--n_samples", "1", "--out_dir", str(alias)),
                   _start("--model", str(tmp_path / "no_model"), "--out_dir", str(out))]
        for name, proc in zip((alias, out), seconds):
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 2, err[-3000:]
            assert [line for line in err.splitlines() if line.startswith("error:")] == [
                f"error: --out_dir {name} is in use by another job (pid {first.pid} on {socket.gethostname()}, "
                f"{out}.lock); if that job is gone, delete the lock file"], err[-3000:]
        assert first.poll() is None and os.listdir(out) == []  # the first samples on, alone
    finally:
        first.kill()
        first.communicate()
