"""The algorithm's tests, to read beside the paper: the value tracker (Eq. 5-7, Algorithm 2), prioritized sampling
(Eq. 11), the advantages (Eq. 8, Eq. 9, GRPO), D(x) and the PPO-clip loss (Eq. 10) on hand-made tensors. Each
test is one property on small hand-made numbers; no engine, no process group. The verifier's tests are in
tests/test_reward.py.

    .venv/bin/python -m pytest test_spo.py -q

The real engine, trainer, sandbox and the end-to-end runs are tested in tests/ (the README's test command runs
both; `-m "not slow"` skips the ones that start vLLM or torchrun).
"""
import itertools
import math

import numpy as np
import pytest
import torch

from sampler import PromptSampler, priority_weights
from spo import D_HALF, PreviousResponse, divergence, global_normalise, ppo_clip_loss, remember, spo_advantage
from tracker import ValueTracker
from variants import grpo_advantage


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


# ---- sampler -------------------------------------------------------------------------------------------
def test_priority_weights():
    w = priority_weights([0.5, 0.0, 1.0, 1.2, -0.1, 0.5], [1, 1, 1, 1, 1, 4], eps=0.05, gamma=0.5)
    np.testing.assert_allclose(w, [0.55, 0.05, 0.05, 0.05, 0.05, 0.25 + 0.05])
    np.testing.assert_allclose(priority_weights([0.5], [4.0]), [0.55])  # gamma = 0 ignores n_eff


def exact_successive(w, batch_size):
    """Exact P(i in batch) for successive sampling, by enumerating sequences."""
    w = np.asarray(w, float)
    inclusion = np.zeros(len(w))
    for seq in itertools.permutations(range(len(w)), batch_size):
        left, p = w.sum(), 1.0
        for i in seq:
            p *= w[i] / left
            left -= w[i]
        inclusion[list(seq)] += p
    return inclusion


@pytest.mark.parametrize("w, batch_size", [([1, 2, 3, 4, 0.5, 6], 3), ([1000, 1000, 1, 1, 2, 1], 4)])
def test_draws_follow_exact_successive_sampling_in_random_order(w, batch_size):
    """Inclusion as successive sampling, and the batch's order carries no weight: every position (the first is
    rank 0's slice and the first PPO mini-batch) holds prompt i with probability P(i in batch) / B."""
    draws = 20000
    sampler = PromptSampler(len(w), seed=1)
    sampler.set_weights(np.array(w, float))
    batches = np.stack([sampler.draw(batch_size) for _ in range(draws)])  # (draws, B)
    inclusion = exact_successive(w, batch_size)
    for observed, p in [(np.bincount(batches[:, 0], minlength=len(w)), inclusion / batch_size),
                        (np.bincount(batches[:, -1], minlength=len(w)), inclusion / batch_size),
                        (np.bincount(batches.ravel(), minlength=len(w)), inclusion)]:
        sigma = np.sqrt(draws * p * (1 - p)) + 1.0
        assert (np.abs(observed - draws * p) < 5 * sigma).all(), (observed / draws, p)


def test_single_draw_frequencies_chi_square():
    w = np.array([0.05, 0.1, 0.3, 0.55, 0.2, 0.5, 0.05, 0.25])
    draws = 40000
    sampler = PromptSampler(len(w), seed=2)
    sampler.set_weights(w)
    counts = np.bincount([sampler.draw(1)[0] for _ in range(draws)], minlength=len(w))
    expected = draws * w / w.sum()
    assert ((counts - expected) ** 2 / expected).sum() < 24.3  # chi2(7 dof) 0.999 quantile


def test_inclusion_matches_numpy_choice_at_larger_n():
    """Inclusion mass per weight class, ours vs numpy's choice(replace=False, p), 200 prompts, B = 40."""
    n, batch_size, draws = 200, 40, 3000
    weight_class = np.arange(n) % 3
    w = np.array([0.05, 0.3, 0.55])[weight_class]
    sampler = PromptSampler(n, seed=3)
    sampler.set_weights(w)
    ours = np.bincount(weight_class[np.concatenate([sampler.draw(batch_size) for _ in range(draws)])])
    legacy = np.random.RandomState(4)
    ref = np.bincount(weight_class[np.concatenate(
        [legacy.choice(n, batch_size, replace=False, p=w / w.sum()) for _ in range(draws)])])
    assert (np.abs(ours - ref) < 5 * np.sqrt(2 * ref)).all(), (ours, ref)


@pytest.mark.parametrize("n, batch_size", [(1, 1), (7, 7), (50, 49), (1000, 64)])
def test_draws_are_distinct_and_skip_zero_weights(n, batch_size):
    sampler = PromptSampler(n, seed=5)
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


def test_incremental_weights_give_the_same_draws_as_a_full_rebuild():
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
    assert (incremental.weights == full.weights).all()
    assert all((incremental.draw(64) == full.draw(64)).all() for _ in range(5))


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
    counts = np.bincount(np.concatenate([sampler.draw(5) for _ in range(4000)]), minlength=10)
    assert (np.abs(counts - 2000) < 5 * np.sqrt(2000 * 0.5)).all(), counts


# ---- advantages (Eq. 8, Eq. 9) ---------------------------------------------------------------------------
def test_spo_advantage_uses_the_value_before_this_reward():
    """Eq. 8: A = r - v_{-1}(x). Reading the value after the tracker absorbed r would shrink A towards 0."""
    tracker = ValueTracker(2)
    tracker.init_from_scores(np.array([0, 1]), [2.0, 6.0], [8, 8], smoothing="mean")  # v = 0.25, 0.75
    index, reward = np.array([0, 1]), np.array([1.0, 0.0])
    advantage = spo_advantage(reward, tracker.value_at(index))
    tracker.update(index, reward, 0.9)
    np.testing.assert_allclose(advantage, [0.75, -0.75])
    after = spo_advantage(reward, tracker.value_at(index))
    assert (np.abs(after) < np.abs(advantage)).all()


def test_global_normalise_is_one_z_score_over_all_ranks():
    """Eq. 9 over the global batch: two ranks that each see half the batch get the halves of the one z-score."""
    a = np.array([1.0, 2.0, 4.0, 7.0, 0.5])
    halves = [a[:2], a[2:]]
    totals = sum(np.array([h.sum(), (h ** 2).sum(), h.size, h.size]) for h in halves)  # what all_reduce returns
    out = np.concatenate([global_normalise(h, all_reduce=lambda _: totals) for h in halves])
    np.testing.assert_allclose(out, (a - a.mean()) / (a.std(ddof=1) + 1e-8), rtol=1e-12)
    np.testing.assert_allclose(global_normalise(a, all_reduce=np.asarray), out, rtol=1e-12)  # a world of one


def test_token_measure_centres_the_advantage_over_loss_tokens():
    """--adv_norm token (SPO++): the advantage has mean 0 over the batch's loss tokens (each trajectory repeated
    once per token), which the trajectory form misses once lengths differ, and weighted unbiased std 1."""
    a, tokens = np.array([1.0, -0.5, 0.25, -1.0]), np.array([3, 10, 1, 6])
    out = global_normalise(a, all_reduce=np.asarray, weight=tokens)
    assert abs(np.repeat(out, tokens).mean()) < 1e-12
    v1, v2 = tokens.sum(), (tokens ** 2).sum()
    assert abs((tokens * out ** 2).sum() / (v1 - v2 / v1) - 1) < 1e-7  # reliability-weighted unbiased variance
    assert abs(np.repeat(global_normalise(a, all_reduce=np.asarray), tokens).mean()) > 0.1  # trajectory form: not
    halves = [(a[:1], tokens[:1]), (a[1:], tokens[1:])]  # two ranks sum their weighted totals
    totals = sum(np.array([(w * h).sum(), (w * h ** 2).sum(), w.sum(), (w ** 2).sum()]) for h, w in halves)
    split = np.concatenate([global_normalise(h, all_reduce=lambda _: totals, weight=w) for h, w in halves])
    np.testing.assert_allclose(split, out, rtol=1e-12)


def test_token_measure_with_equal_lengths_is_the_trajectory_form():
    a = np.array([0.3, -0.7, 1.1, 0.0, -0.2])
    np.testing.assert_array_equal(global_normalise(a, all_reduce=np.asarray, weight=np.full(5, 1.0)),
                                  global_normalise(a, all_reduce=np.asarray))
    np.testing.assert_allclose(global_normalise(a, all_reduce=np.asarray, weight=np.full(5, 7)),
                               global_normalise(a, all_reduce=np.asarray), rtol=1e-6)


def test_grpo_advantage_is_a_z_score_within_each_group():
    a = grpo_advantage(np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), group_size=4)
    # group 1: mean 0.25, unbiased std 0.5; group 2: all equal, so no signal at all
    np.testing.assert_allclose(a, [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], atol=1e-5)


# ---- D(x) and SPO's memory ------------------------------------------------------------------------------
def test_divergence_by_hand():
    then = np.log([0.5, 0.25])
    assert divergence(then, then, "abs") == divergence(then, then, "k3") == 0.0  # the policy did not move
    now = then + np.log([2.0, 0.5])  # l = +ln 2 and -ln 2
    assert divergence(now, then, "abs") == pytest.approx(math.log(2))  # mean |l|
    assert divergence(now, then, "k3") == pytest.approx(0.25)  # (1 - ln 2) + (ln 2 - 1/2), halved
    assert divergence(np.array([]), np.array([])) == 0.0  # a response with no policy token: a first visit


def test_k3_divergence_is_an_unbiased_estimate_of_kl_then_now():
    """For tokens sampled from pi_then, the mean of e^l - 1 - l (l = log pi_now - log pi_then) is KL(then || now)."""
    p_then, p_now = np.array([0.7, 0.2, 0.1]), np.array([0.5, 0.3, 0.2])
    tokens = np.random.default_rng(0).choice(3, size=400_000, p=p_then)
    kl = float(np.sum(p_then * np.log(p_then / p_now)))
    assert divergence(np.log(p_now[tokens]), np.log(p_then[tokens]), "k3") == pytest.approx(kl, rel=0.02)


def test_k3_d_half_gives_the_same_rho_as_abs_at_the_centre_of_the_clip_window():
    """The authors' D_half = 0.06 leaves rho unclipped for mean |l| in [0.0035, 0.0116]; at the window's
    geometric centre the k3 measure with its own D_half gives the same rho (Gaussian log-ratios), and with 0.06
    it would pin rho at rho_max."""
    log_ratio = np.random.default_rng(0).normal(0.0, math.sqrt(0.0035 * 0.0116) * math.sqrt(math.pi / 2), 200_000)
    rho = {name: ValueTracker(1, d_half=D_HALF[name]).rho([divergence(log_ratio, 0 * log_ratio, name)])[0]
           for name in ("abs", "k3")}
    assert 0.9 < rho["abs"] < 0.95 and rho["k3"] == pytest.approx(rho["abs"], abs=0.003)
    assert ValueTracker(1, d_half=0.06).rho([divergence(log_ratio, 0 * log_ratio, "k3")])[0] == 0.96


def test_remember_keeps_each_prompts_latest_response():
    def response(token):
        return PreviousResponse(np.array([token], np.int32), np.array([-1.0], np.float32), np.array([1], np.int8))
    previous = {}
    remember(previous, np.array([3, 5]), [response(1), response(2)], all_gather=list)  # a world of one
    remember(previous, np.array([5, 7]), [response(3), response(4)], all_gather=list)
    assert {i: int(p.response_ids[0]) for i, p in previous.items()} == {3: 1, 5: 3, 7: 4}


# ---- the PPO-clip loss (Eq. 10) -------------------------------------------------------------------------
@pytest.mark.parametrize("advantage, ratio, loss, clipped, gradient", [
    (1.0, 1.1, -1.1, False, True),   # inside the clip range: the plain policy-gradient surrogate
    (1.0, 1.5, -1.28, True, False),  # clip-higher: a positive advantage gains nothing beyond 1 + 0.28
    (1.0, 0.5, -0.5, False, True),   # below 1 - 0.2 with A > 0 the unclipped term is the pessimistic one
    (-1.0, 1.5, 1.5, False, True),   # A < 0 above the range: unclipped (pessimistic), the gradient pushes back
    (-1.0, 0.5, 0.8, True, False),   # A < 0 below 1 - 0.2: clipped, no gradient
    (-1.0, 5.0, 5.0, False, True),   # A < 0 with a ratio under the dual-clip bound c = 10: unclipped
    (-1.0, 20.0, 10.0, False, False),  # dual-clip: the loss of a negative advantage stops at c * |A|
])
def test_ppo_clip_loss_by_hand(advantage, ratio, loss, clipped, gradient):
    logprobs = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)  # old log-prob 0
    out, was_clipped = ppo_clip_loss(logprobs, torch.zeros(1, 1, dtype=torch.float64),
                                     torch.tensor([advantage], dtype=torch.float64), torch.ones(1, 1),
                                     clip_low=0.2, clip_high=0.28, dual_clip=10.0, n_tokens=1)
    out.backward()
    assert out.item() == pytest.approx(loss) and bool(was_clipped[0, 0]) == clipped
    # d loss / d log pi = -A * ratio where the surrogate is not cut off, 0 where a bound decided
    assert logprobs.grad.item() == (pytest.approx(-advantage * ratio) if gradient else 0.0)


def test_ppo_clip_loss_is_a_token_mean_over_the_global_count_and_skips_masked_tokens():
    logprobs = torch.tensor([[0.0, 0.0, 50.0], [0.0, -50.0, 7.0]])  # masked tokens hold garbage
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = ppo_clip_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -3.0]), mask,
                            clip_low=0.2, clip_high=0.28, dual_clip=10.0, n_tokens=6)
    assert loss.item() == pytest.approx((-1.0 - 1.0 + 3.0) / 6)  # ratio 1 on every counted token; 6 tokens globally
