"""What no namespace covers (machinery/seccomp.py): the kernel keyrings (a snippet cannot read the trainer's keys,
plant any, or leave any for the next run) and memory no limit counts (memfds, SysV IPC), as root and as an
ordinary user, against the real sandbox.

    .venv/bin/python -m pytest tests/test_sandbox_keys_memory.py -q
"""
import os
import subprocess

import pytest

from common import ENV, PYTHON, ROOT, SNIPPET_TIMEOUT_S
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
