"""Single-stream Policy Optimization (SPO, Xu & Ding, ICLR 2026): the training program and the algorithm's math.

One training step (Algorithm 1) reads top to bottom in `main`:
  1. draw B prompts, favouring those whose outcome is uncertain (Eq. 11; sampler.py);
  2. one response per prompt from the colocated engine (vLLM: rollout.py; transformers: hf_engine.py); GRPO
     instead draws B/G prompts and G responses each, so both algorithms generate B responses per step;
  3. the binary reward r from the verifier (reward.py);
  4. SPO re-scores the previous response of every prompt it revisits, for D(x) (with --ppo_steps > 1 the same
     no-grad pass gives PPO's old log-probs; with one optimiser step per batch the update's forward gives them);
  5. the advantage: SPO's A = r - v(x) with the tracker's value from BEFORE this reward (Eq. 8), normalised over
     the whole global batch (Eq. 9); then D(x) sets the forgetting factor rho(x) (Eq. 5), the tracker absorbs r
     (tracker.py) and the sampler's weights follow. GRPO: the z-score within each group;
  6. PPO-clip with clip-higher and dual-clip (Eq. 10), token mean over the global mini-batch, k optimiser steps;
  7. the new weights are pushed into the engine.
The estimators, losses and sampling SPO is compared against (RLOO, Dr. GRPO, REINFORCE++, GSPO, CISPO, DAPO's
dynamic sampling, Batch SPO, ...) are one flag away (variants.py): one branch in step 5, one loss in step 6.
The algorithm's own math sits here as small pure functions, each named for what it computes: `spo_advantage`
(Eq. 8), `global_normalise` (Eq. 9), `divergence` (D(x) of Eq. 5), `ppo_clip_loss` (Eq. 10), and SPO's memory of
each prompt's last response (`PreviousResponse`, `remember`: D(x) re-scores it under the current policy, one more
forward pass). The per-prompt state: tracker.py, sampler.py. machinery/: the FSDP2 trainer and the rest.

The same program runs the CPU toy and an 8-GPU node; only device-dependent settings change (gloo / nccl,
fp32 / bf16, vLLM's KV cache space / GPU memory fraction and sleep mode):

    torchrun --nproc_per_node=2 spo.py                         # the toy on a laptop CPU (--algo grpo, --tools, ...)
    torchrun --nproc_per_node=8 spo.py --model Qwen/Qwen3-8B --train dapo.parquet ...   (docs/scale.md)
"""
import argparse
import functools
import math
import os
import time
from dataclasses import dataclass

# big CPU tensors on 2 MiB huge pages: torch reads this at its first allocation, hence here (docs/algorithm.md)
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402

import variants
from eval import add_probe_flags, evaluations
from machinery import checkpoint, memory, trainer
from machinery.collectives import all_gather_np, all_gather_objects, all_reduce_np
from machinery.data import check_context, find_model, load_dataset, load_tokenizer
from machinery.errors import fail
from machinery.metrics import Logger, PromptReach, oversample_metrics, spo_metrics, step_metrics
from machinery.run_dir import check_disk, open_run_dir
from hf_engine import choose_engine, start_engine
from offline_values import check_values_header, init_tracker_from_file, toy_values, training_v0_settings
from reward import add_reward_flags, rewards
from rollout import (TOOL_INSTRUCTION, add_budget_flag, add_tool_flags, apply_tool_defaults, prepare_vllm,
                     tools_from_flags)
from sampler import PromptSampler, priority_weights
from tasks import toy
from tracker import ValueTracker


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="SPO / GRPO training with FSDP2 and a colocated rollout engine")
    # ---- data and model
    p.add_argument("--model", default=None, help="HF model name or local path (default: the built-in toy)")
    p.add_argument("--train", default=None, help="training prompts: parquet or JSONL (default: the toy)")
    p.add_argument("--test", default=None, help="held-out prompts for evaluation (default: the toy)")
    p.add_argument("--toy_dir", default=None, help="the toy's directory (default: the shipped one, tasks/built/)")
    p.add_argument("--offline_values", default="auto",
                   help="offline_values.py output that initialises the tracker (Algorithm 2); 'auto': on the toy, "
                        "built with the engine on first use, else none; 'none': the uninformed prior")
    p.add_argument("--n0", type=int, default=8, help="offline samples per prompt when values are built here")
    p.add_argument("--accept_offline_mismatch", action="store_true", help="use values made with other settings")
    p.add_argument("--max_prompt_len", type=int, default=256, help="longer prompts are left out (counted)")
    p.add_argument("--train_prompts", type=int, default=0, help="train on the first N prompts only (0: all)")
    p.add_argument("--preset", choices=sorted(variants.PRESETS), default=None, help="named defaults (variants.PRESETS)")
    add_budget_flag(p)  # --max_response_len (alias --max_tokens), shared with eval.py and offline_values.py
    # ---- algorithm
    p.add_argument("--algo", choices=["spo", "grpo", "rloo", "dr_grpo", "reinforce_pp"], default="spo",
                   help="advantage estimator (docs/variants.md)")
    p.add_argument("--batch_size", type=int, default=64, help="responses per step, over all ranks")
    p.add_argument("--group_size", type=int, default=None, help="responses per prompt (spo: 1, others: 8)")
    p.add_argument("--steps", type=int, default=150, help="training steps (rollout batches)")
    p.add_argument("--baseline", choices=["tracker", "none", "fixed"], default="tracker", help="spo's v(x)")
    p.add_argument("--sampler", choices=["auto", "prioritized", "uniform"], default="auto", help="auto: "
                   "prioritized for spo, uniform for the others")
    p.add_argument("--sampling_eps", type=float, default=0.05, help="Eq. 11 exploration bonus")
    p.add_argument("--sampling_gamma", type=float, default=0.0, help="Eq. 11 N_eff^gamma (ICLR form)")
    p.add_argument("--rho", choices=["kl", "constant", "none"], default="kl", help="forgetting (none: rho = 1)")
    p.add_argument("--rho_min", type=float, default=0.875, help="lower clip of rho; N0 = 1/(1-rho_min)")
    p.add_argument("--rho_max", type=float, default=0.96, help="upper clip of rho (used on a first visit)")
    p.add_argument("--divergence", choices=["abs", "k3"], default="abs", help="D(x): mean |log-ratio| (abs, the "
                   "authors') or the k3 KL estimate")
    p.add_argument("--d_half", type=float, default=None,
                   help=f"divergence at which rho halves (default: {D_HALF['abs']} for abs, {D_HALF['k3']} for k3)")
    p.add_argument("--rho_constant", type=float, default=0.875, help="rho when --rho constant")
    p.add_argument("--adv_norm", choices=["trajectory", "token"], default="trajectory", help="Eq. 9 over "
                   "trajectories (paper) or loss tokens (SPO++'s token measure; spo, reinforce_pp)")
    p.add_argument("--init_smoothing", choices=["kt", "mean"], default="kt", help="v0: (s+0.5)/(n+1) (kt, the "
                   "authors') or s/n (mean, the paper's)")
    # ---- policy optimisation
    p.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate (paper: 1e-6 for Qwen3-8B)")
    p.add_argument("--weight_decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--grad_clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--ppo_steps", type=int, default=1, help="optimiser steps per rollout batch (paper: 8)")
    p.add_argument("--clip_low", type=float, default=0.2, help="PPO ratio clip below 1")
    p.add_argument("--clip_high", type=float, default=0.28, help="PPO ratio clip above 1 (clip-higher)")
    p.add_argument("--dual_clip", type=float, default=10.0, help="dual-clip bound for negative advantages")
    p.add_argument("--temperature", type=float, default=1.0, help="training sampling temperature")
    add_reward_flags(p)  # --reward (the verifier), --truncated_reward, --think_format (reward.py)
    # ---- tools: --tools, --max_turns, --sandbox_workers, ... (one group, shared with eval.py / offline_values.py)
    add_tool_flags(p)
    # ---- the family: --loss, --loss_agg, --dynamic_sampling, --max_sampling_rounds (variants.py)
    variants.add_variant_flags(p)
    # ---- evaluation
    p.add_argument("--eval_every", type=int, default=25, help="held-out evaluation every N steps (0: off)")
    p.add_argument("--eval_samples", type=int, default=2, help="samples per held-out prompt")
    p.add_argument("--eval_temperature", type=float, default=1.0, help="evaluation temperature")
    p.add_argument("--eval_top_p", type=float, default=1.0, help="evaluation top-p (paper: 0.95)")
    p.add_argument("--eval_top_k", type=int, default=-1, help="evaluation top-k (paper: 20)")
    p.add_argument("--eval_max_prompts", type=int, default=500, help="held-out prompts used (0: all)")
    add_probe_flags(p)  # --probe_every, --probe_prompts, --probe_samples: does the tracker track? (eval.py)
    # ---- run, checkpoints, logging
    p.add_argument("--run_dir", default=None, help="outputs go here (default: runs/<algo>-<date>-<time>-<pid>)")
    p.add_argument("--save_every", type=int, default=50, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", default=None, help="a run directory to continue from its latest checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seeds prompt sampling and generation")
    p.add_argument("--log_every", type=int, default=10, help="console line every N steps")
    p.add_argument("--max_nonfinite", type=int, default=3, help="abort after N consecutive non-finite losses")
    p.add_argument("--wandb", default=None, help="wandb project name (only if wandb is installed)")
    p.add_argument("--tensorboard", action="store_true", help="also log to TensorBoard (if installed)")
    # ---- memory: micro-batches, gradient checkpointing, the engine (--engine) and its share, the estimate
    memory.add_memory_flags(p)
    p.add_argument("--engine_compile", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile vLLM's model (auto: on GPU only; docs/benchmarks.md)")
    args = p.parse_args(argv)
    for action in p._actions:  # which flags the command line gave: --resume accepts changes to some only
        action.default = argparse.SUPPRESS
    args.given = sorted(vars(p.parse_args(argv)))
    variants.apply_preset(args)  # --preset: defaults for the flags the command line left unset
    if args.sampler == "auto":
        args.sampler = "prioritized" if args.algo == "spo" else "uniform"
    if args.group_size is None:  # single stream: one response per prompt; the group estimators: 8
        args.group_size = 1 if args.algo == "spo" else 8
    if args.d_half is None:
        args.d_half = D_HALF[args.divergence]
    apply_tool_defaults(args)
    return args


# ------------------------------------------------------------------------------------------------ advantages
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


# ------------------------------------------------------------------------------------------------ D(x) and SPO's memory
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


# D_half per divergence measure: the authors' 0.06 for the mean |l|; for k3 (about l^2 / 2) the value that agrees
# with it at the clip window's centre, 0.06 (pi / 4) 0.0064 = 3.0e-4 (derived in docs/algorithm.md).
D_HALF = {"abs": 0.06, "k3": 3.0e-4}


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


def remember(previous, index, responses):
    """previous[i] = the latest PreviousResponse of prompt i. Pass the responses of ALL ranks (a prompt may land
    on any rank next time); for a prompt drawn twice in one batch the later response wins."""
    for i, response in zip(index, responses):
        previous[int(i)] = response


# ------------------------------------------------------------------------------------------------ the loss
def ppo_clip_loss(logprobs, old_logprobs, advantage, mask, clip_low, clip_high, dual_clip, n_tokens):
    """Eq. 10: PPO-clip with clip-higher and dual-clip, summed over masked tokens and divided by n_tokens (the
    policy tokens of the global mini-batch: a token mean over all ranks).

    Per token, with ratio = pi / pi_old and A the trajectory's advantage (broadcast to its tokens):
        loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))          (the pessimistic bound)
        and for A < 0 also at most -A * dual_clip: a huge ratio cannot blow up the loss (dual-clip).
    logprobs, old_logprobs, mask: (B, T); advantage: (B,). Returns (loss, clipped): clipped (B, T) is True where
    the clip range decided (the token's gradient is zero there; the dual-clip bound is not counted)."""
    loss, clipped = ppo_clip_token_loss(logprobs, old_logprobs, advantage, mask, clip_low, clip_high, dual_clip)
    return (loss * mask).sum() / n_tokens, clipped


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


# ------------------------------------------------------------------------------------------------ set-up
def start(args):
    """Everything checked before anything heavy starts: the process group, a resumed run's own settings, every
    flag, vLLM's environment, the run directory (one run per directory, locked), the tools, the model and data
    (the built-in toy where none are named). Returns (args, rank, world, device, tools, on_toy)."""
    rank, world, device = trainer.setup_distributed()
    if args.resume:  # the run's own settings; only some flags may change (checkpoint.RESUME_MAY_CHANGE)
        args = checkpoint.resume_args(args)
    variants.check_args(args, world)  # one clear line for a bad flag or combination
    args.bf16 = memory.use_bf16(args.bf16, device.type == "cuda")  # auto: on GPU only; "on" needs bf16 units
    prepare_vllm(args.cpu_kv_cache_gib)  # quiet INFO lines (they would bury the progress bar), the CPU KV cache
    args.engine = choose_engine(args.engine, rank == 0)  # auto: vllm where it imports, else hf (said in one line)
    args.run_dir = open_run_dir(args, "spo.py")
    tools = tools_from_flags(args)  # None without --tools; else the tool loop and this rank's sandbox pool
    on_toy = toy.fill_in(args, "train", "train", test="test")  # on the toy, 'auto' offline values are built here
    args.model = find_model(args.model)  # a hub name without a hub: its cached copy, or one line
    return args, rank, world, device, tools, on_toy


def load_data(args, tools, prompts_per_step, is_main):
    """The training and held-out prompts, and the settings that make offline values v0 (Algorithm 2) valid for
    this run: a values file made otherwise would start the tracker from another distribution than training
    samples from, so its header is checked here. Returns (tokenizer, data, test, v0_settings)."""
    tokenizer = load_tokenizer(args.model)
    # the engine's context (vLLM's max_model_len) must fit the model's positions
    check_context(args.model, args.max_prompt_len + args.max_response_len, "--max_prompt_len + --max_response_len")
    system_prompt = TOOL_INSTRUCTION if args.tool_instruction else None
    data = load_dataset(args.train, tokenizer, args.max_prompt_len, is_main, system_prompt)
    if args.train_prompts > len(data.keys):
        fail(f"--train_prompts {args.train_prompts}: --train {args.train} has only {len(data.keys)} prompts", once=True)
    data = data[: args.train_prompts or None]
    test = load_dataset(args.test, tokenizer, args.max_prompt_len, is_main, system_prompt) if args.test else None
    if test is not None and args.eval_max_prompts:
        test = test[: args.eval_max_prompts]
    if test is not None and is_main and (shared := len(set(test.keys) & set(data.keys))):  # e.g. --test = --train
        print(f"warning: {shared} of the {len(test.keys)} held-out prompts (--test) are also training prompts "
              f"(--train): held-out accuracy counts them", flush=True)
    if len(data.keys) < prompts_per_step:
        fail(f"--train {args.train}: {len(data.keys)} prompts, fewer than the {prompts_per_step} distinct prompts "
             f"each step draws (--batch_size / --group_size, x --oversample)", once=True)
    v0_settings = training_v0_settings(args, tools, system_prompt)
    if args.algo == "spo" and not args.resume and args.offline_values not in ("auto", "none"):
        check_values_header(args.offline_values, v0_settings, args.accept_offline_mismatch)
    return tokenizer, data, test, v0_settings


def build_policy_and_engine(args, world, device, run_dir, data, is_main):
    """The policy (FSDP2) and its colocated engine, once the estimate says a rank's memory holds them; from the
    latest checkpoint with --resume. Returns (policy, optimizer, engine, state): state is the checkpoint's
    per-prompt state and step (None for a new run)."""
    on_gpu = device.type == "cuda"
    memory.check_rank_memory(args, world, on_gpu, is_main, fail)
    state = checkpoint.load_checkpoint(args.resume, world, data.keys) if args.resume else None
    model_path = state["model_dir"] if state else args.model
    policy, optimizer = trainer.build_policy(model_path, device, args.lr, args.weight_decay,
                                             memory.use_gradient_checkpointing(args.gradient_checkpointing, on_gpu),
                                             memory.use_layer_units(args.fsdp_units, on_gpu), args.bf16 == "on")
    check_disk(run_dir, policy, export_bytes_per_parameter=2 if on_gpu else 4)
    engine = start_engine(args.engine, model_path, seed=args.seed, device=device, temperature=args.temperature,
                          max_model_len=args.max_prompt_len + args.max_response_len,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          compile_model=None if args.engine_compile == "auto" else args.engine_compile == "on",
                          bf16=args.bf16 == "on")
    if state:
        checkpoint.restore_training_state(policy, optimizer, state["shards"])
    return policy, optimizer, engine, state


def per_prompt_state(args, state, engine, data, v0_settings, tools, on_toy, is_main):
    """The state SPO carries across steps: the tracker (from the checkpoint, or from offline values v0:
    Algorithm 2), the sampler and its weights (Eq. 11), each prompt's previous response (for D(x)), and which
    prompts were drawn and trained on. Returns (tracker, sampler, previous, reach, start_step)."""
    n_prompts = len(data.keys)
    tracker = ValueTracker(n_prompts, args.rho_min, args.rho_max, args.d_half,
                           {"constant": args.rho_constant, "none": 1.0}.get(args.rho))
    sampler = PromptSampler(n_prompts, seed=args.seed, mode=args.sampler)
    previous = {}  # prompt index -> PreviousResponse (SPO only; stays empty for GRPO)
    reach = PromptReach(n_prompts)  # --oversample: prompts drawn and trained on, over the run
    if state:
        tracker.load_state_dict(state["tracker"])
        sampler.load_state_dict(state["sampler"])
        reach.load_state_dict(state.get("reach"))
        previous = {i: PreviousResponse(**fields) for i, fields in state["previous"].items()}
    elif args.algo == "spo" and args.offline_values != "none":
        values_path = args.offline_values
        if values_path == "auto" and on_toy:  # the toy's v0, measured once with this engine and cached
            values_path = toy_values(engine, data, args, tools, v0_settings, progress=is_main)
        if values_path != "auto":
            init_tracker_from_file(tracker, values_path, data, args.init_smoothing, is_main)
        elif is_main:
            print("no --offline_values: the tracker starts from the uninformed prior (make them with "
                  "offline_values.py)", flush=True)
    if args.sampler == "prioritized":
        sampler.set_weights(priority_weights(tracker.value, tracker.n_eff, args.sampling_eps, args.sampling_gamma))
    return tracker, sampler, previous, reach, state["step"] if state else 0


# ------------------------------------------------------------------------------------------------ the step loop
def main(argv=None):
    args, rank, world, device, tools, on_toy = start(parse_args(argv))
    run_dir, is_main, on_gpu = args.run_dir, rank == 0, device.type == "cuda"
    group = args.group_size  # responses per prompt: 1 for SPO (more: Batch SPO), G for the group estimators
    local = args.batch_size // world  # responses per rank per step
    started = math.ceil(args.oversample * local / group) * group  # trajectories started per rank (--oversample)
    tokenizer, data, test, v0_settings = load_data(args, tools, started * world // group, is_main)
    policy, optimizer, engine, state = build_policy_and_engine(args, world, device, run_dir, data, is_main)
    tracker, sampler, previous, reach, start_step = per_prompt_state(args, state, engine, data, v0_settings, tools,
                                                                     on_toy, is_main)
    logger = Logger(run_dir, vars(args), is_main, args.wandb, args.tensorboard, start_step if state else None)
    logger.console(f"{len(data.keys)} training prompts, {len(test.keys) if test else 0} held-out, world size {world}, "
                   f"device {device.type}")  # (rank 0 only)
    # Step 6's loss: Eq. 10 (PPO-clip, token mean over the global mini-batch); --loss / --loss_agg swap in another
    loss_fn = functools.partial(ppo_clip_loss, clip_low=args.clip_low, clip_high=args.clip_high,
                                dual_clip=args.dual_clip)
    if (args.loss, args.loss_agg) != ("ppo_clip", "token_mean"):
        loss_fn = variants.make_loss(args.loss, args.loss_agg, ppo_clip_token_loss, clip_low=args.clip_low,
                                     clip_high=args.clip_high, dual_clip=args.dual_clip,
                                     n_sequences=args.batch_size // args.ppo_steps, max_len=args.max_response_len)

    def sample(step, round_, t, oversampled):
        """Steps 1-3 for one batch of B/G prompts (dynamic sampling calls it again for more groups). Adds its
        seconds to `t` and its over-sampling metrics to `oversampled`."""
        # 1. prompts (Eq. 11): every rank draws the same global batch (same seed, same weights), then its slice.
        t0 = time.time()
        index = np.repeat(sampler.draw(started * world // group), group)  # (B,) prompt indices (more: over-sampled)
        mine = index[rank * started: (rank + 1) * started]  # (B_local,)
        # 2. one response per slot (with --tools a multi-turn trajectory whose interpreter tokens have mask 0);
        #    per-request seeds so ranks, steps and rounds sample differently. Over-sampled: the first B_local to
        #    finish are kept (whole groups), the others aborted (or, to measure them, left to finish).
        seeds = np.random.SeedSequence([args.seed, 0, step, rank] + [round_] * (round_ > 0)).generate_state(started)
        rollouts = engine.generate([data.prompt_ids[i] for i in mine], seeds, max_tokens=args.max_response_len,
                                   tools=tools, group_size=group,
                                   keep_first=local if started > local and not args.oversample_measure else None)
        t["generate"] = t.get("generate", 0.0) + time.time() - t0
        # 3. rewards r(x, y) in {0, 1}; a response cut off by the budget scores 0 by default (reward.py).
        t0 = time.time()
        done = np.array([r is not None for r in rollouts])
        reward = np.full(started, np.nan)
        reward[done] = rewards([r for r in rollouts if r], [data.answers[i] for i in mine[done]], args.think_format,
                               args.truncated_reward, args.reward, args.reward_timeout)
        kept = variants.first_finished(rollouts, local, group) if started > local else done
        oversampled.update(oversample_metrics(rollouts, reward, kept, mine, reach) if started > local else {})
        t["score"] = t.get("score", 0.0) + time.time() - t0
        return mine[kept], [r for r, k in zip(rollouts, kept) if k], reward[kept]  # (B_local,), rollouts, (B_local,)

    nonfinite = 0
    if start_step == 0 and (before := evaluations(engine, test, data, tracker, args, tools, 0)):
        logger.log(0, before)  # held-out accuracy and the tracker probe before training, when asked for
    for step in logger.progress(range(start_step + 1, args.steps + 1), total=args.steps, initial=start_step):
        t, oversampled = {}, {}
        mine, rollouts, reward = sample(step, 0, t, oversampled)  # steps 1-3
        sampling = {"sampling/generated": started * world, "sampling/used": args.batch_size, **oversampled}
        if args.dynamic_sampling:  # DAPO: drop the groups whose rewards are all equal, refill (variants.py)
            mine, rollouts, reward, sampling = variants.dynamic_sampling(
                (mine, rollouts, reward), lambda k: sample(step, k, t, oversampled), group, args.max_sampling_rounds,
                rank, world, all_gather_objects)
        memory.phase_end(on_gpu, "generate")  # (GPU: device memory in use with vLLM awake)
        engine.sleep()
        # 4. the trainer's log-probs before the update, in one no-grad pass: (SPO) of the previous response of every
        #    prompt this batch revisits (Batch SPO: one per prompt), and with ppo_steps > 1 PPO's old log-probs.
        t0 = time.time()
        revisited = [(slot, previous[i]) for slot, i in enumerate(mine) if i in previous and slot % group == 0]
        old = trainer.old_logprobs(policy, rollouts if args.ppo_steps > 1 else [],
                                   [(data.prompt_ids[mine[slot]], p.response_ids, p.mask) for slot, p in revisited],
                                   args.temperature, args.micro_batch_size, args.max_tokens_per_micro_batch)
        t["old_logprobs"] = time.time() - t0
        # 5. advantages, and the state each algorithm carries to the next step (Eq. 9 weighs a trajectory by its
        #    loss tokens with --adv_norm token).
        norm_weight = [sum(r.response_mask) for r in rollouts] if args.adv_norm == "token" else None
        if args.algo == "spo":
            value = tracker.value_at(mine) if args.baseline != "none" else np.zeros(local)  # v_{-1}(x)
            raw_advantage = spo_advantage(reward, value)  # Eq. 8, before the tracker absorbs r
            advantage = global_normalise(raw_advantage, weight=norm_weight)  # Eq. 9
            divergences, revisit = np.zeros(local), np.zeros(local)  # D(x) per slot; 0 on a first visit
            for (slot, prev), now in zip(revisited, old["revisited"]):  # a prompt's G slots share D(x), one rho
                divergences[slot: slot + group] = divergence(now[prev.mask > 0], prev.logprobs[prev.mask > 0],
                                                             args.divergence)
                revisit[slot: slot + group] = 1.0
            all_index, all_reward, all_divergences, all_revisit, all_raw_advantage = all_gather_np(
                mine, reward, divergences, revisit, raw_advantage)  # one collective
            rho = tracker.rho(all_divergences)  # Eq. 5: 2^(-D / D_half), clipped
            if args.baseline != "fixed":  # the fixed baseline keeps v0 forever (the A*-PO-like ablation)
                tracker.update(all_index, all_reward, rho)  # Eq. 5: every rank applies the same update, once
            if args.sampler == "prioritized":  # Eq. 11 for the prompts whose value just changed
                uniq = np.unique(all_index)
                sampler.set_weights(priority_weights(tracker.value_at(uniq), tracker.n_eff_at(uniq),
                                                     args.sampling_eps, args.sampling_gamma), uniq)
            algo_metrics = spo_metrics(all_raw_advantage, tracker, all_divergences, rho, all_revisit > 0)
        elif args.algo == "reinforce_pp":  # REINFORCE++: no per-prompt baseline, r whitened over the global batch
            raw_advantage, advantage, algo_metrics = reward, global_normalise(reward, weight=norm_weight), {}
        else:  # the group baselines (variants.py): GRPO's z-score, RLOO's leave-one-out mean, Dr. GRPO's mean
            raw_advantage = advantage = variants.GROUP_BASELINES[args.algo](reward, group)
            algo_metrics = {}  # (all-equal groups: in step_metrics, for every estimator with groups)
        # 6. PPO-clip (Eq. 10; or --loss, --loss_agg), `ppo_steps` optimiser steps over the global batch.
        t0 = time.time()
        stats = trainer.ppo_update(policy, optimizer, rollouts, old["batch"] if args.ppo_steps > 1 else None,
                                   advantage, loss_fn, ppo_steps=args.ppo_steps, micro_batch_size=args.micro_batch_size,
                                   temperature=args.temperature, grad_clip=args.grad_clip,
                                   max_tokens=args.max_tokens_per_micro_batch)
        t["update"] = time.time() - t0
        memory.phase_end(on_gpu, "update")
        old.update(stats.pop("old", {}))  # ppo_steps 1: this batch's old log-probs came out of the update's forward
        if args.algo == "spo":  # SPO's memory for D(x) at the next visit: the acting policy's log-probs
            remember(previous, all_index, all_gather_objects(
                [PreviousResponse.of(r, logprobs) for r, logprobs in zip(rollouts, old["batch"])]))
        nonfinite = nonfinite + 1 if stats["nonfinite"] else 0
        if nonfinite >= args.max_nonfinite:
            raise SystemExit(f"error: {nonfinite} consecutive steps with a non-finite loss at step {step}; "
                             f"lower --lr or check the data (metrics in {run_dir}/metrics.jsonl)")
        # 7. weight push: the next rollouts come from the updated policy.
        t0 = time.time()
        engine.push_weights(trainer.full_parameters(policy, torch.bfloat16 if args.bf16 == "on" else None))
        t["weight_push"] = time.time() - t0

        metrics = {**step_metrics(reward, raw_advantage, advantage, rollouts, old, stats, t, group=group,
                                  tools=tools is not None), **algo_metrics, **sampling}
        metrics.update(memory.peak_metrics(on_gpu))  # GPU: device memory in use at the phases' ends
        metrics.update(evaluations(engine, test, data, tracker, args, tools, step))  # when due (eval.py)
        logger.log(step, metrics, console=(step % args.log_every == 0 or step == args.steps))
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            checkpoint.save_checkpoint(run_dir, step, policy, optimizer, tokenizer, world, data.keys,
                                       tracker.state_dict(), sampler.state_dict(),
                                       {i: vars(p) for i, p in previous.items()}, vars(args), reach=reach.state_dict(),
                                       export_dtype=torch.bfloat16 if on_gpu else None)
    logger.close()
    if tools:
        tools.pool.close()
    engine.shutdown()  # also tears down the process group


if __name__ == "__main__":
    main()
