"""Run directories and outputs guarded: lock files and holds, so that no run overwrites another (no library does).
"""
import atexit
import contextlib
import errno
import itertools
import os
import shutil
import socket
import time

import torch.distributed as dist

from machinery.checkpoint import MANIFEST, STEP, checkpoint_dirs, damaged, no_checkpoint
from machinery.collectives import all_gather_objects
from machinery.errors import fail, shown
from machinery.untrusted import read_file


def default_run_dir(algo):
    """runs/<algo>-<date>-<time>-<pid>: unique per job on a host (one-second names collided)."""
    return os.path.join("runs", f"{algo}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")


def open_run_dir(run_dir, *, resumed, algo, program):
    """The run directory (or a default one) claimed by rank 0, on every rank; an error stops every rank. Every
    rank writes its checkpoint shards there: a node that does not see rank 0's directory (its lock) is named."""
    error = owner = None
    if dist.get_rank() == 0:
        run_dir = run_dir or default_run_dir(algo)
        error = claim_run_dir(run_dir, resumed, program)
        owner = _lock_owner(os.path.join(run_dir, ".lock"))
    run_dir, error, owner = all_gather_objects([(run_dir, error, owner)])[0]
    if error:
        fail(error, once=True)
    seen = all_gather_objects([(socket.gethostname(), _lock_owner(os.path.join(run_dir, ".lock")) == owner)])
    if blind := sorted({host for host, sees in seen if not sees}):
        fail(f"--run_dir {run_dir}, created by rank 0 on {seen[0][0]}, is not seen by the ranks on "
             f"{', '.join(blind)}: every rank writes its checkpoint shards there, so it must be on a filesystem "
             f"all nodes share (an absolute path; docs/scale.md)", once=True)
    return run_dir


def claim_run_dir(run_dir, resume, name):
    """Rank 0's lock on run_dir, or an error line: a fresh run refuses a directory with checkpoints."""
    saved = checkpoint_dirs(run_dir)
    if not resume and saved:
        return (f"--run_dir {run_dir} already holds a run with checkpoints (newest: {os.path.basename(saved[-1])}): "
                f"continue it with --resume {run_dir}, or choose another --run_dir")
    if resume and not saved:
        return no_checkpoint(run_dir)
    lock, existed = os.path.join(run_dir, ".lock"), os.path.isdir(run_dir)
    try:
        os.makedirs(run_dir, exist_ok=True)
        if busy := take_lock(lock, name):
            return f"--run_dir {run_dir} is {busy}"
        if link := _linked(run_dir):
            os.remove(lock)
            return (f"--run_dir {run_dir}: {link} is a symbolic link (to {os.readlink(link)}), and a run writes only "
                    f"inside its directory: remove the link")
        probe = os.path.join(run_dir, ".write_test")
        with open(probe, "w") as f:  # (not a link: `_linked`)
            f.write("ok")
        os.remove(probe)
        if not resume:
            _take_over(run_dir, name)  # only now: a live job's files are never moved (its lock refused us above)
    except OSError as e:
        return f"--run_dir {run_dir}: cannot write there ({e.strerror or e})"
    atexit.register(_release, lock, run_dir, existed)
    return None


# What a run writes in its directory: a symbolic link at any of these would take writes outside it.
WRITTEN = {"config.json", "metrics.jsonl", "samples.jsonl", "probe.jsonl", "run.png", "checkpoints", "wandb",
           "tensorboard", "tracker_ids.json", ".write_test"}


def _linked(run_dir):
    """The first symbolic link where a run writes in run_dir (WRITTEN, and what save_checkpoint writes), or None."""
    root = os.path.join(run_dir, "checkpoints")
    paths = [os.path.join(run_dir, n) for n in os.listdir(run_dir)
             if n.removesuffix(".tmp") in WRITTEN or n.startswith(("events.out.", "offline_values_"))]
    paths += [os.path.join(root, n) for n in (os.listdir(root) if os.path.isdir(root) and not os.path.islink(root)
                                                else []) if STEP.fullmatch(n.removesuffix(".tmp")) or n in
              ("latest", "latest.tmp")]
    return next((p for p in sorted(paths) if os.path.islink(p)), None)


def _take_over(run_dir, name):
    ours = WRITTEN - {"run.png", ".write_test"}
    if files := sorted(f for f in os.listdir(run_dir) if f in ours or f.startswith("events.out.")):
        aside = _move_aside(run_dir, files, "earlier_attempt")
        print(f"{name}: --run_dir {run_dir}: the run there saved no checkpoint; starting afresh, its files "
              f"({shown(', '.join(files))}) moved to {aside}", flush=True)


def _move_aside(folder, files, prefix):
    aside = next(path for k in itertools.count(1) if not os.path.exists(path := os.path.join(folder, f"{prefix}_{k}")))
    os.makedirs(aside)
    for f in files:
        os.replace(os.path.join(folder, f), os.path.join(aside, f))
    return aside


def take_lock(lock, name):
    """None once this process holds `lock` (a dead job's is removed, with a line), else why not. Of many jobs that
    find a dead job's lock at once one removes it: each judges it under a flock on it, and removes it only while it is
    still the file at `lock` (removing whatever lock was there, two held it at once). Another host's lock stays."""
    import fcntl  # Unix only, as the sandbox's: here so that this module loads on Windows too
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError), open(  # (gone meanwhile: try again; a FIFO opens at once)
                    lock, "rb", opener=lambda path, _: os.open(path, os.O_RDONLY | os.O_NONBLOCK)) as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # released when closed
                if _held(lock, holder := _lock_owner(lock)):
                    job = f"pid {holder[1]} on {holder[0]}" if holder else "one starting now"
                    return f"in use by another job ({job}, {lock}); if that job is gone, delete the lock file"
                if os.path.samestat(os.fstat(f.fileno()), os.stat(lock)):  # else removed, maybe taken, meanwhile
                    print(f"{name}: removing a stale lock {lock} (its process {holder and holder[:2]} is gone)",
                          flush=True)
                    os.remove(lock)  # (its owner is dead: only a remover holding the flock changes `lock` now)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(_owner_line())
        return None
    return f"in use: another job keeps taking its lock {lock}; try again"


def _owner_line():
    """Host, pid and start time (a later process given the same pid is not mistaken for the owner)."""
    return f"{socket.gethostname()} {os.getpid()} {_start_time(os.getpid())}\n"


def _start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _lock_owner(lock):
    try:
        host, pid, *start = read_file(lock, 4096).decode().split()
        return shown(host), int(pid), int(start[0]) if start and start[0].isdigit() else None  # (host: printed)
    except (OSError, ValueError):  # (a FIFO too: its read would wait for ever)
        return None


def _held(lock, owner):
    """Whether a lock belongs to a live job (another host's cannot be checked: it counts as live)."""
    if owner is None:
        try:
            return time.time() - os.path.getmtime(lock) < 10
        except OSError:
            return False
    host, pid, start = owner
    return host != socket.gethostname() or (pid != os.getpid() and _alive(pid, start))


def _alive(pid, start=None):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's live process
    return start is None or _start_time(pid) in (None, start)


def _release(lock, run_dir, existed):
    if (_lock_owner(lock) or ())[:2] == (socket.gethostname(), os.getpid()):
        os.remove(lock)
        if not existed and not os.listdir(run_dir):
            os.rmdir(run_dir)


def live_job(run_dir):
    lock = os.path.join(run_dir, ".lock")
    owner = _lock_owner(lock)
    return (f"pid {owner[1]} on {owner[0]}" if owner else "one starting") if _held(lock, owner) else None


def checkpoint_bytes(n_parameters, export_bytes_per_parameter):
    return n_parameters * (4 + 8 + export_bytes_per_parameter)


def check_disk(run_dir, model, export_bytes_per_parameter):
    """Before the engine starts: room in run_dir for one more checkpoint, else one line (stale holds removed first)."""
    need = checkpoint_bytes(sum(p.numel() for p in model.parameters()), export_bytes_per_parameter)
    free, (jobs, held) = None, ([], 0)
    if dist.get_rank() == 0:
        jobs, held = clear_stale_holds(os.path.join(run_dir, "checkpoints"))
        free = shutil.disk_usage(run_dir).free
    free, jobs, held = all_gather_objects([(free, jobs, held)])[0]
    if free < need:
        fail(f"--run_dir {run_dir}: {free / 2**30:.1f} GiB free, a checkpoint needs about {need / 2**30:.1f} GiB "
             f"(weights, optimiser state, HF export)" + (f"; {held / 2**30:.1f} GiB are kept by evaluations that "
             f"hold rotated-out checkpoints ({', '.join(jobs)}) until they exit" if held else ""), once=True)


def open_output(path, flag, program, earlier=(), locked=False):
    """An output claimed by rank 0 (locked: already, by an earlier call); an error stops every rank."""
    error = (set_aside(path, flag, program, earlier) if locked else claim_output(path, flag, program, earlier)) \
        if dist.get_rank() == 0 else None
    if error := all_gather_objects([error])[0]:
        fail(error, once=True)


def claim_output(path, flag, program, earlier=()):
    """Rank 0's lock on an output, or an error line; an earlier run's results (`earlier`) move into earlier_K/. The
    lock is named by the output's real path: two spellings of one directory (a link) take one lock."""
    lock = os.path.realpath(path) + ".lock"
    try:
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        if busy := take_lock(lock, program):
            return f"{flag} {path} is {busy}"
    except OSError as e:
        return f"{flag} {path}: cannot write there ({e.strerror or e})"
    atexit.register(_release, lock, path, True)
    return set_aside(path, flag, program, earlier)


def set_aside(path, flag, program, earlier):
    """Under the output's lock: its earlier results (`earlier`) moved into earlier_K/, or an error line."""
    try:
        files = sorted(f for f in os.listdir(path) if f.endswith(earlier)) if earlier and os.path.isdir(path) else []
        if files:
            print(f"{program}: {flag} {path} holds an earlier run's results ({shown(', '.join(files))}): moved to "
                  f"{_move_aside(path, files, 'earlier')}", flush=True)
        if earlier:
            os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"{flag} {path}: cannot write there ({e.strerror or e})"
    return None


def shared_output(path, run_dir, program, what):
    """A file runs share (the toy's offline values): path, or the same name in run_dir where path is taken."""
    if dist.get_rank() == 0 and not os.path.exists(path) and (error := claim_output(path, what, program)):
        kept = os.path.join(run_dir, os.path.basename(path))
        print(f"{program}: {error}; this run keeps its own in {kept}", flush=True)
        path = kept
    return all_gather_objects([path])[0]


@contextlib.contextmanager
def run_file(run_dir, name):
    """Writing a run's log (metrics.jsonl, samples.jsonl, the trackers', probe.jsonl): a full disk stops the run in
    one line that says which checkpoint is intact, as a checkpoint's own write does, instead of a traceback."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        kept = ([f"the last checkpoint ({os.path.basename(p)}) is intact" for p in checkpoint_dirs(run_dir)]
                or ["there is no checkpoint yet"])[-1]
        fail(f"disk full ({e.strerror}) while writing {name} in {run_dir}: {kept}; free space, then --resume "
             f"{run_dir}")


@contextlib.contextmanager
def atomic_write(path):
    """path written under a temporary name, renamed once whole and on disk: nobody finds half a file there."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def resolve_model(path: str) -> str:
    """A model directory: an HF dir or hub name as is; of a run, its newest checkpoint's model/."""
    run = os.path.normpath(path)
    if found := checkpoint_dirs(os.path.dirname(run) if os.path.basename(run) == "checkpoints" else run):
        path = found[-1]
    if os.path.isdir(os.path.join(path, "model")) and not os.path.isfile(os.path.join(path, "config.json")):
        path = os.path.join(path, "model")
    return path


def checkpoint_model(given: str, tries: int = 3):
    """--model, on rank 0: (the model directory it names, where to load it from, an error line or None). A training
    run rotates its checkpoints, maybe while the engine loads one: model/ is held (hard links) and checked there."""
    run = os.path.normpath(given)
    run = os.path.dirname(run) if os.path.basename(run) == "checkpoints" else run
    if os.path.isfile(os.path.join(run, "metrics.jsonl")) and not checkpoint_dirs(run):
        job = live_job(run)
        return None, None, (f"--model {given}: an spo.py run without a checkpoint: " +
                            (f"it is still running ({job}); evaluate it after its first checkpoint" if job else
                             "it stopped before its first"))
    for _ in range(tries):
        model = resolve_model(given)
        step = os.path.dirname(model) if os.path.basename(model) == "model" else model
        if os.path.basename(os.path.dirname(step)) != "checkpoints" or not os.path.basename(step).startswith("step_"):
            return model, model, None  # a Hugging Face directory or hub name
        if not os.path.isdir(step):
            return None, None, f"--model {given}: no such checkpoint (a run keeps only its newest checkpoints)"
        model = os.path.join(step, "model")
        try:
            hold = _hold(step)
        except FileNotFoundError:
            continue  # deleted by its run while it was linked
        problem = damaged(hold or step, "model/")
        if problem is None:
            if hold:
                atexit.register(shutil.rmtree, hold, True)
            return model, os.path.join(hold or step, "model"), None
        if hold:
            shutil.rmtree(hold, ignore_errors=True)
        if os.path.isdir(step) and (problem := damaged(step, "model/")):  # damaged, not deleted meanwhile
            intact = [p for p in checkpoint_dirs(os.path.dirname(os.path.dirname(step)))
                      if damaged(p, "model/") is None]
            return None, None, (f"--model {given}: checkpoint {step} is damaged ({problem})" +
                                (f"; the newest intact one: --model {intact[-1]}" if intact else ""))
    return None, None, f"--model {given}: its run deleted its checkpoints while they were read; try again"


def _hold(step):
    """step_N's model/ and manifest hard-linked into checkpoints/.eval-<host>-<pid>/ with a lock. None where links
    cannot be made (a read-only copy: nothing rotates it); FileNotFoundError: its run deleted it meanwhile."""
    root = os.path.dirname(step)
    clear_stale_holds(root)
    hold = os.path.join(root, f".eval-{socket.gethostname()}-{os.getpid()}")
    try:
        os.makedirs(hold)
        with open(os.path.join(hold, ".lock"), "w") as f:
            f.write(_owner_line())
        os.link(os.path.join(step, MANIFEST), os.path.join(hold, MANIFEST))
        for folder, _, files in os.walk(os.path.join(step, "model")):
            os.makedirs(os.path.join(hold, os.path.relpath(folder, step)))
            for f in files:
                os.link(os.path.join(folder, f), os.path.join(hold, os.path.relpath(folder, step), f))
    except OSError as e:
        shutil.rmtree(hold, ignore_errors=True)
        if isinstance(e, FileNotFoundError):
            raise
        return None
    return hold


def clear_stale_holds(root):
    """Stale holds in root removed; the live ones' jobs and the bytes only they keep."""
    jobs, links = [], {}  # inode: (bytes, links seen in live holds, links in all)
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        hold = os.path.join(root, name)
        if not name.startswith(".eval-"):
            continue
        if (job := live_job(hold)) is None:
            shutil.rmtree(hold, ignore_errors=True)
            continue
        jobs.append(job)
        for folder, _, files in os.walk(hold):
            for f in files:
                with contextlib.suppress(OSError):  # its evaluation may be removing it now
                    st = os.lstat(os.path.join(folder, f))
                    links[st.st_ino] = (st.st_size, links.get(st.st_ino, (0, 0))[1] + 1, st.st_nlink)
    return jobs, sum(size for size, seen, nlink in links.values() if seen == nlink)
