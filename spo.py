"""Single-stream Policy Optimization (SPO, Xu & Ding, ICLR 2026): the training program and the algorithm's math.

SPO trains an LLM on verifiable rewards r(x, y) in {0, 1} with ONE response per prompt; its baseline is not GRPO's
group mean but a persistent per-prompt value tracker v(x) (tracker.py). Algorithm 1's step, as `main` runs it:
  1. draw B prompts, favouring those whose outcome is uncertain (Eq. 11; sampler.py);
  2. one response per prompt from the colocated engine (rollout.py; GRPO draws B/G prompts and G responses each);
  3. the reward r of each response (reward.py);
  4. old log-probs, one no-grad pass: of revisited prompts' previous responses (D(x)) and PPO's of the batch;
  5. A = r - v(x) with the value read BEFORE this reward (Eq. 8), normalised over the global batch (Eq. 9); D(x)
     sets the forgetting factor rho(x), the tracker absorbs r (Eq. 5), the sampler's weights follow;
  6. PPO-clip with clip-higher and dual-clip (Eq. 10), a token mean over the global mini-batch (with one optimiser
     step its forward gives the batch's old log-probs); this response remembered for D(x); 7. the weight push.
The math is the small pure functions below, each the one that runs; GRPO and its relatives are one flag away
(variants.py: one branch in step 5, one loss in step 6); machinery/ holds the FSDP2 trainer and the rest. The loop
marks where Algorithm 1 ends and the bookkeeping (metrics, evaluations, checkpoints) begins.

    torchrun --nproc_per_node=2 spo.py                                        # the toy (--algo grpo, --tools, ...)
    torchrun --nproc_per_node=8 spo.py --model Qwen/Qwen3-8B --train dapo.parquet ...      (docs/scale.md)
"""
import argparse
import contextlib
import functools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

import variants
from machinery import checkpoint, memory, resume, trainer, untrusted
from machinery.collectives import all_gather_np, all_gather_objects, all_reduce_np
from machinery.device import start_program, use_bf16
from machinery.data import check_context, find_model, load_tokenizer, load_train_and_test
from machinery.metrics import Logger, plot_run, run_summary, spo_metrics, step_metrics
from machinery.run_dir import check_disk, open_run_dir
from machinery.trackers import add_logging_flags, check_trackers
from offline_values import TrainingV0, add_v0_flags, check_values_header, claim_toy_values, init_tracker
from reward import BUILT_IN, add_reward_flags, rewards
from hf_engine import add_engine_flags, start_engine
from rollout import TOOL_INSTRUCTION, add_budget_flag, add_tool_flags, make_tools, response_budget, step_seeds
from probes import ProbeSettings, add_eval_flags, evaluations, exact_metric, exact_template
from sampler import PromptSampler, priority_weights
from tasks import thinking, toy
from tracker import ValueTracker

# D_half per divergence measure: the authors' 0.06 for mean |l|; k3's agrees with it mid-window (docs/algorithm.md)
D_HALF = {"abs": 0.06, "k3": 3.0e-4}
DUAL_CLIP = 10.0  # Eq. 10's dual-clip bound c, the authors'
WEIGHT_DECAY = 0.01  # AdamW's (torch's default), the authors'
MAX_NONFINITE = 3  # consecutive steps with a non-finite loss before the run stops with one line


# ------------------------------------------------------------------------------------------------ the math
def spo_advantage(reward, value):
    """Eq. 8: A = r - v_{-1}(x). The value is read before this reward is absorbed: keeps the gradient unbiased."""
    return reward - value


def global_normalise(advantage, eps=1e-8, all_reduce=all_reduce_np, weight=None):
    """Eq. 9: (A - mean) / std over the GLOBAL batch (unbiased std, as the authors): `all_reduce` sums this
    rank's weighted (sum, sum of squares, count, count^2) over all ranks (identity for a world of one).
    weight (B,): --adv_norm token (SPO++'s token measure): each trajectory counts once per loss token, so the
    advantage is centred under the token mean the loss takes; the trajectory mean is not, once lengths differ."""
    weight = np.ones_like(advantage) if weight is None else np.asarray(weight, advantage.dtype)  # (B,)
    total, total_sq, n, n_sq = all_reduce([(weight * advantage).sum(), (weight * advantage ** 2).sum(), weight.sum(),
                                           (weight ** 2).sum()])
    mean = total / n
    dof = n - n_sq / n  # weighted Bessel correction: n - 1 for unit weights, so equal lengths give the paper's form
    std = max((total_sq - n * mean ** 2) / (dof if dof > 0 else 1.0), 0.0) ** 0.5
    return (advantage - mean) / (std + eps)


@dataclass
class PreviousResponse:
    """SPO's memory of a prompt: its latest response and the log-probs that the acting policy (the one that
    sampled it) gave it. At the next visit D(x) compares those log-probs with the current policy's."""
    response_ids: np.ndarray  # (T,) int32 token ids
    logprobs: np.ndarray  # (T,) float32: the acting policy's log-probs (that step's PPO old log-probs)
    mask: np.ndarray  # (T,) int8: 1 on tokens the policy generated, 0 on tool output

    @classmethod
    def of(cls, rollout, logprobs):
        """From a rollout.Rollout and the trainer's old log-probs of it, stored compactly."""
        return cls(np.asarray(rollout.response_ids, np.int32), np.asarray(logprobs, np.float32),
                   np.asarray(rollout.response_mask, np.int8))


def divergence(now, then, estimator="abs"):
    """D(x) for Eq. 5, from l = log pi_now(y_k) - log pi_then(y_k) over a response's policy tokens:
    "abs": mean |l|, the authors' measure (the scale their D_half and clip window were tuned for);
    "k3": mean of e^l - 1 - l: for y sampled from pi_then an unbiased, non-negative estimate of
    KL(pi_then || pi_now) per token (about l^2 / 2 for small l). No tokens: 0 (rho = rho_max)."""
    log_ratio = np.asarray(now) - np.asarray(then)  # (T,) in the log-probs' own precision (float32 here)
    if not log_ratio.size:
        return 0.0
    if estimator == "abs":
        return float(np.mean(np.abs(log_ratio)))
    if estimator == "k3":
        return float(np.mean(np.expm1(log_ratio) - log_ratio))
    raise ValueError(f"divergence: estimator must be 'abs' or 'k3', got {estimator!r}")


def remember(previous, index, responses, all_gather=all_gather_objects):
    """previous[i] = the latest PreviousResponse of prompt i, for the global batch's prompt indices: `all_gather`
    concatenates every rank's responses in rank order (a prompt may land on any rank next time). For a prompt drawn
    twice in one batch the later response wins."""
    for i, response in zip(index, all_gather(responses)):
        previous[int(i)] = response


def ppo_clip_loss(logprobs, old_logprobs, advantage, mask, clip_low, clip_high, dual_clip, n_tokens, weights=1.0):
    """Eq. 10: PPO-clip with clip-higher and dual-clip, summed over masked tokens and divided by n_tokens (the
    policy tokens of the global mini-batch: a token mean over all ranks). Per token, with ratio = pi / pi_old and
    A the trajectory's advantage (broadcast to its tokens):
        loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))          (the pessimistic bound)
        and for A < 0 also at most -A * dual_clip: a huge ratio cannot blow up the loss (dual-clip).
    logprobs, old_logprobs, mask: (B, T); advantage: (B,); weights: 1, or (B, T) per-token factors (--tis, not the
    paper's). Returns (loss, clipped): clipped (B, T) is True where the clip range decided (zero gradient there)."""
    loss, clipped = ppo_clip_token_loss(logprobs, old_logprobs, advantage, mask, clip_low=clip_low,
                                         clip_high=clip_high, dual_clip=dual_clip)
    return (loss * mask * weights).sum() / n_tokens, clipped


def ppo_clip_token_loss(logprobs, old_logprobs, advantage, mask, clip_low, clip_high, dual_clip):
    """Eq. 10 per token, before aggregation: the (B, T) loss and clipped mask of ppo_clip_loss (variants.py
    aggregates it otherwise with --loss_agg)."""
    adv = advantage[:, None]  # (B, 1)
    ratio = torch.exp((logprobs - old_logprobs) * mask)  # (B, T); masked tokens: ratio 1
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
    return loss, loss_clipped > loss_unclipped


# ------------------------------------------------------------------------------------------------ the step loop
@contextlib.contextmanager
def timed(seconds, phase):
    """seconds[phase] += the block's wall time (a phase may run several times in a step: DAPO's refill rounds)."""
    t0 = time.time()
    yield
    seconds[phase] = seconds.get(phase, 0.0) + time.time() - t0


def main(argv=None):
    args, run = start(parse_args(argv))  # every flag final from here on; what the set-up built (Run)
    rank, world, data, group, resampling = run.rank, run.world, run.data, args.group_size, run.resampling
    logger = Logger(args.run_dir, vars(args), rank == 0, args.report_to, run.start_step or None)  # resumed: its step
    logger.console(f"{len(data.keys)} training prompts, {len(run.test.keys) if run.test else 0} held-out, {world} "
                   f"ranks on {run.device.type}; run directory {args.run_dir}")
    # Step 6's loss: Eq. 10 (PPO-clip, token mean over the global mini-batch); --loss / --loss_agg swap in another
    loss_fn = functools.partial(ppo_clip_loss, clip_low=args.clip_low, clip_high=args.clip_high, dual_clip=DUAL_CLIP)
    if (args.loss, args.loss_agg) != ("ppo_clip", "token_mean"):
        loss_fn = variants.make_loss(args.loss, args.loss_agg, ppo_clip_token_loss, clip_low=args.clip_low,
                                     clip_high=args.clip_high, dual_clip=DUAL_CLIP,
                                     n_sequences=args.batch_size // args.ppo_steps, max_len=args.max_response_len)
    kl = None  # --kl_coef: a penalty to the initial policy, the coefficient times a per-token KL estimate
    if args.kl_coef:
        kl = (args.kl_coef, functools.partial(variants.kl_to_reference, estimator=args.kl_estimator))
    exact = exact_metric(run.policy, run.tokenizer, args.eval_reference, args.micro_batch_size,
                         args.max_tokens_per_micro_batch)  # the exact success probability, where one is known
    evaluate = functools.partial(evaluations, run.engine, run.test, data, run.tracker, tools=run.tools, exact=exact,
                                 settings=ProbeSettings.pick(vars(args)))  # held-out accuracy, the probe: when due
    passes = dict(temperature=args.temperature, micro_batch_size=args.micro_batch_size,
                  max_tokens=args.max_tokens_per_micro_batch)  # the trainer's forward passes (steps 4 and 6)

    def sample(step, times, round_=0):
        """Steps 1-3 for this rank's slots (round_ > 0: DAPO's refill): (prompt indices, rollouts, rewards)."""
        n = resampling.started  # B / world; more under --oversample
        seeds = step_seeds(args.seed, step, rank, n, round_)
        with timed(times, "generate"):
            # 1. B prompts (Eq. 11): every rank draws the same batch and takes its slots (GRPO: B/G prompts, G each)
            prompts = np.repeat(run.sampler.draw(n * world // group), group)
            mine = prompts[rank * n: (rank + 1) * n]
            # 2. one response per slot from the engine (--oversample: the first to finish, the rest aborted, None)
            rollouts = run.engine.generate([data.prompt_ids[i] for i in mine], seeds, max_tokens=args.max_response_len,
                                           tools=run.tools, group_size=group, keep_first=resampling.keep_first)
        with timed(times, "score"):  # 3. the verifier's reward of each response (NaN where aborted)
            reward = rewards(rollouts, [data.answers[i] for i in mine], think_format=args.think_format,
                             truncated_reward=args.truncated_reward, reward=args.reward, timeout_s=args.reward_timeout)
        return mine, rollouts, reward

    started_at, nonfinite, on_gpu = time.time(), 0, run.device.type == "cuda"
    if run.start_step == 0 and (before := evaluate(step=0)):
        logger.log(0, before)
    for step in logger.progress(range(run.start_step + 1, args.steps + 1), total=args.steps, initial=run.start_step):
        t = {}  # each phase's seconds
        mine, rollouts, reward = sample(step, t)  # steps 1-3
        sampling = {"sampling/generated": args.batch_size, "sampling/used": args.batch_size}
        if resampling.on:  # Appendix B: the first B to finish kept; DAPO: groups of equal rewards refilled
            mine, rollouts, reward, sampling = resampling((mine, rollouts, reward), functools.partial(sample, step, t),
                                                          rank=rank, world=world)
        run.engine.sleep()
        # 4. old log-probs, one no-grad pass: SPO's revisited prompts' (D(x)); the batch's unless step 6 gives them
        revisited = [(slot, run.previous[i]) for slot, i in enumerate(mine) if i in run.previous and slot % group == 0]
        with timed(t, "old_logprobs"):
            old = trainer.old_logprobs(run.policy, [] if trainer.reuses_forward(args.ppo_steps, args.tis) else rollouts,
                                       [(data.prompt_ids[mine[slot]], p.response_ids, p.mask) for slot, p in revisited],
                                       **passes)
        # 5. advantages and the state each algorithm carries to the next step (--adv_norm token: Eq. 9 per token)
        norm_weight = [sum(r.response_mask) for r in rollouts] if args.adv_norm == "token" else None
        if args.algo == "spo":
            value = run.tracker.value_at(mine) if args.baseline != "none" else np.zeros(len(mine))  # v_{-1}(x)
            raw_advantage = spo_advantage(reward, value)  # Eq. 8, before the tracker absorbs r
            advantage = global_normalise(raw_advantage, weight=norm_weight)  # Eq. 9
            divergences, revisit = np.zeros(len(mine)), np.zeros(len(mine))  # D(x) per slot; 0 on a first visit
            for (slot, prev), now in zip(revisited, old["revisited"]):  # a prompt's G slots share D(x), one rho
                divergences[slot: slot + group] = divergence(now[prev.mask > 0], prev.logprobs[prev.mask > 0],
                                                             args.divergence)
                revisit[slot: slot + group] = 1.0
            batch_index, batch_reward, batch_divergences, batch_revisit, batch_raw_advantage = all_gather_np(
                mine, reward, divergences, revisit, raw_advantage)  # the global batch's, in one collective
            rho = run.tracker.rho(batch_divergences)  # Eq. 5: 2^(-D / D_half), clipped
            if args.baseline != "fixed":  # the fixed baseline keeps v0 forever (the A*-PO-like ablation)
                run.tracker.update(batch_index, batch_reward, rho)  # Eq. 5: every rank applies the same update, once
            if args.sampler == "prioritized":  # Eq. 11 for the prompts whose value just changed
                uniq = np.unique(batch_index)
                run.sampler.set_weights(priority_weights(run.tracker.value_at(uniq), run.tracker.n_eff_at(uniq),
                                                         args.sampling_eps, args.sampling_gamma), uniq)
            shown = {"value": value, "rho": rho[rank * len(mine):], "divergence": divergences}  # in samples.jsonl
        elif args.algo == "reinforce_pp":  # REINFORCE++: no per-prompt baseline, r whitened over the global batch
            raw_advantage, advantage, shown = reward, global_normalise(reward, weight=norm_weight), {}
        else:  # the group baselines (variants.py): GRPO's z-score, RLOO's leave-one-out mean, Dr. GRPO's mean
            raw_advantage = advantage = variants.GROUP_BASELINES[args.algo](reward, group)
            shown = {}  # (all-equal groups: in step_metrics, for every estimator with groups)
        # 6. PPO-clip (Eq. 10; or --loss, --loss_agg), `ppo_steps` optimiser steps over the global batch; acting:
        # the batch's log-probs under the policy that sampled it (step 4's, or with one optimiser step its forward's)
        with timed(t, "update"):
            stats, acting = trainer.update(run.policy, run.optimizer, rollouts, old, advantage, loss_fn=loss_fn,
                                           check=step == run.start_step + 1, ppo_steps=args.ppo_steps,
                                           lr=trainer.scheduled_lr(step, args.lr, args.warmup_steps, args.lr_schedule,
                                                                   args.steps), grad_clip=args.grad_clip, tis=args.tis,
                                           reference=run.reference, kl=kl, **passes)
        if args.algo == "spo":  # for D(x) at the next visit
            remember(run.previous, batch_index,
                     [PreviousResponse.of(r, logprobs) for r, logprobs in zip(rollouts, acting["batch"])])
        # 7. weight push: the next rollouts come from the updated policy
        with timed(t, "weight_push"):
            run.engine.push_weights(run.policy)  # gathered whole in the engine's dtype (bf16 with --bf16 on)
        # ---- Algorithm 1 ends here: what follows records the step (metrics, evaluations, checkpoints)
        nonfinite = nonfinite + 1 if stats["nonfinite"] else 0
        if nonfinite >= MAX_NONFINITE:
            raise SystemExit(f"error: {nonfinite} consecutive steps with a non-finite loss at step {step}; "
                             f"lower --lr or check the data (metrics in {args.run_dir}/metrics.jsonl)")
        metrics = {**step_metrics(reward, raw_advantage, advantage, rollouts, acting, stats=stats, times=t, group=group,
                                  tools=run.tools is not None), **sampling, **memory.peak_metrics(on_gpu)}
        if args.algo == "spo":  # SPO's own: zero-signal samples (Fig. 3a), the tracker, D(x) and rho
            metrics.update(spo_metrics(batch_raw_advantage, run.tracker, batch_divergences, rho, batch_revisit > 0))
        metrics.update(evaluate(step=step))
        logger.log(step, metrics, console=(step % args.log_every == 0 or step == args.steps))
        logger.samples(step, run.tokenizer.decode, [data.prompt_ids[i] for i in mine], rollouts,
                       {"reward": reward, "advantage": raw_advantage, **shown})  # a few generations to read
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            run.save(args.run_dir, step, vars(args), export_dtype=torch.bfloat16 if on_gpu else None)
    logger.close()
    run.close()  # the sandbox workers and the engine, which also tears down the process group
    if rank == 0:  # the last line: held-out before and after (the default run: beside the README's range), what next
        default_run = run.on_toy and not set(args.given) - {"run_dir", "seed"}
        print(run_summary(args.run_dir, plot_run(args.run_dir), time.time() - started_at,
                          toy.DEFAULT_RUN_RANGE if default_run else None, args.test), flush=True)


# ------------------------------------------------------------------------------------------------ set-up
def parse_args(argv=None):
    """The flags in the paper's order; a preset's defaults, and what the algorithm alone decides (start: the rest)."""
    p = argparse.ArgumentParser(description="SPO / GRPO training with FSDP2 and a colocated rollout engine")
    p.add_argument("--preset", choices=sorted(toy.PRESETS), default=None, help="named defaults (tasks/toy.py:PRESETS)")
    g = p.add_argument_group("data and model")
    g.add_argument("--model", default=None, help="HF model name or local path (default: the built-in toy)")
    g.add_argument("--train", default=None, help="training prompts: parquet, JSONL or hub owner/name[:config][@split]")
    g.add_argument("--test", default=None, help="held-out prompts, as --train (both default to the toy's)")
    g.add_argument("--toy_dir", default=None, help=argparse.SUPPRESS)
    g.add_argument("--max_prompt_len", type=int, default=256, help="token limit; longer prompts left out")
    g.add_argument("--train_prompts", type=int, default=0, help=argparse.SUPPRESS)  # the first N only (sweeps),
    g.add_argument("--pool_seed", type=int, default=-1, help=argparse.SUPPRESS)  # or N drawn by this seed
    g = p.add_argument_group("Algorithm 1: sampling and rollout (steps 1-3)")
    g.add_argument("--batch_size", type=int, default=64, help="responses per step, over all ranks")
    g.add_argument("--group_size", type=int, default=None, help="responses per prompt (default: spo 1, others 8)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of training (and v0)")
    add_budget_flag(g)  # --max_response_len, shared with eval.py and offline_values.py
    add_reward_flags(g)  # --reward (the verifier), --truncated_reward, --think_format, --reward_timeout
    sampling_variants = g  # --dynamic_sampling, --oversample: below, with the losses (variants.py)
    add_tool_flags(p)  # its own group: --tools, --max_turns, --sandbox_workers, ... (shared with the other programs)
    g = p.add_argument_group("advantage and tracker (Eq. 5-9)")
    g.add_argument("--algo", choices=["spo", "reinforce_pp", *variants.GROUP_ALGOS], default="spo",
                   help="advantage estimator (docs/variants.md)")
    g.add_argument("--baseline", choices=["tracker", "none", "fixed"], default="tracker", help="spo's v(x) (fixed: v0)")
    add_v0_flags(g)  # --offline_values, --n0, --accept_offline_mismatch, --init_smoothing (Algorithm 2)
    g.add_argument("--rho", choices=["kl", "constant", "none"], default="kl", help="rho: 2^(-D/D_half), fixed, 1")
    g.add_argument("--rho_min", type=float, default=0.875, help="lower clip of rho; N0 = 1/(1-rho_min)")
    g.add_argument("--rho_max", type=float, default=0.96, help="upper clip of rho (used on a first visit)")
    g.add_argument("--divergence", choices=["abs", "k3"], default="abs", help="D(x): mean |log-ratio|, or k3")
    g.add_argument("--d_half", type=float, default=None, help=f"D at which rho halves (default: {D_HALF})")
    g.add_argument("--rho_constant", type=float, default=0.875, help="rho when --rho constant")
    g.add_argument("--adv_norm", choices=["trajectory", "token"], default="trajectory", help="Eq. 9's weights")
    g = p.add_argument_group("policy loss (Eq. 10)")
    g.add_argument("--clip_low", type=float, default=0.2, help="PPO ratio clip below 1")
    g.add_argument("--clip_high", type=float, default=0.28, help="PPO ratio clip above 1 (clip-higher)")
    variants.add_variant_flags(sampling_variants, g)  # --loss, --loss_agg, --tis here
    g = p.add_argument_group("sampler (Eq. 11)")
    g.add_argument("--sampler", choices=["auto", "prioritized", "uniform"], default="auto", help="auto: Eq. 11 for spo")
    g.add_argument("--sampling_eps", type=float, default=0.05, help="Eq. 11's exploration bonus eps")
    g.add_argument("--sampling_gamma", type=float, default=0.0, help="Eq. 11's N_eff^gamma (0: the arXiv form)")
    g = p.add_argument_group("training and optimiser")
    g.add_argument("--steps", type=int, default=150, help="training steps (rollout batches)")
    g.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate (paper: 1e-6 for Qwen3-8B)")
    g.add_argument("--grad_clip", type=float, default=1.0, help="global gradient 2-norm clip")
    g.add_argument("--ppo_steps", type=int, default=1, help="optimiser steps per rollout batch (paper: 8)")
    g.add_argument("--lr_schedule", choices=["constant", "cosine"], default="constant",
                   help="after the warmup: --lr throughout (the paper), or a cosine decay over the run's --steps")
    g.add_argument("--warmup_steps", type=int, default=0, help="linear warmup of the learning rate over N steps")
    g = p.add_argument_group("evaluation and probe")
    add_eval_flags(g)  # --eval_every, --eval_samples, ..., and the tracker probe's
    g = p.add_argument_group("run directory and logging")
    g.add_argument("--run_dir", default=None, help="outputs go here (default: runs/<algo>-<date>-<time>-<pid>)")
    g.add_argument("--save_every", type=int, default=50, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--resume", default=None, help="a run dir to continue from its newest checkpoint (auto: --run_dir)")
    g.add_argument("--seed", type=int, default=0, help="seeds prompt sampling and generation")
    add_logging_flags(g)  # --report_to, and --log_every (hidden)
    g = p.add_argument_group("system: memory, micro-batches, engine")
    memory.add_trainer_flags(g)  # micro-batches, gradient checkpointing, FSDP2 units, bf16, the estimate's override
    add_engine_flags(g, gpu_share=0.5)  # --engine, --gpu_memory_utilization, --compile
    args = p.parse_args(argv)
    args.given = resume.given_flags(p, argv)  # --resume accepts changes to some only
    vars(args).update(toy.preset_values(args.preset, args.given, args.algo))  # --preset: defaults for the rest
    args.sampler = {"auto": "prioritized" if args.algo == "spo" else "uniform"}.get(args.sampler, args.sampler)
    args.group_size = (1 if args.algo == "spo" else 8) if args.group_size is None else args.group_size
    args.d_half = args.d_half if args.d_half is not None else D_HALF[args.divergence]
    args.max_response_len = response_budget(args.max_response_len, args.tools)
    return args


def start(args):
    """Everything checked before anything heavy starts (start_program: as eval.py and offline_values.py), then the
    final flags, once, and what the loop needs, new or resumed: (args, checkpoint.Run); nothing changes args after."""
    rank, world, device, engine = start_program(args.engine)
    # --resume: the run's own settings (running nothing it names); --resume auto: resumed if there is a checkpoint
    args = argparse.Namespace(**resume.resumed_flags(vars(args), BUILT_IN, toy.BUILT))
    check_trackers(args.report_to, args.resume)  # --resume's come from the run's config.json, unchecked at parse time
    variants.check_flags(vars(args), world)  # one clear line for a bad flag or combination
    thinking.check_budget(args.toy_dir, args.max_response_len)  # a worked sum must fit
    on_gpu, on_toy = device.type == "cuda", args.train is None  # on the toy, 'auto' offline values are built here
    bf16 = use_bf16(args.bf16, on_gpu)  # auto: on GPU only; "on" needs bf16 units
    run_dir = open_run_dir(args.resume or args.run_dir, resumed=bool(args.resume), algo=args.algo, program="spo.py")
    eval_reference = exact_template(args.eval_reference, on_toy and not args.tools and not thinking.is_thinking(
        args.toy_dir), args.eval_top_p, args.eval_top_k)  # auto: the toy's only correct response (not a thinking toy)
    toy_dir, model, train, test = toy.fill_in(args.toy_dir, args.tools, args.model, args.train, "train", test=args.test)
    tools = make_tools(args.tools, args.max_turns, args.sandbox_workers, args.sandbox_timeout, args.sandbox_memory_mb,
                       max_tool_output_chars=args.max_tool_output_chars,
                       private={train: "train", test: "test", run_dir: "run_dir"})
    model = find_model(model)  # a hub name without a hub: its cached copy, or one line
    check_context(model, args.max_prompt_len + args.max_response_len, "--max_prompt_len + --max_response_len")
    system_prompt = TOOL_INSTRUCTION if args.tool_instruction else None
    tokenizer = load_tokenizer(model)
    data, test_data = load_train_and_test(
        tokenizer, train, test, system_prompt=system_prompt, max_prompt_len=args.max_prompt_len,
        train_prompts=args.train_prompts, pool_seed=args.pool_seed, test_prompts=args.eval_max_prompts,
        verbose=rank == 0, min_prompts=math.ceil(args.oversample * args.batch_size / world / args.group_size) * world)
    # --kl_coef's reference is the initial model: resume replaces --model by the checkpoint's, so config.json keeps it
    kl_reference = vars(args).get("kl_reference") if args.resume else model
    if args.resume and args.kl_coef:
        kl_reference = find_model(kl_reference, f"kl_reference (--kl_coef's initial model, {run_dir}/config.json)")
    here = dict(engine=engine, bf16=bf16, run_dir=run_dir, eval_reference=eval_reference, toy_dir=toy_dir, model=model,
                train=train, test=test, kl_reference=kl_reference,
                held_out=untrusted.same_held_out(vars(args), test_data and test_data.keys, args.resume))  # by content
    v0 = TrainingV0.pick({**vars(args), **here}, tools=tools, system_prompt=system_prompt)  # Algorithm 2's settings
    if args.algo == "spo" and not args.resume and args.offline_values not in ("auto", "none"):
        check_values_header(args.offline_values, v0.settings(), args.accept_offline_mismatch, model)
    v0 = claim_toy_values(v0, on_toy and args.algo == "spo" and not args.resume, run_dir)  # said before the engine
    untrusted.same_everywhere({"--train": untrusted.digest(data.keys), "--test": here["held_out"], "--model":
                               untrusted.digest(model), "--offline_values": untrusted.digest(v0.offline_values)},
                              all_gather_objects)  # nodes read node-local copies
    max_tokens, checkpointing, layer_units = memory.trainer_plan(vars(args), model, world, on_gpu, rank == 0)
    args = argparse.Namespace(**{**vars(args), **here, "offline_values": v0.offline_values,
                                 "max_tokens_per_micro_batch": max_tokens})  # final
    # the policy, its optimiser and engine, once the memory estimate fits; a resumed run's model and state
    state = checkpoint.load_checkpoint(args.resume, world, data.keys) if args.resume else None
    model_path = state["model_dir"] if state else args.model
    policy, optimizer = trainer.build_policy(model_path, device, lr=args.lr, weight_decay=WEIGHT_DECAY,
                                             gradient_checkpointing=checkpointing, layer_units=layer_units,
                                             bf16=args.bf16 == "on", compile_layers=args.compile == "on")
    reference = trainer.build_policy(args.kl_reference, device, lr=0.0, weight_decay=0.0,
                                     gradient_checkpointing=False, layer_units=layer_units,
                                     bf16=args.bf16 == "on")[0] if args.kl_coef else None
    check_disk(args.run_dir, policy, export_bytes_per_parameter=2 if on_gpu else 4)
    engine = start_engine(args.engine, model_path, seed=args.seed, device=device, temperature=args.temperature,
                          max_model_len=args.max_prompt_len + args.max_response_len, bf16=args.bf16 == "on",
                          gpu_memory_utilization=args.gpu_memory_utilization, engine_compile=args.compile)
    if state:
        checkpoint.restore_training_state(policy, optimizer, state["shards"])
    # the state carried across steps: the tracker, the sampler's weights (Eq. 11), previous responses, what
    # over-sampling counts
    tracker = tracker_at_start(args, data, v0, engine, state, on_toy=on_toy, is_main=rank == 0)
    sampler = PromptSampler(len(data.keys), seed=args.seed, mode=args.sampler)
    resampling = variants.Resampling(args.batch_size, world, args.group_size, oversample=args.oversample,
                                     measure=args.oversample_measure, dynamic=args.dynamic_sampling,
                                     n_prompts=len(data.keys))
    if state:
        sampler.load_state_dict(state["sampler"])
        resampling.load_state_dict(state["reach"])
    if args.sampler == "prioritized":
        sampler.set_weights(priority_weights(tracker.value, tracker.n_eff, args.sampling_eps, args.sampling_gamma))
    previous = {i: PreviousResponse(**fields) for i, fields in state["previous"].items()} if state else {}
    return args, checkpoint.Run(rank=rank, world=world, device=device, tools=tools, tokenizer=tokenizer, data=data,
                                test=test_data, on_toy=on_toy, policy=policy, optimizer=optimizer,
                                reference=reference, engine=engine,
                                tracker=tracker, sampler=sampler, previous=previous, resampling=resampling,
                                start_step=state["step"] if state else 0)


def tracker_at_start(args, data, v0, engine, state, *, on_toy, is_main):
    """The value tracker (Eq. 5-7): the checkpoint's; new, from v0 (Algorithm 2: spo only, the others read none)."""
    tracker = ValueTracker(len(data.keys), args.rho_min, args.rho_max, args.d_half,
                           {"constant": args.rho_constant, "none": 1.0}.get(args.rho))
    if state:
        tracker.load_state_dict(state["tracker"])
    elif args.algo == "spo":
        init_tracker(tracker, v0, engine, data, on_toy=on_toy, is_main=is_main)
    return tracker


if __name__ == "__main__":
    main()
