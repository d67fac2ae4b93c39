"""The house a reader walks: the top level holds the design card's files, each folder one kind of thing, imports
go one way (no cycle; a lower layer never imports a higher one), and the README's map of the paper's equations
(and every `file.py:name` the docs mention) names code that exists.

    .venv/bin/python -m pytest tests/test_layout.py -q
"""
import ast
import os
import re
import subprocess

import pytest

from common import ROOT

CARD = {"spo.py", "tracker.py", "sampler.py", "rollout.py", "sandbox.py", "offline_values.py", "eval.py",
        "test_spo.py", "requirements.txt", "README.md"}
# the verifier, the ablation family and the engine where vLLM cannot run: concepts a student reads (and runs); what
# the programs share (the evaluations between steps). Each says why it is top-level in docs/design.md.
BESIDE = {"reward.py", "variants.py", "hf_engine.py", "probes.py"}
FOLDERS = {"machinery", "tasks", "bench", "experiments", "tests", "docs"}
# Layers, lowest first: a module may import its own layer or a lower one. Within a layer the graph must still be
# acyclic. The top-level parts of the algorithm sit above the machinery; the tasks are built through them; the
# programs run everything; benchmarks, experiments and tests sit on top.
LAYERS = [("machinery",), ("tracker", "sampler", "reward", "sandbox", "rollout", "hf_engine", "variants"), ("tasks",),
          ("probes", "offline_values"), ("eval", "spo"), ("bench", "experiments")]
PROGRAMS = ("spo", "eval", "offline_values")
RUNS = ("main", "parse_args")  # a program's own: what nothing imports (offline_values.py is also Algorithm 2's library)


def tracked_files():
    """The repository's files (git's list where this is a checkout, else what lies on disk)."""
    proc = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode == 0 and proc.stdout.strip():
        return [f for f in proc.stdout.splitlines() if os.path.exists(os.path.join(ROOT, f))]
    return [os.path.relpath(os.path.join(d, f), ROOT) for d, dirs, files in os.walk(ROOT)
            for f in files if not any(part.startswith(".") for part in os.path.relpath(d, ROOT).split(os.sep)[1:])]


def modules():
    """{dotted module name: path} of the project's Python files outside tests/."""
    out = {}
    for f in tracked_files():
        if f.endswith(".py") and not f.startswith(("tests/", ".")) and f != "test_spo.py":
            out[f[:-3].replace("/", ".").removesuffix(".__init__")] = os.path.join(ROOT, f)
    return out


def imports(path, known):
    """The project modules a file imports anywhere in it (function-level imports count: they are edges too)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found.update(n for n in names if n in known)
    return found


def layer(module):
    top = module.split(".")[0]
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_every_top_level_file_beside_the_card_says_why_in_the_design_notes():
    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        lines = f.read().splitlines()
    missing = [name for name in sorted(BESIDE) if not any(line.lstrip().startswith(f"- {name}: ") for line in lines)]
    assert BESIDE and missing == [], missing


def test_the_readme_names_every_shipped_toy():
    """tasks/built/'s folders, whatever they are, each named in the README's layout as `name/`."""
    built = os.path.join(ROOT, "tasks", "built")
    toys = sorted(d for d in os.listdir(built) if os.path.isdir(os.path.join(built, d)))
    text = layout_sections()["tasks"]
    assert "toy" in toys and [t for t in toys if not re.search(rf"(?<![\w/]){re.escape(t)}/", text)] == []


def test_the_top_level_holds_the_card_and_folders_one_kind_each():
    files = tracked_files()
    top = {f for f in files if "/" not in f and not f.startswith(".")}
    extra = top - CARD - BESIDE
    assert CARD | BESIDE <= top, f"missing at the top level: {sorted(CARD | BESIDE - top)}"
    assert len(extra) <= 2, f"more than two files beside the card's: {sorted(extra)}"
    folders = {f.split("/")[0] for f in files if "/" in f and not f.startswith(".")}
    assert folders <= FOLDERS, f"folders outside the plan: {sorted(folders - FOLDERS)}"


def test_imports_have_no_cycle_and_go_down_the_layers():
    known = modules()
    graph = {m: imports(p, known) - {m} for m, p in known.items()}
    upward = [(m, d) for m, deps in graph.items() for d in deps if layer(d) > layer(m)]
    assert not upward, f"imports of a higher layer: {upward}"
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"
    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, f"import cycles: {cycles}"


def program_imports(path, known):
    """The programs a file imports as programs: eval.py or spo.py at all, or a program's main or parse_args."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in PROGRAMS and a.name != "offline_values")
        elif isinstance(node, ast.ImportFrom) and node.module in PROGRAMS and node.level == 0:
            found.update(node.module for a in node.names if node.module != "offline_values" or a.name in RUNS)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in PROGRAMS:
            found.update([node.value.id] if node.attr in RUNS or node.value.id != "offline_values" else [])
    return found & set(known)


def test_no_program_stands_on_a_program():
    """Programs are run, not imported: what two of them share lives in a module under them, taking values. The
    notebook above them (bench/, experiments/) may run spo.py and call its equations; offline_values.py is also
    Algorithm 2's library (spo.py reads v0 with it), but nothing imports eval.py or a program's main or parse_args."""
    known = modules()
    notebook = layer("bench")
    found = {m: sorted(p for p in program_imports(path, known) - {m} if layer(m) < notebook or p != "spo")
             for m, path in known.items()}
    assert not {m: p for m, p in found.items() if p}, "programs imported (move what they share into a module)"


def test_the_program_check_sees_a_main_imported_and_passes_the_library(tmp_path):
    path = tmp_path / "m.py"
    known = {p: "" for p in PROGRAMS}
    path.write_text("from offline_values import TrainingV0\nimport offline_values\noffline_values.V0_SETTINGS\n")
    assert program_imports(str(path), known) == set()
    for bad in ("from offline_values import main\n", "import offline_values\noffline_values.main()\n",
                "import eval\n", "from spo import parse_args\n"):
        path.write_text(bad)
        assert program_imports(str(path), known), bad


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The checker itself: a machinery file importing spo is seen as an edge of a higher layer."""
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    import spo\n")
    known = {"machinery.bad": str(path), "spo": ""}
    assert imports(str(path), known) == {"spo"} and layer("spo") > layer("machinery.bad")


# ---- the docs: the README's size, its links, and every `file.py:name` they mention
REFERENCE = re.compile(r"`([\w/]+\.py):([\w.]+)`")


def defined(path, dotted):
    """Whether `dotted` (a function, class, module-level name, or Class.method) is defined in the file."""
    body = ast.parse(open(path).read()).body
    for part in dotted.split("."):
        found = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def doc_pages():
    return [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")]


def test_the_readme_is_short_undated_and_links_every_docs_page():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert len(text.splitlines()) <= 300
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dated notes belong in docs/LOG.md"
    pages = doc_pages()
    assert "docs/LOG.md" in pages
    assert [p for p in pages if f"({p})" not in text] == [], "docs pages the README does not link"


@pytest.mark.parametrize("page", ["README.md"] + doc_pages())
def test_every_code_reference_in_the_docs_exists(page):
    text = open(os.path.join(ROOT, page)).read()
    missing = [f"{f}:{name}" for f, name in REFERENCE.findall(text)
               if not os.path.exists(os.path.join(ROOT, f)) or not defined(os.path.join(ROOT, f), name)]
    assert not missing, f"{page} names code that does not exist: {missing}"


def test_the_equation_map_names_a_function_for_each_equation():
    text = open(os.path.join(ROOT, "README.md")).read()
    rows = [line for line in text.splitlines() if line.startswith("|") and REFERENCE.search(line)]
    for equation in ("Eq. 5", "Eq. 6", "Eq. 7", "Eq. 8", "Eq. 9", "Eq. 10", "Eq. 11", "Algorithm 1", "Algorithm 2"):
        assert any(equation in row for row in rows), f"the README's equation map has no row for {equation}"
    assert any("Eq. 10" in row and "`spo.py:ppo_clip_loss`" in row for row in rows)  # the loss training runs


def test_the_reference_check_sees_a_missing_name(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("X = 1\nclass A:\n    def f(self):\n        pass\ndef g():\n    pass\n")
    assert defined(str(path), "A.f") and defined(str(path), "g") and defined(str(path), "X")
    assert not defined(str(path), "A.g") and not defined(str(path), "h")


# The project speaks of itself by dates and commits, never of how its work was organised. "session" stays
# free for a process's (start_new_session, "a session of its own", a session keyring) and "lead" for SPO's lead.
ORGANISATION = re.compile((  # a space stands for any run of blanks, newlines and comment marks
    r"\bsessions\b|\bsession(?: |-)\d|\b(?:a|one|this|that|next|last|later|earlier|first|second|third|fourth|fifth|"
    r"sixth|seventh|eighth|helper|lead's) session\b(?! of its own| keyring)|\bissue \d+'s session|\bhelpers? "
    r"(?:session|agent|was|were|started|waited|delivered|stood)\b|\b(?:budget|compile|decode|GPU) helpers?\b|"
    r"\bthe lead (?:took|went|merges|merged|adds|added|will)\b|\blent\b|\bleases?\b|\bnot_drawn\b|"
    r"\bdrawn (?:machine|task|session)|\bclosing note|\bsitting\b|\bsub-?agents?\b"
).replace(" ", r"[\s#]+"), re.IGNORECASE)


def matches(pattern, files=None):
    """'file:line: match' of every match of pattern in the files, by default every tracked .md and .py outside tests/
    (the tests quote the lines these checks refuse, as data)."""
    found = []
    for f in files or [f for f in tracked_files() if f.endswith((".md", ".py")) and not f.startswith("tests/")]:
        text = open(os.path.join(ROOT, f), encoding="utf-8").read()
        found += [f"{f}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in pattern.finditer(text)]
    return found


def test_no_doc_or_code_narrates_how_the_work_was_organised():
    """No session, helper, lead or lent-machine talk: say what changed, measured or was decided, by date and commit."""
    assert "spo.py" in tracked_files() and matches(ORGANISATION) == []


def test_the_organisation_check_sees_narration_and_passes_a_process_session():
    for line in ("No GPU was lent (status: not_drawn).", cited("Issue", 52, "'s session ran the screen."),
                 "a screen (session 4)",
                 "Two helpers were\n# started at 16:26.", "LOG.md#2026-12-05-session-2", "the lead took its task over",
                 "sixth session", "measured this session", "the budget helper's cuts", "several sessions"):
        assert ORGANISATION.search(line), line
    for line in ("start_new_session=True", "a verifier runs in a session of its own", "the trainer's session keyring",
                 "joins a fresh empty session keyring", "SPO's lead over GRPO", "prompts drawn per step", "os.setsid()",
                 "a release of vLLM", "an eager helper"):
        assert not ORGANISATION.search(line), line


def cited(word, number, rest=""):
    """A citation of a tracker's item, put together here so that this file cites none itself."""
    return f"{word} {number}{rest}"


# Nor by issue numbers or the branches work was done on (h-NAME, hNN-NAME): a reader has neither. Upstream reports,
# cited as owner/repo#N (NVIDIA/nccl#864), "the GPU branch" (a code path) and "one branch in step 5" stay free.
TRACKER_OR_BRANCH = re.compile(r"(?i:\bissues? #?\d+)|\bh\d*-[a-z][a-z\d]*\b|"
                               r"(?i:\b(?:on|from|merged?) (?:the )?branch [`(]?[\w./-]+|\bthis branch\b)")


def test_no_doc_or_code_names_an_issue_number_or_a_working_branch():
    """Say what changed and when (a date, a commit), not which issue asked for it or which branch it was made on."""
    assert "README.md" in tracked_files() and matches(TRACKER_OR_BRANCH) == []


def test_the_issue_and_branch_check_sees_them_and_passes_upstream_reports(tmp_path):
    for line in (cited("Issue", 52, "'s screen"), cited("Issues", 61, ", 62 and 63 worked on"),
                 cited("(issue", "#7", ")"), "on branch h49-decode", "Merge h-budget into main",
                 "merged from branch docs70", '"new" is this branch'):
        assert TRACKER_OR_BRANCH.search(line), line
    for line in ("NVIDIA/nccl#864 and NVIDIA/nccl#964", "vllm-project/vllm#47654", "the GPU branch that found eight",
                 "one branch in step 5", "an H100-class card", "it issues a warning", "the tissue 5", "bf16-safe"):
        assert not TRACKER_OR_BRANCH.search(line), line
    (tmp_path / "x.md").write_text(f"fine\nas {cited('issue', 58)} asked\n")
    assert matches(TRACKER_OR_BRANCH, [str(tmp_path / "x.md")]) == [f"{tmp_path / 'x.md'}:2: {cited('issue', 58)!r}"]


# ------------------------------------------------------------------------------------------------ docs drift
def test_docs_flags_give_the_presets_variants_sets():
    """docs/flags.md's --preset row states each preset's values as `--flag value` and the probe's clause."""
    from tasks import toy
    with open(os.path.join(ROOT, "docs", "flags.md")) as f:
        row = next(line for line in f if "`--preset`" in line)
    for name, values in toy.PRESETS.items():
        text = row[row.index(f"`{name}`"):]
        flags = dict(re.findall(r"--(\w+) (\S+?)(?=[ `])", re.search(r"`(--[^`]*)`", text).group(1) + " "))
        probe = re.search(r"probe on (?:all )?(\d+) prompts \((\d+) samples, every (\d+) steps\)", text)
        flags.update(zip(("probe_prompts", "probe_samples", "probe_every"), probe.groups()))
        assert set(flags) == set(values), name
        for flag, value in values.items():
            doc = flags[flag]
            assert (value.endswith(doc) if isinstance(value, str) else float(doc) == value), (name, flag, doc, value)


def layout_sections():
    """{folder ('' for the top level): the README Layout block's text about it}."""
    with open(os.path.join(ROOT, "README.md")) as f:
        block = f.read().split("## Layout", 1)[1].split("```")[1]
    sections, folder = {"": ""}, ""
    for line in block.splitlines():
        if heading := re.match(r"(\w+)/ ", line + " "):
            folder = heading.group(1)
        sections[folder] = sections.get(folder, "") + line + "\n"
    return sections


def test_every_python_file_outside_tests_is_in_the_readme_layout():
    sections = layout_sections()
    missing = [f for f in tracked_files() if f.endswith(".py") and not f.startswith(("tests/", "."))
               and not f.endswith("__init__.py")
               and not re.search(rf"(?<![\w/]){re.escape(os.path.basename(f))}",
                                 sections.get(os.path.dirname(f).split("/")[0], ""))]
    assert "spo.py" in sections[""] and missing == [], missing


COLLECTIVE = re.compile(r"\bdist\.(barrier|broadcast\w*|all_gather\w*|all_reduce|gather\w*|reduce\w*|scatter\w*)\(")


def test_no_program_waits_in_a_bare_collective():
    """A rank waiting in a torch collective while another stopped on an error prints a traceback beneath that
    error; machinery/collectives.py's collectives make it one line (since 2026-12-05). The reference (not bench/,
    experiments/ or tests) uses them, except FSDP2's set-up in machinery/trainer.py, before any rank can stop."""
    from test_budgets import python_lines
    bare = [f"{f}:{n}" for f, text in python_lines().items()
            if not f.startswith(("tests/", "bench/", "experiments/")) and f not in (
                "test_spo.py", "machinery/collectives.py", "machinery/trainer.py")
            for n, line in enumerate(text, 1) if COLLECTIVE.search(line)]
    assert bare == []
    assert COLLECTIVE.search("    dist.barrier()") and COLLECTIVE.search("dist.broadcast_object_list(box)")
