"""The estimators and policy losses SPO is compared against, one flag away.

An ablation changes one thing: the baseline (GRPO, RLOO, Dr. GRPO, MaxRL: G consecutive responses per prompt), the
per-token policy loss (GSPO, CISPO, SAPO; PPO-clip itself, Eq. 10, is spo.ppo_clip_token_loss), the loss aggregation
(a sum over micro-batch pieces divided by a GLOBAL constant), a KL penalty to the initial policy, or which samples
are kept (DAPO's dynamic sampling, which counts the samples generated and used so that equal-budget comparisons stay
honest; group-free over-sampling, Appendix B, kept by rollout.Engine.generate). Each member is a small pure function
of explicit arguments that cites where its formula comes from, so that a fork can swap one part and trust the others
did not move. REINFORCE++'s whitening is spo.global_normalise applied to r; Batch SPO (`--group_size` with spo), the
fixed offline baseline and rho = 1 are SPO's own tracker with another setting, in spo.py's step 5.

Why here and not in spo.py: the default run reads SPO's step without these detours, and each variant is one
`if/elif` branch in spo.py's step 5 (advantages) or one entry in `make_loss` (losses). docs/variants.md's table
gives each flag's formula and source, and which combination reproduces the paper's SPO and GRPO runs:

    torchrun --nproc_per_node=2 spo.py --algo rloo --group_size 8 --dynamic_sampling --loss cispo
    torchrun --nproc_per_node=2 spo.py --algo spo --group_size 4            # Batch SPO (Appendix B)
"""
import argparse
import functools
import math
from types import SimpleNamespace

import numpy as np
import torch

from machinery.errors import check_ranges, fail
from machinery.collectives import all_gather_np, all_gather_objects
from reward import check_reward_flag

LOSSES = ("ppo_clip", "gspo", "cispo", "sapo")
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "token_sum")
GROUP_ALGOS = ("grpo", "rloo", "dr_grpo", "max_rl")  # need G >= 2 responses per prompt


def add_variant_flags(sampling, p):
    """The family's sampling flags (into `sampling`: steps 1-3) and policy-loss flags (into p; the estimator is
    spo.py's --algo and --baseline)."""
    p.add_argument("--loss", choices=LOSSES, default="ppo_clip",
                   help="policy loss: PPO-clip (Eq. 10), GSPO's sequence ratio, CISPO's clipped IS weight, SAPO's soft "
                        "gate")
    p.add_argument("--loss_agg", choices=AGGREGATIONS, default="token_mean",
                   help="token mean over the global mini-batch, mean over sequences of their token mean, or "
                        "token sum / (sequences x --max_response_len)")
    sampling.add_argument("--dynamic_sampling", action="store_true",
                          help="DAPO: drop groups whose rewards are all equal and refill (group estimators only)")
    sampling.add_argument("--oversample", type=float, default=1.0, help="start f x B trajectories, train on the "
                          "first B to finish, abort the rest (Appendix B; group estimators: whole groups); 1: off")
    # let the rest finish, to log the kept vs aborted lengths and rewards (docs/variants.md)
    sampling.add_argument("--oversample_measure", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tis", type=float, default=0.0,
                   help="truncated importance sampling against the engine/trainer mismatch: each token's loss times "
                        "min(pi_trainer / pi_engine, C) (verl's, OpenRLHF's form); 0: off (the paper)")
    p.add_argument("--kl_coef", type=float, default=0.0, help="a KL penalty to the initial policy, this times its "
                   "token mean added to the loss (TRL's beta); 0: off, no reference kept (the paper)")
    p.add_argument("--kl_estimator", choices=KL_ESTIMATORS, default="k3", help="the penalty's per-token estimate of "
                   "KL(pi || pi_ref): k1 log-ratio, k2 its square / 2, k3 e^l - 1 - l (TRL's, verl's low_var_kl)")


MAX_SAMPLING_ROUNDS = 4  # DAPO's refill rounds at most; then all-equal groups fill the batch


def check_flags(flags, world):
    """One clear line, printed once, for a flag out of range or a combination that has no meaning, before anything
    heavy starts: the batch must split into whole groups per rank and whole mini-batches, and each variant's
    flags must fit its estimator. flags: spo.py's flag values by name (a dict: every flag is checked)."""
    check_ranges(flags)  # each flag within its own range (machinery/errors.py)
    f = SimpleNamespace(**flags)  # each flag by its own name
    if f.batch_size % (world * f.group_size):
        fail(f"--batch_size {f.batch_size} must be a multiple of world size x group size ({world} x "
             f"{f.group_size}) so that every rank gets whole groups", once=True)
    if (f.batch_size // world) % f.ppo_steps:
        fail(f"--ppo_steps {f.ppo_steps} must divide the per-rank batch {f.batch_size // world}", once=True)
    if f.algo in GROUP_ALGOS and f.group_size < 2:
        fail(f"--group_size must be at least 2 for {f.algo}", once=True)
    if f.algo != "spo" and f.baseline != "tracker":
        fail(f"--baseline {f.baseline} is an SPO option; {f.algo} has its own baseline", once=True)
    # --offline_values auto is silently unused by the estimators without a tracker; asked for by name, it is an error
    offline_given = "offline_values" in flags.get("given", ()) or f.offline_values != "auto"
    if f.algo != "spo" and offline_given and f.offline_values != "none":
        fail(f"--offline_values initialises SPO's value tracker; {f.algo} has none (it would be ignored)", once=True)
    if f.baseline == "fixed" and (f.offline_values == "none" or (f.offline_values == "auto" and f.train)):
        fail("--baseline fixed keeps the offline values v0 forever; it needs --offline_values", once=True)
    if not f.oversample >= 1 or (f.oversample > 1 and f.dynamic_sampling):
        fail(f"--oversample must be at least 1 (1: off) and cannot be combined with --dynamic_sampling, got "
             f"{f.oversample}", once=True)
    if f.adv_norm != "trajectory" and f.algo not in ("spo", "reinforce_pp"):
        fail(f"--adv_norm {f.adv_norm} sets Eq. 9's batch normalisation; --algo {f.algo} normalises within "
             f"each group instead", once=True)
    if f.probe_every and f.algo != "spo":
        fail(f"--probe_every measures SPO's value tracker; --algo {f.algo} has none", once=True)
    if f.dynamic_sampling and (f.algo == "spo" or f.group_size < 2):
        fail(f"--dynamic_sampling drops groups whose rewards are all equal; it needs a group estimator with "
             f"--group_size >= 2 (got --algo {f.algo}, --group_size {f.group_size})", once=True)
    check_reward_flag(f.reward, f.reward_timeout)  # resolved now, not at the first reward


# ------------------------------------------------------------------------------------------------ group baselines
def grpo_advantage(reward, group_size, eps=1e-6):
    """GRPO (Shao et al. 2024, DeepSeekMath): z-score within each group of G consecutive responses to one
    prompt, (r - mean) / (std + eps), with the unbiased std (as verl)."""
    r = reward.reshape(-1, group_size)  # (B/G, G)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + eps)).reshape(-1)


def rloo_advantage(reward, group_size):
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): r_i minus the mean of the OTHER G - 1 rewards of its
    group. The baseline does not contain r_i, so it is unbiased; the advantages of a group sum to zero."""
    r = reward.reshape(-1, group_size)  # (B/G, G)
    others = (r.sum(1, keepdims=True) - r) / (group_size - 1)
    return (r - others).reshape(-1)


def dr_grpo_advantage(reward, group_size):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): r - group mean, NOT divided by the
    group's std (which up-weights prompts that are almost always or almost never solved)."""
    r = reward.reshape(-1, group_size)  # (B/G, G)
    return (r - r.mean(1, keepdims=True)).reshape(-1)


def max_rl_advantage(reward, group_size, eps=1e-6):
    """MaxRL (Tajwar et al. 2026, "Maximum Likelihood Reinforcement Learning", arXiv 2602.02710; TRL's MaxRLTrainer,
    prime-rl): (r - mean_G) / mean_G within each group. With binary rewards a success's weight is 1/p_hat - 1, so
    the expected gradient follows log p(x), not p(x): hard prompts weigh more. A group without a success gets 0
    (its numerator is 0; eps only keeps the division finite)."""
    r = reward.reshape(-1, group_size)  # (B/G, G)
    mean = r.mean(1, keepdims=True)
    return ((r - mean) / (mean + eps)).reshape(-1)


GROUP_BASELINES = {"grpo": grpo_advantage, "rloo": rloo_advantage, "dr_grpo": dr_grpo_advantage,
                   "max_rl": max_rl_advantage}


# ------------------------------------------------------------------------------------------------ policy losses
# Each returns the (B, T) per-token loss and the (B, T) tokens where a clip bound decided; logprobs, old_logprobs,
# mask: (B, T); advantage: (B,). Masked positions may hold anything: the aggregation multiplies by the mask.
def gspo_token_loss(logprobs, old_logprobs, advantage, mask, clip_low, clip_high):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per SEQUENCE, the
    geometric mean of its token ratios, s = exp(mean over the response's tokens of (log pi - log pi_old)), clipped
    at the sequence level: loss = max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high)). The sequence's loss is given
    to each of its tokens, so --loss_agg seq_mean_token_mean gives GSPO's own mean over sequences."""
    n = mask.sum(1).clamp(min=1)  # (B,) policy tokens per sequence; an idle dummy row has none
    seq_ratio = torch.exp(((logprobs - old_logprobs) * mask).sum(1) / n)  # (B,)
    unclipped = -advantage * seq_ratio
    clipped = -advantage * torch.clamp(seq_ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)  # (B,)
    return loss[:, None].expand_as(mask), (clipped > unclipped)[:, None].expand_as(mask)


def cispo_token_loss(logprobs, old_logprobs, advantage, mask, clip_low, clip_high):
    """CISPO (MiniMax 2025, the MiniMax-M1 report): REINFORCE with a clipped importance weight under stop-gradient,
    loss = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * log pi. Unlike PPO-clip no token loses its
    gradient: the weight is capped, not the update (MiniMax-M1 sets no lower bound: --clip_low 1)."""
    ratio = torch.exp((logprobs - old_logprobs) * mask)  # (B, T); masked tokens: ratio 1
    weight = torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach()
    clipped = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
    logprobs = torch.where(mask > 0, logprobs, torch.zeros_like(logprobs))  # masked positions may hold anything
    return -weight * advantage[:, None] * logprobs, clipped


SAPO_TAU = (1.0, 1.05)  # SAPO's gate temperatures for A > 0 and A < 0: the paper's, TRL's and verl's defaults


def sapo_token_loss(logprobs, old_logprobs, advantage, mask, clip_low, clip_high, tau=SAPO_TAU):
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347; TRL's loss_type="sapo"): the
    hard clip replaced by a soft gate, loss = -A (4 / tau) sigmoid(tau (ratio - 1)), tau = tau_pos where A > 0,
    tau_neg where A < 0. At ratio 1 its gradient is exactly the policy gradient's (d/d ratio = A); off-policy it
    fades smoothly instead of stopping. Nothing is clipped (clip_low, clip_high unused; `clipped` is all False)."""
    adv = advantage[:, None]  # (B, 1)
    ratio = torch.exp((logprobs - old_logprobs) * mask)  # (B, T); masked tokens: ratio 1
    t = torch.where(adv > 0, tau[0], tau[1])  # (B, 1)
    return -adv * (4 / t) * torch.sigmoid(t * (ratio - 1)), torch.zeros_like(mask, dtype=torch.bool)


def kl_to_reference(logprobs, ref_logprobs, estimator):
    """--kl_coef's per-token estimate of KL(pi || pi_ref) from l = log pi_ref(y) - log pi(y) (Schulman 2020,
    "Approximating KL Divergence"; unbiased for y sampled from pi: the tokens come from the engine's pi_old, the
    same policy with one optimiser step, nearly so after more): k1 = -l (unbiased, often negative), k2 = l^2 / 2
    (biased, low variance), k3 = e^l - 1 - l (unbiased, never negative; TRL's beta term, verl's "low_var_kl",
    OpenRLHF's "k3"). As a loss their gradients are another matter (Tang & Munos 2025): k1's is 0 in expectation,
    k2's is the reverse KL's, k3's the forward KL's. verl clamps k3 to [-10, 10]; TRL and OpenRLHF do not, nor here.
    logprobs, ref_logprobs: (B, T); masked positions may hold anything (the caller multiplies by the mask)."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return log_ratio ** 2 / 2
    return torch.exp(log_ratio) - 1 - log_ratio


# ------------------------------------------------------------------------------------------------ aggregations
# A loss is computed per micro-batch and summed over micro-batches and ranks (trainer.ppo_update), so each
# aggregation is a sum over this piece's sequences divided by a constant of the GLOBAL mini-batch.
def token_mean(token_loss, mask, n_tokens):
    """Every policy token of the global mini-batch weighs the same (DAPO; SPO's authors): sum / n_tokens."""
    return (token_loss * mask).sum() / n_tokens


def seq_mean_token_mean(token_loss, mask, n_sequences):
    """Each sequence's token mean, averaged over the n_sequences of the global mini-batch (GRPO's original
    1/G sum_i 1/|y_i| sum_t): a short response's tokens weigh more than a long one's."""
    return ((token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n_sequences


def token_sum(token_loss, mask, constant):
    """Dr. GRPO: the token sum divided by a constant that depends on no response's length (here the global
    mini-batch's sequences x the response budget), so length does not rescale a sequence's gradient."""
    return (token_loss * mask).sum() / constant


def policy_loss(logprobs, old_logprobs, advantage, mask, n_tokens, weights=1.0, *, token_loss, aggregation,
                n_sequences, max_len):
    """The loss_fn trainer.ppo_update calls, per micro-batch: a per-token loss (times `weights`, --tis), then the
    aggregation. Returns (loss, clipped) like spo.ppo_clip_loss (with ppo_clip and token_mean it computes exactly
    that)."""
    loss, clipped = token_loss(logprobs, old_logprobs, advantage, mask)
    loss = loss * weights
    if aggregation == "token_mean":
        return token_mean(loss, mask, n_tokens), clipped
    if aggregation == "seq_mean_token_mean":
        return seq_mean_token_mean(loss, mask, n_sequences), clipped
    return token_sum(loss, mask, n_sequences * max_len), clipped


def make_loss(loss, aggregation, ppo_clip_token_loss, *, clip_low, clip_high, dual_clip, n_sequences, max_len):
    """loss_fn(logprobs, old_logprobs, advantage, mask, n_tokens) for --loss and --loss_agg. n_sequences: the
    global mini-batch (batch_size // ppo_steps); max_len: the response budget (token_sum's constant)."""
    token_loss = {"ppo_clip": functools.partial(ppo_clip_token_loss, dual_clip=dual_clip),
                  "gspo": gspo_token_loss, "cispo": cispo_token_loss, "sapo": sapo_token_loss}[loss]
    return functools.partial(policy_loss, token_loss=functools.partial(token_loss, clip_low=clip_low,
                                                                       clip_high=clip_high),
                             aggregation=aggregation, n_sequences=n_sequences, max_len=max_len)


# ------------------------------------------------------------------------------------------------ dynamic sampling
def select_groups(group_rewards, n_groups):
    """DAPO's filter (Yu et al. 2025, section 3.2, "dynamic sampling"): the first n_groups groups, in generation order,
    whose rewards are not all equal; if too few, the earliest all-equal groups fill the rest (they carry no
    signal but keep every step's batch the same size). group_rewards: (N, G). Returns (indices (n_groups,),
    how many of them are all-equal)."""
    r = np.asarray(group_rewards)
    informative = r.min(1) != r.max(1)  # (N,)
    order = np.concatenate([np.flatnonzero(informative), np.flatnonzero(~informative)])
    chosen = order[:n_groups]
    return chosen, int((~informative[chosen]).sum())


def dynamic_sampling(first, more, group, max_rounds, rank, world, gather):
    """Keep B/G groups that carry signal. first: this rank's (prompt indices, rollouts, rewards) of the step's
    batch; more(k): the same for generation round k >= 1 (every rank calls it as often: the decision is taken on
    gathered rewards); gather: all_gather_objects. Every rank gathers every group, rollouts included (a kept group
    may move to another rank, so that each rank still gets whole groups), and takes its slice of the same
    selection. Returns this rank's (indices, rollouts, rewards) and the sampling metrics (generated vs used)."""
    n_local = len(first[0]) // group  # groups per rank
    n_groups = n_local * world
    pool, batch, rounds = [], first, 1  # pool: (indices, rollouts, rewards) per group, all ranks, in order
    while True:
        index, rollouts, reward = batch
        pool += gather([(index[k * group:(k + 1) * group], rollouts[k * group:(k + 1) * group],
                         reward[k * group:(k + 1) * group]) for k in range(n_local)])
        group_rewards = np.array([np.asarray(g[2], dtype=np.float64) for g in pool])  # (N, G)
        chosen, degenerate = select_groups(group_rewards, n_groups)
        if degenerate == 0 or rounds > max_rounds:
            break
        batch = more(rounds)
        rounds += 1
    mine = [pool[i] for i in chosen[rank * n_local:(rank + 1) * n_local]]
    all_equal = group_rewards.min(1) == group_rewards.max(1)
    metrics = {"sampling/generated": len(pool) * group, "sampling/used": n_groups * group,
               "sampling/rounds": rounds, "sampling/degenerate_generated": float(all_equal.mean()),
               "sampling/degenerate_used": degenerate / n_groups}
    return (np.concatenate([g[0] for g in mine]), [r for g in mine for r in g[1]],
            np.concatenate([np.asarray(g[2]) for g in mine]), metrics)


def first_finished(rollouts, keep, group_size=1):
    """(N,) bool: the trajectories of the first keep / G groups of G consecutive rollouts to finish, by finish_order
    (None or -1: aborted); what generate(keep_first=keep) keeps, computed after the fact from a generate that let
    every trajectory finish (over-sampling's measurement mode)."""
    order = np.array([r.finish_order if r is not None and r.finish_order >= 0 else np.inf for r in rollouts])
    order = order.reshape(-1, group_size).max(1)  # (N / G,): a group finishes with its last member
    kept = np.zeros(len(order), dtype=bool)
    first = np.argsort(order, kind="stable")[: keep // group_size]
    kept[first] = np.isfinite(order[first])
    return np.repeat(kept, group_size)


def started_per_rank(batch_size, world, group, oversample):
    """Trajectories each rank starts in steps 1-3: B / world, or f times that in whole groups (Appendix B)."""
    return math.ceil(oversample * (batch_size // world) / group) * group


class Resampling:
    """What steps 1-3 start and keep under Appendix B's over-sampling (--oversample f: f x B trajectories started,
    the first B to finish kept, the rest aborted; --oversample_measure: all let finish, to log kept against
    aborted) or DAPO's dynamic sampling (refill rounds until B/G groups carry signal), and the state over-sampling
    carries: each prompt's draws and trainings over the run (a slow prompt is aborted more often)."""

    def __init__(self, batch_size, world, group, oversample, measure, dynamic, n_prompts):
        self.local, self.group, self.dynamic = batch_size // world, group, dynamic
        self.started = started_per_rank(batch_size, world, group, oversample)  # steps 1-3's slots per rank
        self.oversampled = self.started > self.local
        self.keep_first = self.local if self.oversampled and not measure else None  # the engine aborts the rest
        self.on = self.oversampled or dynamic
        self.drawn, self.kept = np.zeros(n_prompts, np.int64), np.zeros(n_prompts, np.int64)

    def __call__(self, first, sample, *, rank, world, max_rounds=MAX_SAMPLING_ROUNDS):
        """What the loop trains on. first: steps 1-3's (this rank's prompt indices, rollouts, rewards); sample(k):
        steps 1-3 again for DAPO's refill round k. Returns this rank's (indices, rollouts, rewards) and the
        sampling metrics (generated vs used)."""
        batch, metrics = self.keep(*first)
        sampling = {"sampling/generated": self.started * world, "sampling/used": self.local * world, **metrics}
        if self.dynamic:  # DAPO: drop the groups whose rewards are all equal, refill
            *batch, sampling = dynamic_sampling(batch, lambda k: self.keep(*sample(k))[0], self.group, max_rounds,
                                                rank, world, all_gather_objects)
        return (*batch, sampling)

    def keep(self, mine, rollouts, reward):
        if not self.oversampled:
            return (mine, rollouts, reward), {}
        kept = first_finished(rollouts, self.local, self.group)
        return (mine[kept], [r for r, k in zip(rollouts, kept) if k], reward[kept]), self.metrics(rollouts, reward,
                                                                                                  kept, mine)

    def metrics(self, rollouts, reward, kept, index):
        """Kept against aborted trajectories (keeping the first to finish keeps the short ones), and the reach."""
        finished = np.array([r is not None for r in rollouts], dtype=np.float64)
        lengths = np.array([len(r.response_ids) if r is not None else np.nan for r in rollouts])
        kept, finished, lengths, reward, index = (all_gather_np(np.asarray(x, dtype=np.float64))
                                                  for x in (kept, finished, lengths, reward, index))
        k, aborted = kept > 0, (kept == 0) & (finished > 0)
        m = {"oversample/kept_share": k.mean(), "oversample/kept_length_mean": lengths[k].mean(),
             "oversample/kept_reward_mean": reward[k].mean(), "oversample/aborted_finished": aborted.sum(),
             **self.reach(index.astype(np.int64), index[k].astype(np.int64))}
        if aborted.any():
            m.update({"oversample/aborted_length_mean": lengths[aborted].mean(),
                      "oversample/aborted_reward_mean": reward[aborted].mean()})
        return {key: float(v) for key, v in m.items()}

    def reach(self, drawn, kept):
        """The run's count of draws and trainings per prompt, after this step's (drawn, kept prompt indices)."""
        np.add.at(self.drawn, drawn, 1)
        np.add.at(self.kept, kept, 1)
        seen = self.drawn > 0
        return {"oversample/prompts_drawn": seen.sum(),
                "oversample/never_trained_share": (seen & (self.kept == 0)).sum() / max(seen.sum(), 1)}

    def state_dict(self):
        return {"drawn": self.drawn.copy(), "kept": self.kept.copy()}

    def load_state_dict(self, state):
        if state is not None:  # None: a checkpoint made without --oversample
            self.drawn, self.kept = np.array(state["drawn"], np.int64), np.array(state["kept"], np.int64)
