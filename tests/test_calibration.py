"""The calibrated regime: the pool statistics every toy evaluation logs (probes.py:pool_statistics), the
preregistered primary metric and power (experiments/analysis.py), and the sharper warm start --preset calibrated
ships.

    .venv/bin/python -m pytest tests/test_calibration.py -q
"""
import os

import numpy as np
import pytest

import spo
import variants
from probes import pool_statistics
from experiments.analysis import area_mean, detectable, exact_curve, seeds_for


def test_pool_statistics_split_the_reward_variance_between_and_within_prompts():
    """Two prompts at 0 and 1: every group agrees and all the variance is between prompts; one prompt at 0.5 for
    all: none of it is, and 8 samples all agree with probability 2 / 2^8."""
    ends = pool_statistics([0.0, 1.0])
    assert ends["pool/all_agree8"] == 1.0 and ends["pool/between_share"] == pytest.approx(1.0)
    assert ends["pool/mastered"] == ends["pool/unsolved"] == 0.5
    middle = pool_statistics([0.5] * 4)
    assert middle["pool/between_share"] == 0.0 and middle["pool/all_agree8"] == pytest.approx(2 / 256)
    assert middle["pool/mastered"] == middle["pool/unsolved"] == 0.0


def test_pool_statistics_of_a_pool_all_solved_is_not_nan():
    assert pool_statistics([1.0, 1.0])["pool/between_share"] == 0.0


def test_the_primary_metric_counts_the_offline_generations_at_the_base_value():
    """SPO with offline values (n0 = 2 on 4 prompts: 8 samples) starts its curve 8 samples in; over a budget of 16
    samples a run that jumps from 0 to 1 at its first step averages less than one that spent nothing first."""
    rows = {0: {"step": 0, "eval/exact": 0.0}, 1: {"step": 1, "sampling/generated": 8, "eval/exact": 1.0},
            2: {"step": 2, "sampling/generated": 8, "eval/exact": 1.0}}
    spo_run = {"config": {"algo": "spo", "n0": 2, "offline_values": "auto"}, "rows": rows}
    grpo_run = {"config": {"algo": "grpo", "n0": 2, "offline_values": "auto"}, "rows": rows}
    spo_curve, grpo_curve = exact_curve(spo_run, pool=4), exact_curve(grpo_run, pool=4)
    assert spo_curve == [(0.0, 0.0), (8.0, 0.0), (16.0, 1.0), (24.0, 1.0)]
    assert area_mean(spo_curve, 16) == pytest.approx(0.25) and area_mean(grpo_curve, 16) == pytest.approx(0.75)
    no_offline = {"config": {"algo": "spo", "n0": 2, "offline_values": "none"}, "rows": rows}
    assert exact_curve(no_offline, pool=4) == grpo_curve


def test_a_curve_short_of_the_budget_is_refused():
    with pytest.raises(ValueError, match="before the budget"):
        area_mean([(0.0, 0.1), (10.0, 0.2)], 20)


def test_power_needs_more_seeds_for_a_noisier_difference():
    """(t_{.975} + t_{.80}) sd / sqrt(n): with sd 1 point 5 seeds cannot detect 1 point (3.7 / sqrt(5) = 1.65 sd),
    and the seed count grows about as sd^2."""
    assert detectable(0.01, 5) == pytest.approx((2.776 + 0.941) * 0.01 / np.sqrt(5))
    assert seeds_for(0.01, 0.004) < seeds_for(0.01, 0.008) < seeds_for(0.01, 0.012)
    n = seeds_for(0.01, 0.008)
    assert detectable(0.008, n) <= 0.01 < detectable(0.008, n - 1)
    assert seeds_for(0.01, 0.05) is None  # more than 30 seeds


def test_the_calibrated_preset_trains_the_shipped_sharper_toy():
    from tasks import toy
    args = spo.parse_args(["--preset", "calibrated"])
    assert args.toy_dir == toy.SHARP_TOY and os.path.isdir(args.toy_dir)
    assert toy.checksum_error(args.toy_dir) is None
    assert toy.ensure_toy(args.toy_dir)[0] == os.path.join(args.toy_dir, "model")
    assert args.batch_size // args.ppo_steps >= args.group_size * 2  # whole GRPO groups on each of 2 ranks


def test_the_analysis_of_the_committed_sweep_records_pairs_by_seed_and_counts_grpos_silent_samples():
    """The calibrated sweep's records (whatever seeds have landed): every variant paired with spo on the same seeds,
    the primary metric an average of exact success, and Fig. 3a's share: GRPO's all-agree groups give a large share
    of samples no signal, SPO's tracker baseline gives none."""
    from experiments.analysis import analyse
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "calibrated")
    result = analyse(out, "spo", budget=46592)
    assert {"spo", "grpo", "no_baseline", "uniform", "no_offline"} <= set(result["variants"])
    spo_seeds = set(result["variants"]["spo"]["primary"])
    for name, v in result["variants"].items():
        assert set(v["primary"]) == spo_seeds and all(0.5 < x < 1.0 for x in v["primary"].values())
        assert all(v["final"][s] > v["primary"][s] for s in spo_seeds)  # still learning: the end above the average
    assert result["paired"]["grpo"]["primary"]["n"] == len(spo_seeds)
    assert min(result["variants"]["grpo"]["zero_advantage"].values()) > 0.3
    assert max(result["variants"]["spo"]["zero_advantage"].values()) < 0.01


def test_the_forgetting_sweeps_primary_reads_the_sampled_accuracy_and_counts_the_offline_samples():
    """The thinking toy has no exact success (many traces are correct): analyse() refuses the default key there and
    averages eval/accuracy when asked; SPO's curve starts 512 samples late (n0 8 x 64 prompts spent on v0), GRPO's
    does not, so at the same step SPO's point sits further right."""
    from experiments.analysis import analyse, exact_curve, load, pool_size
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "forgetting")
    with pytest.raises(SystemExit, match="eval/exact"):
        analyse(out, "spo")
    result = analyse(out, "spo", key="eval/accuracy")
    assert result["budget"] == 6400 and set(result["variants"]["grpo"]["primary"]) == set(range(10, 15))
    spo, grpo = (exact_curve(load(out, f"{v}-s10"), 64, "eval/accuracy") for v in ("spo", "grpo"))
    assert spo[1] == (512.0, spo[0][1]) and spo[2][0] == grpo[1][0] + 512 == 25 * 64 + 512
    assert pool_size(load(out, "spo-s10")["config"]) == 64


def test_the_sign_flip_test_counts_sign_assignments_and_holm_steps_down():
    """Paired differences all of one sign at 8 seeds: only the two all-one-sign assignments reach |sum|, p = 2/256;
    Holm multiplies the smallest p by the family's size, the next by one less, and never lets p fall."""
    from experiments.analysis import holm, sign_flip_p, t_test_p
    z = np.array([1.0, -1.0] * 4)  # mean 0, sd sqrt(8 / 7): c + z has t = c sqrt(7) at 7 degrees of freedom
    for t, p in ((2.36462, 0.05), (3.49948, 0.01), (1.41492, 0.2)):  # Student's t table, two-sided
        assert abs(t_test_p(t / np.sqrt(7) + z) - p) < 1e-4, t
    assert sign_flip_p([0.01] * 8) == 2 / 256 and sign_flip_p([0.01, -0.01]) == 1.0
    assert sign_flip_p([0.03, 0.01, -0.01, 0.02]) == 6 / 16  # |sum| 5 or 7 (in 0.01): 3 patterns, each signed +-
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.5}) == {"a": 0.04, "c": 0.09, "b": 0.09, "d": 0.5}
