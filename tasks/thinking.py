"""A toy whose responses think: three-digit sums worked column by column before the boxed answer.

The plain toy's response is `\\boxed{a+b}`, about 12 tokens nearly all of which the policy is sure of, so the mean
|log-ratio| over a response (SPO's D(x), Eq. 5) stays under rho's window. Here the model writes its reasoning first,
one line per column from the units up, digits of a and b, the carry in, and the column's sum, then the answer read
off those lines:

    347+586=  ->  7+6+0=13 / 4+8+1=13 / 3+5+1=9 / \\boxed{933}   (lines joined by newlines; about 38 tokens)

The warm start's noise lands in the written partial sums, where a person errs: a column that carries is written
wrong (off by 1 or 2) with probability `noise`, one that does not with noise / 3, and everything after follows
from what was written. So the uncertain tokens are spread over the reasoning, success depends on the carries a
prompt has, and a wrong partial sum makes a wrong answer that RL can learn away. With --shuffle (the shipped
build) each line's three terms come in a random order (`6+0+7=13`): uncertainty on every prompt that never decides
the reward, as a long chain's wording is, which narrows D's spread over prompts (docs/experiments.md). Same
tokenizer and model as the plain toy (tasks/toy.py's functions). Built deterministically on one kind of CPU,
shipped in tasks/built/toy_think:

    python -m tasks.thinking --toy_dir tasks/built/toy_think --shuffle
    torchrun --nproc_per_node=2 spo.py --toy_dir tasks/built/toy_think --max_response_len 64  # (the toys: 32)

toy.json's "recipe" tells tasks/toy.py:ensure_toy to check such a folder, never to rebuild it as its own. The exact
metric (--eval_reference auto) is off here: any trace ending in the right box is correct, not one response.
"""
import argparse
import json
import os

import numpy as np
import torch

from tasks.toy import build_atomically, encode_segments, response_logprob, warm_started

THINK_VERSION = 1  # bump when the recipe below changes, and rebuild the shipped folder
RECIPE = "thinking"  # toy.json's "recipe" for this module's toys


def is_thinking(toy_dir):
    """Whether toy_dir holds a built thinking toy (toy.json's recipe)."""
    marker = os.path.join(toy_dir or "", "toy.json")
    return os.path.exists(marker) and json.load(open(marker)).get("recipe") == RECIPE


def check_budget(toy_dir, max_response_len):
    """One line (exit 2) where a thinking toy's budget cannot hold a correct trace: every response cut, reward 0."""
    if is_thinking(toy_dir) and max_response_len < LONGEST_TRACE:
        from machinery.errors import fail
        fail(f"--max_response_len {max_response_len}: the thinking toy {toy_dir} needs at least {LONGEST_TRACE} "
             f"tokens for a worked sum (docs/experiments.md's runs use 64)", once=True)


def make_problems(seed, n_train, n_test):
    """Disjoint train / test sets of (a, b), both of three digits."""
    pairs = np.random.default_rng(seed).choice(900 * 900, n_train + n_test, replace=False)
    pairs = [(100 + int(p) // 900, 100 + int(p) % 900) for p in pairs]
    return pairs[:n_train], pairs[n_train:]


def thinking_response(a, b, rng=None, noise=0.0, order=None, score_order=True):
    """The worked sum as (text, in the loss) pieces; with rng, a column's sum is written off by 1 or 2 with
    probability noise (noise / 3 where the column does not carry) and the lines after it, and the box, follow.
    order (a numpy Generator): each line's three terms in a random order, a choice that never decides the reward;
    score_order=False leaves those choices out of the loss (to score the sums given the order)."""
    pieces, carry, answer = [], 0, 0
    for k, (x, y) in enumerate(zip(reversed(str(a)), reversed(str(b)))):
        s = int(x) + int(y) + carry
        if rng is not None and rng.random() < (noise if s >= 10 else noise / 3):
            s = max(0, s + int(rng.choice([-2, -1, 1, 2])))
        terms = [x, y, str(carry)]
        if order is not None:
            order.shuffle(terms)
        pieces += [(f"{terms[0]}+{terms[1]}+", score_order), (f"{terms[2]}={s}\n", True)]
        carry, answer = s // 10, answer + (s % 10) * 10 ** k
    return pieces + [(f"\\boxed{{{answer + carry * 10 ** (len(pieces) // 2)}}}", True)]


# Tokens of the longest trace (one a character, plus the end of turn): four-digit box, two-digit sums.
LONGEST_TRACE = sum(len(piece) for piece, _ in thinking_response(999, 999)) + 1


@torch.no_grad()
def correct_trace_probability(model, tokenizer, problems, shuffle=False):
    """Per problem, the exact probability at temperature 1.0 of the correct worked sum (shuffle: of its sums and
    box given one random order of the terms): a lower bound of the success probability (a trace with errors that
    cancel also ends in the right box)."""
    out, order = [], np.random.default_rng(1) if shuffle else None
    for i in range(0, len(problems), 256):
        chunk = problems[i: i + 256]
        ids, mask = encode_segments(tokenizer, [f"{a}+{b}=" for a, b in chunk],
                                    [thinking_response(a, b, order=order, score_order=False) for a, b in chunk])
        out.append(response_logprob(model, ids, mask).exp())
    return torch.cat(out).numpy()


def build_thinking_toy(toy_dir, seed=0, n_train=2000, n_test=500, steps=600, lr=3e-3, batch_size=64, noise=0.3,
                       shuffle=False):
    """Build the thinking toy into toy_dir atomically (tasks/toy.py:build_atomically)."""
    def build(tmp):
        train, test = make_problems(seed, n_train, n_test)
        model, tokenizer, loss, seconds = warm_started(
            tmp, train, test, "+", seed, steps, lr, batch_size,
            lambda a, b, rng: thinking_response(a, b, rng, noise, order=rng if shuffle else None))
        p_test = correct_trace_probability(model, tokenizer, test, shuffle)
        p_train = correct_trace_probability(model, tokenizer, train, shuffle)
        tokens = np.mean([sum(len(tokenizer.encode(t)) for t, _ in thinking_response(a, b)) + 1 for a, b in test])
        return {"recipe": RECIPE, "version": THINK_VERSION, "seed": seed, "n_train": n_train, "n_test": n_test,
                "steps": steps, "lr": lr, "noise": noise, "shuffle": shuffle, "final_sft_loss": loss,
                "warm_start_seconds": round(seconds, 1), "response_tokens_mean": float(tokens),
                "test_accuracy_t1": float(p_test.mean()),  # of the correct trace: a lower bound
                "train_correct_trace_histogram": np.histogram(p_train, bins=np.linspace(0, 1, 11))[0].tolist()}
    return build_atomically(toy_dir, build)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toy_dir", default="tasks/built/toy_think", help="where to build the toy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data split and the warm start")
    parser.add_argument("--steps", type=int, default=600, help="warm-start optimiser steps")
    parser.add_argument("--noise", type=float, default=0.3, help="rate of wrong partial sums in carrying columns")
    parser.add_argument("--shuffle", action="store_true", help="each line's terms in a random order")
    args = parser.parse_args()
    print(json.dumps(build_thinking_toy(args.toy_dir, seed=args.seed, steps=args.steps, noise=args.noise,
                                        shuffle=args.shuffle), indent=1))
