"""On transformers' decoder: log pi of the response tokens, the output projection applied a chunk of positions at a
time (no (B, T, V) logits tensor, which TRL and verl hold), with fp32 logits and one fp32 weight-gradient buffer
under bf16 (docs/benchmarks.md, GPU notes). Used by machinery/trainer.py's passes and by the tests of the head."""
import functools

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from machinery.batching import LOGIT_CHUNK_BYTES, PACKED_ATTENTION, PackedLayout, packed_row, to_device, \
    use_packed_attention
from machinery.errors import fail


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
    run = (functools.partial(checkpoint, _chunk_logprobs, use_reentrant=False, preserve_rng_state=False)
           if torch.is_grad_enabled() else _chunk_logprobs)
    logp, entropy = zip(*[run(hidden[k: k + chunk], weight, (token, total), bias, targets[k: k + chunk], temperature,
                              with_entropy) for k in range(0, len(targets), chunk)])
    return torch.cat(logp), (torch.cat(entropy) if with_entropy else None)


def attach_logprob_forward(model):
    """`model.response_logprobs(...)`, in FSDP2's gather hooks: it uses the root unit outside the model's forward."""
    from torch.distributed.fsdp import register_fsdp_forward_method
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("final_logit_softcapping", "logit_scale"):  # applied inside forward, after the projection
        if getattr(config, name, None) not in (None, 1, 1.0):
            fail(f"--model: {config.model_type} scales its logits ({name}={getattr(config, name)}), which "
                 f"logprob_head.response_logprobs does not apply; this model is not supported yet")
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
