"""The variance of SPO's and GRPO's policy gradient at one policy, to test the paper's claim (Fig. 3b) that SPO's
per-prompt baseline v(x) gives a lower-variance gradient than GRPO's group mean at the same number of samples.

For one estimator, K independent batches of B samples each (fresh prompts drawn uniformly from the training pool,
fresh samples, all seeded), each scored as training scores it (reward.rewards), and the on-policy gradient g_k of
the token-mean loss  L = -sum_tokens A * log pi(token) / n_tokens  over every parameter (log-probs at the sampling
temperature, as trainer.token_logprobs computes them; at ratio 1 this is PPO-clip's gradient too):
- spo:  B prompts x 1 sample, A = r - v(x) (Eq. 8, spo.spo_advantage), then Eq. 9's global normalisation
        (spo.global_normalise); v(x) from a checkpoint's tracker (its state.pt) or an offline-values file (v0);
- grpo: B/G prompts x G samples, A = the group z-score (variants.grpo_advantage).
Reported: the trace of the gradient covariance over batches, sum_k ||g_k - mean g||^2 / (K - 1); ||mean g||^2
(biased up by trace / K: the debiased value is in the JSON); their ratio; the mean over batches of the variance
of the residual r - baseline before any scaling (baseline v(x) for spo, the group mean for grpo); the share of
samples whose advantage in the loss is zero (|A| < 1e-6: GRPO's all-agree groups; for spo the samples whose r - v
equals the batch mean, which Eq. 9 centres to 0; the JSON also has the share with r - baseline zero), and the mean
reward.

    python -m experiments.gradient_variance --model tasks/built/toy_sharp/model --algo grpo \\
        --train tasks/built/toy_sharp/train.parquet --batches 8
    python -m experiments.gradient_variance --model RUN/checkpoints/step_000100/model --algo spo --train T.parquet
    (spo on a checkpoint: the tracker of its sibling state.pt; on the base model: --offline_values FILE)
    python -m experiments.gradient_variance summary RESULT.json ...   # mean [95% CI] over measurement seeds
"""
import argparse
import json
import os

import numpy as np
import torch

MAX_PROMPT_LEN, MAX_RESPONSE_LEN = 256, 32  # spo.py's default prompt limit; the response budget of this measurement
COLUMNS = ["algo", "B", "G", "K", "T", "cov_trace", "mean_grad_sq", "ratio", "adv_var_raw", "zero_adv_share",
           "mean_reward"]


def covariance_trace(grads):
    """Trace of the sample covariance of K gradients, (K, P) -> sum_k ||g_k - mean g||^2 / (K - 1), in float64.
    The unbiased estimate of E||g - E g||^2, the total variance of one batch's gradient. Needs K >= 2."""
    g = torch.as_tensor(grads).double()
    if g.ndim != 2 or g.shape[0] < 2:
        raise ValueError(f"covariance_trace: need a (K, P) stack with K >= 2, got shape {tuple(g.shape)}")
    return float(((g - g.mean(0)) ** 2).sum() / (g.shape[0] - 1))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an HF model directory: the toy's, or <run>/checkpoints/step_N/model")
    p.add_argument("--algo", choices=["spo", "grpo"], required=True)
    p.add_argument("--state", default=None, help="spo: a checkpoint's state.pt (default: the model dir's sibling)")
    p.add_argument("--offline_values", default=None, help="spo on a base model: offline_values.py's file (v0)")
    p.add_argument("--train", required=True, help="the training prompts (parquet or JSONL), as the run's --train")
    p.add_argument("--train_prompts", type=int, default=None, help="the first N prompts (default: the checkpoint "
                                                                      "run's --train_prompts, else 1024; 0: all)")
    p.add_argument("--batch_size", type=int, default=128, help="samples per batch, B")
    p.add_argument("--group_size", type=int, default=8, help="grpo: samples per prompt, G")
    p.add_argument("--batches", type=int, default=16, help="independent batches, K (at least 2)")
    p.add_argument("--temperature", type=float, default=0.5, help="sampling temperature, also the log-probs'")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompt draws and the samples")
    p.add_argument("--micro_batch_size", type=int, default=64, help="sequences per forward/backward pass")
    p.add_argument("--json", default=None, help="also write the result here")
    return check(p.parse_args(argv))


def check(args):
    """Bad input as one `error: ...` line, before any model loads; the spo value source resolved."""
    def error(message):
        raise SystemExit(f"error: {message}")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        error(f"--model {args.model}: not a Hugging Face model directory (no config.json)")
    if not os.path.isfile(args.train):
        error(f"--train {args.train}: no such file")
    args.group_size = args.group_size if args.algo == "grpo" else 1
    if args.algo == "grpo" and (args.group_size < 2 or args.batch_size % args.group_size):
        error(f"--batch_size {args.batch_size} must be a multiple of --group_size {args.group_size} (at least 2)")
    if args.batches < 2 or args.batch_size < 2 or not args.temperature > 0 or args.micro_batch_size < 1:
        error("need --batches >= 2, --batch_size >= 2, --temperature > 0 and --micro_batch_size >= 1")
    sibling = os.path.join(os.path.dirname(os.path.abspath(args.model)), "state.pt")
    if args.algo == "spo" and args.state is None and args.offline_values is None and os.path.isfile(sibling):
        args.state = sibling
    if args.algo == "spo" and (args.state is None) == (args.offline_values is None):
        error("--algo spo needs exactly one value source for v(x): --state STATE_PT (a checkpoint's; found "
              "beside --model when there) or --offline_values FILE (v0 of the base model)")
    for flag in ("state", "offline_values"):
        if getattr(args, flag) is not None and not os.path.isfile(getattr(args, flag)):
            error(f"--{flag} {getattr(args, flag)}: no such file")
    args.checkpoint = None
    if args.state is not None:
        from machinery.checkpoint import read_state
        args.checkpoint = read_state(args.state)
    if args.train_prompts is None:
        args.train_prompts = args.checkpoint["config"]["train_prompts"] if args.checkpoint else 1024
    return args


def world_of_one(sums):
    """spo.global_normalise's all-reduce over ranks (Eq. 9's batch sums), for one process: the sums themselves."""
    return np.asarray(sums, np.float64)


def value_tracker(args, data):
    """spo's v(x): the checkpoint's tracker, restored as spo.py resumes it, or v0 from the offline values."""
    from initial_values import check_values_header, init_tracker_from_file
    from reward import DEFAULT_REWARD
    from tracker import ValueTracker
    tracker = ValueTracker(len(data.keys))
    if args.checkpoint is not None:
        if args.checkpoint["prompt_keys"] != data.keys:
            raise SystemExit(f"error: --state {args.state} was made with another training set "
                             f"({len(args.checkpoint['prompt_keys'])} prompts there, {len(data.keys)} here): give "
                             f"the run's --train and --train_prompts")
        tracker.load_state_dict(args.checkpoint["tracker"])
        return tracker
    # v0 measured at another temperature or budget is a prior for another policy: a warning says so
    check_values_header(args.offline_values, {"temperature": args.temperature, "top_p": 1.0,
                                              "max_tokens": MAX_RESPONSE_LEN, "truncated_reward": "zero",
                                              "think_format": False, "tools": None, "system_prompt": None,
                                              "reward": DEFAULT_REWARD}, accept_mismatch=True)
    init_tracker_from_file(tracker, args.offline_values, data, "kt", verbose=True)
    return tracker


def policy_gradient(policy, rollouts, advantage, temperature, micro_batch_size):
    """(P,) fp32 gradient of L = -sum_tokens A * log pi(token) / n_tokens over the batch's policy tokens."""
    from machinery.batching import pack
    from machinery.trainer import token_logprobs
    device = next(policy.parameters()).device
    policy.zero_grad(set_to_none=True)
    n_tokens = max(sum(sum(r.response_mask) for r in rollouts), 1)
    for s in range(0, len(rollouts), micro_batch_size):
        ids, mask = pack([(r.prompt_ids, r.response_ids, r.response_mask)
                          for r in rollouts[s: s + micro_batch_size]], device)
        logp, _ = token_logprobs(policy, ids, mask, temperature)  # (b, T-1), 0 off the response
        adv = torch.tensor(advantage[s: s + micro_batch_size], dtype=torch.float32, device=device)[:, None]
        (-(adv * logp * mask).sum() / n_tokens).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float().cpu()
                      for p in policy.parameters()])


def measure(args):
    """The K batches' gradients and advantages at --model; returns the result as a dict (the JSON's)."""
    import spo
    import variants
    from hf_engine import start_engine
    from machinery.data import load_tokenizer, load_train_and_test
    from machinery.trainer import attach_logprob_forward
    from reward import rewards
    from sampler import PromptSampler
    from transformers import AutoModelForCausalLM
    group = args.group_size
    data, _ = load_train_and_test(load_tokenizer(args.model), args.train, None, max_prompt_len=MAX_PROMPT_LEN,
                                  train_prompts=args.train_prompts, test_prompts=0, system_prompt=None,
                                  min_prompts=args.batch_size // group, verbose=True)
    tracker = value_tracker(args, data) if args.algo == "spo" else None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engine = start_engine("hf", args.model, seed=args.seed, device=device, temperature=args.temperature,
                          max_model_len=MAX_PROMPT_LEN + MAX_RESPONSE_LEN, bf16=False)  # fp32, as the policy
    policy = attach_logprob_forward(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device))
    sampler = PromptSampler(len(data.keys), seed=args.seed, mode="uniform")
    grads, batch_rewards, raw_var, zero, zero_raw = [], [], [], [], []
    for k in range(args.batches):
        index = np.repeat(sampler.draw(args.batch_size // group), group)  # (B,): G consecutive slots per prompt
        seeds = np.random.SeedSequence([args.seed, k]).generate_state(len(index))
        rollouts = engine.generate([data.prompt_ids[i] for i in index], seeds, max_tokens=MAX_RESPONSE_LEN,
                                   group_size=group)
        reward = rewards(rollouts, [data.answers[i] for i in index])  # (B,) as training scores
        if args.algo == "spo":
            raw = spo.spo_advantage(reward, tracker.value_at(index))  # Eq. 8
            advantage = spo.global_normalise(raw, all_reduce=world_of_one)  # Eq. 9
        else:
            raw = variants.dr_grpo_advantage(reward, group)  # r - group mean: the residual before the std
            advantage = variants.grpo_advantage(reward, group)
        grads.append(policy_gradient(policy, rollouts, advantage, args.temperature, args.micro_batch_size))
        batch_rewards.append(reward.tolist())
        raw_var.append(float(np.var(raw)))
        zero.append(float(np.mean(np.abs(advantage) < 1e-6)))  # no gradient from these samples
        zero_raw.append(float(np.mean(np.abs(raw) < 1e-6)))
        print(f"batch {k + 1}/{args.batches}: mean reward {reward.mean():.3f}, zero-advantage share {zero[-1]:.3f}",
              flush=True)
    engine.shutdown()
    grads = torch.stack(grads)  # (K, P)
    trace = covariance_trace(grads)
    mean_sq = float((grads.double().mean(0) ** 2).sum())
    return {"model": args.model, "algo": args.algo, "value_source": args.state or args.offline_values,
            "B": args.batch_size, "G": group, "K": args.batches, "T": args.temperature, "seed": args.seed,
            "train_prompts": len(data.keys), "parameters": grads.shape[1], "cov_trace": trace,
            "mean_grad_sq": mean_sq, "mean_grad_sq_debiased": mean_sq - trace / args.batches,
            "ratio": trace / mean_sq if mean_sq > 0 else float("inf"), "adv_var_raw": float(np.mean(raw_var)),
            "zero_adv_share": float(np.mean(zero)),
            "zero_raw_share": float(np.mean(zero_raw)), "mean_reward": float(np.mean(batch_rewards)),
            "rewards": batch_rewards}


def markdown_row(result):
    return "| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v)
                              for v in (result[c] for c in COLUMNS)) + " |"


def summary(paths):
    """Markdown: for each (model, algo) among the --json results, the mean [95% t-interval] over its measurement
    seeds of the covariance trace, the noise-to-signal ratio, the residual's variance and the zero-advantage share."""
    from experiments.analysis import mean_ci
    groups = {}
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        groups.setdefault((result["model"], result["algo"]), []).append(result)
    keys = ["cov_trace", "ratio", "adv_var_raw", "zero_adv_share", "mean_reward"]
    lines = ["| model | algo | seeds | " + " | ".join(keys) + " |", "|" + " --- |" * (len(keys) + 3)]
    for (model, algo), results in groups.items():
        if len({r["seed"] for r in results}) != len(results):
            raise SystemExit(f"error: {model} {algo}: two results with the same --seed (the same batches twice)")
        cells = []
        for key in keys:
            mean, low, high, n = mean_ci([r[key] for r in results])
            cells.append(f"{mean:.4g}" + (f" [{low:.4g}, {high:.4g}]" if n > 1 else ""))
        lines.append(f"| {model} | {algo} | {len(results)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    import sys
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["summary"]:
        print(summary(argv[1:]))
        return None
    torch.set_num_threads(1)  # other jobs share this machine's cores
    args = parse_args(argv)
    result = measure(args)
    print(markdown_row(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
