"""A snippet's isolation: util-linux's unshare, then a launcher of ours (syscalls), in place of bubblewrap or nsjail
(no wheel here).

The command line that isolates one snippet run of sandbox.py, and what it needs from the host (a dedicated uid as
root, the dirs a snippet may read). sandbox.py runs the command, reads its output and kills what is left;
`sandbox.isolation()` checks once that this machine allows it (if not, SandboxUnavailable and --tools refuses to
start in one line; there is no weaker fallback). The plan is made once per process; every run builds it afresh:
  unshare   network namespace (a downed loopback: no network, no abstract Unix socket of the host), pid namespace
            (all of the run dies with it), IPC namespace (POSIX message queues; SysV IPC is refused), and
            a mount namespace with a root of its own (_root_setup): fresh tmpfs capped in bytes and inodes on /tmp,
            /var/tmp, /dev/shm, /run/lock (all it may write), the system's and the interpreter's dirs read-only, then
            pivot_root: the repository, the data and their answers, the run directory, homes are not there.
  limits    memory (RLIMIT_AS), CPU seconds, processes, open files, file size, no core dumps.
  seccomp   a fresh empty session keyring, then a filter (machinery/seccomp.py) fails what no namespace covers:
            sockets but AF_INET(6) and NETLINK_ROUTE, new namespaces, keyrings, memfds, SysV IPC, io_uring, bpf,
            perf events, userfaultfd, other ABIs' syscalls (multiprocessing, asyncio, threads still work).
  identity  as root: a dedicated uid per concurrent run (60000 + slot, flock in a dir only root can write), no
            groups, no_new_privs (RLIMIT_NPROC then stops a fork bomb). Otherwise: a nested user namespace that
            maps no one, so the snippet holds no capability: it cannot undo its mounts or make namespaces.
  lifetime  setpriv: unshare gets SIGKILL when the thread that started it ends (the trainer killed, even by SIGKILL),
            and the pid namespace dies with it.
"""
import atexit
import contextlib
import functools
import marshal
import os
import re
import stat
import sys
import tempfile
from dataclasses import dataclass

from machinery.seccomp import SYSCALLS, seccomp_program

UID_BASE, UID_SLOTS = 60000, 256  # dedicated uids for runs; outside normal user ranges, inside 16 bits
_LOCK_DIR = "/run/spo_sandbox_uids"  # only root claims uids, and only root can write /run: no one can plant files here
_SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # fresh capped tmpfs: all a snippet may write
SCRATCH_INODES = 4096  # per tmpfs, then ENOSPC: a file, dir or link pins ~1 KiB of kernel memory nothing else counts
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")  # read-only in the root
_DEVICES = ("null", "zero", "random", "urandom")


class SandboxUnavailable(RuntimeError):
    """The sandbox itself cannot run (not the snippet): a run must stop rather than train on tool errors."""


@dataclass(frozen=True)
class Isolation:
    dedicated_uid: bool  # runs as an unprivileged uid of its own (we are root); else in a user namespace of no one


def claim_uid() -> tuple[int, int]:
    """A dedicated uid no other run (thread or process) holds now; the lock dies with the fd."""
    import fcntl  # Unix only: imported here so that rollout.py, which imports sandbox.py, loads on Windows too
    with contextlib.suppress(FileExistsError):
        os.mkdir(_LOCK_DIR, 0o700)  # anything else: the probe's traceback names it
    info = os.lstat(_LOCK_DIR)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise SandboxUnavailable(f"sandbox: {_LOCK_DIR} is not a private directory of ours (owner uid {info.st_uid}, "
                                 f"mode {info.st_mode & 0o777:o}): someone else made it; remove it and start again")
    for uid in range(UID_BASE, UID_BASE + UID_SLOTS):
        fd = os.open(os.path.join(_LOCK_DIR, str(uid)), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise SandboxUnavailable(f"sandbox: all {UID_SLOTS} dedicated uids from {UID_BASE} are busy "
                             f"(--sandbox_workers across all trainers of this machine)")


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


@functools.cache
def visible_dirs() -> tuple[str, ...]:
    """What a snippet sees, read-only: the system's dirs and the interpreter's own (its venv, its install)."""
    system = tuple(d for d in _SYSTEM_DIRS if os.path.lexists(d))
    python = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(
        os.path.realpath(sys.executable))))}
    resolved = [os.path.realpath(d) for d in system]
    python = sorted(p for p in python if not any(_under(p, d) for d in resolved))
    return system + tuple(p for p in python if not any(_under(p, q) for q in python if q != p))


def visible_to_snippets(path: str) -> bool:
    """Whether a snippet can read this path: it lies under a dir of visible_dirs."""
    path = os.path.realpath(path)
    return any(_under(path, os.path.realpath(d)) for d in visible_dirs())


@functools.cache
def _mount_point() -> str:
    """An empty dir of ours where each run mounts its root, in its own mount namespace (the host's stays empty)."""
    atexit.register(os.rmdir, directory := tempfile.mkdtemp(prefix="spo_sandbox_root_"))
    return directory


def _mount_points_under(directory: str) -> list[str]:
    """The host's mount points at or under directory (submounts such as a container's /etc/hosts), parents first."""
    with open("/proc/self/mountinfo") as f:
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in f]
    return [directory] + [p for p in points if _under(p, directory) and p != directory]


@functools.cache
def _root_setup(scratch_bytes: int) -> tuple:
    """The launcher's steps (as root of the run's mount namespace) that build the snippet's root, in order; a mount
    makes its mount point if missing."""
    root, bind, recursive = _mount_point(), 0x1000, 0x5000  # MS_BIND, MS_BIND | MS_REC
    links = [d for d in visible_dirs() if d in _SYSTEM_DIRS and os.path.islink(d)]  # /bin -> usr/bin
    def tmpfs(target, size, mode):
        return "mount", "tmpfs", target, "tmpfs", 0, f"size={size},nr_inodes={SCRATCH_INODES},mode={mode}"
    steps = [tmpfs(root, "1m", "755"), ("mkdir", root + "/dev")]
    steps += [tmpfs(root + d, scratch_bytes, "1777") for d in _SCRATCH_DIRS]  # first: a venv under /tmp goes on it
    for d in (d for d in visible_dirs() if d not in links):  # read-only, each submount too
        steps += [("mount", d, root + d, None, recursive, None)]
        steps += [("readonly", root + p) for p in _mount_points_under(d)]
    steps += [("symlink", os.readlink(d), root + d) for d in links] + [("symlink", "/proc/self/fd", root + "/dev/fd")]
    for d in (f"/dev/{n}" for n in _DEVICES if os.path.exists(f"/dev/{n}")):
        steps += [("file", root + d), ("mount", d, root + d, None, bind, None)]
    return tuple(steps + [("mount", "/proc", root + "/proc", None, recursive, None), ("enter", root)])


# Between the namespaces and the snippet (argv: its plan, marshalled, in hex; then the snippet's command), as root of
# the run's mount namespace: builds the snippet's root and enters it (after pivot_root nothing of the host's tree
# stays reachable, not even through /proc/1/root), joins a fresh empty session keyring (a kernel without keyrings has
# nothing to leak: ENOSYS), sets the limits, takes the snippet's identity, installs the seccomp filter and execs.
# Syscalls rather than mount(8) and friends: a process per step was most of a run's cost. Few, light imports.
LAUNCHER = """import ctypes, errno, marshal, os, resource, sys
plan, libc = marshal.loads(bytes.fromhex(sys.argv[1])), ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
def check(result, what):
    if result < 0:
        sys.exit(f"sandbox: cannot {what}: {os.strerror(ctypes.get_errno())}")
def mount(source, target, fstype, flags, data):
    if not os.path.lexists(target):
        os.makedirs(target)
    check(libc.mount(*(s and os.fsencode(s) for s in (source, target, fstype)), flags, data and data.encode()),
          f"mount {target}")
def readonly(target):  # a bind remount sets every flag: keep those a user namespace may not clear (nosuid, nodev...)
    mount(None, target, None, 0x1020 | 1 | os.statvfs(target).f_flag & 14, None)  # REMOUNT | BIND | RDONLY
def enter(root):
    os.chdir(root)
    check(libc.syscall(plan["pivot_root"], b".", b"."), "pivot_root")  # the host's root now lies over ours:
    check(libc.umount2(b".", 2), "detach the host's root")  # MNT_DETACH (pivot_root(2)'s own recipe)
    readonly("/")
    os.chdir("/tmp")
ops = {"mount": mount, "readonly": readonly, "enter": enter, "mkdir": os.mkdir, "symlink": os.symlink,
       "file": lambda p: os.close(os.open(p, os.O_CREAT))}
for op, *args in plan["root"]:
    ops[op](*args)
if libc.syscall(plan["keyctl"], 1, None) < 0 and ctypes.get_errno() != errno.ENOSYS:  # JOIN_SESSION_KEYRING, NULL
    check(-1, "leave the session keyring")
if plan["uid"] is None:  # a nested user namespace of no one: no capability, so the mounts cannot be undone
    check(libc.unshare(0x10000000), "make a user namespace")  # CLONE_NEWUSER
for name, value in plan["limits"].items():  # without root, in the snippet's namespace: nproc counts only its own
    resource.setrlimit(getattr(resource, "RLIMIT_" + name.upper()), (value, value))
if plan["uid"] is not None:  # no capability left, and none to gain (no_new_privs below)
    os.setgroups([])
    os.setresgid(plan["uid"], plan["uid"], plan["uid"])
    os.setresuid(plan["uid"], plan["uid"], plan["uid"])
class Fprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
fprog = Fprog(len(plan["seccomp"]) // 8, plan["seccomp"])
check(libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0), "install the seccomp filter")
os.execv(sys.argv[2], sys.argv[2:])  # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with SECCOMP_MODE_FILTER
"""


def command(code: str, iso: Isolation, uid: int | None, limits: dict) -> list[str]:
    """unshare -> sh -> the launcher (root, keyring, limits, identity, seccomp) -> python -I -c code."""
    # Before Linux 5.14, RLIMIT_NPROC counts all the user's processes (the trainer's threads too), even inside the
    # snippet's own user namespace: without root it is not set there.
    old = tuple(int(n) for n in re.findall(r"\d+", os.uname().release)[:2]) < (5, 14)
    limits = {k: v for k, v in limits.items() if k != "nproc" or iso.dedicated_uid or not old}
    plan = {"root": _root_setup(limits["fsize"]), "limits": limits, "uid": uid, "seccomp": seccomp_program(),
            "keyctl": SYSCALLS["keyctl"], "pivot_root": SYSCALLS["pivot_root"]}
    argv = ["setpriv", "--pdeathsig", "KILL", "unshare", "--mount", "--net", "--pid", "--ipc", "--fork",
            "--kill-child", "--mount-proc"] + ([] if iso.dedicated_uid else ["--user", "--map-root-user"])
    # The shell stays pid 1 of the namespace (it forks, not execs: a command follows), so python keeps ordinary
    # signal semantics and orphans get reaped; when the shell exits, the kernel kills the namespace.
    argv += ["sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-I", "-S", "-c", LAUNCHER, marshal.dumps(plan).hex()]
    return argv + [sys.executable, "-I", "-c", code]
