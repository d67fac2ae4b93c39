"""bench/peer.py (`python -m bench peer`): spo.py against TRL's GRPOTrainer on the toy. TRL is a benchmark-only
dependency in its own interpreter (--trl_python or SPO_TRL_PYTHON); without it the benchmark says how to install it
and stops. The comparison itself is a benchmark, not a test (the test environment has no TRL); a quick run of it:
`python -m bench peer --trl_python /tmp/trlvenv/bin/python --steps 3`.

    .venv/bin/python -m pytest tests/test_bench_peer.py -q
"""

import pytest

from common import PYTHON, ok, python


def test_without_trl_the_benchmark_says_how_to_install_it_and_skips(tmp_path):
    import subprocess
    if subprocess.run([PYTHON, "-c", "import trl"], capture_output=True).returncode == 0:
        pytest.skip("this interpreter has trl")
    proc = ok(python("-m", "bench", "peer", "--trl_python", PYTHON, "--toy_dir", str(tmp_path), "--steps", "1"))
    assert "skipped: TRL is not installed" in proc.stdout and "pip install torch==2.13.0 trl" in proc.stdout
