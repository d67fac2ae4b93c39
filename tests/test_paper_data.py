"""tasks/paper.py: the paper's six datasets converted from a Hugging Face cache that the tests build in the hub's own
layout (hub/datasets--org--name/snapshots/<commit>/..., refs/main), with small files in each dataset's real file
layout and column names; the program runs offline (HF_HUB_OFFLINE=1) in a subprocess, as a user runs it.

    .venv/bin/python -m pytest tests/test_paper_data.py -q
"""
import json
import shutil
import socket
import subprocess

import pyarrow as pa
import pytest

from common import ENV, PYTHON, ROOT, write_parquet
from machinery.data import load_prompts
from reward import exact_match
from tasks.paper import BOX_LINE, normalise_answer

COMMIT, NEW_COMMIT = "1" * 40, "2" * 40
# The DAPO training prompt's wording, written out here so that the module's evaluation wrapper is checked against it
HEAD = ("Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
TAIL = "\n\nRemember to put your answer on its own line after \"Answer:\"."
NAMES = ["dapo_math_17k_en", "aime24", "aime25", "beyond_aime", "brumo25", "hmmt_feb25"]


def dapo_rows(rows):
    """open-r1/DAPO-Math-17k-Processed's columns: the DAPO prompt as a string, its answer in `solution` and again in
    reward_model, the source chat messages, extra_info.index."""
    return {"prompt": [HEAD + q + TAIL for q, _ in rows], "solution": [a for _, a in rows],
            "data_source": ["math_dapo"] * len(rows),
            "source_prompt": [[{"content": HEAD + q + TAIL, "role": "user"}] for q, _ in rows],
            "ability": ["MATH"] * len(rows),
            "reward_model": [{"ground_truth": a, "style": "rule-lighteval/MATH_v2"} for _, a in rows],
            "extra_info": [{"index": f"uuid-{i}"} for i in range(len(rows))]}


def matharena(rows):
    return {"problem_idx": pa.array(range(1, len(rows) + 1), pa.int64()), "problem": [q for q, _ in rows],
            "answer": [a for _, a in rows], "problem_type": [["Algebra"]] * len(rows)}


AIME24 = {"ID": ["2024-I-1", "2024-I-2", "2024-II-3"], "Problem": ["Find p.", "Find q.", "Find r."],
          "Solution": ["...", "...", "..."], "Answer": pa.array([204, 25, 33], pa.int64())}


def hub():
    """{repo: {path in the snapshot: columns}}: each dataset in its real layout, with the awkward rows."""
    return {
        "open-r1/DAPO-Math-17k-Processed": {
            "en/train-00000-of-00001.parquet": dapo_rows([
                ("What is 1+1?", "2"), ("Find x if 2x=6.", "3"), ("What is 1+1?", "2"),   # a duplicate
                ("求 1+2 的值。", "3"),                                                     # not English
                ("A problem without an answer.", ""), ("Pad it: 007.", "007")]),
            "all/train-00000-of-00001.parquet": dapo_rows([("Only in the all config.", "1")])},
        "Maxwell-Jia/AIME_2024": {"aime_2024_problems.parquet": AIME24},
        "yentinglin/aime_2025": {"data/train-00000-of-00001.parquet": {
            "problem": ["Find s.", "Find t.", "Find u."], "answer": ["033", "$\\frac{1}{2}$", "  70 "],
            "id": ["0", "1", "2"], "url": ["u"] * 3}},
        "ByteDance-Seed/BeyondAIME": {"data/test-00000-of-00001.parquet": {
            "problem": ["Find v.", "Find w.", "Find y."], "answer": ["\\boxed{12}", "", "$\\boxed{\\frac{3}{4}}$"]}},
        "MathArena/brumo_2025": {"data/train-00000-of-00001.parquet": matharena(
            [("Find a.", "\\sqrt{2}"), ("Find b.", "$$8$$"), ("Find c.", "2^{25}")])},
        "MathArena/hmmt_feb_2025": {"data/train-00000-of-00001.parquet": matharena(
            [("Find d.", "\\frac{9}{2}"), ("Find e.", "5"), ("Find d.", "4.5")])},   # a duplicate, another answer
    }


def add_to_cache(hf_home, repo, files, commit=COMMIT):
    root = hf_home / "hub" / f"datasets--{repo.replace('/', '--')}"
    for path, columns in files.items():
        (root / "snapshots" / commit / path).parent.mkdir(parents=True, exist_ok=True)
        write_parquet(root / "snapshots" / commit / path, columns)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)  # the hub writes the commit without a newline


def build_cache(hf_home, skip=()):
    for repo, files in hub().items():
        if repo not in skip:
            add_to_cache(hf_home, repo, files)
    return hf_home


def prepare(hf_home, out, *args, endpoint=None):
    """`python -m tasks.paper prepare` on the cache hf_home: offline, or online against a hub at endpoint."""
    env = {k: v for k, v in ENV.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE")}
    env.update({"HF_HOME": str(hf_home)}, **({"HF_ENDPOINT": endpoint} if endpoint else {"HF_HUB_OFFLINE": "1"}))
    return subprocess.run([PYTHON, "-m", "tasks.paper", "prepare", "--out", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def rows(out, name):
    return [json.loads(line) for line in (out / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    hf_home = build_cache(tmp_path_factory.mktemp("hf"))
    out = tmp_path_factory.mktemp("paper") / "data"
    ok(prepare(hf_home, out))
    return hf_home, out, json.loads((out / "manifest.json").read_text())


def test_every_schema_converts_to_files_the_loader_reads(prepared):
    _, out, _ = prepared
    answers = {name: load_prompts(out / f"{name}.jsonl").answers for name in NAMES}
    assert answers == {"dapo_math_17k_en": ["2", "3", "7"], "aime24": ["204", "25", "33"],
                       "aime25": ["33", "\\frac{1}{2}", "70"], "beyond_aime": ["12", "\\frac{3}{4}"],
                       "brumo25": ["\\sqrt{2}", "8", "2^{25}"], "hmmt_feb25": ["\\frac{9}{2}", "5"]}


def test_original_answers_and_source_ids_are_kept(prepared):
    _, out, _ = prepared
    assert [r["answer_original"] for r in rows(out, "aime25")] == ["033", "$\\frac{1}{2}$", "  70 "]
    assert [r["answer_original"] for r in rows(out, "aime24")] == [204, 25, 33]
    assert [r["source_id"] for r in rows(out, "aime24")] == ["2024-I-1", "2024-I-2", "2024-II-3"]
    assert [r["source_id"] for r in rows(out, "dapo_math_17k_en")] == ["uuid-0", "uuid-1", "uuid-5"]
    assert [r["source_id"] for r in rows(out, "beyond_aime")] == ["data/test-00000-of-00001.parquet#0",
                                                                   "data/test-00000-of-00001.parquet#2"]


def test_training_set_keeps_english_distinct_answered_rows_of_the_en_config(prepared):
    _, out, manifest = prepared
    text = (out / "dapo_math_17k_en.jsonl").read_text(encoding="utf-8")
    assert "求" not in text and "Only in the all config" not in text and "without an answer" not in text
    entry = manifest["datasets"]["dapo_math_17k_en"]
    assert (entry["config"], entry["files"][0]["path"]) == ("en", "en/train-00000-of-00001.parquet")
    assert (entry["rows_in"], entry["rows_out"], entry["duplicates_dropped"]) == (6, 3, 1)
    assert entry["rows_dropped"] == {"non-English (CJK characters)": 1, "empty answer (or not text or a number)": 1}


def test_manifest_counts_add_up_and_name_the_source(prepared):
    _, out, manifest = prepared
    for name, entry in manifest["datasets"].items():
        assert entry["revision"] == COMMIT and entry["output"] == f"{name}.jsonl"
        assert entry["rows_out"] == len(rows(out, name))
        assert entry["rows_in"] == entry["rows_out"] + entry["duplicates_dropped"] + sum(entry["rows_dropped"].values())
    assert sorted(manifest["datasets"]) == sorted(NAMES)
    assert manifest["datasets"]["hmmt_feb25"]["duplicates_with_another_answer"] == 1
    assert manifest["datasets"]["beyond_aime"]["rows_dropped"] == {"empty answer (or not text or a number)": 1}
    assert (manifest["datasets"]["beyond_aime"]["hub"], manifest["datasets"]["beyond_aime"]["split"]) == \
        ("ByteDance-Seed/BeyondAIME", "test")


def test_evaluation_prompts_are_the_authors_by_default(prepared):
    """Training prompts carry the DAPO instruction; an evaluation problem is the bare problem plus the box line, as
    the authors evaluated (so that ours compare with Table 1)."""
    _, out, _ = prepared
    assert rows(out, "dapo_math_17k_en")[0]["prompt"] == HEAD + "What is 1+1?" + TAIL + BOX_LINE
    assert [r["prompt"] for r in rows(out, "aime24")] == [p + BOX_LINE for p in AIME24["Problem"]]
    assert json.loads((out / "manifest.json").read_text())["datasets"]["aime24"]["prompt_template"] == "authors"


def test_training_style_evaluation_prompt_carries_the_training_instruction(tmp_path):
    out = tmp_path / "out"
    ok(prepare(build_cache(tmp_path / "hf"), out, "--only", "aime24", "--eval_prompt", "training"))
    assert [r["prompt"] for r in rows(out, "aime24")] == [HEAD + p + TAIL + BOX_LINE for p in AIME24["Problem"]]


def test_second_run_is_a_no_op(prepared, tmp_path):
    hf_home, out, _ = prepared
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in copy.iterdir()}
    proc = ok(prepare(hf_home, copy))
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in copy.iterdir()} == before
    assert proc.stdout.count("up to date") == len(NAMES)


def test_a_new_commit_or_a_damaged_file_is_rewritten_and_nothing_else(prepared, tmp_path):
    hf_home, out, _ = prepared
    copy, hf_copy = tmp_path / "copy", tmp_path / "hf"
    shutil.copytree(out, copy)
    shutil.copytree(hf_home, hf_copy)
    add_to_cache(hf_copy, "Maxwell-Jia/AIME_2024", {"aime_2024_problems.parquet": {
        **{k: v[:2] for k, v in AIME24.items()}, "Answer": pa.array([204, 25], pa.int64())}}, commit=NEW_COMMIT)
    (copy / "brumo25.jsonl").write_text("damaged\n")
    proc = ok(prepare(hf_copy, copy))
    manifest = json.loads((copy / "manifest.json").read_text())
    assert manifest["datasets"]["aime24"]["revision"] == NEW_COMMIT and len(rows(copy, "aime24")) == 2
    assert len(rows(copy, "brumo25")) == 3
    assert proc.stdout.count("up to date") == len(NAMES) - 2


def test_a_dataset_missing_from_the_cache_is_one_line_naming_it(tmp_path):
    proc = prepare(build_cache(tmp_path / "hf", skip=("MathArena/brumo_2025",)), tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "brumo25" in lines[0] and "MathArena/brumo_2025" in lines[0], proc.stderr
    assert "HF_HUB_OFFLINE" in lines[0] and "network" in lines[0]


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path):
    hf_home, out = build_cache(tmp_path / "hf", skip=("MathArena/brumo_2025",)), tmp_path / "out"
    assert prepare(hf_home, out).returncode == 2
    assert sorted(json.loads((out / "manifest.json").read_text())["datasets"]) == sorted(NAMES[:4])
    add_to_cache(hf_home, "MathArena/brumo_2025", hub()["MathArena/brumo_2025"])
    proc = ok(prepare(hf_home, out))
    assert proc.stdout.count("up to date") == 4 and len(rows(out, "hmmt_feb25")) == 2


def test_an_unreachable_hub_falls_back_to_the_cache(tmp_path):
    hf_home = build_cache(tmp_path / "hf", skip=("MathArena/brumo_2025",))
    with socket.socket() as s:  # a port nothing listens on: the hub refuses at once
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    ok(prepare(hf_home, tmp_path / "out", "--only", "aime24", endpoint=endpoint))
    assert load_prompts(tmp_path / "out" / "aime24.jsonl").answers == ["204", "25", "33"]
    proc = prepare(hf_home, tmp_path / "out", "--only", "brumo25", endpoint=endpoint)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "MathArena/brumo_2025" in lines[0], proc.stderr


def test_unexpected_columns_are_one_line_naming_dataset_file_and_columns(tmp_path):
    hf_home = build_cache(tmp_path / "hf", skip=("Maxwell-Jia/AIME_2024",))
    add_to_cache(hf_home, "Maxwell-Jia/AIME_2024", {"aime_2024_problems.parquet": {
        "ID": ["2024-I-1"], "question": ["Find p."], "Answer": [204]}})
    proc = prepare(hf_home, tmp_path / "out", "--only", "aime24")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "aime24" in lines[0] and "aime_2024_problems.parquet" in lines[0]
    assert "['ID', 'question', 'Answer']" in lines[0]


@pytest.mark.parametrize("raw, want", [
    ("033", "33"), ("000", "0"), (" 70\n", "70"), (17.0, "17"), (204, "204"), (2.5, "2.5"),
    ("$\\frac{1}{2}$", "\\frac{1}{2}"), ("$$8$$", "8"), ("\\(3\\)", "3"), ("\\[x+1\\]", "x+1"),
    ("\\boxed{12}", "12"), ("$\\boxed{\\frac{3}{4}}$", "\\frac{3}{4}"), ("\\boxed{ 05 }", "5"),
    ("$5$ and $6$", "$5$ and $6$"),                       # two formulas, not one pair of delimiters
    ("\\boxed{1}+\\boxed{2}", "\\boxed{1}+\\boxed{2}"),   # two boxes, not one around it all
    ("\\dfrac{1}{2}", "\\dfrac{1}{2}"), ("1,000", "1,000"),
    ("", None), ("  ", None), ("$ $", None), ("\\boxed{}", None), (None, None), (True, None), (["1"], None),
    (float("nan"), None)])
def test_normalise_answer(raw, want):
    assert normalise_answer(raw) == want


def test_normalised_answers_match_what_the_strict_verifier_reads():
    assert exact_match("so it is \\boxed{33}", "033") == 0.0  # the raw AIME answer: a right response scores 0
    assert exact_match("so it is \\boxed{33}", normalise_answer("033")) == 1.0
    assert exact_match("so it is \\boxed{\\frac{1}{2}}", normalise_answer("$\\frac{1}{2}$")) == 1.0
