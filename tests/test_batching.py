"""How the trainer cuts its work (machinery/batching.py): micro-batches within the token budget, and sequences
dealt to the ranks by tokens. The same plan under torchrun is tested in tests/test_trainer.py.

    .venv/bin/python -m pytest tests/test_batching.py -q
"""
import numpy as np

from machinery import batching
from machinery import logprob_head


def test_token_budget_micro_batches_cover_every_sequence_once_within_the_budget():
    lengths = [5, 17, 3, 9, 9, 30, 1, 12]
    for padded in (False, True):
        plan = batching.plan_micro_batches(lengths, max_sequences=3, max_tokens=20, padded=padded)
        assert sorted(i for group in plan for i in group) == list(range(len(lengths)))
        for group in plan:
            # packed: the row holds the sum of the lengths; padded: each sequence padded to the longest
            cost = len(group) * max(lengths[i] for i in group) if padded else sum(lengths[i] for i in group)
            assert len(group) <= 3 and (cost <= 20 or len(group) == 1)
            assert [lengths[i] for i in group] == sorted((lengths[i] for i in group), reverse=True)
        assert plan[0] == [5]  # 30 tokens: over the budget, alone
    assert batching.plan_micro_batches(lengths, max_sequences=3) == [[0, 1, 2], [3, 4, 5], [6, 7]]  # no budget


def test_the_planner_counts_the_tokens_the_packed_row_runs():
    """The device check's recorded 1.7B batch (docs/gpu_runs/2026-12-04_trainer.log, round 1: 53,569 tokens in 36
    micro-batches of 2,048 counted as count x longest), rebuilt from its seed as bench/gpu_trainer.py draws it:
    counted as the packed row runs it, at most 28."""
    from bench.gpu_trainer import shared_prompt_batch
    batch = shared_prompt_batch(np.random.default_rng([0, 0]), 151_936, 8, 8, (64, 512), (200, 900))
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in batch]
    assert sum(lengths) == 53_569
    assert len(batching.plan_micro_batches(lengths, 64, 2048, padded=True)) == 36  # as recorded
    assert len(batching.plan_micro_batches(lengths, 64, 2048)) <= 28


def test_ranks_get_tokens_not_counts():
    """Longest first to the least-loaded rank: no rank ends with more than the lightest one plus the longest
    sequence, where slicing by count (first half / second half) gives one rank nearly all the tokens."""
    lengths = [16000, 15000, 14000, 900, 800, 700, 600, 500]
    owner = batching.assign_by_tokens(lengths, world=2)
    load = np.bincount(owner, weights=lengths, minlength=2)
    assert load.max() - load.min() <= max(lengths) and load.max() < 0.6 * sum(lengths)
    assert list(batching.assign_by_tokens([5, 5, 5, 5], world=2)) == [0, 1, 0, 1]  # ties: in order, lowest rank


def _qwen3(**sliding):
    """A tiny Qwen3 (GQA: 4 query heads on 2 key-value heads), fp32, dropout off."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from machinery import trainer
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, **sliding)
    return trainer.prepare_for_training(Qwen3ForCausalLM(config), gradient_checkpointing=False)


def _sequences(seed, lengths, shared=()):
    """(B, T) right-padded ids and the (B, T-1) response mask of prompt + response pairs of these lengths, each
    prompt starting with the tokens `shared`."""
    rng = np.random.default_rng(seed)
    return batching.pack([(list(shared) + rng.integers(1, 64, p).tolist(), rng.integers(1, 64, r).tolist(), [1] * r)
                          for p, r in lengths], "cpu")


def _logprobs_and_grads(model, ids, mask):
    import torch
    from machinery import trainer
    rows, cols = mask.nonzero(as_tuple=True)
    model.zero_grad(set_to_none=True)
    logp, _ = logprob_head.response_logprobs(model, ids, rows, cols, 1.0)
    (logp * torch.linspace(-1, 1, len(logp))).sum().backward()  # positions weighed unequally
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_shared_prefix_groups_spare_each_shared_prefix_once():
    """Two prompts sampled three times each behind one system prompt (GRPO's groups): each prompt's group spares
    its whole prompt, not just the system prompt that all six share; every sequence in exactly one group, no group
    claiming more than its members really share; a lone sequence shares nothing."""
    system, a, b = [9] * 6, [1, 2, 3, 4], [1, 2, 7, 7]
    sequences = [system + a + [5], system + b + [5, 6], system + a + [6], system + b + [8], system + a + [5, 5],
                 system + b]
    groups = batching.shared_prefix_groups(sequences)
    assert sorted(i for _, members in groups for i in members) == list(range(6))
    assert sorted((shared, sorted(members)) for shared, members in groups) == [(10, [0, 2, 4]), (10, [1, 3, 5])]
    for shared, members in groups:
        assert all(sequences[m][:shared] == sequences[members[0]][:shared] for m in members)
    assert batching.shared_prefix_groups([[3, 1], [4, 1], [3]]) == [(1, [2, 0]), (0, [1])]  # [3] is [3, 1]'s prefix


def test_packed_row_keeps_each_sequence_up_to_its_last_target_and_finds_every_position():
    import torch
    ids, mask = _sequences(0, [(5, 3), (2, 9), (4, 0), (7, 1)], shared=[1, 2, 3])  # the third asks for nothing
    mask[1, 9:] = 0  # the second's last 4 response tokens are not asked for: cut after position 8's target
    rows, cols = mask.nonzero(as_tuple=True)
    flat, positions, layout, index = batching.packed_row(ids, rows, cols)
    # the 3 shared tokens once, then each row's own: 11 - 3, 10 - 3 (cut), 11 - 3 tokens; the third left out
    assert flat.shape == (1, 26)
    # one attention call: each of its rows a whole sequence (its prefix and own tokens, then pads), and each row
    # position's output taken from a query at that very position
    (call,) = layout.calls
    lengths = [11, 10, 11]
    assert sorted(flat[0, row][:n].tolist() for row, n in zip(call, sorted(lengths, reverse=True))) == sorted(
        ids[b, :n].tolist() for b, n in zip([0, 1, 3], lengths))
    assert torch.equal(call.flatten()[layout.pick], torch.arange(26))
    assert torch.equal(flat[0, index], ids[rows, cols]) and torch.equal(flat[0, index + 1], ids[rows, cols + 1])
    assert torch.equal(positions[0, index], cols)  # each sequence counts its positions from 0, through the prefix


def test_packed_log_probs_and_gradients_are_the_padded_ones_and_no_sequence_sees_another():
    """The decoder on one packed row (packed_attention; a prefix three sequences share, one sequence whole inside
    another, so with nothing of its own) against the same model on right-padded rows (torch's own causal sdpa):
    the same log-probs and gradients up to the sum's order. And a sequence's log-probs stay put when the other
    sequences of its micro-batch change, which attention across sequences would break."""
    import torch
    from machinery import trainer
    lengths = [(6, 9), (3, 2), (11, 5), (4, 12), (1, 3)]
    ids, mask = _sequences(1, lengths, shared=[5, 6, 7, 8])
    ids[4, :7], mask[4] = ids[0, :7], 0  # the fifth: the first's first 7 tokens...
    mask[4, 4:6] = 1  # ...asked at two of them
    model = _qwen3()
    padded = _logprobs_and_grads(model, ids, mask)
    logprob_head.attach_logprob_forward(model)
    assert model.config._attn_implementation == batching.PACKED_ATTENTION
    packed = _logprobs_and_grads(model, ids, mask)
    torch.testing.assert_close(packed[0], padded[0], atol=1e-5, rtol=0)
    for name, grad in padded[1].items():
        torch.testing.assert_close(packed[1][name], grad, atol=1e-5, rtol=1e-4)
    others, _ = _sequences(2, lengths, shared=[9, 9, 9, 9])  # every sequence's tokens different...
    others[2] = ids[2]  # ...but the third's
    rows, cols = mask.nonzero(as_tuple=True)
    with torch.no_grad():
        again, _ = logprob_head.response_logprobs(model, others, rows, cols, 1.0)
    third = rows == 2
    torch.testing.assert_close(again[third], packed[0][third], atol=1e-6, rtol=0)
    assert (again[~third] - packed[0][~third]).abs().max() > 1e-2


def test_packed_attention_keeps_a_sliding_window_and_refuses_an_unpacked_call():
    """A model with a sliding window (here 4 tokens on every layer): transformers builds it into the mask of the
    padded call; packed_attention rebuilds it per sequence. The window matters (without it the numbers differ),
    and a call without sequence bounds (the model's own forward) raises instead of attending across sequences."""
    import pytest
    import torch
    from machinery import trainer
    ids, mask = _sequences(3, [(7, 8), (2, 3), (9, 6)])
    windowed, full = _qwen3(use_sliding_window=True, sliding_window=4, max_window_layers=0), _qwen3()
    padded = _logprobs_and_grads(windowed, ids, mask)[0]
    assert not torch.allclose(padded, _logprobs_and_grads(full, ids, mask)[0], atol=1e-3)
    logprob_head.attach_logprob_forward(windowed)
    torch.testing.assert_close(_logprobs_and_grads(windowed, ids, mask)[0], padded, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="packed_attention"):
        windowed(input_ids=ids)


def _old_packed_attention(module, query, key, value, attention_mask, packed_layout=None, sliding_window=None,
                          **kwargs):
    """packed_attention as it was: a gather per call and tensor (the reference its outputs must equal)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    out = []
    for positions in packed_layout.calls:
        q, k, v = (x[0].index_select(1, positions.flatten()).unflatten(1, positions.shape).transpose(0, 1)
                   for x in (query, key, value))
        n, mask = positions.shape[1], None
        if sliding_window is not None and n > sliding_window:
            i = torch.arange(n, device=q.device)
            mask = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window))[None, None]
        out.append(sdpa_attention_forward(module, q, k, v, mask, **kwargs)[0].flatten(0, 1))
    return torch.cat(out).index_select(0, packed_layout.pick)[None], None


def _one_layer(seed, lengths, shared, calls):
    """A packed row's layout with `calls` attention calls, and one GQA layer's (1, heads, S, d) query, key and value
    (4 query heads on 2 key-value heads) that want gradients, and a stand-in for the attention module."""
    import types
    import torch
    ids, mask = _sequences(seed, lengths, shared=shared)
    _, _, layout, _ = batching.packed_row(ids, *mask.nonzero(as_tuple=True))
    assert len(layout.calls) == calls
    S = int(layout.pick.numel())
    g = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(1, heads, S, 8, generator=g).requires_grad_() for heads in (4, 2, 2)]
    return layout, qkv, types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=True)


def _attend(function, layout, qkv, module, **kwargs):
    """function's output on the layer and the gradients of q, k, v under a loss that weighs every output."""
    import torch
    for x in qkv:
        x.grad = None
    out, _ = function(module, *qkv, None, packed_layout=layout, scaling=8 ** -0.5, dropout=0.0, **kwargs)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out.detach(), [x.grad.clone() for x in qkv]


# four prompts with nothing in common (a call each), and a shared prefix whose sequences differ so much in length
# that they take two calls
LAYER_CALLS = [(1, [(5, 3), (7, 9), (2, 4), (6, 1)], (), 4), (2, [(3, 2), (3, 30), (3, 3)], (7, 7, 7, 7), 2)]


def test_packed_attention_gathers_once_per_layer_whatever_the_calls_and_keeps_its_numbers():
    """One gather of q, k and v each (and one of the outputs, packed_layout.pick) per layer, forward and backward
    (index_add), however many calls the layout has; a gather per call cost each call's backward a zero buffer the
    size of the whole row. The outputs are the per-call version's to the last bit, and so are the gradients of
    positions that one call reads; a prefix two calls share sums its gradient in another order."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("index_select", "index_add", "index_add_"):
                self.counts[name.rstrip("_")] = self.counts.get(name.rstrip("_"), 0) + 1
            return func(*args, **(kwargs or {}))

    for seed, lengths, shared, calls in LAYER_CALLS:
        layout, qkv, module = _one_layer(seed, lengths, shared, calls)
        with Count() as count:
            count.counts = {}
            out, grads = _attend(batching.packed_attention, layout, qkv, module)
        assert count.counts == {"index_select": 4, "index_add": 4}, count.counts  # q, k, v and the pick
        old_out, old_grads = _attend(_old_packed_attention, layout, qkv, module)
        assert torch.equal(out, old_out)
        for grad, old in zip(grads, old_grads):
            if calls == 4:  # no position in two calls
                assert torch.equal(grad, old)
            torch.testing.assert_close(grad, old, atol=1e-6, rtol=0)


def test_fp32_gqa_on_a_gpu_repeats_the_key_value_heads_and_the_numbers_stay():
    """On CUDA in fp32 with fewer key-value heads than query heads, packed_attention repeats the key-value heads
    itself (sdpa would otherwise take its math kernel: no fused fp32 kernel takes GQA); not in bf16 or fp16, not
    on CPU, not without GQA. Forced on here, the repeated heads give the GQA call's outputs and gradients, and a
    sliding-window call (masked: transformers repeats the heads itself) is not repeated twice."""
    import pytest
    import torch
    need = batching._needs_repeated_kv
    assert need("cuda", torch.float32, 32, 8)
    assert not need("cuda", torch.bfloat16, 32, 8) and not need("cuda", torch.float16, 32, 8)
    assert not need("cpu", torch.float32, 32, 8) and not need("cuda", torch.float32, 8, 8)
    seed, lengths, shared, calls = LAYER_CALLS[1]
    for window in (None, 4):
        layout, qkv, module = _one_layer(seed, lengths, shared, calls)
        gqa = _attend(batching.packed_attention, layout, qkv, module, sliding_window=window)
        with pytest.MonkeyPatch.context() as patch:
            repeats = []
            patch.setattr(batching, "_needs_repeated_kv", lambda *args: repeats.append(args) or True)
            repeated = _attend(batching.packed_attention, layout, qkv, module, sliding_window=window)
        assert len(repeats) == (calls if window is None else 0)  # both calls here are longer than the window
        for mine, theirs in zip([repeated[0], *repeated[1]], [gqa[0], *gqa[1]]):
            torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-5)  # another sdpa kernel


def _replay_layouts(model, rounds, budgets=((4096, False), (2048, True), (32768, False), (16384, True))):
    """Per round, the frames dynamo has compiled after the trainer's passes over a fresh batch drawn as the device
    check draws the recorded 1.7B batch (token ids mod the tiny vocabulary), at the old and the new budgets."""
    import torch
    from torch._dynamo.utils import counters
    from bench.gpu_trainer import shared_prompt_batch
    from machinery import trainer
    rng, compiled = np.random.default_rng([0, 0]), []
    for _ in range(rounds):
        batch = [([t % 64 for t in r.prompt_ids], [t % 64 for t in r.response_ids], [1] * len(r.response_ids))
                 for r in shared_prompt_batch(rng, 151_936, 8, 8, (64, 512), (200, 900))]
        for budget, grad in budgets:
            for group in batching.plan_micro_batches([len(p) + len(r) for p, r, _ in batch], 64, budget):
                ids, mask = batching.pack([batch[i] for i in group])
                with torch.set_grad_enabled(grad):
                    logp, _ = logprob_head.response_logprobs(model, ids, *mask.nonzero(as_tuple=True), 1.0)
                    if grad:
                        logp.sum().backward()
        compiled.append(dict(counters["frames"]))
    return compiled


def test_compiled_decoder_layers_compile_in_round_1_only_over_the_recorded_layouts(capsys):
    """--compile on's layers (trainer.compile_decoder_layers; dynamo's eager backend here: its guards and
    recompiles are the same) over three rounds of micro-batch layouts: every frame compiled in round 1, none after,
    none refused (packed_attention runs eager inside, so a layout is no guard). With a recompile limit of 1 the
    same layouts hit it, and the run says so in one line."""
    import torch
    from machinery import trainer
    torch._dynamo.reset()
    model = _qwen3()
    logprob_head.attach_logprob_forward(model)
    trainer.compile_decoder_layers(model, backend="eager")
    first, *later = _replay_layouts(model, 3)
    assert first["ok"] == first["total"] > 0 and all(frames == first for frames in later), (first, later)
    assert "recompile" not in capsys.readouterr().err
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        _replay_layouts(model, 1, budgets=((2048, True),))
    said = [line for line in capsys.readouterr().err.splitlines() if "recompile" in line]
    assert len(said) == 1 and said[0].startswith("warning: --compile: torch._dynamo hit config.recompile_limit (1); "
                                                 "function: "), said
