"""One error line per node, not one traceback per rank (argparse's error() where argparse cannot check), what came
from outside in it escaped (`shown`, for every line that shows such text); and the flags' ranges (check_ranges).
"""
import os
import socket
import sys
from types import SimpleNamespace


def shown(text):
    """Text from outside (model or tool output, a file's name, a key) fit for a console or a summary: unprintable
    characters as repr writes them (ESC, which starts a cursor move or a title change, is \\x1b), all else as is."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


# torchrun's ranks on this node, read before anything runs: vLLM's CPU engine sets LOCAL_WORLD_SIZE to its own
# tensor-parallel size once it starts, which would make every later error look as if it came from another node
LOCAL_WORLD = os.environ.get("LOCAL_WORLD_SIZE")


def fail(message, once=False):
    """A one-line error instead of a traceback; once: every rank of a node reaches it alike, so only the node's
    first rank prints it, and with several nodes its host name with it (a file missing on one node only is said
    there; rank 0 alone would say nothing of it)."""
    env = os.environ.get
    if not once or env("LOCAL_RANK", env("RANK", "0")) == "0":
        from tqdm import tqdm
        nodes = env("WORLD_SIZE", "1") != (LOCAL_WORLD or env("WORLD_SIZE", "1"))
        where = f"[{socket.gethostname()}, rank {env('RANK')}] " if nodes else ""
        tqdm.write(f"error: {where}{shown(message)}", file=sys.stderr)  # a line of its own, also below a progress bar
        sys.stderr.flush()
    # a live gloo group can abort the exit (seen in CI): destroy it now, unless vLLM's own teardown will
    dist, vllm_groups = sys.modules.get("torch.distributed"), sys.modules.get("vllm.distributed.parallel_state")
    if (dist is not None and dist.is_available() and dist.is_initialized()
            and not (vllm_groups and vllm_groups.model_parallel_is_initialized())):
        dist.destroy_process_group()
    raise SystemExit(2)


def check_finite(flags):
    """Every float flag is finite: argparse's float() takes "nan", which slips through range checks."""
    import math
    for name, value in flags.items():
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{name} must be a finite number, got {value}", once=True)


def check_sampling(temperature, top_p, top_k, prefix=""):
    """Sampling flags within vLLM's SamplingParams' ranges, now: vLLM refuses them only at the first request."""
    if not 0 <= temperature <= 2:
        fail(f"--{prefix}temperature must be in [0, 2] (the engines' range), got {temperature}", once=True)
    if not 0 < top_p <= 1:
        fail(f"--{prefix}top_p must be in (0, 1], got {top_p}", once=True)
    if top_k < -1:
        fail(f"--{prefix}top_k must be -1 or 0 (off) or at least 1, got {top_k}", once=True)

# Flags that must be at least this (a 0 or a negative value used to become a default or a traceback later).
AT_LEAST = {"batch_size": 1, "group_size": 1, "steps": 1, "max_prompt_len": 1, "max_response_len": 1,
            "micro_batch_size": 1, "ppo_steps": 1, "n0": 1, "eval_samples": 1, "eval_every": 0, "save_every": 0,
            "log_every": 1, "eval_max_prompts": 0, "probe_every": 0, "probe_prompts": 1, "probe_samples": 1,
            "train_prompts": 0, "pool_seed": -1, "seed": 0, "max_tool_output_chars": 1, "warmup_steps": 0}
POSITIVE = ("temperature", "eval_temperature", "d_half", "grad_clip", "gpu_memory_utilization")
NON_NEGATIVE = ("lr", "tis", "kl_coef", "clip_low", "clip_high", "sampling_eps", "sampling_gamma")


def check_ranges(flags):
    """spo.py's flags each within its own range ({flag: value}), one line for the first that is not: nan and inf
    first (they would pass the comparisons), then AT_LEAST, POSITIVE, NON_NEGATIVE and the ranges with reasons."""
    f = SimpleNamespace(**flags)
    check_finite(flags)
    for flag, low in AT_LEAST.items():
        if flags[flag] < low:
            fail(f"--{flag} must be at least {low}, got {flags[flag]}", once=True)
    for flag in POSITIVE + NON_NEGATIVE:
        if not flags[flag] >= 0 or (flag in POSITIVE and flags[flag] == 0):  # also NaN
            fail(f"--{flag} must be {'positive' if flag in POSITIVE else 'at least 0'}, got {flags[flag]}",
                 once=True)
    if isinstance(f.max_tokens_per_micro_batch, int) and f.max_tokens_per_micro_batch < 1:
        fail(f"--max_tokens_per_micro_batch must be at least 1, got {f.max_tokens_per_micro_batch}", once=True)
    if not 0 < f.rho_min <= f.rho_max < 1 or not 0 < f.rho_constant <= 1:  # (rho_min 1: N0 infinite)
        fail(f"--rho_min, --rho_max, --rho_constant must satisfy 0 < rho_min <= rho_max < 1 and 0 < rho_constant "
             f"<= 1, got {f.rho_min}, {f.rho_max}, {f.rho_constant}", once=True)
    check_sampling(f.temperature, 1.0, -1)  # within the engines' ranges (vLLM refuses at the first request)
    check_sampling(f.eval_temperature, f.eval_top_p, f.eval_top_k, prefix="eval_")
    for flag, ok, why in (
            ("clip_low", f.clip_low < 1, "below 1: the ratio's lower clip 1 - clip_low must stay above 0"),
            ("gpu_memory_utilization", f.gpu_memory_utilization <= 1, "at most 1 (a share of the GPU)")):
        if not ok:
            fail(f"--{flag} must be {why}; got {flags[flag]}", once=True)
