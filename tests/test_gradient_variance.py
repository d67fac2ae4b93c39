"""experiments/gradient_variance.py: the covariance trace of a stack of gradients, the bad-input lines, and real
measurements on the shipped sharp toy (tasks/built/toy_sharp: its model, engine and verifier, nothing mocked).

    .venv/bin/python -m pytest tests/test_gradient_variance.py -q
"""
import json
import math
import os

import numpy as np
import pytest
import torch

from common import one_thread
from experiments.gradient_variance import covariance_trace, main

TOY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tasks", "built", "toy_sharp")
SMALL = ["--model", f"{TOY}/model", "--train", f"{TOY}/train.parquet", "--batch_size", "8", "--batches", "3"]


# ------------------------------------------------------------------------------------------------ the pure part
def test_identical_gradients_have_no_variance_even_far_from_zero():
    g = np.random.default_rng(0).normal(size=1000) * 1e6 + 3e7  # large and offset: no cancellation to hide in
    assert covariance_trace(np.tile(g, (5, 1))) == pytest.approx(0.0, abs=1e-12 * float(g @ g))
    assert covariance_trace(torch.zeros(4, 7)) == 0.0


def test_two_gradients_plus_minus_d_give_twice_the_squared_norm():
    """g = m +- d: the mean is m, each deviation d, so the trace is 2 ||d||^2 / (K - 1) = 2 ||d||^2 whatever m."""
    rng = np.random.default_rng(1)
    m, d = rng.normal(size=50), rng.normal(size=50)
    assert covariance_trace(np.stack([m + d, m - d])) == pytest.approx(2 * float(d @ d), rel=1e-12)
    assert covariance_trace(torch.tensor(np.stack([m + d, m - d]), dtype=torch.float32)) == pytest.approx(
        2 * float(d @ d), rel=1e-5)  # fp32 input, float64 arithmetic


def test_the_trace_is_the_sum_of_the_per_coordinate_unbiased_variances():
    g = np.random.default_rng(2).normal(size=(6, 40))
    assert covariance_trace(g) == pytest.approx(np.trace(np.cov(g, rowvar=False)), rel=1e-12)
    assert covariance_trace(g + 5.0) == pytest.approx(covariance_trace(g), rel=1e-10)  # a shift changes nothing


@pytest.mark.parametrize("shape", [(1, 10), (10,), (2, 3, 4)])
def test_fewer_than_two_gradients_or_another_shape_is_an_error(shape):
    with pytest.raises(ValueError, match="K >= 2"):
        covariance_trace(np.zeros(shape))


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("argv, message", [
    (["--model", "/no/such/dir", "--algo", "grpo", "--train", f"{TOY}/train.parquet"], "not a Hugging Face model"),
    (["--model", f"{TOY}/model", "--algo", "spo", "--train", f"{TOY}/train.parquet"], "needs exactly one value"),
    (["--model", f"{TOY}/model", "--algo", "grpo", "--train", f"{TOY}/train.parquet", "--batch_size", "12"],
     "multiple of --group_size 8"),
    (["--model", f"{TOY}/model", "--algo", "grpo", "--train", f"{TOY}/train.parquet", "--batches", "1"],
     "--batches >= 2"),
    (["--model", f"{TOY}/model", "--algo", "spo", "--train", f"{TOY}/train.parquet", "--state", "/no/state.pt"],
     "--state /no/state.pt: no such file"),
])
def test_bad_input_is_one_error_line_before_any_model_loads(argv, message, monkeypatch):
    import transformers

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert str(exit_.value).startswith("error: ") and message in str(exit_.value)
    assert "\n" not in str(exit_.value)


# ------------------------------------------------------------------------------------------------ real runs
def measured(*argv):
    with one_thread():
        return main([*SMALL, *argv])


def check_finite(result):
    for key in ("cov_trace", "mean_grad_sq", "ratio", "adv_var_raw", "zero_adv_share", "mean_reward"):
        assert math.isfinite(result[key]) and result[key] >= 0, (key, result[key])
    assert result["cov_trace"] > 0 and result["parameters"] > 0


def test_grpo_on_the_toy_zero_advantages_are_exactly_the_all_agree_groups(tmp_path, capsys):
    result = measured("--algo", "grpo", "--group_size", "4", "--json", str(tmp_path / "grpo.json"))
    check_finite(result)
    groups = np.array(result["rewards"]).reshape(3, 2, 4)  # (K, B/G, G)
    agree = (groups == groups[..., :1]).all(-1)  # (K, B/G)
    assert result["zero_adv_share"] == pytest.approx(agree.mean())
    assert result["zero_raw_share"] == pytest.approx(agree.mean())  # r - group mean is 0 there too
    assert json.loads((tmp_path / "grpo.json").read_text())["cov_trace"] == result["cov_trace"]
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| grpo | 8 | 4 | 3 | 0.5 |")
    # the same seeds give the same samples, and micro-batches of 3 the same gradient (the token mean is global)
    again = measured("--algo", "grpo", "--group_size", "4", "--micro_batch_size", "3")
    assert again["rewards"] == result["rewards"]
    assert again["cov_trace"] == pytest.approx(result["cov_trace"], rel=1e-4)
    assert again["mean_grad_sq"] == pytest.approx(result["mean_grad_sq"], rel=1e-4)


def test_spo_on_the_toy_with_a_constant_value_of_one_half(tmp_path):
    """Offline values [0, 1] for every prompt: v0 = (1 + 0.5) / (2 + 1) = 0.5 (KT), so r - v = r - 0.5 is never 0,
    its variance is the rewards' own in each batch, and Eq. 9 zeroes a batch's advantages only when all its
    rewards agree."""
    from machinery.data import load_dataset, load_tokenizer
    data = load_dataset(f"{TOY}/train.parquet", load_tokenizer(f"{TOY}/model"), 256, False)[:1024]
    values = tmp_path / "values.json"
    values.write_text(json.dumps({"header": {"temperature": 0.5, "top_p": 1.0, "max_tokens": 32},
                                  "prompts": {key: {"scores": [0.0, 1.0]} for key in data.keys}}))
    result = measured("--algo", "spo", "--offline_values", str(values))
    check_finite(result)
    rewards = np.array(result["rewards"])  # (K, B)
    assert result["G"] == 1 and result["adv_var_raw"] == pytest.approx(rewards.var(1).mean())
    assert result["zero_adv_share"] == pytest.approx((rewards == rewards[:, :1]).all(1).mean())
    assert result["zero_raw_share"] == 0.0


def test_the_summary_averages_each_model_and_algo_over_its_measurement_seeds_and_refuses_a_repeated_seed(tmp_path,
                                                                                                         capsys):
    base = {"model": "m", "algo": "spo", "ratio": 1.0, "adv_var_raw": 0.1, "zero_adv_share": 0.0, "mean_reward": 0.5}
    paths = []
    for i, (algo, seed, trace) in enumerate([("spo", 0, 1.0), ("spo", 1, 3.0), ("grpo", 0, 5.0)]):
        paths.append(str(tmp_path / f"{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump({**base, "algo": algo, "seed": seed, "cov_trace": trace}, f)
    main(["summary", *paths])
    rows = {line.split(" | ")[1]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["spo"].startswith("| m | spo | 2 | 2 [") and rows["grpo"].startswith("| m | grpo | 1 | 5 |")
    with open(paths[1], "w") as f:
        json.dump({**base, "seed": 0, "cov_trace": 3.0}, f)
    with pytest.raises(SystemExit, match="same --seed"):
        main(["summary", *paths])
