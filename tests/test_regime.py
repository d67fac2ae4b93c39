"""The regime measurement (experiments/regime.py): revisits per prompt, the drift of p(x) per visit, the bias a
steady drift predicts, and the bounds, read from a run's probe.jsonl and metrics.jsonl.

    .venv/bin/python -m pytest tests/test_regime.py -q
"""
import json

from probes import probe_stats
from experiments import regime


def write_run(run_dir, probes, rho=0.9):
    run_dir.mkdir()
    with open(run_dir / "probe.jsonl", "w") as f:
        for step, success, value, visits in probes:
            stats = probe_stats(value, success, 16, [10.0] * len(value))
            f.write(json.dumps({"step": step, "success": success, "value": value, "n_eff": [10.0] * len(value),
                                "visits": visits, "n_samples": 16, **stats}) + "\n")
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(0, probes[-1][0] + 1):
            f.write(json.dumps({"step": step, "tracker/rho_mean": rho, "tracker/visits_mean": 3.0,
                                **({"eval/accuracy": 0.1 + step / 100} if step % 10 == 0 else {})}) + "\n")
    return str(run_dir)


def test_drift_per_visit_and_the_bias_it_predicts(tmp_path):
    """Success rises 0.2 over 10 visits: delta = 0.02 per visit; at rho 0.9 a steady drift predicts a bias of
    -0.02 x 9 = -0.18."""
    r = regime.regime(write_run(tmp_path / "run", [(0, [0.2, 0.4], [0.2, 0.4], [0, 0]),
                                                   (10, [0.4, 0.6], [0.4, 0.6], [10, 10])]))
    (interval,) = r["intervals"]
    assert abs(interval["delta"] - 0.02) < 1e-12 and abs(interval["memory"] - 10) < 1e-9
    assert abs(interval["lag"] + 0.18) < 1e-9
    assert r["visits_per_prompt"] == 3.0 and r["held_out"] == ((0, 0.1), (10, 0.2))
    assert r["passes"]  # v(x) equals the measured rate at both probes


def test_a_lagging_tracker_fails_the_bias_bound(tmp_path):
    r = regime.regime(write_run(tmp_path / "run", [(0, [0.2, 0.4], [0.2, 0.4], [0, 0]),
                                                   (10, [0.5, 0.7], [0.4, 0.6], [10, 10])]))
    assert abs(r["probes"][1]["bias"] + 0.1) < 1e-12 and not r["passes"]
    assert "NOT met" in regime.report("run", r)


def test_rho_one_means_an_unbounded_memory_not_a_division_error(tmp_path):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a divide-by-zero RuntimeWarning fails the test
        r = regime.regime(write_run(tmp_path / "run", [(0, [0.2, 0.4], [0.2, 0.4], [0, 0]),
                                                       (10, [0.4, 0.6], [0.3, 0.5], [10, 10])], rho=1.0))
    (interval,) = r["intervals"]
    assert interval["memory"] == float("inf") and interval["lag"] == float("-inf")


def test_targets_weigh_the_window_by_revisits_and_take_the_lag_on_prompts_being_learned(tmp_path):
    """Two steps with revisits: 10% of the batch with rho strictly inside its window, then 90% of a batch 3 times as
    revisited: 0.1 x 1/4 + 0.9 x 3/4 = 0.7. The lag is read only where 0.1 < p < 0.9 (the p = 0.95 prompt's
    larger miss is not a lag), and only after step 20."""
    from experiments.analysis import read_run
    run_dir = write_run(tmp_path / "run", [(0, [0.5, 0.95], [0.0, 0.0], [0, 0]),
                                           (30, [0.5, 0.95], [0.4, 0.6], [10, 10])])
    with open(tmp_path / "run" / "config.json", "w") as f:
        json.dump({"batch_size": 8, "group_size": 1, "train_prompts": 16, "train": ""}, f)
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        for step, share, at_min, at_max in ((31, 0.25, 0.5, 0.4), (32, 0.75, 0.05, 0.05)):
            f.write(json.dumps({"step": step, "tracker/revisit_share": share, "tracker/rho_at_min": at_min,
                                "tracker/rho_at_max": at_max, "tracker/divergence_revisit_mean": 0.01,
                                "policy/clip_fraction": 0.001, "time": step}) + "\n")
    m = regime.measure(read_run(run_dir), after=20)
    assert abs(m["window"] - 0.7) < 1e-12
    assert abs(m["lag"] - 0.1) < 1e-12 and abs(m["bias"] - 0.225) < 1e-12  # bias: mean of -0.1 and -0.35
    assert m["mastered"] == (0.5, 0.5) and m["samples"] == 8 * 32 / 16


def test_the_between_share_two_independent_estimates_give_needs_no_noise_model():
    """v0 = (s + 0.5) / (n0 + 1) from n0 offline samples and the probe's success are independent estimates of p(x):
    their covariance is Var p scaled by n0 / (n0 + 1), whatever the samples' noise."""
    import numpy as np
    p = np.array([0.0, 0.25, 0.5, 1.0, 1.0])
    v0 = (8 * p + 0.5) / 9
    expected = p.var() / (p.mean() * (1 - p.mean()))
    assert abs(regime.between_share_free(v0, p, 8, "kt") - expected) < 1e-12
    assert abs(regime.between_share_free(p, p, 8, "mean") - expected) < 1e-12


def test_all_agree_from_a_probe_is_the_hypergeometric_chance_a_group_agrees():
    assert regime.all_agree_estimate([1.0, 0.0], 16) == 1.0
    assert abs(regime.all_agree_estimate([0.5], 16) - 2 / 12870) < 1e-15  # C(8, 8) twice over C(16, 8)
    assert abs(regime.all_agree_estimate([7 / 16], 16) - 9 / 12870) < 1e-15  # 9 failures: C(9, 8) = 9 groups


def test_the_lag_share_is_what_centring_leaves_a_prompt_specific_lag():
    """A lag common to every prompt is centred away (Eq. 9); one that differs by prompt adds its variance."""
    common = {"exact": [0.2, 0.4, 0.6, 0.8], "value": [0.1, 0.3, 0.5, 0.7]}
    noise = (0.16 + 0.24 + 0.24 + 0.16) / 4  # E[p (1 - p)]: what an exact baseline leaves
    assert abs(regime.lag_share(common, "exact")) < 1e-12
    assert abs(regime.lag_share(common, "exact", shared=True) - 0.01 / noise) < 1e-12
    specific = {"exact": [0.2, 0.4, 0.6, 0.8], "value": [0.1, 0.5, 0.5, 0.9]}
    assert abs(regime.lag_share(specific, "exact") - 0.01 / noise) < 1e-12
