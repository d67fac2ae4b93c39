"""No library decides these; they are decided once so that the estimate, trainer and engine agree (tests/test_memory).

What the three programs do first on a machine (torch.distributed on gloo or nccl, the engine that imports), the
trainer's flags and their `auto` values (the token budget: memory.auto_budget), and the memory a run reports."""
import argparse
import datetime
import os

import torch
import torch.distributed as dist

from machinery.console import quiet_vllm
from machinery.errors import fail
from machinery.memory import CPU_TOKENS, GIB, GPU_TOKENS, check_rank_memory


# NCCL's default, 10 minutes, is shorter than rank 0 writing an 8B model's export while the others wait.
DIST_TIMEOUT = datetime.timedelta(minutes=60)


def setup_distributed():
    """torch.distributed on gloo (CPU) or nccl (GPU); plain `python spo.py` is a world of one (not under srun)."""
    if "RANK" not in os.environ:
        if int(os.environ.get("SLURM_NTASKS", "1")) > 1:  # srun python spo.py: every task a world of one, on cuda:0
            if os.environ.get("SLURM_PROCID", "0") != "0":
                raise SystemExit(2)  # said once, by the first task
            fail(f"{os.environ['SLURM_NTASKS']} SLURM tasks without torchrun: each would train alone; start "
                 f"torchrun in each task: srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=GPUS "
                 f"--rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 spo.py ... (docs/scale.md)")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    # imported before init_process_group, torch.distributed.nn holds no group that could abort the exit (CI)
    import torch.distributed.nn  # noqa: F401
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        prefer_flash_attention(on_gpu=True)
        dist.init_process_group("nccl", device_id=device, timeout=DIST_TIMEOUT)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=DIST_TIMEOUT)
    return dist.get_rank(), dist.get_world_size(), device


def start_program(engine):
    """What the three programs do first. Returns (rank, world, device, engine kind)."""
    rank, world, device = setup_distributed()
    quiet_vllm()
    if error := set_cpu_kv_cache():
        fail(error, once=True)
    return rank, world, device, choose_engine(engine, rank == 0)


def set_cpu_kv_cache():
    """VLLM_CPU_KVCACHE_SPACE, vLLM's own setting of the CPU engine's KV cache per rank (GiB): 1 when unset. Returns
    an error line for a bad value (vLLM would otherwise fail with GPU advice, or take half the RAM per rank for an
    empty string)."""
    value = os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if not value.strip().isdigit() or int(value) < 1:
        return f"VLLM_CPU_KVCACHE_SPACE={value!r}: must be a whole number of GiB, at least 1"
    return None


def choose_engine(choice, is_main):
    """--engine resolved and said. After quiet_vllm: vLLM's log level is read when it is imported."""
    why = f"--engine {choice}"
    if choice == "auto":
        try:
            import vllm  # noqa: F401 - only whether it imports
            choice, why = "vllm", "--engine auto: vllm imports"
        except Exception as e:  # noqa: BLE001 - not installed, or installed but broken
            choice, why = "hf", f"--engine auto: vllm does not import ({type(e).__name__}: {str(e)[:120]})"
    if is_main:
        print(f"rollout engine: {choice} ({why})", flush=True)
    return choice


BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 (AVX-512 BF16, AMX), Arm (FEAT_BF16)


def native_bf16():
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(" ".join(line for line in f if line.startswith(("flags", "Features"))).split())
    except OSError:
        return []
    return [f for f in BF16_FLAGS if f in flags]


def use_bf16(choice, on_gpu):
    """--bf16 -> "on"/"off" (auto: GPU only); "on" on a CPU without bf16 instructions (emulated: slow) is one line."""
    if choice == "on" and not on_gpu and not native_bf16():
        fail("--bf16 on: this CPU has no bf16 instructions (none of " + ", ".join(BF16_FLAGS) + " in /proc/cpuinfo), "
             "so bf16 matmuls would be emulated, far slower than fp32; leave --bf16 at auto", once=True)
    return ("on" if on_gpu else "off") if choice == "auto" else choice


def use_layer_units(choice, on_gpu, world=1):
    """--fsdp_units -> per-layer FSDP2 units (auto: on more than one GPU: one GPU has no gather to overlap)."""
    return on_gpu and world > 1 if choice == "auto" else choice == "layers"


def _tokens_or_off(value):
    return None if value == "off" else value if value == "auto" else int(value)


def add_trainer_flags(p):
    """spo.py's trainer flags, resolved here and by memory.check_rank_memory."""
    p.add_argument("--micro_batch_size", type=int, default=64, help=argparse.SUPPRESS)  # sequences per pass, at most
    p.add_argument("--max_tokens_per_micro_batch", type=_tokens_or_off, default="auto",
                   help="the update's token budget per forward pass, as the packed row runs it (sequences packed "
                        "longest first and dealt to the ranks by tokens; the no-grad pass takes twice on GPU; auto: "
                        f"{CPU_TOKENS} on CPU, on GPU {GPU_TOKENS} or what the memory estimate fits; 'off': "
                        "micro_batch_size sequences each)")
    p.add_argument("--gradient_checkpointing", choices=["auto", "on", "off"], default="auto", help="recompute each "
                   "decoder layer in the backward pass (auto: on GPU where the budget does not fit without it)")
    # FSDP2's units, per decoder layer or the whole model (bench/gpu_trainer.py compares them; auto: use_layer_units)
    p.add_argument("--fsdp_units", choices=["auto", "layers", "model"], default="auto", help=argparse.SUPPRESS)
    p.add_argument("--bf16", choices=["auto", "on", "off"], default="auto",
                   help="compute in bf16: the trainer (FSDP2 mixed precision, fp32 master weights) and the engine "
                        "(auto: on GPU only; on a CPU with bf16 instructions 'on' is faster: docs/benchmarks.md)")
    p.add_argument("--ignore_memory_estimate", action="store_true",
                   help="start even when the per-rank memory estimate exceeds what a rank has (it errs high)")


_gpu = {"phases": {}, "peak": 0.0}  # GPU: memory in use at this step's phase ends (phase_end), the largest so far


def trainer_plan(flags, model, world, on_gpu, is_main):
    """spo.py's trainer layout, 'auto' resolved here and by the memory estimate (printed; one line if it will not
    fit): (tokens per micro-batch, gradient checkpointing, per-layer FSDP2 units)."""
    layer_units = use_layer_units(flags["fsdp_units"], on_gpu, world)
    max_tokens, checkpointing = check_rank_memory(
        model, world=world, on_gpu=on_gpu, is_main=is_main, batch_size=flags["batch_size"], layer_units=layer_units,
        micro_batch_size=flags["micro_batch_size"], max_tokens=flags["max_tokens_per_micro_batch"],
        max_sequence_len=flags["max_prompt_len"] + flags["max_response_len"], ignore=flags["ignore_memory_estimate"],
        gradient_checkpointing=flags["gradient_checkpointing"], gpu_memory_utilization=flags["gpu_memory_utilization"])
    return max_tokens, checkpointing, layer_units


def phase_end(on_gpu, phase):
    """GPU: the memory in use at a phase's end, total - free (max_memory_allocated would miss the CUDA context)."""
    if on_gpu:
        free, total = torch.cuda.mem_get_info()
        _gpu["phases"][phase] = total - free


def peak_resident_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def peak_metrics(on_gpu):
    """memory/peak_gib over the ranks so far (CPU: VmHWM; GPU: phase_end's), against the estimate at start."""
    from machinery.collectives import all_reduce_np
    if not on_gpu:
        return {"memory/peak_gib": float(all_reduce_np([peak_resident_bytes()], op="max")[0]) / GIB}
    names = sorted(_gpu["phases"])
    used = all_reduce_np([_gpu["phases"].pop(name) for name in names] + [0.0], op="max") / GIB  # every rank alike
    _gpu["peak"] = max(_gpu["peak"], float(used.max()))
    return {"memory/peak_gib": _gpu["peak"], **{f"memory/{name}_gib": float(v) for name, v in zip(names, used)}}


def prefer_flash_attention(on_gpu):
    """cuDNN's attention off on a GPU: it plans each exact shape it meets, and packed rows bring new ones often."""
    if on_gpu:
        torch.backends.cuda.enable_cudnn_sdp(False)
