"""The engine/trainer mismatch and silent no-learning: truncated importance sampling (--tis: trainer.tis_weights and
the loss's weights), the mismatch metrics, and the warning after a first update that did not move the policy
(trainer.learning_warning). The runs with --bf16 on (where the mismatch is real) and --lr 0 are slow.

    .venv/bin/python -m pytest tests/test_mismatch.py -q
"""
import json
import subprocess

import numpy as np
import pytest
import torch

import spo
import variants
from common import ENV, PYTHON, ROOT, ok, toy_args, torchrun
from machinery.trainer import tis_weights


def test_tis_weights_are_the_ratio_capped_and_one_off_the_policy_tokens():
    old, engine = np.log([0.5, 0.9, 0.2, 0.7]), np.log([0.25, 0.9, 0.4, 1e-3])
    w = tis_weights(old, engine, [1, 1, 1, 0], cap=1.5)
    np.testing.assert_allclose(w, [1.5, 1.0, 0.5, 1.0])  # 2 capped at 1.5; 0.5 kept; tool token: 1


def test_the_mismatch_metrics_count_policy_tokens_outside_the_band():
    from machinery.trainer import vllm_gap
    from rollout import Rollout
    rollouts = [Rollout([1], [5, 6, 7], list(np.log([0.5, 0.5, 0.5])), "", "stop", response_mask=[1, 1, 0]),
                Rollout([1], [5, 6], list(np.log([0.5, 0.5])), "", "stop", response_mask=[1, 1])]
    trainer = [np.log([0.5, 0.6, 0.99]), np.log([0.47, 0.5])]  # ratios 1, 1.2, (a tool token), 0.94, 1
    gap = vllm_gap(trainer, rollouts)
    assert (gap["ratio_outside"], gap["tokens"]) == (1, 4) and gap["ratio_max"] == pytest.approx(1.2)
    assert gap["logprob_gap_max"] == pytest.approx(np.log(1.2))


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo"])
def test_the_weights_scale_each_tokens_loss(loss):
    """Weights 1 give the paper's loss exactly; any weights give the per-token loss times them, for every loss."""
    g = torch.Generator().manual_seed(0)
    logp, old = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), (torch.rand(3, 5, generator=g) > 0.3).float()
    weights = torch.rand(3, 5, generator=g) * 2
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=10.0)
    if loss == "ppo_clip":
        fn = lambda **w: spo.ppo_clip_loss(logp, old, adv, mask, n_tokens=7.0, **kw, **w)[0]  # noqa: E731
        token = spo.ppo_clip_token_loss(logp, old, adv, mask, **kw)[0]
    else:
        fn = lambda **w: variants.make_loss(loss, "token_mean", spo.ppo_clip_token_loss, n_sequences=3,  # noqa: E731
                                            max_len=5, **kw)(logp, old, adv, mask, 7.0, **w)[0]
        token = {"gspo": variants.gspo_token_loss, "cispo": variants.cispo_token_loss}[loss](
            logp, old, adv, mask, clip_low=0.2, clip_high=0.28)[0]
    assert torch.equal(fn(), fn(weights=torch.ones(3, 5)))
    torch.testing.assert_close(fn(weights=weights), (token * mask * weights).sum() / 7.0)


LEARNING = """
import torch.distributed as dist, numpy as np
from machinery.trainer import learning_warning
dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)
old = [np.array([-1.0, -2.0, -3.0]), np.array([-1.0, -1.0])]
masks = [[1, 1, 0], [1, 1]]
for changed, new, adv in [(True, [old[0] + 0.1, old[1] - 0.1], [1.0, -1.0]),   # as the advantages say
                          (False, old, [1.0, -1.0]),                              # --lr 0
                          (True, [old[0] - 0.1, old[1] + 0.1], [1.0, -1.0]),      # the wrong way
                          (True, [old[0] + 0.1, old[1] - 0.1], [0.0, 0.0]),       # all advantages zero
                          (True, [old[0] - 0.01, old[1] - 0.2], [1.0, -1.0])]:    # both fall, the negatives more
    print(learning_warning(changed, old, new, adv, masks))
dist.destroy_process_group()  # a gloo group left at exit can abort the interpreter
"""


def test_the_learning_warning_speaks_only_when_the_update_did_not_follow_the_advantages():
    proc = subprocess.run([PYTHON, "-c", LEARNING], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 5, proc.stderr[-2000:]
    assert lines[0] == lines[4] == "None"
    assert all(line.startswith("the first update did not move") for line in lines[1:4])
    assert "parameters unchanged" in lines[1] and "parameters changed" in lines[2] and "over 0" in lines[3]
    assert "zero learning rate (--lr)" in lines[1]


@pytest.mark.slow
def test_a_zero_learning_rate_is_said_once(small_toy, tmp_path):
    proc = ok(torchrun(2, *toy_args(small_toy, tmp_path, "--steps", "2", "--lr", "0", "--eval_every", "0")))
    assert proc.stderr.count("warning: the first update did not move the policy") == 1, proc.stderr[-3000:]
    assert "parameters unchanged" in proc.stderr and "zero learning rate" in proc.stderr


@pytest.mark.slow
def test_the_default_run_says_nothing(tmp_path):
    """The shipped toy and the default flags (the uninformed prior instead of building offline values: any reward
    that differs from its batch's gives a non-zero advantage; 64 responses at the toy's 13% all fail 1 time in
    7,000)."""
    proc = ok(torchrun(2, "spo.py", "--steps", "1", "--eval_every", "0", "--save_every", "0", "--offline_values",
                       "none", "--run_dir", str(tmp_path / "run")))
    assert "did not move the policy" not in proc.stderr + proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_tis_under_bf16_truncates_and_the_mismatch_is_measured(small_toy, tmp_path):
    """--bf16 on: engine and trainer compute in bf16 with different kernels, so their token ratios spread around 1
    (on this toy within about 3%: none outside [0.9, 1.1]); --tis 1 caps every ratio above 1 (about half)."""
    from machinery.device import native_bf16
    if not native_bf16():
        pytest.skip("--bf16 on needs bf16 instructions on a CPU (the flag is refused without them)")
    ok(torchrun(2, *toy_args(small_toy, tmp_path, "--steps", "2", "--bf16", "on", "--tis", "1", "--eval_every", "0")))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert json.loads((tmp_path / "config.json").read_text())["tis"] == 1.0
    for r in rows:
        assert 0 <= r["policy/ratio_outside"] < 0.5 and r["policy/ratio_max"] > 1.0, r
        assert 0.05 < r["policy/tis_truncated"] < 0.95, r
