"""The README's results hold to their data: every number with a decimal point that a paragraph of "Results on the
toy" quotes is a value of the sweep the paragraph links (experiments/NAME/: its primary.json and summary.json, or
recomputed from its records.tar.gz), at the precision printed. A quoted number cannot drift from its data: a test
changes each quoted digit in a copy of the README and sees the check report it.

    .venv/bin/python -m pytest tests/test_readme_numbers.py -q
"""
import functools
import json
import os
import re

import numpy as np

from experiments.analysis import area_mean, contrasts, exact_curve, mean_ci, sweep_runs
from experiments.regime import measure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBER = r"[-+]?\d+\.\d+"
# How a result paragraph quotes a number, tried in this order (each match is taken out of the text before the next).
QUOTES = [
    ("estimates", rf"(?<![\w.])({NUMBER})%?(?: points)? \[({NUMBER}), ({NUMBER})\]"),  # "52.6% [49.9, 55.2]"
    ("pairs", rf"\[({NUMBER}), ({NUMBER})\]"),  # a bare interval, "[46.2, 59.0]"
    ("ranges", r"(?<![\w.])(\d+\.\d+)-(\d+\.\d+)"),  # "13.4-13.7%": a quantity's least and largest over arms or seeds
    ("lists", r"(?<![\w.])(\d+\.\d+(?:, \d+\.\d+){2,})"),  # "55.6, 50.7, 53.8": a quantity seed by seed
    ("means", rf"(?<![\w.])({NUMBER})"),  # any other: an estimate's mean without its interval, sign dropped
]
# Quotes the generic rule cannot tell from a neighbouring value of their sweep (changing their last digit gives
# another value it holds: rho_none's detectable 0.28, the probe's own between-prompt share 0.54-0.62), each pinned
# to its value: {pattern with the number's group: (sweep, path in sources(); "*" for a range over one place)}.
PINNED = {
    r"detectable (\d+\.\d+)(?=\))": ("mixed", ("primary", "paired", "uniform", "primary", "detectable")),
    r"between-prompt share (\d+\.\d+-\d+\.\d+)(?=;)": ("mixed", ("regime", "spo", "runs", "*", "between_free")),
    r"lags the policy by (\d+\.\d+)(?= against)": ("forgetting", ("regime", "rho_none", "over_seeds", "bias_mean",
                                                                   "mean")),
    r"against SPO's (\d+\.\d+)(?=,)": ("forgetting", ("regime", "spo", "over_seeds", "bias_mean", "mean")),
}
# Numbers a result paragraph may state that are not results, each with why.
EXCEPTIONS = {
    "temperature 1.0": "the sampling temperature, a setting",
    "about 0.5 points either way": "a bound read off two intervals: test_the_forgetting_bound_covers_its_intervals",
}


# ------------------------------------------------------------------------------------------------ the README's side
def result_paragraphs(readme):
    """[(folders, text)]: the paragraphs of "## Results on the toy", each with the experiments/NAME folders it
    links; a paragraph that links none (a table, a paragraph on the table above it) belongs to the one before."""
    section = readme.split("## Results on the toy", 1)[1].split("\n## ", 1)[0]
    out, folders = [], ()
    for block in re.split(r"\n\s*\n", section):
        folders = tuple(sorted(set(re.findall(r"experiments/(\w+)/", block)))) or folders
        text = re.sub(r"\]\([^)]*\)", "]", block)  # link targets: paths and anchors, not quotes
        text = re.sub(r"`[^`]*`", "", text).replace("*", "")  # flags and code; bold marks
        out.append((folders, " ".join(text.split())))
    return out


def canon(quoted):
    """A printed number as compared: no '+', and -0.0 is 0.0."""
    quoted = quoted.lstrip("+")
    return quoted[1:] if re.fullmatch(r"-0\.0*", quoted) else quoted


# ------------------------------------------------------------------------------------------------ the data's side
def flatten(node, path=()):
    """[(path, number)] of every finite number in a JSON tree; a path is the keys and list indices down to it."""
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in flatten(v, path + (str(k),))]
    if isinstance(node, list):
        return [leaf for i, v in enumerate(node) for leaf in flatten(v, path + (i,))]
    ok = isinstance(node, (int, float)) and not isinstance(node, bool) and np.isfinite(node)
    return [(path, float(node))] if ok else []


def paired(diffs):
    mean, low, high, _ = mean_ci(diffs)
    return {"mean": mean, "ci95": [low, high], "sd": float(np.std(diffs, ddof=1))}


def accountings(runs, budget):
    """variant - spo at the accountings docs/experiments.md ("Against GRPO: four accountings") gives beside the
    primary: over training samples (the primary's --training_samples); each run's accuracy where the budget of
    total generations is spent, linear between evaluations (offline counted); the average with a seed's offline
    samples shared by the four arms that read them, 1,024 each (exact_curve's pool of 128 at n0 = 8)."""
    key, spo = "eval/accuracy", runs["spo"]

    def at_end(run):
        return float(np.interp(budget, *zip(*exact_curve(run, run["config"]["train_prompts"], key))))

    def area(run, pool):
        return area_mean(exact_curve(run, pool, key), budget)
    ways = {"training_samples": lambda run: area(run, 0), "at_budget_end": at_end,
            "offline_shared": lambda run: area(run, 1024 / run["config"]["n0"])}
    return {variant: {name: paired([way(seeds[s]) - way(spo[s]) for s in sorted(spo)]) for name, way in ways.items()}
            for variant, seeds in runs.items() if variant != "spo" and set(seeds) >= set(spo)}  # complete arms


def regime(runs, budget):
    """experiments/regime.py:measure of every run (the tracker's lag, the regime's targets) and each quantity's mean
    and interval over a variant's seeds."""
    out = {}
    for variant, seeds in runs.items():
        measured = [{k: v for k, v in measure(run).items() if isinstance(v, (int, float))} for run in seeds.values()]
        out[variant] = {"runs": measured, "over_seeds": {}}
        for k in measured[0]:
            mean, low, high, _ = mean_ci([r[k] for r in measured])
            out[variant]["over_seeds"][k] = {"mean": mean, "ci95": [low, high]}
    return out


# The addendum's planned family, as experiments/mixed/PLAN.md ("Addendum") names it and primary.md prints it.
ADDENDUM = ("no_offline-grpo:total", "spo-no_offline:total", "spo_g8-grpo:training", "spo-spo_g8:training")


def addendum(runs, budget):
    """experiments/analysis.py:contrasts of the addendum's family over the mixed sweep's records (its own budget per
    accounting, as primary.md's command)."""
    return contrasts(os.path.join(ROOT, "experiments", "mixed"), ADDENDUM, "eval/accuracy")["rows"]


# What the README quotes that a sweep's JSON files do not hold, recomputed from its records.
RECOMPUTED = {"mixed": (accountings, regime, addendum), "forgetting": (regime,)}


@functools.lru_cache(maxsize=None)
def sources(folder):
    """flatten() of {"primary": primary.json, "summary": summary.json, and what RECOMPUTED adds from the records
    (read once), by its function's name}; None for a folder with neither file."""
    out = os.path.join(ROOT, "experiments", folder)
    trees = {f[:-5]: json.load(open(os.path.join(out, f))) for f in ("primary.json", "summary.json")
             if os.path.exists(os.path.join(out, f))}
    if "primary" in trees and folder in RECOMPUTED:
        runs = sweep_runs(out)
        trees.update({compute.__name__: compute(runs, trees["primary"]["budget"]) for compute in RECOMPUTED[folder]})
    return flatten(trees) if trees else None


# ------------------------------------------------------------------------------------------------ the check
def shown(digits, *values):
    return tuple(canon(f"{v:.{digits}f}") for v in values)


@functools.lru_cache(maxsize=None)
def printed(folder, digits):
    """{kind of QUOTES: set}: what a sweep's data lets a paragraph quote, printed with `digits` decimals, at scale 1
    (p, shares) and 100 (percent, points). An estimate is an object's mean (`mean`, `..._mean`) with its interval
    (`ci95`, `..._ci95`), quoted in either sign ("GRPO leads by" quotes -(spo - grpo)); a pair any two-number list; a
    group the values whose paths differ in one place only (a quantity over seeds, arms or steps): a range is a
    group's least and largest, a list its values in order. None for a folder without data."""
    leaves = sources(folder)
    if leaves is None:
        return None
    objects, groups = {}, {}
    for path, v in leaves:
        objects.setdefault(path[:-1], {})[path[-1]] = v
        for i in range(len(path)):
            groups.setdefault(path[:i] + ("*",) + path[i + 1:], []).append(v)
    pairs = {path: (o[0], o[1]) for path, o in objects.items() if set(o) == {0, 1}}
    estimates = [(m, *pair) for path, pair in pairs.items() if str(path[-1]).endswith("ci95")
                 for k, m in objects.get(path[:-1], {}).items() if str(k).endswith("mean")]
    out = {kind: set() for kind, _ in QUOTES}
    for s in (1, 100):
        out["estimates"] |= {q for m, lo, hi in estimates
                             for q in (shown(digits, s * m, s * lo, s * hi), shown(digits, -s * m, -s * hi, -s * lo))}
        out["pairs"] |= {q for lo, hi in pairs.values()
                         for q in (shown(digits, s * lo, s * hi), shown(digits, -s * hi, -s * lo))}
        out["ranges"] |= {shown(digits, s * min(g), s * max(g)) for g in groups.values() if len(g) > 1}
        out["lists"] |= {shown(digits, *(s * v for v in g)) for g in groups.values() if len(g) > 2}
        out["means"] |= {shown(digits, s * abs(m)) for m, _, _ in estimates}
    return out


def pinned(folder, path):
    """The value PINNED names (a pattern with "*": its least and largest), in both scales, as numbers."""
    values = [v for p, v in sources(folder) if len(p) == len(path) and all(a in ("*", b) for a, b in zip(path, p))]
    return [(s * min(values), s * max(values)) if "*" in path else (s * abs(values[0]),) for s in (1, 100)]


def decimals(quoted):
    """The digits after the point the quoted numbers share; None where they differ (then nothing matches)."""
    digits = {len(q.split(".")[1]) for q in re.findall(r"\d+\.\d+", " ".join(quoted))}
    return digits.pop() if len(digits) == 1 else None


def unmatched(readme):
    """([(folders, quote)], how many numbers were read): every quote of the README's result paragraphs that no value
    of the sweeps the paragraph links gives at the printed precision, every PINNED quote not at its value or not
    found, and every number in a paragraph that links no sweep with data."""
    found, read = [], 0
    for pattern, (folder, path) in PINNED.items():
        m = re.search(pattern, " ".join(text for _, text in result_paragraphs(readme)))
        quoted = tuple(m.group(1).split("-")) if m else ()
        if not m or quoted not in [shown(decimals(quoted), *v) for v in pinned(folder, path)]:
            found.append(((folder,), m.group(0) if m else pattern))
    for folders, text in result_paragraphs(readme):
        for phrase in list(EXCEPTIONS) + list(PINNED):
            text = re.sub(phrase if phrase in PINNED else re.escape(phrase), " ", text)
        for kind, pattern in QUOTES:
            for m in re.finditer(pattern, text):
                quoted = tuple(canon(q) for q in m.groups())
                quoted = tuple(quoted[0].split(", ")) if kind == "lists" else quoted
                quoted = (quoted[0].lstrip("-"),) if kind == "means" else quoted
                digits = decimals(quoted)
                read += len(quoted)
                known = [printed(f, digits) for f in folders if digits is not None and printed(f, digits)]
                if not any(quoted in k[kind] for k in known):
                    found.append((folders, m.group(0)))
            text = re.sub(pattern, " ", text)
    return found, read


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_every_number_the_results_quote_is_its_sweeps():
    found, read = unmatched(readme())
    assert read >= 100, f"only {read} quoted numbers read: has the results section moved?"
    assert found == [], f"quoted numbers not in their sweep's data: {found}"


def test_every_result_paragraph_links_a_sweep_with_data():
    folders = {f for names, _ in result_paragraphs(readme()) for f in names}
    assert {"toy_default", "toy", "paper_regime", "calibrated", "forgetting", "mixed"} <= folders
    assert [f for f in folders if sources(f) is None] == []


def bump(text, end):
    """text with the digit before `end` changed (9 -> 8, others up by one)."""
    digit = text[end - 1]
    return text[:end - 1] + ("8" if digit == "9" else str(int(digit) + 1)) + text[end:]


def test_the_check_sees_any_quoted_digit_changed():
    """A copy of the README with the last digit of one quoted number changed, for every number in the results but
    the EXCEPTIONS: each copy is reported."""
    text = readme()
    start = text.index("## Results on the toy")
    end = text.index("\n## ", start + 1)
    skip = [m.span() for phrase in EXCEPTIONS for m in re.finditer(re.escape(phrase), text)]
    ends = [start + m.end() for m in re.finditer(r"(?<![\w.])\d+\.\d+", text[start:end])]
    ends = [e for e in ends if not any(a < e <= b for a, b in skip)]
    assert len(ends) >= 100
    before = len(unmatched(text)[0])
    missed = [text[e - 40:e] for e in ends if len(unmatched(bump(text, e))[0]) == before]
    assert missed == [], missed


def test_the_forgetting_bound_covers_its_intervals():
    """"No accuracy effect of forgetting beyond about 0.5 points either way": rho_none - spo's intervals, over the
    budget and at step 300, lie within 0.5 points of zero."""
    with open(os.path.join(ROOT, "experiments", "mixed", "primary.json")) as f:
        rho_none = json.load(f)["paired"]["rho_none"]
    assert "about 0.5 points either way" in readme()
    assert max(abs(x) for metric in ("primary", "final") for x in rho_none[metric]["ci95"]) <= 0.005
