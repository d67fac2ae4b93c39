"""Stands in for bubblewrap or nsjail (no wheel here): util-linux's prlimit, unshare, mount and pivot_root, composed.

The command line that isolates one snippet run of sandbox.py, and what it needs from the host (a dedicated uid as
root, the dirs a snippet may read). sandbox.py runs the command, reads its output and kills what is left;
`sandbox.isolation()` checks once that this machine allows it (if not, SandboxUnavailable and --tools refuses to
start in one line; there is no weaker fallback). Each run costs about 1.5x a run without its own root
(docs/benchmarks.md: the sandbox). How a run is built:
  prlimit   memory (RLIMIT_AS), CPU seconds, processes (as root), open files, file size, no core dumps.
  unshare   network namespace (a downed loopback: no network, no abstract Unix socket of the host), pid namespace
            (all of the run dies with it), IPC namespace (POSIX message queues; SysV IPC is refused), and
            a mount namespace with a root of its own (_root_setup): fresh size-capped tmpfs on /tmp, /var/tmp,
            /dev/shm, /run/lock (all it may write), the system's and the interpreter's dirs read-only, then
            pivot_root: the repository, the data and their answers, the run directory, homes are not there.
  seccomp   a fresh empty session keyring, then a filter fails socket(AF_UNIX), datagram socketpair(AF_UNIX),
            io_uring_setup, add_key, keyctl, request_key, memfd_create, memfd_secret and other ABIs' syscalls with
            EPERM (multiprocessing and asyncio still work: they use stream pairs and /dev/shm).
  identity  as root: a dedicated uid per concurrent run (60000 + slot, flock in a dir only root can write), no
            groups, no_new_privs (RLIMIT_NPROC then stops a fork bomb). Otherwise: a nested user namespace that
            maps no one, so the snippet holds no capability: it cannot undo its mounts or make namespaces.
"""
import atexit
import contextlib
import functools
import os
import re
import shlex
import stat
import sys
import tempfile
from dataclasses import dataclass

from machinery.seccomp import KEYCTL, LAUNCHER, seccomp_program

UID_BASE, UID_SLOTS = 60000, 256  # dedicated uids for runs; outside normal user ranges, inside 16 bits
_LOCK_DIR = "/run/spo_sandbox_uids"  # only root claims uids, and only root can write /run: no one can plant files here
_SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # fresh size-capped tmpfs: all a snippet may write
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
def _root_setup(scratch_bytes: int) -> str:
    """Shell commands (as root of the run's mount namespace) that build the snippet's root and enter it; after
    pivot_root nothing of the host's tree stays reachable, not even through /proc/1/root."""
    q, root = shlex.quote, _mount_point()
    links = [d for d in visible_dirs() if d in _SYSTEM_DIRS and os.path.islink(d)]  # /bin -> usr/bin
    dirs = [d for d in visible_dirs() if d not in links]
    first = [d for d in dirs if not any(_under(d, s) for s in _SCRATCH_DIRS)]  # a venv under /tmp: after its tmpfs
    devices = [f"/dev/{n}" for n in _DEVICES if os.path.exists(f"/dev/{n}")]
    # Few processes: each command here is a fork and exec on every tool call.
    cmds = [f"mount -t tmpfs -o size=1m,mode=755 tmpfs {q(root)}", f"cd {q(root)}",
            "mkdir -p " + " ".join(q(root + d) for d in (*_SCRATCH_DIRS, *first, "/proc", "/dev", "/.old"))]
    cmds += [f"mount -t tmpfs -o size={scratch_bytes},mode=1777 tmpfs {q(root + d)}" for d in _SCRATCH_DIRS]
    if later := [d for d in dirs if d not in first]:
        cmds.append("mkdir -p " + " ".join(q(root + d) for d in later))
    for d in dirs:  # read-only, each submount too (bind,ro remounts the top one only)
        cmds.append(f"mount --rbind -o ro {q(d)} {q(root + d)}")
        cmds += [f"mount -o remount,bind,ro {q(root + p)}" for p in _mount_points_under(d)[1:]]
    if links:
        cmds.append("cp -P " + " ".join(q(d) for d in links) + f" {q(root)}/")
    cmds += [f": > {q(root + d)}; mount --bind {d} {q(root + d)}" for d in devices]
    cmds += [f"mount --rbind /proc {q(root)}/proc", f"ln -s /proc/self/fd {q(root)}/dev/fd", "pivot_root . .old",
             "umount -l /.old", "mount -o remount,bind,ro /", "cd /tmp"]
    return "; ".join(cmds) + "; "


def _per_namespace_nproc() -> bool:
    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return bool(release) and (int(release[1]), int(release[2])) >= (5, 14)


def command(code: str, iso: Isolation, uid: int | None, limits: dict) -> list[str]:
    """prlimit -> unshare -> sh: the new root -> the launcher (a fresh keyring, seccomp) -> setpriv (root) or a user
    namespace of no one (otherwise) -> python -I -c code."""
    # Without root, RLIMIT_NPROC counts all the user's processes (the trainer's threads too) outside the snippet's
    # own user namespace: it is set inside it, where (Linux 5.14+) it counts the snippet's processes only.
    outer = {k: v for k, v in limits.items() if k != "nproc" or iso.dedicated_uid}
    argv = ["prlimit", *(f"--{name}={value}" for name, value in outer.items()), "--"]
    argv += ["unshare", "--mount", "--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc"]
    argv += [] if iso.dedicated_uid else ["--user", "--map-root-user"]
    # The shell stays pid 1 of the namespace (no exec), so python keeps ordinary signal
    # semantics and orphans get reaped; when the shell exits, the kernel kills the namespace.
    argv += ["sh", "-c", f'set -e; {_root_setup(limits["fsize"])}"$@"', "sh"]
    argv += [sys.executable, "-I", "-S", "-c", LAUNCHER, seccomp_program().hex(), str(KEYCTL)]
    if iso.dedicated_uid:
        # setpriv resolves the interpreter path before its capabilities go; afterwards the snippet has
        # no capabilities and cannot gain any.
        argv += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]
    else:
        # A nested user namespace that maps no one: the snippet holds no capability at all, so it cannot undo
        # its mounts (made by the namespace above), and an unmapped uid cannot make namespaces of its own.
        argv += ["unshare", "--user"]
        if "nproc" in limits and _per_namespace_nproc():
            argv += ["prlimit", f"--nproc={limits['nproc']}", "--"]
    return argv + [sys.executable, "-I", "-c", code]
