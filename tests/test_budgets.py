"""The size budgets: lines per file, columns, code tokens of the reference, the notebook and spo.py, spo.py's flags
(hidden ones too) and --help's groups in the paper's order, positional arguments past five: each seen to fail.

    .venv/bin/python -m pytest tests/test_budgets.py -q
"""
import argparse
import ast
import io
import os
import re
import tokenize

from common import ROOT
from test_layout import tracked_files


# The size budgets (since 2026-12-04), each seen to fail at a lower value. The reference, the notebook and spo.py
# are counted in code tokens (the standard tokenize module, without comments, docstrings, newlines and
# indentation): explaining costs nothing, and packing lines tighter buys nothing.
FILE_LINES, COLUMNS, POSITIONAL_ARGUMENTS = 450, 120, 5
ALL_FLAGS, UNGROUPED_FLAGS = 80, 6  # every flag, hidden ones too (76; 78: the LR schedule's; 80: the KL's); ungrouped
# the library a fork reads; the notebook (bench/, experiments/); spo.py. At 57226b3: 60,934, 23,073 and 4,282;
# the way down is simpler code, to 58,000, 23,000 and 4,000 (raised on 2026-12-07 from 61,935 / 23,740 / 4,290 by
# what the KL penalty, the sweep's plan check, the run-log guard, the torchrun restart refusal and fail()'s
# node layout added; then down to 62,354 when the tracker's and sampler's repeats of the flag checks went; 62,715
# with the SmolLM2 mixed-difficulty task, 2026-12-08; 62,654 and 4,404 with one generate for both engines, the push
# taking the policy and remember() gathering; the notebook 23,940 with `regime targets --minutes` and the share drawn
# a step for a task at another scale than the mixed toy's, and the pool size of a JSONL training set; the reference
# 62,700 with the mixed profile's one-line refusal of a file of another shape)
REFERENCE_TOKENS, NOTEBOOK_TOKENS, SPO_TOKENS = 62700, 23940, 4404
SKIPPED_TOKENS = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                  tokenize.ENCODING, tokenize.ENDMARKER}


def python_lines():
    """{path: its lines} of every tracked Python file, tests included."""
    return {f: open(os.path.join(ROOT, f), encoding="utf-8").read().splitlines()
            for f in tracked_files() if f.endswith(".py")}


def code_tokens(text):
    """Python tokens of a file's code: comments, docstrings (a module's, class's or function's first statement
    when it is a string), newlines and indentation left out."""
    docstrings = {(node.body[0].lineno, node.body[0].col_offset) for node in ast.walk(ast.parse(text))
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
                  and isinstance(node.body[0].value.value, str)}
    return sum(1 for t in tokenize.generate_tokens(io.StringIO(text).readline)
               if t.type not in SKIPPED_TOKENS and not (t.type == tokenize.STRING and t.start in docstrings))


def test_no_python_file_outgrows_its_lines_and_spo_py_its_tokens():
    lines = python_lines()
    assert {f: len(text) for f, text in lines.items() if len(text) > FILE_LINES} == {}
    assert code_tokens("\n".join(lines["spo.py"])) <= SPO_TOKENS


def test_reference_and_notebook_each_within_their_token_budget():
    """The reference (top-level files, machinery/, tasks/) and the notebook (bench/, experiments/), each within its
    own budget, tests aside: what adds code pays it back, and the notebook cannot borrow from the reference."""
    count = {"reference": 0, "notebook": 0}
    for f, text in python_lines().items():
        if not f.startswith(("tests/", ".")) and f != "test_spo.py":
            count["notebook" if f.startswith(("bench/", "experiments/")) else "reference"] += code_tokens(
                "\n".join(text))
    assert count["reference"] <= REFERENCE_TOKENS and 0 < count["notebook"] <= NOTEBOOK_TOKENS, count


def test_the_token_count_skips_what_explains_and_ignores_how_lines_are_packed():
    explained = '''"""A module."""\n\n\ndef f(a, b):\n    """Adds."""\n    return a + b  # the sum\n'''
    assert code_tokens(explained) == code_tokens("def f(a, b):\n    return a + b\n") == 12
    assert code_tokens("x = g(1,\n      2)\n") == code_tokens("x = g(1, 2)\n") == 8
    assert code_tokens("x = 1\ny = 2\n") == 6 and code_tokens("x = 'not a docstring'\n") == 3


def test_no_python_line_is_wider_than_the_budget():
    lines = python_lines()
    wide = [f"{f}:{n}" for f, text in lines.items() for n, line in enumerate(text, 1) if len(line) > COLUMNS]
    assert "spo.py" in lines and wide == []


def public_flags(parser):
    return [a.option_strings[0] for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
            and a.dest != "help"]


def spo_parser(monkeypatch):
    """The parser spo.parse_args builds."""
    import spo
    parsers = []
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                        lambda self, argv=None, *a, original=argparse.ArgumentParser.parse_args:
                        parsers.append(self) or original(self, argv))
    spo.parse_args([])
    return parsers[0]


def test_spo_py_flags_within_budget_hidden_ones_too_all_documented(monkeypatch):
    """Every flag counts, hidden or not: hiding one does not make it cheaper to keep. --help lists what a user
    chooses; what only a preset, a benchmark, a sweep or a test sets is hidden (docs/flags.md lists both)."""
    parser = spo_parser(monkeypatch)
    flags = public_flags(parser)
    hidden = {a.option_strings[0] for a in parser._actions if a.help == argparse.SUPPRESS}
    assert "--algo" in flags and len(flags) + len(hidden) <= ALL_FLAGS, (len(flags), len(hidden))
    with open(os.path.join(ROOT, "docs", "flags.md")) as f:
        documented = set(re.findall(r"`(--\w+)`", f.read()))
    assert flags and set(flags) | hidden <= documented | {"--max_tokens"}, sorted(set(flags) | hidden - documented)


# --help's groups in the paper's order: data, Algorithm 1's sampling (the tool loop beside it), Eq. 5-9, Eq. 10, Eq. 11,
# the optimiser, evaluation, the run, the system
HELP_GROUPS = ["data and model", "Algorithm 1: sampling and rollout (steps 1-3)", "tools (tool-integrated reasoning)",
               "advantage and tracker (Eq. 5-9)", "policy loss (Eq. 10)", "sampler (Eq. 11)", "training and optimiser",
               "evaluation and probe", "run directory and logging", "system: memory, micro-batches, engine"]


def help_groups(parser):
    """[(title, its public flags)] in --help's order; argparse's own untitled sections as None."""
    return [(g.title if g.title not in ("positional arguments", "options") else None,
             [a.option_strings[0] for a in g._group_actions if a.option_strings and a.help != argparse.SUPPRESS
              and a.dest != "help"]) for g in parser._action_groups]


def test_spo_py_help_groups_every_flag_under_the_papers_headings_in_order(monkeypatch):
    groups = help_groups(spo_parser(monkeypatch))
    assert [title for title, flags in groups if title and flags] == HELP_GROUPS
    ungrouped = [flag for title, flags in groups if title is None for flag in flags]
    assert len(ungrouped) <= UNGROUPED_FLAGS, ungrouped


def test_docs_flags_table_is_grouped_and_ordered_as_help(monkeypatch):
    """docs/flags.md's table: each row under its first flag's --help group, titled as --help titles it, the rows in
    --help's order (a row may name several flags: `--train`, `--test`)."""
    order = [(title or "options", flag) for title, flags in help_groups(spo_parser(monkeypatch)) for flag in flags]
    group_of, position = {flag: title for title, flag in order}, {flag: k for k, (_, flag) in enumerate(order)}
    with open(os.path.join(ROOT, "docs", "flags.md")) as f:
        text = f.read()
    rows, title = [], None
    for line in text[text.index("| group | flag |"): text.index("### Not in `--help`")].splitlines()[2:]:
        if line.startswith("| "):
            group, flags = line.split(" | ")[:2]  # ("| title" or "|", its flags)
            title = group[1:].strip() or title
            rows.append((title, re.search(r"`(--\w+)`", flags).group(1)))
    assert [title for title, _ in rows] == [group_of[flag] for _, flag in rows], rows
    assert [position[flag] for _, flag in rows] == sorted(position[flag] for _, flag in rows)


def call_positional_arguments(path):
    """[(line, callee, positional arguments)] of every call in a file."""
    return [(node.lineno, ast.unparse(node.func), len(node.args)) for node in ast.walk(ast.parse(open(path).read()))
            if isinstance(node, ast.Call)]


def test_spo_py_calls_name_their_arguments_past_five():
    """The widest calls read by name: no call in spo.py passes more than five arguments by position."""
    calls = call_positional_arguments(os.path.join(ROOT, "spo.py"))
    wide = [call for call in calls if call[2] > POSITIONAL_ARGUMENTS]
    assert calls and wide == [], wide


def test_the_budget_checks_see_a_wide_call_a_stray_flag_and_a_group_out_of_order(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("f(1, 2, 3, 4, 5, g(6, 7, 8, 9, 10, 11))\n")
    assert [c[1:] for c in call_positional_arguments(str(path)) if c[2] > POSITIONAL_ARGUMENTS] == [("f", 6), ("g", 6)]
    p = argparse.ArgumentParser()
    p.add_argument("--stray", help="ungrouped")
    p.add_argument_group("sampler (Eq. 11)").add_argument("--a")
    p.add_argument_group("data and model").add_argument("--b")
    assert help_groups(p)[1] == (None, ["--stray"]) and [t for t, _ in help_groups(p)[2:]] != HELP_GROUPS[:2]


# The files a reader opens to follow one step: the project files whose functions steps 1-7 of spo.py's loop call
# directly (the bookkeeping below the loop's marked line is free). cleanrl's ppo.py: 1; the target here: 7.
LOOP_FILES = 8
LOOP_END = "# ---- Algorithm 1 ends here"
RUN_FILES = {"sampler": "sampler.py", "tracker": "tracker.py", "engine": "rollout.py", "resampling": "variants.py"}


def loop_calls(source):
    """{project file: names called} of the calls in steps 1-7 of source's loop: main's `for step` body above
    LOOP_END, and the functions main defines (sample: steps 1-3). A name resolves through spo.py's imports and
    definitions; run.X.method and resampling through RUN_FILES (what start() builds: rollout.Engine's interface
    for the engine); numpy, torch and builtins are not project files."""
    tree = ast.parse(source)
    where = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            where.update({a.asname or a.name: node.module for a in node.names})
        elif isinstance(node, ast.Import):
            where.update({a.asname or a.name: a.name for a in node.names})
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            where[node.name] = "spo"
    end = next(n for n, line in enumerate(source.splitlines(), 1) if line.strip().startswith(LOOP_END))
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    loop = next(node for node in ast.walk(main) if isinstance(node, ast.For))
    bodies = [s for s in loop.body if s.lineno < end] + [f for f in main.body if isinstance(f, ast.FunctionDef)]
    found = {}
    for call in (c for body in bodies for c in ast.walk(body) if isinstance(c, ast.Call)):
        f, chain = call.func, []
        while isinstance(f, (ast.Attribute, ast.Subscript)):  # a.b.c(...), and TABLE[key](...)
            chain += [f.attr] if isinstance(f, ast.Attribute) else []
            f = f.value
        if not isinstance(f, ast.Name):
            continue
        chain.append(f.id)
        head = chain[-1]
        if head == "run" and len(chain) > 2:
            module = RUN_FILES.get(chain[-2], "").removesuffix(".py") or None
        elif head == "resampling":  # run.resampling
            module = "variants"
        else:
            module = where.get(head)
            module = f"machinery.{head}" if module == "machinery" else module  # from machinery import trainer
        if module and module.split(".")[0] in ("spo", "sampler", "rollout", "reward", "tracker", "variants",
                                                "machinery", "probes", "offline_values", "hf_engine", "tasks"):
            found.setdefault(module.replace(".", "/") + ".py", set()).add(".".join(reversed(chain)))
    return found


# Data flows forward: a step of the loop may read what an earlier step made but never write into it (it returns its
# own values instead). Steps are marked by the loop's "# N." comments (what precedes "# 4." is steps 1-3).
MUTATORS = {"update", "append", "extend", "pop", "clear", "setdefault", "insert", "remove", "popitem", "sort",
            "fill_", "copy_", "zero_", "add_", "mul_"}


def backward_writes(source):
    """[(line, name, step it was bound in, step that writes it)] of the writes in main's loop, above LOOP_END, into
    a name an earlier step of the same iteration bound: item or attribute assignment, augmented assignment, or a
    mutating method call (MUTATORS). Names bound before the loop (the run's state) are free."""
    lines = source.splitlines()
    end = next(n for n, line in enumerate(lines, 1) if line.strip().startswith(LOOP_END))
    marks = [(n, int(m.group(1))) for n, line in enumerate(lines, 1)
             if (m := re.match(r"\s*# ([4-7])\. ", line))]
    step_of = lambda line: max([k for n, k in marks if n < line], default=3)  # noqa: E731
    main = next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == "main")
    loop = next(node for node in ast.walk(main) if isinstance(node, ast.For))
    bound, found = {}, []

    def root(node):
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    for statement in (s for s in loop.body if s.lineno < end):
        for node in ast.walk(statement):
            step = step_of(node.lineno) if hasattr(node, "lineno") else None
            written = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for t in ast.walk(target):
                        if isinstance(t, (ast.Attribute, ast.Subscript)) or isinstance(node, ast.AugAssign):
                            written.append(root(t))
                        elif isinstance(t, ast.Name):
                            bound.setdefault(t.id, step)
            elif isinstance(node, (ast.For, ast.comprehension)) or isinstance(node, ast.withitem):
                for t in ast.walk(node.target if not isinstance(node, ast.withitem) else
                                  (node.optional_vars or ast.Tuple([], ast.Store()))):
                    if isinstance(t, ast.Name):
                        bound.setdefault(t.id, step or step_of(t.lineno))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in MUTATORS):
                written.append(root(node.func.value))
            found += [(node.lineno, name, bound[name], step) for name in written
                      if name in bound and bound[name] < step]
    return found


def test_no_step_of_the_loop_writes_into_an_earlier_steps_values():
    with open(os.path.join(ROOT, "spo.py")) as f:
        assert backward_writes(f.read()) == []


def test_the_forward_check_sees_a_step_writing_back():
    source = ("def main():\n    for step in range(3):\n        rollouts = sample()\n        # 4. old\n"
              "        old = score(rollouts)\n        # 6. update\n        stats = update(old)\n"
              "        old['batch'] = stats['old']\n        rollouts.append(1)\n        # ---- Algorithm 1 ends here\n"
              "        old.clear()\n")
    assert [(name, bound, step) for _, name, bound, step in backward_writes(source)] == [("old", 4, 6),
                                                                                         ("rollouts", 3, 6)]


def test_one_step_of_the_loop_reads_in_few_files():
    with open(os.path.join(ROOT, "spo.py")) as f:
        found = loop_calls(f.read())
    assert {"spo.py", "sampler.py", "tracker.py", "machinery/trainer.py"} <= set(found), found
    assert len(found) <= LOOP_FILES, {f: sorted(names) for f, names in found.items()}


def test_the_loop_file_count_sees_a_call_into_another_file():
    source = ("from machinery import trainer, metrics\nimport numpy as np\ndef main():\n    def sample():\n"
              "        return run.sampler.draw(4)\n    for step in range(3):\n        trainer.update(np.zeros(2))\n"
              "        run.engine.sleep()\n        # ---- Algorithm 1 ends here\n        metrics.log(step)\n")
    assert loop_calls(source) == {"machinery/trainer.py": {"trainer.update"}, "sampler.py": {"run.sampler.draw"},
                                  "rollout.py": {"run.engine.sleep"}}
