"""Stands in for argparse's error() where argparse cannot check: one line on rank 0 only, not one traceback per rank.
"""
import os
import sys


def fail(message, once=False):
    """A one-line error instead of a traceback; once: every rank reaches it alike, so only rank 0 prints it."""
    if not once or os.environ.get("RANK", "0") == "0":
        from tqdm import tqdm
        tqdm.write(f"error: {message}", file=sys.stderr)  # on a line of its own, also below a progress bar
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
