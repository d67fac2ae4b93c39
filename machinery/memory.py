"""A rank's memory: the estimate before anything starts, the trainer's layout that fits it (its flags and their
`auto` values: tokens per micro-batch, gradient checkpointing, FSDP2 units), and what a run used (memory/*).

No library estimates a rank's memory before it starts; the estimate buys one line instead of a SIGKILL minutes in.
Arithmetic from the config and the flags; it errs high on CPU, and the GPU constants are unchecked (docs/scale.md).

    python -m machinery.memory --model smollm/model --tokens 2048   # the estimate for 2 ranks, nothing started
"""
import argparse
import bisect
import os
from dataclasses import dataclass

from machinery.batching import LOGIT_CHUNK_BYTES

GIB = 2 ** 30
# Saved activations per decoder layer and token, in elements: ACT_HIDDEN x hidden + ACT_MLP x intermediate, set
# above what autograd saves and above the process's growth with tokens (measured: docs/own-model-and-data.md). SDPA
# saves no (T, T) scores, so sequence length does not enter.
ACT_HIDDEN, ACT_MLP = 18, 4
# With gradient checkpointing, hidden elements kept per layer and token: on CPU freed blocks stay with the C
# allocator (measured); the GPU's caching allocator reuses its blocks (arithmetic, not measured).
CKPT_HIDDEN = {"cpu": 6, "gpu": 2}
CPU_PROCESS_BYTES = 1.25 * GIB  # python, torch, vLLM's libraries (a toy rank peaks at 1.9 GiB with 1 GiB of KV)
# GPU, per rank, estimates from reported numbers, never measured here (sources: docs/scale.md): the CUDA context,
# the trainer's one NCCL communicator (vLLM at tensor-parallel size 1 makes none), and vLLM asleep at level 2 (its
# CUDA-graph pool and persistent buffers stay).
GPU_CONTEXT_BYTES = 1 * GIB
GPU_NCCL_BYTES = 1.5 * GIB
GPU_ENGINE_ASLEEP_BYTES = 3 * GIB


@dataclass
class ModelShape:
    parameters: int  # all parameters, tied ones once
    root_parameters: int  # outside the decoder layers: embedding, output projection (if untied), final norm
    layer_parameters: int  # the largest decoder layer
    layers: int
    hidden: int
    intermediate: int
    vocab: int


def model_shape(model_path, config=None):
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
    """The most tokens one forward pass can hold, as plan_micro_batches cuts them."""
    if max_tokens_per_micro_batch is not None:
        return max(min(max_tokens_per_micro_batch, micro_batch_size * max_sequence_len), max_sequence_len)
    return min(micro_batch_size, sequences_per_rank) * max_sequence_len


def rank_memory(shape, *, world, tokens, on_gpu, gradient_checkpointing, layer_units=True, kv_cache_gib=1.0,
                gpu_bytes=0, gpu_memory_utilization=0.5, engine=True, reference=False):
    """Estimated peak bytes of one rank, {item: bytes}, "peak" the total (engine False: the trainer alone;
    reference: --kl_coef's frozen initial policy, fp32 shards beside the policy's)."""
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
    if reference:  # its passes gather a unit as the policy's do, never at the same time: only the shards add
        items["reference weights (sharded)"] = shape.parameters * 4 / world
    if on_gpu:
        items["fp32 output projection"] = 2 * shape.vocab * shape.hidden * 4  # the fp32 copy and its gradient
        # foreach_reduce casts a unit's bf16 gradients into one full-size fp32 buffer: the root unit's and the
        # previous unit's still in flight, or the whole model's (torch 2.13 fsdp/_fully_shard/_fsdp_collectives.py)
        items["FSDP2 fp32 reduce-scatter buffers"] = 4 * (shape.root_parameters + shape.layer_parameters
                                                          if layer_units else shape.parameters)
        resident = {"CUDA context": GPU_CONTEXT_BYTES, "NCCL communicator": GPU_NCCL_BYTES if world > 1 else 0,
                    "engine asleep (while training)": GPU_ENGINE_ASLEEP_BYTES if engine else 0}
        training = sum(items.values()) + sum(resident.values())
        # while vLLM generates: the trainer's shards and the root unit the weight push left gathered
        # (and the reference's shards)
        generating = ((12 + 4 * reference) * shape.parameters / world + gathered + gpu_memory_utilization * gpu_bytes
                      + resident["CUDA context"] + resident["NCCL communicator"]) if engine else 0
        items.update(resident)
        items["peak"] = max(training, generating)
        return items
    # Counted twice: the engine holds more than its fp32 weights (a tied head packed apart, load buffers)
    if engine:
        items["engine weights (fp32, x2)"] = 2 * shape.parameters * 4
        items["engine KV cache"] = kv_cache_gib * GIB
    items["process (python, torch, vLLM)"] = CPU_PROCESS_BYTES
    items["peak"] = sum(items.values())
    return items


def available_per_rank(on_gpu, local_ranks):
    if on_gpu:
        import torch
        return torch.cuda.mem_get_info()[1]
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024 / local_ranks


def fitting_tokens(shape, budget, **kwargs):
    """The most tokens (at most 2^24; 0 if none) whose peak fits budget, by bisection: the peak grows with them."""
    peak = lambda tokens: rank_memory(shape, tokens=tokens, **kwargs)["peak"]  # noqa: E731
    return max(bisect.bisect_right(range((1 << 24) + 1), budget, key=peak) - 1, 0)


# The update's tokens per micro-batch: on a GPU ~10k hide the host's cost per layer (docs/benchmarks.md)
GPU_TOKENS, CPU_TOKENS = 16384, 2048


def auto_budget(shape, budget, max_tokens, checkpointing, *, max_sequence_len, **common):
    """(tokens, checkpointing, the reason). On a GPU 'auto' tokens are GPU_TOKENS or the most that fit, and 'auto'
    checkpointing is off where those fit without it (it recomputes every layer: +33% FLOPs). CPU: CPU_TOKENS, off."""
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
                      gradient_checkpointing, layer_units, gpu_memory_utilization, ignore=False, reference=False):
    """spo.py's check: (tokens per micro-batch, checkpointing) resolved and printed, or one line if they won't fit."""
    from machinery.errors import fail
    shape = model_shape(model)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", 1))
    budget = available_per_rank(on_gpu, local_ranks)  # on a GPU: the card's total
    common = dict(world=world, on_gpu=on_gpu, layer_units=layer_units, kv_cache_gib=kv, reference=reference,
                  gpu_bytes=budget if on_gpu else 0, gpu_memory_utilization=gpu_memory_utilization)
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
    remedy = (f"pass --max_tokens_per_micro_batch {fit} or less" if fit >= max_sequence_len else
              "shorten --max_response_len / --max_prompt_len, use fewer ranks per node, or --gradient_checkpointing on")
    message = (f"{flag} {value}: a rank needs about {items['peak'] / GIB:.1f} GiB ({tokens} tokens per forward pass "
               f"take {items['activations'] / GIB:.1f} GiB of activations) but has {budget / GIB:.1f} GiB; {remedy} "
               f"(--ignore_memory_estimate to start anyway)")
    if not ignore:
        fail(message, once=True)
    if is_main:
        print(f"warning: {message}", flush=True)
    return max_tokens, checkpointing


# ------------------------------------------------------------------------------------------------ the trainer's layout
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


def trainer_plan(flags, model, world, on_gpu, is_main):
    """spo.py's trainer layout, 'auto' resolved here and by the memory estimate (printed; one line if it will not
    fit): (tokens per micro-batch, gradient checkpointing, per-layer FSDP2 units)."""
    layer_units = use_layer_units(flags["fsdp_units"], on_gpu, world)
    max_tokens, checkpointing = check_rank_memory(
        model, world=world, on_gpu=on_gpu, is_main=is_main, batch_size=flags["batch_size"], layer_units=layer_units,
        micro_batch_size=flags["micro_batch_size"], max_tokens=flags["max_tokens_per_micro_batch"],
        max_sequence_len=flags["max_prompt_len"] + flags["max_response_len"], ignore=flags["ignore_memory_estimate"],
        gradient_checkpointing=flags["gradient_checkpointing"], gpu_memory_utilization=flags["gpu_memory_utilization"],
        reference=flags["kl_coef"] != 0)
    return max_tokens, checkpointing, layer_units


# ------------------------------------------------------------------------------------------------ memory used
_gpu = {"phases": {}, "peak": 0.0}  # GPU: memory in use at this step's phase ends (phase_end), the largest so far


def phase_end(on_gpu, phase):
    """GPU: the memory in use at a phase's end, total - free (max_memory_allocated would miss the CUDA context)."""
    if on_gpu:
        import torch
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
    items = rank_memory(model_shape(args.model), world=args.world, tokens=args.tokens, on_gpu=args.gpu,
                        gradient_checkpointing=args.gradient_checkpointing,
                        layer_units=use_layer_units(args.fsdp_units, args.gpu, args.world),
                        kv_cache_gib=args.cpu_kv_cache_gib or 1,
                        gpu_bytes=args.gpu_gib * GIB, gpu_memory_utilization=args.gpu_memory_utilization)
    for name, value in items.items():
        if name == "peak" and args.gpu:  # the GPU's two peaks: the trainer at work, and vLLM generating
            print(f"{'while training':40s} {sum(v for k, v in items.items() if k != 'peak') / GIB:8.2f} GiB")
        print(f"{name:40s} {value / GIB:8.2f} GiB")


if __name__ == "__main__":
    main()
