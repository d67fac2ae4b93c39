"""The paper's pipeline (experiments/paper.py): Table 1's arithmetic and transcription, the prepared data it
needs, and the dry run through every stage (offline values, training, two evaluations, the table) and its resume.

    .venv/bin/python -m pytest tests/test_paper_pipeline.py -q
"""
import json
import subprocess
import sys

import pytest

from common import ENV, ROOT
from experiments.paper import BENCHMARKS, PAPER, data_files, paper_table


def test_the_papers_averages_are_the_unweighted_means_of_its_cells():
    """A check of the transcription: each row's Average is the mean of its five cells (not weighted by problem
    count, which would give 58.4 for SPO's maj@32), to the table's rounding."""
    for name, cells in PAPER.items():
        for i in (0, 1):
            assert abs(sum(c[i] for c in cells[:5]) / 5 - cells[5][i]) <= 0.051, (name, i)


def _results(maj, avg, n=32):
    return {stem: {"samples": n, f"maj@{n}_boot_mean": m, f"avg@{n}": a}
            for (stem, _), m, a in zip(BENCHMARKS, maj, avg)}


def test_our_rows_are_percent_cells_and_their_unweighted_mean():
    table = paper_table({"spo": _results([0.8, 0.6, 0.4, 0.2, 0.0], [0.5, 0.5, 0.5, 0.5, 1.0], n=4)})
    ours = "| spo (ours, n = 4) | 80.0 / 50.0 | 60.0 / 50.0 | 40.0 / 50.0 | 20.0 / 50.0 | 0.0 / 100.0 | 40.0 / 60.0 |"
    assert ours in table.splitlines()
    row = "| SPO (paper, n = 32) | 84.0 / 74.9 | 76.5 / 65.0 | 46.9 / 40.3 | 64.0 / 59.0 | 47.5 / 40.6 | 63.8 / 56.0 |"
    assert row in table.splitlines()
    header = table.splitlines()[0]
    assert header == "| | AIME 24 | AIME 25 | BeyondAIME | BRUMO 25 | HMMT 25 | Average |"


def test_a_prepared_directory_missing_a_benchmark_is_one_line(tmp_path):
    for stem in ["dapo_math_17k_en", "aime24", "aime25", "beyond_aime", "brumo25"]:
        (tmp_path / f"{stem}.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    with pytest.raises(SystemExit) as stop:
        data_files(str(tmp_path))
    assert str(stop.value).startswith(f"error: --data {tmp_path}: no hmmt_feb25.jsonl or hmmt_feb25.parquet")
    (tmp_path / "hmmt_feb25.jsonl").write_text('{"prompt": "2+2?", "answer": "4"}\n')
    train, benchmarks = data_files(str(tmp_path))
    assert train.endswith("dapo_math_17k_en.jsonl") and list(benchmarks) == [stem for stem, _ in BENCHMARKS]


@pytest.mark.slow
def test_the_dry_run_goes_through_every_stage_and_a_rerun_skips_them(tmp_path):
    """The same program as the paper's run, with the toy, tiny budgets, one process and the transformers engine
    (quicker to start than vLLM: the stages' own tests run both engines)."""
    cmd = [sys.executable, "-m", "experiments.paper", "--dry_run", "--out", str(tmp_path), "--nproc", "1",
           "--engine", "hf"]
    first = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for stage in ("values", "train", "eval_base", "eval"):
        assert f"{stage}: done in" in first.stdout, first.stdout
    rows = [line for line in first.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 3 + 2 and rows[-1].startswith("| spo (ours, n = 4) | ")  # header, paper, ours
    assert (tmp_path / "table.md").read_text().startswith(rows[0])
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert sorted(summary["results"]) == sorted(stem for stem, _ in BENCHMARKS)
    assert "step_000002" in summary["config"]["model"]  # the trained model's last checkpoint
    again = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)
    assert again.returncode == 0 and " running " not in again.stdout, again.stdout[-3000:]
    assert all(f"{stage}: done (" in again.stdout for stage in ("values", "train", "eval_base", "eval"))
    assert [line for line in again.stdout.splitlines() if line.startswith("| ")] == rows
