"""Sampling a model outside training, with seeds of its own: eval.py's scored samples (`sample_and_score`) and what
spo.py measures between steps (`evaluations`: held-out accuracy, the tracker probe, the exact probability).

Every request's seed derives from (seed, prompt key, sample index), so a sample does not depend on the world size,
batch or order, and none of these touches training's random state.
"""
import argparse
import hashlib
import json
import os
from dataclasses import dataclass, fields

import numpy as np
import torch.distributed as dist

from machinery import collectives
from machinery.errors import check_finite, check_sampling, fail
from machinery.run_dir import run_file
from reward import DEFAULT_REWARD, VERIFIER_TIMEOUT_S, check_reward_flag, reward_and_answer


def probe_stats(value, success, n_samples, n_eff=None):
    """v(x) against the measured success rate: MAE, bias, and the MAE a PERFECT tracker would show from the
    n-sample measurement alone; with n_eff, an UNBIASED tracker's of N_eff samples (E|p_hat - p| approximations)."""
    value, success = np.asarray(value, np.float64), np.asarray(success, np.float64)
    spread = success * (1 - success) * n_samples / max(n_samples - 1, 1)  # unbiased p(1-p) from n Bernoulli draws
    stats = {"probe/mae": float(np.mean(np.abs(value - success))), "probe/bias": float(np.mean(value - success)),
             "probe/mae_floor": float(np.mean(np.sqrt(2 / np.pi * spread / n_samples)))}
    if n_eff is not None:
        noise = spread * (1 / np.asarray(n_eff, np.float64) + 1 / n_samples)
        stats["probe/mae_unbiased"] = float(np.mean(np.sqrt(2 / np.pi * noise)))
    return stats


POOL_PROMPTS = 2048  # the training prompts pool_statistics reads (a fixed subset of a larger set)


def pool_statistics(p, group=8, mastered=0.9):
    """Whether a baseline and a sampler have work to do; between_share: the most a per-prompt baseline removes."""
    p = np.asarray(p, np.float64)
    total = p.mean() * (1 - p.mean())
    return {"pool/exact": float(p.mean()), "pool/mastered": float(np.mean(p >= mastered)),
            "pool/unsolved": float(np.mean(p <= 1 - mastered)),
            "pool/all_agree8": float(np.mean(p ** group + (1 - p) ** group)),
            "pool/between_share": float(p.var() / total) if total > 0 else 0.0}


@dataclass(frozen=True)
class ProbeSettings:
    """The values spo.py's evaluations read, named as its flags."""
    eval_every: int
    eval_samples: int
    eval_temperature: float
    eval_top_p: float
    eval_top_k: int
    probe_every: int
    probe_prompts: int
    probe_samples: int
    steps: int
    seed: int
    temperature: float
    max_response_len: int
    think_format: bool
    truncated_reward: str
    reward: str
    reward_timeout: float
    run_dir: str

    @classmethod
    def pick(cls, flags: dict):
        return cls(**{f.name: flags[f.name] for f in fields(cls)})


# ---------------------------------------------------------------------------------------------- evaluation
EVAL_DEFAULTS = {"n": 32, "temperature": 0.6, "top_p": 0.95, "top_k": 20}  # the paper's evaluation sampling


def request_seeds(base, prompt_key: str, n: int) -> np.ndarray:
    """(n,) per-request seeds for samples 0..n-1 of one prompt (the first k do not depend on n)."""
    key = int(hashlib.sha1(prompt_key.encode("utf-8")).hexdigest()[:16], 16)
    return np.random.SeedSequence([*np.atleast_1d(base).tolist(), key]).generate_state(n)


def check_sampling_flags(flags, at_least):
    """eval.py's and offline_values.py's flags ({flag: value}), checked here, not where first used (hours in): every
    float finite, sampling within the engines' ranges, the verifier, each flag of at_least ({flag: least value}; None:
    unset) and the engine's share of the GPU."""
    check_finite(flags)
    check_sampling(flags["temperature"], flags["top_p"], flags.get("top_k", -1))
    check_reward_flag(flags["reward"], flags["reward_timeout"])
    for flag, low in at_least.items():
        if flags[flag] is not None and flags[flag] < low:
            note = " (0: all)" if flag == "max_prompts" else ""
            fail(f"--{flag} must be at least {low}{note}, got {flags[flag]}", once=True)
    if not 0 < flags["gpu_memory_utilization"] <= 1:
        fail(f"--gpu_memory_utilization must be in (0, 1], got {flags['gpu_memory_utilization']}", once=True)


def sample_and_score(engine, data, n, seeds_base, *, temperature, top_p, top_k, max_tokens, rank, world,
                     think_format=False, tools=None, reward=DEFAULT_REWARD, reward_timeout=VERIFIER_TIMEOUT_S,
                     progress=True, problems=None):
    """n samples of each of `problems` (default: every problem of `data`), sharded over ranks (rank r takes
    r, r + world, ...). Returns (samples, rollouts): samples[j] lists the n (answer or None, correct, truncated) of
    problems[j], on every rank (gathered: call it on all ranks); rollouts maps this rank's problems to their n
    Rollouts. A truncated sample is scored as it is: --truncated_reward is training's, not evaluation's."""
    problems = range(len(data.keys)) if problems is None else problems
    mine = list(problems[rank::world])
    outputs = []
    if mine:  # a rank with no problem (more ranks than problems) still joins the gather below
        seeds = np.concatenate([request_seeds(seeds_base, data.keys[p], n) for p in mine])
        bar = None
        if progress and rank == 0:
            from tqdm import tqdm
            bar = tqdm(total=len(mine) * n, desc=f"sampling (rank 0 of {world})", unit="sample", dynamic_ncols=True)
        outputs = engine.generate([data.prompt_ids[p] for p in mine for _ in range(n)], seeds,
                                  max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  **({"tools": tools} if tools is not None else {}),
                                  **({"progress": bar.update} if bar is not None else {}))
        if bar is not None:
            bar.close()
    rollouts = {p: outputs[j * n:(j + 1) * n] for j, p in enumerate(mine)}
    local = {p: [(answer, bool(score), r.finish_reason == "length") for r, (score, answer) in
                 ((r, reward_and_answer(r.text, data.answers[p], think_format, reward, reward_timeout)) for r in rs)]
             for p, rs in rollouts.items()}
    # answers and flags only: responses stay on their rank (a rank stopped by its verifier: one line, not a traceback)
    parts = collectives.all_gather_objects([local]) if world > 1 else [local]
    merged = {p: s for part in parts for p, s in part.items()}
    return [merged[p] for p in problems], rollouts


def evaluations(engine, test, data, tracker, settings: ProbeSettings, tools, step, exact=None):
    """What spo.py measures between steps when due (every --eval_every / --probe_every steps and at the end)."""
    metrics = {}
    if test is not None and settings.eval_every and (step % settings.eval_every == 0 or step == settings.steps):
        metrics.update(heldout_metrics(engine, test, settings, tools, exact))
        if exact:  # the training pool's regime, for every algorithm (docs/experiments.md: the calibrated regime)
            pool = probe_subset(len(data.keys), POOL_PROMPTS, settings.seed)
            metrics.update(pool_statistics(exact(data, pool, settings.temperature)))
    if settings.probe_every and (step % settings.probe_every == 0 or step == settings.steps):
        metrics.update(tracker_probe(engine, data, tracker, settings, step, tools, exact))
    return metrics


def heldout_metrics(engine, test, settings: ProbeSettings, tools, exact=None):
    """spo.py's held-out evaluation (avg@n and why samples fail). Seeds independent of the step: every evaluation
    scores the same draws."""
    samples, rollouts = sample_and_score(engine, test, settings.eval_samples, [settings.seed, 1],
                                         temperature=settings.eval_temperature, top_p=settings.eval_top_p,
                                         top_k=settings.eval_top_k, max_tokens=settings.max_response_len,
                                         rank=dist.get_rank(), world=dist.get_world_size(),
                                         think_format=settings.think_format, tools=tools, reward=settings.reward,
                                         reward_timeout=settings.reward_timeout, progress=False)
    flat = [sample for problem in samples for sample in problem]  # (answer, correct, truncated)
    metrics = {"eval/accuracy": float(np.mean([correct for _, correct, _ in flat])),
               "eval/unparsed": float(np.mean([answer is None for answer, _, _ in flat])),
               "eval/truncated": float(np.mean([truncated for _, _, truncated in flat]))}
    if len(set(test.sources or [None])) > 1:  # verl's per-data_source accuracy: a mixed test set's strata
        for source in sorted(set(test.sources)):
            metrics[f"eval/accuracy/{source}"] = float(np.mean([correct for problem, s in zip(samples, test.sources)
                                                                if s == source for _, correct, _ in problem]))
    if tools:
        used = collectives.all_reduce_np([sum(r.tool_calls > 0 for rs in rollouts.values() for r in rs)])[0]
        metrics["eval/tool_use"] = used / (len(test.keys) * settings.eval_samples)
    if exact:
        metrics["eval/exact"] = float(exact(test, range(len(test.keys)), settings.eval_temperature).mean())
    return metrics


# ---------------------------------------------------------------------------------------------- exact metric
def exact_template(flag, on_toy, top_p, top_k):
    """--eval_reference resolved (None: off); with --eval_top_p or --eval_top_k it would not be the sampler's."""
    from tasks.toy import ONLY_CORRECT
    template = {"auto": ONLY_CORRECT if on_toy else None, "off": None}.get(flag, flag)
    if template and (top_p < 1 or top_k > 0):
        fail(f"--eval_reference {flag}: the exact probability is of sampling at the temperature alone; pass "
             f"--eval_top_p 1 --eval_top_k -1 (now {top_p}, {top_k}) or --eval_reference off", once=True)
    return template


def exact_metric(policy, tokenizer, template, micro_batch_size, max_tokens):
    """None without a template, else `exact(data, indices, temperature)` -> (K,): the probability that the policy
    answers each prompt with `template` ({answer}: its ground truth) and ends its turn, from the trainer's no-grad
    pass. Where that response is the only one scored correct, the success probability without sampling noise."""
    if template is None:
        return None
    from machinery.trainer import old_logprobs

    def exact(data, indices, temperature):
        indices = list(indices)
        mine = indices[dist.get_rank()::dist.get_world_size()]  # each rank scores its share, then all gather
        responses = [tokenizer.encode(template.replace("{answer}", str(data.answers[i])), add_special_tokens=False)
                     + [tokenizer.eos_token_id] for i in mine]
        scored = old_logprobs(policy, [], [(data.prompt_ids[i], r, np.ones(len(r))) for i, r in zip(mine, responses)],
                              temperature, micro_batch_size, max_tokens)["revisited"]
        local = {i: float(np.exp(np.sum(lp, dtype=np.float64))) for i, lp in zip(mine, scored)}
        merged = {i: p for part in collectives.all_gather_objects([local]) for i, p in part.items()}
        return np.array([merged[i] for i in indices])
    return exact


# ---------------------------------------------------------------------------------------------- tracker probe
# Does the tracker track? Its v(x) is meant to be the current policy's success rate on x (Eq. 5 with rho
# forgetting what older policies did). The probe measures that rate directly on a fixed random subset of training
# prompts with fresh samples, so the gap between the two (and its noise floor) is visible over training.
def add_eval_flags(p):
    """spo.py's flags for its evaluations between steps."""
    p.add_argument("--eval_every", type=int, default=25, help="held-out evaluation every N steps and at the end "
                   "(0: off)")
    p.add_argument("--eval_samples", type=int, default=2, help="samples per held-out prompt (avg@n's n)")
    p.add_argument("--eval_temperature", type=float, default=1.0, help="evaluation temperature")
    # Not in --help (what experiments/paper.py, the sweeps and the tests set; docs/flags.md): the paper's top-p 0.95
    # and top-k 20 (-1: off), the first N held-out prompts (0: all), and the only correct response whose exact
    # probability evaluations and the probe also log (eval/exact, probe/*_exact; auto: the toy's \boxed{answer})
    p.add_argument("--eval_top_p", type=float, default=1.0, help=argparse.SUPPRESS)
    p.add_argument("--eval_top_k", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--eval_max_prompts", type=int, default=500, help=argparse.SUPPRESS)
    p.add_argument("--eval_reference", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--probe_every", type=int, default=0,
                   help="tracker probe every N steps and at the end (0: off; spo only): v(x) of a fixed subset of "
                        "training prompts against the policy's success rate from fresh samples (probe.jsonl)")
    p.add_argument("--probe_prompts", type=int, default=64, help=argparse.SUPPRESS)  # prompts followed (sweeps)
    p.add_argument("--probe_samples", type=int, default=16, help=argparse.SUPPRESS)  # fresh samples per prompt


def probe_subset(n_prompts, k, seed):
    """(min(k, n),) sorted prompt indices the probe follows for the whole run, from a generator of their own."""
    return np.sort(np.random.default_rng([seed, 3]).choice(n_prompts, size=min(k, n_prompts), replace=False))


def tracker_probe(engine, data, tracker, settings: ProbeSettings, step, tools, exact=None):
    """--probe_every: for the fixed subset of training prompts, the tracker's v(x) as it stands now (the baseline
    x's next visit would use) against the current policy's success rate from --probe_samples fresh samples per
    prompt, sampled and scored as training does, with request seeds from (seed, 2, step, prompt key): never
    training's or the held-out evaluation's. Rank 0 appends a line to <run_dir>/probe.jsonl (a resumed run may
    repeat a step: its last line wins). Returns probe_stats; with `exact`, v(x) against the exact probability too."""
    n = settings.probe_samples
    index = probe_subset(len(data.keys), settings.probe_prompts, settings.seed)  # (K,)
    value, n_eff = tracker.value_at(index), tracker.n_eff_at(index)  # (K,) read before any further update
    samples, _ = sample_and_score(engine, data, n, [settings.seed, 2, step], temperature=settings.temperature,
                                  top_p=1.0, top_k=-1, max_tokens=settings.max_response_len, rank=dist.get_rank(),
                                  world=dist.get_world_size(), think_format=settings.think_format, tools=tools,
                                  reward=settings.reward, reward_timeout=settings.reward_timeout, progress=False,
                                  problems=index)
    cut_scores_zero = settings.truncated_reward == "zero"  # training's rule (reward.rewards)
    measured = np.array([np.mean([correct and not (cut and cut_scores_zero) for _, correct, cut in s])
                         for s in samples])  # (K,)
    stats, exact_p = probe_stats(value, measured, n, n_eff), {}
    if exact:
        exact_p = {"exact": exact(data, index, settings.temperature).tolist()}
        stats.update({"probe/mae_exact": float(np.mean(np.abs(value - exact_p["exact"]))),
                      "probe/bias_exact": float(np.mean(value - exact_p["exact"]))})
    if dist.get_rank() == 0:
        with run_file(settings.run_dir, "probe.jsonl"), open(os.path.join(settings.run_dir, "probe.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "prompt": index.tolist(), "value": value.tolist(),
                                "success": measured.tolist(), **exact_p, "n_eff": n_eff.tolist(),
                                "visits": tracker.visits[index].tolist(), "n_samples": n, **stats}) + "\n")
    return stats


