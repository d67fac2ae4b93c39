"""Evaluation (eval.py): pass@k, maj@k and summaries on hand-made numbers, then the evaluation command on a real
spo.py checkpoint over two ranks.

    .venv/bin/python -m pytest tests/test_eval.py -q
"""
import itertools
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from common import ok, python, torchrun
from eval import bootstrap_maj_at_k, majority_vote, markdown_table, pass_at_k, summarize

# ---- pass@k
def _brute_pass_at_k(n, c, k):
    flags = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(flags[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_vectorised_matches_scalar_with_mixed_n():
    n, c = np.array([4, 8, 8, 5]), np.array([0, 3, 8, 1])
    expected = [pass_at_k(int(a), int(b), 3) for a, b in zip(n, c)]
    np.testing.assert_allclose(pass_at_k(n, c, 3), expected, atol=1e-12)


def test_pass_at_n_is_any_correct():
    c = np.array([0, 1, 5, 16])
    np.testing.assert_array_equal(pass_at_k(16, c, 16), (c > 0).astype(float))


def test_pass_at_1_is_mean_correctness():
    assert pass_at_k(32, 12, 1) == pytest.approx(12 / 32)


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(np.array([8, 4]), np.array([1, 1]), 6)            # one problem has too few samples


def test_pass_at_k_large_n_is_finite():
    assert 0.0 < pass_at_k(1024, 1, 512) == pytest.approx(0.5)


# ---- maj@k
def test_majority_vote_plain_majority():
    assert majority_vote(["3", "5", "5"], [True, False, False]) == 0.0
    assert majority_vote(["3", "5", "3"], [True, False, True]) == 1.0


def test_majority_vote_tie_goes_to_first_in_sample_order():
    assert majority_vote(["7", "8", "8", "7"], [True, False, False, True]) == 1.0
    assert majority_vote(["8", "7", "7", "8"], [False, True, True, False]) == 0.0


def test_majority_vote_compares_stripped_answers():
    assert majority_vote(["4", " 5", "5 ", "4"], [True, False, False, True]) == 1.0   # 4 first-appears first
    assert majority_vote(["4", " 5", "5 ", "5"], [True, False, False, False]) == 0.0  # 5 x3


def test_majority_vote_none_and_empty_never_win():
    assert majority_vote([None, None, "", "  ", "9"], [False, False, False, False, True]) == 1.0


def test_majority_vote_all_unparsed_is_wrong():
    assert majority_vote([None, "", None], [False, False, False]) == 0.0


def test_majority_vote_length_mismatch_raises():
    with pytest.raises(ValueError):
        majority_vote(["1", "2"], [True])


def test_bootstrap_is_deterministic_for_a_seed():
    answers = [["1", "2", "2", None, "1", "3"], ["a", "b", "b", "a"]]
    correct = [[True, False, False, False, True, False], [False, True, True, False]]
    a = bootstrap_maj_at_k(answers, correct, 3, n_boot=200, seed=7)
    assert a == bootstrap_maj_at_k(answers, correct, 3, n_boot=200, seed=7)
    assert a != bootstrap_maj_at_k(answers, correct, 3, n_boot=200, seed=8)
    assert 0.0 < a[0] < 1.0 and a[1] > 0.0


def test_bootstrap_equals_single_vote_when_samples_agree():
    answers, correct = [["6"] * 8, ["2"] * 8], [[True] * 8, [False] * 8]
    assert bootstrap_maj_at_k(answers, correct, 8, n_boot=50, seed=0) == (0.5, 0.0)
    assert majority_vote(answers[0], correct[0]) == 1.0


def test_bootstrap_matches_exact_expectation_for_k1():
    # maj@1 of a resample is one random sample: its expectation is the fraction correct
    answers, correct = [["1", "2", "3", "4"]], [[True, False, False, False]]
    mean, _ = bootstrap_maj_at_k(answers, correct, 1, n_boot=20000, seed=0)
    assert mean == pytest.approx(0.25, abs=0.02)


# ---- summaries
def test_summarize_values_and_keys():
    samples = [[("1", True), ("2", False), ("1", True), (None, False)],
               [("5", False), ("5", False), ("6", True), ("7", False)]]
    s = summarize(samples, ks=(1, 2, 8), n_boot=100)
    assert s["avg@4"] == pytest.approx(3 / 8)
    assert s["pass@1"] == pytest.approx(3 / 8)
    assert s["pass@2"] == pytest.approx(((1 - 1 / 6) + 0.5) / 2)    # C(2,2)/C(4,2) = 1/6 ; C(3,2)/C(4,2)=1/2
    assert "pass@8" not in s                                        # only k <= n
    assert s["maj@4"] == 0.5
    assert {"maj@4_boot_mean", "maj@4_boot_std"} <= s.keys()


def test_summarize_rejects_ragged_samples():
    with pytest.raises(ValueError):
        summarize([[("1", True)], [("1", True), ("2", False)]])


def test_markdown_table_has_rows_and_average():
    s1 = summarize([[("1", True), ("1", True)]], ks=(1,), n_boot=10)
    s2 = summarize([[("1", False), ("2", False)]], ks=(1,), n_boot=10)
    table = markdown_table({"aime24": s1, "aime25": s2}).splitlines()
    assert table[0].startswith("| benchmark |") and "maj@2 (boot)" in table[0]
    assert len(table) == 5 and table[-1].startswith("| average |")
    assert "| aime24 | 1 | 2 | 100.0 |" in table[2] and "100.0 ± 0.0" in table[2]
    assert "| 50.0 |" in table[-1]



# ---- the evaluation command
def test_eval_imports_without_vllm():
    ok(python("-c", "import sys; sys.modules['vllm'] = None; import eval; assert 'rollout' not in sys.modules"))


def test_request_seeds_depend_on_prompt_key_and_sample_only():
    from probes import request_seeds
    a = request_seeds([0, 1], "edbe8e30412159f8", 8)
    assert list(request_seeds([0, 1], "edbe8e30412159f8", 3)) == list(a[:3])  # more samples keep the first ones
    assert len(set(a.tolist())) == 8
    assert not set(a.tolist()) & set(request_seeds([0, 1], "edbe8e30412159f9", 8).tolist())
    assert not set(a.tolist()) & set(request_seeds([0, 2], "edbe8e30412159f8", 8).tolist())


@pytest.fixture(scope="session")
def spo_run_dir(spo_run):
    return spo_run[0]


@pytest.mark.slow
def test_resolve_model_finds_a_checkpoint_model(spo_run_dir):
    from machinery.run_dir import resolve_model
    model = str(spo_run_dir / "checkpoints" / "step_000004" / "model")
    assert resolve_model(str(spo_run_dir)) == model
    assert resolve_model(str(spo_run_dir / "checkpoints")) == model
    assert resolve_model(os.path.dirname(model)) == model
    assert resolve_model(model) == model
    assert resolve_model("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"


# ---- --model on a run directory: the newest checkpoint, held against the run's rotation
def _checkpointed_run(run, steps=(2, 4)):
    """A run directory as spo.py leaves it, with real (tiny) model/ exports and manifests (no shards: eval.py
    reads only model/)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from machinery import checkpoint
    from tasks import toy
    (run / "config.json").parent.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    for step in steps:
        path = run / "checkpoints" / f"step_{step:06d}"
        toy.build_tokenizer(str(path / "model"))
        torch.manual_seed(step)
        Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
                         ).save_pretrained(path / "model")
        checkpoint._write_manifest(str(path))
        (run / "checkpoints" / "latest").write_text(path.name)
    return run


def test_resolve_model_takes_the_newest_checkpoint_not_a_deleted_latest(tmp_path):
    """`latest` names a step directory the user deleted (a damaged one, as --resume's error tells them to)."""
    from machinery.run_dir import resolve_model
    run = _checkpointed_run(tmp_path / "run")
    (run / "checkpoints" / "latest").write_text("step_000006")
    model = str(run / "checkpoints" / "step_000004" / "model")
    assert resolve_model(str(run)) == model and resolve_model(str(run / "checkpoints")) == model


def test_a_live_runs_checkpoint_is_held_against_its_rotation(tmp_path):
    """eval.py on a run still training read a checkpoint its rotation deleted meanwhile ("not a model directory"):
    the checkpoint's model is now held (hard links) until eval.py exits, and loads after the run deleted it."""
    import shutil
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer
    from machinery.run_dir import checkpoint_model
    run = _checkpointed_run(tmp_path / "run")
    stale = run / "checkpoints" / ".eval-host-0"  # the hold of an evaluation that was killed
    stale.mkdir()
    (stale / ".lock").write_text(f"{__import__('socket').gethostname()} {2 ** 22 + 1}\n")  # no such pid
    step = run / "checkpoints" / "step_000004"
    weights = load_file(step / "model" / "model.safetensors")
    model, source, error = checkpoint_model(str(run))
    assert error is None and model == str(step / "model") and source != model
    assert not stale.exists()
    for old in ("step_000002", "step_000004"):  # two more checkpoints: the run's rotation deletes both
        shutil.rmtree(run / "checkpoints" / old)
    held = load_file(os.path.join(source, "model.safetensors"))
    assert held.keys() == weights.keys() and all((held[k] == weights[k]).all() for k in weights)
    assert AutoConfig.from_pretrained(source).hidden_size == 32 and AutoTokenizer.from_pretrained(source)("1+1")


def test_the_next_hold_clears_holds_whose_evaluation_is_gone_and_keeps_live_ones(tmp_path):
    """A killed eval.py's hold would keep a rotated-out checkpoint on disk: its pid may name a later process now,
    which its lock's start time tells apart from the evaluation that wrote it."""
    import socket
    import subprocess
    from machinery.run_dir import checkpoint_model
    run = _checkpointed_run(tmp_path / "run", steps=(2,))
    holds = {name: run / "checkpoints" / f".eval-{name}" for name in ("live", "recycled")}
    with subprocess.Popen(["sleep", "60"]) as live:
        with open(f"/proc/{live.pid}/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19])
        for name, started in (("live", start), ("recycled", start - 1)):
            holds[name].mkdir()
            (holds[name] / ".lock").write_text(f"{socket.gethostname()} {live.pid} {started}\n")
        error = checkpoint_model(str(run))[2]
        live.kill()
    assert error is None and holds["live"].exists() and not holds["recycled"].exists()


def test_a_run_without_a_checkpoint_says_whether_it_is_still_running(tmp_path):
    import socket
    import subprocess
    from machinery.run_dir import checkpoint_model
    run = _checkpointed_run(tmp_path / "run", steps=())
    assert "stopped before its first" in checkpoint_model(str(run))[2]
    with subprocess.Popen(["sleep", "60"]) as live:
        (run / ".lock").write_text(f"{socket.gethostname()} {live.pid}\n")
        error = checkpoint_model(str(run))[2]
        live.kill()
    assert f"still running (pid {live.pid}" in error and "after its first checkpoint" in error


def test_a_damaged_checkpoint_is_named_with_the_newest_intact_one(tmp_path):
    from machinery.run_dir import checkpoint_model
    run = _checkpointed_run(tmp_path / "run")
    export = run / "checkpoints" / "step_000004" / "model" / "model.safetensors"
    with open(export, "r+b") as f:
        f.truncate(export.stat().st_size - 1)
    _, _, error = checkpoint_model(str(run))
    assert str(export) in error and f"--model {run / 'checkpoints' / 'step_000002'}" in error
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".eval-")]  # no hold left
    _, _, error = checkpoint_model(str(run / "checkpoints" / "step_000006"))
    assert "no such checkpoint" in error


@pytest.fixture(scope="session")
def eval_run(small_toy, spo_run_dir, tmp_path_factory):
    """eval.py on two ranks, on a real spo.py checkpoint (a plain HF dir), over two files: the toy test set and
    a JSONL copy of its first 10 problems in another schema."""
    out = tmp_path_factory.mktemp("eval_out")
    subset = out / "first10.jsonl"
    rows = pq.read_table(small_toy["test"]).to_pylist()[:10]
    subset.write_text("".join(json.dumps({"problem": r["prompt"][0]["content"],
                                          "answer": r["reward_model"]["ground_truth"]}) + "\n" for r in rows))
    model = str(spo_run_dir / "checkpoints" / "step_000004" / "model")
    ok(torchrun(2, "eval.py", "--model", model, "--data", small_toy["test"], str(subset), "--n_samples", "4",
                "--max_tokens", "32", "--out_dir", str(out / "eval")))
    return out / "eval"


def _samples(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_eval_cli_writes_samples_and_summaries(eval_run):
    assert {"test.samples.jsonl", "first10.samples.jsonl", "summary.json", "summary.md"} <= set(os.listdir(eval_run))
    assert not [f for f in os.listdir(eval_run) if ".rank" in f]  # per-rank shards merged and removed
    results = json.loads((eval_run / "summary.json").read_text())["results"]
    assert set(results) == {"test", "first10"} and results["test"]["problems"] == 40
    for summary in results.values():
        metrics = {k: v for k, v in summary.items() if "@" in k}
        assert {"avg@4", "pass@1", "pass@2", "pass@4", "maj@4", "maj@4_boot_mean"} <= set(metrics)
        assert all(0.0 <= v <= 1.0 for v in metrics.values())
        assert summary["pass@1"] == pytest.approx(summary["avg@4"], abs=1e-12)
        assert summary["avg@4"] <= summary["pass@2"] <= summary["pass@4"]
        assert 0.0 <= summary["unparsed"] <= 1.0 and 0.0 <= summary["truncated"] <= 1.0
    table = (eval_run / "summary.md").read_text()
    assert "| test |" in table and "| first10 |" in table and "| average |" in table
    assert "| unparsed | truncated |" in table.splitlines()[2]  # after the header line, the table's columns


@pytest.mark.slow
def test_eval_samples_are_in_order_and_agree_with_the_summary(eval_run):
    rows = _samples(eval_run / "test.samples.jsonl")
    assert len(rows) == 40 * 4
    assert [r["sample"] for r in rows] == [0, 1, 2, 3] * 40  # problems in data order, 4 samples each
    assert len({r["prompt_key"] for r in rows}) == 40
    summary = json.loads((eval_run / "summary.json").read_text())["results"]["test"]
    assert np.mean([r["correct"] for r in rows]) == pytest.approx(summary["avg@4"])
    from reward import reward_and_answer
    assert all((bool(s), a) == (r["correct"], r["answer"]) for r in rows
               for s, a in [reward_and_answer(r["response"], r["ground_truth"])])


@pytest.mark.slow
def test_eval_samples_do_not_depend_on_the_file_or_rank(eval_run):
    """The subset's problems land on the same ranks but in another request batch; seeds come from the prompt
    id, so their responses match the full set's exactly."""
    full, subset = _samples(eval_run / "test.samples.jsonl"), _samples(eval_run / "first10.samples.jsonl")
    assert subset == full[:40]




@pytest.mark.parametrize("program", ["eval", "offline_values"])
@pytest.mark.parametrize("flag", ["--max_response_len", "--max_tokens"])
def test_a_zero_token_budget_is_an_error_not_the_default(program, flag, capsys):
    """--max_tokens 0 used to become the default 32 (a falsy value took the default's place)."""
    module = __import__(program)
    with pytest.raises(SystemExit):
        module.parse_args([flag, "0"])
    assert "--max_response_len (--max_tokens)" in capsys.readouterr().err
    assert module.parse_args([]).max_response_len == 32  # unset still means the default


@pytest.mark.parametrize("program", ["spo", "eval", "offline_values"])
def test_the_budget_has_one_name_one_alias_and_one_default_in_the_three_programs(program):
    parse_args = __import__(program).parse_args
    assert parse_args(["--max_response_len", "64"]).max_response_len == 64
    assert parse_args(["--max_tokens", "64"]).max_response_len == 64            # the old name of eval.py
    assert parse_args([]).max_response_len == 32 and parse_args(["--tools"]).max_response_len == 160


def test_summary_counts_unparsed_and_truncated_samples():
    samples = [[("1", True, False), (None, False, True), ("2", False, False), (None, False, False)],
               [("5", True, True), ("5", True, False), ("6", False, False), ("7", False, False)]]
    s = summarize(samples, ks=(1,), n_boot=10)
    assert s["unparsed"] == 2 / 8 and s["truncated"] == 2 / 8 and s["avg@4"] == 3 / 8
    assert "truncated" not in summarize([[("1", True)]], ks=(1,), n_boot=10)    # (answer, correct): no flag
    header, _, row = markdown_table({"b": s}).splitlines()
    assert header.endswith("| unparsed | truncated |") and row.endswith("| 25.0 | 25.0 |")


def test_sample_and_score_flags_unparsed_and_truncated_responses():
    """Hand-made responses through sample_and_score (a fake engine): no final box is unparsed, finish reason
    "length" is truncated, and a truncated response with a right box still counts as correct in evaluation."""
    from machinery.data import Dataset
    from probes import sample_and_score
    from rollout import Rollout
    responses = [("\\boxed{4}", "stop"), ("I think 4", "stop"), ("\\boxed{4} and then", "length"),
                 ("\\boxed{5", "length")]

    class Engine:
        def generate(self, prompt_ids, seeds, **sampling):
            return [Rollout([1], [2], [0.0], text, reason) for text, reason in responses]
    samples, _ = sample_and_score(Engine(), Dataset(["k"], [[1]], ["4"]), 4, 0, temperature=1.0, top_p=1.0,
                                  top_k=-1, max_tokens=8, rank=0, world=1)
    assert samples == [[("4", True, False), (None, False, False), ("4", True, True), (None, False, True)]]
    s = summarize(samples, ks=(1,), n_boot=10)
    assert (s["avg@4"], s["unparsed"], s["truncated"]) == (0.5, 0.5, 0.5)


def test_sample_and_score_shows_a_bar_of_finished_samples_on_rank_0_only_when_asked(capsys, monkeypatch):
    """The bar counts rank 0's samples as the engine finishes them (its progress callable); spo.py's held-out
    evaluation (progress=False, under the training bar) and the other ranks show none."""
    from machinery.data import Dataset
    from probes import sample_and_score
    from rollout import Rollout

    class Engine:
        def generate(self, prompt_ids, seeds, progress=None, **sampling):
            self.given = progress
            for _ in prompt_ids:
                if progress is not None:
                    progress()
            return [Rollout([1], [2], [0.0], "\\boxed{4}", "stop") for _ in prompt_ids]
    data = Dataset(["a", "b", "c"], [[1], [1], [1]], ["4", "4", "4"])
    everyone = {p: [("4", True, False)] * 2 for p in range(3)}  # (the other rank's scores: not what is tested)
    monkeypatch.setattr("machinery.collectives.all_gather_objects", lambda items: [everyone] * 2)
    for progress, rank, shown in ((True, 0, True), (False, 0, False), (True, 1, False)):
        engine = Engine()
        sample_and_score(engine, data, 2, 0, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8, rank=rank,
                         world=2, progress=progress)
        err = capsys.readouterr().err
        assert (engine.given is not None) == shown and ("sampling (rank 0 of 2)" in err) == shown
        if shown:
            assert "4/4" in err  # rank 0's problems a and c, 2 samples each


@pytest.mark.parametrize("argv, says", [(["--top_p", "1.5"], "--top_p must be in (0, 1], got 1.5"),
                                        (["--top_k", "-3"], "--top_k must be -1 or 0 (off) or at least 1, got -3"),
                                        (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
                                        (["--reward_timeout", "0"], "--reward_timeout must be a positive number"),
                                        (["--seed", "-1"], "--seed must be at least 0, got -1"),
                                        (["--n_boot", "-1"], "--n_boot must be at least 1, got -1"),
                                        (["--n_boot", "0"], "--n_boot must be at least 1, got 0"),
                                        (["--gpu_memory_utilization", "0"],
                                         "--gpu_memory_utilization must be in (0, 1]"),
                                        (["--max_prompt_len", "0"], "--max_prompt_len must be at least 1, got 0")])
def test_flags_are_one_line_at_start(argv, says, capsys):
    """vLLM refused bad sampling flags only at its first request, after the model and the engine had loaded; a
    negative seed failed after the engine started, --n_boot -1 after all the sampling (the summary lost) and
    --n_boot 0 wrote NaN into summary.json, which is not JSON."""
    import eval as evaluation
    with pytest.raises(SystemExit):
        evaluation.parse_args(argv)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1, err


def test_a_full_out_dir_is_one_line_and_leaves_no_rank_shard(tmp_path, monkeypatch, capsys):
    """The disk fills while a rank writes its shard of the samples file: one line naming --out_dir, no shard left
    (it was a traceback and an empty eval_out/<name>.samples.jsonl.rank0)."""
    from types import SimpleNamespace
    import torch.distributed as dist
    import eval as evaluation
    monkeypatch.setattr(dist, "barrier", lambda: None)

    class Full:
        response_ids, finish_reason = [2, 3], "stop"

        @property
        def text(self):
            raise OSError(28, "No space left on device")
    path = tmp_path / "test.samples.jsonl"
    with pytest.raises(SystemExit):
        evaluation.write_samples(str(path), SimpleNamespace(keys=["p0"], answers=["2"]), {0: [("2", True, None)]},
                                 {0: [Full()]}, 1, 0, 1)
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out_dir {tmp_path}: cannot write test.samples.jsonl (No space left on device)")
    assert len(err.strip().splitlines()) == 1 and os.listdir(tmp_path) == []
