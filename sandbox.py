"""Run one untrusted Python snippet for tool-integrated reasoning (paper section 5.1, Appendix D).

The policy writes a ```python block, we run it here, and its stdout + stderr go back into the context
(format_tool_output, interpreter_text). The sandbox is stateless: every run is a fresh interpreter in a fresh
directory, and nothing a snippet does (timeout, crash, flood, fork bomb) raises in the caller; it all comes back
as a SandboxResult.

    from sandbox import run_code, SandboxPool, format_tool_output
    print(format_tool_output(run_code("print(2**100)", timeout_s=30, memory_mb=1024)))
    with SandboxPool(workers=8) as pool:           # threads: each run is a subprocess
        results = pool.map(codes)                   # in order; futures via pool.submit(code)

How a run is isolated (machinery/isolation.py, `isolation()` checks once that this machine allows it; if not,
SandboxUnavailable and --tools refuses to start in one line; there is no weaker fallback): its own network, pid,
IPC and mount namespaces with a root of its own (only the system's and the interpreter's dirs, read only), rlimits,
a fresh session keyring, a seccomp filter against what no namespace covers (machinery/seccomp.py: sockets but
AF_INET(6), new namespaces, keyrings, memfds, SysV IPC, bpf, perf events), a dedicated uid as root or a user
namespace of no one otherwise; a parent-death signal ends the run when the caller does, however it ends.

Plus `python -I`, a scrubbed environment (nothing of ours), stdin closed; output capped while it arrives (first
and last halves kept); at the wall-clock limit every process of the run is SIGKILLed and hunted down.

NOT protected: kernel exploits (not a security boundary: use a VM or gVisor for hostile code); reading the
bound dirs (/etc, the venv); CPU contention with the trainer; memory beyond max_processes * memory_mb plus the four
tmpfs dirs (max_file_bytes and 4096 inodes each) and the kernel's own buffers (pipes, sockets: bounded by
max_open_files; a memory cgroup would be the fix); without root on Linux before 5.14, a fork bomb up to the user's
process limit. Linux only (rollout.make_tools refuses --tools elsewhere).
"""
import ast
import contextlib
import functools
import os
import re
import selectors
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from machinery.isolation import Isolation, SandboxUnavailable, claim_uid, command
from machinery.seccomp import seccomp_program

_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"  # the sandbox's, whatever the caller's
_OOM_PATTERN = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int  # signal N: 128 + N (a shell sits between); -9 on timeout
    timed_out: bool  # hit the wall-clock limit; the whole run was killed
    out_of_memory: bool  # MemoryError (RLIMIT_AS) or an allocation failure message in stderr
    output_truncated: bool  # a stream exceeded max_output_bytes; its middle was dropped
    duration_s: float


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
        with contextlib.suppress(OSError, KeyError, ValueError):  # not a pid, or it exited while we looked
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if fields["State"].split()[0] != "Z" and (int(fields["NSpgid"].split()[0]) == pgid
                                                      or int(fields["Uid"].split()[0]) == uid):
                pids.append(int(name))
    return pids


def _kill_everything(pgid: int, uid: int | None):
    """SIGKILL the run's process group, then every straggler (setsid daemons, double forks, fork
    bombs: all share the dedicated uid) until none is left. Returns once they are really gone."""
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # first strike: the whole group at once
    deadline = time.monotonic() + 5.0
    while (pids := _run_processes(pgid, uid)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)


def _run(code: str, iso: Isolation, timeout_s: float, max_output_bytes: int, limits: dict) -> SandboxResult:
    start = time.perf_counter()
    uid, lock_fd = claim_uid() if iso.dedicated_uid else (None, None)
    try:
        if lock_fd is not None:  # marked while a run uses the uid: a mark found is a killed trainer's run
            if os.pread(lock_fd, 1, 0):
                _kill_everything(None, uid)  # (its processes got SIGKILL with it: this is the backstop)
            os.pwrite(lock_fd, b"1", 0)
        env = {"PATH": _PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               # one BLAS thread: less contention with the trainer, and fewer threads for RLIMIT_NPROC
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        try:
            proc = subprocess.Popen(command(code, iso, uid, limits), cwd="/", env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except (OSError, ValueError) as e:  # e.g. a NUL byte in the code, or code over 128 KiB
            return SandboxResult(stdout="", stderr=f"sandbox: could not start the code: {e}", exit_code=-1,
                                 timed_out=False, out_of_memory=False, output_truncated=False,
                                 duration_s=time.perf_counter() - start)
        with proc:
            out, err, timed_out = _read_until_exit(proc, timeout_s, max_output_bytes)
            # A finished run is already empty: the kernel killed it all with its pid 1.
            if timed_out:
                _kill_everything(proc.pid, uid)
            proc.wait()
        if lock_fd is not None:  # nothing of the run is left
            os.ftruncate(lock_fd, 0)
        stderr = err.text()
        return SandboxResult(stdout=out.text(), stderr=stderr, exit_code=proc.returncode, timed_out=timed_out,
                             out_of_memory=bool(_OOM_PATTERN.search(stderr)), duration_s=time.perf_counter() - start,
                             output_truncated=max(out.total, err.total) > max_output_bytes)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


_PROBE = ("import os, socket\n"
          "try:\n    socket.socket(socket.AF_UNIX).close()\n    unix = 'open'\n"
          "except PermissionError:\n    unix = 'blocked'\n"
          f"print(os.geteuid(), sorted(n for _, n in socket.if_nameindex()), unix, os.path.exists({__file__!r}), "
          "sep=';')")
_probe_lock = threading.Lock()


@functools.cache
def _probe() -> Isolation:
    """The isolation every run gets. There is no weaker fallback: a snippet that could read the host's files (the
    data and its answers, the run directory, the user's home) or write them, or reach the trainer's keys, is not a
    sandbox."""
    for tool in ("unshare", "setpriv"):  # the sandbox's own PATH: a user's may lack sbin (Debian's)
        if shutil.which(tool, path=_PATH) is None:
            raise SandboxUnavailable(f"sandbox: --tools needs {tool} (util-linux), not found in {_PATH}")
    if seccomp_program() is None:
        raise SandboxUnavailable(f"sandbox: --tools needs a seccomp filter, which we have for x86_64 and aarch64 only "
                                 f"(this is {os.uname().machine})")
    iso = Isolation(dedicated_uid=os.geteuid() == 0)
    r = _run(_PROBE, iso, 20.0, 4096, {"as": 1 << 30, "fsize": 1 << 20, "core": 0})
    fields = r.stdout.strip().split(";")  # euid (never 0), interfaces, AF_UNIX, whether this file is seen
    if r.exit_code == 0 and fields == [fields[0], "['lo']", "blocked", "False"] and fields[0] != "0":
        return iso
    raise SandboxUnavailable(f"sandbox: cannot give snippets a private root here ({iso}: "
                             f"{(r.stdout + r.stderr).strip()[-300:]}); not as root this needs unprivileged user "
                             "namespaces (sysctl user.max_user_namespaces > 0, on Ubuntu kernel.apparmor_restrict_"
                             "unprivileged_userns=0) and seccomp: allow them, run as root, or drop --tools")


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
              "fsize": max_file_bytes, "core": 0, "nproc": max_processes}
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


# The tags of the tool loop and of the think gate. Printed by a snippet, they would close its interpreter block,
# open a code block or end a thought, and what follows would read as the model's own (reward.py:visible_text).
_LOOP_TAGS = re.compile(r"<(/?(?:code|interpreter|think))>")


def interpreter_text(outcome, max_chars: int) -> tuple[str, bool, bool]:
    """(interpreter text, error, timed out) for a tool outcome: a Future of a SandboxResult, or an error
    message. Tool output is plain text: the loop's tags in it are escaped (`<code>` -> `&lt;code>`), and
    rollout.py tokenises it with no added token. A failing snippet becomes text like any other error
    (training must go on); a sandbox that cannot run at all stops the run with one line."""
    error, timed_out = True, False
    if isinstance(outcome, str):
        out = outcome
    else:
        try:
            result = outcome.result()
            out, error, timed_out = format_tool_output(result, max_chars), result.exit_code != 0, result.timed_out
        except SandboxUnavailable as e:
            from machinery.errors import fail
            fail(f"--tools: {e}")
        except Exception as e:  # noqa: BLE001 - anything else the sandbox raises goes back to the model
            out = f"sandbox error: {type(e).__name__}: {e}"[:max_chars]
    out = _LOOP_TAGS.sub(r"&lt;\1>", out.rstrip())
    return f"<interpreter>\n{out}\n</interpreter>\n\n", error, timed_out
