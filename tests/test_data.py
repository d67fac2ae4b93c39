"""Prompt files (machinery/data.py): the schemas a user brings, stable prompt keys, duplicates, and one clear error
per bad file or row.

    .venv/bin/python -m pytest tests/test_data.py -q
"""
import json

import pyarrow as pa
import pytest

from common import write_parquet
from machinery.data import load_prompts, prompt_key

ROWS = [("What is 1+1?", "2"), ("What is 2+3?", "5"), ("Name a prime.", "7")]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _check(ps, rows=ROWS):
    assert ps.answers == [a for _, a in rows]
    assert ps.messages == [[{"role": "user", "content": q}] for q, _ in rows]
    assert ps.keys == [prompt_key(m) for m in ps.messages] and len(set(ps.keys)) == len(rows)
    assert ps.n_rows == len(rows) and ps.n_duplicates == 0


def test_load_verl_dapo_parquet(tmp_path):
    path = write_parquet(tmp_path / "dapo.parquet", {
        "data_source": ["math_dapo"] * 3,
        "prompt": [[{"content": q, "role": "user"}] for q, _ in ROWS],
        "ability": ["MATH"] * 3,
        "reward_model": [{"ground_truth": a, "style": "rule-lighteval/MATH_v2"} for _, a in ROWS],
        "extra_info": [{"index": str(i)} for i in range(3)]})
    _check(load_prompts(path))


def test_load_open_r1_processed_parquet(tmp_path):
    path = write_parquet(tmp_path / "openr1.parquet", {
        "prompt": [q for q, _ in ROWS], "solution": [a for _, a in ROWS],
        "data_source": ["math_dapo"] * 3,
        "source_prompt": [[{"content": q, "role": "user"}] for q, _ in ROWS],
        "reward_model": [{"ground_truth": a, "style": "rule"} for _, a in ROWS]})
    _check(load_prompts(path))


def test_verl_and_open_r1_give_the_same_keys(tmp_path):
    verl = write_parquet(tmp_path / "a.parquet", {"prompt": [[{"role": "user", "content": q}] for q, _ in ROWS],
                                                   "reward_model": [{"ground_truth": a} for _, a in ROWS]})
    plain = _write_jsonl(tmp_path / "b.jsonl", [{"problem": q, "answer": a} for q, a in ROWS])
    assert load_prompts(verl).keys == load_prompts(plain).keys


@pytest.mark.parametrize("prompt_col, answer_col", [("problem", "answer"), ("question", "ground_truth"),
                                                    ("prompt", "solution")])
def test_load_plain_parquet_and_jsonl(tmp_path, prompt_col, answer_col):
    _check(load_prompts(write_parquet(tmp_path / "p.parquet", {prompt_col: [q for q, _ in ROWS],
                                                                 answer_col: [a for _, a in ROWS]})))
    _check(load_prompts(_write_jsonl(tmp_path / "p.jsonl", [{prompt_col: q, answer_col: a} for q, a in ROWS])))


def test_answer_column_preferred_over_worked_solution(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"problem": "1+1?", "solution": "1+1 is 2", "answer": "2"}])
    assert load_prompts(path).answers == ["2"]


def test_numeric_answers_become_strings(tmp_path):
    path = write_parquet(tmp_path / "n.parquet", {"problem": ["a", "b", "c"], "answer": [17.0, 2.5, -3.0]})
    assert load_prompts(path).answers == ["17", "2.5", "-3"]
    path = _write_jsonl(tmp_path / "n.jsonl", [{"problem": "a", "answer": 17}])
    assert load_prompts(path).answers == ["17"]
    path = write_parquet(tmp_path / "f.parquet", {"problem": ["a", "b"], "answer": pa.array([0.1, 17.0], pa.float32())})
    assert load_prompts(path).answers == ["0.1", "17"]  # as written, not 0.10000000149011612


def test_unknown_columns_error_lists_found_columns(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", {"text": ["a"], "label": ["b"]})
    with pytest.raises(ValueError, match=r"x\.parquet.*\['text', 'label'\].*problem.*answer"):
        load_prompts(path)


def test_empty_files_error(tmp_path):
    empty_parquet = write_parquet(tmp_path / "e.parquet", {"problem": pa.array([], pa.string()),
                                                             "answer": pa.array([], pa.string())})
    with pytest.raises(ValueError, match="empty"):
        load_prompts(empty_parquet)
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        load_prompts(tmp_path / "e.jsonl")


def test_missing_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_prompts(tmp_path / "nope.parquet")


@pytest.mark.parametrize("row, says", [({"problem": "", "answer": "1"}, "missing or empty"),
                                       ({"problem": "q", "answer": "  "}, "missing or empty"),
                                       ({"problem": "q", "answer": None}, "missing or empty"),
                                       ({"problem": "q"}, "missing or empty"),
                                       ({"problem": None, "answer": "1"}, "missing or empty"),
                                       ({"problem": "q", "answer": ["1"]}, "the answer must be a string or a number")])
def test_bad_row_error_names_file_and_row(tmp_path, row, says):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"problem": "ok", "answer": "1"}, row])
    with pytest.raises(ValueError, match=r"bad\.jsonl row 1: " + says):
        load_prompts(path)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes('{"problem": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.jsonl: not UTF-8 text"):
        load_prompts(path)


def test_bad_json_line_and_extension(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "a", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2"):
        load_prompts(path)
    path.write_text('{"problem": "a", "answer": "1"}\n{"problem": ' + "[" * 100000 + "\n")
    with pytest.raises(ValueError, match="line 2: JSON nested too deeply"):
        load_prompts(path)
    path.write_text(json.dumps({"problem": "a\u2028b", "answer": "1"}, ensure_ascii=False) + "\n")  # U+2028 as is
    assert load_prompts(path).messages == [[{"role": "user", "content": "a\u2028b"}]]
    (tmp_path / "data.csv").write_text("problem,answer\n")
    with pytest.raises(ValueError, match="unsupported"):
        load_prompts(tmp_path / "data.csv")


def test_duplicates_counted_first_answer_kept(tmp_path):
    rows = [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": "2"}, {"problem": "a", "answer": "1"},
            {"problem": "a", "answer": "9"}, {"problem": "b", "answer": " 2 "}]
    ps = load_prompts(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert ps.answers == ["1", "2"] and ps.n_rows == 5
    assert ps.n_duplicates == 3 and ps.n_conflicting == 1


def test_keys_stable_under_reordering(tmp_path):
    a = load_prompts(_write_jsonl(tmp_path / "a.jsonl", [{"problem": q, "answer": x} for q, x in ROWS]))
    b = load_prompts(_write_jsonl(tmp_path / "b.jsonl", [{"problem": q, "answer": x} for q, x in ROWS[::-1]]))
    assert dict(zip(a.keys, a.answers)) == dict(zip(b.keys, b.answers))
    assert a.keys == b.keys[::-1]


def test_system_prompt_changes_the_prompt_not_the_key(tmp_path):
    from machinery.data import with_system
    user = [{"role": "user", "content": "q"}]
    assert with_system(user, None) == user
    assert with_system(user, "S") == [{"role": "system", "content": "S"}] + user
    assert with_system([{"role": "system", "content": "T"}] + user, "S")[0] == {"role": "system", "content": "S\n\nT"}


def test_prompt_key_depends_on_roles_and_all_messages():
    user = [{"role": "user", "content": "x"}]
    assert prompt_key(user) != prompt_key([{"role": "system", "content": "x"}])
    assert prompt_key(user) != prompt_key([{"role": "system", "content": "s"}] + user)
    assert len(prompt_key(user)) == 16


