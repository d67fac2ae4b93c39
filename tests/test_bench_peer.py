"""bench/peer.py (`python -m bench peer`): spo.py against TRL's GRPOTrainer. TRL lives in its own interpreter
(--trl_python or SPO_TRL_PYTHON); without it the benchmark says how to install it and stops. The arithmetic of the
table and the plumbing (rounds, flags) run here on hand numbers, with no TRL and no spo.py; the comparison itself
is a benchmark, not a test: the slow smoke test only checks that it runs.

    .venv/bin/python -m pytest tests/test_bench_peer.py -q
"""
import inspect
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
                "spo": [run([1.0, 1.0], [0.5, 0.5]), run([4.0, 6.0], [2.0, 2.0])],
                "TRL bf16": [run([1.0, 1.0], [0.5, 0.5]), run([1.0, 1.0], [0.5, 0.5])],
                "spo bf16": [run([0.5, 0.5], [0.1, 0.1]), run([0.25, 0.25], [0.1, 0.1])]}
    rows = summarise(measured, {"TRL": "TRL", "spo": "TRL", "TRL bf16": "TRL bf16", "spo bf16": "TRL bf16"})
    assert rows["TRL"]["step"] == 6.0 and rows["spo"]["step"] == 2.5  # medians over both rounds' steps
    assert rows["spo"]["ratio"] == 2.5 / 6.0 and rows["TRL"]["ratio"] == 1.0
    assert rows["spo"]["rounds"] == [1.0 / 3.0, 5.0 / 8.0]  # round 1's TRL 3.0, round 2's 8.0
    assert rows["spo"]["phases"] == {"generate": 1.25}
    assert rows["spo bf16"]["ratio"] == 0.375 and rows["spo bf16"]["rounds"] == [0.5, 0.25]  # TRL at bf16's


def test_every_trl_row_gives_its_precision_and_none_is_left_to_trls_defaults():
    from bench.peer import trl_config
    spec = {"steps": 8, "seed": 3, "batch_size": 16, "lr": 1e-5, "max_response_len": 48}
    fp32, bf16 = (trl_config({**spec, "precision": p}, "/run") for p in ("fp32", "bf16"))
    assert fp32["bf16"] is False and bf16["bf16"] is True and fp32["fp16"] is bf16["fp16"] is False
    assert {k: v for k, v in fp32.items() if k != "bf16"} == {k: v for k, v in bf16.items() if k != "bf16"}
    # TRL 1.16's defaults that would differ from spo.py's: bf16 (not fp16), checkpointing on, a linear lr decay,
    # lr 1e-6, weight decay 0, epsilon_high = epsilon, a 512-token budget, seed 42, dropout kept
    assert {k: fp32[k] for k in ("gradient_checkpointing", "lr_scheduler_type", "warmup_steps", "learning_rate",
                                 "weight_decay", "epsilon", "epsilon_high", "max_completion_length", "seed",
                                 "disable_dropout", "beta", "num_iterations", "gradient_accumulation_steps",
                                 "steps_per_generation", "max_grad_norm", "loss_type", "scale_rewards")} == {
        "gradient_checkpointing": False, "lr_scheduler_type": "constant", "warmup_steps": 0, "learning_rate": 1e-5,
        "weight_decay": 0.01, "epsilon": 0.2, "epsilon_high": 0.28, "max_completion_length": 48, "seed": 3,
        "disable_dropout": True, "beta": 0.0, "num_iterations": 1, "gradient_accumulation_steps": 1,
        "steps_per_generation": 1, "max_grad_norm": 1.0, "loss_type": "dapo", "scale_rewards": "group"}
    assert fp32["model_init_kwargs"] == {"dtype": "float32"} and fp32["per_device_train_batch_size"] == 16
    from bench import peer  # the worker builds its GRPOConfig from these, and checks what TRL made of bf16
    assert "trl.GRPOConfig(**trl_config(spec, run_dir))" in inspect.getsource(peer.trl_worker)


def test_the_rows_are_each_launch_at_each_precision_and_bf16_needs_bf16_instructions():
    from bench.peer import plan_rows
    rows, skipped = plan_rows(["fp32", "bf16"], [1, 2], 2, 2, [])
    assert skipped.startswith("bf16 rows skipped: this CPU has no bf16 instructions") and "\n" not in skipped
    assert [(r["who"], r["precision"], r["ranks"], r["threads"]) for r in rows] == [
        ("trl", "fp32", 1, 2), ("grpo", "fp32", 1, 2), ("spo", "fp32", 1, 2), ("grpo", "fp32", 2, 1),
        ("spo", "fp32", 2, 1)]
    rows, skipped = plan_rows(["fp32", "bf16"], [1, 2], 2, 1, ["amx_bf16"])
    assert skipped is None and [r["precision"] for r in rows] == ["fp32"] * 5 + ["bf16"] * 5
    assert all(r["trl"] == f"TRL GRPOTrainer (GRPO), {r['precision']}" for r in rows)  # its own precision's TRL
    assert len({r["label"] for r in rows}) == 10


def test_rounds_alternate_their_order_and_every_row_says_its_precision(monkeypatch, capsys):
    from bench import peer
    from machinery import device
    calls = []

    def program(cmd, run_dir, env):
        calls.append((cmd, env))
        slow = 2.0 if "--nproc_per_node=2" in cmd else 1.0  # two ranks: every phase and step twice one rank's
        return [{"step": s, "time": 10.0 * s * slow, "time/generate": 1.0 * slow, "time/update": 3.0 * slow,
                 "time/step": 4.0 * slow, "memory/peak_gib": 1.0, "about": "TRL x"} for s in (1, 2, 3)]
    monkeypatch.setattr(peer, "run_program", program)
    monkeypatch.setattr(peer.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))  # "TRL is here"
    monkeypatch.setattr(device, "native_bf16", lambda: ["avx512_bf16"])
    rows = peer.bench_peer(steps=3, rounds=2, spo_args=["--lr", "1e-3"])
    order = [("trl" if "_trl" in c else c[c.index("--algo") + 1], json.loads(c[-1])["precision"] if "_trl" in c
              else c[c.index("--bf16") + 1], c[3] if "_trl" not in c else "") for c, _ in calls]
    one = [("trl", "fp32", ""), ("grpo", "off", "--nproc_per_node=1"), ("spo", "off", "--nproc_per_node=1"),
           ("grpo", "off", "--nproc_per_node=2"), ("spo", "off", "--nproc_per_node=2"), ("trl", "bf16", ""),
           ("grpo", "on", "--nproc_per_node=1"), ("spo", "on", "--nproc_per_node=1"),
           ("grpo", "on", "--nproc_per_node=2"), ("spo", "on", "--nproc_per_node=2")]
    assert order == one + one[::-1]
    threads = os.cpu_count() or 1
    assert [int(env["OMP_NUM_THREADS"]) for _, env in calls[:5]] == [1, threads, threads] + [max(1, threads // 2)] * 2
    assert json.loads(calls[0][0][-1])["threads"] == 1  # the toy's TRL: one thread (SmolLM2's: every one)
    spec, spo = json.loads(calls[0][0][-1]), calls[1][0]
    assert {k: spec[k] for k in peer.SAME} == {"steps": 3, "seed": 0, "batch_size": 64, "lr": 2e-4,
                                               "max_response_len": 32}
    assert "--lr=0.0002" in spo and spo[-2:] == ["--lr", "1e-3"]  # the later flag wins in spo.py's argparse
    assert rows["spo.py (SPO), bf16, 2 ranks"]["step"] == 20.0  # steps 1-2 left out (the toy's 5, at most steps - 1)
    out = capsys.readouterr().out
    header, *table = out.split("\nphases, median s per step")[0].split("\nrow ", 1)[1].splitlines()
    end = len("row ") + header.index("precision") + len("precision")
    assert [line[end - 9:end].strip() for line in table] == ["fp32"] * 5 + ["bf16"] * 5  # every row's precision
    # untimed: the wall step less the timed phases, 20 - 8 on two ranks against 10 - 4 on one
    assert "spo.py (SPO), bf16, 2 ranks against 1 rank(s): generate +1.000, update +3.000, untimed +6.000; " \
           "step +10.000" in out
    assert "bf16=" not in out.split("TRL's GRPOConfig (bf16 per row)")[1].split("settings that differ")[0]
    assert "settings that differ (spo.py | TRL)" in out


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
    assert all(label in proc.stdout.split("phases, median s per step", 1)[1]
               for label in ("TRL GRPOTrainer (GRPO), fp32", "spo.py (SPO), fp32, 2 ranks"))
