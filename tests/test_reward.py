"""The verifier (reward.py): the default rule (the authors' strict boxed answer: the last box within the tail
window, compared as a string; the think gate; tool output is not the model's answer), then your own verifier
(`--reward module:function`): how a spec is resolved and refused, what a verifier sees and may return, the
example second verifier `numeric_match`, and `math_verify` (the optional math-verify package).

    .venv/bin/python -m pytest tests/test_reward.py -q
"""
import os
import subprocess
import sys

import pytest

from tests.common import ROOT

from reward import boxed_reward, exact_match, extract_boxed, reward_and_answer


# ---- the default rule: the authors' strict boxed answer ------------------------------------------------
def test_extract_boxed_nested_braces():
    assert extract_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"


def test_extract_boxed_last_box_wins():
    assert extract_boxed(r"\boxed{1} then \boxed{2} and finally \boxed{3}") == "3"
    assert boxed_reward(r"\boxed{1} then \boxed{2}", "1") == 0.0
    assert boxed_reward(r"\boxed{1} then \boxed{2}", "2") == 1.0


def test_box_beyond_tail_window_scores_zero():
    text = r"The answer is \boxed{42}." + " more words" * 20        # box starts > 100 chars from the end
    assert boxed_reward(text, "42") == 0.0
    assert exact_match(text, "42", tail_chars=1000) == 1.0
    assert extract_boxed(text) == "42"                              # no window: found


def test_box_must_start_inside_window():
    text = r"\boxed{42}"
    assert extract_boxed(text, tail_chars=len(text)) == "42"
    assert extract_boxed(text, tail_chars=len(text) - 1) is None    # the opener is cut


def test_no_box_and_unclosed_box():
    assert extract_boxed("the answer is 42") is None
    assert boxed_reward("the answer is 42", "42") == 0.0
    assert extract_boxed(r"\boxed{4") is None
    # the last opener decides: an unclosed final box does not fall back to an earlier complete one
    assert extract_boxed(r"\boxed{4} and \boxed{5") is None
    assert reward_and_answer(r"\boxed{4} and \boxed{5", "4") == (0.0, None)


def test_space_after_boxed_is_not_a_box():
    assert extract_boxed(r"\boxed {42}") is None


def test_whitespace_stripped_but_no_other_normalisation():
    assert boxed_reward(r"\boxed{  42 }", " 42\n") == 1.0
    assert boxed_reward(r"\boxed{0.5}", "1/2") == 0.0
    assert boxed_reward(r"\boxed{42.0}", "42") == 0.0


def test_empty_box_is_no_answer():
    assert reward_and_answer(r"\boxed{ }", "x") == (0.0, None)


def test_unicode_answer_and_text():
    assert boxed_reward("résumé π≈ \\boxed{√2·π}", "√2·π") == 1.0
    assert boxed_reward("\\boxed{√2·π}", "√2 π") == 0.0


def test_reward_and_answer_returns_answer_even_when_wrong():
    assert reward_and_answer(r"\boxed{7}", "8") == (0.0, "7")
    assert reward_and_answer(r"\boxed{8}", 8) == (1.0, "8")


@pytest.mark.parametrize("text, expected", [
    ("think</think> \\boxed{5}", 1.0),
    ("no close \\boxed{5}", 0.0),                                    # no </think>
    ("a</think>b</think> \\boxed{5}", 0.0),                          # two </think>
    ("t</think> <code>print(5)</code> \\boxed{5}", 0.0),             # tool call after thinking
    ("t</think> <interpreter>5</interpreter> \\boxed{5}", 0.0),
    ("<code>x</code><interpreter>5</interpreter></think> \\boxed{5}", 1.0),  # tools inside thinking are fine
])
def test_think_format_gate(text, expected):
    assert boxed_reward(text, "5", think_format=True) == expected
    assert boxed_reward(text, "5") == 1.0                          # without the gate all are right


def test_think_format_failure_yields_no_answer():
    assert reward_and_answer("x \\boxed{5}", "5", think_format=True) == (0.0, None)


def test_interpreter_output_is_not_the_models_answer():
    """A snippet that prints a box must not answer for the model (a reward hack): code and tool output are not
    scored."""
    hack = "<code>\n```python\nprint('\\\\boxed{42}')\n```\n</code><interpreter>\n\\boxed{42}\n</interpreter>\n\n"
    assert reward_and_answer(hack, "42") == (0.0, None)
    assert reward_and_answer(hack + "so \\boxed{42}", "42") == (1.0, "42")  # copying it is the model's answer
    assert boxed_reward("\\boxed{42} <interpreter>\n\\boxed{7}", "42") == 1.0  # an unclosed block (budget cut)
    assert boxed_reward("\\boxed{42} <code>\nprint('\\\\boxed{7}')", "42") == 1.0


# ---- your own verifier (--reward module:function) -------------------------------------------------------
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


def returning(tmp_path, value):
    """A --reward spec whose verifier (a file, run in its child process like any of yours) returns value."""
    (tmp_path / "returns.py").write_text(f"import numpy as np\ndef f(text, truth):\n    return {value}\n")
    return f"{tmp_path / 'returns.py'}:f"


@pytest.mark.parametrize("value, shown", [("0.5", "0.5"), ("2", "2"), ("-1", "-1"), ("float('nan')", "nan"),
                                          ("None", "None"), ("'1'", "'1'"), ("[1]", "[1]")])
def test_a_verifier_must_return_0_or_1(value, shown, tmp_path, capsys):
    """SPO's tracker is a Beta posterior over binary rewards: anything else stops with one line naming --reward."""
    spec = returning(tmp_path, value)
    with pytest.raises(SystemExit):
        reward_and_answer(r"\boxed{1}", "1", reward=spec)
    err = capsys.readouterr().err
    assert err.startswith(f"error: --reward {spec} returned {shown} (a ") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("value, expected", [("True", 1.0), ("False", 0.0), ("1", 1.0), ("0", 0.0), ("1.0", 1.0),
                                             ("np.float32(1)", 1.0), ("np.bool_(False)", 0.0)])
def test_a_verifier_may_return_a_bool_an_int_or_a_float(value, expected, tmp_path):
    """numpy's too: its child sends 0 or 1 on as a float."""
    assert reward_and_answer(r"\boxed{1}", "1", reward=returning(tmp_path, value)) == (expected, "1")


# ---- a verifier that raises or never returns: one line naming it and the input ------------------------------
def test_a_verifier_that_raises_is_one_line_naming_it_and_the_input(tmp_path, capsys):
    """It used to be a traceback on every rank. The line names the function, the exception, the response and the
    ground truth; inputs it does not raise on still score."""
    from reward import reward_and_answer
    verifier = tmp_path / "picky.py"
    verifier.write_text("def score(text, truth):\n    if '7' in text:\n        raise KeyError('no sevens')\n"
                        "    return text.endswith('{' + truth + '}')\n")
    spec = f"{verifier}:score"
    assert reward_and_answer(r"so \boxed{3}", "3", reward=spec) == (1.0, "3")
    with pytest.raises(SystemExit) as stop:
        reward_and_answer(r"so \boxed{17}", "17", reward=spec)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: --reward {spec} raised KeyError: 'no sevens'") and r"\\boxed{17}" in err
    assert "ground truth '17'" in err


def test_a_verifier_that_never_returns_stops_the_process_with_one_line(tmp_path):
    """It used to hang the run at step 0 with no output. In a process of its own (the stuck call keeps running
    until the process exits, which it must do despite it): exit 2 and one line naming --reward_timeout."""
    verifier = tmp_path / "stuck.py"
    verifier.write_text("def score(text, truth):\n    while True:\n        pass\n")
    code = (f"import reward\nreward.rewards([type('R', (), {{'text': 'x \\\\boxed{{1}}', 'finish_reason': 'stop'}})()],"
            f" ['1'], reward={str(verifier) + ':score'!r}, timeout_s=2)\nprint('not reached')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "not reached" not in proc.stdout, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: --reward {verifier}:score did not return within --reward_timeout 2 s, on the response "
        f"'x \\\\boxed{{1}}' (its last 200 characters) with ground truth '1'; to score such inputs 0 instead, catch "
        f"the case in the verifier and return 0"]


def test_the_verifier_child_is_replaced_after_a_timeout(tmp_path, capsys):
    """A caller that survives the stop (a test, a notebook) gets a fresh child: the stuck one is never reused."""
    from reward import reward_and_answer
    verifier = tmp_path / "slow_once.py"
    verifier.write_text("import time\ndef score(text, truth):\n    if 'slow' in text:\n        time.sleep(30)\n"
                        "    return 1\n")
    spec = f"{verifier}:score"
    with pytest.raises(SystemExit):
        reward_and_answer(r"slow \boxed{1}", "1", reward=spec, timeout_s=0.5)
    assert "did not return within --reward_timeout 0.5 s" in capsys.readouterr().err
    assert reward_and_answer(r"fast \boxed{1}", "1", reward=spec) == (1.0, "1")  # the default limit: a loaded machine


# ---- reward:math_verify (the math-verify package, in a child process) ------------------------------------------
def math_reward(text, truth):
    """Through reward_and_answer, as training scores (call_verifier)."""
    return reward_and_answer(text, truth, reward="reward:math_verify")[0]


@pytest.mark.parametrize("answer, truth", [
    (r"\frac{1}{2}", "0.5"), ("2^{n-1}", "2^(n-1)"), (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}"), ("[1, 2)", "[1,2)"),
    (r"(0, \infty)", r"(0,\infty)"), ("1,000", "1000"), (r"\dfrac{3}{4}", "3/4"), ("2x+1", "1+2x"),
])
def test_math_verify_scores_equivalent_answers_1_both_ways(answer, truth):
    assert math_reward(rf"so \boxed{{{answer}}}", truth) == 1.0
    assert math_reward(rf"so \boxed{{{truth}}}", answer) == 1.0


@pytest.mark.parametrize("answer, truth", [
    ("3", "4"), ("(1,2]", "[1,2]"), ("(2,3)", "(3,2)"), ("2x+1", "2x-1"), ("0.33", r"\frac{1}{3}"),
    (r"\sqrt{2}", "1.41"), ("2^{n+1}", "2^(n-1)"),
])
def test_math_verify_scores_different_answers_0_both_ways(answer, truth):
    assert math_reward(rf"so \boxed{{{answer}}}", truth) == 0.0
    assert math_reward(rf"so \boxed{{{truth}}}", answer) == 0.0


def test_math_verify_reads_the_same_final_answer_as_exact_match():
    assert reward_and_answer("the answer is 0.5", "0.5", reward="reward:math_verify") == (0.0, None)  # no box
    assert math_reward(r"\boxed{\frac{1}{2}} and" + " more words" * 20, "0.5") == 0.0    # outside the tail
    assert math_reward(r"\boxed{0.5} no, finally \boxed{0.4}", "0.5") == 0.0              # the last box decides
    assert reward_and_answer(r"<code>print('\\boxed{1/2}')</code> \boxed{0.5}", "1/2",
                             reward="reward:math_verify") == (1.0, "0.5")


def test_math_verify_is_given_the_ground_truth_as_gold():
    """verify() is not symmetric: a set answers a relation in the gold, not the other way round."""
    assert math_reward(r"\boxed{(1,2)}", "1<x<2") == 1.0
    assert math_reward(r"\boxed{1<x<2}", "(1,2)") == 0.0


def test_exact_match_and_math_verify_disagree_where_they_should():
    """math_verify accepts what the strict rule refuses, and never refuses what it accepts: an identical answer
    scores 1 without asking math-verify (which parses `\\text{}` to nothing and scores it 0 against itself)."""
    for answer, truth in [(r"\frac{1}{2}", "0.5"), ("1,000", "1000"), ("2^{n-1}", "2^(n-1)")]:
        text = rf"so \boxed{{{answer}}}"
        assert (exact_match(text, truth), math_reward(text, truth)) == (0.0, 1.0)
    for same in [r"\text{}", "@@!"]:
        text = rf"so \boxed{{{same}}}"
        assert (exact_match(text, same), math_reward(text, same)) == (1.0, 1.0)


@pytest.mark.parametrize("answer, truth", [
    (r"\frac{1}{}", "1"), (r"\left( 2", "1"), ("^^_", "1"), ("$", "1"), ("\\", "1"), (r"\frac{1}{0}", "1"),
    (r"\begin{pmatrix}", "1"), (r"\sqrt[", "1"), ("1", r"\frac{"), ("1", "\\"), (r"\text{\x}", "2"), ("'\"\n", "1"),
])
def test_math_verify_never_raises_on_malformed_latex(answer, truth):
    assert math_reward(rf"so \boxed{{{answer}}}", truth) == 0.0


def test_math_verify_survives_a_huge_number():
    """`\\boxed{10^{10^{10}}}` makes sympy build a ten-billion-digit integer in C code that holds the GIL: run in
    the trainer's process, nothing could stop it and the process hung (in a process of its own here, so a hang
    fails the test). In the child, math-verify's own limit ends it: 0, and the run goes on."""
    code = ("import reward\nspec = 'reward:math_verify'\n"
            "print(reward.reward_and_answer('so \\\\boxed{10^{10^{10}}}', '1', reward=spec),"
            " reward.reward_and_answer('so \\\\boxed{1/2}', '0.5', reward=spec))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "(0.0, '10^{10^{10}}') (1.0, '1/2')"


def test_math_verify_kills_a_child_stuck_past_its_limit(monkeypatch):
    """The parent's limit is the backstop: a child that does not answer in time is killed, the answer scores 0 and
    a fresh child takes the next one (math-verify's own limit on this answer is 5 s, well past 1 s)."""
    import reward
    assert math_reward(r"\boxed{1/2}", "0.5") == 1.0                # the child is up
    stuck = reward._children["math-verify"].process
    monkeypatch.setattr(reward, "MATH_VERIFY_LIMIT_S", 1.0)
    assert math_reward(r"\boxed{10^{10^{10}}}", "1") == 0.0
    assert stuck.poll() is not None and "math-verify" not in reward._children  # killed, and forgotten
    monkeypatch.undo()
    assert math_reward(r"\boxed{1/2}", "0.5") == 1.0
    assert reward._children["math-verify"].process.pid != stuck.pid


def test_math_verify_without_the_package_is_one_line_before_start(tmp_path):
    """A --reward whose function resolves but whose package is missing is refused when the flag is checked, in one
    line saying what to install (here a math_verify that does not import stands in for a missing one)."""
    (tmp_path / "math_verify").mkdir()
    missing = "raise ModuleNotFoundError(\"No module named 'math_verify'\")\n"
    (tmp_path / "math_verify" / "__init__.py").write_text(missing)
    code = "import reward\nreward.check_reward_flag('reward:math_verify')\nprint('not reached')"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "not reached" not in proc.stdout, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: --reward reward:math_verify: the math-verify package does not import (ModuleNotFoundError: No module "
        "named 'math_verify'): pip install math-verify"]


def verifier_timeout_worker(spec, collective):
    """[torchrun, 2 ranks] rank 1's verifier times out while rank 0 waits for it in a collective."""
    import numpy as np
    import torch.distributed as dist
    from machinery import collectives
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        reward_and_answer(r"\boxed{1}", "1", reward=spec, timeout_s=1)
    {"gather": lambda: collectives.all_gather_np(np.zeros(3)), "barrier": collectives.barrier,
     "objects": lambda: collectives.all_gather_objects([{"answers": 1}])}[collective]()


@pytest.mark.parametrize("collective", ["gather", "barrier", "objects"])
def test_a_verifier_timeout_on_one_rank_is_one_line_from_each_rank(tmp_path, collective):
    """The waiting rank used to print a traceback (gloo's "Connection closed by peer") beneath the clear line."""
    from tests.common import torchrun
    verifier = tmp_path / "stuck.py"
    verifier.write_text("import time\ndef score(text, truth):\n    time.sleep(600)\n")
    proc = torchrun(2, "tests/test_reward.py", "verifier_timeout_worker", f"{verifier}:score", collective)
    errors = sorted(line for line in proc.stderr.splitlines() if line.startswith("error: "))
    assert proc.returncode != 0 and "[rank" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 2 and "did not return within --reward_timeout 1 s" in errors[0], errors
    assert errors[1] == "error: rank 0 stopped too: another rank stopped first (its error is above)", errors


if __name__ == "__main__":  # torchrun tests/test_reward.py WORKER ARGS...
    globals()[sys.argv[1]](*sys.argv[2:])
