"""A run directory from elsewhere, moved or shared (machinery/untrusted.py, checkpoint.py, run_dir.py): --resume runs
no verifier its config.json names, a run made in another checkout resumes from its checkpoint's model and from data
named where it is now (checked by content), a stale lock whose pid another process has now is taken over, rotation
and resume touch only what they wrote (never through a symbolic link), the tokenizer's files on a disk out of inodes
are one line, and the toy's offline values have one writer (a read-only toy: the run directory's copy).

    .venv/bin/python -m pytest tests/test_resume_moved.py -q
"""
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys

import pytest

import test_checkpoint
from common import ENV, ROOT, ok, python
from test_checkpoint import _one_error

saved_run = test_checkpoint.saved_run  # the fixture: a run directory with two real checkpoints (steps 2 and 4)


def _can_mount():
    proc = subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "none", "/mnt"], capture_output=True)
    return proc.returncode == 0


def _in_mount_namespace(setup, command, tmp_path):
    """command run after setup (shell lines: mounts) in a mount namespace of its own; (returncode, output)."""
    if not _can_mount():
        pytest.skip("needs a mount namespace (root with CAP_SYS_ADMIN)")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f"set -e; {setup}; set +e; {command}"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    return proc


# ---- item: config.json names code
def test_resume_runs_no_verifier_that_its_config_names(saved_run, tmp_path, capsys):
    """A run directory from elsewhere whose config.json names a verifier file: --resume stops with one line before
    anything imports it; named on the command line it is the user's choice."""
    from machinery import resume
    from reward import BUILT_IN
    run = shutil.copytree(saved_run, tmp_path / "run")
    hook = run / "hook.py"
    hook.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\ndef score(text, truth):\n    return 1\n")
    for reward in (f"{hook}:score", "hook.py:score", "hook:score"):
        (run / "config.json").write_text(json.dumps({"steps": 4, "reward": reward, "train": str(run / "hook.py")}))
        err = _one_error(capsys, lambda: resume.resumed_config(str(run), {"steps": 8}, BUILT_IN))
        assert f"names the verifier {reward!r}, which is not built in" in err and f"--reward {reward}" in err, err
    assert not (tmp_path / "ran").exists()
    settings = resume.resumed_config(str(run), {"steps": 8, "reward": "hook:score"}, BUILT_IN)
    assert settings["reward"] == "hook:score"
    assert settings["model"] == str(run / "checkpoints" / "step_000004" / "model")  # the checkpoint's own


# ---- a stale lock whose pid was reused
def test_a_lock_whose_pid_another_process_has_now_is_taken_over(tmp_path):
    """Rank 0 killed (no exit handler ran), its pid handed to another process (a restarted container): the start
    time its lock records tells them apart."""
    from machinery import run_dir
    run = tmp_path / "run"
    code = (f"import os\nfrom machinery import run_dir\nassert run_dir.claim_run_dir({str(run)!r}, False, 'spo.py') "
            f"is None\nos._exit(0)")
    ok(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120))
    host, _, start = (run / ".lock").read_text().split()
    with subprocess.Popen(["sleep", "60"]) as other:
        (run / ".lock").write_text(f"{host} {other.pid} {start}\n")
        error = run_dir.claim_run_dir(str(run), resume=False, name="spo.py")
        (run / ".lock").write_text(f"{host} {other.pid} {run_dir._start_time(other.pid)}\n")  # its own: live
        busy = run_dir.claim_run_dir(str(run), resume=False, name="spo.py")
        other.kill()
    assert error is None and busy.startswith(f"--run_dir {run} is in use by another job (pid {other.pid}")
    assert host == socket.gethostname()


# ---- rotation and links: only what it wrote, nothing outside the run directory
def test_rotation_keeps_a_users_copy_and_no_link_is_written_through(tmp_path):
    """A user's step_000001_best survives rotation; a symbolic link at step_000004.tmp or latest.tmp (pointing
    outside the run directory) is replaced, never written through."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    (run / "checkpoints" / "step_000001_best").mkdir(parents=True)
    (run / "checkpoints" / "step_000001_best" / "mine").write_text("kept")
    outside.mkdir()
    (outside / "file").write_text("theirs")
    os.symlink(outside, run / "checkpoints" / "step_000004.tmp")
    os.symlink(outside / "file", run / "checkpoints" / "latest.tmp")
    ok(subprocess.run([sys.executable, "tests/test_checkpoint.py", "checkpoint_worker", str(run)], cwd=ROOT, env=ENV,
                      capture_output=True, text=True, timeout=600))
    assert sorted(p.name for p in outside.iterdir()) == ["file"] and (outside / "file").read_text() == "theirs"
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["latest", "step_000001_best", "step_000002", "step_000004"], names
    assert not (run / "checkpoints" / "step_000004").is_symlink()
    assert (run / "checkpoints" / "step_000001_best" / "mine").read_text() == "kept"


def test_resume_removes_a_linked_partial_checkpoint_without_following_it(saved_run, tmp_path, capsys):
    from machinery import checkpoint, run_dir
    run, outside = shutil.copytree(saved_run, tmp_path / "run"), tmp_path / "outside"
    (outside / "shards").mkdir(parents=True)
    os.symlink(outside, run / "checkpoints" / "step_000006.tmp")
    assert checkpoint.load_checkpoint(str(run), 1, ["k0", "k1"])["step"] == 4
    assert (outside / "shards").is_dir() and not os.path.lexists(run / "checkpoints" / "step_000006.tmp")
    assert "removed step_000006.tmp, a symbolic link (not followed" in capsys.readouterr().out
    os.symlink(outside / "metrics", run / "metrics.jsonl")  # a resume would cut it back: refused, nothing written
    error = run_dir.claim_run_dir(str(run), resume=True, name="spo.py")
    assert error.startswith(f"--run_dir {run}: {run / 'metrics.jsonl'} is a symbolic link (to {outside / 'metrics'})")
    assert not (outside / "metrics").exists() and not (run / ".lock").exists()


def test_out_of_inodes_while_the_tokenizer_is_written_is_one_line(tmp_path):
    """The Rust tokenizer raises a plain Exception on a full disk: one line, no step_N.tmp left, step 2 kept."""
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = _in_mount_namespace(f"mount -t tmpfs -o size=64m,nr_inodes=200 none {disk}",
                               f"{sys.executable} tests/test_checkpoint.py checkpoint_worker {disk}/run inodes; "
                               f"echo rc=$?; ls {disk}/run/checkpoints", tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "rc=2" in proc.stdout and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("error: disk full (No space left on device) while writing checkpoint step 4 to ")
    assert proc.stdout.split("rc=2")[1].split() == ["latest", "step_000002"], proc.stdout


# ---- the toy's offline values: one writer, kept where the run can write
VALUES = ("import torch.distributed as dist\nfrom machinery import run_dir\n"
          "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
          "print('->', run_dir.shared_output({path!r}, {run!r}, 'spo.py', 'the values'))\n"
          "dist.destroy_process_group()\n")  # (a gloo group left at exit can abort the interpreter)


def test_the_toys_values_have_one_writer_and_a_read_only_toy_keeps_them_in_the_run(tmp_path):
    """Another run measuring the same values now (its lock live), or a read-only toy directory: this run keeps its
    own in its run directory, said in one line before the engine starts; otherwise it claims the toy's file."""
    toy, run = tmp_path / "toy", tmp_path / "run"
    toy.mkdir()
    run.mkdir()
    path, kept = str(toy / "values.json"), str(run / "values.json")
    code = VALUES.format(path=path, run=str(run))
    proc = ok(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True))
    assert proc.stdout.strip().splitlines()[-1] == f"-> {path}"
    with subprocess.Popen(["sleep", "60"]) as other:
        from machinery.run_dir import _start_time
        (toy / "values.json.lock").write_text(f"{socket.gethostname()} {other.pid} {_start_time(other.pid)}\n")
        proc = ok(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True))
        other.kill()
    assert proc.stdout.strip().splitlines() == [
        f"spo.py: the values {path} is in use by another job (pid {other.pid} on {socket.gethostname()}, "
        f"{path}.lock); if that job is gone, delete the lock file; this run keeps its own in {kept}", f"-> {kept}"]
    os.remove(toy / "values.json.lock")
    proc = _in_mount_namespace(f"mount --bind {toy} {toy}; mount -o remount,bind,ro {toy}",
                               f"{sys.executable} -c {shlex.quote(code)}", tmp_path)
    assert proc.stdout.strip().splitlines() == [
        f"spo.py: the values {path}: cannot write there (Read-only file system); this run keeps its own in {kept}",
        f"-> {kept}"], proc.stdout + proc.stderr[-2000:]


def test_the_tool_toys_offline_values_ship_for_the_readmes_tools_run():
    """The README's `spo.py --tools` finds the tool toy's v0 shipped (listed in its SHA256SUMS), not 6 minutes of
    sampling before step 1."""
    import spo
    from offline_values import TrainingV0, toy_values_path
    from rollout import Tools
    from tasks import toy
    args = spo.parse_args(["--tools"])
    tools = Tools(None, max_turns=args.max_turns, max_tool_output_chars=args.max_tool_output_chars)
    toy_dir = toy.default_toy_dir(tools=True)
    v0 = TrainingV0.pick(vars(args), tools=tools).settings()
    path = toy_values_path(toy_dir, args.n0, args.seed, v0, args.train_prompts)
    assert os.path.isfile(path), path
    assert os.path.relpath(path, toy_dir) in (open(os.path.join(toy_dir, toy.CHECKSUMS)).read())
    assert toy.checksum_error(toy_dir, tools=True) is None
    with open(path) as f:
        header = json.load(f)["header"]
    assert header["model"] == "tasks/built/toy_tools/model"  # the same in every clone
    assert header["dataset"] == "tasks/built/toy_tools/train.parquet"


# ---- a run made in another checkout
@pytest.mark.slow
def test_a_run_made_in_another_checkout_resumes_from_its_own_model_and_data_named_now(tmp_path):
    """A run on the shipped toy, its config.json naming a clone that is gone: --resume takes the checkpoint's model
    and this checkout's toy (prompts checked), or a --test named where it is now; a --train with other prompts, or
    a file that is nowhere, is one line."""
    run, gone = tmp_path / "made" / "run", "/gone/clone/tasks/built/toy"
    small = ["--batch_size", "16", "--eval_every", "2", "--eval_max_prompts", "16", "--micro_batch_size", "8",
             "--offline_values", "none", "--save_every", "2"]
    ok(python("spo.py", "--run_dir", str(run), "--steps", "2", *small))
    moved = tmp_path / "moved"
    shutil.move(run, moved)
    config = json.loads((moved / "config.json").read_text())
    config.update(model=f"{gone}/model", train=f"{gone}/train.parquet", test=f"{gone}/test.parquet", toy_dir=gone)
    (moved / "config.json").write_text(json.dumps(config))
    shipped_test = os.path.join(ROOT, "tasks/built/toy/test.parquet")
    test = shutil.copy(shipped_test, tmp_path / "held_out.parquet")
    proc = ok(python("spo.py", "--resume", str(moved), "--steps", "3", "--test", str(test)))
    assert f"--train {gone}/train.parquet is not there; using this checkout's" in proc.stdout
    rows = [json.loads(line) for line in open(moved / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for extra, says in [(("--train", shipped_test), "the checkpoint was made with another training set"),
                        (("--test", os.path.join(ROOT, "tasks/built/toy/train.parquet")), "not the run's held-out"),
                        ((), f"its --test {test} is not there")]:
        if not extra:
            os.remove(test)
        proc = python("spo.py", "--resume", str(moved), "--steps", "6", *extra)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and says in proc.stderr, proc.stderr[-3000:]
