"""What no namespace covers (machinery/seccomp.py): the kernel keyrings (a snippet cannot read the trainer's keys,
plant any, or leave any for the next run) and memory no limit counts (memfds, SysV IPC, the inodes of the scratch
tmpfs), as root and as an ordinary user, against the real sandbox.

    .venv/bin/python -m pytest tests/test_sandbox_keys_memory.py -q
"""
import os
import subprocess

import pytest

from common import ENV, PYTHON, ROOT, SNIPPET_TIMEOUT_S
from machinery.isolation import SCRATCH_INODES
from machinery.seccomp import _SYSCALL_NR
from sandbox import run_code
from test_sandbox_root import _as_an_ordinary_user

NR = _SYSCALL_NR[os.uname().machine]
# A trainer with a key in its session keyring (a Kerberos ticket cache, an AFS token), then two snippets: the first
# tries to read it and to plant keys of its own, the second looks for what the first left.
TRAINER = f'''
import ctypes, sandbox
libc = ctypes.CDLL(None, use_errno=True)
assert libc.syscall({NR["keyctl"]}, 1, None) > 0  # a session keyring of this test's own (not the caller's)
key = libc.syscall({NR["add_key"]}, b"user", b"spo_trainer_key", b"kerberos ticket", 15, -3)  # KEY_SPEC_SESSION
assert key > 0, ctypes.get_errno()
snoop = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(64)
def attempt(name, result):
    print(name, "DID" if result >= 0 else "blocked " + os.strerror(ctypes.get_errno()))
attempt("read the trainer's key", libc.syscall({NR["keyctl"]}, 11, %d, buf, 64))  # KEYCTL_READ
attempt("find it in @s", libc.syscall({NR["keyctl"]}, 10, -3, b"user", b"spo_trainer_key", 0))  # KEYCTL_SEARCH
for ring in (-3, -4, -5):  # session, user, user session keyrings
    attempt("plant in %%d" %% ring, libc.syscall({NR["add_key"]}, b"user", b"spo_planted", b"x", 1, ring))
attempt("request", libc.syscall({NR["request_key"]}, b"user", b"spo_planted", None, 0))
print("seen in /proc/keys:", sorted(w for w in open("/proc/keys").read().split() if w.startswith("spo_")))
""" % key
for run in range(2):
    r = sandbox.run_code(snoop, timeout_s={SNIPPET_TIMEOUT_S})
    print(r.stdout, r.stderr)
print("trainer still reads:", ctypes.string_at(buf := ctypes.create_string_buffer(64),
      libc.syscall({NR["keyctl"]}, 11, key, buf, 64)))
'''


@pytest.mark.parametrize("who", ["as ourselves", "as an ordinary user"])
def test_a_snippet_cannot_read_plant_or_leave_keys(who, tmp_path):
    if who == "as an ordinary user" and os.geteuid() != 0:
        pytest.skip("we are an ordinary user already")
    if who == "as ourselves":
        proc = subprocess.run([PYTHON, "-c", TRAINER], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    else:
        proc = _as_an_ordinary_user(TRAINER, tmp_path)
    assert proc.returncode == 0 and "trainer still reads: b'kerberos ticket'" in proc.stdout, proc
    assert "DID" not in proc.stdout and proc.stdout.count("blocked") == 12, proc.stdout
    assert proc.stdout.count("seen in /proc/keys: []") == 2, proc.stdout


MEMORY = f'''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held, chunk = {{}}, b"x" * (1 << 20)
def hold(way, make):
    try:
        for i in range(16):
            fd = make(i)
            for _ in range(64):
                os.write(fd, chunk)
                held[way] = held.get(way, 0) + 1  # MiB
    except OSError:
        pass
hold("memfd", lambda i: os.memfd_create(f"m{{i}}"))
hold("/dev/shm", lambda i: os.open(f"/dev/shm/m{{i}}", os.O_CREAT | os.O_WRONLY))
hold("/tmp", lambda i: os.open(f"/tmp/m{{i}}", os.O_CREAT | os.O_WRONLY))
for i in range(16):  # SysV shm: filled while attached, then detached (no mapping left for RLIMIT_AS to count)
    shm = libc.shmget(0x5E0000 + i, 64 << 20, 0o1600)
    if shm < 0:
        break
    address = libc.shmat(shm, None, 0)
    ctypes.memset(address, 1, 64 << 20)
    libc.shmdt(ctypes.c_void_p(address))
    if libc.shmget(0x5E0000 + i, 0, 0) >= 0:  # still there, unattached
        held["sysv"] = held.get("sysv", 0) + 64
print(held)
'''


def test_memfds_and_sysv_shm_cannot_hold_more_than_the_documented_bound():
    # The documented bound: memory_mb per process, plus each scratch tmpfs (max_file_bytes apiece, 64 MiB here).
    r = run_code(MEMORY, timeout_s=SNIPPET_TIMEOUT_S, memory_mb=128)
    assert r.exit_code == 0, r
    held = eval(r.stdout)
    assert "memfd" not in held and "sysv" not in held and held["/dev/shm"] <= 64 and held["/tmp"] <= 64, r


# Each scratch dir filled with another kind of inode, up to 4 times the bound (an unbounded tmpfs stops there).
INODES = f'''
import errno, os
def fill(folder, make):
    try:
        for i in range({4 * SCRATCH_INODES}):
            make(f"{{folder}}/{{i}}")
    except OSError as e:
        return i, errno.errorcode[e.errno]
    return i + 1, None
open("/dev/shm/target", "w").close()
print({{folder: fill(folder, make) for folder, make in [
    ("/tmp", lambda p: os.close(os.open(p, os.O_CREAT | os.O_WRONLY))), ("/var/tmp", os.mkdir),
    ("/dev/shm", lambda p: os.link("/dev/shm/target", p)), ("/run/lock", lambda p: os.symlink("target", p))]}})
'''


def test_a_snippet_cannot_make_more_inodes_than_the_bound_and_an_ordinary_one_still_writes():
    """Empty files, dirs, hard links and symlinks take no bytes but an inode each, and about 1 KiB of kernel memory
    that no rlimit counts (0.9 million empty files held 1.1 GiB): every scratch tmpfs says ENOSPC at the bound."""
    r = run_code(INODES, timeout_s=SNIPPET_TIMEOUT_S, memory_mb=128, max_processes=2, max_file_bytes=4 << 20)
    assert r.exit_code == 0, r
    made = eval(r.stdout)  # (at most 4 x SCRATCH_INODES creations: it stops at once either way)
    assert all(error == "ENOSPC" and 0 < n <= SCRATCH_INODES for n, error in made.values()), made
    r = run_code("for d in ('/tmp', '/var/tmp', '/dev/shm', '/run/lock'):\n    open(d + '/a', 'w').write(d)\n"
                 "    print(open(d + '/a').read())", timeout_s=SNIPPET_TIMEOUT_S, memory_mb=128, max_processes=2,
                 max_file_bytes=4 << 20)
    assert (r.exit_code, r.stdout.split()) == (0, ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"]), r


# ---- kernel interfaces no namespace covers: socket families, new namespaces, kernel-wide syscalls
KERNEL = f'''
import ctypes, os, socket, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def attempt(name, fn):  # fn returns a syscall's result; an fd it made is closed
    try:
        result = fn()
    except OSError as e:
        result, errno = -1, e.errno
    else:
        errno = ctypes.get_errno()
    if result == 0 and name.startswith("clone"):
        os._exit(0)  # the child of a clone that worked
    print(name, "made" if result >= 0 else "refused " + os.strerror(errno), flush=True)
def sock(*args):
    return socket.socket(*args).detach()
def raw(nr, *args):
    return libc.syscall(nr, *args)
attempt("vsock stream", lambda: sock(40, socket.SOCK_STREAM))
attempt("vsock dgram cloexec nonblock", lambda: sock(40, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | 2048))
attempt("vsock raw, high bits", lambda: raw({NR["socket"]}, 0x100000028, 1, 0))
for protocol in (15, 16, 4, 9, 12):  # uevent, generic, sock_diag, audit, netfilter
    attempt(f"netlink {{protocol}}", lambda: sock(socket.AF_NETLINK, socket.SOCK_RAW, protocol))
for family in (17, 38, 15, 30, 44, 29, 31, 21, 42, 5):  # packet, alg, key, tipc, xdp, can, bluetooth, rds, ...
    attempt(f"family {{family}}", lambda: sock(family, socket.SOCK_DGRAM))
attempt("socketpair seqpacket", lambda: socket.socketpair(type=socket.SOCK_SEQPACKET)[0].detach())
attempt("socketpair tipc", lambda: raw({NR["socketpair"]}, 30, 2, 0, ctypes.create_string_buffer(8)))
attempt("unshare user+mount", lambda: libc.unshare(0x10020000))
attempt("unshare net", lambda: libc.unshare(0x40000000))
attempt("unshare files", lambda: libc.unshare(0x400))
attempt("unshare command", lambda: -subprocess.run(["unshare", "--user", "--mount", "true"]).returncode)
attempt("setns", lambda: libc.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0))
for flag in (0x10000000, 0x20000, 0x20000000, 0x40000000, 0x2000000):  # user, mount, pid, net, cgroup
    attempt(f"clone {{flag:#x}}", lambda: raw({NR["clone"]}, flag | 17, 0, 0, 0, 0))
attempt("clone3", lambda: raw({NR["clone3"]}, ctypes.create_string_buffer(88), 88))
attempt("perf_event_open", lambda: raw({NR["perf_event_open"]}, ctypes.create_string_buffer(128), 0, -1, -1, 0))
attempt("bpf", lambda: raw({NR["bpf"]}, 0, ctypes.create_string_buffer(128), 128))
attempt("userfaultfd", lambda: raw({NR["userfaultfd"]}, 0))
attempt("syslog", lambda: raw({NR["syslog"]}, 3, ctypes.create_string_buffer(4096), 4096))
print("still works:")
attempt("inet", lambda: sock(socket.AF_INET, socket.SOCK_STREAM))
attempt("inet6", lambda: sock(socket.AF_INET6, socket.SOCK_DGRAM))
attempt("route", lambda: sock(socket.AF_NETLINK, socket.SOCK_RAW, 0) and len(socket.if_nameindex()) - 1)
attempt("pair", lambda: socket.socketpair()[0].detach())
attempt("clone", lambda: raw({NR["clone"]}, 17, 0, 0, 0, 0))
thread = threading.Thread(target=lambda: None)
attempt("thread", lambda: thread.start() or thread.join() or 0)
attempt("subprocess", lambda: subprocess.run(["true"]).returncode)
'''


@pytest.mark.parametrize("who", ["as ourselves", "as an ordinary user"])
def test_kernel_interfaces_no_namespace_covers_are_refused(who, tmp_path):
    """Kernel interfaces not namespaced: a snippet makes no socket but AF_INET(6) and NETLINK_ROUTE (a vsock one
    shared the VM's port space and reached the hypervisor, a uevent one heard the host's devices), no namespace (as
    root, a user namespace of its own held every capability there and mounted tmpfs no limit counts: 720 MiB under
    --sandbox_memory_mb 128), and no bpf, perf events, userfaultfd or kernel log whatever this kernel's sysctls say;
    clone3 is ENOSYS so that libc falls back to clone, and threads and subprocesses still work."""
    if who == "as an ordinary user" and os.geteuid() != 0:
        pytest.skip("we are an ordinary user already")
    code = f"import sandbox\nr = sandbox.run_code({KERNEL!r}, timeout_s={SNIPPET_TIMEOUT_S})\nprint(r.stdout, r.stderr)"
    proc = subprocess.run([PYTHON, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300) \
        if who == "as ourselves" else _as_an_ordinary_user(code, tmp_path)
    refused, works = proc.stdout.split("still works:\n")
    assert proc.returncode == 0 and refused.count("\n") == 35 and "made" not in refused, proc.stdout
    assert refused.count("refused Function not implemented") == 1 and "clone3 refused Function" in refused
    assert works.split("\n")[:7] == [f"{name} made" for name in ("inet", "inet6", "route", "pair", "clone", "thread",
                                                                   "subprocess")], proc.stdout
