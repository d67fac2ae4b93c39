"""A snippet's own root (machinery/isolation.py:_root_setup): it holds the system's and the interpreter's dirs,
read-only, and nothing else of the host (the repository, the data and their answers, run directories, homes);
without root the snippet cannot write or undo that either; a machine that cannot give it refuses --tools in one
line.

    .venv/bin/python -m pytest tests/test_sandbox_root.py -q
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import sandbox
from common import ENV, PYTHON, ROOT, SNIPPET_TIMEOUT_S
from machinery import isolation
from sandbox import run_code

ATTEMPTS = r'''
import ctypes, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, fn):
    try:
        print(name, "DID" if fn() else "blocked")  # fn: whether the attack worked
    except OSError as e:
        print(name, "blocked", type(e).__name__)
attempt("write venv", lambda: open(os.path.join(sys.prefix, "pyvenv.cfg"), "a") is not None)
attempt("write etc", lambda: open("/etc/spo_pwned", "w") is not None)
attempt("umount tmp", lambda: libc.umount2(b"/tmp", 2) == 0)
attempt("remount usr", lambda: libc.mount(None, b"/usr", None, 32 | 4096, None) == 0)  # MS_REMOUNT | MS_BIND, rw
attempt("host root", lambda: os.listdir("/proc/1/root") is not None)
attempt("own namespace",
        lambda: subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"]).returncode == 0)
open("/tmp/scratch", "w").write("fine")
print("scratch ok")
'''


def test_a_snippet_sees_no_repository_data_run_dir_or_home(tmp_path):
    run_dir_file = tmp_path / "metrics.jsonl"
    run_dir_file.write_text("a run's records")
    secrets = [os.path.abspath(sandbox.__file__), os.path.join(ROOT, "tasks", "built", "toy", "train.parquet"),
               str(run_dir_file)]
    home = os.path.expanduser("~")
    code = f"import os\nfor p in {secrets!r}:\n    print(os.path.exists(p))\nprint(sorted(os.listdir({home!r})) " \
           f"if os.path.isdir({home!r}) else [])"
    r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S)
    assert r.exit_code == 0 and r.stdout.splitlines()[:3] == ["False"] * 3, r
    # Home holds at most the way to the interpreter's dirs (a pyenv, say), never the user's files.
    leading = {d[len(home) + 1:].split("/")[0] for d in isolation.visible_dirs() if d.startswith(home + "/")}
    assert set(eval(r.stdout.splitlines()[3])) <= leading, r.stdout


def test_visible_to_snippets_tells_what_a_snippet_can_read():
    assert isolation.visible_to_snippets(sys.executable) and isolation.visible_to_snippets("/etc/passwd")
    assert not isolation.visible_to_snippets(os.path.join(ROOT, "tasks", "built", "toy", "train.parquet"))


def test_data_a_snippet_could_read_is_refused_in_one_line():
    from rollout import make_tools
    inside = os.path.join(sys.prefix, "pyvenv.cfg")  # as if the data lived inside the venv
    proc = subprocess.run([PYTHON, "-c", f"from rollout import make_tools; make_tools(True, 8, 1, 30, 1024, 256, "
                                         f"{{{inside!r}: 'train'}})"], env=ENV, cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: --train {inside} lies under a directory"), proc
    assert proc.stderr.count("\n") == 1
    assert make_tools(False, 8, 1, 30, 1024, 256, {inside: "train"}) is None  # no tools: nothing to hide


def test_a_machine_without_the_tools_for_a_private_root_refuses_tools_in_one_line():
    proc = subprocess.run([PYTHON, "-c", "import sandbox; sandbox._PATH = '/nonexistent'\n"
                                         "from rollout import make_tools; make_tools(True, 8, 1, 30, 1024, 256)"],
                          env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --tools: sandbox: --tools needs unshare"), proc
    assert proc.stderr.count("\n") == 1


def test_the_tools_are_found_on_the_sandboxs_path_not_the_callers():
    # Debian's default PATH for an ordinary user has no sbin, where pivot_root lives.
    proc = subprocess.run([PYTHON, "-c", "import sandbox; print(sandbox.run_code('print(1 + 1)').stdout)"],
                          env={**ENV, "PATH": "/usr/local/bin:/usr/bin:/bin"}, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "2\n\n", proc


USER = 1000  # an ordinary user's uid, for tests run as root


def _as_an_ordinary_user(code, hold_dir):
    """Run python code as uid USER (or as ourselves when we are not root)."""
    return subprocess.run(ordinary_user_argv(code, hold_dir), env=ENV, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def ordinary_user_argv(code, hold_dir):
    """The command that runs python code as uid USER (or as ourselves when we are not root), in the same process.
    An interpreter under a dir others cannot enter (/root) is made reachable in a private mount namespace: the dir's
    child is held aside, a tmpfs (mode 755) covers the dir, the child moves back on it. Nothing changes on the host."""
    argv = [PYTHON, "-c", code]
    if os.geteuid() == 0:
        cmds = []
        for d in isolation.visible_dirs():
            parts = d.strip("/").split("/")
            closed = [i for i in range(1, len(parts)) if not os.stat("/" + "/".join(parts[:i])).st_mode & 0o001]
            if closed:
                parent, hold = "/" + "/".join(parts[:closed[0]]), os.path.join(hold_dir, str(len(cmds)))
                child = f"{parent}/{parts[closed[0]]}"
                cmds += [f"mkdir -p {hold}", f"mount --rbind {child} {hold}", f"mount -t tmpfs -o mode=755 tmpfs "
                         f"{parent}", f"mkdir -p {child}", f"mount --move {hold} {child}"]
        argv = ["unshare", "--mount", "sh", "-c", f'set -e; {"; ".join(cmds) or ":"}; exec setpriv --reuid={USER} '
                f'--regid={USER} --clear-groups "$@"', "sh"] + argv
    return argv


def test_without_root_a_snippet_cannot_write_the_users_files_or_undo_its_mounts(tmp_path):
    # The user's own file, in the checkout (readable by anyone, writable by its owner).
    directory = tempfile.mkdtemp(prefix=".sandbox_test_", dir=ROOT)
    own = os.path.join(directory, "notes.txt")
    Path(own).write_text("precious")
    os.chmod(directory, 0o755)
    if os.geteuid() == 0:
        os.chown(directory, USER, USER)
        os.chown(own, USER, USER)
    attempts = ATTEMPTS + f"attempt('write own file', lambda: open({own!r}, 'a') is not None)\n"
    try:
        proc = _as_an_ordinary_user(f"import os, sandbox\nprint(os.geteuid(), sandbox.isolation().dedicated_uid)\n"
                                    f"r = sandbox.run_code({attempts!r}, timeout_s={SNIPPET_TIMEOUT_S})\n"
                                    "print(r.stdout, r.stderr)", tmp_path)
        assert Path(own).read_text() == "precious"
    finally:
        shutil.rmtree(directory)
    assert proc.returncode == 0 and proc.stdout.split("\n")[0].endswith(" False"), proc
    assert "DID" not in proc.stdout and proc.stdout.count("blocked") == 7 and "scratch ok" in proc.stdout, proc.stdout


def test_without_root_a_fork_bomb_stops_at_the_process_limit(tmp_path):
    if tuple(int(x) for x in os.uname().release.split(".")[:2]) < (5, 14):
        pytest.skip("before Linux 5.14 RLIMIT_NPROC counts all of the user's processes: not set without root")
    bomb = ("import os, time\nn = 0\ntry:\n    while n < 200:\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        n += 1\nexcept OSError:\n"
            "    print('stopped after', n)\n")
    proc = _as_an_ordinary_user(f"import sandbox\nprint(sandbox.run_code({bomb!r}, timeout_s={SNIPPET_TIMEOUT_S}, "
                                f"max_processes=8).stdout)", tmp_path)
    assert proc.returncode == 0 and "stopped after" in proc.stdout and int(proc.stdout.split()[2]) < 8, proc


@pytest.mark.skipif(os.geteuid() != 0, reason="only root claims dedicated uids (without root there is no lock dir)")
def test_a_lock_dir_another_user_planted_is_refused(tmp_path, monkeypatch):
    planted = tmp_path / "locks"
    planted.mkdir(mode=0o777)
    os.chown(planted, 65534, 65534)  # made by "nobody", who could link its files anywhere
    monkeypatch.setattr(isolation, "_LOCK_DIR", str(planted))
    with pytest.raises(sandbox.SandboxUnavailable, match="not a private directory of ours"):
        isolation.claim_uid()
    assert os.listdir(planted) == []  # nothing created in it
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    monkeypatch.setattr(isolation, "_LOCK_DIR", str(link))
    with pytest.raises(sandbox.SandboxUnavailable):
        isolation.claim_uid()
