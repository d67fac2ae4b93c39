"""On a cluster a launch fails loudly: srun without torchrun is one line; a run directory one node does not see, or a
file missing on one node only, is said by that node with its host name (docs/scale.md, "Several nodes"). The nodes
are two torchrun processes on this machine with working directories of their own.

    .venv/bin/python -m pytest tests/test_cluster.py -q
"""
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from common import ENV, ROOT, toy_args, torchrun, torchrun_nodes


@pytest.mark.parametrize("task", ["0", "1"])
def test_srun_without_torchrun_is_one_line_from_the_first_task(task, tmp_path):
    env = {**ENV, "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_PROCID": task}
    proc = subprocess.run([sys.executable, "spo.py", "--run_dir", str(tmp_path / "run")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    if task == "0":
        assert len(lines) == 1 and lines[0].startswith("error: 2 SLURM tasks without torchrun") and "srun torchrun" \
            in lines[0], proc.stderr[-3000:]
    else:
        assert lines == []  # the other tasks stop silently: srun shows one line, not one per task
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("program", ["spo.py", "eval.py"])  # (offline_values.py: the same start_program)
def test_torchrun_max_restarts_is_one_line_before_anything_starts(program, tmp_path):
    """torchrun --max-restarts 1 (not supported: docs/scale.md): one line from the first try's rank 0, the
    restarted try silent, and nothing made (no run directory)."""
    proc = torchrun(2, "--max-restarts=1", program, *(["--run_dir", str(tmp_path / "run")] * (program == "spo.py")),
                    timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: torchrun --max-restarts 1: restarting the ranks inside one torchrun is not "
                                "supported") and "--resume auto" in errors[0]
    assert not (tmp_path / "run").exists()


def _two_nodes(small_toy, tmp_path, run_dir, train=None):
    """Node 0 in tmp/node0, node 1 in tmp/node1: spo.py by its absolute path; the toy's files absolute, or --train
    `train` relative (copied into node 0's directory only)."""
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for cwd in cwds:
        cwd.mkdir()
    spo, *args = toy_args(small_toy, run_dir)
    if train:
        shutil.copy(small_toy["train"], cwds[0] / train)
        args[args.index("--train") + 1] = train
    return torchrun_nodes(2, os.path.join(ROOT, spo), *args, "--steps", "1", "--eval_every", "0", cwds=cwds,
                          timeout=600)


@pytest.mark.slow
def test_a_run_dir_one_node_does_not_see_is_named(small_toy, tmp_path):
    """A relative --run_dir: created by rank 0 in node 0's directory, absent in node 1's."""
    node0, node1 = _two_nodes(small_toy, tmp_path, "run")
    assert node0.returncode and node1.returncode
    said = f"is not seen by the ranks on {socket.gethostname()}"
    assert said in node0.stderr and "error: [" in node0.stderr, node0.stderr[-3000:]
    for node in (node0, node1):  # each node stops on a line (exit code 2 in torchrun's summary), no traceback of ours
        assert re.search(r"^\s*exitcode\s*: 2 ", node.stderr, re.M), node.stderr[-3000:]
        ours = rf'File "{re.escape(ROOT)}/(?!\.venv/)'  # a frame of the repository's code (torchrun's own are fine)
        assert not re.search(ours, node.stderr), node.stderr[-3000:]


@pytest.mark.slow
def test_a_file_missing_on_one_node_is_said_by_that_node(small_toy, tmp_path):
    """--train relative: the file is in node 0's directory only. Node 1 says so, with its host name and rank."""
    _, node1 = _two_nodes(small_toy, tmp_path, tmp_path / "run", train="train.parquet")
    assert node1.returncode, node1.stderr[-3000:]
    errors = [line for line in node1.stderr.splitlines() if line.startswith("error:")]
    assert errors and errors[0].startswith(f"error: [{socket.gethostname()}, rank 1] ") and "train.parquet" in \
        errors[0], node1.stderr[-3000:]


@pytest.mark.slow
def test_nodes_whose_train_copies_differ_in_order_stop_with_one_line(small_toy, tmp_path):
    """--train relative, node-local copies of the same rows in another order on node 1: each index would stand for
    another prompt on each node (the tracker and sampler mixing two prompts per key). Both nodes stop in one line
    naming --train and the host, before the engine starts."""
    import pyarrow.parquet as pq
    table = pq.read_table(small_toy["train"])
    for node, rows in (("node0", range(table.num_rows)), ("node1", reversed(range(table.num_rows)))):
        (tmp_path / node).mkdir()
        pq.write_table(table.take(list(rows)), tmp_path / node / "train.parquet")
    spo, *args = toy_args(small_toy, tmp_path / "run")
    args[args.index("--train") + 1] = "train.parquet"
    nodes = torchrun_nodes(2, os.path.join(ROOT, spo), *args, "--steps", "1", "--eval_every", "0",
                           cwds=[tmp_path / "node0", tmp_path / "node1"], timeout=600)
    for node in nodes:
        errors = [line for line in node.stderr.splitlines() if line.startswith("error:")]
        assert node.returncode and len(errors) == 1 and "--train: the ranks on" in errors[0], node.stderr[-3000:]
        assert socket.gethostname() in errors[0] and "memory per rank" not in node.stdout
