"""The log-prob head (machinery/logprob_head.py): chunked log-probs equal the full-vocabulary computation, fp32 logits
keep bf16 rounding out, and under bf16 the chunks of response_logprobs sum the output projection's weight gradient in
ONE fp32 buffer (_WeightGradient, _HalfInputLogits) that the weight receives once, with the numbers of the unchunked
projection and of the old way (a fresh fp32 (V, H) gradient per chunk, added up by autograd).

    .venv/bin/python -m pytest tests/test_head_gradient.py -q
"""
import contextlib
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from machinery import logprob_head

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
    """logprob_head._HalfInputLogits as it was: its weight gradient a fresh (V, H) fp32 tensor per chunk, on weight32
    (the weight in fp32), for autograd to add up."""

    @staticmethod
    def forward(ctx, hidden, weight, weight32):
        ctx.save_for_backward(hidden, weight)
        return logprob_head._mm_fp32(hidden, weight.t())

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        return logprob_head._mm_fp32(grad, weight).to(hidden.dtype), None, logprob_head._mm_fp32(grad.t(), hidden)


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
    logp, weight_grad, hidden_grad, _, (model, ids, rows, cols) = _run(logprob_head.response_logprobs)
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
    made = _run(logprob_head.response_logprobs, count=True)[3]
    assert len(made) == 1, made
    old_made = _run(_old_logprobs, count=True)[3]
    assert len(old_made) >= 7, old_made  # the count sees them: one per chunk


def _plain_logprobs(model, ids, temperature):
    """The computation response_logprobs replaces: every position's full-vocabulary log-softmax."""
    logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float() / temperature, -1)  # (B, T-1, V)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_chunked_response_logprobs_equal_the_full_vocabulary_computation(tmp_path):
    """Response positions only, 7 at a time, logits recomputed in the backward: the same log-probs, entropies
    and gradients as the plain (B, T-1, V) log-softmax, within 1e-5."""
    from tasks import toy
    from machinery import trainer
    model = toy.build_model(toy.build_tokenizer(str(tmp_path)), seed=0)
    trainer.prepare_for_training(model, gradient_checkpointing=False)
    ids = torch.randint(3, 128, (3, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(3, 29)
    for b, (start, end) in enumerate([(4, 29), (10, 20), (0, 5)]):  # prompts, responses and padding differ
        mask[b, start:end] = 1
    rows, cols = mask.nonzero(as_tuple=True)
    logp, entropy = logprob_head.response_logprobs(model, ids, rows, cols, 0.7, with_entropy=True, chunk=7)
    (logp * torch.linspace(-1, 1, len(logp))).sum().backward()  # a loss that weighs the positions unequally
    chunked_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plain_logp, plain_entropy = _plain_logprobs(model, ids, 0.7)
    (plain_logp[rows, cols] * torch.linspace(-1, 1, len(logp))).sum().backward()
    torch.testing.assert_close(logp, plain_logp[rows, cols], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, plain_entropy[rows, cols], atol=1e-5, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(chunked_grads[name], p.grad, atol=1e-5, rtol=1e-4)
    assert max(g.abs().max().item() for g in chunked_grads.values()) > 1e-3  # the gradients were not all zero
    scattered, _ = logprob_head.token_logprobs(logprob_head.attach_logprob_forward(model), ids, mask, 0.7)
    torch.testing.assert_close(scattered, plain_logp.detach() * mask, atol=1e-5, rtol=0)  # 0 off the responses


def test_output_projection_in_fp32_keeps_bf16_rounding_out_of_the_logprobs():
    """Under bf16 mixed precision the hidden states and weights are bf16; computing the logits in bf16 rounds
    logits near 40 to steps of 0.25. _chunk_logprobs projects in fp32: with inputs bf16 holds exactly, the
    log-probs are exact, where bf16 logits are off by more than 0.01."""
    from machinery import trainer
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randint(-8, 9, (16, 32), generator=g) / 2).to(torch.bfloat16)  # exact in bf16
    weight = (torch.randint(-8, 9, (50, 32), generator=g) / 4).to(torch.bfloat16)
    targets = torch.randint(0, 50, (16,), generator=g)
    exact = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert (hidden.double() @ weight.double().T).abs().max() > 32  # logits where bf16 steps by 0.25
    logp, _ = logprob_head._chunk_logprobs(hidden, weight, (None, {}), None, targets, 1.0, False)
    torch.testing.assert_close(logp.double(), exact, atol=2e-5, rtol=0)
    bf16_logits = torch.log_softmax((hidden @ weight.T).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert (bf16_logits.double() - exact).abs().max() > 1e-2


def test_bf16_inputs_give_the_fp32_projections_logprobs_and_gradients():
    """Under bf16 the projection is a bf16 GEMM accumulating in fp32 (_HalfInputLogits; torch.mm's out_dtype on
    CUDA, fp32 copies here): the log-probs and entropies of the fp32 projection of the same bf16 values within
    1e-5, gradients within bf16 rounding, the weight's gradient summed in fp32 (logprob_head._WeightGradient) and handed
    to the weight in its dtype. fp32 inputs (CPU) keep the fp32 path: the old computation, linear(hidden, weight) in
    fp32, to the last bit."""
    from machinery import trainer
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(37, 64, generator=g), torch.randn(500, 64, generator=g) * 0.2
    targets, scale = torch.randint(0, 500, (37,), generator=g), torch.linspace(-1, 1, 37)

    def run(hidden, weight):
        hidden, total = hidden.clone().requires_grad_(), {}
        token = logprob_head._WeightGradient.apply(weight, total) if weight.dtype == torch.bfloat16 else None
        logp, entropy = logprob_head._chunk_logprobs(hidden, weight, (token, total), None, targets, 0.7, True)
        (logp * scale).sum().backward()
        return logp.detach(), entropy, hidden.grad
    w = weight.clone().requires_grad_()
    logp, entropy, grad = run(hidden, w)  # fp32: the parameter itself
    old = torch.nn.functional.linear(hidden, weight) / 0.7  # the fp32 path as it was, to the last bit
    assert torch.equal(logp, old.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(old, -1))
    w16 = weight.bfloat16().requires_grad_()
    logp16, entropy16, grad16 = run(hidden.bfloat16(), w16)
    w_ref = w16.detach().float().requires_grad_()  # the fp32 path on the same (bf16) values
    logp_ref, entropy_ref, grad_ref = run(hidden.bfloat16().float(), w_ref)
    torch.testing.assert_close(logp16, logp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy16, entropy_ref, atol=1e-5, rtol=0)
    assert grad16.dtype == torch.bfloat16 and w16.grad.dtype == torch.bfloat16
    for mine, theirs in ((grad16.float(), grad_ref), (w16.grad.float(), w_ref.grad)):
        assert (mine - theirs).norm() <= 1e-2 * theirs.norm() and theirs.norm() > 0
    assert (logp16 - logp).abs().max() > 1e-3  # bf16 inputs are not the fp32 ones: the check above can fail
