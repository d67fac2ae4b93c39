"""A verifier that misbehaves cannot damage the run (reward.py, child processes): your own `--reward` runs in a
child process of its own, so what it does to its process (changes directory, ends it, is killed, spins in C code
holding the GIL, prints) leaves the trainer's untouched; a child that ends before answering is retried once, then
the run stops with one `error:` line, never a silent 0. The same holds for math-verify's child.

The tests where the verifier ends its process run the caller in a process of its own: on a regression the
verifier's os._exit(0) would end pytest itself, with exit status 0.

    .venv/bin/python -m pytest tests/test_verifier_isolation.py -q
"""
import os
import subprocess
import sys
import time
import uuid

import pytest

from tests.common import ROOT, live_pids_with

from reward import check_reward_flag, reward_and_answer


def verifier(tmp_path, body, name="score"):
    """A --reward spec for a verifier file whose function runs body (with os, re, signal, time imported)."""
    path = tmp_path / f"{name}.py"
    path.write_text("import os, re, signal, time\ndef score(text, truth):\n" +
                    "".join(f"    {line}\n" for line in body.splitlines()))
    return f"{path}:score"


def run_caller(code, env=None):
    """code run by a Python process of its own, as spo.py would run it, in a session of its own (on a regression a
    verifier's os.killpg would end pytest too)."""
    return subprocess.run([sys.executable, "-c", "import reward\n" + code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, start_new_session=True)


def test_a_verifier_that_changes_directory_leaves_the_callers_where_it_was(tmp_path, monkeypatch):
    """It used to move the trainer: checkpoints went elsewhere, and --resume found none."""
    monkeypatch.chdir(tmp_path)
    spec = verifier(tmp_path, "os.chdir('/')\nreturn 1")
    assert reward_and_answer(r"\boxed{1}", "1", reward=spec) == (1.0, "1")
    assert os.getcwd() == str(tmp_path)


def test_what_a_verifier_prints_does_not_mix_with_its_reply(tmp_path, capfd):
    """Its stdout, from Python or written to the file descriptor directly, goes to stderr."""
    spec = verifier(tmp_path, "print('0')\nos.write(1, b'[\"value\", 0.0]\\n')\nreturn 1")
    assert [reward_and_answer(rf"\boxed{{{i}}}", "1", reward=spec)[0] for i in range(3)] == [1.0] * 3
    assert capfd.readouterr().err.count('["value", 0.0]') == 3


def test_a_verifier_that_ends_its_process_is_retried_once_then_stops_the_run_with_one_line(tmp_path):
    """os._exit(0) used to end the run with exit status 0, no checkpoint and no message."""
    calls = tmp_path / "calls"
    spec = verifier(tmp_path, f"if 'quit' in text:\n    open({str(calls)!r}, 'a').write('.')\n    os._exit(0)\n"
                              f"return 1")
    proc = run_caller(f"print(reward.reward_and_answer('fine \\\\boxed{{1}}', '1', reward={spec!r}))\n"
                      f"reward.reward_and_answer('quit \\\\boxed{{1}}', '1', reward={spec!r})\nprint('not reached')")
    assert proc.returncode == 2 and proc.stdout == "(1.0, '1')\n", proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"error: --reward {spec} ended its process twice (exit code 0), on the response 'quit \\\\boxed{{1}}' (its "
        f"last 200 characters) with ground truth '1'; to score such inputs 0 instead, catch the case in the verifier "
        f"and return 0"]
    assert calls.read_text() == ".."                                      # asked again, once, in a fresh child


def test_a_verifier_that_kills_its_process_group_does_not_kill_the_caller(tmp_path):
    """It starts a checker and stops it with os.killpg, the usual idiom: its group used to be the training rank's."""
    spec = verifier(tmp_path, "import subprocess\nsubprocess.Popen(['sleep', '60'])\n"
                              "os.killpg(os.getpgrp(), signal.SIGKILL)")
    proc = run_caller(f"print('alive', flush=True)\nreward.reward_and_answer('\\\\boxed{{1}}', '1', reward={spec!r})")
    assert proc.returncode == 2 and proc.stdout == "alive\n", proc
    assert proc.stderr.splitlines() == [
        f"error: --reward {spec} ended its process twice (killed by signal 9), on the response '\\\\boxed{{1}}' "
        f"(its last 200 characters) with ground truth '1'; to score such inputs 0 instead, catch the case in the "
        f"verifier and return 0"]


def gone(pid, within_s=10.0):
    """Whether process pid ends (or is a zombie that only waits for init to reap it) within within_s."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


# A verifier's checker, started the ways a verifier might: in its group, in a session of its own, a daemon (double
# fork, setsid). Each sleeps for SLEEP seconds, a number no other process uses: its mark.
CHECKERS = {"in its group": "subprocess.Popen(['sleep', SLEEP])",
            "own session": "subprocess.Popen(['sleep', SLEEP], start_new_session=True)",
            "daemon": "subprocess.Popen(['sh', '-c', f'(setsid sleep {SLEEP} &)'])"}


def checker_verifier(tmp_path, how, then):
    """(spec, mark, pid file): a verifier that starts a checker `how`, writes its own pid, then runs `then`."""
    mark, pid = f"600.{uuid.uuid4().int % 10**9}", tmp_path / "pid"
    return verifier(tmp_path, f"import subprocess\nSLEEP = {mark!r}\n{CHECKERS[how]}\ntime.sleep(0.5)\n"
                              f"open({str(pid)!r}, 'w').write(str(os.getpid()))\n{then}"), mark, pid


@pytest.mark.parametrize("how", CHECKERS)
def test_the_checkers_a_verifier_leaves_are_stopped_with_it(tmp_path, how):
    """Processes that outlive their limits: at --reward_timeout the verifier and every checker it started end, even
    one in a session of its own, which used to hold the trainer's stderr open (`spo.py 2>&1 | tee` never ended)."""
    spec, mark, pid = checker_verifier(tmp_path, how, "while True:\n    pass")
    proc = run_caller(f"reward.reward_and_answer('\\\\boxed{{1}}', '1', reward={spec!r}, timeout_s=5)")  # its
    assert proc.returncode == 2 and "--reward_timeout 5 s" in proc.stderr, proc  # pipes closed: it returned
    assert gone(int(pid.read_text())) and live_pids_with(mark) == [], how


@pytest.mark.parametrize("hangs", [True, False])
def test_a_killed_trainers_verifier_and_its_checkers_end_with_it(tmp_path, hangs):
    """Processes that outlive their limits: the trainer killed by SIGKILL (nothing of it runs to clean up), while
    its verifier hangs or after it returned; its checker in a session of its own ends too."""
    spec, mark, pid = checker_verifier(tmp_path, "own session", "while True:\n    pass" if hangs else "return 1")
    trainer = subprocess.Popen([sys.executable, "-c", f"import reward, time\nreward.reward_and_answer("
                                f"'\\\\boxed{{1}}', '1', reward={spec!r})\ntime.sleep(600)"], cwd=ROOT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not pid.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live_pids_with(mark), "the checker did not start"
    finally:
        trainer.kill()
        trainer.wait()
    assert gone(int(pid.read_text())) and gone_all(mark)


def gone_all(mark, within_s=10.0):
    deadline = time.monotonic() + within_s
    while live_pids_with(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    return live_pids_with(mark) == []


def test_a_verifier_killed_while_scoring_is_asked_again_in_a_fresh_child(tmp_path):
    """As the kernel's out-of-memory killer would: the answer is scored by the retry, not lost."""
    mark = tmp_path / "killed_once"
    spec = verifier(tmp_path, f"if not os.path.exists({str(mark)!r}):\n    open({str(mark)!r}, 'w').close()\n"
                              f"    os.kill(os.getpid(), signal.SIGKILL)\nreturn 1")
    proc = run_caller(f"print(reward.reward_and_answer('\\\\boxed{{1}}', '1', reward={spec!r}))")
    assert proc.returncode == 0 and proc.stdout == "(1.0, '1')\n", proc.stderr[-2000:]
    assert mark.exists()


def test_a_verifier_stuck_in_c_code_holding_the_gil_is_stopped_in_time(tmp_path):
    """A regular expression that backtracks for ever holds the GIL: on a thread of the trainer's process no timeout
    could fire and the run hung. Its child is killed at --reward_timeout: the run stops within seconds, and the
    child does not live on."""
    pid_file = tmp_path / "pid"
    spec = verifier(tmp_path, f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                              f"return bool(re.match(r'(a+)+$', 'a' * 64 + 'b'))")
    proc = run_caller(f"import time\nreward.check_reward_flag({spec!r}, 1)\nstart = time.monotonic()\n"
                      f"try:\n    reward.reward_and_answer('\\\\boxed{{1}}', '1', reward={spec!r}, timeout_s=1)\n"
                      f"finally:\n    print(time.monotonic() - start)")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "did not return within --reward_timeout 1 s" in proc.stderr and float(proc.stdout) < 1 + 10
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_a_verifier_that_ends_its_process_on_import_is_one_line_before_start(tmp_path):
    path = tmp_path / "leaves.py"
    path.write_text("import os\nos._exit(3)\n")
    proc = run_caller(f"reward.check_reward_flag('{path}:score')\nprint('not reached')")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [f"error: --reward {path}:score: its process ended on import, exit code 3"]


def test_a_verifier_past_its_timeout_is_stopped_not_left_running(tmp_path, capsys):
    """A stuck call used to go on, on an abandoned thread of the trainer's process, for as long as the run."""
    pid_file = tmp_path / "pid"
    spec = verifier(tmp_path, f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\nwhile True:\n    pass")
    check_reward_flag(spec)
    start = time.monotonic()
    with pytest.raises(SystemExit):
        reward_and_answer(r"\boxed{1}", "1", reward=spec, timeout_s=0.5)
    assert time.monotonic() - start < 0.5 + 10 and "--reward_timeout 0.5 s" in capsys.readouterr().err
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


# ---- math-verify's child: killed while scoring (out of memory) -----------------------------------------------
def fake_math_verify(tmp_path, kills):
    """PYTHONPATH for a math_verify package whose verify is killed (SIGKILL) on its first `kills` calls in all
    (counted in a file), then says equal."""
    (tmp_path / "math_verify").mkdir()
    count = tmp_path / "killed"
    (tmp_path / "math_verify" / "__init__.py").write_text(
        f"import os, signal\ndef parse(s):\n    return s\ndef verify(gold, answer):\n"
        f"    if not os.path.exists({str(count)!r}) or len(open({str(count)!r}).read()) < {kills}:\n"
        f"        open({str(count)!r}, 'a').write('.')\n        os.kill(os.getpid(), signal.SIGKILL)\n"
        f"    return True\n")
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}


def test_math_verify_killed_while_scoring_is_asked_again(tmp_path):
    """It used to score the answer 0 without a verdict."""
    proc = run_caller("reward.check_reward_flag('reward:math_verify')\n"
                      "print(reward.reward_and_answer('\\\\boxed{1/2}', '0.5', reward='reward:math_verify'))",
                      env=fake_math_verify(tmp_path, kills=1))
    assert proc.returncode == 0 and proc.stdout == "(1.0, '1/2')\n", proc.stderr[-2000:]


def test_math_verify_killed_twice_stops_the_run_with_one_line(tmp_path):
    proc = run_caller("reward.reward_and_answer('\\\\boxed{1/2}', '0.5', reward='reward:math_verify')\n"
                      "print('not reached')", env=fake_math_verify(tmp_path, kills=2))
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        "error: --reward reward:math_verify: the math-verify process ended twice (killed by signal 9) while scoring "
        "the answer '1/2' against the ground truth '0.5', which has no verdict (out of memory?)"]
