"""The tracker's and the sampler's guards and checkpoint state: bad input is refused with an error that says what
is wrong, and a saved state restores exactly (and refuses another training set's size).

    .venv/bin/python -m pytest tests/test_state.py -q
"""
import numpy as np
import pytest

from metrics import PromptReach
from sampler import PromptSampler
from tracker import ValueTracker


@pytest.mark.parametrize("index, reward, rho, match", [
    ([0, 0], [1.0, 0.0], [0.9, 0.8], "different rho"),
    ([0], [np.nan], 0.9, "NaN"),
    ([7], [1.0], 0.9, "out of range"),
    ([-1], [1.0], 0.9, "out of range"),
    ([0, 1], [1.0], 0.9, "same length"),
    ([0.0], [1.0], 0.9, "integer"),
    ([0], [1.0], 1.5, r"\[0, 1\]"),
])
def test_update_rejects_bad_input(index, reward, rho, match):
    with pytest.raises(ValueError, match=match):
        ValueTracker(3).update(np.array(index), np.array(reward), rho)


def test_tracker_state_round_trip_and_size_check():
    tracker = ValueTracker(4, rho_constant=0.9)
    tracker.update(np.array([0, 2]), np.array([1.0, 0.0]), 0.9)
    state = tracker.state_dict()
    tracker.update(np.array([0]), np.array([0.0]), 0.9)  # the saved state must not alias the live arrays
    restored = ValueTracker(4)
    restored.load_state_dict(state)
    assert restored.rho_constant == 0.9
    np.testing.assert_array_equal(restored.alpha, [1.45, 0.5, 0.45, 0.5])
    with pytest.raises(ValueError, match="4 prompts, this run has 5"):
        ValueTracker(5).load_state_dict(state)


@pytest.mark.parametrize("call, match", [
    (lambda s: s.draw(11), "batch_size"),
    (lambda s: s.draw(0), "batch_size"),
    (lambda s: s.set_weights(np.ones(9)), "expected 10 weights"),
    (lambda s: s.set_weights(-np.ones(10)), ">= 0"),
    (lambda s: s.set_weights(np.full(10, np.nan)), "finite"),
    (lambda s: s.set_weights(np.ones(2), np.array([3, 3])), "repeated"),
    (lambda s: s.set_weights(np.ones(1), np.array([10])), "out of range"),
    (lambda s: s.draw(2, weights=np.zeros(10)), "all prompt weights are 0"),
    (lambda s: s.draw(3, weights=np.array([1.0, 1.0] + [0.0] * 8)), "fewer prompts with weight > 0"),
])
def test_sampler_rejects_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call(PromptSampler(10, seed=0))


def test_sampler_state_size_check():
    with pytest.raises(ValueError, match="10 prompts"):
        PromptSampler(11, seed=0).load_state_dict(PromptSampler(10, seed=0).state_dict())


@pytest.mark.parametrize("keys_field", ["prompt_ids", "prompt_keys"])  # before the renames; before shards
def test_a_checkpoint_from_an_older_spo_is_refused_in_one_line(tmp_path, capsys, keys_field):
    import torch
    import checkpoint
    step = tmp_path / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_000002")
    torch.save({"step": 2, "world_size": 1, keys_field: ["0123456789abcdef"]}, step / "state.pt")  # no shards/
    with pytest.raises(SystemExit):
        checkpoint.load_checkpoint(str(tmp_path), 1, ["0123456789abcdef"])
    err = capsys.readouterr().err
    assert "older spo.py" in err and str(step / "model") in err and len(err.strip().splitlines()) == 1


# ---- run directories (checkpoint.py): one run per directory, one job at a time
def test_a_fresh_run_refuses_a_directory_that_holds_a_run(tmp_path):
    import checkpoint
    (tmp_path / "metrics.jsonl").write_text('{"step": 20}\n')
    error = checkpoint.claim_run_dir(str(tmp_path), resume=False, name="spo.py")
    assert "already holds a run (metrics.jsonl)" in error and f"--resume {tmp_path}" in error
    assert not (tmp_path / ".lock").exists()  # refused before anything was written
    assert "no run with checkpoints" in checkpoint.claim_run_dir(str(tmp_path / "new"), resume=True, name="spo.py")


def test_a_live_lock_keeps_a_second_job_out_and_a_stale_one_is_taken_over(tmp_path):
    import os
    import socket
    import subprocess
    import checkpoint
    run, host = tmp_path / "run", socket.gethostname()
    assert checkpoint.claim_run_dir(str(run), resume=False, name="spo.py") is None
    assert (run / ".lock").read_text().split() == [host, str(os.getpid())]
    with subprocess.Popen(["sleep", "60"]) as live:  # another job, alive
        (run / ".lock").write_text(f"{host} {live.pid}\n")
        error = checkpoint.claim_run_dir(str(run), resume=False, name="spo.py")  # still fresh: no run files yet
        live.kill()
    assert "in use by another job" in error and str(live.pid) in error
    (run / ".lock").write_text("")  # a job between creating its lock and writing it: in use...
    assert "in use by another job (one starting now" in checkpoint.claim_run_dir(str(run), False, "spo.py")
    os.utime(run / ".lock", (0, 0))  # ...unless the empty lock is old
    assert checkpoint.claim_run_dir(str(run), resume=False, name="spo.py") is None
    for pid in (live.pid, os.getpid()):  # gone; ours (a restarted container handed this process a dead job's pid)
        (run / ".lock").write_text(f"{host} {pid}\n")
        assert checkpoint.claim_run_dir(str(run), resume=False, name="spo.py") is None
        assert (run / ".lock").read_text().split() == [host, str(os.getpid())]


def test_resume_keeps_the_runs_settings_and_names_each_changed_one():
    import checkpoint
    saved = {"lr": 2e-4, "seed": 0, "steps": 20, "algo": "spo", "eval_every": 25}
    settings, errors = checkpoint.resumed_settings(saved, {"steps": 40, "eval_every": 5})
    assert not errors and settings == {**saved, "steps": 40, "eval_every": 5}
    settings, errors = checkpoint.resumed_settings(saved, {"lr": 1e-3, "seed": 0, "algo": "grpo"})
    assert len(errors) == 2 and settings["lr"] == 2e-4
    assert errors[0].startswith("--algo grpo: the run being resumed has spo")
    assert errors[1].startswith("--lr 0.001: the run being resumed has 0.0002")


def test_metrics_are_cut_back_to_the_checkpoint_on_resume(tmp_path):
    import json
    from metrics import Logger
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(7)))
    Logger(str(tmp_path), {}, True, resume_step=4).close()
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    # a crash mid-write (the reason to resume) leaves a row cut off, or a last row without its newline
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "rew\n{"step": 3}')
    logger = Logger(str(tmp_path), {}, True, resume_step=3)
    logger.log(4, {"reward/mean": 0.5})
    logger.close()
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [0, 1, 3, 4]


def test_no_room_for_a_checkpoint_is_found_before_the_engine_starts(tmp_path):
    """check_disk estimates a checkpoint from the parameter count (fp32 weights, Adam moments, the export): a
    model of 10^12 parameters (on the meta device: no memory) needs 14.5 TiB, which this disk does not have."""
    import subprocess
    import sys
    from common import ENV, ROOT
    code = ("import torch, torch.distributed as dist, checkpoint\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
            "model = torch.nn.Linear(10**6, 10**6, bias=False, device='meta')\n"
            f"checkpoint.check_disk({str(tmp_path)!r}, model, export_bytes_per_parameter=4)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith(f"error: --run_dir {tmp_path}:")
    assert "a checkpoint needs about 14901.2 GiB" in proc.stderr


def test_prompt_reach_counts_prompts_never_trained_on_and_restores():
    """--oversample's run-long count: a prompt drawn twice and kept once is reached; one only ever aborted is not."""
    reach = PromptReach(5)
    reach.update(np.array([0, 1, 2]), np.array([0, 2]))
    reach.update(np.array([1, 3]), np.array([3]))
    assert reach.metrics() == {"oversample/prompts_drawn": 4, "oversample/never_trained_share": 1 / 4}
    restored = PromptReach(5)
    restored.load_state_dict(reach.state_dict())
    restored.update(np.array([1]), np.array([1]))  # counting goes on after a resume
    assert restored.metrics()["oversample/never_trained_share"] == 0.0


def test_an_all_equal_batch_is_counted_and_said_once(tmp_path, capsys):
    import json
    from metrics import Logger
    logger = Logger(str(tmp_path), {"ppo_steps": 1}, True)
    for step, (mean, all_equal) in enumerate([(0.5, 0.0), (0.0, 1.0), (0.3, 0.0), (1.0, 1.0)], start=1):
        logger.log(step, {"reward/mean": mean, "reward/all_equal": all_equal})
    logger.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["reward/all_equal_steps"] for r in rows] == [0, 1, 1, 2]
    notes = [line for line in capsys.readouterr().out.splitlines() if "every reward of the batch" in line]
    assert len(notes) == 1 and notes[0].startswith("step 2: every reward of the batch is 0 ")
    resumed = Logger(str(tmp_path), {"ppo_steps": 1}, True, resume_step=3)  # the count survives a resume
    resumed.log(4, {"reward/mean": 1.0, "reward/all_equal": 1.0})
    resumed.close()
    assert json.loads(open(tmp_path / "metrics.jsonl").readlines()[-1])["reward/all_equal_steps"] == 2
    assert "every reward" not in capsys.readouterr().out  # said once per run


def test_the_console_shows_kl_only_when_it_can_move(tmp_path, capsys):
    """With one optimiser step per batch the update starts on-policy: approx_kl is 0 and leaves the console line;
    SPO's mean D(x) over revisited prompts shows how far the policy moves."""
    from metrics import Logger
    metrics = {"reward/mean": 0.5, "policy/approx_kl": 0.0, "tracker/divergence_revisit_mean": 0.04,
               "response/truncated": 0.25}
    for ppo_steps, shown in ((1, False), (8, True)):
        logger = Logger(str(tmp_path / str(ppo_steps)), {"ppo_steps": ppo_steps}, True)
        logger.log(1, metrics, console=True)
        logger.close()
        line = capsys.readouterr().out.splitlines()[-1]
        assert line.startswith("step 1: reward=0.5 D=0.04") and "cut=0.25" in line and ("kl=" in line) == shown
