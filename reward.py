"""The verifier: the binary reward r(x, y) in {0, 1} that SPO's tracker absorbs (Eq. 5) and its advantage
subtracts from (Eq. 8); training, the offline values pass (Algorithm 2) and evaluation all score with it.

The default (`--reward reward:exact_match`) is the authors' strict rule: the last `\\boxed{...}`, starting within
the last 100 characters, equal to the ground truth after stripping whitespace. Before any verifier reads a response,
its tool blocks are removed (a snippet that prints `\\boxed{N}` would otherwise answer for the model), and by default
a response cut off by the token budget scores 0 (else a policy can learn never to end its answer: docs/design.md).
Your own verifier (`--reward module:function`, docs/own-model-and-data.md) must return 0 or 1 (the tracker is a
Beta posterior over successes) and runs in a child process of its own: nothing it does there touches the run.
"""
import argparse
import contextlib
import functools
import importlib
import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from fractions import Fraction
from pathlib import Path

import numpy as np

from machinery.errors import fail

TAIL_CHARS = 100  # the authors' window: a box that starts earlier than this is not the final answer
BOX = "\\boxed{"  # `\boxed {x}` (with a space) is valid LaTeX but is NOT an answer here, as in the authors' rule
# Tool calls and their output (rollout.py's loop; unclosed when cut by the budget) are not the model's answer.
TOOL_BLOCKS = re.compile(r"<(code|interpreter)>.*?(?:</\1>|$)", re.DOTALL)
DEFAULT_REWARD = "reward:exact_match"  # the authors' strict rule (and the paper's)
VERIFIER_TIMEOUT_S = 60.0  # per response: generous for a symbolic checker, short against a hang


def add_reward_flags(parser, truncation=True):
    """The verifier's flags, shared by the three programs (eval.py scores truncated responses as they are)."""
    parser.add_argument("--reward", default=DEFAULT_REWARD, help="the verifier, module:function or file.py:function, "
                        "fn(response_text, ground_truth) -> 0 or 1 (docs/own-model-and-data.md; e.g. "
                        "reward:numeric_match, reward:math_verify); default: the authors' strict boxed rule")
    if truncation:
        parser.add_argument("--truncated_reward", choices=["zero", "score"], default="zero",  # (the authors': zero)
                            help=argparse.SUPPRESS)  # a cut-off response gets 0, or is scored (the benchmarks)
    parser.add_argument("--think_format", action="store_true",
                        help="reward 0 unless one </think> with no tool call after it (the authors' gate)")
    parser.add_argument("--reward_timeout", type=float, default=VERIFIER_TIMEOUT_S,
                        help="seconds your own verifier may take on one response; longer stops the run, naming "
                             "the input")


def extract_boxed(text: str, tail_chars: int | None = None) -> str | None:
    """Content of the last `\\boxed{` in text (or in its last tail_chars characters), braces matched naively.
    The LAST opener decides: one that never closes (a response cut off inside its final box) gives None."""
    if tail_chars is not None:
        text = text[max(len(text) - tail_chars, 0):]  # the box must start (and so end) inside the window
    start = text.rfind(BOX)
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(BOX) - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(BOX):i]
    return None


def final_answer(text: str, tail_chars: int = TAIL_CHARS) -> str | None:
    """The model's final answer: the last box in the tail, stripped; None if there is none or it is empty."""
    boxed = extract_boxed(text, tail_chars)
    return (boxed.strip() or None) if boxed is not None else None


# ------------------------------------------------------------------------------------------------ verifiers
# fn(response_text, ground_truth) -> 0 or 1; the text comes without tool blocks (visible_text).
def exact_match(text: str, ground_truth: str, tail_chars: int = TAIL_CHARS) -> float:
    """The default --reward, the authors' rule: the final answer equals the ground truth exactly (both stripped)."""
    return float(final_answer(text, tail_chars) == str(ground_truth).strip())


# A plain decimal (exponent of at most 3 digits: `1e999999999` would make Fraction build a huge integer) or a/b.
NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?|[+-]?\d+/\d+")


def numeric_match(text: str, ground_truth: str) -> float:
    """`--reward reward:numeric_match`: exact_match, but two numbers (decimals or a/b) compare by value, in exact
    rational arithmetic: `3.0` = `3` = `6/2`, `0.5` = `1/2`, `1e3` = `1000`."""
    answer, truth = final_answer(text), str(ground_truth).strip()
    if answer is None:
        return 0.0
    if NUMBER.fullmatch(answer) and NUMBER.fullmatch(truth):
        with contextlib.suppress(ValueError, ZeroDivisionError):  # 1/0; or more digits than int() converts
            return float(Fraction(answer) == Fraction(truth))
    return float(answer == truth)


# ------------------------------------------------------------------------------------------------ child processes
# Code the run cannot vouch for runs in a child process, never in the trainer's: a user's verifier (and its import),
# and math-verify (below). Whatever it does to its own process (os.chdir, os._exit, signal handlers, globals, a loop
# in C that holds the GIL, the memory that gets it killed) cannot move the run's files, end the run or hang it. A
# child answers one JSON line per request, in order, on a private copy of its stdout: what the code prints (from
# Python or from C) goes to stderr, and it reads an empty stdin, so neither mixes with the requests and replies.
CHILD_PRELUDE = r"""
import json, os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's: this child ends when the trainer ends it
if sys.platform == "linux":  # a keeper: the code runs in its child, and whatever that starts ends with the keeper
    import contextlib, ctypes, select
    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the code's orphans (setsid, double fork) come to us
    if code := os.fork():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit())  # stop()
        watch = select.poll()  # (a pidfd is readable when its process has ended)
        for pid in (os.getppid(), code):  # the trainer (however it ends), the code
            watch.register(os.pidfd_open(pid), select.POLLIN)
        with contextlib.suppress(SystemExit):
            watch.poll()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ended = {}  # SIGKILL our children until none is left (a killed one's orphans come to us)
        while children := [int(p) for p in open(f"/proc/self/task/{os.getpid()}/children").read().split()]:
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            ended.update(os.waitpid(pid, 0) for pid in children)
        status = os.waitstatus_to_exitcode(ended[code])
        if status < 0:  # end as the code's process did
            os.kill(os.getpid(), -status)
        os._exit(status if status >= 0 else 128 - status)
    os.setpgid(0, 0)  # a group of its own: an os.killpg of the code's does not reach the keeper
requests, replies = os.fdopen(os.dup(0)), os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
def reply(*message):
    print(json.dumps(message), file=replies, flush=True)
"""


class _Child:
    """A child process running `python -c code *args`; started: its first reply (["ready"] or ["error", why])."""

    def __init__(self, code, *args):
        # A session of its own: a verifier that stops its checkers with os.killpg (the usual idiom) stops its own
        # group, not the training rank's; its keeper (CHILD_PRELUDE) ends every process it started, at stop() or
        # when the trainer ends, even one in a session of its own.
        self.process = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.replies = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True, name="verifier-child").start()
        self.started = self.replies.get()

    def _read(self):  # a thread, so the wait for a reply can time out on any platform
        for line in self.process.stdout:
            self.replies.put(json.loads(line))
        self.replies.put(None)

    def ask(self, request, timeout_s):
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except OSError:  # it had ended: its pipe is closed
            return None
        return self.replies.get(timeout=timeout_s)

    def stop(self):
        """Kill it and every process it started (its keeper does, on SIGTERM), reap it; returns how it ended."""
        if self.process.returncode is None:  # not reaped: its pid (without a keeper: its group's id) is still ours
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGTERM) if sys.platform == "linux" else \
                    os.killpg(self.process.pid, signal.SIGKILL)
        code = self.process.wait()
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


_children = {}  # what runs in a child (a --reward spec, or "math-verify") -> its running _Child
_children_lock = threading.Lock()  # one request in flight: a reply must answer its own request


def _child(key, start):
    child = _children.get(key)
    if child is None or child.process.poll() is not None:  # first use, or it ended between two requests
        child = _children[key] = start()
    return child


def _ask(key, start, request, timeout_s):
    """[kind, value...], the reply of the child for key (start() starts one). One that does not answer within
    timeout_s is killed: ["timeout"]. One that ends before answering is replaced and asked again, once, then
    ["ended", how]: never a score without a verdict."""
    with _children_lock:
        for _ in range(2):
            child = _child(key, start)
            try:
                reply = child.ask(request, timeout_s)
            except BaseException as e:  # the limit, or an interrupt: a late reply must not answer the next request
                del _children[key]
                child.stop()
                if isinstance(e, queue.Empty):
                    return ["timeout"]
                raise
            if reply is not None:
                return reply
            del _children[key]
            how = child.stop()
        return ["ended", how]


# math-verify's own time limits use SIGALRM: a signal handler, which is the trainer's to own and which Python runs
# only in a main thread. Worse, `\boxed{10^{10^{10}}}` makes sympy compute a ten-billion-digit integer in C code that
# holds the GIL and checks only for signals: in the trainer's process nothing could stop it and the whole process
# hung. So math-verify runs in a child, in its main thread with its limits on (a parse or comparison that runs out
# of time is no match), and the parent kills the child if even those fail (undecided in time: a 0, a verdict).
MATH_VERIFY_CHILD = CHILD_PRELUDE + r"""
try:
    from math_verify import parse, verify
except Exception as e:
    reply("error", f"{type(e).__name__}: {e}")
    raise SystemExit
reply("ready")
for line in requests:
    answer, truth = json.loads(line)
    try:  # gold first: verify is not symmetric (an equation as gold, intervals)
        same = verify(parse("\\boxed{" + truth + "}"), parse("\\boxed{" + answer + "}"))
    except Exception:  # it catches its own errors; this is for any it lets through
        same = False
    reply("value", int(bool(same)))
"""
MATH_VERIFY_LIMIT_S = 40.0  # per answer; math-verify's own limits are 5 s per parse and per comparison


def _start_math_verify():
    """A math-verify child; ValueError with one line when math-verify does not import."""
    child = _Child(MATH_VERIFY_CHILD)
    if child.started != ["ready"]:
        how = child.stop()
        why = child.started[1] if child.started else f"its process ended, {how}"
        raise ValueError(f"the math-verify package does not import ({why}): pip install math-verify")
    return child


def math_verify(text: str, ground_truth: str) -> float:
    """`--reward reward:math_verify`: the same final box as exact_match, compared with the ground truth by the
    math-verify package: `\\frac{1}{2}` = `0.5`, `2^{n-1}` = `2^(n-1)`, `1,000` = `1000`. An exact match scores 1
    without it; an answer it cannot parse or decide within its limits (or MATH_VERIFY_LIMIT_S) scores 0."""
    answer, truth = final_answer(text), str(ground_truth).strip()
    if answer is None:
        return 0.0
    if answer == truth:  # exact_match's 1 stands: it needs no parse, and no time limit can take it back
        return 1.0
    try:
        kind, *value = _ask("math-verify", _start_math_verify, [answer, truth], MATH_VERIFY_LIMIT_S)
    except ValueError as e:  # a fresh child no longer imports it
        fail(f"--reward reward:math_verify: {e}")
    if kind == "ended":
        fail(f"--reward reward:math_verify: the math-verify process ended twice ({value[0]}) while scoring the "
             f"answer {answer!r} against the ground truth {truth!r}, which has no verdict (out of memory?)")
    return float(value == [1])  # ["timeout"]: undecided, 0


math_verify.check_before_start = lambda: _child("math-verify", _start_math_verify)


@functools.lru_cache(maxsize=None)
def load_verifier(spec: str):
    """The function a --reward spec names, imported once per process; ValueError with one line if it cannot be."""
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"--reward {spec}: expected module:function or file.py:function (e.g. reward:numeric_match)")
    try:
        if module_name.endswith(".py"):
            source = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            module = importlib.util.module_from_spec(source)
            source.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # not found, or it fails on import: either way the run cannot score
        raise ValueError(f"--reward {spec}: cannot import {module_name} ({e.__class__.__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--reward {spec}: {module_name} has no function {name}")
    try:
        getattr(fn, "check_before_start", lambda: None)()  # math_verify: its optional package imports
    except ValueError as e:
        raise ValueError(f"--reward {spec}: {e}") from None
    return fn


# Our own verifiers run in the trainer's process: pure code of ours that leaves the process as it found it, in
# bounded time (math_verify keeps math-verify in its own child), without a pipe round trip per response.
BUILT_IN = {"reward:exact_match", "reward:numeric_match", "reward:math_verify"}
VERIFIER_CHILD = CHILD_PRELUDE + r"""
sys.path[:] = json.loads(sys.argv[2])  # the trainer's: the spec imports as it would there
from reward import is_binary, load_verifier
try:
    fn = load_verifier(sys.argv[1])
except ValueError as e:
    reply("error", str(e))
    raise SystemExit
reply("ready")
for line in requests:
    try:
        value = fn(*json.loads(line))
    except BaseException as e:  # noqa: BLE001 - sys.exit too: whatever the verifier raises is reported
        reply("raised", f"{type(e).__name__}: {e}")
    else:  # 0 or 1 travels as a float (a numpy bool or float included), anything else as what it was
        reply(*(["value", float(value)] if is_binary(value) else ["returned", f"{value!r} (a {type(value).__name__})"]))
"""


def _start_verifier(spec):
    """The child that runs your verifier; ValueError with one line if it does not import."""
    child = _Child(VERIFIER_CHILD, spec, json.dumps(sys.path))
    if child.started != ["ready"]:
        how = child.stop()
        raise ValueError(child.started[1] if child.started else f"--reward {spec}: its process ended on import, {how}")
    return child


def check_reward_flag(spec: str, timeout_s: float = VERIFIER_TIMEOUT_S):
    """Resolve --reward once, before anything heavy starts: a bad spec or --reward_timeout is one `error:` line."""
    if not 0 < timeout_s < float("inf"):
        fail(f"--reward_timeout must be a positive number of seconds, got {timeout_s}", once=True)
    try:
        if spec in BUILT_IN:
            load_verifier(spec)
        else:
            with _children_lock:
                _child(spec, functools.partial(_start_verifier, spec))
    except ValueError as e:
        fail(str(e), once=True)


def call_verifier(spec: str, text: str, ground_truth: str, timeout_s: float = VERIFIER_TIMEOUT_S):
    """The --reward verifier's value on one response. Your own verifier, in its child: one that raises, returns
    anything but 0 or 1, does not return within timeout_s (its child is killed, even in C holding the GIL) or ends
    its process twice stops the run with one line naming the input, not a traceback, a hang or a silent 0."""
    if spec in BUILT_IN:
        return load_verifier(spec)(text, ground_truth)
    try:
        kind, *value = _ask(spec, functools.partial(_start_verifier, spec), [text, ground_truth], timeout_s)
    except ValueError as e:  # a fresh child no longer imports it
        fail(str(e))
    if kind == "value":
        return value[0]
    if kind == "returned":
        fail(f"--reward {spec} returned {value[0]}; a verifier must return 0 or 1 "
             f"(SPO's tracker is a Beta posterior over binary rewards)")
    what = (f"raised {value[0]}" if kind == "raised" else f"ended its process twice ({value[0]})" if kind == "ended"
            else f"did not return within --reward_timeout {timeout_s:g} s")
    fail(f"--reward {spec} {what}, on the response {text[-200:]!r} (its last 200 characters) with ground truth "
         f"{ground_truth!r}; to score such inputs 0 instead, catch the case in the verifier and return 0")


def is_binary(value) -> bool:
    return isinstance(value, (bool, int, float, np.number, np.bool_)) and value in (0, 1)


# ------------------------------------------------------------------------------------------------ scoring
def visible_text(response_text: str, think_format: bool = False) -> str | None:
    """What a verifier reads: the response without tool blocks; None (reward 0) when think_format's gate fails."""
    if think_format:
        after_think = response_text.partition("</think>")[2]
        if response_text.count("</think>") != 1 or "<code>" in after_think or "<interpreter>" in after_think:
            return None
    return TOOL_BLOCKS.sub("", response_text)


def reward_and_answer(response_text: str, ground_truth: str, think_format: bool = False,
                      reward: str = DEFAULT_REWARD, timeout_s: float = VERIFIER_TIMEOUT_S) -> tuple[float, str | None]:
    """(reward in {0.0, 1.0} by the --reward verifier, the final boxed answer or None: maj@k's vote)."""
    text = visible_text(response_text, think_format)
    return (0.0, None) if text is None else (call_verifier(reward, text, ground_truth, timeout_s), final_answer(text))


def boxed_reward(response_text: str, ground_truth: str, think_format: bool = False) -> float:
    """The binary reward r(x, y) by the default rule."""
    return reward_and_answer(response_text, ground_truth, think_format)[0]


def rewards(rollouts, ground_truths, think_format=False, truncated_reward="zero", reward=DEFAULT_REWARD,
            timeout_s=VERIFIER_TIMEOUT_S):
    """(B,) rewards of a batch of rollout.Rollout, as training and the offline values pass score them; NaN for a
    trajectory over-sampling aborted (None: Appendix B)."""
    scores = np.array([reward_and_answer(r.text, answer, think_format, reward, timeout_s)[0] if r else np.nan
                       for r, answer in zip(rollouts, ground_truths)])
    if truncated_reward == "zero":
        scores *= np.array([r is None or r.finish_reason != "length" for r in rollouts])
    return scores
