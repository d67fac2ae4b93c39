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

The mixed toy (`--mixed`, shipped in tasks/built/toy_mixed, `spo.py --preset mixed`) is the paper's regime of
prompts, some mastered, some unsolved: operands of 1 to 5 digits in strata by columns (MIXED_SHARES, the same in
the train and test sets), the first two columns written nearly without error and a carry from the third on wrong
half the time, and five-column sums never in the warm start (unsolved at first):

    python -m tasks.thinking --mixed --toy_dir tasks/built/toy_mixed
"""
import argparse
import json
import os

import numpy as np

from tasks.toy import build_atomically, success_probability, warm_started

THINK_VERSION = 1  # bump when the recipe below changes, and rebuild the shipped folder
RECIPE = "thinking"  # toy.json's "recipe" for this module's toys


def is_thinking(toy_dir):
    """Whether toy_dir holds a built thinking toy (toy.json's recipe)."""
    marker = os.path.join(toy_dir or "", "toy.json")
    return os.path.exists(marker) and json.load(open(marker)).get("recipe") == RECIPE


def longest_trace(digits=3):
    """Tokens of the longest trace of operands of `digits` digits (one a character, plus the end of turn)."""
    return sum(len(piece) for piece, _ in thinking_response(10 ** digits - 1, 10 ** digits - 1)) + 1


def check_budget(toy_dir, max_response_len):
    """One line (exit 2) where a thinking toy's budget cannot hold a correct trace: every response cut, reward 0."""
    if is_thinking(toy_dir):
        longest = longest_trace(json.load(open(os.path.join(toy_dir, "toy.json"))).get("max_digits", 3))
        if max_response_len < longest:
            from machinery.errors import fail
            fail(f"--max_response_len {max_response_len}: the thinking toy {toy_dir} needs at least {longest} "
                 f"tokens for a worked sum (docs/experiments.md's runs use 64)", once=True)


def make_problems(seed, n_train, n_test):
    """Disjoint train / test sets of (a, b), both of three digits."""
    pairs = np.random.default_rng(seed).choice(900 * 900, n_train + n_test, replace=False)
    pairs = [(100 + int(p) // 900, 100 + int(p) % 900) for p in pairs]
    return pairs[:n_train], pairs[n_train:]


def thinking_response(a, b, rng=None, noise=0.0, order=None, score_order=True, plain_noise=None, careful=0):
    """The worked sum as (text, in the loss) pieces, one line per column of the longer operand (the shorter one's
    missing digits written 0); with rng, a column's sum is written off by 1 or 2 with probability noise
    (plain_noise, by default noise / 3, where the column does not carry, or is one of the first `careful` columns)
    and the lines after it, and the box, follow.
    order (a numpy Generator): each line's three terms in a random order, a choice that never decides the reward;
    score_order=False leaves those choices out of the loss (to score the sums given the order)."""
    pieces, carry, answer, width = [], 0, 0, max(len(str(a)), len(str(b)))
    plain_noise = noise / 3 if plain_noise is None else plain_noise
    for k, (x, y) in enumerate(zip(reversed(str(a).zfill(width)), reversed(str(b).zfill(width)))):
        s = int(x) + int(y) + carry
        if rng is not None and rng.random() < (noise if s >= 10 and k >= careful else plain_noise):
            s = max(0, s + int(rng.choice([-2, -1, 1, 2])))
        terms = [x, y, str(carry)]
        if order is not None:
            order.shuffle(terms)
        pieces += [(f"{terms[0]}+{terms[1]}+", score_order), (f"{terms[2]}={s}\n", True)]
        carry, answer = s // 10, answer + (s % 10) * 10 ** k
    return pieces + [(f"\\boxed{{{answer + carry * 10 ** (len(pieces) // 2)}}}", True)]


LONGEST_TRACE = longest_trace(3)  # the three-digit toy's: four-digit box, two-digit sums


def correct_trace_probability(model, tokenizer, problems, shuffle=False):
    """Per problem, the exact probability at temperature 1.0 of the correct worked sum (shuffle: of its sums and
    box given one random order of the terms): a lower bound of the success probability (a trace with errors that
    cancel also ends in the right box)."""
    order = np.random.default_rng(1) if shuffle else None
    return success_probability(model, tokenizer, problems,
                               lambda a, b: thinking_response(a, b, order=order, score_order=False))


# The mixed toy's strata by columns (the longer operand's digits): a share of the train and test sets each; sums of
# more than MIXED_SEEN columns never appear in the warm start, so they start unsolved.
MIXED_SHARES, MIXED_SEEN = {1: 0.02, 2: 0.30, 3: 0.25, 4: 0.25, 5: 0.18}, 4


def columns(a, b):
    return max(len(str(a)), len(str(b)))


def stratum(a, b):
    """The mixed toy's data_source: its stratum, by which spo.py's evaluation also logs held-out accuracy."""
    return f"toy_add_{columns(a, b)}col"


def make_mixed_problems(seed, n_train, n_test, shares=MIXED_SHARES):
    """Disjoint train / test sets of (a, b) stratified by columns L: in a stratum, one operand has L digits and the
    other 1 to L (either first), each set shuffled."""
    rng, train, test = np.random.default_rng(seed), [], []
    low = lambda digits: 0 if digits == 1 else 10 ** (digits - 1)  # noqa: E731
    for width, share in shares.items():
        n, drawn = round(n_train * share), {}
        while len(drawn) < n + round(n_test * share):
            other = int(rng.integers(1, width + 1))
            pair = int(rng.integers(low(width), 10 ** width)), int(rng.integers(low(other), 10 ** other))
            drawn[pair[::-1] if rng.random() < 0.5 else pair] = None
        train, test = train + list(drawn)[:n], test + list(drawn)[n:]
    return [train[i] for i in rng.permutation(len(train))], [test[i] for i in rng.permutation(len(test))]


def difficulty_profile(p, problems, samples=8):
    """What decides whether SPO's parts can act, from per-prompt success p: per stratum of columns its mean, the
    shares mastered (p >= 0.9) and unsolved (p <= 0.1); the between-prompt share of reward variance Var(p) / (m (1 -
    m)); the chance a group of `samples` all agree, E[p^G + (1 - p)^G]."""
    p, width = np.asarray(p, np.float64), np.array([columns(a, b) for a, b in problems])
    ends = lambda q: {"mastered": float((q >= 0.9).mean()), "unsolved": float((q <= 0.1).mean())}  # noqa: E731
    strata = {int(w): {"n": int((width == w).sum()), "mean": float(p[width == w].mean()), **ends(p[width == w])}
              for w in np.unique(width)}
    m = p.mean()
    return {"mean": float(m), **ends(p), "between_share": float(p.var() / (m * (1 - m))),
            "all_agree": float(np.mean(p ** samples + (1 - p) ** samples)), "strata": strata}


def build_mixed_toy(toy_dir, seed=0, n_train=3000, n_test=500, steps=1200, lr=3e-3, batch_size=64, noise=0.5,
                    plain_noise=0.005, careful=2):
    """The mixed-difficulty thinking toy (shuffled terms): 1 to 5 columns, warm-started on up to MIXED_SEEN, its
    partial sums wrong mostly where a column from the third on carries: short sums mastered, long ones with
    several carries hard, and the unseen five-column ones unsolved."""
    def build(tmp):
        train, test = make_mixed_problems(seed, n_train, n_test)
        model, tokenizer, loss, seconds = warm_started(
            tmp, train, test, "+", seed, steps, lr, batch_size,
            lambda a, b, rng: thinking_response(a, b, rng, noise, order=rng, plain_noise=plain_noise, careful=careful),
            warm=[pair for pair in train if columns(*pair) <= MIXED_SEEN], source=stratum)
        p_train, p_test = (correct_trace_probability(model, tokenizer, split, shuffle=True) for split in (train, test))
        tokens = np.mean([sum(len(tokenizer.encode(t)) for t, _ in thinking_response(a, b)) + 1 for a, b in test])
        return {"recipe": RECIPE, "version": THINK_VERSION, "mixed": True, "max_digits": max(MIXED_SHARES),
                "seen_columns": MIXED_SEEN, "shares": MIXED_SHARES, "seed": seed, "n_train": n_train,
                "n_test": n_test, "steps": steps, "lr": lr, "noise": noise, "plain_noise": plain_noise,
                "careful": careful, "shuffle": True, "final_sft_loss": loss, "warm_start_seconds": round(seconds, 1),
                "response_tokens_mean": float(tokens), "test_accuracy_t1": float(p_test.mean()),
                # of the correct trace (a lower bound of success): the difficulty the screen starts from
                "train_profile": difficulty_profile(p_train, train), "test_profile": difficulty_profile(p_test, test)}
    return build_atomically(toy_dir, build)


def build_thinking_toy(toy_dir, seed=0, n_train=2000, n_test=500, steps=600, lr=3e-3, batch_size=64, noise=0.3,
                       shuffle=False):
    """Build the thinking toy into toy_dir atomically (tasks/toy.py:build_atomically)."""
    def build(tmp):
        train, test = make_problems(seed, n_train, n_test)
        model, tokenizer, loss, seconds = warm_started(
            tmp, train, test, "+", seed, steps, lr, batch_size,
            lambda a, b, rng: thinking_response(a, b, rng, noise, order=rng if shuffle else None))
        p_train, p_test = (correct_trace_probability(model, tokenizer, split, shuffle) for split in (train, test))
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
    parser.add_argument("--steps", type=int, default=None, help="warm-start optimiser steps (default 600)")
    parser.add_argument("--noise", type=float, default=None, help="rate of wrong partial sums in carrying columns "
                        "(default 0.3)")
    parser.add_argument("--shuffle", action="store_true", help="each line's terms in a random order")
    parser.add_argument("--mixed", action="store_true", help="the mixed-difficulty toy (1 to 5 columns, shuffled; "
                        "its own defaults for --steps and --noise unless given)")
    args = parser.parse_args()
    given = {k: v for k, v in (("steps", args.steps), ("noise", args.noise)) if v is not None}  # 0 is a value
    if args.mixed:
        info = build_mixed_toy(args.toy_dir, seed=args.seed, **given)
    else:
        info = build_thinking_toy(args.toy_dir, seed=args.seed, shuffle=args.shuffle, **given)
    print(json.dumps(info, indent=1))
