"""The sandbox (sandbox.py) as a runner: its limits (timeouts, fork and memory bombs, output floods, the process
limit), what a run returns (exit codes, undecodable output, unstartable code, no state between runs), its argument
checks, and the pool. Snippets expected to finish get a generous limit (common.SNIPPET_TIMEOUT_S); only the timeout
tests use short limits, with snippets that can never finish in time. What a snippet cannot reach on the host:
tests/test_sandbox_isolation.py; the text the tool loop sends in and gets back: tests/test_sandbox_tool_text.py.

    .venv/bin/python -m pytest tests/test_sandbox.py -q
"""
import os
import resource
import signal
import subprocess
import time

import sys
import threading
import uuid
from pathlib import Path

import pytest

from common import ENV, ROOT, SNIPPET_TIMEOUT_S, live_pids_with
from machinery import isolation as machinery_isolation
from sandbox import SandboxPool, format_tool_output, isolation, run_code
from test_sandbox_root import ordinary_user_argv


def test_infinite_loop_times_out():
    r = run_code("while True:\n    pass", timeout_s=1)
    assert r.timed_out and r.exit_code != 0 and not r.out_of_memory


def test_sleep_is_cut_by_wall_clock_not_cpu_limit():
    r = run_code("import time\ntime.sleep(600)\nprint('woke')", timeout_s=1)
    assert r.timed_out and "woke" not in r.stdout
    assert r.duration_s < 300  # killed at the wall-clock limit (a sleep uses no CPU time), not after 600 s


def test_fork_bomb_is_killed_and_leaves_nothing():
    marker = f"forkbomb_{uuid.uuid4().hex}"
    code = f"# {marker}\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_code(code, timeout_s=2, max_processes=16)
    assert r.timed_out
    assert live_pids_with(marker) == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_process_limit_stops_forking():
    code = ("import os, time\nn = 0\ntry:\n    while n < 200:\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
            "except OSError as e:\n    print('stopped after', n, type(e).__name__)\n")
    r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S, max_processes=8)
    # Root ignores RLIMIT_NPROC (hence the dedicated uid); without root it holds inside the user namespace.
    assert "stopped after" in r.stdout and int(r.stdout.split()[2]) < 8, (isolation(), r)


def test_memory_bomb_reports_out_of_memory():
    r = run_code("chunks = []\nwhile True:\n    chunks.append(bytearray(10 << 20))", 
                 timeout_s=SNIPPET_TIMEOUT_S, memory_mb=256)
    assert r.out_of_memory and r.exit_code != 0 and not r.timed_out
    assert "MemoryError" in format_tool_output(r)


def test_output_flood_is_capped_while_reading():
    code = ("import sys\nchunk = b'x' * (1 << 20)\nfor _ in range(200):\n    sys.stdout.buffer.write(chunk)\n"
            "sys.stdout.buffer.write(b'\\nEND\\n')")
    peak_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S, max_output_bytes=4096)
    peak_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before_kb) / 1024
    assert r.output_truncated and r.exit_code == 0 and not r.timed_out
    assert len(r.stdout) < 4096 + 100 and r.stdout.startswith("xxx") and r.stdout.endswith("END\n")
    assert peak_growth_mb < 100  # 200 MiB went through the pipe; we kept 4 KiB


def test_endless_flood_times_out_with_bounded_output():
    r = run_code("while True:\n    print('y' * 10000)", timeout_s=1, max_output_bytes=1000)
    assert r.timed_out and r.output_truncated and len(r.stdout) < 1100


def test_binary_garbage_is_decoded_with_replacement():
    r = run_code("import sys\nsys.stdout.buffer.write(bytes(range(256)) * 4)\n"
                 "sys.stderr.buffer.write(b'\\xff\\xfe\\x00bad')", timeout_s=SNIPPET_TIMEOUT_S)
    assert r.exit_code == 0 and isinstance(r.stdout, str) and "\ufffd" in r.stdout and "\ufffd" in r.stderr
    assert isinstance(format_tool_output(r), str)


def test_syntax_error_is_reported():
    r = run_code("def f(:\n    pass", timeout_s=SNIPPET_TIMEOUT_S)
    assert r.exit_code != 0 and "SyntaxError" in r.stderr and not r.timed_out


def test_exit_code_is_passed_through():
    assert run_code("exit(3)", timeout_s=SNIPPET_TIMEOUT_S).exit_code == 3


def test_unstartable_code_becomes_a_result():
    r = run_code("print('a')\x00", timeout_s=SNIPPET_TIMEOUT_S)
    assert r.exit_code == -1 and "could not start" in r.stderr


def test_runs_are_stateless():
    # /tmp is private, or read-only when the interpreter itself lives under /tmp: either way nothing persists.
    first = run_code("open('state.txt', 'w').write('1')\ntry:\n    open('/tmp/state2.txt', 'w').write('1')\n"
                     "except OSError:\n    pass", timeout_s=SNIPPET_TIMEOUT_S)
    second = run_code("import os\nprint(os.path.exists('state.txt'), os.path.exists('/tmp/state2.txt'))",
                      timeout_s=SNIPPET_TIMEOUT_S)
    assert first.exit_code == 0 and second.stdout == "False False\n"


def test_pool_returns_results_in_submission_order():
    codes = [f"import time\ntime.sleep({(7 * i) % 5 * 0.05})\nprint({i})" for i in range(10)]
    with SandboxPool(workers=4, timeout_s=SNIPPET_TIMEOUT_S) as pool:
        results = pool.map(codes)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(10)]


def test_pool_bounds_concurrency():
    marker = f"pool_{uuid.uuid4().hex}"
    running, done = [], threading.Event()

    def sample():  # how many sandboxed interpreters (argv: python -I -c code) run right now
        while not done.is_set():
            running.append(sum(1 for pid in live_pids_with(marker) if _is_interpreter(pid)))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with SandboxPool(workers=2, timeout_s=SNIPPET_TIMEOUT_S) as pool:
            results = pool.map([f"import time\ntime.sleep(0.5)  # {marker}"] * 6)
    finally:
        done.set()
        sampler.join()
    assert all(r.exit_code == 0 for r in results)
    assert max(running) == 2  # it did run in parallel, and never more than 2 at once


def _is_interpreter(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[0] == sys.executable.encode() and argv[1:2] == [b"-I"]


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="timeout_s"):
        run_code("print(1)", timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        SandboxPool(workers=0)


def gone_within(mark, seconds=10.0):
    deadline = time.monotonic() + seconds
    while live_pids_with(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    return live_pids_with(mark) == []


@pytest.mark.parametrize("who", ["as ourselves", "as an ordinary user"])
@pytest.mark.parametrize("how", ["sleeps, run from a pool", "a daemon, run on the main thread"])
def test_a_killed_trainers_snippets_end_with_it(who, how, tmp_path):
    """Processes that outlive their limits: a snippet of a trainer killed by SIGKILL used to sleep on past its time
    limit (RLIMIT_CPU counts no sleep), keeping its memory and, as root, the uid the next run is given."""
    if who == "as an ordinary user" and os.geteuid() != 0:
        pytest.skip("we are an ordinary user already")
    digits = uuid.uuid4().int % 10**9  # the sleep's seconds are 600.digits, a number no other process uses
    mark, made = f"600.{digits}", f"'600.' + '{digits}'"  # (made in the snippet: not in the trainer's arguments)
    snippet = f"import subprocess\nsubprocess.run(['sleep', {made}])" if how.startswith("sleeps") else \
        f"import subprocess, time\nsubprocess.Popen(['sh', '-c', '(setsid sleep ' + {made} + ' &)'])\ntime.sleep(600)"
    run = f"sandbox.SandboxPool(2, timeout_s=600).submit({snippet!r})" if "pool" in how else \
        f"sandbox.run_code({snippet!r}, timeout_s=600)"
    code = f"import sandbox, time\n{run}\ntime.sleep(600)"
    argv = [sys.executable, "-c", code] if who == "as ourselves" else ordinary_user_argv(code, tmp_path)
    trainer = subprocess.Popen(argv, env=ENV, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not live_pids_with(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live_pids_with(mark), "the snippet did not start"
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    assert gone_within(mark)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root gives runs dedicated uids")
def test_what_a_killed_trainers_run_left_under_a_uid_ends_before_the_uid_is_given_again(tmp_path, monkeypatch):
    """Processes that outlive their limits, the backstop: a run's uid is marked while the run uses it; a run given
    a marked uid first ends whatever still runs under it."""
    monkeypatch.setattr(machinery_isolation, "UID_BASE", 60000 + 200 + uuid.uuid4().int % 50)
    uid, lock_fd = machinery_isolation.claim_uid()
    os.pwrite(lock_fd, b"1", 0)  # as a trainer killed in the middle of a run leaves it
    mark = f"600.{uuid.uuid4().int % 10**9}"
    left = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", mark])
    os.close(lock_fd)
    try:
        while not live_pids_with(mark):  # it runs as the uid once it is sleep
            time.sleep(0.01)
        assert run_code("print(1)", timeout_s=SNIPPET_TIMEOUT_S).stdout == "1\n"
        assert left.wait(timeout=10) == -signal.SIGKILL
    finally:
        left.kill()
