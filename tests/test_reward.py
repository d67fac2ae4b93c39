"""Your own verifier (`--reward module:function`, reward.py): how a spec is resolved and refused, what a verifier
sees and may return, and the example second verifier `numeric_match`. The default rule's own tests (the paper's
strict boxed answer) stay in test_spo.py beside the algorithm.

    .venv/bin/python -m pytest tests/test_reward.py -q
"""
import numpy as np
import pytest

from reward import exact_match, reward_and_answer


def test_numeric_match_compares_numbers_by_value_still_from_the_final_box():
    from reward import numeric_match
    assert numeric_match(r"so \boxed{3.0}", "3") == 1.0 and exact_match(r"so \boxed{3.0}", "3") == 0.0
    assert numeric_match(r"\boxed{0.5}", "1/2") == 1.0 and numeric_match(r"\boxed{1e3}", "1000") == 1.0
    assert numeric_match(r"\boxed{-6/2}", "-3.00") == 1.0
    assert numeric_match(r"\boxed{3.1}", "3") == 0.0 and numeric_match(r"\boxed{0.1}", "1/3") == 0.0
    assert numeric_match("the answer is 3.0", "3") == 0.0                     # no box, no answer
    assert numeric_match(r"\boxed{x+1}", "x+1") == 1.0 and numeric_match(r"\boxed{1,000}", "1000") == 0.0


def test_numeric_match_does_not_build_huge_numbers():
    """`1e999999999` parsed as a Fraction would build a billion-digit integer: such answers fall back to the
    string comparison, instantly."""
    from reward import numeric_match
    assert numeric_match(r"\boxed{1e999999999}", "1e999999999") == 1.0
    assert numeric_match(r"\boxed{1e999999999}", "1") == 0.0 and numeric_match(r"\boxed{1/0}", "1") == 0.0


def test_a_verifier_from_a_file_reads_the_text_without_tool_blocks_after_the_think_gate(tmp_path):
    from reward import load_verifier
    seen = tmp_path / "seen.txt"
    path = tmp_path / "my_verifier.py"
    path.write_text(f"def says_yes(text, truth):\n    open({str(seen)!r}, 'a').write(text + '|')\n"
                    f"    return 'yes' in text\n")
    spec = f"{path}:says_yes"
    assert load_verifier(spec)("yes", "x") is True
    seen.write_text("")
    text = "<code>\n```python\nprint('yes')\n```\n</code><interpreter>\nyes\n</interpreter>\n\\boxed{no}"
    assert reward_and_answer(text, "x", reward=spec) == (0.0, "no")            # the tool's "yes" is not read
    assert seen.read_text() == "\n\\boxed{no}|"
    assert reward_and_answer("yes</think> x", "x", think_format=True, reward=spec) == (1.0, None)
    assert reward_and_answer("yes", "x", think_format=True, reward=spec) == (0.0, None)  # gate: not called
    assert seen.read_text().count("|") == 2


@pytest.mark.parametrize("spec, message", [
    ("reward", "expected module:function"),
    ("no_such_module_xyz:f", "cannot import no_such_module_xyz (ModuleNotFoundError"),
    ("reward:no_such_function", "reward has no function no_such_function"),
    ("reward:TAIL_CHARS", "reward has no function TAIL_CHARS"),                 # not callable
    ("/no/such/file.py:f", "cannot import /no/such/file.py"),
])
def test_a_bad_reward_spec_is_one_line_naming_the_flag(spec, message, capsys):
    from reward import check_reward_flag
    with pytest.raises(SystemExit) as stop:
        check_reward_flag(spec)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"error: --reward {spec}: ") and message in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("value", [0.5, 2, -1, float("nan"), None, "1", [1]])
def test_a_verifier_must_return_0_or_1(value, capsys, monkeypatch):
    """SPO's tracker is a Beta posterior over binary rewards: anything else stops with one line naming --reward."""
    import reward
    monkeypatch.setattr(reward, "load_verifier", lambda spec: lambda text, truth: value)
    with pytest.raises(SystemExit):
        reward.reward_and_answer(r"\boxed{1}", "1", reward="mine:f")
    err = capsys.readouterr().err
    assert err.startswith(f"error: --reward mine:f returned {value!r}") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("value", [True, False, 1, 0, 1.0, np.float32(1), np.bool_(False)])
def test_a_verifier_may_return_a_bool_an_int_or_a_float(value, monkeypatch):
    import reward
    monkeypatch.setattr(reward, "load_verifier", lambda spec: lambda text, truth: value)
    assert reward.reward_and_answer(r"\boxed{1}", "1", reward="mine:f") == (float(value), "1")
