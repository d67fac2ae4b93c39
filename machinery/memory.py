"""No library estimates a rank's memory before it starts; this buys one line instead of a SIGKILL minutes in.

How much memory one rank needs, estimated before anything heavy starts. Without it a run that does not fit ends
as the kernel's SIGKILL (`exitcode -9` from torchrun, nothing else) minutes into the first step. spo.py calls
`check_rank_memory` before building the policy: the estimate printed once, and one line naming the flag to change
when it exceeds what a rank has. How the trainer cuts its work within that budget is batching.py.

The estimate is arithmetic: the model's shapes come from its config (parameters counted on the meta device, so
nothing is loaded), the rest from the flags. Per rank:
- trainer state, sharded by FSDP2: fp32 weights, fp32 gradients, AdamW's two moments;
- gathered weights: with per-layer FSDP units the root unit (embedding, output projection, final norm) and two
  decoder layers (one prefetched), otherwise the whole model, full size, and their gradients before the
  reduce-scatter;
- activations: tokens per forward pass x bytes per token (every decoder layer's saved tensors, or with gradient
  checkpointing each layer's input plus one layer recomputed), the largest item for a real model;
- the log-prob chunks (batching.LOGIT_CHUNK_BYTES of fp32 logits, their softmax and gradient);
- the engine: on CPU fp32 weights (counted twice), the KV cache (VLLM_CPU_KVCACHE_SPACE) and the process's
  libraries; on GPU vLLM's share of the card while it generates (`--gpu_memory_utilization`; the trainer then
  holds its shards and the root unit the weight push left gathered), asleep while the trainer works;
- on GPU also what stays on the card in every phase: the CUDA context, the NCCL communicator, vLLM's runtime at
  sleep level 2 (CUDA-graph pools, persistent buffers), and FSDP2's fp32 reduce-scatter buffers while training.
The per-token constant was measured on this project's CPU machine (docs/own-model-and-data.md); it errs
high. GPU numbers are the same arithmetic in bf16 plus estimates read from the sources named at each constant;
they have never been checked on a GPU (docs/scale.md).

    python -m machinery.memory --model smollm/model --tokens 2048   # the estimate for 2 ranks, nothing started
"""
import argparse
import os
from dataclasses import dataclass


from machinery.batching import LOGIT_CHUNK_BYTES

GIB = 2 ** 30
# Saved activations per decoder layer and token, in elements: ACT_HIDDEN x hidden + ACT_MLP x intermediate. Set
# above what autograd saves (SmolLM2-135M in fp32: 1.70 MiB per token over 30 layers, i.e. 14.8k elements per
# layer and token; the formula gives 16.5k) and above the growth of the process's peak memory with tokens (1.5-1.7
# MiB per token). Attention by SDPA saves no (T, T) scores, so sequence length does not enter (measured: 2 x 1024
# and 16 x 128 tokens peaked alike).
ACT_HIDDEN, ACT_MLP = 18, 4
# With gradient checkpointing autograd keeps each layer's input (1.1 x hidden elements per layer and token for
# SmolLM2), but on CPU the process's peak grows by 0.43 MiB per token, 6 x hidden per layer: freed blocks stay
# with the C allocator. PyTorch's GPU caching allocator reuses its blocks; 2 there is arithmetic, not measured.
CKPT_HIDDEN = {"cpu": 6, "gpu": 2}
# A CPU rank's process besides the model and the KV cache: python, torch, vLLM's libraries and runtime (a toy rank
# peaks at 1.9 GiB with a 1 GiB KV cache and a model of 2 MiB).
CPU_PROCESS_BYTES = 1.25 * GIB
# GPU, per rank, estimates (never measured here). The CUDA context with the kernels torch and vLLM load and cuBLAS's
# workspaces: 0.5-1 GiB on H100-class cards (vLLM's start-up report counts it in "non_torch_memory": 1.27 GiB on an
# 80 GB card in the log of vLLM PR #11743).
GPU_CONTEXT_BYTES = 1 * GIB
# The trainer's one NCCL communicator (FSDP2 and our collectives share the default process group; vLLM with
# tensor_parallel_size 1 makes none: its groups of one rank skip the device communicator, vllm 0.32
# distributed/parallel_state.py). NCCL's buffers grow with channels and NVLink SHARP: about 1.6 GB for one
# communicator after an all-reduce (NVIDIA/nccl issue #864), 0.5-0.7 GB per group on 4 A100s (issue #964).
GPU_NCCL_BYTES = 1.5 * GIB
# vLLM asleep at level 2 discards its weights and KV cache but keeps its CUDA-graph pool (1.4 GiB for a TP8 model in
# vLLM issue #47654; offloading it is unmerged work, PRs #45623 and #56373) and the model runner's persistent
# buffers and attention workspace, allocated by torch.
GPU_ENGINE_ASLEEP_BYTES = 3 * GIB


@dataclass
class ModelShape:
    """What the estimate needs from a model's config."""
    parameters: int  # all parameters, tied ones once
    root_parameters: int  # outside the decoder layers: embedding, output projection (if untied), final norm
    layer_parameters: int  # the largest decoder layer
    layers: int
    hidden: int
    intermediate: int
    vocab: int


def model_shape(model_path, config=None):
    """ModelShape of a Hugging Face causal LM, built on the meta device from its config (no weights read); config:
    the config itself, instead of the model's path (bench/gpu.py)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = config or AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = model.model.layers
    in_layers = sum(p.numel() for p in layers.parameters())
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    return ModelShape(parameters=total, root_parameters=total - in_layers,
                      layer_parameters=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
                      layers=len(layers), hidden=text.hidden_size,
                      intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size), vocab=text.vocab_size)


def tokens_per_forward(micro_batch_size, max_tokens_per_micro_batch, sequences_per_rank, max_sequence_len):
    """The most tokens (padding included) one forward pass of the trainer can hold, from the flags: a token budget
    bounds it, but a sequence longer than the budget still gets a micro-batch of its own
    (plan_micro_batches); without one it is micro_batch_size sequences of the longest possible length."""
    if max_tokens_per_micro_batch is not None:
        return max(min(max_tokens_per_micro_batch, micro_batch_size * max_sequence_len), max_sequence_len)
    return min(micro_batch_size, sequences_per_rank) * max_sequence_len


def rank_memory(shape, *, world, tokens, on_gpu, gradient_checkpointing, layer_units=True, kv_cache_gib=1.0,
                gpu_bytes=0, gpu_memory_utilization=0.5, engine=True):
    """Estimated peak bytes of one rank, as {item: bytes} (see the module docstring); "peak" is the total.
    engine: a colocated vLLM engine (spo.py); False: the trainer alone (bench/gpu.py)."""
    compute = 2 if on_gpu else 4  # bytes per activation: bf16 compute on GPU, fp32 on CPU
    per_layer_token = (ACT_HIDDEN * shape.hidden + ACT_MLP * shape.intermediate) * compute
    if gradient_checkpointing:  # each layer's input kept, one layer's activations recomputed at a time
        per_token = shape.layers * CKPT_HIDDEN["gpu" if on_gpu else "cpu"] * shape.hidden * compute + per_layer_token
    else:
        per_token = shape.layers * per_layer_token
    unit = shape.root_parameters + 2 * shape.layer_parameters if layer_units else shape.parameters
    gathered = unit * compute
    items = {"trainer state (sharded)": shape.parameters * 16 / world,  # fp32 weights + gradients + 2 moments
             "gathered weights and their gradients": 2 * gathered,
             "activations": tokens * per_token,
             "log-prob chunks": 3 * min(LOGIT_CHUNK_BYTES, tokens * shape.vocab * 4)}
    if on_gpu:
        items["fp32 output projection"] = 2 * shape.vocab * shape.hidden * 4  # the fp32 copy and its gradient
        # foreach_reduce casts a unit's bf16 gradients into one fp32 buffer of the unit's full size for the
        # reduce-scatter (torch 2.13 fsdp/_fully_shard/_fsdp_collectives.py): the root unit's, and the previous
        # unit's still in flight (layer units), or the whole model's
        items["FSDP2 fp32 reduce-scatter buffers"] = 4 * (shape.root_parameters + shape.layer_parameters
                                                          if layer_units else shape.parameters)
        resident = {"CUDA context": GPU_CONTEXT_BYTES, "NCCL communicator": GPU_NCCL_BYTES if world > 1 else 0,
                    "engine asleep (while training)": GPU_ENGINE_ASLEEP_BYTES if engine else 0}
        training = sum(items.values()) + sum(resident.values())
        # while vLLM generates: the trainer's sharded weights and moments, and the root unit the weight push left
        # gathered for the next forward (collectives.full_parameters); vLLM's share counts from the card's total
        generating = (shape.parameters * 12 / world + gathered + gpu_memory_utilization * gpu_bytes
                      + resident["CUDA context"] + resident["NCCL communicator"]) if engine else 0
        items.update(resident)
        items["peak"] = max(training, generating)
        return items
    # Counted twice: a SmolLM2 rank at 1024 tokens per forward peaked 1.4% under the estimate with one copy, and
    # the engine holds more than its fp32 weights (the tied output projection packed separately, load buffers).
    if engine:
        items["engine weights (fp32, x2)"] = 2 * shape.parameters * 4
        items["engine KV cache"] = kv_cache_gib * GIB
    items["process (python, torch, vLLM)"] = CPU_PROCESS_BYTES
    items["peak"] = sum(items.values())
    return items


def available_per_rank(on_gpu, local_ranks):
    """Bytes one rank can have: the GPU's total memory, or on CPU the host's available memory (MemAvailable:
    free plus what the kernel can reclaim) shared by the node's ranks."""
    if on_gpu:
        import torch
        return torch.cuda.mem_get_info()[1]
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024 / local_ranks


def fitting_tokens(shape, budget, **kwargs):
    """The most tokens per forward pass that keep rank_memory's peak within `budget` bytes (0 if none do)."""
    low, high = 0, 1 << 24
    while low < high:
        mid = (low + high + 1) // 2
        if rank_memory(shape, tokens=mid, **kwargs)["peak"] <= budget:
            low = mid
        else:
            high = mid - 1
    return low


# The update's token budget per micro-batch on a GPU where memory allows (verl's ppo_max_token_len_per_gpu): the
# host's cost is per layer and operator, not per token, and ~10k tokens of device work hide it (docs/benchmarks.md).
# The CPU keeps 2048: no device to keep busy, and a larger row only grows the process (no faster step measured).
GPU_TOKENS, CPU_TOKENS = 16384, 2048


def auto_budget(shape, budget, max_tokens, checkpointing, *, max_sequence_len, **common):
    """--max_tokens_per_micro_batch and --gradient_checkpointing resolved: (tokens, checkpointing, the reason).
    max_tokens: 'auto', a number or None (off); checkpointing: 'auto', 'on' or 'off'. On a GPU 'auto' tokens are
    GPU_TOKENS where the estimate fits them, else the most that fits (in steps of 1024, at least one sequence), and
    'auto' checkpointing is off where those tokens fit without it: it recomputes every layer (+33% FLOPs) and adds
    host work per layer. On CPU: CPU_TOKENS, checkpointing off. common: rank_memory's other arguments."""
    on_gpu = common["on_gpu"]
    if not on_gpu or checkpointing != "auto" and max_tokens != "auto":
        tokens = (GPU_TOKENS if on_gpu else CPU_TOKENS) if max_tokens == "auto" else max_tokens
        return tokens, checkpointing == "on", "as given" if max_tokens != "auto" else "CPU default"

    def fits(ckpt):
        return fitting_tokens(shape, budget, gradient_checkpointing=ckpt, **common)
    if max_tokens != "auto":  # the tokens given, checkpointing auto
        need = tokens_per_forward(1 << 30, max_tokens, 1 << 30, max_sequence_len)
        return max_tokens, need > fits(False), f"{need} tokens {'do not fit' if need > fits(False) else 'fit'} without"
    for ckpt in (False, True) if checkpointing == "auto" else (checkpointing == "on",):
        if fits(ckpt) >= GPU_TOKENS:
            return GPU_TOKENS, ckpt, f"{GPU_TOKENS} tokens fit {'only with' if ckpt else 'without'} checkpointing"
    ckpt, fit = checkpointing != "off", fits(checkpointing != "off") // 1024 * 1024
    return max(fit, max_sequence_len), ckpt, "the most tokens that fit" if fit >= max_sequence_len else "none fit"


def check_rank_memory(model, *, world, on_gpu, is_main, batch_size, micro_batch_size, max_tokens, max_sequence_len,
                      gradient_checkpointing, layer_units, gpu_memory_utilization, ignore=False):
    """spo.py's check: resolve the 'auto' budgets (auto_budget), print the estimate (rank 0) and stop with one line
    naming the flag if it will not fit. Returns (the update's tokens per micro-batch, gradient checkpointing).
    max_tokens: --max_tokens_per_micro_batch ('auto', a number, None: off); gradient_checkpointing: 'auto', 'on' or
    'off'; ignore (--ignore_memory_estimate): warn instead of stopping (the estimate errs high)."""
    from machinery.errors import fail
    shape = model_shape(model)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", 1))
    gpu_bytes = available_per_rank(True, local_ranks) if on_gpu else 0
    budget = available_per_rank(on_gpu, local_ranks)
    common = dict(world=world, on_gpu=on_gpu, layer_units=layer_units, kv_cache_gib=kv, gpu_bytes=gpu_bytes,
                  gpu_memory_utilization=gpu_memory_utilization)
    max_tokens, checkpointing, why = auto_budget(shape, budget, max_tokens, gradient_checkpointing,
                                                 max_sequence_len=max_sequence_len, **common)
    common["gradient_checkpointing"] = checkpointing
    tokens = tokens_per_forward(micro_batch_size, max_tokens, 2 * batch_size // world,  # batch + revisited responses
                                max_sequence_len)
    items = rank_memory(shape, tokens=tokens, **common)
    if is_main:
        print(f"memory per rank (estimate): {items['peak'] / GIB:.1f} GiB of {budget / GIB:.1f} GiB available "
              f"({shape.parameters / 1e6:.0f}M parameters, {tokens} tokens per forward pass: activations "
              f"{items['activations'] / GIB:.1f} GiB, gradient checkpointing {'on' if checkpointing else 'off'}, "
              f"FSDP units: {'layers' if layer_units else 'the whole model'}; budget {max_tokens} tokens: {why})",
              flush=True)
    if items["peak"] <= budget:
        return max_tokens, checkpointing
    fit = fitting_tokens(shape, budget, **common)
    flag, value = (("--max_tokens_per_micro_batch", max_tokens) if max_tokens is not None
                   else ("--micro_batch_size", micro_batch_size))
    remedy = (f"pass --max_tokens_per_micro_batch {fit} or less" if fit >= max_sequence_len
              else "shorten --max_response_len / --max_prompt_len, use fewer ranks per node, or "
                   "--gradient_checkpointing on")
    message = (f"{flag} {value}: a rank needs about {items['peak'] / GIB:.1f} GiB ({tokens} tokens per forward pass "
               f"take {items['activations'] / GIB:.1f} GiB of activations) but has {budget / GIB:.1f} GiB; {remedy} "
               f"(--ignore_memory_estimate to start anyway)")
    if not ignore:
        fail(message, once=True)
    if is_main:
        print(f"warning: {message}", flush=True)
    return max_tokens, checkpointing


def _tokens_or_off(value):
    """--max_tokens_per_micro_batch: a number of tokens, 'auto', or 'off' (None)."""
    return None if value == "off" else value if value == "auto" else int(value)


def add_memory_flags(p):
    """spo.py's trainer flags that the estimate reads: how its forward passes are cut, checkpointing, FSDP2's units,
    bf16 (the device decisions: device.py)."""
    p.add_argument("--micro_batch_size", type=int, default=64, help=argparse.SUPPRESS)  # sequences per pass, at most
    p.add_argument("--max_tokens_per_micro_batch", type=_tokens_or_off, default="auto",
                   help="the update's token budget per forward pass, as the packed row runs it (sequences packed "
                        "longest first and dealt to the ranks by tokens; the no-grad pass takes twice on GPU; auto: "
                        f"{CPU_TOKENS} on CPU, on GPU {GPU_TOKENS} or what the memory estimate fits; 'off': "
                        "micro_batch_size sequences each)")
    p.add_argument("--gradient_checkpointing", choices=["auto", "on", "off"], default="auto",
                   help="recompute each decoder layer in the backward pass (auto: on GPU where the budget does not "
                        "fit without it)")
    # FSDP2's units (bench/gpu_trainer.py compares them): each decoder layer (one layer's full weights at a time) or
    # the whole model (one gather per pass); auto: layers on more than one GPU, else model
    p.add_argument("--fsdp_units", choices=["auto", "layers", "model"], default="auto", help=argparse.SUPPRESS)
    p.add_argument("--bf16", choices=["auto", "on", "off"], default="auto",
                   help="compute in bf16: the trainer (FSDP2 mixed precision, fp32 master weights) and the engine "
                        "(auto: on GPU only; on a CPU with bf16 instructions 'on' is faster: docs/benchmarks.md)")
    p.add_argument("--ignore_memory_estimate", action="store_true",
                   help="start even when the per-rank memory estimate exceeds what a rank has (it errs high)")


def main():
    p = argparse.ArgumentParser(description="Estimate one rank's peak memory for an spo.py run (nothing starts).")
    p.add_argument("--model", required=True, help="Hugging Face model directory or hub name")
    p.add_argument("--world", type=int, default=2, help="ranks")
    p.add_argument("--gpu", action="store_true", help="estimate for GPUs (bf16 compute, vLLM asleep while training)")
    p.add_argument("--gpu_gib", type=float, default=80.0, help="memory of one GPU (GiB)")
    p.add_argument("--cpu_kv_cache_gib", type=int, default=None, help="the CPU engine's KV cache per rank (GiB)")
    p.add_argument("--gpu_memory_utilization", type=float, default=0.5, help="vLLM's share of each GPU (as spo.py)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per forward pass")
    p.add_argument("--gradient_checkpointing", action="store_true", help="checkpoint each decoder layer")
    p.add_argument("--fsdp_units", choices=["auto", "layers", "model"], default="auto",
                   help="FSDP2 units (auto: layers on more than one GPU, else model)")
    args = p.parse_args()
    layer_units = args.gpu and args.world > 1 if args.fsdp_units == "auto" else args.fsdp_units == "layers"
    items = rank_memory(model_shape(args.model), world=args.world, tokens=args.tokens, on_gpu=args.gpu,
                        gradient_checkpointing=args.gradient_checkpointing, layer_units=layer_units,
                        kv_cache_gib=args.cpu_kv_cache_gib or 1,
                        gpu_bytes=args.gpu_gib * GIB, gpu_memory_utilization=args.gpu_memory_utilization)
    for name, value in items.items():
        if name == "peak" and args.gpu:  # the GPU's two peaks: the trainer at work, and vLLM generating
            print(f"{'while training':40s} {sum(v for k, v in items.items() if k != 'peak') / GIB:8.2f} GiB")
        print(f"{name:40s} {value / GIB:8.2f} GiB")


if __name__ == "__main__":
    main()
