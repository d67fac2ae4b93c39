"""samples.jsonl (machinery/trackers.py, machinery/metrics.py:Logger): a few generations a step, bounded in size
whatever the run's length or its responses', and a markdown table whose cells cannot break it.

    .venv/bin/python -m pytest tests/test_samples.py -q
"""
import json

import numpy as np

from machinery import metrics, trackers
from rollout import Rollout


def _rollouts(n, text):
    return [Rollout([1, 2], [3, 4], [0.0, 0.0], text, "length" if k % 2 else "stop") for k in range(n)]


def test_a_step_gives_its_first_slots_with_cut_texts():
    rows = trackers.sample_rows(7, lambda ids: "p" * 10_000, [[1]] * 9, _rollouts(9, "r" * 10_000),
                                {"reward": np.arange(9.0), "rho": np.full(9, 0.9)})
    assert len(rows) == trackers.SAMPLES_PER_STEP
    assert [r["reward"] for r in rows] == [0.0, 1.0, 2.0, 3.0] and all(r["step"] == 7 for r in rows)
    assert [r["truncated"] for r in rows] == [False, True, False, True]
    assert all(len(r["prompt"]) == len(r["response"]) == trackers.SAMPLE_CHARS for r in rows)
    json.dumps(rows)  # plain numbers: numpy's would not serialise


def test_the_file_stops_at_its_bound_and_says_so_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(metrics, "SAMPLES_MAX_BYTES", 20_000)
    logger = metrics.Logger(str(tmp_path), {}, is_main=True)
    for step in range(1, 30):  # each step about 4 x 4 KB
        logger.samples(step, lambda ids: "p" * 2000, [[1]] * 4, _rollouts(4, "r" * 2000), {"reward": np.ones(4)})
    logger.close()
    size = (tmp_path / "samples.jsonl").stat().st_size
    assert 20_000 <= size < 20_000 + 4 * 4200  # at most one step past the bound
    assert capsys.readouterr().out.count("no more samples this run") == 1


def test_markdown_cells_cannot_break_the_table():
    rows = trackers.sample_rows(1, lambda ids: "a | b\nc", [[1]], _rollouts(1, "x\n| y"), {"reward": [1.0]})
    table = trackers._markdown(rows).split("\n")
    assert len(table) == 3 and table[0] == "step | prompt | response | truncated | reward"
    assert table[2].count(" | ") == 4 and "<br>" in table[2]
