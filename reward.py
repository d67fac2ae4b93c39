"""The verifier: the binary reward r(x, y) in {0, 1} that SPO's tracker absorbs (Eq. 5) and its advantage
subtracts from (Eq. 8). Training, the offline values pass (Algorithm 2) and evaluation all score with it.

The default rule (`--reward reward:exact_match`) is the authors' strict one: the answer is the last `\\boxed{...}`
(braces matched), which must start within the last 100 characters of the response and must equal the ground truth
exactly after stripping whitespace (`\\boxed{1/2}` is wrong for "0.5"). Two additions of ours, applied before any
verifier reads the response:
- Tool calls are not the model's answer: `<code>...</code>` and `<interpreter>...</interpreter>` blocks are
  removed before the box is looked for. Scored as the authors do (whole text), a snippet that prints
  `\\boxed{N}` would answer for the model (in its code and again in the tool output): a reward hack.
- A response cut off by the token budget (or the tool loop's turn limit) scores 0 by default
  (`truncated_reward="zero"`): it never finished its answer. Scored as is, the verifier ignores whatever follows
  the last box, and a policy can learn never to end its answer (docs/design.md, Rewards).
`think_format=True` adds the authors' gate for thinking models: exactly one `</think>` and no tool tag after it.

Your own verifier (`--reward module:function` or `--reward path/to/file.py:function`, docs/own-model-and-data.md)
is a function `fn(response_text, ground_truth) -> 0 or 1` that reads the response with the tool blocks removed
(after the think gate) and the answer as a stripped string. Binary, because SPO's tracker is a Beta posterior over
successes (Eq. 5) and pass@k, maj@k and the offline-values check count successes; any other value stops the run
with one line naming --reward. `numeric_match` (numbers by value) and `math_verify` (mathematical equivalence,
with the optional math-verify package) are two more verifiers.

    from reward import boxed_reward, rewards
    boxed_reward("so the sum is \\\\boxed{17}", "17")                       # 1.0
    rewards(rollouts, ground_truths, think_format=False, truncated_reward="zero")   # (B,) for rollout.Rollout
"""
import functools
import importlib
import importlib.util
import json
import queue
import re
import subprocess
import sys
import threading
from fractions import Fraction
from pathlib import Path

import numpy as np

TAIL_CHARS = 100  # the authors' window: a box that starts earlier than this is not the final answer
BOX = "\\boxed{"  # `\boxed {x}` (with a space) is valid LaTeX but is NOT an answer here, as in the authors' rule
# Tool calls and their output (rollout.py's loop; unclosed when cut by the budget) are not the model's answer.
TOOL_BLOCKS = re.compile(r"<(code|interpreter)>.*?(?:</\1>|$)", re.DOTALL)
DEFAULT_REWARD = "reward:exact_match"  # the authors' strict rule (and the paper's)
VERIFIER_TIMEOUT_S = 60.0  # per response: generous for a symbolic checker, short against a hang


def add_reward_flags(parser, truncation=True):
    """The verifier's flags, shared by spo.py, offline_values.py and eval.py (eval scores truncated responses as
    they are: truncation=False leaves --truncated_reward out)."""
    parser.add_argument("--reward", default=DEFAULT_REWARD,
                        help="the verifier, module:function or file.py:function, fn(response_text, ground_truth) "
                             "-> 0 or 1 (docs/own-model-and-data.md; e.g. reward:numeric_match, reward:math_verify); "
                             "default: the authors' strict boxed rule")
    if truncation:
        parser.add_argument("--truncated_reward", choices=["zero", "score"], default="zero",
                            help="a response cut off by the token budget gets 0 (zero) or is scored like any other")
    parser.add_argument("--think_format", action="store_true",
                        help="reward 0 unless one </think> with no tool call after it (the authors' gate)")
    parser.add_argument("--reward_timeout", type=float, default=VERIFIER_TIMEOUT_S,
                        help="seconds the verifier may take on one response; longer stops the run, naming the input")


def extract_boxed(text: str, tail_chars: int | None = None) -> str | None:
    """Content of the last `\\boxed{` in text (or in its last tail_chars characters), braces matched.

    The LAST opener decides: if it never closes (a response cut off inside its final box) the result is None,
    we do not fall back to an earlier box. Braces are counted naively, so `\\{ \\}` pairs count too.
    """
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
    """The model's final answer: the last box in the tail, stripped; None if there is none or it is empty
    (`\\boxed{}` or `\\boxed{  }` is no answer)."""
    boxed = extract_boxed(text, tail_chars)
    return (boxed.strip() or None) if boxed is not None else None


# ------------------------------------------------------------------------------------------------ verifiers
# fn(response_text, ground_truth) -> 0 or 1; the text comes without tool blocks (visible_text).
def exact_match(text: str, ground_truth: str, tail_chars: int = TAIL_CHARS) -> float:
    """The default --reward, the authors' rule: 1.0 if the final answer equals the ground truth exactly (both
    stripped), else 0.0."""
    return float(final_answer(text, tail_chars) == str(ground_truth).strip())


# A plain decimal (exponent of at most 3 digits: `1e999999999` would make Fraction build a huge integer) or a/b.
NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?|[+-]?\d+/\d+")


def numeric_match(text: str, ground_truth: str) -> float:
    """An example of a second verifier (`--reward reward:numeric_match`): the same final box as exact_match, but
    when both sides are numbers (decimals with an optional exponent, or a/b) they compare by value, in exact
    rational arithmetic: `3.0` = `3` = `6/2`, `0.5` = `1/2`, `1e3` = `1000`. Anything else (`\\frac{1}{2}`,
    `1,000`, `x+1`) falls back to exact_match's string equality."""
    answer, truth = final_answer(text), str(ground_truth).strip()
    if answer is None:
        return 0.0
    if NUMBER.fullmatch(answer) and NUMBER.fullmatch(truth):
        try:
            return float(Fraction(answer) == Fraction(truth))
        except (ValueError, ZeroDivisionError):  # 1/0; or more digits than int() converts
            pass
    return float(answer == truth)


# math-verify's own time limits use SIGALRM, which Python handles only in a process's main thread, and our verifier
# calls run on a worker thread. Worse, `\boxed{10^{10^{10}}}` makes sympy compute a ten-billion-digit integer in C
# code that holds the GIL and checks only for signals: on a worker thread nothing can stop it and the whole process
# hangs. So math-verify runs in a child process, in its main thread with its limits on (a parse or comparison that
# runs out of time is no match), and the parent kills the child if even those fail.
MATH_VERIFY_CHILD = r"""
import json, sys
reply, sys.stdout = sys.stdout, sys.stderr  # whatever the libraries print must not mix with the replies
try:
    from math_verify import parse, verify
except Exception as e:
    print(f"{type(e).__name__}: {e}", file=reply, flush=True)
    raise SystemExit
print("ready", file=reply, flush=True)
for line in sys.stdin:
    answer, truth = json.loads(line)
    try:  # gold first: verify is not symmetric (an equation as gold, intervals)
        same = verify(parse("\\boxed{" + truth + "}"), parse("\\boxed{" + answer + "}"))
    except Exception:  # it catches its own errors; this is for any it lets through
        same = False
    print(int(bool(same)), file=reply, flush=True)
"""
MATH_VERIFY_LIMIT_S = 40.0  # per answer; math-verify's own limits are 5 s per parse and per comparison
_math_child = None  # (process, queue of its reply lines, None at its end)
_math_lock = threading.Lock()


def _math_verify_child():
    """The running math-verify child, started on first use (or after it was killed). Raises ValueError with one
    line when math-verify does not import: math_verify.check_before_start, run when --reward is resolved."""
    global _math_child
    if _math_child is None or _math_child[0].poll() is not None:
        process = subprocess.Popen([sys.executable, "-c", MATH_VERIFY_CHILD], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        replies = queue.SimpleQueue()

        def read():  # a thread, so the wait for a reply can time out on any platform
            for line in process.stdout:
                replies.put(line.strip())
            replies.put(None)

        threading.Thread(target=read, daemon=True, name="math-verify").start()
        started = replies.get()
        if started != "ready":
            process.kill()
            process.wait()
            raise ValueError(f"the math-verify package does not import ({started}): pip install math-verify")
        _math_child = process, replies
    return _math_child


def math_verify(text: str, ground_truth: str) -> float:
    """`--reward reward:math_verify`: the same final box as exact_match, compared with the ground truth by the
    math-verify package (parse, then verify, gold first): `\\frac{1}{2}` = `0.5`, `2^{n-1}` = `2^(n-1)`,
    `1,000` = `1000`, `[1, 2)` = `[1,2)`. An exact match scores 1 without it; no box, an answer it cannot parse
    or one it cannot decide within its limits (or MATH_VERIFY_LIMIT_S) scores 0."""
    global _math_child
    answer, truth = final_answer(text), str(ground_truth).strip()
    if answer is None:
        return 0.0
    if answer == truth:  # exact_match's 1 stands: it needs no parse, and no time limit can take it back
        return 1.0
    with _math_lock:  # one request in flight: a reply must answer its own request
        process, replies = _math_verify_child()
        try:
            process.stdin.write(json.dumps([answer, truth]) + "\n")
            process.stdin.flush()
            reply = replies.get(timeout=MATH_VERIFY_LIMIT_S)
        except (BrokenPipeError, queue.Empty):
            reply = None
        if reply is None:  # stuck past its own limits, or died: a fresh child takes the next answer
            process.kill()
            process.wait()
            _math_child = None
    return float(reply == "1")


math_verify.check_before_start = _math_verify_child


@functools.lru_cache(maxsize=None)
def load_verifier(spec: str):
    """The function a --reward spec names: `module:function` (imported as Python imports it: the repository,
    PYTHONPATH, installed packages) or `path/to/file.py:function`. Raises ValueError with one line naming the
    flag for a malformed spec, a module that does not import or a missing function. Cached: one import per
    process."""
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


def check_reward_flag(spec: str, timeout_s: float = VERIFIER_TIMEOUT_S):
    """Resolve --reward once, before anything heavy starts: a bad spec or --reward_timeout is one `error:` line
    (exit code 2)."""
    from machinery.errors import fail
    if not 0 < timeout_s < float("inf"):
        fail(f"--reward_timeout must be a positive number of seconds, got {timeout_s}", once=True)
    try:
        load_verifier(spec)
    except ValueError as e:
        fail(str(e), once=True)


_worker = None  # (requests, replies) of the thread that runs verifier calls; replaced after a call times out
_worker_lock = threading.Lock()


def _verifier_worker():
    """One daemon thread runs every verifier call, fed by a queue: starting a thread per call costs a millisecond
    on a busy machine, a hand-off tens of microseconds. Daemon: a call that never returns cannot hold the exit."""
    global _worker
    if _worker is None:
        requests, replies = queue.SimpleQueue(), queue.SimpleQueue()

        def serve():
            while True:
                fn, text, ground_truth = requests.get()
                try:
                    replies.put(("value", fn(text, ground_truth)))
                except BaseException as e:  # noqa: BLE001 - whatever the user's function raises is reported
                    replies.put(("error", e))

        threading.Thread(target=serve, daemon=True, name="verifier").start()
        _worker = requests, replies
    return _worker


def call_verifier(spec: str, text: str, ground_truth: str, timeout_s: float = VERIFIER_TIMEOUT_S):
    """The --reward verifier's value on one response, within timeout_s. A verifier that raises, or does not return
    in time, stops the run with one line naming it and the input: a traceback on every rank, or a silent hang at
    step 0, tells the user nothing. (A verifier stuck inside C code that holds the GIL, e.g. `10 ** 10 ** 10`,
    cannot be interrupted from Python: give such code its own limit.)"""
    global _worker
    fn = load_verifier(spec)
    with _worker_lock:
        requests, replies = _verifier_worker()
        requests.put((fn, text, ground_truth))
        try:
            kind, value = replies.get(timeout=timeout_s)
        except queue.Empty:
            kind, value, _worker = "timeout", None, None  # the stuck thread is abandoned, never reused
    if kind == "value":
        return value
    from machinery.errors import fail
    what = (f"raised {type(value).__name__}: {value}" if kind == "error"
            else f"did not return within --reward_timeout {timeout_s:g} s")
    fail(f"--reward {spec} {what}, on the response {text[-200:]!r} (its last 200 characters) with ground truth "
         f"{ground_truth!r}; to score such inputs 0 instead, catch the case in the verifier and return 0")


def checked_reward(value, spec: str) -> float:
    """A verifier's return value as 0.0 or 1.0; anything else stops with one line naming --reward."""
    if isinstance(value, (bool, int, float, np.number, np.bool_)) and value in (0, 1):
        return float(value)
    from machinery.errors import fail
    fail(f"--reward {spec} returned {value!r} (a {type(value).__name__}); a verifier must return 0 or 1 "
         f"(SPO's tracker is a Beta posterior over binary rewards)")


# ------------------------------------------------------------------------------------------------ scoring
def visible_text(response_text: str, think_format: bool = False) -> str | None:
    """What a verifier reads: the response without tool calls and their output; None (reward 0, no answer) when
    think_format is on and the authors' gate fails (not exactly one `</think>`, or a tool tag after it)."""
    if think_format:
        after_think = response_text.partition("</think>")[2]
        if response_text.count("</think>") != 1 or "<code>" in after_think or "<interpreter>" in after_think:
            return None
    return TOOL_BLOCKS.sub("", response_text)


def reward_and_answer(response_text: str, ground_truth: str, think_format: bool = False,
                      reward: str = DEFAULT_REWARD, timeout_s: float = VERIFIER_TIMEOUT_S) -> tuple[float, str | None]:
    """(reward in {0.0, 1.0} by the --reward verifier, the final boxed answer or None). The answer feeds maj@k
    (whatever the verifier; None never wins a vote). The think gate and the tool-block removal come first."""
    text = visible_text(response_text, think_format)
    if text is None:
        return 0.0, None
    return checked_reward(call_verifier(reward, text, ground_truth, timeout_s), reward), final_answer(text)


def boxed_reward(response_text: str, ground_truth: str, think_format: bool = False) -> float:
    """The binary reward r(x, y) by the default rule: 1.0 if the final boxed answer equals the ground truth."""
    return reward_and_answer(response_text, ground_truth, think_format)[0]


def rewards(rollouts, ground_truths, think_format=False, truncated_reward="zero", reward=DEFAULT_REWARD,
            timeout_s=VERIFIER_TIMEOUT_S):
    """(B,) rewards of a batch of rollout.Rollout, as training and the offline values pass score them.
    truncated_reward "zero": a rollout that hit the token budget or the turn limit (finish reason "length")
    scores 0; "score": it is scored like any other. reward: the --reward spec; timeout_s: --reward_timeout."""
    scores = np.array([reward_and_answer(r.text, answer, think_format, reward, timeout_s)[0]
                       for r, answer in zip(rollouts, ground_truths)])
    if truncated_reward == "zero":
        scores *= np.array([r.finish_reason != "length" for r in rollouts])
    return scores
