"""The KL penalty's reference policy and the learning-rate schedule end to end on two ranks: no reference built
without the penalty, and a run with both resumed exactly (the reference is the initial policy, not the checkpoint's).

    .venv/bin/python -m pytest tests/test_reference_policy.py -q
"""
import json
import os
import sys

import numpy as np
import pytest

from common import ok, toy_args, torchrun
from test_end_to_end import _assert_same_checkpoint, _metrics


def count_models(*argv):
    """spo.py, and then the number of FSDP2 models trainer.build_policy built on this rank (the policy, and with
    --kl_coef the reference) in <run_dir>/models.<rank>."""
    import spo
    from machinery import trainer
    build, built = trainer.build_policy, []
    trainer.build_policy = lambda *a, **k: built.append(1) or build(*a, **k)
    spo.main(list(argv))
    with open(os.path.join(argv[argv.index("--run_dir") + 1], f"models.{os.environ['RANK']}"), "w") as f:
        f.write(str(len(built)))


@pytest.mark.slow
def test_no_reference_policy_without_a_kl_penalty(small_toy, tmp_path):
    """--kl_coef 0 (the default): one model built, the policy, and no policy/kl_ref computed."""
    ok(torchrun(1, "tests/test_reference_policy.py", "count_models",
                *toy_args(small_toy, tmp_path, "--steps", "1", "--eval_every", "0")[1:]))
    assert (tmp_path / "models.0").read_text() == "1"
    assert not any("policy/kl_ref" in r for r in _metrics(tmp_path))


@pytest.mark.slow
def test_the_learning_rate_schedule_and_the_kl_penalty_resume_exactly(small_toy, tmp_path):
    """--warmup_steps 2 --lr_schedule cosine --kl_coef 0.05: the rates by hand (lr / 2, lr, then the cosine's first
    two of two steps, lr and lr / 2); a reference built beside the policy, as far from it as k3 says (0 before the
    first update, never negative, above 1e-4 by the last step); and 4 steps straight == 2, stop, --resume, 2 more
    (the schedule is the step's, the reference the initial policy, not the checkpoint's)."""
    schedule = ("--warmup_steps", "2", "--lr_schedule", "cosine", "--save_every", "2", "--kl_coef", "0.05")
    ok(torchrun(2, "tests/test_reference_policy.py", "count_models",
                *toy_args(small_toy, tmp_path / "straight", "--steps", "4", *schedule)[1:]))
    ok(torchrun(2, *toy_args(small_toy, tmp_path / "resumed", "--steps", "2", *schedule)))
    ok(torchrun(2, *toy_args(small_toy, tmp_path / "resumed", "--steps", "4", "--resume", str(tmp_path / "resumed"))))
    assert [(tmp_path / "straight" / f"models.{rank}").read_text() for rank in (0, 1)] == ["2", "2"]
    lr = json.loads((tmp_path / "straight" / "config.json").read_text())["lr"]
    for run in ("straight", "resumed"):
        rows = [r for r in _metrics(tmp_path / run) if "policy/lr" in r]
        np.testing.assert_allclose([r["policy/lr"] for r in rows], [lr / 2, lr, lr, lr / 2], rtol=1e-12)
        kl = [r["policy/kl_ref"] for r in rows]
        assert abs(kl[0]) < 1e-6 and min(kl) >= 0 and kl[-1] > 1e-4, kl  # (k3 is never negative)
    _assert_same_checkpoint(tmp_path / "straight", tmp_path / "resumed", tmp_path)


if __name__ == "__main__":  # torchrun tests/test_reference_policy.py WORKER [spo.py ARGS...]
    globals()[sys.argv[1]](*sys.argv[2:])
