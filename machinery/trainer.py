"""On torch FSDP2 (fully_shard) and transformers: the policy-gradient trainer TRL or verl has, in one readable file.

FSDP2 averages gradients over ranks and spo.py's loss is a mean over the GLOBAL token count, so each rank scales
it by the world size (set_gradient_divide_factor(1) would, but fails on gloo)."""
import functools
import logging
import math
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from machinery.batching import IDLE, PACKED_ATTENTION, Sequence, deal_by_tokens, loss_terms, micro_batches, pack, \
    to_device
from machinery.collectives import all_gather_np, all_gather_objects, all_reduce_np
from machinery.logprob_head import attach_logprob_forward, token_logprobs
from machinery.memory import phase_end


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


@torch.no_grad()
def old_logprobs(model, rollouts, revisited, temperature, micro_batch_size, max_tokens=None, entropy=True):
    """Before the update, in one pass: old log-probs of the batch and of `revisited` triples (D(x)), entropy (the
    full vocabulary's: entropy=False spares it where only the log-probs are read, as the reference's), gap."""
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
        logp, token_entropy = token_logprobs(model, ids, mask, temperature, with_entropy=entropy and bool(rollouts))
        done.append((sequences, mask.numpy()))
        results += [logp.flatten(), (torch.zeros_like(logp) if token_entropy is None else token_entropy).sum(1)]
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


# ---- the trainer's diagnostics: its log-probs against the engine's, and whether the first update moved the policy
def vllm_gap(batch, rollouts):
    """The trainer's and the engine's log-probs of the sampled tokens compared (a failed weight push shows here)."""
    if not rollouts:
        return {"logprob_gap_mean": 0.0, "logprob_gap_max": 0.0, "ratio_outside": 0, "ratio_max": 0.0, "tokens": 0}
    diff = np.concatenate([(lp - np.asarray(r.logprobs))[np.asarray(r.response_mask) > 0]
                           for lp, r in zip(batch, rollouts)])
    ratio = np.exp(diff)
    return {"logprob_gap_mean": float(np.abs(diff).mean()), "logprob_gap_max": float(np.abs(diff).max()),
            "ratio_outside": int(((ratio < 0.9) | (ratio > 1.1)).sum()), "ratio_max": float(ratio.max()),
            "tokens": len(diff)}


def learning_warning(changed, old, new, advantage, masks):
    """None if the first update moved the policy the way the advantages say, else a warning (else it is silent): the
    positive-advantage tokens' mean log-prob change above the negative ones'. Not each one's sign: on a pretrained
    model both may fall, the right and the wrong answers sharing their format's tokens (SmolLM2-135M, 2026-12-08)."""
    sums = np.zeros(5)  # changed; the log-prob change summed over positive-advantage tokens, their count; negative
    sums[0] = changed
    for o, n, a, m in zip(old, new, advantage, masks):
        delta = (np.asarray(n) - np.asarray(o))[np.asarray(m) > 0]
        if a > 0:
            sums[1:3] += [delta.sum(), len(delta)]
        elif a < 0:
            sums[3:5] += [delta.sum(), len(delta)]
    total = all_gather_np(sums).reshape(-1, 5).sum(0)
    rose, fell = total[1] / max(total[2], 1), total[3] / max(total[4], 1)
    if total[0] > 0 and rose > fell:
        return None
    return (f"the first update did not move the policy the way the advantages say (parameters "
            f"{'changed' if total[0] else 'unchanged'}; mean log-prob change of positive-advantage tokens {rose:+.2e} "
            f"over {total[2]:.0f}, of negative-advantage ones {fell:+.2e} over {total[4]:.0f}): likely a zero learning "
            f"rate (--lr), all advantages zero (every reward equal to its baseline), or frozen parameters")


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


# _accumulate_gradients' sums over a mini-batch's tokens, in order; ppo_update reduces them over ranks by name
STEP_SUMS = ("loss", "clipped", "kl", "kl_ref", "tokens", "truncated", "decoder_tokens")


def reuses_forward(ppo_steps, tis):
    """Whether the update's forward gives the batch's old log-probs, so that old_logprobs need not score it: with
    one optimiser step the policy before it is the forward's (TRL skips the pass alike); --tis's weights are
    fixed before the update, from old log-probs, so it keeps the pass."""
    return ppo_steps == 1 and not tis


def ppo_update(model, optimizer, rollouts, old, advantage, loss_fn, *, ppo_steps, micro_batch_size, temperature,
               grad_clip, max_tokens=None, tis=0.0, reference=None, kl=None):
    """`ppo_steps` optimiser steps over consecutive mini-batches, each loss from loss_fn(logprobs, old_logprobs,
    advantage, mask, n_tokens=the GLOBAL mini-batch's tokens) -> (loss, clipped) (Eq. 10). A step whose loss or
    gradient norm is not finite is skipped on every rank. tis: tis_weights' cap, passed as weights (0: off).
    old None (one step, no --tis: reuses_forward): the forward's own log-probs, detached, are the old ones (the
    ratio is exactly 1) and come back as stats["old"], what old_logprobs gives of the batch. kl: (coefficient,
    kl_estimate(logprobs, ref_logprobs) -> (B, T)) adds coefficient x its token mean to each loss, reference: the
    batch's log-probs under the reference policy (old_logprobs' "batch" of it)."""
    per, world, rank = len(rollouts) // ppo_steps, dist.get_world_size(), dist.get_rank()
    sequences = [Sequence(r.prompt_ids, r.response_ids, r.response_mask, None if old is None else old[i],
                          float(advantage[i]), tis_weights(old[i], r.logprobs, r.response_mask, tis) if tis else None,
                          None if reference is None else reference[i], owner=rank, index=i)
                 for i, r in enumerate(rollouts)]
    # over all ranks and mini-batches: the STEP_SUMS but the loss (its steps may be skipped)
    totals, loss, grad_norm, nonfinite = dict.fromkeys(STEP_SUMS[1:], 0.0), 0.0, 0.0, False
    for k in range(ppo_steps):
        # this rank's part of mini-batch k; token budgets: also even out the ranks' tokens (long responses vary a lot)
        mini, shares, everything = deal_by_tokens(sequences[k * per: (k + 1) * per], len, max_tokens is not None)
        global_tokens = (float(sum(np.sum(s.mask) for s in everything)) if everything is not None  # exact
                         else all_reduce_np([sum(float(np.sum(s.mask)) for s in mini)])[0])
        sums, scored = _accumulate_gradients(model, mini, shares, loss_fn, global_tokens, temperature,
                                             micro_batch_size, max_tokens, tis, kl, reuse=old is None)
        step_norm = clip_grad_norm(model.parameters(), grad_clip)
        reduced = dict(zip(STEP_SUMS, all_reduce_np(sums)))  # one collective for the loss and the counts
        totals = {name: total + reduced[name] for name, total in totals.items()}
        if np.isfinite(reduced["loss"]) and np.isfinite(step_norm):  # every rank sees the same global values
            optimizer.step()
            loss, grad_norm = loss + reduced["loss"], grad_norm + step_norm
        else:
            nonfinite = True  # every rank skips this step
        optimizer.zero_grad(set_to_none=True)
    scored = _owned(scored, len(rollouts), rollouts, max_tokens is not None)[1] if old is None else None
    return {"old": scored, "loss": loss / ppo_steps, "grad_norm": grad_norm / ppo_steps,
            "clip_fraction": totals["clipped"] / totals["tokens"], "approx_kl": totals["kl"] / totals["tokens"],
            "nonfinite": nonfinite, "tis_truncated": totals["truncated"] / totals["tokens"],  # weight = the cap
            "decoder_tokens": totals["decoder_tokens"] / world,  # per rank
            **({"kl_ref": totals["kl_ref"] / totals["tokens"]} if kl else {})}


def _accumulate_gradients(model, mini, shares, loss_fn, global_tokens, temperature, micro_batch_size, max_tokens, tis,
                          kl, reuse):
    """One step's gradient, reduced once: its STEP_SUMS (k3 KL to the old policy, kl's estimate to the reference;
    truncated: tokens at the --tis cap), and with reuse (ppo_update's old None: the sequences carry no old
    log-probs) the forward's scores (_scores)."""
    world, ran = dist.get_world_size(), getattr(model, "decoder_tokens", 0)
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
        mask, old_logp, weights, ref_logp, adv = to_device([mask, *loss_terms(sequences, bool(tis), bool(kl))],
                                                           logp.device)  # (b, T) each, (b,)
        old_logp = logp.detach() if reuse else old_logp
        loss, clipped = loss_fn(logp, old_logp, adv, mask, n_tokens=global_tokens,
                                **({"weights": weights} if tis else {}))
        # (masked positions: both log-probs 0, so no estimate overflows there; its gradient is 0 too)
        kl_ref = (kl[1](logp * mask, ref_logp * mask) * mask).sum() if kl else mask.new_zeros(())
        loss = loss + kl[0] * kl_ref / global_tokens if kl else loss  # a token mean whatever --loss_agg: one scale
        model.set_requires_gradient_sync(m == len(plan) - 1)  # the reduce-scatter after the last backward only
        (loss * world).backward()  # x world: FSDP2 averages gradients, our loss is already a global mean
        with torch.no_grad():
            log_ratio = (logp - old_logp) * mask
            parts.append(torch.stack([loss.detach().float(), (clipped.float() * mask).sum(),
                                      ((torch.exp(log_ratio) - 1 - log_ratio) * mask).sum(),  # k3, KL(old||new)
                                      kl_ref.detach().float(), mask.sum(),
                                      ((weights == tis) * mask).sum() if tis else mask.new_zeros(())]))
    for unit in layers:  # (the no-grad pass: one layer gathered at a time)
        unit.set_reshard_after_forward(True)
    host = torch.cat([torch.stack(parts).double().flatten(), *results]).cpu().numpy() if parts else []  # one read
    width = len(STEP_SUMS) - 1  # (the decoder's tokens: counted on the host)
    sums = functools.reduce(np.add, np.reshape(host[: width * len(parts)], (-1, width)), np.zeros(width))  # in order
    scored = _scores(done, host[width * len(parts):]) if done else []
    return np.append(sums, getattr(model, "decoder_tokens", 0) - ran), scored


def scheduled_lr(step, lr, warmup_steps, schedule, total_steps):
    """The learning rate of rollout step `step` (from 1), for each of its optimiser steps: a linear warmup, lr x
    step / warmup_steps up to step warmup_steps, then lr ("constant"), or a cosine from lr towards 0 over the steps
    left, lr (1 + cos(pi k / n)) / 2 at the k-th of the n = total_steps - warmup_steps (k from 0: the first step
    after the warmup has lr, the last still a little; transformers' cosine schedule, counted in rollout steps).
    A function of the step alone: a resumed run gets the same rates."""
    if step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "cosine":
        return lr * (1 + math.cos(math.pi * (step - warmup_steps - 1) / (total_steps - warmup_steps))) / 2
    return lr


def update(model, optimizer, rollouts, old, advantage, loss_fn, *, check, ppo_steps, micro_batch_size, temperature,
           grad_clip, lr, max_tokens=None, tis=0.0, reference=None, kl=None):
    """Step 6: ppo_update, and with `check` (a run's first step) a warning line unless it moved the policy the way
    the advantages say (one more pass). old: step 4's old_logprobs, whose "batch" is empty where reuses_forward.
    reference: --kl_coef's reference policy (None: no penalty), whose log-probs of the batch one no-grad pass
    gives first.
    Returns (stats, acting): acting is old_logprobs' dict of the batch under the policy that sampled it, step 4's
    or, where it did not score the batch, this forward's (old itself is left as step 4 made it)."""
    def norms():  # (P,) fp64 norms of this rank's shards (the optimiser's: the model's may be unsharded copies now)
        return torch.stack([(p.to_local() if isinstance(p, DTensor) else p).detach().double().norm()
                            for group in optimizer.param_groups for p in group["params"]])
    before = norms() if check else None
    for group in optimizer.param_groups:  # (scheduled_lr's: the optimiser keeps no schedule of its own)
        group["lr"] = lr
    if reference is not None:
        reference = old_logprobs(reference, rollouts, [], temperature, micro_batch_size, max_tokens, False)["batch"]
    stats = ppo_update(model, optimizer, rollouts, old["batch"] or None, advantage, loss_fn, ppo_steps=ppo_steps,
                       micro_batch_size=micro_batch_size, temperature=temperature, grad_clip=grad_clip,
                       max_tokens=max_tokens, tis=tis, reference=reference, kl=kl)
    acting = {**old, **(stats.pop("old") or {})}
    if check:
        new = old_logprobs(model, rollouts, [], temperature, micro_batch_size, max_tokens)["batch"]
        warning = learning_warning(not torch.equal(before, norms()), acting["batch"], new, advantage,
                                   [r.response_mask for r in rollouts])
        if warning and dist.get_rank() == 0:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    phase_end(next(model.parameters()).is_cuda, "update")  # (GPU: memory/update_gib)
    return {**stats, "lr": lr}, acting
