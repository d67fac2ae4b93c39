"""What a run records (machinery/metrics.py; over-sampling's reach: variants.py): the prompts drawn but never
trained on, the all-equal batch note, the console line's columns and the run's plot (plot_run).

    .venv/bin/python -m pytest tests/test_metrics.py -q
"""
import numpy as np

from variants import Resampling


def test_prompt_reach_counts_prompts_never_trained_on_and_restores():
    """--oversample's run-long count: a prompt drawn twice and kept once is reached; one only ever aborted is not."""
    def resampling():
        return Resampling(4, 1, 1, oversample=1.5, measure=False, dynamic=False, n_prompts=5)
    first = resampling()
    first.reach(np.array([0, 1, 2]), np.array([0, 2]))
    assert first.reach(np.array([1, 3]), np.array([3])) == {"oversample/prompts_drawn": 4,
                                                            "oversample/never_trained_share": 1 / 4}
    restored = resampling()
    restored.load_state_dict(first.state_dict())
    # counting goes on after a resume
    assert restored.reach(np.array([1]), np.array([1]))["oversample/never_trained_share"] == 0.0


def test_an_all_equal_batch_is_counted_and_said_once(tmp_path, capsys):
    import json
    from machinery.metrics import Logger
    logger = Logger(str(tmp_path), {"ppo_steps": 1}, True)
    for step, (mean, all_equal) in enumerate([(0.5, 0.0), (0.0, 1.0), (0.3, 0.0), (1.0, 1.0)], start=1):
        logger.log(step, {"reward/mean": mean, "reward/all_equal": all_equal})
    logger.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["reward/all_equal_steps"] for r in rows] == [0, 1, 1, 2]
    notes = [line for line in capsys.readouterr().out.splitlines() if "every reward of the batch" in line]
    assert len(notes) == 1 and notes[0].startswith("step 2: every reward of the batch is 0 ")
    resumed = Logger(str(tmp_path), {"ppo_steps": 1}, True, resume_step=3)  # the count survives a resume
    resumed.log(4, {"reward/mean": 1.0, "reward/all_equal": 1.0})
    resumed.close()
    assert json.loads(open(tmp_path / "metrics.jsonl").readlines()[-1])["reward/all_equal_steps"] == 2
    assert "every reward" not in capsys.readouterr().out  # said once per run


def test_the_console_shows_kl_only_when_it_can_move(tmp_path, capsys):
    """With one optimiser step per batch the update starts on-policy: approx_kl is 0 and leaves the console line;
    SPO's mean D(x) over revisited prompts shows how far the policy moves."""
    from machinery.metrics import Logger
    metrics = {"reward/mean": 0.5, "policy/approx_kl": 0.0, "tracker/divergence_revisit_mean": 0.04,
               "response/truncated": 0.25}
    for ppo_steps, shown in ((1, False), (8, True)):
        logger = Logger(str(tmp_path / str(ppo_steps)), {"ppo_steps": ppo_steps}, True)
        logger.log(1, metrics, console=True)
        logger.close()
        line = capsys.readouterr().out.splitlines()[-1]
        assert line.startswith("step 1: reward=0.5 D=0.04") and "cut=0.25" in line and ("kl=" in line) == shown


def _write_rows(path, rows, tail=""):
    import json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)


def _png_shape(path):
    import matplotlib.image
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(path).shape  # decodes: a whole, valid PNG


def test_plot_run_draws_the_panels_the_metrics_have_and_never_fails(tmp_path, capsys):
    """SPO's five panels (two rows of three); GRPO's file has no tracker keys: three panels (one row); an empty or
    missing metrics file, or a row cut off mid-write, still gives a PNG."""
    from machinery.metrics import plot_run
    step = {"reward/mean": 0.25, "policy/entropy": 0.3}
    tracker = {"tracker/value_mean": 0.2, "tracker/rho_mean": 0.9}
    rows = ([{"step": 0, "time": 0.0, "eval/accuracy": 0.1}]
            + [{"step": s, "time": float(s), **step, **tracker} for s in range(1, 5)]
            + [{"step": 4, "time": 4.5, "eval/accuracy": 0.3}])
    _write_rows(tmp_path / "spo" / "metrics.jsonl", rows, tail='{"step": 5, "reward/me')  # cut off by a crash
    _write_rows(tmp_path / "grpo" / "metrics.jsonl",
                [{k: v for k, v in row.items() if not k.startswith("tracker/")} for row in rows])
    _write_rows(tmp_path / "empty" / "metrics.jsonl", [])
    (tmp_path / "none").mkdir()
    shapes = {}
    for run in ("spo", "grpo", "empty", "none"):
        path = plot_run(str(tmp_path / run))
        assert path == str(tmp_path / run / "run.png")
        shapes[run] = _png_shape(path)
    assert shapes["spo"][0] > shapes["grpo"][0] and shapes["spo"][1] == shapes["grpo"][1]  # a second row of panels
    assert not list(tmp_path.glob("*/run.png.tmp")) and "skipped" not in capsys.readouterr().out


def test_plot_run_returns_none_with_one_line_when_it_cannot_write(tmp_path, capsys):
    from machinery.metrics import plot_run
    _write_rows(tmp_path / "metrics.jsonl", [{"step": 1, "time": 0.0, "reward/mean": 0.5}])
    (tmp_path / "run.png.tmp").mkdir()  # the PNG cannot be written
    assert plot_run(str(tmp_path)) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("run plot skipped (")


def test_the_summary_line_gives_accuracy_before_and_after_and_the_range_only_when_asked(tmp_path):
    """One line: the first and last held-out accuracy, the README's range only for the default run, the run
    directory, the plot and the next command; a run without evaluations says so instead of inventing a number."""
    from machinery.metrics import run_summary
    _write_rows(tmp_path / "metrics.jsonl", [{"step": 0, "time": 0.0, "eval/accuracy": 0.132},
                                            {"step": 1, "time": 1.0, "reward/mean": 0.5},
                                            {"step": 150, "time": 2.0, "eval/accuracy": 0.52}])
    line = run_summary(str(tmp_path), "p.png", 90.0, (44.9, 58.8), "test.parquet")
    assert "\n" not in line and "13.2% (step 0) -> 52.0% (step 150)" in line and "44.9-58.8%" in line
    assert str(tmp_path) in line and "p.png" in line and "eval.py --model" in line and "--data test.parquet" in line
    assert "44.9" not in run_summary(str(tmp_path), "p.png", 90.0, None, None)
    _write_rows(tmp_path / "metrics.jsonl", [{"step": 1, "time": 1.0, "reward/mean": 0.5}])
    assert "not measured" in run_summary(str(tmp_path), None, 90.0, (44.9, 58.8))
