"""On torch FSDP2 (fully_shard) and transformers: the policy-gradient trainer TRL or verl has, in one readable file.

spo.py tells the algorithm's story and holds its math (the advantages, D(x), the PPO-clip loss of Eq. 10); this
file holds the mechanics that any policy-gradient trainer on torch FSDP2 needs (the policy, its log-probs, the
update loop):
- `setup_distributed`: torch.distributed on gloo (CPU) or nccl (GPU); `python spo.py` works as a world of 1.
- `build_policy`: a Hugging Face causal LM sharded with FSDP2 (`fully_shard` per decoder layer, then the root, or
  the whole model as one unit); on GPU bf16 compute with fp32 master weights and fp32 gradient reduction; FSDP2's
  own weight gather and gradient reduce-scatter (gloo's or nccl's).
- `token_logprobs` (via `response_logprobs`): the decoder once per micro-batch, its sequences packed into one row
  without padding and shared prefixes once (batching.packed_row, packed_attention), the output projection only
  at response positions, with fp32 logits (from a bf16 GEMM accumulating in fp32 under bf16) and in chunks, so
  no (B, T, V) logits tensor exists at any vocabulary size.
- `old_logprobs` / `ppo_update`: per-token log-probs of prompt + response sequences in micro-batches, and the
  optimiser steps around a loss function given by the caller, normalised by the GLOBAL token count. FSDP2
  averages gradients over ranks; that loss is already a global mean, so each rank scales its loss by the world
  size to get the true gradient (set_gradient_divide_factor(1) would do the same but fails on gloo).
- `clip_grad_norm`: torch's gradient clipping on FSDP2's shards in one collective. The small collectives and the
  full weights for the push are in collectives.py, checkpoints in checkpoint.py, what a run records in metrics.py.
"""
import datetime
import functools
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from machinery.collectives import all_gather_np, all_gather_objects, all_reduce_np
from machinery.device import prefer_flash_attention
from machinery.metrics import learning_warning, vllm_gap
from machinery.errors import fail
from machinery.batching import (IDLE, LOGIT_CHUNK_BYTES, PACKED_ATTENTION, deal_by_tokens, micro_batches, pack,
                                packed_row, use_packed_attention)


# ------------------------------------------------------------------------------------------------ setup
# How long a rank waits in a collective before the job fails. NCCL's default, 10 minutes, is shorter than rank 0
# writing an 8B model's HF export (16 GB in bf16) on a slow disk while the others wait at the barrier.
DIST_TIMEOUT = datetime.timedelta(minutes=60)


def setup_distributed():
    """Start torch.distributed. Under torchrun the environment says who we are; plain `python spo.py` is a
    world of one (vLLM's external launcher needs the process group either way)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    # torch.distributed.nn's functions take `group=group.WORLD` as a default, evaluated on import: imported after
    # init_process_group (transformers' model and tokenizer modules do), they hold the group past
    # destroy_process_group, and its gloo threads can abort the exit ("terminate called without an active
    # exception", exit -6, seen in CI). Imported first, the defaults are None.
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


# ------------------------------------------------------------------------------------------------ the policy
def build_policy(path, device, lr, weight_decay, gradient_checkpointing=None, layer_units=None, bf16=None):
    """The policy: a Hugging Face causal LM in training mode, sharded with FSDP2, and its AdamW optimiser.
    gradient_checkpointing: recompute each decoder layer's activations in the backward pass (None: on GPU only,
    where long responses make the saved activations the largest memory item).
    layer_units: each decoder layer its own FSDP2 unit (None: on GPU only, where FSDP2 overlaps the next layer's
    gather with compute); on CPU a rank's one thread pays every unit's gathers in turn, so one unit is faster.
    bf16: forward and backward in bf16 with FSDP2's mixed precision (the fp32 parameters stay the master copy the
    optimiser updates; gradients are reduced in fp32). None: on GPU only; on CPU it pays only where the cores have
    bf16 instructions (device.use_bf16 refuses it elsewhere).

    Only rank 0 reads the weights (in fp32, on the host: 33 GB for an 8B model); the other ranks build the model
    on the meta device, and each rank receives its own shard by broadcast (set_model_state_dict with
    broadcast_from_rank0), so a node holds one full copy on the host, not one per GPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) if dist.get_rank() == 0 else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    on_gpu = device.type == "cuda"
    prepare_for_training(model, on_gpu if gradient_checkpointing is None else gradient_checkpointing)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    bf16 = on_gpu if bf16 is None else bf16
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    for unit in [*(model.model.layers if (on_gpu if layer_units is None else layer_units) else []), model]:
        fully_shard(unit, mesh=mesh, **({"mp_policy": mp} if mp else {}))
    attach_logprob_forward(model)
    model.to_empty(device=device)  # storage for this rank's shards (and the buffers), contents undefined
    set_model_state_dict(model, loaded.state_dict() if loaded is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers that are not in the state dict (rotary inv_freq) are computed at construction, which on the meta
    # device computed nothing: rank 0 copies its own and broadcasts them.
    loaded_buffers = dict(loaded.named_buffers()) if loaded is not None else {}
    for name, buffer in model.named_buffers():
        if loaded is not None:
            buffer.copy_(loaded_buffers[name])
        dist.broadcast(buffer, src=0)
    del loaded
    # foreach: one dispatch per operation over all parameters. On CPU torch defaults to a Python loop per
    # parameter, and with FSDP2's DTensors every operation of that loop pays DTensor's dispatch; same numbers.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=True)
    return model, optimizer


def prepare_for_training(model, gradient_checkpointing):
    """Training mode with dropout off, and optionally gradient checkpointing that really happens.

    `from_pretrained` returns a model in eval mode, and transformers checkpoints a layer only while the model is
    training: without `.train()` gradient checkpointing is silently never applied and every activation is kept.
    Dropout stays off: PPO's ratio compares the update's log-probs with the old ones, and dropout noise in either
    would move the ratio away from 1 for no reason (Qwen3 has none; other models may)."""
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0  # attention modules pass it to the attention kernel in training mode
    if gradient_checkpointing:
        # Non-reentrant checkpointing: the variant that composes with FSDP2 and with inputs that need no grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


HALF = (torch.bfloat16, torch.float16)


def _mm_fp32(a, b, into=None):
    """a @ b in fp32 from bf16 (or fp16) a and b, or with `into` (fp32) into += a @ b in place: one half-precision
    GEMM accumulating in fp32 where torch has it for the device (mm's and addmm's out_dtype: CUDA; no CPU kernel in
    torch 2.13), else the same numbers from fp32 copies."""
    if a.is_cuda and "dtype" in torch.ops.aten.mm.overloads():
        if into is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        try:  # fp32 into with bf16 a and b: allowed since pytorch#167931, not in torch 2.8/2.9; 2.11 unverified
            return torch.addmm(into, a, b, out_dtype=torch.float32, out=into)
        except RuntimeError:  # the same sum through a temporary: the memory the buffer saves, not the numbers
            return into.add_(torch.mm(a, b, out_dtype=torch.float32))
    return torch.mm(a.float(), b.float()) if into is None else into.addmm_(a.float(), b.float())


class _WeightGradient(torch.autograd.Function):
    """The output projection's weight gradient under bf16, summed over the chunks in ONE fp32 buffer, total["sum"],
    into which each chunk's _HalfInputLogits adds its share in place (not a fresh (V, H) fp32 gradient per chunk for
    autograd to add up). Every chunk takes this function's output (an empty tensor), so autograd runs this backward
    after all of theirs: it hands the weight the sum in the weight's dtype, its one gradient through autograd (under
    FSDP2 mixed precision the gathered bf16 copy's, which FSDP2 reduce-scatters after the backward)."""

    @staticmethod
    def forward(ctx, weight, total):
        ctx.total, ctx.dtype = total, weight.dtype
        return weight.new_empty(0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _):
        return ctx.total.pop("sum").to(ctx.dtype), None  # (the buffer freed once cast)


class _HalfInputLogits(torch.autograd.Function):
    """(n, V) fp32 logits hidden @ weight.T from bf16 hidden (n, H) and weight (V, H). A product of two bf16 values
    is exact in fp32, so these are the fp32 projection's logits (up to the order of the sum) from a bf16 GEMM, not
    an fp32 one (no TF32 by default: several times slower). mm's out_dtype has no derivative (torch 2.13): hence
    this function. token, total: _WeightGradient's output and buffer, into which the backward adds the weight's
    gradient in fp32 (None: no weight gradient). The logits' gradient is rounded to bf16 for the backward GEMMs, as
    every gradient in the bf16 decoder is."""

    @staticmethod
    def forward(ctx, hidden, weight, token, total):
        ctx.save_for_backward(hidden, weight)  # (FSDP2 keeps the root unit gathered until its backward)
        ctx.total = total
        return _mm_fp32(hidden, weight.t())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # grad: (n, V) fp32
        hidden, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        grad_hidden = _mm_fp32(grad, weight).to(hidden.dtype) if ctx.needs_input_grad[0] else None  # (n, H)
        if ctx.needs_input_grad[2]:  # the weight's, (V, H) fp32, added into the one buffer of all chunks
            ctx.total["sum"] = _mm_fp32(grad.t(), hidden, ctx.total.get("sum"))
        return grad_hidden, None, grad.new_empty(0) if ctx.needs_input_grad[2] else None, None


def _chunk_logprobs(hidden, weight, weight_sum, bias, targets, temperature, with_entropy):
    """(n,) log-probs of `targets` and (n,) entropies (or None) from (n, H) hidden states, with fp32 logits even
    when the model computes in bf16: bf16 logits near 30 are rounded to steps of 0.125, an error the log-probs (and
    PPO's ratio) would inherit. Under bf16 _HalfInputLogits, its weight gradient summed as weight_sum says
    (_WeightGradient's token, None for no weight gradient, and buffer); in fp32 (CPU) an fp32 GEMM on the parameter.
    log p = logit - logsumexp(logits), so the (n, V) log-softmax is never stored."""
    if weight.dtype in HALF and hidden.dtype == weight.dtype:
        logits = _HalfInputLogits.apply(hidden, weight, *weight_sum)  # (n, V) fp32
        logits = (logits if bias is None else logits + bias.float()) / temperature
    else:
        logits = torch.nn.functional.linear(hidden.float(), weight.float(), bias) / temperature  # (n, V) fp32
    normaliser = torch.logsumexp(logits, -1)  # (n,)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - normaliser
    if not with_entropy:
        return logp, None
    with torch.no_grad():  # a metric, never differentiated (the update pass asks for it when it is the old pass)
        p_times_logits = (logits - normaliser[:, None]).exp_().mul_(logits)  # one more (n, V) tensor, not three
        return logp, normaliser - p_times_logits.sum(-1)  # H = logsumexp - E_p[logit]


def response_logprobs(model, ids, rows, cols, temperature, with_entropy=False, chunk=None):
    """(N,) log pi(ids[rows, cols + 1] | ids[rows, :cols + 1]) at the sampling temperature, and the (N,) entropies
    (or None): the decoder runs once over the sequences (packed into one row without padding, a prefix they share
    once: batching.packed_row, where the model takes packed_attention: attach_logprob_forward; else over the
    padded (B, T) rows), the output projection only at the N positions asked for (the response tokens), `chunk`
    positions at a time (default: LOGIT_CHUNK_BYTES of fp32 logits). No (B, T, V) tensor ever exists (Qwen3, V =
    151,936: 12 GB per fp32 copy of the logits of 2 x 10k tokens). With gradients each chunk is checkpointed
    (recomputed in the backward), so the backward too holds one chunk's logits at a time.
    Call it as `model.response_logprobs(...)` after attach_logprob_forward (build_policy does), so that FSDP2
    gathers the parameters around it as it would around `forward`."""
    if model.config._attn_implementation == PACKED_ATTENTION:  # one row without padding (attach_logprob_forward)
        flat, positions, layout, index = packed_row(ids, rows, cols)
        hidden = model.base_model(input_ids=flat, position_ids=positions, packed_layout=layout,
                                  use_cache=False).last_hidden_state[0, index]  # (N, H)
    else:
        flat = ids
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[rows, cols]  # (N, H)
    # the tokens the decoder really ran, for ppo_update's policy/decoder_tokens
    model.decoder_tokens = getattr(model, "decoder_tokens", 0) + flat.numel()
    head = model.get_output_embeddings()
    weight = head.weight  # (V, H): the gathered bf16 copy under bf16 mixed precision, else the fp32 parameter
    total = {}  # under bf16 with gradients: the chunks' weight gradient, summed in one fp32 buffer (_WeightGradient)
    token = _WeightGradient.apply(weight, total) if weight.dtype in HALF and torch.is_grad_enabled() else None
    bias = None if head.bias is None else head.bias.float()
    targets = ids[rows, cols + 1]  # (N,)
    chunk = chunk or max(1, LOGIT_CHUNK_BYTES // (4 * weight.shape[0]))
    logp, entropy = [], []
    for k in range(0, len(targets), chunk):
        part = (hidden[k: k + chunk], weight, (token, total), bias, targets[k: k + chunk], temperature, with_entropy)
        if torch.is_grad_enabled():
            part_logp, part_entropy = checkpoint(_chunk_logprobs, *part, use_reentrant=False)
        else:
            part_logp, part_entropy = _chunk_logprobs(*part)
        logp.append(part_logp)
        entropy.append(part_entropy)
    return torch.cat(logp), (torch.cat(entropy) if with_entropy else None)


def attach_logprob_forward(model):
    """Give the model `model.response_logprobs(ids, rows, cols, temperature, with_entropy)`.

    FSDP2 gathers a sharded module's parameters only around `forward`; the root unit here holds the embedding,
    the final norm and the output projection, which response_logprobs uses outside the model's own forward.
    register_fsdp_forward_method wraps the method in the same gather/release hooks (a no-op without FSDP)."""
    from torch.distributed.fsdp import register_fsdp_forward_method
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("final_logit_softcapping", "logit_scale"):  # applied inside forward, after the projection
        if getattr(config, name, None) not in (None, 1, 1.0):
            fail(f"--model: {config.model_type} scales its logits ({name}={getattr(config, name)}), which "
                 f"trainer.response_logprobs does not apply; this model is not supported yet")
    use_packed_attention(model)  # the decoder on one row without padding (batching.packed_row)
    model.response_logprobs = functools.partial(response_logprobs, model)
    register_fsdp_forward_method(model, "response_logprobs")
    return model


def token_logprobs(model, ids, mask, temperature, with_entropy=False):
    """(B, T-1) log pi(token_t | tokens_<t) where mask > 0 (response tokens; 0 elsewhere) and, if asked, the
    (B, T-1) entropy of pi at those positions. model: as returned by attach_logprob_forward."""
    rows, cols = mask.nonzero(as_tuple=True)
    if not len(rows):
        # An idle rank (mask all 0) still projects one position: under FSDP2 every rank must produce a gradient
        # for the output projection, or the ranks' reduce-scatters would not match. Its value is masked out.
        rows = cols = torch.zeros(1, dtype=torch.long, device=ids.device)
    logp, entropy = model.response_logprobs(ids, rows, cols, temperature, with_entropy)
    scatter = functools.partial(torch.zeros(mask.shape, device=ids.device).index_put, (rows, cols))
    return scatter(logp), (scatter(entropy) if with_entropy else None)


def _scored(items, token_logp, entropy, mask):
    """Per packed sequence of items (owner rank, index there, prompt ids, response ids): (owner, index, (T_i,)
    response log-probs, entropy summed over its policy tokens, policy tokens)."""
    return [(owner, i, row[len(p) - 1: len(p) - 1 + len(r)].float().cpu().numpy(),
             float((row_entropy * row_mask).sum()), float(row_mask.sum()))
            for (owner, i, p, r), row, row_entropy, row_mask in zip(items, token_logp, entropy, mask)]


def _to_owners(scored, n, max_tokens, counted):
    """_scored results back to the rank that owns each sequence (with a token budget they were dealt to the ranks
    by tokens): (n,) log-probs by index, and the entropy per policy token over the indices `counted` accepts."""
    if max_tokens is not None:
        scored = [item for item in all_gather_objects(scored) if item[0] == dist.get_rank()]
    out, entropy_sum, token_count = [None] * n, 0.0, 0.0
    for _, i, logp, row_entropy, tokens in scored:
        out[i] = logp
        if counted(i):
            entropy_sum, token_count = entropy_sum + row_entropy, token_count + tokens
    return out, entropy_sum / max(token_count, 1.0)


@torch.no_grad()
def old_logprobs(model, rollouts, revisited, temperature, micro_batch_size, max_tokens=None):
    """The trainer's log-probs, before this step's update, of this batch's responses (PPO's old log-probs) and of
    `revisited` responses (spo.py: previous responses, for D(x)), in one pass. revisited: (prompt token ids,
    response token ids, response mask) triples. Also the policy's entropy on this batch and the gap between the
    trainer's and vLLM's log-probs of the sampled tokens (a weight push that did not land shows here).
    Tool-output tokens (mask 0) were never sampled: their log-prob is not computed and reads 0.
    With a token budget (max_tokens) all ranks' sequences are dealt to the ranks by tokens (assign_by_tokens)
    and each result goes back to the rank that owns the sequence."""
    device, rank = next(model.parameters()).device, dist.get_rank()
    sequences = [(r.prompt_ids, r.response_ids, r.response_mask) for r in rollouts] + list(revisited)
    work = [(rank, i, seq) for i, seq in enumerate(sequences)]  # (the rank that owns it, its index there, sequence)
    # token budgets: score a token-balanced share of all ranks' sequences
    work, shares, _ = deal_by_tokens(work, lambda item: len(item[2][0]) + len(item[2][1]), max_tokens is not None)
    scored = []
    for group in micro_batches([len(p) + len(r) for _, _, (p, r, _) in work], micro_batch_size, max_tokens,
                                shares, padded=model.config._attn_implementation != PACKED_ATTENTION):
        chunk = [work[j][2] for j in group] or [IDLE]  # an idle rank still joins the collective forward
        ids, mask = pack(chunk, device)
        # (the entropy is of this batch's responses only: a pass of revisited ones alone skips it)
        token_logp, entropy = token_logprobs(model, ids, mask, temperature, with_entropy=bool(rollouts))
        scored += _scored([(work[j][0], work[j][1], p, r) for j, (p, r, _) in zip(group, chunk)], token_logp,
                          torch.zeros_like(token_logp) if entropy is None else entropy, mask)
    # the entropy of this batch's responses, not of the revisited ones
    out, entropy = _to_owners(scored, len(sequences), max_tokens, lambda i: i < len(rollouts))
    return {"batch": out[: len(rollouts)], "revisited": out[len(rollouts):], "sequences": len(sequences),
            "entropy": entropy, **vllm_gap(out[: len(rollouts)], rollouts)}


def tis_weights(old_logprobs, engine_logprobs, mask, cap):
    """Truncated importance sampling (--tis; Yao et al. 2025, verl's and OpenRLHF's form): per token
    min(pi_trainer / pi_engine, cap), the trainer's old log-prob against the engine's that sampled the token;
    1 on tokens the policy did not generate (tool output). The samples came from the engine, the gradient is the
    trainer's: the weight corrects for the gap, and the cap bounds its variance."""
    ratio = np.exp(np.asarray(old_logprobs) - np.asarray(engine_logprobs))
    return np.where(np.asarray(mask) > 0, np.minimum(ratio, cap), 1.0)


@torch.no_grad()
def clip_grad_norm(parameters, max_norm):
    """torch.nn.utils.clip_grad_norm_ (2-norm) for FSDP2's sharded gradients, the same numbers bit for bit on two
    ranks (tests/test_trainer.py) in one collective instead of the several of DTensor's arithmetic (docs/design.md):
    each rank's norm of each of its gradient shards, each parameter's norm over the ranks (sqrt of the summed
    squares, as DTensor reduces a partial norm), their 2-norm, and every shard scaled by min(1, max / (norm + 1e-6)).
    Returns the global norm as a float."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
    squares = all_gather_np((torch.stack(torch._foreach_norm(grads, 2.0)) ** 2.0)[None].cpu().numpy())  # (world, P)
    total = torch.linalg.vector_norm(torch.from_numpy(squares).sum(0) ** 0.5, 2.0)
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0).to(grads[0].device))
    return float(total)


@torch.no_grad()
def _shard_norms(optimizer):
    """(P,) norms of this rank's parameter shards in fp64: whether an update changed the parameters at all. The
    optimiser's parameters: the model's may be FSDP2's unsharded copies at the moment."""
    return torch.stack([(p.to_local() if isinstance(p, DTensor) else p).double().norm()
                        for group in optimizer.param_groups for p in group["params"]])


def ppo_update(model, optimizer, rollouts, old, advantage, loss_fn, *, ppo_steps, micro_batch_size, temperature,
               grad_clip, max_tokens=None, tis=0.0, check=False):
    """`ppo_steps` optimiser steps over consecutive mini-batches of the rollouts, each step's loss from
    loss_fn(logprobs, old_logprobs, advantage, mask, n_tokens=...) -> (loss, clipped) (spo.ppo_clip_loss, Eq. 10),
    where n_tokens counts the policy tokens of the GLOBAL mini-batch (all ranks): a token mean over it. The
    machinery: micro-batches (gradient accumulation), the world-size scaling FSDP2 needs, gradient clipping, and
    skipping a step whose loss or gradient norm is not finite (on every rank alike). old: (T_i,) old log-probs per
    rollout (old_logprobs'); advantage: (B_local,) one scalar per trajectory. max_tokens: the micro-batches'
    token budget (plan_micro_batches), each mini-batch's sequences then dealt to the ranks by tokens
    (assign_by_tokens); None: micro_batch_size sequences each, every rank its own rollouts. tis: the cap of
    tis_weights, passed to loss_fn as weights; 0: off. check: afterwards, a warning line on rank 0 unless the
    update moved the policy the way the advantages say (metrics.learning_warning; one more no-grad pass)."""
    device, world = next(model.parameters()).device, dist.get_world_size()
    per = len(rollouts) // ppo_steps
    sums = {"loss": 0.0, "grad_norm": 0.0}
    # over all ranks and mini-batches: clipped tokens, k3 KL summed over tokens, tokens, and the tokens the decoder
    # ran (response_logprobs counts them on the model: packed rows, each shared prefix once)
    totals, model.decoder_tokens = np.zeros(5), 0
    nonfinite = False
    norms = _shard_norms(optimizer) if check else None
    for k in range(ppo_steps):
        # this rank's part of mini-batch k: (prompt ids, response ids, response mask, old log-probs, advantage,
        # per-token weights)
        mini = [(r.prompt_ids, r.response_ids, r.response_mask, old[i], float(advantage[i]),
                 tis_weights(old[i], r.logprobs, r.response_mask, tis) if tis else None)
                for i, r in enumerate(rollouts[k * per: (k + 1) * per], start=k * per)]
        # token budgets: also even out the ranks' tokens (long responses vary a lot)
        mini, shares, everything = deal_by_tokens(mini, lambda item: len(item[0]) + len(item[1]),
                                                  max_tokens is not None)
        global_tokens = (float(sum(np.sum(item[2]) for item in everything)) if everything is not None  # exact
                         else all_reduce_np([sum(float(np.sum(item[2])) for item in mini)])[0])
        loss_total, counts = 0.0, np.zeros(5)  # this rank's: loss; clipped tokens, k3 KL, tokens, decoder's, truncated
        before = model.decoder_tokens
        for group in micro_batches([len(p) + len(r) for p, r, *_ in mini], micro_batch_size, max_tokens, shares,
                                   padded=model.config._attn_implementation != PACKED_ATTENTION):
            rows = [mini[j] for j in group]
            ids, mask = pack([row[:3] for row in rows] or [IDLE], device)  # (b, T); an idle rank: mask 0, loss 0
            adv = torch.tensor([row[4] for row in rows] or [0.0], dtype=torch.float32, device=device)  # (b,)
            logp, _ = token_logprobs(model, ids, mask, temperature)
            old_logp, weights = torch.zeros_like(mask), torch.ones_like(mask)  # (b, T), as the packed sequences
            for j, (p, _, _, old_row, _, weight_row) in enumerate(rows):
                old_logp[j, len(p) - 1: len(p) - 1 + len(old_row)] = torch.from_numpy(old_row)
                if weight_row is not None:
                    weights[j, len(p) - 1: len(p) - 1 + len(weight_row)] = torch.from_numpy(weight_row)
            loss, clipped = loss_fn(logp, old_logp, adv, mask, n_tokens=global_tokens,
                                    **({"weights": weights} if tis else {}))
            (loss * world).backward()  # x world: FSDP2 averages gradients, our loss is already a global mean
            loss_total += loss.item()
            with torch.no_grad():
                log_ratio = (logp - old_logp) * mask
                counts += [float((clipped.float() * mask).sum()),
                           float(((torch.exp(log_ratio) - 1 - log_ratio) * mask).sum()),  # k3, KL(old||new)
                           float(mask.sum()), 0.0, float(((weights == tis) * mask).sum()) if tis else 0.0]
        counts[3] = model.decoder_tokens - before
        grad_norm = clip_grad_norm(model.parameters(), grad_clip)
        reduced = all_reduce_np([loss_total, *counts])  # one collective for the loss and the counts
        global_loss, totals = reduced[0], totals + reduced[1:]
        if not (np.isfinite(global_loss) and np.isfinite(grad_norm)):
            nonfinite = True  # every rank sees the same global values, so every rank skips this step
            optimizer.zero_grad(set_to_none=True)
            continue
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sums["loss"] += global_loss
        sums["grad_norm"] += grad_norm
    stats = {"loss": sums["loss"] / ppo_steps, "grad_norm": sums["grad_norm"] / ppo_steps,
             "clip_fraction": totals[0] / totals[2], "approx_kl": totals[1] / totals[2], "nonfinite": nonfinite,
             "decoder_tokens": totals[3] / world,  # per rank
             "tis_truncated": totals[4] / totals[2]}  # tokens whose weight is the cap
    if check:
        changed = not torch.equal(norms, _shard_norms(optimizer))
        new = old_logprobs(model, rollouts, [], temperature, micro_batch_size, max_tokens)["batch"]
        warning = learning_warning(changed, old, new, advantage, [r.response_mask for r in rollouts])
        if warning and dist.get_rank() == 0:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    return stats
