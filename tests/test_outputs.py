"""Holds and outputs that collide or outlive their owner (machinery/run_dir.py): what live holds of checkpoints
keep is counted and named by the disk check (tests/test_eval.py: stale holds cleared); one writer per --out and
--out_dir; an earlier evaluation kept, not overwritten; a write stopped midway leaves no half file.

    .venv/bin/python -m pytest tests/test_outputs.py -q
"""
import os
import socket
import subprocess
import sys

import pytest

from common import ENV, ROOT, python
from machinery import run_dir


def started(pid):
    """A process's start time, as a lock records it (/proc/<pid>/stat's field 22)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


@pytest.fixture
def live():
    """Another job, alive while the test runs: a real process, with its pid and start time."""
    proc = subprocess.Popen(["sleep", "120"])
    try:
        yield proc.pid, started(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def _hold(root, name, pid, start, files=()):
    """An evaluation's hold as _hold leaves it: checkpoints/.eval-*/ with its owner's lock and linked files."""
    hold = root / name
    (hold / "model").mkdir(parents=True)
    (hold / ".lock").write_text(f"{socket.gethostname()} {pid} {start}\n")
    for f in files:
        os.link(f, hold / "model" / os.path.basename(f))
    return hold


def test_the_bytes_only_live_holds_keep_are_counted(tmp_path, live):
    """A file still in a checkpoint costs nothing more; one whose checkpoint was rotated out is the hold's alone."""
    step = tmp_path / "step_000002"
    step.mkdir()
    (step / "shared.bin").write_bytes(b"x" * 1000)
    (tmp_path / "rotated.bin").write_bytes(b"y" * 3000)
    _hold(tmp_path, ".eval-a", *live, [step / "shared.bin", tmp_path / "rotated.bin"])
    _hold(tmp_path, ".eval-b", *live, [tmp_path / "rotated.bin"])  # two holds of one file: counted once
    os.remove(tmp_path / "rotated.bin")  # the run's rotation
    lock = len((tmp_path / ".eval-a" / ".lock").read_bytes())
    assert run_dir.clear_stale_holds(str(tmp_path))[1] == 3000 + 2 * lock


def test_the_disk_check_says_what_live_holds_keep(tmp_path, live):
    """A run that has no room for a checkpoint is told which evaluations keep rotated-out ones (a sparse file
    stands in for a rotated-out model)."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    with open(checkpoints / "model.safetensors", "wb") as f:
        f.truncate(3 * 2 ** 30)
    _hold(checkpoints, ".eval-a", *live, [checkpoints / "model.safetensors"])
    os.remove(checkpoints / "model.safetensors")
    code = ("import torch, torch.distributed as dist\nfrom machinery import run_dir\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
            "model = torch.nn.Linear(10**6, 10**6, bias=False, device='meta')\n"
            f"run_dir.check_disk({str(tmp_path)!r}, model, export_bytes_per_parameter=4)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"3.0 GiB are kept by evaluations that hold rotated-out checkpoints (pid {live[0]} on " in proc.stderr


@pytest.mark.parametrize("program, flag, output", [("offline_values.py", "--out", "values.json"),
                                                   ("eval.py", "--out_dir", "eval")])
def test_a_second_writer_to_one_output_gets_one_line(tmp_path, live, program, flag, output):
    """The first writer is a live process holding the output's lock; the second stops before its engine starts."""
    out = tmp_path / output
    (tmp_path / f"{output}.lock").write_text(f"{socket.gethostname()} {live[0]} {live[1]}\n")
    proc = python(program, "--engine", "hf", flag, str(out), timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {flag} {out} is in use by another job (pid {live[0]} on {socket.gethostname()}, "
                      f"{out}.lock); if that job is gone, delete the lock file"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not out.exists()


def test_the_process_group_is_released_once_destroyed_though_transformers_imports_after_it():
    """What a program that stops with one line relies on (machinery.errors.fail): transformers' modules import
    torch.distributed.nn, whose defaults would hold the group; its gloo threads alive at exit can abort it (-6)."""
    code = ("import os, time, torch.distributed as dist\nfrom machinery.device import setup_distributed\n"
            "setup_distributed()\nfrom transformers import AutoTokenizer\ndist.destroy_process_group()\n"
            "time.sleep(1)\n"
            "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
            "print(sorted(n for n in names if 'gloo' in n or 'tcpstore' in n))\n")
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


def test_a_lock_left_by_a_writer_that_is_gone_is_taken_over(tmp_path, live):
    lock = tmp_path / "values.json.lock"
    lock.write_text(f"{socket.gethostname()} {live[0]} {live[1] - 1}\n")  # its pid went to a later process
    assert run_dir.claim_output(str(tmp_path / "values.json"), "--out", "offline_values.py") is None
    assert lock.read_text().split()[:2] == [socket.gethostname(), str(os.getpid())]


def test_an_earlier_evaluation_is_kept_not_overwritten(tmp_path, capsys):
    out = tmp_path / "eval"
    out.mkdir()
    for name in ("summary.json", "summary.md", "aime24.samples.jsonl", "pipeline.json"):
        (out / name).write_text(f"earlier {name}")
    assert run_dir.claim_output(str(out), "--out_dir", "eval.py", (".samples.jsonl", "summary.json",
                                                                   "summary.md")) is None
    assert sorted(os.listdir(out)) == ["earlier_1", "pipeline.json"]  # not eval.py's: left alone
    assert (out / "earlier_1" / "summary.json").read_text() == "earlier summary.json"
    assert f"moved to {out / 'earlier_1'}" in capsys.readouterr().out


def test_a_write_stopped_midway_leaves_no_half_file_at_the_final_name(tmp_path, monkeypatch):
    """eval.py's samples file, with the disk full when it is flushed: the earlier file stays as it was."""
    from types import SimpleNamespace
    import eval
    from machinery import collectives
    path = tmp_path / "test.samples.jsonl"
    path.write_text("earlier\n")
    monkeypatch.setattr(collectives, "barrier", lambda: None)  # one process, no group

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    data = SimpleNamespace(keys=["p0"], answers=["2"])
    rollouts = {0: [SimpleNamespace(response_ids=[2, 3], text="2", finish_reason="stop")]}
    with pytest.raises(SystemExit):
        eval.write_samples(str(path), data, {0: [("2", True, None)]}, rollouts, 1, 0, 1)
    assert path.read_text() == "earlier\n" and sorted(os.listdir(tmp_path)) == [path.name]  # no .tmp, no shard


def test_a_full_disk_under_a_run_log_is_one_line(tmp_path, capsys, name="probe.jsonl"):
    """A run's log written to a full disk (/dev/full: every write ENOSPC): one line naming the file and the state of
    the checkpoints, no traceback; another OSError is not dressed up as a full disk."""
    with pytest.raises(SystemExit), run_dir.run_file(str(tmp_path), name), open("/dev/full", "w") as f:
        f.write("{}\n")
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: disk full (No space left on device) while writing {name} in {tmp_path}: there is no checkpoint yet; "
        f"free space, then --resume {tmp_path}"]
    with pytest.raises(PermissionError), run_dir.run_file(str(tmp_path), name):
        raise PermissionError(13, "Permission denied")
