"""bench/peer.py (`python -m bench peer`): spo.py against TRL's GRPOTrainer. TRL lives in its own interpreter
(--trl_python or SPO_TRL_PYTHON); without it the benchmark says how to install it and stops. The arithmetic of the
table and the plumbing (rounds, flags) run here on hand numbers, with no TRL and no spo.py; the comparison itself
is a benchmark, not a test: the slow smoke test only checks that it runs.

    .venv/bin/python -m pytest tests/test_bench_peer.py -q
"""
import json
import os
import subprocess

import pytest

from common import PYTHON, ok, python


def test_without_trl_the_benchmark_says_how_to_install_it_and_skips(tmp_path):
    for interpreter in (PYTHON, str(tmp_path / "no-such-python")):  # no trl there, or no interpreter at all
        proc = ok(python("-m", "bench", "peer", "--trl_python", interpreter, "--steps", "1"))
        assert proc.stdout.startswith(f"skipped: TRL is not installed for {interpreter}")
        assert "pip install torch==2.13.0 trl==1.16.0" in proc.stdout and len(proc.stdout.splitlines()) == 1


def test_a_task_not_built_says_how_to_build_it_before_anything_starts(tmp_path):
    proc = ok(python("-m", "bench", "peer", "--task", "smollm", "--data_dir", str(tmp_path), "--steps", "1"))
    assert f"skipped: no smollm in {tmp_path}" in proc.stdout and "python -m tasks.smollm" in proc.stdout


def test_step_seconds_are_the_gaps_between_stamps_and_the_first_its_phases_sum():
    from bench.peer import step_seconds
    rows = [{"step": 0, "time": 50.0},  # an evaluation row (--spo_args --eval_every): not a step, not a start
            {"step": 1, "time": 103.0, "time/step": 2.5}, {"step": 2, "time": 104.5, "time/step": 1.4},
            {"step": 3, "time": 110.0, "time/step": 1.5}]
    assert step_seconds(rows) == [2.5, 1.5, 5.5]


def test_the_ratio_pools_every_round_and_each_round_is_against_its_own_trl():
    from bench.peer import summarise

    def run(steps, generate):
        return {"steps": steps, "peak_gib": 1.0, "phases": [{"generate": g} for g in generate]}
    measured = {"TRL": [run([2.0, 4.0], [1.0, 3.0]), run([8.0, 8.0], [5.0, 5.0])],  # the machine slows down
                "spo": [run([1.0, 1.0], [0.5, 0.5]), run([4.0, 6.0], [2.0, 2.0])]}
    rows = summarise(measured, "TRL")
    assert rows["TRL"]["step"] == 6.0 and rows["spo"]["step"] == 2.5  # medians over both rounds' steps
    assert rows["spo"]["ratio"] == 2.5 / 6.0 and rows["TRL"]["ratio"] == 1.0
    assert rows["spo"]["rounds"] == [1.0 / 3.0, 5.0 / 8.0]  # round 1's TRL 3.0, round 2's 8.0
    assert rows["spo"]["phases"] == {"generate": 1.25}


def test_rounds_alternate_their_order_and_spo_args_come_last(monkeypatch, capsys):
    from bench import peer
    calls = []

    def program(cmd, run_dir):
        calls.append(cmd)
        return [{"step": s, "time": 10.0 * s, "time/step": 1.0, "memory/peak_gib": 1.0, "about": "TRL x"}
                for s in (1, 2, 3)]
    monkeypatch.setattr(peer, "run_program", program)
    monkeypatch.setattr(peer.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))  # "TRL is here"
    rows = peer.bench_peer(steps=3, rounds=2, spo_args=["--lr", "1e-3"])
    order = ["trl" if "_trl" in c else c[c.index("--algo") + 1] for c in calls]
    assert order == ["trl", "grpo", "spo", "spo", "grpo", "trl"]
    spec, spo = json.loads(calls[0][-1]), calls[1]
    assert {k: spec[k] for k in peer.SAME} == {"steps": 3, "seed": 0, "batch_size": 64, "lr": 2e-4,
                                               "max_response_len": 32}
    assert "--lr=0.0002" in spo and spo[-2:] == ["--lr", "1e-3"]  # the later flag wins in spo.py's argparse
    assert rows["spo.py (SPO)"]["step"] == 10.0  # steps 1-2 left out (the toy's 5, at most steps - 1)
    assert "settings that differ (spo.py | TRL)" in capsys.readouterr().out


def _trl_python():
    for interpreter in (os.environ.get("SPO_TRL_PYTHON"), "/tmp/trlvenv/bin/python"):
        if interpreter and subprocess.run(f"{interpreter} -c 'import trl'", shell=True).returncode == 0:
            return interpreter
    pytest.skip("no interpreter with trl (set SPO_TRL_PYTHON, or build /tmp/trlvenv: bench/peer.py)")


@pytest.mark.slow
def test_the_comparison_runs_on_the_toy_with_trl():
    proc = ok(python("-m", "bench", "peer", "--trl_python", _trl_python(), "--steps", "3", timeout=1800))
    table = proc.stdout.split("s/step", 1)[1]
    assert all(label in table for label in ("TRL GRPOTrainer (GRPO)", "spo.py --algo grpo", "spo.py (SPO)"))
    assert "TRL GRPOTrainer (GRPO) phases (median s): generate" in proc.stdout
