"""The trainer machinery (machinery/trainer.py) on the real FSDP2 under torchrun: two ranks compute the same update
as one process, the weight push makes vLLM sample from the trained policy, and a non-finite loss skips the step.

    .venv/bin/python -m pytest tests/test_trainer.py -q
"""
import contextlib
import functools
import math
import sys

import numpy as np
import pytest
import torch

from common import end_worker, ok, torchrun
from machinery import device as devices, logprob_head


@pytest.mark.slow
def test_two_rank_fsdp2_gradients_and_normalisation_equal_one_process(small_toy, tmp_path):
    """Same global batch, one SGD step (lr 1, no clipping): the weights after the step are the gradients.
    World 2 must equal world 1, and Eq. 9's normalisation over two ranks must equal the single-process one.
    FSDP2's units (CPU's default: the whole model; GPU's: each decoder layer) change no number at all."""
    out = {}
    for run, world, max_tokens, units in (("w1", 1, "none", "model"), ("w2", 2, "none", "model"),
                                          ("w2_tokens", 2, "12", "model"), ("w2_layers", 2, "none", "layers")):
        ok(torchrun(world, "tests/test_trainer.py", "grad_worker", str(tmp_path / f"{run}.pt"), small_toy["model"],
                    max_tokens, units))
        out[run] = torch.load(tmp_path / f"{run}.pt", weights_only=False)
    moved = 0.0
    for name, p1 in out["w1"]["params"].items():
        torch.testing.assert_close(out["w2"]["params"][name], p1, atol=2e-6, rtol=1e-5)
        assert torch.equal(out["w2_layers"]["params"][name], out["w2"]["params"][name]), name
        # token budgets (sequences dealt to the ranks by tokens, sorted, uneven counts: idle ranks run a dummy)
        # change nothing either
        torch.testing.assert_close(out["w2_tokens"]["params"][name], p1, atol=5e-6, rtol=1e-5)  # (sums reordered)
        moved = max(moved, (p1 - out["w1"]["before"][name]).abs().max().item())
    assert moved > 1e-4  # the step really moved the weights, so the comparison means something
    advantage = out["w1"]["raw_advantage"]
    expected = (advantage - advantage.mean()) / (advantage.std(ddof=1) + 1e-8)
    np.testing.assert_allclose(out["w2"]["normalised"], expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out["w1"]["normalised"], expected, rtol=1e-6, atol=1e-7)
    assert out["w2_tokens"]["micro_batches"] > out["w2"]["micro_batches"]  # the budget really split the batch
    # The old-log-prob pass: dealt to the ranks by tokens, each result back to its owner, the same numbers.
    for run in ("w2", "w2_tokens"):
        for got, expected in zip(out[run]["old"], out["w1"]["old"], strict=True):
            np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)  # float32 batch-shape effects only
    # entropy: each rank's token mean over its own responses (metrics average the ranks), wherever they were scored
    assert abs(out["w2_tokens"]["entropy"] - out["w2"]["entropy"]) < 1e-6 and out["w2"]["entropy"] > 0.1
    # trainer.clip_grad_norm (one collective) gives torch's clip_grad_norm_ numbers bit for bit, clipping (the norm
    # is above 0.5) and not
    for run in out:
        (ours, theirs), (clipped_ours, clipped_theirs) = (c["norms"] for c in out[run]["clip"])
        assert ours == theirs and clipped_ours == clipped_theirs and clipped_ours > 0.5, run
        assert all(c["same_grads"] for c in out[run]["clip"]), run
    # --kl_coef's penalty reaches the gradient at its scale, on any number of ranks and micro-batches: the trainer's
    # step with zero advantages is minus the gradient of coef x k3's token mean (autograd over the global batch)
    for run in out:
        moved = max(float(step.abs().max()) for step, _ in out[run]["kl_step"].values())
        assert moved > 1e-5, run  # the penalty alone moved the weights (without it the step is 0)
        for name, (step, expected) in out[run]["kl_step"].items():
            torch.testing.assert_close(step, expected, atol=1e-6, rtol=1e-4, msg=f"{run} {name}")


@pytest.mark.slow
def test_compiled_decoder_layers_give_the_eager_step(small_toy, tmp_path):
    """--compile on (each decoder layer torch.compile'd before FSDP2, inductor on this CPU): the same SGD step and
    old log-probs as eager, to float32 rounding (the fused kernels sum in another order)."""
    out = {}
    for run in ("model", "compiled"):
        ok(torchrun(2, "tests/test_trainer.py", "grad_worker", str(tmp_path / f"{run}.pt"), small_toy["model"], "none",
                    run))
        out[run] = torch.load(tmp_path / f"{run}.pt", weights_only=False)
    assert all(out["compiled"]["compiled"]) and not any(out["model"]["compiled"])  # nn.Module.compile really ran
    worst = 0.0
    for name, p in out["model"]["params"].items():
        step = p - out["model"]["before"][name]
        compiled_step = out["compiled"]["params"][name] - out["model"]["before"][name]
        assert step.norm() > 0, name  # the step moved every tensor, so the comparison means something
        worst = max(worst, float((compiled_step - step).norm() / step.norm()))
    assert worst < 1e-3, worst  # each tensor's step within 0.1% of its size (a wrong kernel: off by ~1)
    for got, expected in zip(out["compiled"]["old"], out["model"]["old"], strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_vllm_logprobs_match_trainer_after_weight_push(small_toy, tmp_path):
    ok(torchrun(1, "tests/test_trainer.py", "push_worker", str(tmp_path / "push.pt"), small_toy["model"]))
    result = torch.load(tmp_path / "push.pt", weights_only=False)
    assert result["gap_before_push"] > 1e-2  # the update changed the policy: a missed push would show
    assert result["gap_after_push"] < 1e-4
    # --bf16 off: the push keeps fp32 (a bf16 cast would round these trained weights; 1e-2 steps move them off bf16's)
    assert result["norm"].dtype == torch.float32 and torch.equal(result["norm"], result["pushed_norm"])
    assert not torch.equal(result["pushed_norm"], result["pushed_norm"].bfloat16().float())
    assert result["nonfinite_flagged"] and result["nonfinite_left_weights_alone"]


@pytest.mark.slow
def test_micro_batches_wait_for_no_device_read_and_reduce_once_with_the_same_gradient(small_toy, tmp_path):
    """Two ranks (gloo), one SGD step (lr 1: the weights move by the gradient) over 4 sequences a rank, as 1 and as
    4 micro-batches: the host reads of tensor values (those that wait for a GPU: HostReads) are as many for 4 as
    for 1, in the no-grad pass and in the update, so none happens per micro-batch; FSDP2 reduces the gradient once
    per optimiser step (4 times when every micro-batch syncs, as before); and the gradient is the one of a sync
    after every micro-batch, and of one micro-batch, to rounding."""
    ok(torchrun(2, "tests/test_trainer.py", "sync_worker", str(tmp_path / "sync.pt"), small_toy["model"]))
    out = torch.load(tmp_path / "sync.pt", weights_only=False)
    assert out["one"]["reads"] == out["many"]["reads"], out  # (old log-probs, update): nothing per micro-batch
    assert out["many"]["reduces"] == 1 and out["every"]["reduces"] == 4
    for name, p in out["every"]["params"].items():  # (float32 sums in another order)
        torch.testing.assert_close(out["many"]["params"][name], p, atol=5e-6, rtol=1e-5)
        torch.testing.assert_close(out["one"]["params"][name], p, atol=5e-6, rtol=1e-5)
    assert max((p - out["before"][n]).abs().max() for n, p in out["every"]["params"].items()) > 1e-4  # moved


@pytest.mark.slow
def test_the_bucketed_weight_gather_equals_full_tensor_with_uneven_shards(tmp_path):
    """full_parameters gathers many shards per collective: on 3 ranks (7, 3 and 11 rows: uneven shards, a rank
    with fewer rows) and for buckets of one tensor, a few and all, the same names, order and bytes as
    DTensor.full_tensor() and as the unsharded weights, also cast to bf16 before the gather. all_gather_objects
    returns what torch's all_gather_object does, with pickles under, over and far over its first buffer."""
    ok(torchrun(3, "tests/test_trainer.py", "gather_worker", str(tmp_path / "ok")))
    assert (tmp_path / "ok").exists()


def _saved_activation_bytes(model, ids):
    """Bytes autograd keeps for the backward pass of the log-prob forward, and the log-probs."""
    from machinery import trainer
    saved = [0]

    def keep(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor
    mask = torch.ones(ids.shape[0], ids.shape[1] - 1)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        logprobs, _ = logprob_head.token_logprobs(logprob_head.attach_logprob_forward(model), ids, mask, 1.0)
    logprobs.sum().backward()
    return saved[0], logprobs.detach()


def test_gradient_checkpointing_really_drops_activations(tmp_path):
    """transformers checkpoints a layer only in training mode, and from_pretrained returns eval mode: enabling
    checkpointing without .train() (the old build_policy) keeps every activation. prepare_for_training keeps far
    fewer, and the log-probs do not change (dropout stays off)."""
    from tasks import toy
    from machinery import trainer
    tokenizer = toy.build_tokenizer(str(tmp_path))
    ids = torch.randint(3, 128, (4, 96), generator=torch.Generator().manual_seed(0))

    def model(mode):
        m = toy.build_model(tokenizer, seed=0).eval()  # as from_pretrained returns it
        if mode == "eval_mode_checkpointing":
            m.gradient_checkpointing_enable()
        elif mode != "eval":
            trainer.prepare_for_training(m, gradient_checkpointing=(mode == "checkpointing"))
        return m
    measured = {mode: _saved_activation_bytes(model(mode), ids)
                for mode in ("eval", "eval_mode_checkpointing", "train", "checkpointing")}
    assert measured["eval_mode_checkpointing"][0] == measured["eval"][0]  # the bug: nothing was dropped
    assert measured["checkpointing"][0] < 0.5 * measured["train"][0]
    for mode in ("eval_mode_checkpointing", "train", "checkpointing"):
        torch.testing.assert_close(measured[mode][1], measured["eval"][1], atol=1e-6, rtol=0)


def test_prepare_for_training_turns_dropout_off():
    from machinery import trainer
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, attention_dropout=0.5)
    model = trainer.prepare_for_training(Qwen3ForCausalLM(config), gradient_checkpointing=False)
    assert model.training
    assert all(m.attention_dropout == 0.0 for m in model.modules() if hasattr(m, "attention_dropout"))
    ids = torch.arange(3, 19)[None]
    torch.testing.assert_close(model(ids).logits, model(ids).logits)  # deterministic in training mode


# ---- workers, run under torchrun by the tests above
def _fixed_batch(tokenizer_size, n=8, seed=0):
    from rollout import Rollout
    rng = np.random.default_rng(seed)
    rollouts = []
    for _ in range(n):
        response = list(rng.integers(3, tokenizer_size, size=rng.integers(2, 9)))
        rollouts.append(Rollout(list(rng.integers(3, tokenizer_size, size=rng.integers(3, 7))), response,
                                [0.0] * len(response), "", "stop"))
    advantage = rng.normal(size=n)
    return rollouts, advantage


def _update_loss():
    from spo import ppo_clip_loss
    return functools.partial(ppo_clip_loss, clip_low=0.2, clip_high=0.28, dual_clip=10.0)


def _update(policy, optimizer, rollouts, old, advantage, micro_batch_size, grad_clip, max_tokens=None):
    """One optimiser step of Eq. 10 with the paper's clip settings, through the trainer's machinery."""
    from machinery import trainer
    return trainer.ppo_update(policy, optimizer, rollouts, old, advantage, _update_loss(), ppo_steps=1,
                              micro_batch_size=micro_batch_size, temperature=1.0, grad_clip=grad_clip,
                              max_tokens=max_tokens)


def grad_worker(out, model_path, max_tokens, units):
    from machinery import batching, collectives, trainer
    from spo import global_normalise
    from torch.distributed.tensor import DTensor
    max_tokens = None if max_tokens == "none" else int(max_tokens)
    build = functools.partial(trainer.build_policy, model_path, lr=1.0, weight_decay=0.0,
                              layer_units=units == "layers", compile_layers=units == "compiled")
    rank, world, device = devices.setup_distributed()
    policy, _ = build(device)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    before = {k: v.clone() for k, v in collectives.full_parameters(policy)}
    rollouts, advantage = _fixed_batch(90)
    local = len(rollouts) // world
    mine = slice(rank * local, (rank + 1) * local)
    scored = trainer.old_logprobs(policy, rollouts[mine], [], 1.0, 2, max_tokens)
    old_all = collectives.all_gather_objects(scored["batch"])
    entropy = collectives.all_reduce_np([scored["entropy"]])[0]
    old = [lp - 0.05 for lp in scored["batch"]]  # ratios away from 1, inside the clip range on both sides
    _update(policy, optimizer, rollouts[mine], old, advantage[mine], micro_batch_size=2, grad_clip=1e9,
            max_tokens=max_tokens)
    params = {k: v.clone() for k, v in collectives.full_parameters(policy)}
    normalised = collectives.all_gather_np(global_normalise(advantage[mine]))
    micro_batches = len(batching.micro_batches([len(r.prompt_ids) + len(r.response_ids) for r in rollouts[mine]],
                                               2, max_tokens))
    # trainer.clip_grad_norm against torch's clip_grad_norm_ on these sharded gradients, clipping and not
    ids, mask = batching.pack([(r.prompt_ids, r.response_ids, r.response_mask) for r in rollouts[mine]], device)
    (logprob_head.token_logprobs(policy, ids, mask, 1.0)[0] * torch.tensor(advantage[mine])[:, None]).sum().backward()
    grads = [p.grad.to_local().clone() for p in policy.parameters()]
    clip = []
    for max_norm in (1e9, 0.5):
        result = {}
        for way, fn in (("ours", trainer.clip_grad_norm), ("torch", torch.nn.utils.clip_grad_norm_)):
            for p, g in zip(policy.parameters(), grads):
                p.grad.to_local().copy_(g)
            norm = fn(policy.parameters(), max_norm)
            result[way] = (float(norm.full_tensor() if isinstance(norm, DTensor) else norm),
                           [p.grad.full_tensor().clone() for p in policy.parameters()])
        clip.append({"norms": (result["ours"][0], result["torch"][0]),
                     "same_grads": all(torch.equal(a, b) for a, b in zip(result["ours"][1], result["torch"][1]))})
    kl_policy = build(device)[0]  # at the initial weights (the lr-1 step above leaves a policy too far for this)
    kl_step = _kl_step(kl_policy, torch.optim.SGD(kl_policy.parameters(), lr=1.0), rollouts[mine], old, device,
                       max_tokens)
    if rank == 0:
        torch.save({"params": params, "before": before, "raw_advantage": advantage, "normalised": normalised,
                    "micro_batches": micro_batches, "old": old_all, "entropy": entropy / world,
                    "clip": clip, "compiled": [getattr(layer, "_compiled_call_impl", None) is not None
                                               for layer in policy.model.layers], "kl_step": kl_step}, out)
    end_worker()


def _kl_step(policy, optimizer, rollouts, old, device, max_tokens, coef=0.5):
    """--kl_coef's penalty alone (every advantage 0, so Eq. 10's loss and gradient are 0): one SGD step (lr 1) of
    the trainer against the gradient of coef x k3's token mean over the global batch computed here by autograd,
    {name: (the step, minus that gradient)}."""
    from machinery import batching, collectives, trainer
    from variants import kl_to_reference
    ref = [lp + 0.2 * np.cos(np.arange(len(lp))) for lp in old]  # a reference policy's log-probs, fixed
    sequences = [batching.Sequence(r.prompt_ids, r.response_ids, r.response_mask, ref=f) for r, f in zip(rollouts, ref)]
    ids, mask = batching.pack(sequences, device)
    ref_logp = batching.loss_terms(sequences, ref=True)[2].to(device)
    logp = logprob_head.token_logprobs(policy, ids, mask, 1.0)[0]
    tokens = collectives.all_reduce_np([float(mask.sum())])[0]
    (coef * (kl_to_reference(logp * mask, ref_logp * mask, "k3") * mask).sum() / tokens
     * torch.distributed.get_world_size()).backward()  # x world: FSDP2 averages the ranks' gradients
    expected = {name: -p.grad.full_tensor().clone() for name, p in policy.named_parameters()}
    optimizer.zero_grad(set_to_none=True)
    start = {k: v.clone() for k, v in collectives.full_parameters(policy)}
    trainer.ppo_update(policy, optimizer, rollouts, old, np.zeros(len(rollouts)), _update_loss(), ppo_steps=1,
                       micro_batch_size=2, temperature=1.0, grad_clip=1e9, max_tokens=max_tokens, reference=ref,
                       kl=(coef, functools.partial(kl_to_reference, estimator="k3")))
    return {k: (v - start[k], expected[k]) for k, v in collectives.full_parameters(policy) if k in expected}


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the reads of tensor values that wait for the device on a GPU, on a CPU: the ops that do
    (_local_scalar_dense: .item(), float(); nonzero: its size), and .numpy(), .tolist() or .cpu() of a tensor that
    torch computed (on a GPU, a device tensor). Host tensors made from numpy or lists (batching.pack) are not."""
    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten.equal.default}

    def __enter__(self):
        self.count, self.computed = 0, {}
        self.methods = {name: getattr(torch.Tensor, name) for name in ("numpy", "tolist", "cpu")}
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, self._counted(method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def _counted(self, method):
        def read(tensor, *args, **kwargs):
            ref = self.computed.get(id(tensor))
            self.count += ref is not None and ref() is tensor
            return method(tensor, *args, **kwargs)
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.lift_fresh.default:  # torch.from_numpy, torch.tensor: made on the host
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.computed[id(t)] = __import__("weakref").ref(t)
        return out


def sync_worker(out, model_path):
    from machinery import collectives, trainer
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    rank, world, device = devices.setup_distributed()
    rollouts, advantage = _fixed_batch(90)
    mine, advantage = rollouts[rank * 4: rank * 4 + 4], advantage[rank * 4: rank * 4 + 4]
    reduces, reduce = [], _fsdp_param_group.foreach_reduce  # FSDP2's gradient reduce (-scatter), once per unit
    _fsdp_param_group.foreach_reduce = lambda *a, **k: (reduces.append(1), reduce(*a, **k))[1]
    result = {}
    for label, micro_batch_size in (("one", 4), ("many", 1), ("every", 1), ("one", 4), ("many", 1)):
        policy, _ = trainer.build_policy(model_path, device, lr=1.0, weight_decay=0.0)
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)  # (before full_parameters: the shards)
        result["before"] = {k: v.clone() for k, v in collectives.full_parameters(policy)}
        if label == "every":  # as before: FSDP2 reduces after every micro-batch's backward
            policy.set_requires_gradient_sync = lambda *_: None
        counting = label in result  # the second time: the reads counted (the mode hides the update's weights)
        with HostReads() if counting else contextlib.nullcontext() as reads:
            old = trainer.old_logprobs(policy, mine, [], 1.0, micro_batch_size)["batch"]
        reduces.clear()
        with HostReads() if counting else contextlib.nullcontext() as update_reads:
            _update(policy, optimizer, mine, [lp - 0.05 for lp in old], advantage, micro_batch_size, grad_clip=1e9)
        if counting:
            result[label]["reads"] = (reads.count, update_reads.count)
        else:
            result[label] = {"reduces": len(reduces),
                             "params": {k: v.clone() for k, v in collectives.full_parameters(policy)}}
    if rank == 0:
        torch.save(result, out)
    end_worker()


def gather_worker(out):
    from machinery import collectives, trainer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, world, _ = devices.setup_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3, bias=False), torch.nn.Embedding(11, 5))
    unsharded = {k: v.detach().clone() for k, v in model.named_parameters()}
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for bucket_bytes in (1, 40, 2 ** 28):
        got = list(collectives.full_parameters(model, bucket_bytes=bucket_bytes))
        plain = [(n, p.detach().full_tensor()) for n, p in model.named_parameters(remove_duplicate=False)]
        assert [n for n, _ in got] == [n for n, _ in plain] == list(unsharded)
        assert all(torch.equal(a, b) and torch.equal(a, unsharded[n]) for (n, a), (_, b) in zip(got, plain))
        for name, full in collectives.full_parameters(model, torch.bfloat16, bucket_bytes=bucket_bytes):
            assert full.dtype == torch.bfloat16 and torch.equal(full, unsharded[name].to(torch.bfloat16))
    # all_gather_objects: pickles that fit its first buffer, one just over it (rank 1), none (rank 2)
    room = collectives.OBJECT_BUCKET_BYTES
    for sizes in ((3, 5, 0), (3, room, 0), (room // 2, 4 * room, room - 40)):
        mine = [bytes([rank]) * sizes[rank], ("rank", rank, np.arange(rank + 1.0))] if sizes[rank] else []
        expected = [None] * world
        torch.distributed.all_gather_object(expected, mine)
        got = collectives.all_gather_objects(mine)
        expected = [item for part in expected for item in part]
        assert len(got) == len(expected) and all(type(a) is type(b) for a, b in zip(got, expected))
        assert repr(got) == repr(expected), sizes
    if rank == 0:
        open(out, "w").close()
    end_worker()


def push_worker(out, model_path):
    from machinery import collectives, trainer
    from rollout import Engine
    rank, world, device = devices.setup_distributed()
    policy, optimizer = trainer.build_policy(model_path, device, lr=1e-2, weight_decay=0.0)
    engine = Engine(model_path, seed=0, max_model_len=128, device=device, bf16=False)  # --bf16 off
    rollouts, advantage = _fixed_batch(90)
    old = trainer.old_logprobs(policy, rollouts, [], 1.0, 8)["batch"]
    for _ in range(3):
        _update(policy, optimizer, rollouts, old, advantage, micro_batch_size=8, grad_clip=1.0)
    prompts = [r.prompt_ids for r in rollouts]
    sampled = engine.generate(prompts, seeds=range(len(prompts)), max_tokens=16)
    gap_before = trainer.old_logprobs(policy, sampled, [], 1.0, 8)["logprob_gap_max"]
    engine.push_weights(policy)
    sampled = engine.generate(prompts, seeds=range(len(prompts)), max_tokens=16)
    gap_after = trainer.old_logprobs(policy, sampled, [], 1.0, 8)["logprob_gap_max"]
    norm = engine.llm.apply_model(lambda model: model.model.norm.weight.detach().cpu().clone())[0]
    pushed_norm = dict(collectives.full_parameters(policy))["model.norm.weight"]
    # A non-finite loss is flagged and the step skipped: the weights stay as they were.
    before = {k: v.clone() for k, v in collectives.full_parameters(policy)}
    stats = _update(policy, optimizer, rollouts, old, np.full(len(rollouts), np.nan), micro_batch_size=8,
                    grad_clip=1.0)
    unchanged = all(torch.equal(before[k], v) for k, v in collectives.full_parameters(policy))
    torch.save({"gap_before_push": gap_before, "gap_after_push": gap_after, "norm": norm, "pushed_norm": pushed_norm,
                "nonfinite_flagged": stats["nonfinite"], "nonfinite_left_weights_alone": unchanged}, out)
    engine.shutdown()


if __name__ == "__main__":  # torchrun tests/test_trainer.py WORKER OUT [ARGS...]
    globals()[sys.argv[1]](*sys.argv[2:])


def test_the_learning_rate_schedule_by_hand():
    """Warmup lr x step / 4 over 4 steps, then constant, or a cosine over the 4 steps left: lr, (1 + cos(pi / 4)) / 2,
    1/2, (1 + cos(3 pi / 4)) / 2 of lr (never 0: the last step still learns)."""
    from machinery.trainer import scheduled_lr
    assert [scheduled_lr(s, 1.0, 4, "constant", 8) for s in range(1, 9)] == [0.25, 0.5, 0.75, 1, 1, 1, 1, 1]
    cosine = [scheduled_lr(s, 2.0, 4, "cosine", 8) for s in range(1, 9)]
    np.testing.assert_allclose(cosine, [0.5, 1, 1.5, 2, 2, 1 + math.cos(math.pi / 4), 1, 1 + math.cos(3 * math.pi / 4)])
    assert scheduled_lr(1, 3e-6, 0, "constant", 10) == 3e-6  # no warmup: --lr from step 1 (the paper, the default)
