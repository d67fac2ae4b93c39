"""On torch FSDP2 (fully_shard) and transformers: the policy-gradient trainer TRL or verl has, in one readable file.

FSDP2 averages gradients over ranks and spo.py's loss is a mean over the GLOBAL token count, so each rank scales
it by the world size (set_gradient_divide_factor(1) would, but fails on gloo)."""
import contextlib
import datetime
import functools
import logging
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
from machinery.batching import (IDLE, LOGIT_CHUNK_BYTES, PACKED_ATTENTION, PackedLayout, Sequence, deal_by_tokens,
                                loss_terms, micro_batches, pack, packed_row, to_device, use_packed_attention)


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


def build_policy(path, device, lr, weight_decay, gradient_checkpointing=None, layer_units=None, bf16=None,
                 compile_layers=False):
    """The policy (FSDP2; bf16: mixed precision; compile_layers: each decoder layer torch.compile'd) and its AdamW;
    only rank 0 reads the weights, the others get shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) if dist.get_rank() == 0 else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    on_gpu = device.type == "cuda"
    prepare_for_training(model, on_gpu if gradient_checkpointing is None else gradient_checkpointing)
    if compile_layers:  # off by default until a GPU measures it
        compile_decoder_layers(model)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    bf16 = on_gpu if bf16 is None else bf16
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    layer_units = on_gpu and world > 1 if layer_units is None else layer_units
    for unit in [*(model.model.layers if layer_units else []), model]:
        fully_shard(unit, mesh=mesh, **({"mp_policy": mp} if mp else {}))
    attach_logprob_forward(model)
    model.to_empty(device=device)  # storage for this rank's shards (and the buffers), contents undefined
    set_model_state_dict(model, loaded.state_dict() if loaded is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers outside the state dict (rotary inv_freq) were computed on the meta device, i.e. not: rank 0 sends its own
    loaded_buffers = dict(loaded.named_buffers()) if loaded is not None else {}
    for name, buffer in model.named_buffers():
        if loaded is not None:
            buffer.copy_(loaded_buffers[name])
        dist.broadcast(buffer, src=0)
    del loaded
    # foreach: on CPU torch defaults to a loop per parameter, each step paying DTensor's dispatch; same numbers
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=True)
    return model, optimizer


class _RecompileLimit(logging.Filter):
    """dynamo's several-line warning when a compiled layer hits its recompile limit, as one line."""

    def filter(self, record):
        if not str(record.msg).startswith("torch._dynamo hit config."):
            return True
        said = "; ".join(line.strip() for line in record.getMessage().splitlines()[:3])
        print(f"warning: --compile: {said}; from here that code runs eager", file=sys.stderr, flush=True)
        return False


RECOMPILE_LIMIT = _RecompileLimit()


def compile_decoder_layers(model, **options):
    """Each decoder layer torch.compile'd, before FSDP2 (torchtitan's order; dynamo leaves FSDP2's hooks eager):
    fused elementwise kernels, fewer launches. A layer past dynamo's recompile limit runs eager: said in one line."""
    logging.getLogger("torch._dynamo.convert_frame").addFilter(RECOMPILE_LIMIT)
    for layer in model.model.layers:
        layer.compile(**options)


def prepare_for_training(model, gradient_checkpointing):
    """Training mode (transformers checkpoints a layer only then), dropout off: it would move PPO's ratio from 1."""
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0  # attention modules pass it to the attention kernel in training mode
    if gradient_checkpointing:
        # non-reentrant: it composes with FSDP2; no RNG stash: with dropout off the recompute draws nothing
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                           "preserve_rng_state": False})
    return model


HALF = (torch.bfloat16, torch.float16)


def _mm_fp32(a, b, into=None):
    """a @ b (or into += a @ b) in fp32 from half-precision a and b: one GEMM where torch has it (CUDA)."""
    if a.is_cuda and "dtype" in torch.ops.aten.mm.overloads():
        if into is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        try:  # fp32 into with bf16 a and b: allowed since pytorch#167931, not in torch 2.8/2.9; 2.11 unverified
            return torch.addmm(into, a, b, out_dtype=torch.float32, out=into)
        except RuntimeError:  # the same sum through a temporary: the memory the buffer saves, not the numbers
            return into.add_(torch.mm(a, b, out_dtype=torch.float32))
    return torch.mm(a.float(), b.float()) if into is None else into.addmm_(a.float(), b.float())


class _WeightGradient(torch.autograd.Function):
    """The head's weight gradient under bf16, summed over the chunks in ONE fp32 buffer: every chunk takes this
    function's empty output, so this backward runs after all of theirs and hands the weight the sum."""

    @staticmethod
    def forward(ctx, weight, total):
        ctx.total, ctx.dtype = total, weight.dtype
        return weight.new_empty(0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _):
        return ctx.total.pop("sum").to(ctx.dtype), None  # (the buffer freed once cast)


class _HalfInputLogits(torch.autograd.Function):
    """(n, V) fp32 logits from bf16 hidden and weight: a product of two bf16 values is exact in fp32, and mm's
    out_dtype has no derivative (torch 2.13). The backward adds the weight's gradient into _WeightGradient's total."""

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
    """(n,) log-probs and entropies (or None), fp32 logits even in bf16 (which rounds logits near 30 to 0.125)."""
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
    """(N,) log pi(ids[rows, cols + 1] | ids[rows, :cols + 1]) and entropies (or None), the head `chunk` positions at
    a time: no (B, T, V) tensor exists. Call it as `model.response_logprobs(...)` (FSDP2 gathers around it)."""
    device = next(model.parameters()).device
    ids, rows, cols = (x.cpu() for x in (ids, rows, cols))  # host tensors (the loops pass them; no wait then)
    targets = ids[rows, cols + 1]  # (N,)
    if model.config._attn_implementation == PACKED_ATTENTION:  # one row without padding (attach_logprob_forward)
        flat, positions, layout, index = packed_row(ids, rows, cols)  # on the host, then one copy
        flat, positions, index, targets, pick, gather, *calls = to_device(
            [flat, positions, index, targets, layout.pick, layout.gather, *layout.calls], device)
        layout = PackedLayout(calls, pick, gather)
        hidden = model.base_model(input_ids=flat, position_ids=positions, packed_layout=layout,
                                  use_cache=False).last_hidden_state[0, index]  # (N, H)
    else:
        flat, rows, cols, targets = to_device([ids, rows, cols, targets], device)
        hidden = model.base_model(input_ids=flat, use_cache=False).last_hidden_state[rows, cols]  # (N, H)
    # the tokens the decoder really ran (a host count), for ppo_update's policy/decoder_tokens
    model.decoder_tokens = getattr(model, "decoder_tokens", 0) + flat.numel()
    head = model.get_output_embeddings()
    weight = head.weight  # (V, H): the gathered bf16 copy under bf16 mixed precision, else the fp32 parameter
    total = {}  # under bf16 with gradients: the chunks' weight gradient, summed in one fp32 buffer (_WeightGradient)
    token = _WeightGradient.apply(weight, total) if weight.dtype in HALF and torch.is_grad_enabled() else None
    bias = None if head.bias is None else head.bias.float()
    chunk = chunk or max(1, LOGIT_CHUNK_BYTES // (4 * weight.shape[0]))
    logp, entropy = [], []
    for k in range(0, len(targets), chunk):
        part = (hidden[k: k + chunk], weight, (token, total), bias, targets[k: k + chunk], temperature, with_entropy)
        if torch.is_grad_enabled():
            part_logp, part_entropy = checkpoint(_chunk_logprobs, *part, use_reentrant=False, preserve_rng_state=False)
        else:
            part_logp, part_entropy = _chunk_logprobs(*part)
        logp.append(part_logp)
        entropy.append(part_entropy)
    return torch.cat(logp), (torch.cat(entropy) if with_entropy else None)


def attach_logprob_forward(model):
    """`model.response_logprobs(...)`, in FSDP2's gather hooks: it uses the root unit outside the model's forward."""
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
    """(B, T-1) log pi(token_t | tokens_<t) where mask > 0, and the entropy if asked; host ids and mask: no wait."""
    rows, cols = (torch.from_numpy(x) for x in np.nonzero(mask.cpu().numpy()))
    if not len(rows):
        # an idle rank still projects one (masked) position: every rank's reduce-scatter needs the head's gradient
        rows = cols = torch.zeros(1, dtype=torch.long)
    logp, entropy = model.response_logprobs(ids, rows, cols, temperature, with_entropy)
    scatter = functools.partial(torch.zeros(mask.shape, device=logp.device).index_put,
                                tuple(to_device([rows, cols], logp.device)))
    return scatter(logp), (scatter(entropy) if with_entropy else None)


@torch.no_grad()
def old_logprobs(model, rollouts, revisited, temperature, micro_batch_size, max_tokens=None):
    """Before the update, in one pass: old log-probs of the batch and of `revisited` triples (D(x)), entropy, gap."""
    rank, padded = dist.get_rank(), model.config._attn_implementation != PACKED_ATTENTION
    if max_tokens is not None and next(model.parameters()).is_cuda:  # no activations kept: twice the update's
        max_tokens *= 2  # budget on GPU (verl sizes its log-prob passes so)
    model.eval()  # transformers checkpoints a layer only in training mode: no RNG stash, no checkpoint hooks here
    work = [Sequence(*seq, owner=rank, index=i) for i, seq in enumerate(
        [(r.prompt_ids, r.response_ids, r.response_mask) for r in rollouts] + list(revisited))]
    # token budgets: score a token-balanced share of all ranks' sequences
    work, shares, _ = deal_by_tokens(work, len, max_tokens is not None)
    done, results = [], []  # per micro-batch: its sequences and mask (host); log-probs, entropy sums (device)
    for group in micro_batches(list(map(len, work)), micro_batch_size, max_tokens, shares, padded):
        sequences = [work[j] for j in group]
        ids, mask = pack(sequences or [IDLE])  # an idle rank still joins the collective forward
        # (the entropy is of this batch's responses only: a pass of revisited ones alone skips it)
        logp, entropy = token_logprobs(model, ids, mask, temperature, with_entropy=bool(rollouts))
        done.append((sequences, mask.numpy()))
        results += [logp.flatten(), (torch.zeros_like(logp) if entropy is None else entropy).sum(1)]
    host = torch.cat(results).cpu().numpy() if results else None  # the loop's one read
    model.train()
    out, batch = _owned(_scores(done, host), len(rollouts) + len(revisited), rollouts, max_tokens is not None)
    return {"revisited": out[len(rollouts):], "sequences": len(out), **batch}


def _scores(done, host):
    """(owner, index, (T_i,) log-probs, entropy summed over its policy tokens, tokens) per scored sequence, from
    each micro-batch's (sequences, host mask) and `host`: their log-probs and entropy sums, in that order."""
    scored, at = [], 0
    for sequences, mask in done:
        logp, entropy = host[at: at + mask.size].reshape(mask.shape), host[at + mask.size: at + mask.size + len(mask)]
        at += mask.size + len(mask)
        scored += [(s.owner, s.index, logp[j, len(s.prompt) - 1: len(s) - 1].astype(np.float32), float(entropy[j]),
                    float(mask[j].sum())) for j, s in enumerate(sequences)]
    return scored


def _owned(scored, n, rollouts, dealt):
    """This rank's n results by index (dealt by tokens: each back from the rank that scored it), and of the first
    len(rollouts), this batch's, the old log-probs, their entropy and their gap to the engine's."""
    if dealt:
        scored = [item for item in all_gather_objects(scored) if item[0] == dist.get_rank()]
    out, entropy_sum, token_count = [None] * n, 0.0, 0.0
    for _, i, logp, row_entropy, tokens in scored:
        out[i] = logp
        if i < len(rollouts):  # the entropy of this batch's responses, not of the revisited ones
            entropy_sum, token_count = entropy_sum + row_entropy, token_count + tokens
    return out, {"batch": out[: len(rollouts)], "entropy": entropy_sum / max(token_count, 1.0),
                 **vllm_gap(out[: len(rollouts)], rollouts)}


def tis_weights(old_logprobs, engine_logprobs, mask, cap):
    """Truncated importance sampling (--tis; Yao et al. 2025): per token min(pi_trainer / pi_engine, cap)."""
    ratio = np.exp(np.asarray(old_logprobs) - np.asarray(engine_logprobs))
    return np.where(np.asarray(mask) > 0, np.minimum(ratio, cap), 1.0)


@torch.no_grad()
def clip_grad_norm(parameters, max_norm):
    """torch's clip_grad_norm_ on FSDP2's shards, bit for bit, in one collective instead of DTensor's several."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
    squares = all_gather_np((torch.stack(torch._foreach_norm(grads, 2.0)) ** 2.0)[None].cpu().numpy())  # (world, P)
    total = torch.linalg.vector_norm(torch.from_numpy(squares).sum(0) ** 0.5, 2.0)
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0).to(grads[0].device))
    return float(total)


def reuses_forward(ppo_steps, tis):
    """Whether the update's forward gives the batch's old log-probs, so that old_logprobs need not score it: with
    one optimiser step the policy before it is the forward's (TRL skips the pass alike); --tis's weights are
    fixed before the update, from old log-probs, so it keeps the pass."""
    return ppo_steps == 1 and not tis


def ppo_update(model, optimizer, rollouts, old, advantage, loss_fn, *, ppo_steps, micro_batch_size, temperature,
               grad_clip, max_tokens=None, tis=0.0):
    """`ppo_steps` optimiser steps over consecutive mini-batches, each loss from loss_fn(logprobs, old_logprobs,
    advantage, mask, n_tokens=the GLOBAL mini-batch's tokens) -> (loss, clipped) (Eq. 10). A step whose loss or
    gradient norm is not finite is skipped on every rank. tis: tis_weights' cap, passed as weights (0: off).
    old None (one step, no --tis: reuses_forward): the forward's own log-probs, detached, are the old ones (the
    ratio is exactly 1) and come back as stats["old"], what old_logprobs gives of the batch."""
    per, world, rank = len(rollouts) // ppo_steps, dist.get_world_size(), dist.get_rank()
    sequences = [Sequence(r.prompt_ids, r.response_ids, r.response_mask, None if old is None else old[i],
                          float(advantage[i]), tis_weights(old[i], r.logprobs, r.response_mask, tis) if tis else None,
                          owner=rank, index=i) for i, r in enumerate(rollouts)]
    # over all ranks and mini-batches: clipped tokens, k3 KL summed over tokens, tokens, truncated, decoder's tokens
    totals, loss, grad_norm, nonfinite = np.zeros(5), 0.0, 0.0, False
    for k in range(ppo_steps):
        # this rank's part of mini-batch k; token budgets: also even out the ranks' tokens (long responses vary a lot)
        mini, shares, everything = deal_by_tokens(sequences[k * per: (k + 1) * per], len, max_tokens is not None)
        global_tokens = (float(sum(np.sum(s.mask) for s in everything)) if everything is not None  # exact
                         else all_reduce_np([sum(float(np.sum(s.mask)) for s in mini)])[0])
        sums, scored = _accumulate_gradients(model, mini, shares, loss_fn, global_tokens, temperature,
                                             micro_batch_size, max_tokens, tis)
        step_norm = clip_grad_norm(model.parameters(), grad_clip)
        reduced = all_reduce_np(sums)  # one collective for the loss and the counts
        totals += reduced[1:]
        if np.isfinite(reduced[0]) and np.isfinite(step_norm):  # every rank sees the same global values
            optimizer.step()
            loss, grad_norm = loss + reduced[0], grad_norm + step_norm
        else:
            nonfinite = True  # every rank skips this step
        optimizer.zero_grad(set_to_none=True)
    scored = _owned(scored, len(rollouts), rollouts, max_tokens is not None)[1] if old is None else None
    return {"old": scored, "loss": loss / ppo_steps, "grad_norm": grad_norm / ppo_steps,
            "clip_fraction": totals[0] / totals[2], "approx_kl": totals[1] / totals[2], "nonfinite": nonfinite,
            "tis_truncated": totals[3] / totals[2],  # tokens whose weight is the cap
            "decoder_tokens": totals[4] / world}  # per rank


def _accumulate_gradients(model, mini, shares, loss_fn, global_tokens, temperature, micro_batch_size, max_tokens, tis):
    """One step's gradient, reduced once: sums of (loss, clipped, k3 KL, tokens, truncated, decoder tokens), and
    where the sequences carry no old log-probs (ppo_update's old None) the forward's scores (_scores)."""
    world, ran = dist.get_world_size(), getattr(model, "decoder_tokens", 0)
    reuse = any(s.old is None for s in mini)  # (every sequence of a step alike)
    done, results = [], []  # as in old_logprobs
    plan = micro_batches(list(map(len, mini)), micro_batch_size, max_tokens, shares,
                         padded=model.config._attn_implementation != PACKED_ATTENTION)
    parts, layers = [], [unit for unit in model.model.layers if hasattr(unit, "set_reshard_after_forward")]
    for unit in layers:  # layer units stay gathered from each forward to the backward that follows at once
        unit.set_reshard_after_forward(False)
    for m, group in enumerate(plan):
        real = [mini[j] for j in group]
        sequences = real or [IDLE]  # an idle rank: mask 0, loss 0
        ids, mask = pack(sequences)
        logp, entropy = token_logprobs(model, ids, mask, temperature, with_entropy=reuse)
        if reuse:  # one optimiser step: the policy before it is this forward's (the ratio exactly 1)
            done.append((real, mask.numpy()))
            results += [logp.detach().flatten().double(), entropy.sum(1).double()]
        mask, old_logp, weights, adv = to_device([mask, *loss_terms(sequences)], logp.device)  # (b, T), (b,)
        old_logp = logp.detach() if reuse else old_logp
        loss, clipped = loss_fn(logp, old_logp, adv, mask, n_tokens=global_tokens,
                                **({"weights": weights} if tis else {}))
        model.set_requires_gradient_sync(m == len(plan) - 1)  # the reduce-scatter after the last backward only
        (loss * world).backward()  # x world: FSDP2 averages gradients, our loss is already a global mean
        with torch.no_grad():
            log_ratio = (logp - old_logp) * mask
            parts.append(torch.stack([loss.detach().float(), (clipped.float() * mask).sum(),
                                      ((torch.exp(log_ratio) - 1 - log_ratio) * mask).sum(),  # k3, KL(old||new)
                                      mask.sum(), ((weights == tis) * mask).sum() if tis else mask.new_zeros(())]))
    for unit in layers:  # (the no-grad pass: one layer gathered at a time)
        unit.set_reshard_after_forward(True)
    host = torch.cat([torch.stack(parts).double().flatten(), *results]).cpu().numpy() if parts else []  # one read
    sums = functools.reduce(np.add, np.reshape(host[: 5 * len(parts)], (-1, 5)), np.zeros(5))  # in order, as before
    scored = _scores(done, host[5 * len(parts):]) if done else []
    return np.append(sums, getattr(model, "decoder_tokens", 0) - ran), scored


@contextlib.contextmanager
def learning_check(model, optimizer, rollouts, old, advantage, temperature, micro_batch_size, max_tokens, on=True):
    """Around an update: a warning line unless it moved the policy the way the advantages say (one more pass).
    old: old_logprobs' dict, its "batch" read after the update (which gives it where reuses_forward)."""
    def norms():  # (P,) fp64 norms of this rank's shards (the optimiser's: the model's may be unsharded copies now)
        return torch.stack([(p.to_local() if isinstance(p, DTensor) else p).detach().double().norm()
                            for group in optimizer.param_groups for p in group["params"]])
    before = norms() if on else None
    yield
    if on:
        changed = not torch.equal(before, norms())
        new = old_logprobs(model, rollouts, [], temperature, micro_batch_size, max_tokens)["batch"]
        warning = learning_warning(changed, old["batch"], new, advantage, [r.response_mask for r in rollouts])
        if warning and dist.get_rank() == 0:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
