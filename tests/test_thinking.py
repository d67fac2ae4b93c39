"""The thinking toy (tasks/thinking.py): its worked sums score as the verifier reads them, its build is deterministic,
and spo.py takes the shipped folder as a thinking toy (checked, never rebuilt as the plain toy, no exact metric).

    .venv/bin/python -m pytest tests/test_thinking.py -q
"""
import json
import os
import re

import numpy as np
import pytest

from common import ok, one_thread, python, torchrun
from reward import boxed_reward
from tasks import thinking, toy

SHIPPED = os.path.join(toy.BUILT, "toy_think")
SUMS = [(347, 586), (999, 999), (100, 100), (505, 495), (123, 876)]  # carries, a fourth digit, none, a chain


def text(pieces):
    assert all(trained for _, trained in pieces)
    return "".join(piece for piece, _ in pieces)


@pytest.mark.parametrize("a,b", SUMS)
def test_a_correct_worked_sum_scores_1_and_a_wrong_box_0(a, b):
    right = text(thinking.thinking_response(a, b))
    assert right.count("\n") == 3 and boxed_reward(right, str(a + b)) == 1
    wrong = right.replace(f"\\boxed{{{a + b}}}", f"\\boxed{{{a + b + 1}}}")
    assert wrong != right and boxed_reward(wrong, str(a + b)) == 0


def test_a_noisy_worked_sum_boxes_what_its_lines_say():
    """Noise lands in the partial sums; the carries and the box follow the lines as written, right or wrong."""
    rng, wrong = np.random.default_rng(0), 0
    for _ in range(200):
        a, b = (int(n) for n in rng.integers(100, 1000, size=2))
        response = text(thinking.thinking_response(a, b, rng, noise=0.5))
        lines, carry = re.findall(r"(\d)\+(\d)\+(\d)=(\d+)\n", response), 0
        for (x, y, c, s), digit_a, digit_b in zip(lines, str(a)[::-1], str(b)[::-1]):
            assert (x, y, int(c)) == (digit_a, digit_b, carry)
            carry = int(s) // 10
        box = sum(int(s) % 10 * 10 ** k for k, (*_, s) in enumerate(lines)) + carry * 1000
        assert len(lines) == 3 and response.endswith(f"\\boxed{{{box}}}")
        wrong += box != a + b
    assert 0 < wrong < 200


def test_shuffled_terms_change_the_order_never_the_sums_or_the_reward():
    """--shuffle: each line's three terms in a random order (a choice the reward never sees); score_order=False
    leaves exactly those choices out of the loss."""
    rng, orders = np.random.default_rng(0), set()
    for a, b in SUMS * 20:
        pieces = thinking.thinking_response(a, b, order=rng, score_order=False)
        response = "".join(piece for piece, _ in pieces)
        assert boxed_reward(response, str(a + b)) == 1
        assert [trained for _, trained in pieces] == [False, True] * 3 + [True]
        lines = re.findall(r"(\d)\+(\d)\+(\d)=(\d+)\n", response)
        plain = re.findall(r"(\d)\+(\d)\+(\d)=(\d+)\n", text(thinking.thinking_response(a, b)))
        assert [(sorted(t[:3]), t[3]) for t in lines] == [(sorted(t[:3]), t[3]) for t in plain]
        orders.add(lines[0][:3])
    assert len(orders) > len(SUMS)  # the orders vary


def test_the_build_is_deterministic_in_its_data_and_model(tmp_path):
    with one_thread():
        infos = [thinking.build_thinking_toy(str(tmp_path / d), n_train=100, n_test=20, steps=3) for d in "ab"]
    for name in ("train.parquet", "test.parquet", "model/model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert infos[0] == {**infos[1], "warm_start_seconds": infos[0]["warm_start_seconds"]}
    assert infos[0]["recipe"] == thinking.RECIPE and thinking.is_thinking(str(tmp_path / "a"))


def test_a_zero_on_the_build_command_line_is_a_value_not_the_default(tmp_path):
    info = json.loads(ok(python("-m", "tasks.thinking", "--toy_dir", str(tmp_path / "t"), "--steps", "1",
                                "--noise", "0")).stdout)
    assert (info["steps"], info["noise"]) == (1, 0.0)


def test_a_built_thinking_toy_is_checked_not_rebuilt_as_the_plain_toy(tmp_path, monkeypatch):
    """Even when the plain toy's recipe moves on (its version bumped), a thinking toy is its own recipe's."""
    with one_thread():
        thinking.build_thinking_toy(str(tmp_path / "t"), n_train=100, n_test=20, steps=3)
    before = (tmp_path / "t" / "toy.json").read_text()
    monkeypatch.setattr(toy, "TOY_VERSION", toy.TOY_VERSION + 1)
    monkeypatch.setattr(toy, "build_toy", lambda *a, **k: pytest.fail("rebuilt as the plain toy"))
    assert toy.ensure_toy(str(tmp_path / "t"))[0] == str(tmp_path / "t" / "model")
    assert (tmp_path / "t" / "toy.json").read_text() == before


def test_a_budget_too_short_for_a_worked_sum_is_one_line(capsys):
    longest = max(len(text(thinking.thinking_response(a, b))) + 1 for a in range(100, 1000, 7) for b in (999, 905))
    assert longest == thinking.LONGEST_TRACE  # (one token a character, and the end of turn)
    thinking.check_budget(SHIPPED, thinking.LONGEST_TRACE)  # fits
    thinking.check_budget(str(toy.BUILT) + "/toy", 8)  # the plain toy: not this check's
    with pytest.raises(SystemExit) as stop:
        thinking.check_budget(SHIPPED, 32)
    assert stop.value.code == 2 and "--max_response_len 32" in capsys.readouterr().err


def test_the_shipped_thinking_toy_is_the_bytes_its_checksums_name():
    assert thinking.is_thinking(SHIPPED) and toy.checksum_error(SHIPPED) is None
    info = json.load(open(os.path.join(SHIPPED, "toy.json")))
    assert info["version"] == thinking.THINK_VERSION and 25 <= info["response_tokens_mean"] <= 60


@pytest.mark.slow
def test_spo_trains_on_the_thinking_toy_without_the_plain_toys_exact_metric(tmp_path):
    run = tmp_path / "run"
    ok(torchrun(2, "spo.py", "--toy_dir", SHIPPED, "--run_dir", str(run), "--steps", "2", "--batch_size", "16",
                "--train_prompts", "32", "--eval_every", "2", "--eval_max_prompts", "16", "--eval_samples", "2",
                "--offline_values", "none", "--max_response_len", "64"))
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert rows and "eval/accuracy" in rows[-1] and not any("eval/exact" in r for r in rows)
    assert all(r["response/truncated"] < 0.5 for r in rows if "response/truncated" in r)  # the budget fits a trace


# ---------------------------------------------------------------------------------------------- the mixed toy
MIXED = os.path.join(toy.BUILT, "toy_mixed")


@pytest.mark.parametrize("a,b", [(7, 48512), (99999, 1), (5, 5), (1234, 98765)])
def test_a_mixed_sum_works_every_column_of_the_longer_operand(a, b):
    """Unequal lengths: the shorter operand's missing digits are written 0, one line per column, and the box is
    the sum."""
    right = text(thinking.thinking_response(a, b))
    assert right.count("\n") == max(len(str(a)), len(str(b))) and boxed_reward(right, str(a + b)) == 1


def test_mixed_problems_are_disjoint_and_stratified_by_columns():
    train, test = thinking.make_mixed_problems(0, 1000, 200)
    assert not set(train) & set(test) and len(set(train)) == 1000 and len(set(test)) == 200
    for problems, n in ((train, 1000), (test, 200)):
        widths = [thinking.columns(a, b) for a, b in problems]
        assert {w: widths.count(w) for w in set(widths)} == {w: round(n * s) for w, s in
                                                             thinking.MIXED_SHARES.items()}
    assert thinking.make_mixed_problems(0, 1000, 200) == (train, test) != thinking.make_mixed_problems(1, 1000, 200)


def test_the_shipped_mixed_toy_holds_its_strata_and_the_warm_start_never_saw_five_columns():
    """Its files are the bytes SHA256SUMS names; both sets have each stratum's share; the profile its build measured
    starts the short sums mastered and the unseen five-column sums unsolved."""
    import pyarrow.parquet as pq
    assert thinking.is_thinking(MIXED) and toy.checksum_error(MIXED) is None
    info = json.load(open(os.path.join(MIXED, "toy.json")))
    for split in ("train", "test"):
        rows = pq.read_table(os.path.join(MIXED, f"{split}.parquet")).to_pylist()
        widths = [max(map(len, r["prompt"][0]["content"][:-1].split("+"))) for r in rows]
        assert [r["data_source"] for r in rows] == [f"toy_add_{w}col" for w in widths]  # the evaluation's strata
        assert {w: widths.count(w) for w in set(widths)} == {int(w): round(info[f"n_{split}"] * s)
                                                             for w, s in info["shares"].items()}
    strata = info["train_profile"]["strata"]
    assert strata["5"]["mean"] <= 0.1 and strata["2"]["mastered"] > strata["4"]["mastered"]
    thinking.check_budget(MIXED, thinking.longest_trace(5))  # fits
    with pytest.raises(SystemExit):
        thinking.check_budget(MIXED, thinking.LONGEST_TRACE)  # the three-digit toy's budget does not


def test_difficulty_profile_counts_the_ends_and_the_between_share():
    problems = [(1, 2), (3, 4), (10, 20), (12345, 1)]
    profile = thinking.difficulty_profile([1.0, 0.9, 0.5, 0.0], problems, samples=2)
    assert profile["mastered"] == 0.5 and profile["unsolved"] == 0.25 and profile["strata"][1]["n"] == 2
    m, var = 0.6, ((0.4 ** 2 + 0.3 ** 2 + 0.1 ** 2 + 0.6 ** 2) / 4)
    assert abs(profile["between_share"] - var / (m * (1 - m))) < 1e-12
    assert abs(profile["all_agree"] - (1 + 0.82 + 0.5 + 1) / 4) < 1e-12


@pytest.mark.slow
def test_held_out_accuracy_is_also_logged_per_data_source_on_the_mixed_toy(tmp_path):
    """The mixed test set's data_source is its stratum: each evaluation logs every stratum's accuracy, and they
    weigh back to the overall one."""
    run = tmp_path / "run"
    ok(torchrun(2, "spo.py", "--preset", "mixed", "--run_dir", str(run), "--steps", "1", "--batch_size", "16",
                "--train_prompts", "32", "--eval_every", "1", "--eval_max_prompts", "100", "--eval_samples", "2",
                "--offline_values", "none", "--ppo_steps", "1"))
    row = [json.loads(line) for line in open(run / "metrics.jsonl")][-1]
    strata = {k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith("eval/accuracy/")}
    import pyarrow.parquet as pq
    sources = pq.read_table(os.path.join(MIXED, "test.parquet")).column("data_source").to_pylist()[:100]
    assert set(strata) == set(sources) and strata["toy_add_5col"] <= 0.1
    assert abs(sum(strata[s] for s in sources) / len(sources) - row["eval/accuracy"]) < 1e-9
