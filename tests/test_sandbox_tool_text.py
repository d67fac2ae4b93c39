"""What the tool loop (rollout.py) sends into the sandbox and gets back from it (sandbox.py): the REPL-style last
expression, the tool output cut to the model's budget with its notes, and every failure turned into interpreter
text. The sandbox itself: tests/test_sandbox.py and tests/test_sandbox_isolation.py.

    .venv/bin/python -m pytest tests/test_sandbox_tool_text.py -q
"""
from concurrent.futures import Future

import pytest

from common import SNIPPET_TIMEOUT_S
from sandbox import SandboxResult, format_tool_output, interpreter_text, run_code, show_last_expression


def test_format_tool_output_cuts_middle_and_keeps_notes():
    r = SandboxResult(stdout="H" * 200 + "T" * 200, stderr="", exit_code=-9, timed_out=True, out_of_memory=False,
                      output_truncated=False, network_isolated=True, unix_sockets_blocked=True, duration_s=30.2)
    text = format_tool_output(r, max_chars=256)
    head, _, rest = text.partition("\n...\n")
    assert head == "H" * 128 and rest.startswith("T" * 128) and "TimeoutError" in rest
    ok = SandboxResult(stdout="4\n", stderr="", exit_code=0, timed_out=False, out_of_memory=False,
                       output_truncated=False, network_isolated=True, unix_sockets_blocked=True,
                       duration_s=0.02)
    assert format_tool_output(ok) == "4\n"
    failed = SandboxResult(stdout="", stderr="", exit_code=2, timed_out=False, out_of_memory=False,
                           output_truncated=False, network_isolated=True, unix_sockets_blocked=True,
                           duration_s=0.02)
    assert format_tool_output(failed) == "[exit code 2]"


@pytest.mark.parametrize("code, shown", [
    ("x = 6\nx * 7", "42\n"),                          # a bare last expression is shown, like a REPL
    ("x = 'a'; x", "'a'\n"),                           # repr, after a semicolon on the same line
    ("(1 +\n 2)  # sum", "3\n"),                        # a multi-line expression, a trailing comment
    ("é = 'ü'\né", "'ü'\n"),                            # non-ASCII: ast columns are UTF-8 bytes
    ("None", ""),                                       # None shows nothing
    ("print(5)", "5\n"),                                # already a print: unchanged, printed once
    ("for i in range(2):\n    i", ""),                  # indented last line: left alone (the authors' bug)
    ("x = 3", ""),                                      # an assignment shows nothing
    ("y = 2\ry", "2\n"),                                # a lone \r ends a line for python: so here too
    ("y = 2\r\ny", "2\n"),                              # \r\n
])
def test_show_last_expression_runs_like_a_repl(code, shown):
    result = run_code(show_last_expression(code), timeout_s=SNIPPET_TIMEOUT_S)
    assert result.exit_code == 0 and result.stdout == shown, (result.stdout, result.stderr)


def test_show_last_expression_leaves_bad_code_alone_and_keeps_line_numbers():
    assert show_last_expression("def f(:\n  pass") == "def f(:\n  pass"
    for deep in ("1" + "+1" * 3000, "-" * 3000 + "1"):  # too deep for the parser: unchanged, nothing raised
        assert show_last_expression(deep) == deep
    code = "x = 1\ny = 1 / 0\nx"
    result = run_code(show_last_expression(code), timeout_s=SNIPPET_TIMEOUT_S)
    assert "line 2" in result.stderr and "ZeroDivisionError" in result.stderr  # the error line is unchanged


def test_interpreter_text_turns_every_failure_into_text():
    failed = Future()
    failed.set_exception(RuntimeError("sandbox: all 256 dedicated uids are busy"))
    text, error, timed_out = interpreter_text(failed, 256)
    assert text.startswith("<interpreter>\nsandbox error: RuntimeError") and text.endswith("</interpreter>\n\n")
    assert error and not timed_out
    done = Future()
    done.set_result(SandboxResult("x" * 1000, "", 0, False, False, False, True, True, 0.1))
    text, error, timed_out = interpreter_text(done, 64)
    assert not error and len(text) < 64 + 40 and "\n...\n" in text  # cut keeping head and tail
