"""The family's flags (variants.py:check_flags and the ranges): a bad flag or combination is one clear line before
anything heavy starts, every float flag a number, a preset only the flags left unset; and the signal metrics.

    .venv/bin/python -m pytest tests/test_variant_flags.py -q
"""
import json
from dataclasses import replace

import numpy as np
import pytest

import spo
import variants
from common import python
from machinery.metrics import signal_metrics
from tasks import toy


# ---- signal metrics and bad combinations --------------------------------------------------------------------
def test_signal_metrics_by_hand():
    raw = np.array([0.0, 0.0, 1.0, -1.0])
    m = signal_metrics(raw, raw, np.array([1.0, 1.0, 1.0, 0.0]), group=2)
    assert m["signal/zero_advantage"] == 0.5 and m["zero_signal/degenerate_groups"] == 0.5
    assert m["signal/adv_var_raw"] == pytest.approx(0.5) and m["signal/adv_var_effective"] == pytest.approx(1.0)
    assert "zero_signal/degenerate_groups" not in signal_metrics(raw, raw, raw, group=1)


@pytest.mark.parametrize("argv, match", [
    (["--dynamic_sampling"], "needs a group estimator"),
    (["--algo", "rloo", "--group_size", "1"], "at least 2 for rloo"),
    (["--algo", "dr_grpo", "--baseline", "none"], "SPO option"),
    (["--baseline", "fixed", "--offline_values", "none"], "needs --offline_values"),
    (["--baseline", "fixed", "--train", "mine.parquet"], "needs --offline_values"),  # auto: values on the toy only
    (["--group_size", "3"], "multiple of world size x group size"),
    (["--ppo_steps", "5"], "must divide the per-rank batch"),
    (["--algo", "grpo", "--offline_values", "values.json"], "grpo has none (it would be ignored)"),
    (["--algo", "rloo", "--offline_values", "auto"], "rloo has none (it would be ignored)"),  # asked for by name
    (["--reward", "no_such_module_xyz:score"], "--reward no_such_module_xyz:score: cannot import"),
    (["--reward", "reward:no_such_function"], "--reward reward:no_such_function: reward has no function"),
    # out of range: each used to be a traceback, or a 0 that silently became the default
    (["--group_size", "0"], "--group_size must be at least 1, got 0"),
    (["--lr=-1e-3"], "--lr must be at least 0, got -0.001"),  # 0 runs (and the first update warns)
    (["--tis=-1"], "--tis must be at least 0, got -1.0"),
    (["--max_response_len", "-1"], "--max_response_len must be at least 1, got -1"),
    (["--max_response_len", "0"], "--max_response_len must be at least 1, got 0"),
    (["--batch_size", "0"], "--batch_size must be at least 1, got 0"),
    (["--micro_batch_size", "0"], "--micro_batch_size must be at least 1, got 0"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    # values the engine, the model or the math would refuse later (at the first evaluation, at step 4...)
    (["--eval_top_p", "1.5"], "--eval_top_p must be in (0, 1], got 1.5"),
    (["--eval_top_k", "-2"], "--eval_top_k must be -1 or 0 (off) or at least 1, got -2"),
    (["--temperature", "2.5"], "--temperature must be in [0, 2]"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--seed", "-1"], "--seed must be at least 0, got -1"),
    (["--clip_low", "1.2"], "--clip_low must be below 1"),
    (["--gpu_memory_utilization", "1.5"], "--gpu_memory_utilization must be at most 1"),
    (["--max_tool_output_chars", "0"], "--max_tool_output_chars must be at least 1, got 0"),
    (["--reward_timeout", "0"], "--reward_timeout must be a positive number of seconds, got 0.0"),
    (["--rho_min", "0.99"], "rho_min <= rho_max"),
    (["--rho_max", "1"], "rho_max < 1"),
    (["--algo", "grpo", "--adv_norm", "token"], "normalises within each group instead"),
    # (the tracker refuses it: it used to stop the run after start-up)
    (["--train_prompts", "-1"], "--train_prompts must be at least 0, got -1"),
])
def test_bad_flags_get_one_clear_line(argv, match, capsys):
    with pytest.raises(SystemExit):
        variants.check_flags(vars(spo.parse_args(argv)), world=2)
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_no_float_flag_takes_a_non_number(value, capsys):
    """argparse's float() takes nan and inf; every float flag of spo.py must refuse them before start-up (nan passes
    a range check written as `x < low`)."""
    floats = [name for name, default in vars(spo.parse_args([])).items() if isinstance(default, float)]
    assert len(floats) >= 15  # the check below must really cover the float flags
    for name in floats:
        with pytest.raises(SystemExit):
            variants.check_flags(vars(spo.parse_args([f"--{name}={value}"])), world=2)
        err = capsys.readouterr().err
        assert f"--{name} must be a finite number" in err and len(err.strip().splitlines()) == 1, (name, err)


def test_a_preset_fills_only_the_flags_left_unset():
    """--preset tracker_keeps_up: its values where the command line said nothing, the command line's where it did, and
    no probe for an estimator without a tracker (check_flags would refuse it)."""
    preset = toy.PRESETS["tracker_keeps_up"]
    args = spo.parse_args(["--preset", "tracker_keeps_up", "--lr", "3e-5"])
    assert args.lr == 3e-5 and args.steps == preset["steps"] and args.train_prompts == preset["train_prompts"]
    assert args.probe_every == preset["probe_every"]
    grpo = spo.parse_args(["--preset", "tracker_keeps_up", "--algo", "grpo"])
    assert grpo.probe_every == 0 and grpo.steps == preset["steps"]
    variants.check_flags(vars(grpo), world=2)  # no error line
    assert spo.parse_args([]).steps == 150 and spo.parse_args([]).train_prompts == 0


@pytest.mark.parametrize("argv", [["--algo", "grpo"], ["--algo", "grpo", "--offline_values", "none"],
                                  ["--algo", "reinforce_pp"], ["--reward", "reward:numeric_match"]])
def test_the_default_offline_values_pass_the_flag_check(argv):
    variants.check_flags(vars(spo.parse_args(argv)), world=2)


@pytest.mark.parametrize("algo", ["grpo", "rloo", "dr_grpo", "reinforce_pp"])
def test_the_default_offline_values_are_silently_unused_without_a_tracker(algo, tmp_path):
    """With --offline_values auto on the toy, the toy's cached values start SPO's tracker; an estimator without a
    tracker never reads them (its tracker stays at the uninformed prior) and never measures them (no engine here:
    estimating them would fail)."""
    from types import SimpleNamespace
    from offline_values import TrainingV0, toy_values_path
    data = SimpleNamespace(keys=[f"{k:016x}" for k in range(16)])

    def tracker_of(argv):
        args = spo.parse_args(argv + ["--toy_dir", str(tmp_path)])
        variants.check_flags(vars(args), world=2)
        v0_settings = TrainingV0.pick(vars(args))
        path = toy_values_path(args.toy_dir, args.n0, args.seed, v0_settings.settings())
        with open(path, "w") as f:
            json.dump({"header": {}, "prompts": {key: {"scores": [1] * 8} for key in data.keys}}, f)
        v0_settings = replace(v0_settings, offline_values=path)  # where spo.py's start claims it (claim_toy_values)
        return spo.tracker_at_start(args, data, v0_settings, None, None, on_toy=True, is_main=False)
    assert np.all(tracker_of([]).value > 0.9)  # SPO: v0 = (8 + 0.5) / (8 + 1) from the cached file
    tracker = tracker_of(["--algo", algo])
    assert np.all(tracker.value == 0.5) and np.all(tracker.n_eff == 1.0)


def test_spo_py_stops_on_a_bad_reward_before_the_engine_starts():
    proc = python("spo.py", "--reward", "reward:exact")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == ["error: --reward reward:exact: reward has no function exact"]


def _load_data(argv):
    """spo.py's data step (spo.start: the context check, then the datasets) on the shipped toy, in this process."""
    from machinery.data import check_context, load_tokenizer, load_train_and_test
    from tasks import toy
    shipped = f"{toy.BUILT}/toy"
    args = spo.parse_args(["--model", f"{shipped}/model", "--train", f"{shipped}/train.parquet", "--test",
                           f"{shipped}/test.parquet", *argv])
    check_context(args.model, args.max_prompt_len + args.max_response_len, "--max_prompt_len + --max_response_len")
    return load_train_and_test(load_tokenizer(args.model), args.train, args.test, max_prompt_len=args.max_prompt_len,
                               train_prompts=0, test_prompts=args.eval_max_prompts, min_prompts=args.batch_size,
                               system_prompt=None, verbose=True)


def test_spo_py_refuses_a_context_beyond_the_models_positions_before_the_engine_starts(capsys):
    """The toy has 512 positions: 256 prompt + 400 response tokens would be refused by vLLM with a traceback."""
    with pytest.raises(SystemExit):
        _load_data(["--max_response_len", "400"])
    err = capsys.readouterr().err
    assert err.startswith("error: --max_prompt_len + --max_response_len = 656 tokens, more than --model ")
    assert "512 positions" in err and len(err.strip().splitlines()) == 1, err


def test_spo_py_says_when_held_out_prompts_are_training_prompts(capsys):
    """--test equal to --train used to pass silently."""
    from tasks import toy
    train = f"{toy.BUILT}/toy/train.parquet"
    _load_data(["--test", train, "--eval_max_prompts", "100"])
    assert "warning: 100 of the 100 held-out prompts (--test) are also training prompts (--train)" in \
        capsys.readouterr().out
    _load_data(["--eval_max_prompts", "100"])  # the toy's own split: no warning
    assert "warning" not in capsys.readouterr().out


def test_spo_py_stops_on_a_bad_combination_before_the_engine_starts():
    proc = python("spo.py", "--algo", "rloo", "--group_size", "4", "--baseline", "none")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == ["error: --baseline none is an SPO option; rloo has its own baseline"]
