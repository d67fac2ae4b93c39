"""The sandbox (sandbox.py) under attack: timeouts, fork and memory bombs, output floods, host files, the parent's
environment, the network, daemonised children; and the pool. Snippets expected to finish get a generous limit
(common.SNIPPET_TIMEOUT_S); only the timeout tests use short limits, with snippets that can never finish in time.

    .venv/bin/python -m pytest tests/test_sandbox.py -q
"""
import contextlib
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path

import pytest

import sandbox
from common import SNIPPET_TIMEOUT_S
from sandbox import (SandboxPool, SandboxResult, format_tool_output, interpreter_text, isolation, run_code,
                     show_last_expression)


def live_pids_with(marker: str) -> list[int]:
    """Pids of live (non-zombie) host processes whose command line contains marker."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker.encode() in cmdline and state != "Z" and int(name) != os.getpid():
            pids.append(int(name))
    return pids


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
    # Fails where runs stay root (no dedicated uid): root ignores RLIMIT_NPROC.
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


def test_cannot_write_or_delete_host_files():
    # Like the project's own files: outside /tmp, readable by anyone, writable only by its owner (us).
    host_dir = tempfile.mkdtemp(prefix=".sandbox_test_", dir=os.path.dirname(os.path.abspath(sandbox.__file__)))
    os.chmod(host_dir, 0o755)
    host_file = os.path.join(host_dir, "host.txt")
    canary = f"/tmp/spo_sandbox_canary_{uuid.uuid4().hex}"
    escape = f"/tmp/spo_sandbox_escape_{uuid.uuid4().hex}"
    for path in (host_file, canary):
        Path(path).write_text("precious")
        os.chmod(path, 0o644)
    code = f"""
import os, shutil
for path in [{host_file!r}, {canary!r}]:
    for attack in (lambda: open(path, "a").write("pwned"), lambda: os.remove(path),
                   lambda: os.rename(path, path + ".moved")):
        try:
            attack()
            print("DID", path)
        except OSError as e:
            print("blocked", type(e).__name__)
for path in [{os.path.join(host_dir, "new.txt")!r}, {escape!r}]:
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as e:
        print("blocked", type(e).__name__)
shutil.rmtree({host_dir!r}, ignore_errors=True)
"""
    try:
        r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S)
        assert r.exit_code == 0, r
        assert Path(host_file).read_text() == "precious" and Path(canary).read_text() == "precious"
        assert os.listdir(host_dir) == ["host.txt"]
        assert not os.path.exists(escape)  # /tmp writes land in the run's private /tmp, or fail
    finally:
        for path in (host_file, canary, escape):
            Path(path).unlink(missing_ok=True)
        os.rmdir(host_dir)


def test_cannot_read_parent_environment(monkeypatch):
    secret = f"secret_{uuid.uuid4().hex}"
    monkeypatch.setenv("SPO_TEST_SECRET", secret)  # inherited by children unless scrubbed
    # /proc/<pid>/environ shows the environment a process was started with: start one with the secret,
    # as a trainer started with HF_TOKEN would be.
    holder = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                              env={**os.environ}, stdout=subprocess.PIPE)
    code = """
import glob, os
print(dict(os.environ))
for path in glob.glob("/proc/*/environ"):
    try:
        print(path, open(path, "rb").read())
    except OSError:
        pass
"""
    try:
        holder.stdout.readline()
        assert secret.encode() in Path(f"/proc/{holder.pid}/environ").read_bytes()  # the bait is there
        r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S)
    finally:
        holder.kill()
        holder.communicate()
    assert r.exit_code == 0 and "PATH" in r.stdout
    assert secret not in r.stdout + r.stderr
    assert "SPO_TEST_SECRET" not in r.stdout + r.stderr


def test_network_connection_fails_or_result_says_not_isolated():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))  # loopback only, never any other address
    server.listen(8)
    port = server.getsockname()[1]
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "s.sendall(b'hello')\nprint('connected')")
        r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S)
        if not r.network_isolated:
            assert not isolation().namespaces  # the result must not claim isolation it lacks
            return
        assert "connected" not in r.stdout and r.exit_code != 0 and "Error" in r.stderr
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing ever reached our listener
            server.accept()
    finally:
        server.close()


# ---- Unix sockets and SysV IPC of the host
# Every way a snippet might get an AF_UNIX socket aimed at a host path; each prints "GOT ..." if it reached it.
UNIX_ATTACKS = r'''
import ctypes, mmap, os, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def check(fd, what):
    if fd < 0:
        raise OSError(ctypes.get_errno(), what)
    return fd

def raw_socket():  # the syscall itself with the domain's high bits set: the kernel reads only an int
    nr = {"x86_64": 41, "aarch64": 198}[os.uname().machine]
    return socket.socket(fileno=check(libc.syscall(nr, 0x100000001, 1, 0), "socket"))

def i386_socket():  # socket(AF_UNIX, SOCK_STREAM) through the 32-bit ABI (int 0x80), from 64-bit code
    if os.uname().machine != "x86_64":
        raise OSError("no i386 ABI here")
    buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(bytes.fromhex("53 b8 67 01 00 00 bb 01 00 00 00 b9 01 00 00 00 31 d2 cd 80 5b c3"))
    fd = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))()
    return socket.socket(fileno=check(fd, "int 0x80"))

def uring_socket():  # IORING_OP_SOCKET: io_uring makes the socket, no socket() syscall at all
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    ring = check(libc.syscall(425, 1, params), "io_uring_setup")
    sq_entries, cq_entries = struct.unpack_from("II", params, 0)
    sq_tail, sq_mask, sq_array = (struct.unpack_from("I", params, 40 + 4 * i)[0] for i in (1, 2, 6))
    cq_head, cq_mask, cqes = (struct.unpack_from("I", params, 80 + 4 * i)[0] for i in (0, 2, 5))
    sq = mmap.mmap(ring, sq_array + 4 * sq_entries, offset=0)
    cq = mmap.mmap(ring, cqes + 16 * cq_entries, offset=0x8000000)
    sqes = mmap.mmap(ring, 64 * sq_entries, offset=0x10000000)
    sqes[0:64] = struct.pack("=BBHiQQII", 45, 0, 0, 1, 1, 0, 0, 0).ljust(64, b"\0")
    tail = struct.unpack_from("I", sq, sq_tail)[0]
    struct.pack_into("I", sq, sq_array + 4 * (tail & struct.unpack_from("I", sq, sq_mask)[0]), 0)
    struct.pack_into("I", sq, sq_tail, tail + 1)
    libc.syscall(426, ring, 1, 1, 1, None, 0)  # io_uring_enter: submit 1, wait for 1
    head = struct.unpack_from("I", cq, cq_head)[0]
    res = struct.unpack_from("i", cq, cqes + 16 * (head & struct.unpack_from("I", cq, cq_mask)[0]) + 8)[0]
    return socket.socket(fileno=check(res, "IORING_OP_SOCKET"))

def stream(make):
    s = make()
    s.settimeout(10)
    s.connect(STREAM)
    return s.recv(100)

def datagram(make):
    make().sendto(b"datagram", DGRAM)
    return "sent"

for name, attack in {"socket": lambda: stream(lambda: socket.socket(socket.AF_UNIX)),
                     "raw syscall": lambda: stream(raw_socket), "i386 ABI": lambda: stream(i386_socket),
                     "io_uring": lambda: stream(uring_socket),
                     "stream pair": lambda: stream(lambda: socket.socketpair()[0]),  # its peer closed
                     "datagram": lambda: datagram(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)),
                     "datagram pair": lambda: datagram(lambda: socket.socketpair(type=socket.SOCK_DGRAM)[0])}.items():
    try:
        print(name, "GOT", attack())
    except OSError as e:
        print(name, "failed", e)
'''


@pytest.mark.parametrize("under", ["host /tmp", "repository"])
def test_unix_sockets_of_the_host_are_unreachable(under):
    # A host service on paths anyone may write to, like /run/dbus or /dev/log. Under /tmp the run's private
    # /tmp hides it (unless the interpreter lives there); the repository stays visible inside the sandbox.
    directory = tempfile.mkdtemp(prefix=".sandbox_test_", dir="/tmp" if under == "host /tmp" else
                                 os.path.dirname(os.path.abspath(sandbox.__file__)))
    os.chmod(directory, 0o755)
    stream_path, dgram_path = os.path.join(directory, "service.sock"), os.path.join(directory, "log.sock")
    listener, receiver = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(stream_path)
    listener.listen(8)
    receiver.bind(dgram_path)
    for path in (stream_path, dgram_path):
        os.chmod(path, 0o666)
    reached, done = [], threading.Event()  # what reached the host service

    def serve():  # answers every connection with a secret
        listener.settimeout(0.1)
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                reached.append(conn := listener.accept()[0])
                conn.sendall(b"host secret")

    server = threading.Thread(target=serve)
    server.start()
    try:
        code = f"STREAM, DGRAM = {stream_path!r}, {dgram_path!r}\n" + UNIX_ATTACKS
        r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S)
        receiver.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            reached.append(receiver.recv(100))
    finally:
        done.set()
        server.join()
        listener.close()
        receiver.close()
        shutil.rmtree(directory)
    if not r.unix_sockets_blocked:
        assert not isolation().seccomp  # the result must not claim protection it lacks
        return
    assert r.exit_code == 0 and r.stdout.count(" failed ") == 7, r
    assert reached == [] and "GOT" not in r.stdout and "secret" not in r.stdout


def sysv_keys() -> set[int]:
    """Keys of the SysV shm segments, message queues and semaphore sets the host sees."""
    keys = set()
    for kind in ("shm", "msg", "sem"):
        keys |= {int(line.split()[0]) for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]}
    return keys


SYSV = r'''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
def made(name, ident):
    print(name, "made" if ident >= 0 else "failed " + os.strerror(ctypes.get_errno()))
    return ident
'''


def remove_sysv(keys):  # what a sandbox without an IPC namespace leaves behind on the host
    for key in keys:
        for kind in ("-M", "-Q", "-S"):
            subprocess.run(["ipcrm", kind, str(key)], capture_output=True)


def test_sysv_ipc_does_not_outlive_the_run():
    key = 0x5B0000 + uuid.uuid4().int % 0xFFFF  # shm keys key..key+3, a queue and a semaphore set at key
    keys = set(range(key, key + 4))
    assert not keys & sysv_keys()
    code = SYSV + (f"for i in range(4):\n    made('shm', libc.shmget({key} + i, 96 << 20, 0o1666))\n"
                   f"made('queue', libc.msgget({key}, 0o1666))\nmade('semaphore', libc.semget({key}, 1, 0o1666))\n")
    try:
        r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S, memory_mb=128)
        assert r.exit_code == 0 and r.stdout.count("made") + r.stdout.count("failed") == 6, r
        assert not keys & sysv_keys(), r.stdout
    finally:
        remove_sysv(keys)


def _a_process_named(name):
    """Whether a live process has this name (its /proc/PID/comm), whatever namespace it runs in."""
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name:
                    return True
        except OSError:  # not a pid, or gone
            pass
    return False


def test_a_run_cannot_open_another_runs_shared_memory():
    if not (isolation().namespaces or isolation().seccomp):
        pytest.skip(f"no IPC namespace and no seccomp filter here: {isolation()}")
    key = 0x5C0000 + uuid.uuid4().int % 0xFFFF
    # The first run says it is ready by its process name (the host sees it in /proc; a file would need a dir the
    # snippet may write, and a checkout under /tmp is read-only inside), then waits for a file the test makes in a
    # dir both runs can read.
    ready = f"ready{key:x}"
    directory = tempfile.mkdtemp(prefix=".sandbox_test_", dir=os.path.dirname(os.path.abspath(sandbox.__file__)))
    os.chmod(directory, 0o755)
    go_on = os.path.join(directory, "go_on")
    first_code = SYSV + f"""
import time
shm = made("shm", libc.shmget({key}, 4096, 0o1666))
if shm >= 0:
    ctypes.memmove(libc.shmat(shm, None, 0), b"first run's data", 16)
libc.prctl(15, {ready.encode()!r}, 0, 0, 0)  # PR_SET_NAME
while not os.path.exists({go_on!r}):
    time.sleep(0.05)
"""
    second_code = SYSV + f"""
shm = libc.shmget({key}, 0, 0)
if made("opened", shm) >= 0:
    print(ctypes.string_at(libc.shmat(shm, None, 0), 16))
"""
    try:
        with SandboxPool(workers=1, timeout_s=SNIPPET_TIMEOUT_S) as pool:
            first = pool.submit(first_code)
            while not _a_process_named(ready) and not first.done():
                time.sleep(0.05)
            second = run_code(second_code, timeout_s=SNIPPET_TIMEOUT_S)
            Path(go_on).touch()
            first = first.result()
    finally:
        shutil.rmtree(directory)
        remove_sysv([key])
    assert first.exit_code == 0 and ("shm made" in first.stdout or not isolation().namespaces), first
    assert second.exit_code == 0 and "opened failed" in second.stdout and "data" not in second.stdout, second


def test_sysv_ipc_cannot_hold_more_than_the_memory_limit():
    if os.geteuid() != 0 and isolation().namespaces:
        pytest.skip("without root the IPC namespace's limits are not set (the snippet could raise them)")
    key = 0x5D0000 + uuid.uuid4().int % 0xFFFF
    code = SYSV + (f"for i in range(4):\n    made('shm', libc.shmget({key} + i, 96 << 20, 0o1600))\n"
                   f"made('big semaphore set', libc.semget({key}, 10000, 0o1600))\n")
    try:
        r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S, memory_mb=128)
    finally:
        remove_sysv(range(key, key + 4))
    assert r.exit_code == 0 and r.stdout.count("shm ") == 4, r
    assert r.stdout.count("shm made") <= 1 and "big semaphore set failed" in r.stdout, r.stdout


def test_socketpair_and_multiprocessing_still_work():
    code = """
import asyncio, multiprocessing, socket
a, b = socket.socketpair()
a.sendall(b"pair")
print(b.recv(4).decode())
def square(x):
    return x * x
with multiprocessing.Pool(2) as pool:
    print(pool.map(square, range(5)))
parent, child = multiprocessing.Pipe()
p = multiprocessing.Process(target=child.send, args=("pipe",))
p.start()
print(parent.recv())
p.join()
async def main():  # the event loop wakes itself through a socketpair
    await asyncio.sleep(0)
    return "asyncio"
print(asyncio.run(main()))
"""
    r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S)
    assert r.exit_code == 0 and r.stdout == "pair\n[0, 1, 4, 9, 16]\npipe\nasyncio\n", r


def test_cannot_kill_parent_process():
    code = f"""
import os, signal
for target in ({os.getpid()}, os.getppid()):
    try:
        os.kill(target, signal.SIGKILL)
        print("killed", target)
    except OSError as e:
        print("blocked", type(e).__name__)
"""
    r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S)
    os.kill(os.getpid(), 0)  # still here
    assert f"killed {os.getpid()}" not in r.stdout
    assert "blocked" in r.stdout


@pytest.mark.parametrize("main_exits", [True, False])
def test_daemonised_children_are_gone_after_return(main_exits):
    marker = f"daemon_{uuid.uuid4().hex}"
    code = f"""
import os, subprocess, sys, time
sleeper = ["/bin/sh", "-c", "sleep 60; true", {marker!r}]  # the marker is the shell's $0
subprocess.Popen(sleeper, start_new_session=True)  # setsid: leaves the process group
if os.fork() == 0:  # double fork: reparented away from us
    os.setsid()
    if os.fork() == 0:
        os.execv(sleeper[0], sleeper)
    os._exit(0)
time.sleep(0.3)
print("spawned", flush=True)
if not {main_exits}:
    time.sleep(10**6)
"""
    # Exiting: a generous limit. Never exiting: killed at 20 s, long after "spawned" is printed.
    r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S if main_exits else 20)
    assert "spawned" in r.stdout
    assert r.timed_out == (not main_exits)
    assert live_pids_with(marker) == []


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


def test_format_tool_output_cuts_middle_and_keeps_notes():
    r = SandboxResult(stdout="H" * 200 + "T" * 200, stderr="", exit_code=-9, timed_out=True, out_of_memory=False,
                      output_truncated=False, network_isolated=True, unix_sockets_blocked=True, duration_s=30.2)
    text = format_tool_output(r, max_chars=256)
    head, _, rest = text.partition("\n...\n")
    assert head == "H" * 128 and rest.startswith("T" * 128) and "TimeoutError" in rest
    ok = SandboxResult(stdout="4\n", stderr="", exit_code=0, timed_out=False, out_of_memory=False,
                       output_truncated=False, network_isolated=True, unix_sockets_blocked=True,
                       duration_s=0.02)
    assert format_tool_output(ok) == "4\n"
    failed = SandboxResult(stdout="", stderr="", exit_code=2, timed_out=False, out_of_memory=False,
                           output_truncated=False, network_isolated=True, unix_sockets_blocked=True,
                           duration_s=0.02)
    assert format_tool_output(failed) == "[exit code 2]"


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="timeout_s"):
        run_code("print(1)", timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        SandboxPool(workers=0)


# ---- what the tool loop (rollout.py) sends in and gets back
@pytest.mark.parametrize("code, shown", [
    ("x = 6\nx * 7", "42\n"),                          # a bare last expression is shown, like a REPL
    ("x = 'a'; x", "'a'\n"),                           # repr, after a semicolon on the same line
    ("(1 +\n 2)  # sum", "3\n"),                        # a multi-line expression, a trailing comment
    ("é = 'ü'\né", "'ü'\n"),                            # non-ASCII: ast columns are UTF-8 bytes
    ("None", ""),                                       # None shows nothing
    ("print(5)", "5\n"),                                # already a print: unchanged, printed once
    ("for i in range(2):\n    i", ""),                  # indented last line: left alone (the authors' bug)
    ("x = 3", ""),                                      # an assignment shows nothing
    ("y = 2\ry", "2\n"),                                # a lone \r ends a line for python: so here too
    ("y = 2\r\ny", "2\n"),                              # \r\n
])
def test_show_last_expression_runs_like_a_repl(code, shown):
    result = run_code(show_last_expression(code), timeout_s=SNIPPET_TIMEOUT_S)
    assert result.exit_code == 0 and result.stdout == shown, (result.stdout, result.stderr)


def test_show_last_expression_leaves_bad_code_alone_and_keeps_line_numbers():
    assert show_last_expression("def f(:\n  pass") == "def f(:\n  pass"
    for deep in ("1" + "+1" * 3000, "-" * 3000 + "1"):  # too deep for the parser: unchanged, nothing raised
        assert show_last_expression(deep) == deep
    code = "x = 1\ny = 1 / 0\nx"
    result = run_code(show_last_expression(code), timeout_s=SNIPPET_TIMEOUT_S)
    assert "line 2" in result.stderr and "ZeroDivisionError" in result.stderr  # the error line is unchanged


def test_interpreter_text_turns_every_failure_into_text():
    failed = Future()
    failed.set_exception(RuntimeError("sandbox: all 256 dedicated uids are busy"))
    text, error, timed_out = interpreter_text(failed, 256)
    assert text.startswith("<interpreter>\nsandbox error: RuntimeError") and text.endswith("</interpreter>\n\n")
    assert error and not timed_out
    done = Future()
    done.set_result(SandboxResult("x" * 1000, "", 0, False, False, False, True, True, 0.1))
    text, error, timed_out = interpreter_text(done, 64)
    assert not error and len(text) < 64 + 40 and "\n...\n" in text  # cut keeping head and tail
