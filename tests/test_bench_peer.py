"""bench_peer.py (`bench.py peer`): spo.py against TRL's GRPOTrainer on the toy. TRL is a benchmark-only dependency
in its own interpreter (SPO_TRL_PYTHON); without it the benchmark says how to install it and skips.

    SPO_TRL_PYTHON=/tmp/trlvenv/bin/python .venv/bin/python -m pytest tests/test_bench_peer.py -q
"""
import os
import re

import pytest

from common import PYTHON, ok, python


def test_without_trl_the_benchmark_says_how_to_install_it_and_skips(tmp_path):
    import subprocess
    if subprocess.run([PYTHON, "-c", "import trl"], capture_output=True).returncode == 0:
        pytest.skip("this interpreter has trl")
    proc = ok(python("bench_peer.py", "--trl_python", PYTHON, "--toy_dir", str(tmp_path), "--steps", "1"))
    assert "skipped: TRL is not installed" in proc.stdout and "pip install torch==2.13.0 trl" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SPO_TRL_PYTHON"), reason="set SPO_TRL_PYTHON to an interpreter with trl")
def test_peer_benchmark_runs_trl_and_spo_and_prints_the_table(small_toy):
    """Two steps each on the small toy: the three rows (per-step time, ratio to TRL, held-out accuracy by the same
    eval.heldout_metrics) and the list of settings that differ."""
    toy_dir = os.path.dirname(small_toy["model"])
    proc = ok(python("bench_peer.py", "--toy_dir", toy_dir, "--steps", "2", timeout=1800))
    for label in ("TRL GRPOTrainer (GRPO)", "spo.py --algo grpo", "spo.py (SPO)"):
        row = re.search(re.escape(label) + r" +([\d.]+) +([\d.]+)x +([\d.]+)%", proc.stdout)
        assert row, proc.stdout
        assert float(row.group(1)) > 0 and 0 <= float(row.group(3)) <= 100
    assert "settings that differ" in proc.stdout and "generation backend" in proc.stdout
