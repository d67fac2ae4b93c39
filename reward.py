"""The verifier: the binary reward r(x, y) in {0, 1} that SPO's tracker absorbs (Eq. 5) and its advantage
subtracts from (Eq. 8). Training, the offline values pass (Algorithm 2) and evaluation all score with it.

The rule is the authors' strict one: the answer is the last `\\boxed{...}` (braces matched), which must start
within the last 100 characters of the response and must equal the ground truth exactly after stripping
whitespace (`\\boxed{1/2}` is wrong for "0.5"). Two additions of ours:
- Tool calls are not the model's answer: `<code>...</code>` and `<interpreter>...</interpreter>` blocks are
  removed before the box is looked for. Scored as the authors do (whole text), a snippet that prints
  `\\boxed{N}` would answer for the model (in its code and again in the tool output): a reward hack.
- A response cut off by the token budget (or the tool loop's turn limit) scores 0 by default
  (`truncated_reward="zero"`): it never finished its answer. Scored as is, the verifier ignores whatever follows
  the last box, and a policy can learn never to end its answer (README, "Choices").
`think_format=True` adds the authors' gate for thinking models: exactly one `</think>` and no tool tag after it.

    from reward import boxed_reward, rewards
    boxed_reward("so the sum is \\\\boxed{17}", "17")                       # 1.0
    rewards(rollouts, ground_truths, think_format=False, truncated_reward="zero")   # (B,) for rollout.Rollout
"""
import re

import numpy as np

TAIL_CHARS = 100  # the authors' window: a box that starts earlier than this is not the final answer
BOX = "\\boxed{"  # `\boxed {x}` (with a space) is valid LaTeX but is NOT an answer here, as in the authors' rule
# Tool calls and their output (rollout.py's loop; unclosed when cut by the budget) are not the model's answer.
TOOL_BLOCKS = re.compile(r"<(code|interpreter)>.*?(?:</\1>|$)", re.DOTALL)


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


def reward_and_answer(response_text: str, ground_truth: str, think_format: bool = False,
                      tail_chars: int = TAIL_CHARS) -> tuple[float, str | None]:
    """(reward in {0.0, 1.0}, extracted answer or None). The answer feeds maj@k; None never wins a vote.

    think_format: the authors' gate: exactly one `</think>` and no `<code>` / `<interpreter>` after it, else
    (0.0, None). Then tool blocks are removed and the last box of the remaining text is the answer.
    """
    if think_format:
        after_think = response_text.partition("</think>")[2]
        if response_text.count("</think>") != 1 or "<code>" in after_think or "<interpreter>" in after_think:
            return 0.0, None
    response_text = TOOL_BLOCKS.sub("", response_text)
    boxed = extract_boxed(response_text, tail_chars)
    answer = boxed.strip() if boxed is not None else ""
    if not answer:  # `\boxed{}` or `\boxed{  }` is no answer
        return 0.0, None
    return float(answer == str(ground_truth).strip()), answer


def boxed_reward(response_text: str, ground_truth: str, think_format: bool = False) -> float:
    """The binary reward r(x, y): 1.0 if the final boxed answer equals the ground truth, else 0.0."""
    return reward_and_answer(response_text, ground_truth, think_format)[0]


def rewards(rollouts, ground_truths, think_format=False, truncated_reward="zero"):
    """(B,) rewards of a batch of rollout.Rollout, as training and the offline values pass score them.
    truncated_reward "zero": a rollout that hit the token budget or the turn limit (finish reason "length")
    scores 0; "score": it is scored like any other."""
    reward = np.array([boxed_reward(r.text, answer, think_format) for r, answer in zip(rollouts, ground_truths)])
    if truncated_reward == "zero":
        reward *= np.array([r.finish_reason != "length" for r in rollouts])
    return reward
