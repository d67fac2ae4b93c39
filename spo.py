"""Single-stream Policy Optimization (SPO, Xu & Ding, ICLR 2026): the training program.

Each step (Algorithm 1):
  1. draw B prompts, favouring those whose outcome is uncertain (Eq. 11, sampler.py);
  2. one response per prompt from the colocated vLLM engine (rollout.py); GRPO instead draws B/G prompts and G
     responses each, so both algorithms generate B responses per step;
  3. binary reward r from the verifier (eval.py);
  4. advantage A = r - v(x) with the tracker's value from BEFORE this reward (Eq. 8), normalised once over the
     whole global batch (Eq. 9); GRPO: z-score within each group;
  5. the trainer recomputes old log-probs, and in the same forward pass re-scores each prompt's previous
     response to measure how far the policy moved since it last acted on x: D(x), which sets the tracker's
     forgetting factor rho(x) = 2^(-D/D_half) (Eq. 5); the tracker absorbs r (tracker.py);
  6. PPO-clip with clip-higher and dual-clip (Eq. 10), token-mean over the global batch, k optimiser steps;
  7. the new weights are pushed into vLLM.

D(x), exactly: at the previous visit t' of x we keep the response y' and the log-probs the acting policy
pi_t' gave it (they are that step's PPO old log-probs, computed anyway). At this visit the old-log-prob pass of
the current policy pi_t also scores y', and D(x) = mean over y''s generated tokens of the k3 estimator
exp(l) - 1 - l, l = log pi_t(y'_k) - log pi_t'(y'_k): an unbiased, non-negative estimate of
KL(pi_t' || pi_t) per token, with ONE extra forward pass over B previous responses. The authors instead take
the mean |log-ratio| between two post-update actors on that response, tool tokens included, with two extra
passes. First visit: D = 0, rho = rho_max. The previous responses live in CPU memory on every rank (replicated,
since a prompt may land on any rank next time): at paper scale (14k prompts, mean response 4k tokens, 9 bytes
per token) about 0.5 GB per rank, 2 GB at the 16k-token limit; each step all-gathers B new responses.

The same program runs the CPU toy and an 8-GPU node; only the device-dependent settings change (gloo / nccl,
fp32 / bf16, vLLM's KV cache space / GPU memory fraction and sleep mode):

    torchrun --nproc_per_node=2 spo.py                                      # the toy, on a laptop CPU
    torchrun --nproc_per_node=2 spo.py --algo grpo                          # GRPO, same responses per step
    torchrun --nproc_per_node=2 spo.py --tools                              # with a Python tool (a*b tool toy)
    torchrun --nproc_per_node=8 spo.py --model Qwen/Qwen3-8B --train dapo.parquet ...   (README)
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist

import trainer
from trainer import all_gather_np, all_reduce_np
from data import load_dataset, load_tokenizer
from eval import compute_score, sample_and_score
from sampler import PromptSampler, priority_weights
from offline_values import estimate_offline_values, init_tracker_from_file
from rollout import TOOL_INSTRUCTION, add_tool_flags, apply_tool_defaults, tools_from_flags
from tracker import ValueTracker


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="SPO / GRPO training with FSDP2 and colocated vLLM")
    # ---- data and model
    p.add_argument("--model", default=None, help="HF model name or local path (default: the built-in toy)")
    p.add_argument("--train", default=None, help="training prompts: parquet or JSONL (default: the toy)")
    p.add_argument("--test", default=None, help="held-out prompts for evaluation (default: the toy)")
    p.add_argument("--toy_dir", default=None, help="where the built-in toy is built and cached "
                                                    "(default: toy, or toy_tools with --tools)")
    p.add_argument("--offline_values", default="auto",
                   help="offline_values.py output that initialises the tracker (Algorithm 2); 'auto': on the toy, "
                        "built with the engine on first use, else none; 'none': the uninformed prior")
    p.add_argument("--n0", type=int, default=8, help="offline samples per prompt when values are built here")
    p.add_argument("--max_prompt_len", type=int, default=256, help="longer prompts are left out (counted)")
    p.add_argument("--max_response_len", type=int, default=None,
                   help="response token budget, tool output included (default: 32, or 160 with --tools)")
    # ---- algorithm
    p.add_argument("--algo", choices=["spo", "grpo"], default="spo", help="advantage estimator")
    p.add_argument("--batch_size", type=int, default=64, help="responses per step, over all ranks")
    p.add_argument("--group_size", type=int, default=8, help="GRPO responses per prompt")
    p.add_argument("--steps", type=int, default=150, help="training steps (rollout batches)")
    p.add_argument("--baseline", choices=["tracker", "none"], default="tracker",
                   help="SPO baseline: the value tracker, or none (v = 0, the paper's ablation)")
    p.add_argument("--sampler", choices=["auto", "prioritized", "uniform"], default="auto",
                   help="prompt sampling; auto = prioritized for spo, uniform for grpo")
    p.add_argument("--sampling_eps", type=float, default=0.05, help="Eq. 11 exploration bonus")
    p.add_argument("--sampling_gamma", type=float, default=0.0, help="Eq. 11 N_eff^gamma (ICLR form)")
    p.add_argument("--rho", choices=["kl", "constant"], default="kl", help="tracker forgetting factor")
    p.add_argument("--rho_min", type=float, default=0.875, help="lower clip of rho; N0 = 1/(1-rho_min)")
    p.add_argument("--rho_max", type=float, default=0.96, help="upper clip of rho (used on a first visit)")
    p.add_argument("--d_half", type=float, default=0.06, help="divergence at which rho halves")
    p.add_argument("--rho_constant", type=float, default=0.875, help="rho when --rho constant")
    p.add_argument("--init_smoothing", choices=["kt", "mean"], default="kt",
                   help="offline v0: (s+0.5)/(n+1) (kt, the authors') or s/n (mean, the paper's)")
    # ---- policy optimisation
    p.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate (paper: 1e-6 for Qwen3-8B)")
    p.add_argument("--weight_decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--grad_clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--ppo_steps", type=int, default=1, help="optimiser steps per rollout batch (paper: 8)")
    p.add_argument("--clip_low", type=float, default=0.2, help="PPO ratio clip below 1")
    p.add_argument("--clip_high", type=float, default=0.28, help="PPO ratio clip above 1 (clip-higher)")
    p.add_argument("--dual_clip", type=float, default=10.0, help="dual-clip bound for negative advantages")
    p.add_argument("--micro_batch_size", type=int, default=64, help="sequences per forward pass")
    p.add_argument("--temperature", type=float, default=1.0, help="training sampling temperature")
    p.add_argument("--truncated_reward", choices=["zero", "score"], default="zero",
                   help="a response cut off by the token budget gets 0 (zero) or is scored like any other")
    p.add_argument("--think_format", action="store_true",
                   help="reward 0 unless one </think> with no tool call after it (the authors' gate, eval.py)")
    # ---- tools: --tools, --max_turns, --sandbox_workers, ... (one group, shared with eval.py / offline_values.py)
    add_tool_flags(p)
    # ---- evaluation
    p.add_argument("--eval_every", type=int, default=25, help="held-out evaluation every N steps (0: off)")
    p.add_argument("--eval_samples", type=int, default=2, help="samples per held-out prompt")
    p.add_argument("--eval_temperature", type=float, default=1.0, help="evaluation temperature")
    p.add_argument("--eval_top_p", type=float, default=1.0, help="evaluation top-p (paper: 0.95)")
    p.add_argument("--eval_top_k", type=int, default=-1, help="evaluation top-k (paper: 20)")
    p.add_argument("--eval_max_prompts", type=int, default=500, help="held-out prompts used (0: all)")
    # ---- run, checkpoints, logging
    p.add_argument("--run_dir", default=None, help="outputs go here (default: runs/<algo>-<time>)")
    p.add_argument("--save_every", type=int, default=50, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", default=None, help="a run directory to continue from its latest checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seeds prompt sampling and generation")
    p.add_argument("--log_every", type=int, default=10, help="console line every N steps")
    p.add_argument("--max_nonfinite", type=int, default=3, help="abort after N consecutive non-finite losses")
    p.add_argument("--wandb", default=None, help="wandb project name (only if wandb is installed)")
    p.add_argument("--tensorboard", action="store_true", help="also log to TensorBoard (if installed)")
    # ---- engine
    p.add_argument("--cpu_kv_cache_gib", type=int, default=1, help="vLLM KV cache per rank on CPU (GiB)")
    p.add_argument("--gpu_memory_utilization", type=float, default=0.5, help="vLLM share of each GPU")
    args = p.parse_args(argv)
    if args.sampler == "auto":
        args.sampler = "prioritized" if args.algo == "spo" else "uniform"
    apply_tool_defaults(args, "max_response_len")
    return args


def check_args(args, world):
    group = args.group_size if args.algo == "grpo" else 1
    if args.batch_size % (world * group):
        raise SystemExit(f"error: --batch_size {args.batch_size} must be a multiple of world size x group size "
                         f"({world} x {group}) so that every rank gets whole groups")
    if args.algo == "grpo" and args.group_size < 2:
        raise SystemExit("error: --group_size must be at least 2 for grpo")
    if args.ppo_steps < 1 or (args.batch_size // world) % args.ppo_steps:
        raise SystemExit(f"error: --ppo_steps {args.ppo_steps} must divide the per-rank batch "
                         f"{args.batch_size // world}")


# ------------------------------------------------------------------------------------------------ advantages
def spo_advantage(reward, value):
    """Eq. 8: A = r - v_{-1}(x). The value is read before this reward is absorbed: keeps the gradient unbiased."""
    return reward - value


def grpo_advantage(reward, group_size, eps=1e-6):
    """GRPO: z-score within each group of G consecutive responses to one prompt (unbiased std, as verl)."""
    r = reward.reshape(-1, group_size)  # (B/G, G)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + eps)).reshape(-1)


def global_normalise(advantage, eps=1e-8):
    """Eq. 9: (A - mean) / std over the global batch, i.e. over all ranks (unbiased std, as the authors)."""
    total, total_sq, n = all_reduce_np([advantage.sum(), (advantage ** 2).sum(), advantage.size])
    mean = total / n
    std = max((total_sq - n * mean ** 2) / max(n - 1, 1), 0.0) ** 0.5
    return (advantage - mean) / (std + eps)


# ------------------------------------------------------------------------------------------------ evaluation
def evaluate(engine, test, args, tools):
    """Held-out accuracy (avg@n at the evaluation temperature) over all ranks, by the same code as eval.py, and
    with tools the share of samples that called the tool. The seeds do not depend on the step: every evaluation
    scores the same draws, so differences are the model's."""
    samples, rollouts = sample_and_score(engine, test, args.eval_samples, [args.seed, 1],
                                         temperature=args.eval_temperature, top_p=args.eval_top_p,
                                         top_k=args.eval_top_k, max_tokens=args.max_response_len,
                                         rank=dist.get_rank(), world=dist.get_world_size(),
                                         think_format=args.think_format, tools=tools)
    metrics = {"eval/accuracy": float(np.mean([correct for problem in samples for _, correct in problem]))}
    if tools:
        used = all_reduce_np([sum(r.tool_calls > 0 for rs in rollouts.values() for r in rs)])[0]
        metrics["eval/tool_use"] = used / (len(test.ids) * args.eval_samples)
    return metrics


# ------------------------------------------------------------------------------------------------ main
def main(argv=None):
    args = parse_args(argv)
    rank, world, device = trainer.setup_distributed()
    check_args(args, world)
    tools = tools_from_flags(args)  # None without --tools; else the tool loop and this rank's sandbox pool
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.cpu_kv_cache_gib))
    # vLLM logs a few INFO lines per rank at every weight push, burying the progress bar; set
    # VLLM_LOGGING_LEVEL=INFO to see them (and the engine's start-up report) again.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    is_main = rank == 0

    # ---- model and data: the toy unless the user names their own
    on_toy = args.train is None
    if args.model is None or args.train is None:
        import toy
        toy_model, toy_train, toy_test = toy.toy_paths(args.toy_dir, tools=args.tools)
        args.model, args.train = args.model or toy_model, args.train or toy_train
        args.test = args.test or toy_test
    run_dir = args.run_dir or os.path.join("runs", f"{args.algo}-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.resume:
        run_dir = args.resume
    args.run_dir = run_dir
    tokenizer = load_tokenizer(args.model)
    system_prompt = TOOL_INSTRUCTION if args.tool_instruction else None
    data = load_dataset(args.train, tokenizer, args.max_prompt_len, is_main, system_prompt)
    test = load_dataset(args.test, tokenizer, args.max_prompt_len, is_main, system_prompt) if args.test else None
    if test is not None and args.eval_max_prompts:
        test = test[: args.eval_max_prompts]
    n_prompts = len(data.ids)

    # ---- the policy (FSDP2) and its colocated engine
    state = trainer.load_checkpoint(args.resume, world, data.ids) if args.resume else None
    model_path = state["model_dir"] if state else args.model
    policy, optimizer = trainer.build_policy(model_path, device, args.lr, args.weight_decay)
    from rollout import Engine
    engine = Engine(model_path, seed=args.seed, max_model_len=args.max_prompt_len + args.max_response_len,
                    device=device, gpu_memory_utilization=args.gpu_memory_utilization,
                    temperature=args.temperature)

    # ---- the per-prompt state SPO carries across steps: tracker, sampler, previous responses (for D)
    tracker = ValueTracker(n_prompts, args.rho_min, args.rho_max, args.d_half,
                           args.rho_constant if args.rho == "constant" else None)
    sampler = PromptSampler(n_prompts, seed=args.seed, mode=args.sampler)
    previous = {}  # prompt index -> (response ids, acting policy's log-probs, response mask)
    start_step = 0
    if state:
        trainer.restore_optimizer(policy, optimizer, state["optimizer"])
        tracker.load_state_dict(state["tracker"])
        sampler.load_state_dict(state["sampler"])
        previous, start_step = state["previous"], state["step"]
    elif args.algo == "spo" and args.offline_values != "none":
        values_path = args.offline_values
        if values_path == "auto" and on_toy:  # the toy's values, measured once with this engine and cached
            values_path = os.path.join(args.toy_dir, f"offline_values_n{args.n0}_seed{args.seed}"
                                                     f"_len{args.max_response_len}{'_tools' if tools else ''}.json")
            if not os.path.exists(values_path):
                estimate_offline_values(engine, data, values_path, n0=args.n0, temperature=args.temperature,
                                        max_tokens=args.max_response_len, seed=args.seed,
                                        header={"model": args.model, "dataset": args.train},
                                        truncated_reward=args.truncated_reward, progress=is_main, tools=tools)
        if values_path == "auto":
            if is_main:
                print("no --offline_values: the tracker starts from the uninformed prior (make them with "
                      "offline_values.py)", flush=True)
        else:
            init_tracker_from_file(tracker, values_path, data, args.init_smoothing, is_main)
    if args.sampler == "prioritized":
        sampler.set_weights(priority_weights(tracker.value, tracker.n_eff, args.sampling_eps, args.sampling_gamma))

    logger = trainer.Logger(run_dir, vars(args), is_main, args.wandb, args.tensorboard)
    if is_main:
        logger.console(f"{n_prompts} training prompts, {len(test.ids) if test else 0} held-out, world size {world}, "
                       f"device {device.type}")

    group = args.group_size if args.algo == "grpo" else 1
    local = args.batch_size // world  # responses per rank per step
    nonfinite = 0
    if start_step == 0 and test is not None and args.eval_every:
        logger.log(0, evaluate(engine, test, args, tools))
    for step in logger.progress(range(start_step + 1, args.steps + 1), total=args.steps, initial=start_step):
        t = {}
        # 1. prompts: every rank draws the same global batch (same seed, same tracker), then takes its slice.
        t0 = time.time()
        index = np.repeat(sampler.draw(args.batch_size // group), group)  # (B,)
        mine = index[rank * local: (rank + 1) * local]  # (B_local,)
        # 2. one response per slot (with --tools a multi-turn trajectory whose interpreter tokens have mask 0);
        #    per-request seeds so ranks and steps sample differently.
        seeds = np.random.SeedSequence([args.seed, 0, step, rank]).generate_state(local)
        rollouts = engine.generate([data.prompt_ids[i] for i in mine], seeds, max_tokens=args.max_response_len,
                                   tools=tools)
        engine.sleep()
        t["generate"] = time.time() - t0
        # 3. rewards
        t0 = time.time()
        reward = np.array([compute_score(r.text, data.answers[i], args.think_format)
                           for r, i in zip(rollouts, mine)])  # (B_local,)
        if args.truncated_reward == "zero":
            # A response that never ended did not finish its answer. Scored as is, the verifier ignores what
            # follows the last box, and on the toy SPO learned to stop never ending (98% truncated by step 150).
            reward *= np.array([r.finish_reason != "length" for r in rollouts])
        t["score"] = time.time() - t0
        # 4. advantages: SPO's baseline is the tracker's value before this step's rewards.
        value = tracker.value_at(mine)
        if args.algo == "grpo":
            raw_advantage = grpo_advantage(reward, group)
            advantage = raw_advantage
        else:
            raw_advantage = spo_advantage(reward, value if args.baseline == "tracker" else 0.0)
            advantage = global_normalise(raw_advantage)
        # 5. old log-probs of this batch + the previous responses of these prompts (for D) in one pass.
        t0 = time.time()
        prev = [(i, previous[i]) for i in mine if args.algo == "spo" and i in previous]
        old = trainer.score_responses(policy, rollouts, [(data.prompt_ids[i], *p) for i, p in prev],
                                      args.temperature, args.micro_batch_size)
        divergence = np.zeros(local)
        for (i, (_, acting_logprobs, mask)), now in zip(prev, old["previous_logprobs"]):
            slot = int(np.flatnonzero(mine == i)[0])
            log_ratio = now[mask > 0] - acting_logprobs[mask > 0]
            divergence[slot] = float(np.mean(np.expm1(log_ratio) - log_ratio)) if log_ratio.size else 0.0
        t["old_logprobs"] = time.time() - t0
        # The tracker absorbs this step's rewards (Algorithm 1: before the policy update); all ranks agree.
        all_index, all_reward, all_divergence = all_gather_np(mine), all_gather_np(reward), all_gather_np(divergence)
        if args.algo == "spo":
            rho = tracker.rho(all_divergence)
            tracker.update(all_index, all_reward, rho)
            if args.sampler == "prioritized":
                uniq = np.unique(all_index)
                sampler.set_weights(priority_weights(tracker.value_at(uniq), tracker.n_eff_at(uniq),
                                                     args.sampling_eps, args.sampling_gamma), uniq)
            trainer.remember_responses(previous, mine, rollouts, old["logprobs"])
        # 6. PPO-clip, k optimiser steps over the global batch.
        t0 = time.time()
        stats = trainer.ppo_update(policy, optimizer, rollouts, old["logprobs"], advantage, args)
        t["update"] = time.time() - t0
        nonfinite = nonfinite + 1 if stats["nonfinite"] else 0
        if nonfinite >= args.max_nonfinite:
            raise SystemExit(f"error: {nonfinite} consecutive steps with a non-finite loss at step {step}; "
                             f"lower --lr or check the data (metrics in {run_dir}/metrics.jsonl)")
        # 7. weight push: the next rollouts come from the updated policy.
        t0 = time.time()
        engine.push_weights(trainer.full_parameters(policy))
        t["weight_push"] = time.time() - t0

        metrics = trainer.step_metrics(reward, raw_advantage, advantage, rollouts, old, stats, t, group,
                                       tracker if args.algo == "spo" else None,
                                       all_divergence if args.algo == "spo" else None,
                                       rho if args.algo == "spo" else None, tools=tools is not None)
        if test is not None and args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            metrics.update(evaluate(engine, test, args, tools))
        logger.log(step, metrics, console=(step % args.log_every == 0 or step == args.steps))
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            trainer.save_checkpoint(run_dir, step, policy, optimizer, tokenizer, world, data.ids,
                                    tracker.state_dict(), sampler.state_dict(), previous, vars(args))
    logger.close()
    if tools:
        tools.pool.close()
    engine.shutdown()  # also tears down the process group


if __name__ == "__main__":
    main()
