"""What a run records (machinery/metrics.py): the prompts drawn but never trained on, the all-equal batch note, and
the console line's columns.

    .venv/bin/python -m pytest tests/test_metrics.py -q
"""
import numpy as np

from machinery.metrics import PromptReach


def test_prompt_reach_counts_prompts_never_trained_on_and_restores():
    """--oversample's run-long count: a prompt drawn twice and kept once is reached; one only ever aborted is not."""
    reach = PromptReach(5)
    reach.update(np.array([0, 1, 2]), np.array([0, 2]))
    reach.update(np.array([1, 3]), np.array([3]))
    assert reach.metrics() == {"oversample/prompts_drawn": 4, "oversample/never_trained_share": 1 / 4}
    restored = PromptReach(5)
    restored.load_state_dict(reach.state_dict())
    restored.update(np.array([1]), np.array([1]))  # counting goes on after a resume
    assert restored.metrics()["oversample/never_trained_share"] == 0.0


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
