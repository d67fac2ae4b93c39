"""The sandbox (sandbox.py) under attack from the snippet: host files, the parent's environment, the network, the
host's Unix sockets and SysV IPC, the parent process, daemonised children; and what
must still work inside (socket pairs, multiprocessing, asyncio). Snippets expected to finish get a generous limit
(common.SNIPPET_TIMEOUT_S). The limits and the pool: tests/test_sandbox.py.

    .venv/bin/python -m pytest tests/test_sandbox_isolation.py -q
"""
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

import sandbox
from common import SNIPPET_TIMEOUT_S, live_pids_with
from sandbox import run_code


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


def test_network_connection_fails():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))  # loopback only, never any other address
    server.listen(8)
    port = server.getsockname()[1]
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "s.sendall(b'hello')\nprint('connected')")
        r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S)
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
    # A host service on paths anyone may write to, like /run/dbus or /dev/log: the run's own root does not hold
    # them, and seccomp refuses AF_UNIX sockets anyway.
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


def test_sysv_ipc_is_refused():
    # Its limits are the kernel's to set, not ours without root: a segment left unattached holds memory no limit
    # counts (tests/test_sandbox_keys_memory.py). Nothing of Python's own uses SysV IPC.
    key = 0x5D0000 + uuid.uuid4().int % 0xFFFF
    code = SYSV + (f"made('shm', libc.shmget({key}, 4096, 0o1600))\nmade('queue', libc.msgget({key}, 0o1600))\n"
                   f"made('semaphore set', libc.semget({key}, 1, 0o1600))\n")
    try:
        r = run_code(code, timeout_s=SNIPPET_TIMEOUT_S)
    finally:
        remove_sysv([key])
    assert r.exit_code == 0 and r.stdout.count("failed Operation not permitted") == 3, r


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
