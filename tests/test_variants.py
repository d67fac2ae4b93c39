"""The family SPO is compared against (variants.py), each member's defining property on hand-made numbers, and
every flag in a short two-rank run on the toy (the slow tests; orthogonal flags share a run).

    .venv/bin/python -m pytest tests/test_variants.py -q
"""
import json
import math

import numpy as np
import pytest
import torch

import spo
import variants
from common import ok, toy_args, torchrun
from machinery import checkpoint
from tracker import ValueTracker
from variants import (cispo_token_loss, dr_grpo_advantage, dynamic_sampling, grpo_advantage, gspo_token_loss,
                      kl_to_reference, make_loss, max_rl_advantage, rloo_advantage, sapo_token_loss,
                      select_groups)


# ---- group baselines ----------------------------------------------------------------------------------------
def test_rloo_subtracts_the_mean_of_the_others_and_sums_to_zero_per_group():
    reward = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    a = rloo_advantage(reward, group_size=4)
    # group 1: 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3; group 2: 1 - 0 = 1, 0 - 1/3 = -1/3
    np.testing.assert_allclose(a, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1, -1 / 3, -1 / 3, -1 / 3], rtol=1e-12)
    np.testing.assert_allclose(a.reshape(2, 4).sum(1), 0.0, atol=1e-12)


def test_dr_grpo_is_the_group_difference_not_scaled_by_the_std():
    """Two groups with different stds: Dr. GRPO keeps r - mean as it is, GRPO divides each by its own std."""
    reward = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    np.testing.assert_allclose(dr_grpo_advantage(reward, 4), [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    z = grpo_advantage(reward, 4)
    assert z[0] == pytest.approx(0.75 / 0.5, rel=1e-5) and z[4] == pytest.approx(0.5 / math.sqrt(1 / 3), rel=1e-5)


@pytest.mark.parametrize("estimator", [rloo_advantage, dr_grpo_advantage, grpo_advantage])
def test_all_equal_groups_carry_no_signal(estimator):
    np.testing.assert_array_equal(estimator(np.array([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), 3), 0.0)


# ---- Batch SPO and the tracker's forgetting ---------------------------------------------------------------
def test_batch_spo_shares_one_value_and_decays_once_per_prompt_per_step():
    """G = 3 responses of each drawn prompt (spo.py: np.repeat of the draw): one v(x) for all three, and the
    update decays alpha and beta once (rho, not rho^3) before adding the three rewards."""
    tracker = ValueTracker(4, rho_constant=0.5)
    tracker.init_from_scores(np.arange(4), [2.0, 6.0, 4.0, 0.0], [8, 8, 8, 8], smoothing="mean")  # N0 = 8
    index = np.repeat(np.array([1, 3]), 3)
    value = tracker.value_at(index)
    np.testing.assert_array_equal(value, [0.75] * 3 + [0.0] * 3)
    tracker.update(index, np.array([1.0, 0.0, 1.0, 0.0, 0.0, 1.0]), tracker.rho(np.zeros(6)))
    np.testing.assert_allclose(tracker.alpha[[1, 3]], [0.5 * 6 + 2, 0.5 * 0 + 1])
    np.testing.assert_allclose(tracker.n_eff[[0, 1, 2, 3]], [8, 0.5 * 8 + 3, 8, 0.5 * 8 + 3])


def test_rho_none_never_forgets_and_is_not_capped_by_rho_max():
    """--rho none is rho = 1 (spo.py passes rho_constant 1.0): rho_max = 0.96 must not cap it, N_eff grows by one
    per reward and v is the plain mean of everything seen."""
    tracker = ValueTracker(1, rho_min=0.875, rho_max=0.96, rho_constant=1.0)
    tracker.init_from_scores(np.array([0]), [4.0], [8], smoothing="mean")  # alpha 4, beta 4
    assert (tracker.rho([0.0, 10.0]) == 1.0).all()
    rewards = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    for r in rewards:
        tracker.update(np.array([0]), np.array([r]), tracker.rho([5.0]))
    assert tracker.n_eff[0] == 8 + len(rewards) and tracker.alpha[0] == 4 + sum(rewards)


def test_parse_args_rho_none_and_group_size_defaults():
    assert spo.parse_args([]).group_size == 1 and spo.parse_args(["--algo", "rloo"]).group_size == 8
    assert spo.parse_args(["--group_size", "4"]).group_size == 4  # Batch SPO
    assert spo.parse_args(["--rho", "none"]).rho == "none"  # what main makes of it: the rho-none toy run below


# ---- policy losses, by hand -------------------------------------------------------------------------------
def _logprobs(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_gspo_one_clipped_ratio_per_sequence():
    """Sequence 1: token log-ratios 0.2 and 0 -> s = e^0.1 inside [0.8, 1.28]: loss -A s, gradient -A s / |y| per
    token. Sequence 2: log-ratios ln 2 on its two policy tokens (the third is masked garbage) -> s = 2 > 1.28 with
    A = 1: clipped, loss -1.28, no gradient."""
    logprobs = _logprobs([[0.2, 0.0, 0.0], [math.log(2), math.log(2), 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, clipped = gspo_token_loss(logprobs, torch.zeros(2, 3, dtype=torch.float64),
                                    torch.tensor([-1.0, 1.0], dtype=torch.float64), mask, 0.2, 0.28)
    s = math.exp(0.1)
    torch.testing.assert_close(loss, torch.tensor([[s] * 3, [-1.28] * 3], dtype=torch.float64))
    assert clipped.tolist() == [[False] * 3, [True] * 3]
    (loss[:, 0]).sum().backward()  # one sequence-level loss each
    torch.testing.assert_close(logprobs.grad, torch.tensor([[s / 2, s / 2, 0], [0, 0, 0]], dtype=torch.float64))


def test_cispo_keeps_the_gradient_of_a_clipped_token_with_its_weight_capped():
    """ratio 1.5 with A = 1: PPO-clip gives this token no gradient; CISPO gives -sg(1.28) * A * grad log pi, and
    the loss value is -1.28 * A * log pi. ratio 0.5 with A = -2: weight 0.8 (lower bound), loss 0.8 * 2 * log pi."""
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    logprobs = _logprobs([[-1.0 + math.log(1.5), -1.0 + math.log(0.5)]])
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, clipped = cispo_token_loss(logprobs, old, torch.tensor([1.0], dtype=torch.float64), mask, 0.2, 0.28)
    lp = logprobs.detach()[0]
    torch.testing.assert_close(loss.detach()[0], torch.stack([-1.28 * lp[0], -0.8 * lp[1]]))
    assert clipped.tolist() == [[True, True]]
    loss[0, 0].backward()
    assert logprobs.grad[0, 0].item() == pytest.approx(-1.28) and logprobs.grad[0, 1].item() == 0.0
    neg, _ = cispo_token_loss(logprobs.detach(), old, torch.tensor([-2.0], dtype=torch.float64), mask, 0.2, 0.28)
    assert neg[0, 1].item() == pytest.approx(0.8 * 2 * lp[1].item())
    garbage = torch.tensor([[-1.0, -1e30]], dtype=torch.float64)  # a masked position holding garbage
    out, _ = cispo_token_loss(garbage, old, torch.tensor([1.0], dtype=torch.float64), torch.tensor([[1.0, 0.0]]),
                              0.2, 0.28)
    assert out.tolist() == [[1.0, 0.0]]


def test_max_rl_weighs_a_success_by_one_over_its_groups_success_rate():
    """(r - p) / p per group of 4: one success in 4 (p = 1/4): 3 and -1; two (p = 1/2): 1 and -1; none: all 0, not a
    division by zero; a group all solved: 0 (nothing to learn, as for GRPO)."""
    reward = np.array([1.0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_allclose(max_rl_advantage(reward, 4), [3, -1, -1, -1, 1, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0],
                               rtol=1e-5, atol=1e-12)
    assert np.all(np.isfinite(max_rl_advantage(np.zeros(8), 4)))


def test_sapo_gates_softly_with_the_policy_gradient_at_ratio_one():
    """-A (4 / tau) sigmoid(tau (ratio - 1)), tau 1.0 for A > 0 and 1.05 for A < 0: at ratio 1 the loss is -2A / tau
    and its gradient in log pi is -A (the plain policy gradient); at ratio e^0.5 with A = -1 the loss is
    (4 / 1.05) sigmoid(1.05 (e^0.5 - 1)); masked tokens keep ratio 1; nothing counts as clipped."""
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    logprobs = _logprobs([[-1.0, -1.0], [-0.5, -1e30]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    loss, clipped = sapo_token_loss(logprobs, old, torch.tensor([2.0, -1.0], dtype=torch.float64), mask, 0.2, 0.28)
    sigmoid = 1 / (1 + math.exp(-1.05 * (math.exp(0.5) - 1)))
    torch.testing.assert_close(loss.detach(), torch.tensor([[-4.0, -4.0], [4 / 1.05 * sigmoid, 2 / 1.05]],
                                                           dtype=torch.float64))
    assert not clipped.any()
    loss[0, 0].backward()
    assert logprobs.grad[0, 0].item() == pytest.approx(-2.0) and logprobs.grad[0, 1].item() == 0.0


def test_kl_estimates_by_hand_and_their_gradients():
    """l = log pi_ref - log pi at two tokens, l = 0.5 and -1: k1 = -l, k2 = l^2 / 2, k3 = e^l - 1 - l; their
    gradients in log pi are 1, -l and 1 - e^l (Schulman 2020's estimators; zero where pi is pi_ref)."""
    ref = torch.tensor([[-1.0, -2.0, -0.7]], dtype=torch.float64)
    for estimator, values, grads in (
            ("k1", [-0.5, 1.0, 0.0], [1.0, 1.0, 1.0]),
            ("k2", [0.125, 0.5, 0.0], [-0.5, 1.0, 0.0]),
            ("k3", [math.exp(0.5) - 1.5, math.exp(-1.0), 0.0], [1 - math.exp(0.5), 1 - math.exp(-1.0), 0.0])):
        logprobs = _logprobs([[-1.5, -1.0, -0.7]])
        kl = kl_to_reference(logprobs, ref, estimator)
        kl.sum().backward()
        torch.testing.assert_close(kl.detach(), torch.tensor([values], dtype=torch.float64))
        torch.testing.assert_close(logprobs.grad, torch.tensor([grads], dtype=torch.float64))


TOKEN_LOSS = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [0.5, 0.5, 99.0, 99.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # 99: masked garbage


@pytest.mark.parametrize("aggregation, expected", [
    ("token_mean", (1 + 2 + 3 + 4 + 0.5 + 0.5) / 12),  # 12 policy tokens in the global mini-batch
    ("seq_mean_token_mean", (2.0 + 4.0 + 0.5) / 6),  # token means 2, 4, 0.5 over 6 sequences globally
    ("token_sum", (1 + 2 + 3 + 4 + 0.5 + 0.5) / (6 * 10)),  # over 6 sequences x a budget of 10 tokens
])
def test_aggregations_by_hand_and_as_sums_of_micro_batch_pieces(aggregation, expected):
    """The trainer sums a loss over micro-batches and ranks: any split of the rows must give the same total."""
    loss_fn = make_loss("ppo_clip", aggregation, lambda lp, old, adv, mask, **_: (TOKEN_LOSS[lp], None),
                        clip_low=0.2, clip_high=0.28, dual_clip=10.0, n_sequences=6, max_len=10)
    rows = torch.arange(3)
    whole, _ = loss_fn(rows, None, None, MASK, n_tokens=12)
    assert whole.item() == pytest.approx(expected)
    pieces = sum(loss_fn(rows[k], None, None, MASK[k], n_tokens=12)[0] for k in ([0, 2], [1]))
    assert pieces.item() == pytest.approx(expected)


def test_default_loss_is_exactly_spo_ppo_clip_loss():
    """--loss ppo_clip --loss_agg token_mean (the defaults) computes spo.ppo_clip_loss bit for bit: the default run
    does not change."""
    g = torch.Generator().manual_seed(0)
    logprobs, old = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
    adv, mask = torch.tensor([1.5, -0.7, -2.0]), (torch.rand(3, 5, generator=g) > 0.3).float()
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=10.0)
    ours, clipped = make_loss("ppo_clip", "token_mean", spo.ppo_clip_token_loss, n_sequences=6, max_len=5,
                              **kw)(logprobs, old, adv, mask, n_tokens=17)
    ref, ref_clipped = spo.ppo_clip_loss(logprobs, old, adv, mask, n_tokens=17, **kw)
    assert ours.item() == ref.item() and torch.equal(clipped, ref_clipped)


# ---- dynamic sampling ---------------------------------------------------------------------------------------
def test_select_groups_keeps_informative_groups_first_then_fills():
    r = np.array([[1, 1], [0, 1], [0, 0], [1, 0]])
    chosen, degenerate = select_groups(r, 2)
    assert chosen.tolist() == [1, 3] and degenerate == 0
    chosen, degenerate = select_groups(r, 3)
    assert chosen.tolist() == [1, 3, 0] and degenerate == 1  # the earliest all-equal group fills the batch


def _fake_round(rank, k, group=2, groups_per_rank=2):
    """(indices, rollouts, rewards) of one rank in round k: round 0 all-equal except rank 1's last group."""
    index = np.repeat(np.arange(groups_per_rank) + 100 * k + 10 * rank, group)
    reward = np.zeros(group * groups_per_rank)
    if k > 0 or rank == 1:
        reward[-group:] = [1.0, 0.0]
    return index, [f"r{rank}k{k}s{i}" for i in range(len(index))], reward


@pytest.mark.parametrize("max_rounds, rounds, generated, degenerate_used", [(0, 1, 8, 3 / 4), (5, 3, 24, 0.0)])
def test_dynamic_sampling_two_ranks_agree_and_count_generated_and_used(max_rounds, rounds, generated,
                                                                       degenerate_used):
    """Two ranks, 2 groups of 2 each. Round 0 has one informative group (rank 1's), every later round one per
    rank: a batch of 4 informative groups needs 3 rounds (1 + 2 + 2 kept). Both ranks take disjoint slices of one
    selection, whole groups, the same size as before; the metrics count every response generated."""
    out = {}
    for rank in (0, 1):
        calls = iter(range(100))

        def gather(items, calls=calls):
            k = next(calls)  # the k-th gather of this rank is round k on both ranks
            return [g for r in (0, 1) for g in (items if r == rank else _split(_fake_round(r, k)))]
        out[rank] = dynamic_sampling(_fake_round(rank, 0), lambda k, rank=rank: _fake_round(rank, k), 2,
                                     max_rounds, rank, 2, gather)
    (i0, ro0, r0, m0), (i1, ro1, r1, m1) = out[0], out[1]
    assert m0 == m1 and len(ro0) == len(ro1) == 4 and len(r0) == len(i0) == 4
    assert m0["sampling/rounds"] == rounds and m0["sampling/generated"] == generated and m0["sampling/used"] == 8
    assert m0["sampling/degenerate_used"] == degenerate_used
    assert not set(ro0) & set(ro1)
    groups = np.concatenate([r0, r1]).reshape(-1, 2)
    assert (groups.min(1) != groups.max(1)).sum() == round((1 - degenerate_used) * 4)
    for rollouts, index in ((ro0, i0), (ro1, i1)):  # rows stay aligned with their prompts
        assert all(r[:-2] == rollouts[2 * g][:-2] for g in range(2) for r in rollouts[2 * g: 2 * g + 2])
        assert (index[0::2] == index[1::2]).all()


def _split(batch, group=2):
    index, rollouts, reward = batch
    return [(index[k:k + group], rollouts[k:k + group], reward[k:k + group]) for k in range(0, len(index), group)]


# ---- every flag in a short two-rank run on the toy ----------------------------------------------------------
@pytest.fixture(scope="module")
def values(small_toy, tmp_path_factory):
    """Offline values for the small toy, written by hand (k of 8 successes, k = position mod 9), with spo.py's
    default sampling settings in the header: every prompt starts at N_eff = N0 = 8."""
    from machinery.data import load_dataset, load_tokenizer
    data = load_dataset(small_toy["train"], load_tokenizer(small_toy["model"]), 256, False)
    path = tmp_path_factory.mktemp("values") / "values.json"
    header = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 32, "truncated_reward": "zero"}
    path.write_text(json.dumps({"header": header, "prompts": {
        key: {"scores": [1] * (i % 9) + [0] * (8 - i % 9)} for i, key in enumerate(data.keys)}}))
    return str(path)


def _run(small_toy, run_dir, *flags):
    ok(torchrun(2, *toy_args(small_toy, run_dir, "--eval_every", "0", "--steps", "2", *flags)))
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(np.isfinite(v) for v in r.values()), r
        assert {"signal/zero_advantage", "signal/adv_var_raw", "signal/adv_var_effective"} <= r.keys()
    state = checkpoint.read_state(run_dir / "checkpoints" / "step_000002" / "state.pt")
    return rows, state


@pytest.mark.slow
def test_batch_spo_no_baseline_with_gspo_and_sequence_mean(small_toy, values, tmp_path):
    """--group_size 4 with spo: the tracker decays once per drawn prompt per step: with rho = 0.75 from N0 = 8, a
    prompt's N_eff is 8 (never drawn), 0.75 * 8 + 4 = 10 (once) or 0.75 * 10 + 4 = 11.5 (twice); decaying per
    response would give other values. --baseline none: v = 0, so the raw advantage is r (the tracker still learns,
    for the sampler)."""
    rows, state = _run(small_toy, tmp_path, "--offline_values", values, "--group_size", "4", "--baseline", "none",
                       "--rho", "constant", "--rho_constant", "0.75", "--loss", "gspo",
                       "--loss_agg", "seq_mean_token_mean", "--clip_low", "3e-4", "--clip_high", "4e-4")
    n_eff = state["tracker"]["alpha"] + state["tracker"]["beta"]
    assert set(np.round(n_eff, 9)) <= {8.0, 10.0, 11.5} and (np.round(n_eff, 9) != 8.0).sum() >= 4
    assert state["config"]["group_size"] == 4 and all(r["tracker/rho_mean"] == 0.75 for r in rows)
    assert all(r["advantage/mean"] == pytest.approx(r["reward/mean"]) for r in rows)


@pytest.mark.slow
def test_fixed_baseline_rho_none_with_cispo_and_token_sum(small_toy, values, tmp_path):
    """--baseline fixed: the tracker keeps the offline v0 (N_eff 8 everywhere after two steps); --rho none logs
    rho = 1, not rho_max = 0.96."""
    rows, state = _run(small_toy, tmp_path, "--offline_values", values, "--baseline", "fixed", "--rho", "none",
                       "--loss", "cispo", "--loss_agg", "token_sum", "--ppo_steps", "2")
    n_eff = state["tracker"]["alpha"] + state["tracker"]["beta"]
    np.testing.assert_allclose(n_eff, 8.0, rtol=1e-12)
    assert rows[0]["tracker/value_mean"] == rows[1]["tracker/value_mean"]
    assert all(r["tracker/rho_mean"] == 1.0 for r in rows)
    assert all(r["policy/rescored_sequences"] >= 16 for r in rows)  # ppo_steps 2: the batch's own no-grad pass


@pytest.mark.slow
def test_token_measure_centres_the_advantage_per_token(small_toy, tmp_path):
    """--adv_norm token (SPO++): the normalised advantage averages to 0 over the global batch's policy tokens (the
    measure the token-mean loss takes), with responses of different lengths; refused for a group estimator."""
    rows, _ = _run(small_toy, tmp_path, "--adv_norm", "token")
    for r in rows:
        assert abs(r["advantage/token_mean"]) < 1e-6 and r["response/length_max"] > r["response/length_mean"]
    assert json.loads((tmp_path / "config.json").read_text())["adv_norm"] == "token"


@pytest.mark.slow
def test_rloo_with_dynamic_sampling(small_toy, tmp_path):
    """RLOO's advantages sum to zero in every group (so over the batch); dynamic sampling logs generated >= used
    (whole rounds of 16), and the groups it used are informative unless its rounds ran out."""
    rows, _ = _run(small_toy, tmp_path, "--algo", "rloo", "--group_size", "4", "--dynamic_sampling")
    for r in rows:
        assert abs(r["advantage/mean"]) < 1e-9
        assert r["sampling/used"] == 16 and r["sampling/generated"] == 16 * r["sampling/rounds"]
        assert r["zero_signal/degenerate_groups"] == r["sampling/degenerate_used"]
        assert r["sampling/degenerate_used"] == 0.0 or r["sampling/rounds"] == 1 + variants.MAX_SAMPLING_ROUNDS


@pytest.mark.slow
def test_max_rl_with_sapo_four_steps(small_toy, tmp_path):
    """MaxRL's advantage and SAPO's loss, four steps on the toy: every metric finite, the policy moving exactly on the
    steps where some group carries signal; SAPO clips nothing."""
    ok(torchrun(2, *toy_args(small_toy, tmp_path, "--eval_every", "0", "--steps", "4", "--algo", "max_rl",
                             "--group_size", "4", "--loss", "sapo")))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(v) for r in rows for v in r.values())
    assert all(r["policy/clip_fraction"] == 0.0 for r in rows)
    # MaxRL gives an all-equal group (all 0 or all 1) no advantage: the policy moves exactly when some group has signal
    assert all((r["policy/grad_norm"] > 0) == (r["zero_signal/degenerate_groups"] < 1) for r in rows)
    assert any(r["zero_signal/degenerate_groups"] < 1 for r in rows)


@pytest.mark.slow
def test_dr_grpo_with_sequence_mean(small_toy, tmp_path):
    """Dr. GRPO: r - group mean with binary rewards lies in [-1, 1] and is never divided by a std."""
    rows, _ = _run(small_toy, tmp_path, "--algo", "dr_grpo", "--group_size", "4", "--loss_agg",
                   "seq_mean_token_mean")
    for r in rows:
        assert abs(r["advantage/mean"]) < 1e-9 and -1.0 <= r["advantage/p05"] <= r["advantage/p95"] <= 1.0
        assert r["sampling/generated"] == r["sampling/used"] == 16


@pytest.mark.slow
def test_reinforce_pp_whitens_the_rewards_over_the_global_batch(small_toy, tmp_path):
    """REINFORCE++ in its single-stream form (G = 1): raw A = r, no per-prompt baseline, then r is z-scored over
    the global batch of 64 (the small toy solves a few percent: a batch of 64 almost surely holds a success)."""
    rows, _ = _run(small_toy, tmp_path, "--algo", "reinforce_pp", "--group_size", "1", "--batch_size", "64")
    for r in rows:
        assert r["advantage/mean"] == pytest.approx(r["reward/mean"])
        whitened = math.sqrt(63 / 64) if 0 < r["reward/mean"] < 1 else 0.0  # unbiased std: population std below 1
        assert r["advantage/normalised_std"] == pytest.approx(whitened, rel=1e-5, abs=1e-9)
    assert any(0 < r["reward/mean"] < 1 for r in rows), "no success in 128 samples: the whitening went unchecked"
