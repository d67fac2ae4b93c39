"""How a program stops on bad input: one clear line naming the file, row or flag, then exit status 2.

Every check that refuses input before anything heavy starts (flags, data files, offline values, run
directories, verifiers) ends here, on any rank, in any program.
"""
import os
import sys


def fail(message, once=False):
    """A clear one-line error instead of a traceback, for bad input. once: every rank reaches this error the same
    way (flags, shared files), so only rank 0 prints it; otherwise each failing rank prints its own."""
    if not once or os.environ.get("RANK", "0") == "0":
        from tqdm import tqdm
        tqdm.write(f"error: {message}", file=sys.stderr)  # on a line of its own, also below a progress bar
        sys.stderr.flush()
    # A process that exits with its gloo process group alive can abort at interpreter shutdown ("terminate called
    # without an active exception", exit -6, seen in CI): take it down while the interpreter is whole, unless a
    # vLLM engine has started, whose own teardown destroys it (with its subgroups) and would fail if it were gone.
    dist, vllm_groups = sys.modules.get("torch.distributed"), sys.modules.get("vllm.distributed.parallel_state")
    if (dist is not None and dist.is_available() and dist.is_initialized()
            and not (vllm_groups and vllm_groups.model_parallel_is_initialized())):
        dist.destroy_process_group()
    raise SystemExit(2)
