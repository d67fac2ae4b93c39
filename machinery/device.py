"""The machine: what the three programs do first on it (torch.distributed on gloo or nccl, the CPU engine's KV
cache, the engine that imports) and what it computes in (bf16 where it has the instructions, the GPU's attention)."""
import datetime
import os

import torch
import torch.distributed as dist

from machinery.console import quiet_vllm
from machinery.errors import fail


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
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:  # said by the first try's first rank only
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or os.environ.get("RANK", "0") != "0":
            raise SystemExit(2)
        fail(f"torchrun --max-restarts {os.environ['TORCHELASTIC_MAX_RESTARTS']}: restarting the ranks inside one "
             f"torchrun is not supported (the restarted ranks' groups failed to connect or hung in trials); start "
             f"torchrun without it, and rerun or requeue the whole job with --resume auto (docs/scale.md)")
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


def prefer_flash_attention(on_gpu):
    """cuDNN's attention off on a GPU: it plans each exact shape it meets, and packed rows bring new ones often."""
    if on_gpu:
        torch.backends.cuda.enable_cudnn_sdp(False)
