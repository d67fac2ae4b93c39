"""Offline values (offline_values.py, Algorithm 2): the file format, resume after an interruption (also with
another world size), refusal of other settings, and the tracker initialised from the file (Eq. 6).

    .venv/bin/python -m pytest tests/test_offline_values.py -q
"""
import json
import os
import shutil

import numpy as np
import pytest

from common import ok, python, torchrun

def offline_args(small_toy, out, *extra):
    return ["offline_values.py", "--model", small_toy["model"], "--data", small_toy["train"], "--out", str(out),
            "--max_prompts", "80", "--n0", "4", "--chunk_prompts", "8", *extra]


@pytest.fixture(scope="session")
def offline_full(small_toy, tmp_path_factory):
    """An uninterrupted pass, one process."""
    out = tmp_path_factory.mktemp("offline_full") / "values.json"
    ok(python(*offline_args(small_toy, out)))
    return out


@pytest.fixture(scope="session")
def offline_interrupted(small_toy, tmp_path_factory):
    """A pass stopped after 2 chunks of 8 prompts; the partial file is kept read-only as a snapshot for the tests
    below, which each copy it."""
    snapshot = tmp_path_factory.mktemp("offline_interrupted")
    proc = ok(python(*offline_args(small_toy, snapshot / "values.json", "--max_chunks", "2")))
    assert "rerun the same command to resume" in proc.stdout
    return snapshot


def _copy_partial(snapshot, to):
    for name in os.listdir(snapshot):
        shutil.copy(snapshot / name, to / name)
    return to / "values.json"


@pytest.mark.slow
def test_offline_values_file_format(offline_full):
    saved = json.loads(offline_full.read_text())
    assert {"model", "dataset", "n0", "temperature", "top_p", "max_tokens", "seed", "created"} <= set(saved["header"])
    assert saved["header"]["temperature"] == 1.0 and saved["header"]["top_p"] == 1.0  # training sampling
    prompts = saved["prompts"]
    assert len(prompts) == 80
    assert all(len(e["scores"]) == 4 and set(e["scores"]) <= {0.0, 1.0} for e in prompts.values())
    assert all(e["prompt"].strip().endswith("=") for e in prompts.values())  # decoded "a+b=" prompts
    flat = np.array([e["scores"] for e in prompts.values()])  # (80, 4)
    # The small toy's base model solves a few percent at temperature 1: 320 samples without a success (or all
    # successes) would mean a broken scorer, and would make the resume test below trivially pass.
    assert 0 < flat.sum() < flat.size
    assert not list(offline_full.parent.glob("*.partial.jsonl"))  # merged partial files are removed


@pytest.mark.slow
def test_offline_values_interrupted_then_resumed_equals_uninterrupted(small_toy, offline_full, offline_interrupted,
                                                                       tmp_path):
    out = _copy_partial(offline_interrupted, tmp_path)
    assert not out.exists()
    lines = (tmp_path / "values.json.rank0.partial.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 16  # the header + 2 chunks x 8 prompts, all n0 scores of a prompt on one line
    # Resume with another world size: the seeds depend on (seed, prompt id, sample), not on rank or chunking.
    ok(torchrun(2, *offline_args(small_toy, out)))
    resumed, full = json.loads(out.read_text()), json.loads(offline_full.read_text())
    assert list(resumed["prompts"]) == list(full["prompts"])  # dataset order
    assert resumed["prompts"] == full["prompts"]  # identical scores per prompt
    assert not list(tmp_path.glob("*.partial.jsonl"))


@pytest.mark.slow
def test_tracker_from_offline_file_has_n_eff_n0(small_toy, offline_full):
    import offline_values
    from machinery.data import load_dataset, load_tokenizer
    from tracker import ValueTracker
    tokenizer = load_tokenizer(small_toy["model"])
    data = load_dataset(small_toy["train"], tokenizer, 256, False)[:80]
    tracker = ValueTracker(len(data.keys), rho_min=0.875)
    offline_values.init_tracker_from_file(tracker, str(offline_full), data, "kt", False)
    np.testing.assert_allclose(tracker.n_eff, 8.0)  # N0 = 1 / (1 - rho_min)
    scores = json.loads(offline_full.read_text())["prompts"]
    successes = np.array([sum(scores[pid]["scores"]) for pid in data.keys])
    np.testing.assert_allclose(tracker.value, (successes + 0.5) / 5.0)  # KT: (s + 0.5) / (n0 + 1), n0 = 4


@pytest.mark.slow
def test_offline_values_refuses_to_resume_with_other_settings(small_toy, offline_interrupted, tmp_path):
    out = _copy_partial(offline_interrupted, tmp_path)
    before = (tmp_path / "values.json.rank0.partial.jsonl").read_text()
    proc = python(*offline_args(small_toy, out, "--temperature", "0.6"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "partial.jsonl" in proc.stderr and "temperature: 1.0 there, 0.6 now" in proc.stderr
    assert (tmp_path / "values.json.rank0.partial.jsonl").read_text() == before  # nothing appended
    assert not out.exists()


@pytest.mark.slow
def test_offline_values_refuses_a_final_file_made_with_other_settings(small_toy, offline_full, tmp_path):
    out = tmp_path / "values.json"
    shutil.copy(offline_full, out)
    args = offline_args(small_toy, out)
    args[args.index("--n0") + 1] = "8"
    proc = python(*args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "n0: 4 there, 8 now" in proc.stderr and "Traceback" not in proc.stderr




# ---- the training run checks the settings a values file was made with
def _values_file(path, **header):
    path.write_text(json.dumps({"header": {"n0": 8, "seed": 0, **header}, "prompts": {}}))
    return str(path)


WANTED = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 32, "truncated_reward": "zero", "think_format": False,
          "tools": None, "system_prompt": None}


def test_values_header_check_names_each_differing_setting(tmp_path, capsys):
    from offline_values import check_values_header
    made = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 32, "truncated_reward": "zero"}
    check_values_header(_values_file(tmp_path / "same.json", **made), WANTED)  # absent think_format: off
    other = _values_file(tmp_path / "other.json", **{**made, "temperature": 0.6, "think_format": True})
    with pytest.raises(SystemExit):
        check_values_header(other, WANTED)
    err = capsys.readouterr().err
    assert "temperature: 0.6 there, 1.0 here" in err and "think_format: True there, False here" in err
    assert "max_tokens" not in err and len(err.strip().splitlines()) == 1
    check_values_header(other, WANTED, accept_mismatch=True)  # knowingly: a warning, no error
    assert "used anyway" in capsys.readouterr().out


def test_values_made_with_another_verifier_are_refused_like_other_settings(tmp_path, capsys):
    """The header records --reward when it is not the default; a file without it was scored by the default."""
    from offline_values import check_values_header
    made = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 32, "truncated_reward": "zero"}
    check_values_header(_values_file(tmp_path / "default.json", **made), {**WANTED, "reward": "reward:exact_match"})
    numeric = _values_file(tmp_path / "numeric.json", **made, reward="reward:numeric_match")
    check_values_header(numeric, {**WANTED, "reward": "reward:numeric_match"})
    with pytest.raises(SystemExit):
        check_values_header(numeric, WANTED)
    err = capsys.readouterr().err
    assert "reward: 'reward:numeric_match' there, 'reward:exact_match' here" in err and len(err.splitlines()) == 1


def test_values_measured_on_another_model_are_refused_before_the_tracker_starts(tmp_path, capsys):
    """The header records the model (offline_values.py: its absolute path); the same folder reached another way
    matches, another model is refused (it started that model's tracker without a word)."""
    from offline_values import check_values_header
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "link").symlink_to(model)
    made = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 32, "truncated_reward": "zero"}
    values = _values_file(tmp_path / "v.json", **made, model=str(model))
    check_values_header(values, WANTED, model=str(tmp_path / "link"))
    with pytest.raises(SystemExit):
        check_values_header(values, WANTED, model="Qwen/Qwen3-8B")
    err = capsys.readouterr().err
    assert f"model: '{model}' there, 'Qwen/Qwen3-8B' here" in err and len(err.strip().splitlines()) == 1


def test_the_default_runs_cached_toy_values_keep_their_name():
    """spo.py's default run finds the toy's offline values by a hash of the settings that change v0: --reward
    and --max_response_len must leave the default's settings (and so the cached file) as they were."""
    import spo
    from offline_values import TrainingV0, run_header, toy_values_path
    args = spo.parse_args([])
    assert toy_values_path("toy", 8, 0, TrainingV0.pick(vars(args)).settings()) == \
        "toy/offline_values_n8_seed0_len32_325e71ec.json"
    other = TrainingV0.pick(vars(spo.parse_args(["--reward", "reward:numeric_match"]))).settings()
    assert toy_values_path("toy", 8, 0, other) != "toy/offline_values_n8_seed0_len32_325e71ec.json"
    header = dict(n0=8, temperature=1.0, top_p=1.0, max_tokens=32, seed=0, truncated_reward="zero")
    assert "reward" not in run_header({}, **header) and "reward" not in run_header({}, **header,
                                                                                  reward="reward:exact_match")
    assert run_header({}, **header, reward="reward:numeric_match")["reward"] == "reward:numeric_match"


@pytest.mark.slow
def test_spo_refuses_offline_values_made_with_other_settings(small_toy, offline_full, tmp_path):
    proc = python("spo.py", "--model", small_toy["model"], "--train", small_toy["train"], "--offline_values",
                  str(offline_full), "--temperature", "0.7", "--run_dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "temperature: 1.0 there, 0.7 here" in proc.stderr and "--accept_offline_mismatch" in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before anything started


@pytest.mark.parametrize("scores", [[0.5, 1], ["x"], [], 3, [[1, 0], [2, 0]]])
def test_bad_scores_in_a_values_file_are_one_line(tmp_path, capsys, scores):
    """A hand-edited or foreign values file: each prompt's scores must be a non-empty list of 0/1 rewards."""
    import offline_values
    from machinery.data import Dataset
    from tracker import ValueTracker
    path = tmp_path / "values.json"
    path.write_text(json.dumps({"header": {}, "prompts": {"k0": {"scores": [1, 0]}, "k1": {"scores": scores}}}))
    with pytest.raises(SystemExit):
        offline_values.init_tracker_from_file(ValueTracker(2), str(path), Dataset(["k0", "k1"], [[1], [2]],
                                                                                 ["1", "2"]), "kt", False)
    err = capsys.readouterr().err
    assert "values.json" in err and "scores" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("content, says", [
    ({"header": {}, "prompts": [{"scores": [1]}]}, "another shape (at /prompts)"),  # was a traceback
    ({"header": {}, "prompts": {"k0": [1, 0]}}, "another shape (at /prompts/k0)"),
    ({"header": {}, "prompts": {"k0": {"scores": [1, "0"]}}}, "another shape (at /prompts/k0/scores/1)"),
    ({"header": [], "prompts": {}}, "another shape (at /header)"),
    ([{"header": {}}], "another shape (at the top level)"),
    ({"prompts": {}}, "another shape (at /header)"),
    ({"header": {"model": json.loads("[" * 70 + "]" * 70)}, "prompts": {}}, "JSON nested deeper than 64"),
])
def test_a_values_file_that_parses_but_has_another_shape_is_one_line(tmp_path, capsys, content, says):
    """JSON from a file, of any depth or shape: both readers (spo.py's header check and the tracker's initialisation)
    check the file's structure and depth (machinery/untrusted.py:parse_json)."""
    import offline_values
    from machinery.data import Dataset
    from tracker import ValueTracker
    path = tmp_path / "values.json"
    path.write_text(json.dumps(content))
    for read in (lambda: offline_values.check_values_header(str(path), WANTED),
                 lambda: offline_values.init_tracker_from_file(ValueTracker(1), str(path),
                                                               Dataset(["k0"], [[1]], ["1"]), "kt", False)):
        with pytest.raises(SystemExit):
            read()
        err = capsys.readouterr().err
        assert err.startswith(f"error: --offline_values {path}: not an offline-values file") and says in err, err
        assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, says", [(["--top_p", "1.5"], "--top_p must be in (0, 1], got 1.5"),
                                        (["--temperature", "inf"], "--temperature must be a finite number, got inf"),
                                        (["--temperature", "2.5"], "--temperature must be in [0, 2]"),
                                        (["--reward_timeout", "-1"], "--reward_timeout must be a positive number"),
                                        (["--seed", "-1"], "--seed must be at least 0, got -1"),
                                        (["--max_prompts", "-1"], "--max_prompts must be at least 0 (0: all), got -1"),
                                        (["--max_chunks", "0"], "--max_chunks must be at least 1, got 0"),
                                        (["--max_prompt_len", "0"], "--max_prompt_len must be at least 1, got 0")])
def test_flags_are_one_line_at_start(argv, says, capsys):
    """vLLM refuses bad sampling flags only at its first request, after the model and the engine have loaded; a
    negative seed failed after the engine started (leaving a partial file with seed -1 in its header), and
    --max_prompts -1 silently measured all prompts but the last."""
    import offline_values
    with pytest.raises(SystemExit):
        offline_values.parse_args(argv)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("fills_at", [1, 2])
def test_a_full_disk_is_one_line_and_leaves_only_whole_prompts(tmp_path, monkeypatch, capsys, fills_at):
    """The disk fills at the first or the second chunk's flush: one line (it was a traceback), and the partial file
    holds only finished prompts (none: no file), so the same command resumes."""
    import offline_values
    from machinery.data import Dataset
    from rollout import Rollout

    class Engine:
        def generate(self, prompt_ids, seeds, **sampling):
            return [Rollout([1], [2], [0.0], "\\boxed{4}", "stop") for _ in prompt_ids]
    flushes = []

    def fsync(fd):
        flushes.append(fd)
        if len(flushes) == fills_at:
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "values.json"
    with pytest.raises(SystemExit):
        offline_values.estimate_offline_values(Engine(), Dataset(["a", "b"], [[1], [1]], ["4", "4"]), str(out), n0=2,
                                               max_tokens=8, header={}, chunk_prompts=1, progress=False)
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out}.rank0.partial.jsonl: No space left on device while writing") and \
        len(err.strip().splitlines()) == 1, err
    if fills_at == 1:
        assert os.listdir(tmp_path) == []
    else:
        done = offline_values.read_finished(str(out), offline_values.run_header(
            {}, n0=2, temperature=1.0, top_p=1.0, max_tokens=8, seed=0, truncated_reward="zero"))
        assert done["a"] == [1.0, 1.0] and not (tmp_path / "values.json.tmp").exists()  # a's chunk was synced
