"""Prompt files (machinery/data.py): the schemas a user brings, stable prompt keys, duplicates, and one clear error
per bad file or row.

    .venv/bin/python -m pytest tests/test_data.py -q
"""
import json
import os

import pyarrow as pa
import pytest

from common import write_parquet
from machinery import data
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
                                       ({"problem": "q", "answer": ["1"]}, "the answer must be a string or a number"),
                                       # NaN was refused, but infinities passed, and no response can ever match one
                                       ({"problem": "q", "answer": float("inf")}, "the answer inf is not a finite"),
                                       ({"problem": "q", "answer": float("-inf")}, "the answer -inf is not a finite"),
                                       # JSON true became the answer "True", which no box matches: every reward 0
                                       ({"problem": "q", "answer": True}, "the answer must be a string or a number, "
                                                                          "got a bool")])
def test_bad_row_error_names_file_and_row(tmp_path, row, says):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"problem": "ok", "answer": "1"}, row])
    with pytest.raises(ValueError, match=r"bad\.jsonl row 1: " + says):
        load_prompts(path)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes('{"problem": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.jsonl: not UTF-8 text"):
        load_prompts(path)


def test_an_unreadable_jsonl_file_is_one_line_as_a_parquet_file_is(tmp_path, monkeypatch):
    """Permission denied was a PermissionError traceback for JSON lines, one line for the same parquet file."""
    path = _write_jsonl(tmp_path / "locked.jsonl", [{"problem": "q", "answer": "1"}])
    path.chmod(0)
    if os.geteuid() == 0:  # root reads it anyway: the error as the kernel would give it to anyone else
        def denied(*args, **kwargs):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(data, "read_file", denied)
    with pytest.raises(ValueError, match=r"locked\.jsonl: not a readable JSON lines file \(Permission denied\)"):
        load_prompts(path)


@pytest.mark.parametrize("row", [r'{"problem": "a \ud800 b", "answer": "1"}', r'{"problem": "a", "answer": "\udfff"}',
                                 r'{"prompt": [{"role": "user", "content": "x\udc00"}], "answer": "1"}',
                                 r'{"problem": "a", "answer": "1", "extra\ud83d": 0}'])
def test_a_lone_surrogate_in_a_json_lines_row_names_the_file_and_line(tmp_path, row):
    """Lone surrogates in JSON lines: in a prompt it was an error naming neither the file nor the row; in an answer
    it was accepted though no response (text) can hold it, so none could ever match."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"problem": "fine \\ud83d\\ude00", "answer": "1"}\n' + row + "\n")  # a pair is a character
    with pytest.raises(ValueError, match=r"data\.jsonl line 2: not a JSON lines row \(a lone surrogate \(\\ud"):
        load_prompts(path)
    path.write_text('{"problem": "fine \\ud83d\\ude00", "answer": "1"}\n')
    assert load_prompts(path).messages == [[{"role": "user", "content": "fine \U0001f600"}]]


def test_bad_json_line_and_extension(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "a", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2"):
        load_prompts(path)
    path.write_text('{"problem": "a", "answer": "1"}\n{"problem": ' + "[" * 100000 + "\n")
    with pytest.raises(ValueError, match="line 2: not a JSON lines row \\(JSON nested deeper than 64\\)"):
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




# ---- the model directory: checked before anything heavy starts ------------------------------------------------
@pytest.fixture
def toy_model(tmp_path):
    """A copy of the shipped toy model, to damage."""
    import shutil
    from tasks import toy
    return shutil.copytree(f"{toy.BUILT}/toy/model", tmp_path / "model")


JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


@pytest.mark.parametrize("name, damage", [(name, damage) for name in JSON_FILES for damage in ("cut", "deep", "fifo")]
                         + [("model.safetensors", "fifo")])
def test_a_cut_or_special_json_file_of_a_model_directory_is_named(toy_model, name, damage, capsys):
    """JSON from a file, of any depth or shape (and special files): a cut tokenizer.json was transformers' line,
    which names no file; one nested deeply a RecursionError; a FIFO a hang."""
    from machinery.data import load_tokenizer
    path = toy_model / name
    text = path.read_text(errors="replace")
    path.unlink()
    if damage == "fifo":
        os.mkfifo(path)
    else:
        path.write_text(text[:len(text) // 2] if damage == "cut" else '{"x": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(SystemExit):
        load_tokenizer(str(toy_model))
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model {toy_model}: its {name} is unreadable (") and \
        {"cut": "not JSON", "deep": "nested deeper", "fifo": "a FIFO"}[damage] in err, err


@pytest.mark.parametrize("remove, says", [
    (["model.safetensors"], "has no weights"),  # was an OSError traceback, later
    (["tokenizer.json", "tokenizer_config.json"], "has no tokenizer files"),  # was a silent one-token tokenizer
    (["config.json"], "has no config.json"),
    (["chat_template.jinja"], "its tokenizer has no chat template"),  # was a traceback from data.py
])
def test_a_model_directory_missing_a_part_is_one_line(toy_model, remove, says, capsys):
    from machinery.data import load_tokenizer
    for name in remove:
        (toy_model / name).unlink()
    with pytest.raises(SystemExit) as stop:
        load_tokenizer(str(toy_model))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"error: --model {toy_model}: ") and says in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_tokenizer_past_the_models_embedding_is_one_line(toy_model, capsys):
    """Tokens added to the tokenizer without resizing the embedding: eval.py stopped with IndexError at the first
    sample; now one line when the tokenizer loads, before the engine starts."""
    from transformers import AutoTokenizer
    from machinery.data import load_tokenizer
    tokenizer = AutoTokenizer.from_pretrained(toy_model)
    config = json.loads((toy_model / "config.json").read_text())
    tokenizer.add_tokens([f"<new_{i}>" for i in range(config["vocab_size"] - len(tokenizer) + 1)])
    tokenizer.save_pretrained(toy_model)
    with pytest.raises(SystemExit):
        load_tokenizer(str(toy_model))
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model {toy_model}: its tokenizer has {config['vocab_size'] + 1} tokens, more "
                          f"than the {config['vocab_size']} rows") and len(err.strip().splitlines()) == 1, err


def test_the_context_check_checks_the_model_directory_first(toy_model, capsys):
    """spo.py checks the context before it loads the tokenizer: a directory without config.json was a traceback."""
    from machinery.data import check_context
    (toy_model / "config.json").unlink()
    with pytest.raises(SystemExit):
        check_context(str(toy_model), 64, "--max_prompt_len + --max_response_len")
    assert capsys.readouterr().err.startswith(f"error: --model {toy_model}: the directory has no config.json")


def test_a_chat_template_that_rejects_a_role_names_the_row(toy_model, tmp_path, capsys):
    from machinery.data import load_dataset, load_tokenizer
    (toy_model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ m['content'] }}\n{% endfor %}")
    tokenizer = load_tokenizer(str(toy_model))
    rows = [{"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             "answer": "4"}]
    path = _write_jsonl(tmp_path / "roles.jsonl", rows)
    with pytest.raises(SystemExit):
        load_dataset(path, tokenizer, 256, False)
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path} row 1: the prompt (roles system, user) is rejected by the chat template")
    assert "no system role" in err and len(err.strip().splitlines()) == 1, err


def test_a_data_error_is_printed_by_rank_0_only(toy_model, tmp_path, capsys, monkeypatch):
    """Every rank reads the same file: the error used to be printed once per rank."""
    from machinery.data import load_dataset, load_tokenizer
    tokenizer = load_tokenizer(str(toy_model))
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"problem": "q"}])
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as stop:
        load_dataset(path, tokenizer, 256, False)
    assert stop.value.code == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        load_dataset(path, tokenizer, 256, False)
    assert "bad.jsonl: unrecognised columns" in capsys.readouterr().err


def test_a_prompt_too_long_to_fit_is_left_out_untokenised_and_named(toy_model, tmp_path, capsys, monkeypatch):
    """A prompt of megabytes cost gigabytes and seconds of tokenising only to be left out; a prompt of the
    vocabulary's longest tokens that fits is still kept."""
    from machinery.data import load_dataset, load_tokenizer
    tokenizer, long_inputs = load_tokenizer(str(toy_model)), []
    encode = tokenizer.encode

    def counting_encode(text, **kwargs):
        if len(text) > 2 ** 20:
            long_inputs.append(len(text))
        return encode(text, **kwargs)
    monkeypatch.setattr(tokenizer, "encode", counting_encode)
    longest = max(tokenizer.get_vocab(), key=len)  # "<|im_end|>": 10 characters, one token
    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "x" * 4 * 2 ** 20, "answer": "1"},
            {"problem": longest * 60, "answer": "3"}]
    data = load_dataset(_write_jsonl(tmp_path / "huge.jsonl", rows), tokenizer, 64, True)
    assert long_inputs == [] and data.answers == ["2", "3"]
    out = capsys.readouterr().out
    assert "1 prompts longer than --max_prompt_len 64 tokens left out (rows 1; 1 of them over " in out, out
    assert "characters, not tokenised)" in out and len(out.strip().splitlines()) == 1


@pytest.mark.parametrize("damage, says", [
    ("layer", "11 weights missing from the files (model.layers.4.input_layernorm.weight, "),
    ("extra", "1 weights in the files that config.json has no place for (model.layers.0.extra.weight)"),
    ("shape", "12 of another shape (model.layers.0.mlp.down_proj.weight [128, 384] in the files, [128, 256] by "),
])
def test_a_config_that_disagrees_with_the_weights_is_one_line(toy_model, damage, says, capsys):
    """Such a model was trained and evaluated with freshly initialised layers (exit 0), or vLLM's traceback."""
    import torch
    from safetensors.torch import load_file, save_file
    from machinery.data import load_tokenizer
    config = json.loads((toy_model / "config.json").read_text())
    if damage == "layer":
        config.update(num_hidden_layers=5, layer_types=["full_attention"] * 5)
    if damage == "shape":
        config.update(intermediate_size=256)
    (toy_model / "config.json").write_text(json.dumps(config))
    if damage == "extra":
        weights = load_file(toy_model / "model.safetensors")
        save_file({**weights, "model.layers.0.extra.weight": torch.zeros(3)}, toy_model / "model.safetensors")
    with pytest.raises(SystemExit) as stop:
        load_tokenizer(str(toy_model))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: --model {toy_model}: its weights do not match its config.json: {says}"), err


def test_weights_transformers_loads_as_they_are_pass(toy_model, tmp_path):
    """Not a name-by-name comparison: a tied output projection saved anyway, and a mixture of experts in the hub's
    per-expert layout (transformers merges the experts when loading), are what the model needs."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    from machinery.data import weights_disagreement
    weights = load_file(toy_model / "model.safetensors")
    save_file({**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()},
              toy_model / "model.safetensors")
    assert weights_disagreement(toy_model) is None
    moe = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                         num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(moe).save_pretrained(tmp_path / "moe")
    assert "layers.0.mlp.experts.0.gate_proj.weight" in str(load_file(tmp_path / "moe" / "model.safetensors").keys())
    assert weights_disagreement(tmp_path / "moe") is None


# ---- a hub name: the hub, or its cached copy when the hub cannot be reached -------------------------------------
def _hub_cache(home, repo, model_dir):
    """A Hugging Face cache holding `repo` as snapshot_download leaves it: refs/main names a snapshot directory."""
    import shutil
    folder = home / "hub" / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, folder / "snapshots" / commit)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return folder / "snapshots" / commit


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache and a hub that refuses connections at once (a closed local port), as on a machine
    without network; returns the cache's home (HF_HOME)."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path / "hf"


def test_a_hub_name_without_a_hub_loads_its_cached_copy(toy_model, no_hub, capsys):
    from machinery.data import find_model, load_tokenizer
    snapshot = _hub_cache(no_hub, "someone/tiny-model", toy_model)
    path = find_model("someone/tiny-model")
    assert path == str(snapshot) and f"using the cached copy {snapshot}" in capsys.readouterr().out
    assert len(load_tokenizer(path)) == len(load_tokenizer(str(toy_model)))  # the cached model's own tokenizer


def test_a_hub_name_neither_reachable_nor_cached_is_one_line_without_retries(no_hub, capsys):
    """It used to take a minute and 20 retry lines before transformers' own error."""
    from machinery.data import find_model
    with pytest.raises(SystemExit):
        find_model("someone/not-cached")
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --model someone/not-cached: not a local directory, and the Hugging Face hub cannot "
                          "be reached") and str(no_hub / "hub") in err


def test_a_path_that_does_not_exist_is_not_taken_for_a_hub_name(tmp_path, capsys):
    from machinery.data import find_model
    with pytest.raises(SystemExit):
        find_model(str(tmp_path / "no" / "model"))
    assert capsys.readouterr().err.strip() == f"error: --model {tmp_path / 'no' / 'model'}: no such directory"
    with pytest.raises(SystemExit):  # a resumed --kl_coef run's reference, moved away: named as where it is set
        find_model(str(tmp_path / "gone"), "kl_reference (config.json)")
    assert capsys.readouterr().err.strip() == f"error: kl_reference (config.json) {tmp_path / 'gone'}: no such " \
                                              f"directory"


def test_an_interrupted_model_download_is_named(toy_model, no_hub, capsys):
    """A cached snapshot whose weights download did not finish was reported as a directory without weights."""
    from machinery.data import find_model, load_tokenizer
    snapshot = _hub_cache(no_hub, "someone/tiny-model", toy_model)
    (snapshot / "model.safetensors").unlink()  # linked into the snapshot only once whole
    (snapshot.parent.parent / "blobs").mkdir()
    partial = snapshot.parent.parent / "blobs" / "3f2a9c.0badf00d.incomplete"
    partial.write_bytes(b"\0" * 2 ** 20)
    with pytest.raises(SystemExit):
        load_tokenizer(find_model("someone/tiny-model"))
    err = capsys.readouterr().err
    assert f"the download of someone/tiny-model into {snapshot} did not finish: {partial} (1.0 MiB so far)" in err
    assert err.strip().endswith("rerun it with network access") and len(err.strip().splitlines()) == 1, err


def test_an_interrupted_dataset_download_names_what_is_missing(tmp_path):
    """tasks/paper.py said 'no file matching en/train-*.parquet (found: en)': the download had left en/ empty."""
    from machinery.data import unfinished_download
    snapshot = tmp_path / "hub" / "datasets--open-r1--DAPO-Math-17k-Processed" / "snapshots" / "0123abcd"
    (snapshot / "en").mkdir(parents=True)
    (snapshot / "README.md").symlink_to("../../blobs/gone")
    why = unfinished_download(snapshot)
    assert why == (f"the download of open-r1/DAPO-Math-17k-Processed into {snapshot} did not finish: README.md (a "
                   f"link to a missing blob), en/ (empty); rerun it with network access")
    assert unfinished_download(tmp_path) is None  # not a cache snapshot
