"""No library guards a run directory: a lock file and holds, so that no run overwrites another (tests/test_checkpoint).

Run directories: one run per directory, nothing overwritten, and a run's checkpoints read safely while it trains.

A run directory belongs to one run (`claim_run_dir`): a fresh run refuses a directory that holds a checkpoint and
takes over one that holds none (a run that stopped before its first checkpoint: its files are moved aside), default
names are unique (`default_run_dir`), and a lock file (host and pid of rank 0) keeps a second job out while the first
lives; a lock whose process is gone on this host is stale and taken over. `check_disk` asks for room for one more
checkpoint before the engine starts. eval.py reads a run's newest checkpoint through `checkpoint_model`, which holds
it against the run's rotation (machinery/checkpoint.py writes, checks and resumes checkpoints).
"""
import atexit
import contextlib
import itertools
import os
import shutil
import socket
import time

import torch.distributed as dist

from machinery.checkpoint import MANIFEST, checkpoint_dirs, damaged, no_checkpoint
from machinery.errors import fail


def default_run_dir(algo):
    """runs/<algo>-<date>-<time>-<pid>: unique per job on a host (one-second names collided)."""
    return os.path.join("runs", f"{algo}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")


def open_run_dir(run_dir, *, resumed, algo, program):
    """The run directory every rank agrees on (run_dir, or rank 0 names a default one for `algo`), claimed by rank 0
    for this run of `program`; any error stops every rank with one line."""
    from machinery.collectives import all_gather_objects
    error = None
    if dist.get_rank() == 0:
        run_dir = run_dir or default_run_dir(algo)
        error = claim_run_dir(run_dir, resumed, program)
    run_dir, error = all_gather_objects([(run_dir, error)])[0]
    if error:
        fail(error, once=True)
    return run_dir


def claim_run_dir(run_dir, resume, name):
    """Rank 0's check that this run may write run_dir, then its lock (removed at exit). Returns an error line or
    None. A run is continued only from a checkpoint: a fresh run refuses a directory that holds one, and takes
    over one that holds none (a run that stopped before its first checkpoint, or a directory the user made);
    --resume needs one. So neither refusal sends the user to the other. The lock is a file created exclusively;
    a lock left by a process that is gone (same host) is stale and replaced."""
    saved = checkpoint_dirs(run_dir)
    if not resume and saved:
        return (f"--run_dir {run_dir} already holds a run with checkpoints (newest: {os.path.basename(saved[-1])}): "
                f"continue it with --resume {run_dir}, or choose another --run_dir")
    if resume and not saved:
        return no_checkpoint(run_dir)
    lock, existed = os.path.join(run_dir, ".lock"), os.path.isdir(run_dir)
    try:
        os.makedirs(run_dir, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                break
            except FileExistsError:
                owner = _lock_owner(lock)
                if _held(lock, owner):
                    job = f"pid {owner[1]} on {owner[0]}" if owner else "one starting now"
                    return (f"--run_dir {run_dir} is in use by another job ({job}, {lock}); if that job is gone, "
                            f"delete the lock file")
                print(f"{name}: removing a stale lock {lock} (its process {owner} is gone)", flush=True)
                with contextlib.suppress(FileNotFoundError):  # another job may have removed it first
                    os.remove(lock)
        else:
            return f"--run_dir {run_dir}: another job keeps taking its lock {lock}; try again"
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}\n")
        probe = os.path.join(run_dir, ".write_test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
        if not resume:
            _take_over(run_dir, name)  # only now: a live job's files are never moved (its lock refused us above)
    except OSError as e:
        return f"--run_dir {run_dir}: cannot write there ({e.strerror or e})"
    atexit.register(_release, lock, run_dir, existed)
    return None


def _take_over(run_dir, name):
    """A fresh run in a directory whose run stopped before its first checkpoint: that run's files (config, logs,
    unfinished checkpoints/) go to earlier_attempt_K/, kept to read but out of the new run's logs; one line says so."""
    files = sorted(f for f in os.listdir(run_dir) if f in ("config.json", "metrics.jsonl", "probe.jsonl",
                                                           "checkpoints", "wandb") or f.startswith("events.out."))
    if files:
        k = next(k for k in itertools.count(1) if not os.path.exists(os.path.join(run_dir, f"earlier_attempt_{k}")))
        aside = os.path.join(run_dir, f"earlier_attempt_{k}")
        os.makedirs(aside)
        for f in files:
            os.replace(os.path.join(run_dir, f), os.path.join(aside, f))
        print(f"{name}: --run_dir {run_dir}: the run there saved no checkpoint; starting afresh, its files "
              f"({', '.join(files)}) moved to {aside}", flush=True)


def _lock_owner(lock):
    """(host, pid) written in a lock file, or None if unreadable."""
    try:
        with open(lock) as f:
            host, pid = f.read().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


def _held(lock, owner):
    """Whether a lock file belongs to a live job: one on another host (not checkable from here), or a live process
    here other than this one (a restarted container can hand this process the pid of a job that is gone). A lock
    with no owner yet is a job between creating and writing it, unless it is older than a few seconds."""
    if owner is None:
        try:
            return time.time() - os.path.getmtime(lock) < 10
        except OSError:
            return False
    host, pid = owner
    return host != socket.gethostname() or (pid != os.getpid() and _alive(pid))


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _release(lock, run_dir, existed):
    """At exit: our lock goes; a directory this run created and never wrote to (a run refused early) goes too."""
    if _lock_owner(lock) == (socket.gethostname(), os.getpid()):
        os.remove(lock)
        if not existed and not os.listdir(run_dir):
            os.rmdir(run_dir)


def live_job(run_dir):
    """The job holding run_dir's lock ("pid P on HOST"), or None: is a run there still writing?"""
    lock = os.path.join(run_dir, ".lock")
    owner = _lock_owner(lock)
    return (f"pid {owner[1]} on {owner[0]}" if owner else "one starting") if _held(lock, owner) else None


def checkpoint_bytes(n_parameters, export_bytes_per_parameter):
    """About what one checkpoint takes on disk: fp32 weights + Adam's two moments (shards) and the HF export."""
    return n_parameters * (4 + 8 + export_bytes_per_parameter)


def check_disk(run_dir, model, export_bytes_per_parameter):
    """Before the engine starts: room in run_dir for one more checkpoint (the previous one stays until the new
    one is complete), else one line saying how much is free and needed."""
    from machinery.collectives import all_gather_objects
    need = checkpoint_bytes(sum(p.numel() for p in model.parameters()), export_bytes_per_parameter)
    free = shutil.disk_usage(run_dir).free if dist.get_rank() == 0 else None
    free = all_gather_objects([free])[0]
    if free < need:
        fail(f"--run_dir {run_dir}: {free / 2**30:.1f} GiB free, a checkpoint needs about {need / 2**30:.1f} GiB "
             f"(weights, optimiser state, HF export)", once=True)


# ------------------------------------------------------------------------------------------------ reading a run
def resolve_model(path: str) -> str:
    """A model directory from what a user naturally passes: an HF dir or hub name as is, or spo.py output: a run
    directory or its checkpoints/ directory (the newest published checkpoint: `latest` may name one deleted since),
    or a step_N directory (its model/)."""
    from machinery.checkpoint import checkpoint_dirs
    run = os.path.normpath(path)
    found = checkpoint_dirs(os.path.dirname(run) if os.path.basename(run) == "checkpoints" else run)
    if found:
        path = found[-1]
    if os.path.isdir(os.path.join(path, "model")) and not os.path.isfile(os.path.join(path, "config.json")):
        path = os.path.join(path, "model")
    return path


def checkpoint_model(given: str, tries: int = 3):
    """--model, on rank 0: (the model directory it names, the directory to load it from, an error line or None).
    A run still training deletes all but its newest checkpoints, maybe while the engine loads one: a checkpoint's
    model/ is held (`_hold`: hard links, no copy; removed at exit) and checked there (machinery/checkpoint.py:
    damaged, against the sizes written). One deleted before it was held: the run's newest is taken again."""
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
    """step_N's model/ and manifest hard-linked into checkpoints/.eval-<host>-<pid>/ (with a lock naming this
    process), after removing the holds of evaluations that are gone. None where links cannot be made (a read-only
    copy of a run: nothing rotates it); FileNotFoundError: its run deleted it while it was linked."""
    root = os.path.dirname(step)
    for name in os.listdir(root):
        if name.startswith(".eval-") and live_job(os.path.join(root, name)) is None:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    hold = os.path.join(root, f".eval-{socket.gethostname()}-{os.getpid()}")
    try:
        os.makedirs(hold)
        with open(os.path.join(hold, ".lock"), "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}\n")
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
