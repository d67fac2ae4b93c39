"""experiments/analysis.py contrasts: a planned family of paired differences A - B, each at its accounting (total
generations or training samples), Holm-adjusted, on a hand-built sweep whose per-seed differences are known, and on
the committed mixed sweep, where it must give the primary's own numbers.

    python -m pytest tests/test_contrasts.py -q
"""
import json
import os

import numpy as np
import pytest

from common import ROOT
from experiments import analysis

SEEDS = range(8)
Z = np.array([1.0, -1.0] * 4)  # mean 0, sd sqrt(8 / 7): t / sqrt(7) + Z has the paired t-statistic t at 7 df
# Student's t, two-sided, 7 degrees of freedom: t -> p
T01, T05, T20 = 3.49948, 2.36462, 1.41492
# arm: (algo, offline values, held-out accuracy from step 1 on minus grpo's at each seed, in points)
ARMS = {"grpo": ("grpo", "auto", 0 * Z), "no_offline": ("spo", "none", T01 / np.sqrt(7) + Z),
        "spo_g8": ("spo", "auto", -T05 / np.sqrt(7) + Z), "spo": ("spo", "auto", T20 / np.sqrt(7) + Z),
        "uniform": ("spo", "none", T05 / np.sqrt(7) + Z)}


def accuracy(arm, seed):
    """Every run: accuracy 0 at step 0, then one value from step 1 on; seeds differ by far more than the arms
    (a pairing by seed that slipped would show), each arm a known number of points off grpo at each seed."""
    return 0.5 + 0.03 * seed + 0.01 * ARMS[arm][2][seed]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Records of 5 arms x 8 seeds, 4 steps of 16 generations each: 64 training samples; the arms with offline
    values spend n0 2 x 8 pool prompts = 16 more before step 1. So at the total budget (64, the smallest total) a
    curve averages 0.625 of its accuracy with offline values (0 over the first 16, then a ramp over 16) and 0.875
    without (a ramp over the first 16); over training samples every curve averages 0.875 of it."""
    out = str(tmp_path_factory.mktemp("sweep"))
    members = {}
    for arm, (algo, offline, _) in ARMS.items():
        for seed in SEEDS:
            config = {"algo": algo, "offline_values": offline, "n0": 2, "train": "gone", "train_prompts": 8,
                      "batch_size": 16, "pool_seed": seed}
            rows = [{"step": 0, "eval/accuracy": 0.0}] + [
                {"step": step, "sampling/generated": 16, "eval/accuracy": accuracy(arm, seed)} for step in range(1, 5)]
            members[f"{arm}-s{seed}/config.json"] = json.dumps(config).encode()
            members[f"{arm}-s{seed}/metrics.jsonl"] = "".join(json.dumps(r) + "\n" for r in rows).encode()
    analysis.write_archive(os.path.join(out, "records.tar.gz"), members)
    return out


FAMILY = ["no_offline-grpo:total", "spo_g8-grpo:training", "spo-grpo:training", "uniform-grpo:total"]


def test_each_contrast_is_a_minus_b_by_seed_with_its_t_test_and_holm_over_the_family(sweep):
    rows = analysis.contrasts(sweep, FAMILY, "eval/accuracy")["rows"]
    for member, t in zip(FAMILY, (T01, -T05, T20, T05)):
        primary, final = rows[member]["primary"], rows[member]["final"]
        assert primary["n"] == final["n"] == 8 and rows[member]["budget"] == 64
        assert primary["mean"] == pytest.approx(0.875 * 0.01 * t / np.sqrt(7)), member  # the sign: A - B
        assert final["mean"] == pytest.approx(0.01 * t / np.sqrt(7)), member  # the last evaluation: no ramp
        assert primary["sd"] == pytest.approx(0.875 * 0.01 * np.sqrt(8 / 7))
    p = {member: rows[member]["primary"]["p"] for member in FAMILY}
    assert p == pytest.approx(dict(zip(FAMILY, (0.01, 0.05, 0.2, 0.05))), abs=1e-5)
    assert rows["no_offline-grpo:total"]["final"]["p"] == pytest.approx(0.01, abs=1e-5)
    # Holm: 0.01 x 4; the two 0.05s x 3 and x 2, kept non-decreasing; 0.2 x 1
    holm = {member: rows[member]["primary"]["p_holm"] for member in FAMILY}
    assert holm == pytest.approx(dict(zip(FAMILY, (0.04, 0.15, 0.2, 0.15))), abs=1e-4)
    assert "p_holm" not in rows["no_offline-grpo:total"]["final"]  # the family is the averages only
    assert rows["spo-grpo:training"]["primary"]["p_sign_flip"] == analysis.sign_flip_p(
        0.875 * 0.01 * (T20 / np.sqrt(7) + Z))


def test_the_accounting_charges_the_offline_values_at_total_only_and_b_minus_a_is_the_negative(sweep):
    rows = analysis.contrasts(sweep, ["spo-grpo:total", "grpo-spo:training", "spo-grpo:training"],
                              "eval/accuracy")["rows"]
    total = np.mean([0.625 * accuracy("spo", s) - 0.875 * accuracy("grpo", s) for s in SEEDS])
    assert total < 0 and rows["spo-grpo:total"]["primary"]["mean"] == pytest.approx(total)
    assert rows["grpo-spo:training"]["primary"]["mean"] == pytest.approx(
        -rows["spo-grpo:training"]["primary"]["mean"]) == pytest.approx(-0.875 * 0.01 * T20 / np.sqrt(7))


def test_the_table_says_what_its_intervals_cover_and_each_rows_accounting(sweep, capsys):
    analysis.main(["contrasts", sweep, "--metric", "eval/accuracy", "--family", *FAMILY])
    text = capsys.readouterr().out
    assert "the pool's draw" in text and "total, offline values counted" in text
    assert "| spo_g8-grpo:training | 64 | 8 | -0.78 [" in text  # -0.875 x 2.36462 / sqrt(7) points
    assert len([line for line in text.splitlines() if line.startswith("| ") and ":" in line]) == 5  # header + 4


@pytest.mark.parametrize("member", ["spo-grpo", "spo-grpo:final", "spo_grpo:total", "spo-grpo-uniform:total",
                                    "spo-:total", "rloo-grpo:total", "spo-rloo:training"])
def test_a_malformed_or_unknown_member_is_refused_in_one_line(sweep, member):
    with pytest.raises(SystemExit) as refused:
        analysis.main(["contrasts", sweep, "--metric", "eval/accuracy", "--family", "spo-grpo:total", member])
    assert str(refused.value).startswith(f"error: {member!r}" if "rloo" not in member else f"error: {member}:")
    assert "\n" not in str(refused.value)


def test_on_the_committed_mixed_sweep_spo_minus_grpo_is_the_primarys_own_number_at_either_accounting():
    """experiments/mixed/primary.md: grpo - spo +3.59 [+3.22, +3.96] over total generations, -0.87 [-1.25, -0.49]
    over training samples; as spo - grpo the signs turn, and the rest is primary.json's grpo entry."""
    out = os.path.join(ROOT, "experiments", "mixed")
    rows = analysis.contrasts(out, ["spo-grpo:total", "spo-grpo:training"], "eval/accuracy")["rows"]
    cells = {member: analysis.pct(row["primary"]["mean"], *row["primary"]["ci95"], "+.2f")
             for member, row in rows.items()}
    assert cells == {"spo-grpo:total": "-3.59 [-3.96, -3.22]", "spo-grpo:training": "+0.87 [+0.49, +1.25]"}
    with open(os.path.join(out, "primary.json")) as f:
        grpo = json.load(f)["paired"]["grpo"]
    for metric in ("primary", "final"):
        mine = rows["spo-grpo:total"][metric]
        assert mine["mean"] == pytest.approx(-grpo[metric]["mean"]) and mine["n"] == grpo[metric]["n"] == 8
        assert (mine["sd"], mine["p"]) == pytest.approx((grpo[metric]["sd"], grpo[metric]["p"]), abs=1e-6)
