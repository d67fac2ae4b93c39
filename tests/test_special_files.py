"""Special files where a file is expected: a FIFO (or a directory, a socket, a device) given as an input file, or
planted in a run directory, is one line saying what it is, never a read that waits for ever for a writer
(machinery/untrusted.py:open_file). Each case runs in a process of its own, under a time limit: on a regression
it is the one that hangs.

    .venv/bin/python -m pytest tests/test_special_files.py -q
"""
import os
import socket
import subprocess
import sys

import pytest

from common import ENV, ROOT

# (where the special file goes, relative to a run directory; the call, with RUN and PATH; what it says)
CASES = {
    "--offline_values": ("values.json", "import offline_values; offline_values.check_values_header(PATH, {})",
                         "error: --offline_values {path}: not an offline-values file ({kind}, not a regular file;"),
    "config.json": ("config.json", "from machinery.untrusted import read_config; read_config(RUN)",
                    "error: --resume {run}: its config.json is not a run's configuration (a JSON object of spo.py's "
                    "flags, with steps: {kind}, not a regular file)"),
    "checkpoints/latest": ("checkpoints/latest", "from machinery import checkpoint; print(checkpoint.latest_step(RUN))",
                           "None"),
    "a step's manifest": ("checkpoints/step_000002/manifest.json",
                          "from machinery import checkpoint; print(checkpoint.damaged(os.path.dirname(PATH)))",
                          "{path}: unreadable ({kind}, not a regular file)"),
    "metrics.jsonl": ("metrics.jsonl", "from machinery import metrics; print(metrics._rows(PATH))", "[]"),
    "the run's lock": (".lock", "from machinery import run_dir; print(run_dir._lock_owner(PATH))", "None"),
    "--train": ("train.jsonl", "from machinery.data import load_prompts; load_prompts(PATH)",
                "ValueError: {path}: {kind}, not a data file"),
    "a partial values file": ("v.json.rank0.partial.jsonl", "import offline_values; offline_values.read_finished("
                              "os.path.join(RUN, 'v.json'), {})", "ValueError: {path}: not an offline-values file "
                              "({kind}, not a regular file); move it away or choose another --out"),
}


def make(path, kind):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if kind == "a FIFO (named pipe)":
        os.mkfifo(path)
    elif kind == "a directory":
        os.mkdir(path)
    elif kind == "a socket":
        socket.socket(socket.AF_UNIX).bind(path)
    else:
        os.symlink("/dev/zero", path)  # a link to a device that never ends: what it leads to is what counts


@pytest.mark.parametrize("kind", ["a FIFO (named pipe)", "a directory", "a socket", "a character device"])
@pytest.mark.parametrize("case", CASES)
def test_a_special_file_where_a_file_is_expected_is_named_not_waited_on(tmp_path, case, kind):
    """Special files where a file is expected: a FIFO --offline_values, config.json or checkpoints/latest hung the
    run until it was killed, and a FIFO --train was "no such file"."""
    where, call, says = CASES[case]
    run, path = tmp_path / "run", str(tmp_path / "run" / where)
    make(path, kind)
    proc = subprocess.run([sys.executable, "-c", f"import os\nRUN, PATH = {str(run)!r}, {path!r}\n{call}"],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert out and out[-1].startswith(says.format(path=path, run=run, kind=kind)), proc
