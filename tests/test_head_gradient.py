"""The output projection's weight gradient under bf16 (machinery/trainer.py: _WeightGradient, _HalfInputLogits):
the chunks of response_logprobs sum it in ONE fp32 buffer, and the weight receives it once, with the numbers of the
unchunked projection and of the old way (a fresh fp32 (V, H) gradient per chunk, added up by autograd).

    .venv/bin/python -m pytest tests/test_head_gradient.py -q
"""
import contextlib
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from machinery import trainer

V, H, CHUNK = 50, 16, 3  # CHUNK: positions per chunk, to make many chunks


class _Head(torch.nn.Module):
    """A causal LM cut down to its output projection for response_logprobs: the decoder's last hidden states are
    a given (B, T, H) tensor."""

    def __init__(self, hidden, weight):
        super().__init__()
        self.hidden, self.config = hidden, types.SimpleNamespace(_attn_implementation="sdpa")
        self.lm_head = torch.nn.Linear(H, V, bias=False, dtype=weight.dtype)
        self.lm_head.weight = torch.nn.Parameter(weight)

    def base_model(self, input_ids, use_cache):
        return types.SimpleNamespace(last_hidden_state=self.hidden)

    def get_output_embeddings(self):
        return self.lm_head


class _OldHalfInputLogits(torch.autograd.Function):
    """trainer._HalfInputLogits as it was: its weight gradient a fresh (V, H) fp32 tensor per chunk, on weight32
    (the weight in fp32), for autograd to add up."""

    @staticmethod
    def forward(ctx, hidden, weight, weight32):
        ctx.save_for_backward(hidden, weight)
        return trainer._mm_fp32(hidden, weight.t())

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        return trainer._mm_fp32(grad, weight).to(hidden.dtype), None, trainer._mm_fp32(grad.t(), hidden)


def _old_logprobs(model, ids, rows, cols, temperature, chunk):
    """response_logprobs' projection as it was under bf16 (temperature 1, no bias, no entropy)."""
    hidden, weight = model.hidden[rows, cols], model.lm_head.weight
    weight32, targets, logp = weight.float(), ids[rows, cols + 1], []
    for k in range(0, len(targets), chunk):
        logits = _OldHalfInputLogits.apply(hidden[k: k + chunk], weight, weight32)
        logp.append(logits.gather(-1, targets[k: k + chunk, None]).squeeze(-1) - torch.logsumexp(logits, -1))
    return torch.cat(logp), None


class _WeightSized(TorchDispatchMode):
    """Counts the fp32 tensors of the weight's size that operators make (views, in-place and out= results
    aside; and the fp32 copies of the bf16 weight that _mm_fp32 makes on CPU, where a GPU needs none)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() == V * H
                and not func.is_view and not func._schema.is_mutable and func is not torch.ops.aten._to_copy.default):
            self.made.append(func)
        return out


def _run(logprobs, count=False):
    """logprobs' log-probs (bf16 hidden states and weight, 20 positions: 7 chunks) and the gradients of the weight
    and the hidden states under a loss that weighs the positions unequally; with count: the weight-sized fp32
    tensors the backward made."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, H, generator=g).bfloat16().requires_grad_()
    model = _Head(hidden, (torch.randn(V, H, generator=g) * 0.3).bfloat16())
    ids = torch.randint(0, V, (2, 12), generator=g)
    rows, cols = torch.tensor([0] * 11 + [1] * 9), torch.tensor(list(range(11)) + list(range(2, 11)))
    logp, _ = logprobs(model, ids, rows, cols, 1.0, chunk=CHUNK)
    counter = _WeightSized()
    counter.made = []
    with counter if count else contextlib.nullcontext():
        (logp * torch.linspace(-1, 1, len(logp))).sum().backward()
    return logp.detach(), model.lm_head.weight.grad, hidden.grad, counter.made, (model, ids, rows, cols)


def test_bf16_head_gradients_are_the_old_chunked_ones_and_the_unchunked_fp32_ones():
    """The chunks' weight gradients summed in one fp32 buffer: the weight's (bf16) and the hidden states' gradients
    those of the old computation, and of the unchunked fp32 projection of the same bf16 values within bf16
    rounding."""
    logp, weight_grad, hidden_grad, _, (model, ids, rows, cols) = _run(trainer.response_logprobs)
    old_logp, old_weight_grad, old_hidden_grad, _, _ = _run(_old_logprobs)
    assert weight_grad.dtype == torch.bfloat16 and torch.equal(logp, old_logp)
    torch.testing.assert_close(weight_grad, old_weight_grad, atol=0, rtol=0)
    torch.testing.assert_close(hidden_grad, old_hidden_grad, atol=0, rtol=0)
    hidden = model.hidden.detach()[rows, cols].float().requires_grad_()  # the unchunked fp32 reference
    weight = model.lm_head.weight.detach().float().requires_grad_()
    ref = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, ids[rows, cols + 1, None]).squeeze(-1)
    (ref * torch.linspace(-1, 1, len(ref))).sum().backward()
    torch.testing.assert_close(logp, ref.detach(), atol=1e-5, rtol=0)
    full_hidden_grad = torch.zeros_like(model.hidden, dtype=torch.float32).index_put((rows, cols), hidden.grad)
    for mine, theirs in ((weight_grad.float(), weight.grad), (hidden_grad.float(), full_hidden_grad)):
        assert (mine - theirs).norm() <= 1e-2 * theirs.norm() and theirs.norm() > 0


def test_bf16_head_backward_makes_one_weight_sized_fp32_tensor_whatever_the_chunks():
    """Over 7 chunks the backward makes ONE fp32 tensor of the weight's size (the buffer the chunks add into, then
    cast once to the weight's bf16), where the old one made one per chunk (a fresh gradient each, added up by
    autograd): 2.5 GB each at Qwen3-8B."""
    made = _run(trainer.response_logprobs, count=True)[3]
    assert len(made) == 1, made
    old_made = _run(_old_logprobs, count=True)[3]
    assert len(old_made) >= 7, old_made  # the count sees them: one per chunk
