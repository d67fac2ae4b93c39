"""Run one untrusted Python snippet for tool-integrated reasoning (paper section 5.1, Appendix D).

The policy writes a ```python block, we run it here, and its stdout + stderr go back into the context
(format_tool_output, interpreter_text). The sandbox is stateless: every run is a fresh interpreter in a fresh
directory, and nothing a snippet does (timeout, crash, flood, fork bomb) raises in the caller; it all comes back
as a SandboxResult.

    from sandbox import run_code, SandboxPool, format_tool_output
    print(format_tool_output(run_code("print(2**100)", timeout_s=30, memory_mb=1024)))
    with SandboxPool(workers=8) as pool:           # threads: each run is a subprocess
        results = pool.map(codes)                   # in order; futures via pool.submit(code)

How a run is built (`isolation()` probes once which of these the machine allows, best first):
  prlimit   memory (RLIMIT_AS), CPU seconds, processes, open files, file size, no core dumps; a binary rather than
            preexec_fn, so a big, threaded parent forks cheaply (vfork) and safely.
  unshare   new network namespace (only a downed loopback: no network at all), new pid namespace (the snippet sees
            only its own processes; all of them die with it), new mount namespace with a fresh /proc and fresh
            size-capped tmpfs on /tmp, /var/tmp, /dev/shm, /run/lock: the working directory is the private /tmp, gone
            when the run ends. (If the interpreter or its venv lives under one of those dirs, that dir is bound
            read-only instead of hidden.) New IPC namespace: SysV shm, queues, semaphores and POSIX message queues are
            the run's own, unseen by other runs and gone with it. As root we also set its limits (shmmax, shmall: all
            segments together at most memory_mb; shm_rmid_forced: a segment dies with its last user; few queues and
            semaphores), so IPC holds little beyond the run's limits while it lasts; without root the snippet is root
            of the namespace's owner and could lift them. No UTS or cgroup namespace: they would guard nothing (a new
            UTS namespace shows the same hostname, which the snippet cannot change anyway; a cgroup one only renames
            cgroup paths).
  seccomp   a filter (set by a short launcher before setpriv, kept through every fork and exec) fails with EPERM:
            socket(AF_UNIX, ...); socketpair(AF_UNIX, ...) unless SOCK_STREAM (a datagram pair can sendto() any path;
            a stream pair stays connected, so multiprocessing and asyncio work); io_uring_setup (io_uring makes and
            connects sockets without syscalls a filter sees); every syscall of another ABI (i386 via int 0x80, x32,
            arm32); without namespaces also SysV IPC and POSIX message queues, which would outlive the run on the
            host. So no snippet reaches a Unix socket of the host, wherever it lives (/run/*.sock, docker.sock, a dir
            bound read-only: connect() needs no write access). multiprocessing.Manager and the forkserver start method
            listen on AF_UNIX, so they fail.
  setpriv   when we are root: a dedicated unprivileged uid per concurrent run (60000 + slot, claimed with flock so
            parallel trainers never share one), no supplementary groups, no_new_privs. Root ignores RLIMIT_NPROC, so
            this is what stops a fork bomb; it also keeps the snippet off root-owned files and /proc/<pid>/environ of
            other processes.
Plus: `python -I` (no PYTHON* variables, no user site), a scrubbed environment (PATH, HOME, LANG, TMPDIR and
single-threaded BLAS; nothing of ours), stdin closed, a new session; output read while it arrives, each stream
capped at max_output_bytes (first and last halves kept); at the wall-clock limit the whole process group is
SIGKILLed and every process of the run (its group, its uid) is hunted down. Without unshare, runs get a host temp
dir (removed afterwards) and network_isolated=False; without root, no dedicated uid (a snippet that calls setsid
can then outlive the run); without seccomp (a kernel without it, an architecture other than x86_64 and aarch64),
unix_sockets_blocked=False.

What it does NOT protect against: kernel exploits (it is not a security boundary; use a VM or gVisor for hostile
code); reading world-readable host files (and so the host's configuration, the code of the project); FIFOs a host
process left writable to others; CPU contention with the trainer; memory beyond max_processes * memory_mb
(RLIMIT_AS is per process; a memory cgroup would be the fix), plus the private tmpfs dirs and SysV shm (each up to
its cap) while the run lasts; snippets still running if the calling process itself is killed (RLIMIT_CPU bounds
the busy ones). Linux only (rollout.make_tools refuses --tools elsewhere in one line).
The interpreter should be readable by the dedicated uid: one under /root (mode 700) still starts, but with the
system's stdlib of the same minor version (the probe checks that much) and the snippet cannot start it again
itself; `chmod o+x /root` or a python under /opt or /usr avoids that.
"""
import ast
import functools
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from machinery.seccomp import LAUNCHER, seccomp_program

UID_BASE, UID_SLOTS = 60000, 256  # dedicated uids for runs; outside normal user ranges, inside 16 bits
_LOCK_DIR = os.path.join(tempfile.gettempdir(), "spo_sandbox_uids")
_PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # the world-writable dirs of a usual host
_OOM_PATTERN = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int  # signal N: 128 + N in namespaces (a shell sits between), else -N; -9 on timeout
    timed_out: bool  # hit the wall-clock limit; the whole run was killed
    out_of_memory: bool  # MemoryError (RLIMIT_AS) or an allocation failure message in stderr
    output_truncated: bool  # a stream exceeded max_output_bytes; its middle was dropped
    network_isolated: bool  # ran in its own network namespace (no interfaces but a downed loopback)
    unix_sockets_blocked: bool  # socket(AF_UNIX) refused by seccomp: no Unix socket of the host is reachable
    duration_s: float


@dataclass(frozen=True)
class Isolation:
    namespaces: bool  # network, pid, mount and IPC namespaces via unshare (with --user when not root)
    dedicated_uid: bool  # runs as an unprivileged uid of its own (we are root)
    seccomp: bool  # a seccomp filter refuses AF_UNIX sockets and io_uring (SysV IPC too, without namespaces)


class _HeadTail:
    """Keeps the first and last cap // 2 bytes of a stream in bounded memory, however much arrives."""

    def __init__(self, cap: int):
        self.cap, self.head, self.tail, self.total = cap, bytearray(), bytearray(), 0

    def add(self, data: bytes):
        self.total += len(data)
        room = max(0, self.cap - self.cap // 2 - len(self.head))
        self.head += data[:room]
        self.tail += data[room:]
        if len(self.tail) > self.cap:  # trim only now and then: amortised O(1) per byte
            del self.tail[: len(self.tail) - self.cap // 2]

    def text(self) -> str:
        if self.total <= self.cap:
            return (self.head + self.tail).decode("utf-8", errors="replace")
        tail = self.tail[len(self.tail) - self.cap // 2:]
        cut = self.total - len(self.head) - len(tail)
        return (self.head.decode("utf-8", errors="replace") + f"\n...[{cut} bytes cut]...\n"
                + tail.decode("utf-8", errors="replace"))


def _claim_uid() -> tuple[int, int]:
    """A dedicated uid no other run (thread or process) holds now; the lock dies with the fd."""
    import fcntl  # Unix only: imported here so that rollout.py, which imports this file, loads on Windows too
    os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
    for uid in range(UID_BASE, UID_BASE + UID_SLOTS):
        fd = os.open(os.path.join(_LOCK_DIR, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise RuntimeError(f"sandbox: all {UID_SLOTS} dedicated uids from {UID_BASE} are busy")


@functools.cache
def _interpreter_dirs() -> frozenset:
    """The private dirs that contain the running interpreter or its environment."""
    paths = {os.path.realpath(p) for p in (sys.executable, sys.prefix, sys.base_prefix)} | {sys.executable}
    return frozenset(d for d in _PRIVATE_DIRS if any(p == d or p.startswith(d + "/") for p in paths))


def _workdir() -> str:
    """The namespaced run's working directory: the first private dir that gets a fresh tmpfs."""
    return next(d for d in _PRIVATE_DIRS if d not in _interpreter_dirs() and os.path.isdir(d))


# The limits of a run's own IPC namespace that do not depend on the run: few message queues (each holds at
# most kernel.msgmnb bytes, which only CAP_SYS_RESOURCE raises) and semaphores (the kernel's old defaults:
# per set, in all, per semop call, sets), and shm segments freed once nobody has them attached.
_IPC_SYSCTLS = {"msgmni": "32", "sem": "250 32000 32 128", "shm_rmid_forced": "1"}


def _command(code: str, iso: Isolation, uid: int | None, limits: dict) -> list[str]:
    """prlimit -> [unshare -> sh: private dirs, IPC limits] -> [seccomp launcher] -> [setpriv] -> python -I -c code."""
    argv = ["prlimit", *(f"--{name}={value}" for name, value in limits.items()), "--"]
    if iso.namespaces:
        argv += ["unshare", "--mount", "--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc"]
        argv += [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        # The shell stays pid 1 of the namespace (no exec), so python keeps ordinary signal
        # semantics and orphans get reaped; when the shell exits, the kernel kills the namespace.
        # A private dir that holds the interpreter itself (a checkout or venv under /tmp, say) cannot be
        # hidden under a tmpfs: it becomes read-only instead, so the snippet can read it but not write there.
        setup = "".join(f'[ ! -d {d} ] || {{ mount --bind {d} {d} && mount -o remount,bind,ro {d}; }}; '
                         if d in _interpreter_dirs() else
                         f'[ ! -d {d} ] || mount -t tmpfs -o size={limits["fsize"]},mode=1777 tmpfs {d}; '
                         for d in _PRIVATE_DIRS)
        if os.geteuid() == 0:  # without root, the snippet is root of the IPC namespace's owner: it could lift them
            sysctls = {**_IPC_SYSCTLS, "shmmax": limits["as"], "shmall": limits["as"] // os.sysconf("SC_PAGE_SIZE")}
            setup += "".join(f"echo '{value}' > /proc/sys/kernel/{name}; " for name, value in sysctls.items())
        argv += ["sh", "-c", f'set -e; {setup}cd {_workdir()}; "$@"', "sh"]
    if iso.seccomp:
        argv += [sys.executable, "-I", "-S", "-c", LAUNCHER, seccomp_program(not iso.namespaces).hex()]
    if iso.dedicated_uid:
        # setpriv resolves the interpreter path before its capabilities go, so a python under
        # /root still execs; afterwards the snippet has no capabilities and cannot gain any.
        argv += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]
    return argv + [sys.executable, "-I", "-c", code]


def _read_until_exit(proc: subprocess.Popen, timeout_s: float, cap: int) -> tuple[_HeadTail, _HeadTail, bool]:
    """Drain stdout and stderr as they arrive (a flood never fills our memory) until exit or timeout.
    A pidfd says when the process exits without reaping it, so its pid (the group id) stays ours."""
    out, err = _HeadTail(cap), _HeadTail(cap)
    deadline, exited = time.monotonic() + timeout_s, False
    pidfd = os.pidfd_open(proc.pid)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ, out)
            selector.register(proc.stderr, selectors.EVENT_READ, err)
            selector.register(pidfd, selectors.EVENT_READ, None)
            while selector.get_map() and (now := time.monotonic()) < deadline:
                for key, _ in selector.select(timeout=deadline - now):
                    if key.data is None:  # exited; a leftover child may hold the pipes: don't wait on it
                        exited, deadline = True, min(deadline, now + 0.1)
                        selector.unregister(pidfd)
                    elif data := os.read(key.fd, 1 << 16):
                        key.data.add(data)
                    else:
                        selector.unregister(key.fileobj)
        exited = exited or os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    finally:
        os.close(pidfd)
    return out, err, not exited


def _run_processes(pgid: int, uid: int | None) -> list[int]:
    """Live (non-zombie) processes in process group pgid or owned by uid, from /proc/<pid>/status."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if fields["State"].split()[0] != "Z" and (int(fields["NSpgid"].split()[0]) == pgid
                                                      or int(fields["Uid"].split()[0]) == uid):
                pids.append(int(name))
        except (OSError, KeyError, ValueError):  # not a pid, or it exited while we looked
            pass
    return pids


def _kill_everything(pgid: int, uid: int | None):
    """SIGKILL the run's process group, then every straggler (setsid daemons, double forks, fork
    bombs: all share the dedicated uid) until none is left. Returns once they are really gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)  # first strike: the whole group at once
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 5.0
    while (pids := _run_processes(pgid, uid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.002)


def _run(code: str, iso: Isolation, timeout_s: float, max_output_bytes: int, limits: dict) -> SandboxResult:
    start = time.perf_counter()
    uid, lock_fd = _claim_uid() if iso.dedicated_uid else (None, None)
    workdir = None if iso.namespaces else tempfile.mkdtemp(prefix="spo_sandbox_")
    try:
        if workdir and uid is not None:
            os.chown(workdir, uid, uid)
        home = workdir or _workdir()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
               # one BLAS thread: less contention with the trainer, and fewer threads for RLIMIT_NPROC
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        try:
            proc = subprocess.Popen(_command(code, iso, uid, limits), cwd=workdir or "/", env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except (OSError, ValueError) as e:  # e.g. a NUL byte in the code, or code over 128 KiB
            return SandboxResult(stdout="", stderr=f"sandbox: could not start the code: {e}", exit_code=-1,
                                 timed_out=False, out_of_memory=False, output_truncated=False,
                                 network_isolated=iso.namespaces, unix_sockets_blocked=iso.seccomp,
                                 duration_s=time.perf_counter() - start)
        with proc:
            out, err, timed_out = _read_until_exit(proc, timeout_s, max_output_bytes)
            # A finished namespaced run is already empty: the kernel killed it all with its pid 1.
            if timed_out or not iso.namespaces:
                _kill_everything(proc.pid, uid)
            proc.wait()
        stderr = err.text()
        return SandboxResult(
            stdout=out.text(), stderr=stderr, exit_code=proc.returncode, timed_out=timed_out,
            out_of_memory=bool(_OOM_PATTERN.search(stderr)),
            output_truncated=max(out.total, err.total) > max_output_bytes,
            network_isolated=iso.namespaces, unix_sockets_blocked=iso.seccomp,
            duration_s=time.perf_counter() - start)
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        if lock_fd is not None:
            os.close(lock_fd)


_PROBE = ("import os, socket, sys\n"
          "try:\n    socket.socket(socket.AF_UNIX).close()\n    unix = 'open'\n"
          "except PermissionError:\n    unix = 'blocked'\n"
          "print(os.geteuid(), sorted(n for _, n in socket.if_nameindex()), sys.version_info[:2], unix, sep=';')")
_probe_lock = threading.Lock()


@functools.cache
def _probe() -> Isolation:
    if shutil.which("prlimit") is None:
        raise RuntimeError("sandbox.py needs prlimit (util-linux); setpriv and unshare make it stronger")
    strong = [(True, True), (False, True)] if os.geteuid() == 0 else []
    filters, reasons = (True, False), []
    if seccomp_program(False) is None:
        filters = (False,)
        reasons.append(f"no seccomp filter for {os.uname().machine}")
    for iso in [Isolation(ns, uid, seccomp) for ns, uid in strong + [(True, False), (False, False)]
                for seccomp in filters]:
        r = _run(_PROBE, iso, 20.0, 4096, {"as": 1 << 30, "fsize": 1 << 20, "core": 0})
        fields = r.stdout.strip().split(";")
        if (r.exit_code == 0 and len(fields) == 4 and fields[2] == str(sys.version_info[:2])  # same stdlib minor
                and (not iso.namespaces or fields[1] == "['lo']") and (not iso.dedicated_uid or fields[0] != "0")
                and (not iso.seccomp or fields[3] == "blocked")):
            if reasons:
                warnings.warn(f"sandbox: weaker isolation {iso}; stronger ones failed: {reasons}")
            return iso
        reasons.append(f"{iso}: {(r.stdout + r.stderr).strip()[-300:]}")
    raise RuntimeError(f"sandbox: python cannot run at all: {reasons}")


def isolation() -> Isolation:
    """The strongest isolation this machine allows, found once by running a probe through each."""
    with _probe_lock:  # the first calls of a pool's threads arrive together: probe once
        return _probe()


def run_code(code: str, timeout_s: float = 30.0, memory_mb: int = 1024, max_output_bytes: int = 1 << 16,
             cpu_time_s: int | None = None, max_processes: int = 16, max_open_files: int = 256,
             max_file_bytes: int = 64 << 20) -> SandboxResult:
    """Run `code` with python -I in a fresh sandbox; never raises for anything the code does.
    max_processes counts threads too; max_file_bytes also sizes each private tmpfs; the CPU limit
    (default: the wall-clock limit + 1 s) backs up the wall clock should the caller die."""
    if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0 or max_processes <= 0:
        raise ValueError("run_code: timeout_s, memory_mb, max_output_bytes and max_processes must be > 0")
    limits = {"as": memory_mb << 20, "cpu": cpu_time_s or int(timeout_s) + 1, "nofile": max_open_files,
              "fsize": max_file_bytes, "core": 0}
    if os.geteuid() == 0:  # for other users RLIMIT_NPROC counts all their processes, the trainer's too
        limits["nproc"] = max_processes
    return _run(code, isolation(), timeout_s, max_output_bytes, limits)


class SandboxPool:
    """Runs up to `workers` snippets at once, so tool calls overlap generation. Limits as run_code."""

    def __init__(self, workers: int = 8, **limits):
        if workers < 1:
            raise ValueError(f"SandboxPool: workers must be >= 1, got {workers}")
        self.limits = limits
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")

    def submit(self, code: str) -> "Future[SandboxResult]":
        return self.executor.submit(run_code, code, **self.limits)

    def map(self, codes) -> list[SandboxResult]:
        futures = [self.submit(code) for code in codes]
        return [future.result() for future in futures]

    def close(self):
        self.executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def format_tool_output(result: SandboxResult, max_chars: int = 256) -> str:
    """The interpreter text fed back to the model: stdout + stderr, cut to max_chars keeping the first
    and last halves, then a note on timeout / memory / non-zero exit that the cut never removes."""
    text = result.stdout + result.stderr
    if len(text) > max_chars:
        half = max_chars // 2
        text = text[:half] + "\n...\n" + text[len(text) - (max_chars - half):]
    if result.timed_out:
        note = f"TimeoutError: killed after {result.duration_s:.0f} s (time limit)"
    elif result.out_of_memory:
        note = f"MemoryError: out of memory (exit code {result.exit_code})"
    elif result.exit_code != 0:
        note = f"exit code {result.exit_code}"
    else:
        return text
    separator = "" if not text or text.endswith("\n") else "\n"
    return f"{text}{separator}[{note}]"


def show_last_expression(code: str) -> str:
    """Make a bare last top-level expression print its value (repr, nothing for None), as a REPL would.
    Anything else (a print call, an assignment, an indented line, code that does not parse) is returned unchanged."""
    try:
        tree = ast.parse(code)
    except Exception:  # noqa: BLE001 - a syntax error, or nesting too deep for the parser: python reports it
        return code
    last = tree.body[-1] if tree.body else None
    if not isinstance(last, ast.Expr):
        return code
    value = last.value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "print":
        return code
    # where each line starts; python ends a line at \r\n, \r or \n (str.splitlines knows more separators)
    starts = [0] + [m.end() for m in re.finditer(r"\r\n|\r|\n", code)]

    def offset(lineno, col):  # ast columns count UTF-8 bytes
        return starts[lineno - 1] + len(code[starts[lineno - 1]:].encode()[:col].decode())

    start, end = offset(last.lineno, last.col_offset), offset(last.end_lineno, last.end_col_offset)
    shown = f"__value = ({code[start:end]})\nif __value is not None: print(repr(__value))"
    return code[:start] + shown + code[end:]


def interpreter_text(outcome, max_chars: int) -> tuple[str, bool, bool]:
    """(interpreter text, error, timed out) for a tool outcome: a Future of a SandboxResult, or an error
    message. A sandbox that itself fails becomes text like any other error: training must go on."""
    error, timed_out = True, False
    if isinstance(outcome, str):
        out = outcome
    else:
        try:
            result = outcome.result()
            out, error, timed_out = format_tool_output(result, max_chars), result.exit_code != 0, result.timed_out
        except Exception as e:  # noqa: BLE001 - anything the sandbox raises goes back to the model
            out = f"sandbox error: {type(e).__name__}: {e}"[:max_chars]
    return f"<interpreter>\n{out.rstrip()}\n</interpreter>\n\n", error, timed_out
