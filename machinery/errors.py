"""Stands in for argparse's error() where argparse cannot check: one line per node, not one traceback per rank.
"""
import os
import socket
import sys


def fail(message, once=False):
    """A one-line error instead of a traceback; once: every rank of a node reaches it alike, so only the node's
    first rank prints it, and with several nodes its host name with it (a file missing on one node only is said
    there; rank 0 alone would say nothing of it)."""
    env = os.environ.get
    if not once or env("LOCAL_RANK", env("RANK", "0")) == "0":
        from tqdm import tqdm
        nodes = env("WORLD_SIZE", "1") != env("LOCAL_WORLD_SIZE", env("WORLD_SIZE", "1"))
        where = f"[{socket.gethostname()}, rank {env('RANK')}] " if nodes else ""
        tqdm.write(f"error: {where}{message}", file=sys.stderr)  # on a line of its own, also below a progress bar
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
