"""With one optimiser step per batch (--ppo_steps 1) the update's own forward gives the batch's old log-probs
(trainer.reuses_forward): the same step as with step 4's separate no-grad pass, on the real FSDP2 under torchrun.

    .venv/bin/python -m pytest tests/test_reused_forward.py -q
"""
import copy
import functools
import sys

import numpy as np
import pytest
import torch

from common import end_worker, ok, torchrun
from machinery import device as devices


def test_one_step_without_tis_reuses_the_forward():
    from machinery.trainer import reuses_forward
    assert reuses_forward(1, 0.0)
    assert not reuses_forward(2, 0.0)  # later steps' ratios need the policy before the first
    assert not reuses_forward(1, 2.0)  # --tis weighs by old log-probs fixed before the update


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", ["none", "12"])
def test_the_update_forward_gives_the_pass_step_and_log_probs(small_toy, tmp_path, max_tokens):
    """Two ranks, one SGD step at lr 1 (the weights move by the gradients): with and without step 4's pass over
    the batch the weights after the step, the log-probs SPO remembers for D(x) (each back on the rank that owns its
    response, also where token budgets dealt it to the other rank), the entropy and the engine gap agree to
    rounding; the reused step's ratio is exactly 1; step 4's log-probs are never written by step 6."""
    out = tmp_path / "out.pt"
    ok(torchrun(2, "tests/test_reused_forward.py", "worker", str(out), small_toy["model"], max_tokens))
    got = torch.load(out, weights_only=False)
    passed, reused = got["pass"], got["reuse"]
    moved = 0.0
    for name, p in passed["params"].items():
        torch.testing.assert_close(reused["params"][name], p, atol=1e-6, rtol=1e-6)
        moved = max(moved, (p - got["before"][name]).abs().max().item())
    assert moved > 1e-4  # the step moved the weights: the comparison means something
    assert len(reused["remembered"]) == len(passed["remembered"]) == 8
    for a, b in zip(reused["remembered"], passed["remembered"], strict=True):
        assert a.dtype == np.float32 and a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert abs(reused["entropy"] - passed["entropy"]) < 1e-5 and passed["entropy"] > 0.1
    assert abs(reused["gap"] - passed["gap"]) < 1e-5
    assert reused["approx_kl"] == 0.0 and reused["clip_fraction"] == 0.0
    # data flows forward: step 6 hands back its own dict, of step 4's shape, and leaves step 4's as it was
    assert passed["old_untouched"] and reused["old_untouched"] and passed["shape"] and reused["shape"]


def same(a, b):
    """a == b, arrays compared by value (step 4's dict holds lists of arrays)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a) == sorted(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) else a == b


# ---- the worker, run under torchrun by the test above
def worker(out, model_path, max_tokens):
    from machinery import collectives, trainer
    from spo import ppo_clip_loss
    from rollout import Rollout
    max_tokens = None if max_tokens == "none" else int(max_tokens)
    rank, world, device = devices.setup_distributed()
    rng = np.random.default_rng(0)
    rollouts = []
    for _ in range(8):  # lengths that differ, so token budgets deal sequences to the other rank
        response = [int(t) for t in rng.integers(3, 90, size=rng.integers(2, 12))]
        rollouts.append(Rollout([int(t) for t in rng.integers(3, 90, size=rng.integers(3, 7))], response,
                                list(rng.normal(-4.0, 0.1, size=len(response))), "", "stop"))
    advantage = rng.normal(size=8)
    mine = slice(rank * 4, rank * 4 + 4)
    loss_fn = functools.partial(ppo_clip_loss, clip_low=0.2, clip_high=0.28, dual_clip=10.0)
    result = {}
    for way in ("pass", "reuse"):
        policy, _ = trainer.build_policy(model_path, device, lr=1.0, weight_decay=0.0)
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        before = {k: v.clone() for k, v in collectives.full_parameters(policy)}
        old = trainer.old_logprobs(policy, [] if way == "reuse" else rollouts[mine], [], 1.0, 2, max_tokens)
        step_4 = copy.deepcopy(old)
        stats, acting = trainer.update(policy, optimizer, rollouts[mine], old, advantage[mine], loss_fn, check=True,
                                       lr=1.0, ppo_steps=1, micro_batch_size=2, temperature=1.0, grad_clip=1e9,
                                       max_tokens=max_tokens)
        result[way] = {"params": {k: v.clone() for k, v in collectives.full_parameters(policy)},
                       "remembered": collectives.all_gather_objects(acting["batch"]),  # (one list over the ranks)
                       "entropy": acting["entropy"], "gap": acting["logprob_gap_mean"],
                       "approx_kl": stats["approx_kl"], "clip_fraction": stats["clip_fraction"],
                       "old_untouched": all(collectives.all_gather_objects([same(old, step_4)])),
                       "shape": sorted(acting) == sorted(old)}
        result["before"] = before
    if rank == 0:
        torch.save(result, out)
    end_worker()


if __name__ == "__main__":  # torchrun tests/test_reused_forward.py worker OUT MODEL MAX_TOKENS
    globals()[sys.argv[1]](*sys.argv[2:])
