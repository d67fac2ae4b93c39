"""Locks under a crowd (machinery/run_dir.py:take_lock, which every lock of run directories, outputs and sweeps goes
through): of many jobs that find a dead job's lock at once, exactly one holds it afterwards.

    .venv/bin/python -m pytest tests/test_locks.py -q
"""
import multiprocessing
import os
import socket

import pytest

from machinery.run_dir import take_lock

JOBS, ROUNDS = 8, 200
DEAD = 2 ** 22 + 1  # above the kernel's largest pid_max: no process has it


def _job(folder, barrier, holders):
    """Each round: wait for the others, try the round's lock, say whether it holds it; never release one."""
    for k in range(ROUNDS):
        barrier.wait()
        holders.put((k, take_lock(f"{folder}/{k}.lock", "job") is None))


@pytest.mark.parametrize("stale", ["its pid is gone", "its pid is another process's now", "empty, not new"])
def test_of_a_crowd_that_finds_a_stale_lock_exactly_one_holds_it(tmp_path, stale):
    """The old takeover read the dead owner, then removed whatever lock was there, maybe one another job had just
    taken: two jobs held it at once in 24 of 200 rounds."""
    for k in range(ROUNDS):
        lock = tmp_path / f"{k}.lock"
        lock.write_text({"its pid is gone": f"{socket.gethostname()} {DEAD} 1\n", "empty, not new": "",
                         "its pid is another process's now": f"{socket.gethostname()} {os.getpid()} 1\n"}[stale])
        os.utime(lock, (0, 0))  # (an empty lock younger than 10 s is a job starting there)
    fork = multiprocessing.get_context("fork")  # real processes, started without importing torch again
    barrier, holders = fork.Barrier(JOBS), fork.Queue()
    jobs = [fork.Process(target=_job, args=(str(tmp_path), barrier, holders)) for _ in range(JOBS)]
    for job in jobs:
        job.start()
    count = [0] * ROUNDS
    for _ in range(JOBS * ROUNDS):
        k, held = holders.get(timeout=120)  # (a job that died says nothing)
        count[k] += held
    for job in jobs:
        job.join(timeout=60)
    assert {k: n for k, n in enumerate(count) if n != 1} == {}
