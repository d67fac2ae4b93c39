"""spo.py end to end on two ranks: SPO and GRPO runs, exact resume, one clear line for bad input, and training,
offline values and evaluation with tools.

    .venv/bin/python -m pytest tests/test_end_to_end.py -q
"""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from common import ENV, ROOT, SNIPPET_TIMEOUT_S, ok, python, toy_args, torchrun, torchrun_nodes, write_parquet
from machinery import checkpoint
from machinery.data import prompt_key


def _metrics(run):
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def _samples(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_end_to_end_spo_two_ranks(spo_run):
    run, proc = spo_run
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for r in rows[1:]:
        assert all(np.isfinite(v) for v in r.values())
        assert 0.0 <= r["reward/mean"] <= 1.0 and 0.875 <= r["tracker/rho_mean"] <= 0.96
        assert r["policy/logprob_gap_max"] < 1e-3  # every weight push landed
        assert 0.0 <= r["tracker/revisit_share"] <= 1.0
        # --ppo_steps 1: step 4's no-grad pass scores each revisited prompt's previous response only; the update's
        # forward gives the batch's old log-probs (so the ratio is exactly 1)
        assert r["policy/rescored_sequences"] == round(16 * r["tracker/revisit_share"])
        assert r["policy/approx_kl"] == 0.0 and r["policy/clip_fraction"] == 0.0 and r["policy/entropy"] > 0.0
    assert sum(r["policy/rescored_sequences"] for r in rows[1:]) > 0  # prompts were revisited: D(x) measured
    config = json.loads((run / "config.json").read_text())
    assert (config["divergence"], config["d_half"]) == ("abs", 0.06)  # the measure D_half = 0.06 was tuned for
    assert (config["reward"], config["max_response_len"]) == ("reward:exact_match", 32)
    assert "eval/accuracy" in rows[2] and "eval/accuracy" in rows[4]
    assert all(0.0 <= rows[i][k] <= 1.0 for i in (0, 2, 4) for k in ("eval/unparsed", "eval/truncated"))
    assert [r["reward/all_equal_steps"] for r in rows[1:]] == list(np.cumsum([r["reward/all_equal"] for r in rows[1:]]))
    assert "step 4: reward=" in proc.stdout and "cut=" in proc.stdout and "kl=" not in proc.stdout  # --ppo_steps 1
    # the per-rank memory estimate printed at start (memory.py) is above what a rank really used at its peak
    estimate = float(re.search(r"memory per rank \(estimate\): ([\d.]+) GiB", proc.stdout).group(1))
    assert 0 < max(r["memory/peak_gib"] for r in rows[1:]) <= estimate
    # The checkpoint is a plain Hugging Face model.
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000004" / "model")


@pytest.mark.slow
def test_your_own_verifier_scores_training_and_an_all_equal_batch_is_said_once(small_toy, tmp_path):
    """--reward from a file that accepts everything (truncated responses scored too): every batch is all ones,
    which is counted each step and said once; the verifier is recorded in the run's config."""
    verifier = tmp_path / "lenient.py"
    verifier.write_text("def accept(text, ground_truth):\n    return True\n")
    run = tmp_path / "run"
    proc = ok(torchrun(2, *toy_args(small_toy, run, "--steps", "2", "--eval_every", "0", "--log_every", "1",
                                    "--reward", f"{verifier}:accept", "--truncated_reward", "score")))
    rows = _metrics(run)
    assert [(r["reward/mean"], r["reward/all_equal"], r["reward/all_equal_steps"]) for r in rows] == [(1, 1, 1),
                                                                                                     (1, 1, 2)]
    assert json.loads((run / "config.json").read_text())["reward"] == f"{verifier}:accept"
    assert proc.stdout.count("every reward of the batch is 1") == 1


@pytest.mark.slow
def test_end_to_end_grpo_two_ranks(small_toy, tmp_path):
    ok(torchrun(2, *toy_args(small_toy, tmp_path, "--algo", "grpo", "--group_size", "4", "--steps", "2")))
    rows = _metrics(tmp_path)
    assert "zero_signal/degenerate_groups" in rows[-1] and "tracker/value_mean" not in rows[-1]
    assert all(r["policy/rescored_sequences"] == 0 for r in rows[1:])  # no D(x), and one step: no pass at all


@pytest.mark.slow
def test_a_compiled_engine_takes_every_weight_push(small_toy, tmp_path):
    """--compile on (vLLM's torch.compile on CPU): its CPU kernels hold repacked copies of the weights,
    and each push must still reach them: the trainer's and vLLM's log-probs of the sampled tokens agree."""
    ok(torchrun(2, *toy_args(small_toy, tmp_path, "--steps", "3", "--compile", "on", "--eval_every", "0")))
    rows = _metrics(tmp_path)
    assert any(r["policy/grad_norm"] > 0 for r in rows[:-1])  # a push brought changed weights before a step
    assert all(r["policy/logprob_gap_max"] < 1e-3 for r in rows)



@pytest.mark.slow
def test_bf16_trains_with_fp32_master_weights_where_the_cpu_has_bf16_units(small_toy, tmp_path):
    """--bf16 on: the trainer computes in bf16 (FSDP2 mixed precision) and the engine samples in bf16, every push
    lands (the log-prob gap stays at bf16 rounding's size), and the weights the optimiser updates stay fp32. On a
    CPU without bf16 instructions the flag is one line instead (bf16 would be emulated, far slower)."""
    from machinery.device import native_bf16
    proc = torchrun(2, *toy_args(small_toy, tmp_path, "--steps", "3", "--bf16", "on", "--eval_every", "0"))
    if not native_bf16():
        assert proc.returncode != 0 and "error: --bf16 on: this CPU has no bf16 instructions" in proc.stderr
        return
    ok(proc)
    rows = _metrics(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["bf16"] == "on"
    assert any(r["policy/grad_norm"] > 0 for r in rows[:-1])  # a push brought changed weights before a step
    # bf16 on both sides: gaps of bf16 rounding (mean 0.002-0.004 measured), far above fp32's 1e-5, far below 1
    assert all(1e-5 < r["policy/logprob_gap_mean"] < 0.01 for r in rows)
    from transformers import AutoModelForCausalLM  # the export of the fp32 master weights (fp32 on CPU)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / "step_000003" / "model")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def _assert_same_checkpoint(a, b, scratch):
    """Two runs' step-4 checkpoints hold the same tracker, sampler, previous responses, weights (HF export and
    fp32 shards) and Adam moments."""
    state = [checkpoint.read_state(run / "checkpoints" / "step_000004" / "state.pt") for run in (a, b)]
    for key in ("alpha", "beta"):
        np.testing.assert_array_equal(state[0]["tracker"][key], state[1]["tracker"][key])
    assert str(state[0]["sampler"]) == str(state[1]["sampler"])
    assert state[0]["previous"].keys() == state[1]["previous"].keys() and len(state[0]["previous"]) > 16
    for i, fields in state[0]["previous"].items():  # SPO's memory for D(x)
        for name, value in fields.items():
            np.testing.assert_array_equal(value, state[1]["previous"][i][name])
    from safetensors.torch import load_file
    wa, wb = (load_file(run / "checkpoints" / "step_000004" / "model" / "model.safetensors") for run in (a, b))
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-6, rtol=0)
    # The sharded fp32 weights and Adam moments (what resume reads).
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    shards = []
    for run in (a, b):
        dcp_to_torch_save(run / "checkpoints" / "step_000004" / "shards", scratch / "shards.pt")
        shards.append(torch.load(scratch / "shards.pt", weights_only=False))
    moments = [k for k in shards[0]["optimizer"]["state"] if k.endswith("q_proj.weight")]
    assert moments and shards[0]["optimizer"]["state"][moments[0]]["exp_avg_sq"].abs().max() > 0
    for part in ("model", "optimizer"):
        expected, got = shards[0][part], shards[1][part]
        torch.testing.assert_close(got.get("state", got), expected.get("state", expected), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_oversampling_trains_on_the_first_to_finish(small_toy, tmp_path):
    """--oversample (Appendix B): SPO starts 1.5 x B single trajectories and trains on the first B (the rest
    aborted); GRPO with --oversample_measure keeps the first complete groups and lets the others finish, so the
    kept and aborted ones can be compared."""
    ok(torchrun(2, *toy_args(small_toy, tmp_path / "spo", "--steps", "2", "--eval_every", "0", "--oversample", "1.5")))
    for r in _metrics(tmp_path / "spo")[1:]:
        assert all(np.isfinite(v) for v in r.values())
        assert (r["sampling/generated"], r["sampling/used"], r["oversample/kept_share"]) == (24, 16, 16 / 24)
    first = next(r for r in _metrics(tmp_path / "spo") if r["step"] == 1)  # 24 distinct drawn, 16 kept: a third
    assert (first["oversample/prompts_drawn"], first["oversample/never_trained_share"]) == (24, 8 / 24)
    ok(torchrun(2, *toy_args(small_toy, tmp_path / "grpo", "--algo", "grpo", "--group_size", "4", "--steps", "2",
                             "--eval_every", "0", "--oversample", "2", "--oversample_measure")))
    for r in _metrics(tmp_path / "grpo")[1:]:
        assert all(np.isfinite(v) for v in r.values())
        assert (r["sampling/generated"], r["oversample/kept_share"], r["oversample/aborted_finished"]) == (32, 0.5, 16)
        assert "oversample/aborted_reward_mean" in r and "zero_signal/degenerate_groups" in r


@pytest.mark.slow
def test_resume_is_exact(small_toy, spo_run, tmp_path):
    """4 steps straight == 2 steps, stop, --resume, 2 more."""
    straight, _ = spo_run
    ok(torchrun(2, *toy_args(small_toy, tmp_path, "--steps", "2")))
    ok(torchrun(2, *toy_args(small_toy, tmp_path, "--steps", "4", "--resume", str(tmp_path))))
    _assert_same_checkpoint(straight, tmp_path, tmp_path)


@pytest.mark.slow
def test_two_nodes_train_and_resume_as_one_node_does(small_toy, spo_run, tmp_path):
    """docs/scale.md's multi-node command, as two one-process "nodes" on this machine (c10d rendezvous on
    localhost, local rank 0 on both): 2 steps, a checkpoint, 2 more, into one shared run directory, the same
    command both times (--resume auto: a new run in an empty directory, then resumed, as a requeue repeats it).
    Same world size and seeds as the one-node run: the same checkpoint, exactly."""
    straight, _ = spo_run
    run = tmp_path / "run"
    for extra in (("--steps", "2", "--resume", "auto"), ("--steps", "4", "--resume", "auto")):
        for proc in torchrun_nodes(2, *toy_args(small_toy, run, *extra)):
            ok(proc)
    _assert_same_checkpoint(straight, run, tmp_path)


# ---- bad input: one clear line, no traceback. One start of the program checks that (exit status 2, no traceback);
# the other checks call the function that refuses, in-process (each start would pay the torch and vLLM imports).
@pytest.mark.slow
def test_bad_parquet_columns_is_one_line_and_exit_status_2(small_toy, tmp_path):
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["1+1="], "label": ["2"]}), bad)
    proc = python("spo.py", "--model", small_toy["model"], "--train", str(bad), "--test", small_toy["test"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "bad.parquet" in proc.stderr and "'text'" in proc.stderr and "'label'" in proc.stderr


def test_offline_values_for_another_dataset(tmp_path, capsys):
    import offline_values
    from machinery.data import Dataset
    from tracker import ValueTracker
    values = tmp_path / "values.json"
    values.write_text(json.dumps({"header": {}, "prompts": {"0123456789abcdef": {"scores": [1, 0]}}}))
    with pytest.raises(SystemExit):
        offline_values.init_tracker_from_file(ValueTracker(1), str(values), Dataset(["k0"], [[1]], ["1"]), "kt", False)
    assert "not in the training set" in capsys.readouterr().err


@pytest.mark.slow  # (spo_run: a torchrun run)
def test_resume_with_another_world_size_or_dataset(spo_run, capsys):
    """The checkpoint's state names the world size and the training set's prompt keys (from their content)."""
    from machinery.untrusted import read_state
    run, _ = spo_run
    path, _ = checkpoint.resume_point(str(run))
    keys = read_state(os.path.join(path, "state.pt"))["prompt_keys"]
    for world, prompt_keys, says in [(1, keys, "made by 2 ranks"), (2, keys[1:], "made with another training set")]:
        with pytest.raises(SystemExit):
            checkpoint.load_checkpoint(str(run), world, prompt_keys)
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_run_directories_belong_to_one_run(small_toy, spo_run):
    """A fresh run into a directory that holds a run is refused (it used to append to its metrics and delete its
    new checkpoints); --resume with a flag that may not change, or a --steps that is already done, is refused;
    each with one line, before any model is loaded (nothing else on stderr)."""
    run, _ = spo_run
    for args, says in [((), f"--run_dir {run} already holds a run"),
                       (("--resume", str(run), "--lr", "1e-3"), "--lr 0.001: the run being resumed has 0.0002"),
                       (("--resume", str(run), "--algo", "grpo"), "--algo grpo: the run being resumed has spo"),
                       (("--resume", str(run), "--steps", "6", "--reward", "reward:numeric_match"),
                        "--reward reward:numeric_match: the run being resumed has reward:exact_match"),
                       (("--resume", str(run), "--steps", "3"), "--steps 3: the run's latest checkpoint is at step 4")]:
        proc = python(*toy_args(small_toy, run, *args))
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-3000:]
        assert says in proc.stderr, proc.stderr
    assert [r["step"] for r in _metrics(run)] == [0, 1, 2, 3, 4]  # the refused runs wrote nothing


@pytest.mark.slow
def test_an_unwritable_run_dir_or_a_too_small_training_set_is_one_line(small_toy, tmp_path):
    """Found before any model is loaded (they used to surface after the engine had started, or as tracebacks)."""
    proc = python(*toy_args(small_toy, "/dev/null/run"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --run_dir /dev/null/run: cannot write there (Not a directory)"], proc.stderr[-3000:]
    small = write_parquet(tmp_path / "small.parquet", {"problem": ["1+1=", "2+2="], "answer": ["2", "4"]})
    proc = python(*toy_args(small_toy, tmp_path / "run", "--train", str(small)))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]
    assert "2 prompts, fewer than the 16 distinct prompts each step draws" in proc.stderr


def crash_before_rename(*argv):
    """spo.py, except that rank 0 dies (as under kill -9) after writing the step-4 checkpoint, before renaming it
    into place."""
    import os
    import spo
    replace = os.replace

    def dying_replace(src, dst):
        if str(dst).endswith("step_000004"):
            os._exit(9)
        return replace(src, dst)
    os.replace = dying_replace
    spo.main(list(argv))


def disk_full_at_step_2(*argv):
    """spo.py, except that writing the HF export of step 2 fails as on a full disk."""
    import errno
    import safetensors.torch
    import spo
    save_file = safetensors.torch.save_file

    def full_disk(tensors, path, metadata=None):
        if "step_000002" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save_file(tensors, path, metadata=metadata)
    safetensors.torch.save_file = full_disk
    spo.main(list(argv))


def metrics_disk_full_at_step_3(*argv):
    """spo.py, except that from step 3 on metrics.jsonl is /dev/full (every write there: ENOSPC, as on a full disk)."""
    from machinery import metrics
    import spo
    log = metrics.Logger.log

    def full_from_step_3(self, step, *args, **kwargs):
        if step == 3 and self.is_main:
            self.file = open("/dev/full", "w")
        return log(self, step, *args, **kwargs)
    metrics.Logger.log = full_from_step_3
    spo.main(list(argv))


@pytest.mark.slow
def test_killed_during_a_checkpoint_write_resumes_from_the_previous_one_exactly(small_toy, spo_run, tmp_path):
    """Killed between writing step 4 and renaming it: `latest` still names step 2, the resume replays steps 3-4,
    metrics.jsonl keeps one row per step, and the result equals the run that was never killed."""
    straight, _ = spo_run
    run = tmp_path / "run"
    proc = torchrun(2, "tests/test_end_to_end.py", "crash_before_rename", *toy_args(small_toy, run, "--steps", "4",
                                                                                     "--save_every", "2")[1:])
    assert proc.returncode != 0 and (run / "checkpoints" / "latest").read_text() == "step_000002"
    assert (run / "checkpoints" / "step_000004.tmp").is_dir()  # the partial write is left behind, never read
    ok(torchrun(2, *toy_args(small_toy, run, "--steps", "4", "--save_every", "2", "--resume", str(run))))
    assert [r["step"] for r in _metrics(run)] == [0, 1, 2, 3, 4]
    _assert_same_checkpoint(straight, run, tmp_path)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_with_one_line_and_no_partial_checkpoint(small_toy, tmp_path):
    run = tmp_path / "run"
    proc = torchrun(2, "tests/test_end_to_end.py", "disk_full_at_step_2", *toy_args(small_toy, run, "--steps", "2",
                                                                                     "--eval_every", "0")[1:])
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "previous checkpoint" in errors[0]
    assert os.listdir(run / "checkpoints") == []  # the partial step_000002.tmp was removed


@pytest.mark.slow
def test_a_full_disk_under_the_metrics_is_one_line_and_the_last_checkpoint_stays(small_toy, tmp_path):
    run = tmp_path / "run"
    proc = torchrun(2, "tests/test_end_to_end.py", "metrics_disk_full_at_step_3",
                    *toy_args(small_toy, run, "--steps", "4", "--save_every", "2", "--eval_every", "0")[1:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:") and "stopped too" not in line]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]  # (the other rank: "rank 1 stopped too")
    assert errors[0].startswith("error: disk full (No space left on device) while writing metrics.jsonl") and \
        "the last checkpoint (step_000002) is intact" in errors[0] and "OSError" not in proc.stderr
    assert [os.path.basename(p) for p in checkpoint.checkpoint_dirs(str(run))] == ["step_000002"]


# ---- training and evaluation with tools, on the scripted model (conftest.py)
# The scripted prompts (conftest.scripted_model) that end in time; the never-ending "sleep" snippet is the loop
# tests' business (tests/test_rollout.py), with a short limit there and nowhere else.
TOOL_ANSWERS = {"answer": "42", "error": "0", "plain": "7", "loop": "1", "open": "2"}


@pytest.fixture(scope="session")
def tool_run(scripted_model, tmp_path_factory):
    """offline_values.py --tools, then spo.py --tools from those values (2 ranks), then eval.py --tools on its
    checkpoint: the scripted prompts call the tool (answer, error, loop), never close their block (open) or
    answer directly (plain). Snippets get a generous time limit: the test must not depend on the machine's speed."""
    tmp = tmp_path_factory.mktemp("tools")
    data = str(write_parquet(tmp / "tools.parquet", {
        "prompt": [[{"role": "user", "content": p}] for p in TOOL_ANSWERS],
        "reward_model": [{"ground_truth": a} for a in TOOL_ANSWERS.values()]}))
    tool_flags = ["--tools", "--sandbox_timeout", str(SNIPPET_TIMEOUT_S), "--max_turns", "3", "--max_prompt_len", "64"]
    ok(torchrun(1, "offline_values.py", "--model", scripted_model, "--data", data, "--n0", "2",
                "--out", str(tmp / "values.json"), *tool_flags))
    run = tmp / "run"
    ok(torchrun(2, "spo.py", "--model", scripted_model, "--train", data, "--test", data, "--run_dir", str(run),
                "--offline_values", str(tmp / "values.json"), "--batch_size", "4", "--steps", "3",
                "--eval_every", "3", "--micro_batch_size", "8", "--lr", "1e-5", "--divergence", "k3",
                *tool_flags))
    ok(torchrun(1, "eval.py", "--model", str(run), "--data", data, "--n_samples", "2", "--temperature", "0",
                "--out_dir", str(tmp / "eval"), *tool_flags))
    return tmp, run


@pytest.mark.slow
def test_offline_values_sample_with_tools(tool_run):
    tmp, _ = tool_run
    values = json.loads((tmp / "values.json").read_text())
    assert values["header"]["tools"]["max_turns"] == 3 and values["header"]["max_tokens"] == 160
    scores = {p: values["prompts"][prompt_key([{"role": "user", "content": p}])]["scores"] for p in TOOL_ANSWERS}
    assert sum(scores["answer"]) >= 1  # 6*7 came back from the interpreter
    assert sum(scores["open"]) == 0 and sum(scores["loop"]) == 0  # never answered


@pytest.mark.slow
def test_end_to_end_spo_with_tools_two_ranks(tool_run):
    """Tool metrics reach the log; the loss, token count and log-prob check cover policy tokens only (the
    interpreter's placeholder log-prob 0 would show as a gap); a failing tool never stops training."""
    _, run = tool_run
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    steps = rows[1:]
    for r in steps:
        assert all(np.isfinite(v) for v in r.values())
        assert r["policy/logprob_gap_max"] < 1e-3
        assert r["response/policy_tokens_mean"] < r["response/length_mean"] or r["tools/use_rate"] == 0
    assert np.mean([r["tools/use_rate"] for r in steps]) >= 0.4  # 3 of the 5 prompts call the tool
    assert max(r["tools/error_rate"] for r in steps) > 0  # 1/0
    assert 0.0 <= rows[0]["eval/tool_use"] <= 1.0 and rows[-1]["eval/tool_use"] > 0
    config = json.loads((run / "config.json").read_text())
    assert config["tools"] and config["max_response_len"] == 160 and config["d_half"] == 3e-4  # k3's own D_half
    revisits = [r for r in steps if "tracker/rho_p50" in r]  # 4 of 5 prompts per step: revisits from step 2 on
    assert revisits and all(0.875 <= r["tracker/rho_p10"] <= r["tracker/rho_p90"] <= 0.96 for r in revisits)


@pytest.mark.slow
def test_oversampling_with_tools_aborts_trajectories_mid_loop(scripted_model, tool_run, tmp_path):
    """--oversample with --tools: trajectories finish at their own pace (tool runs included); the first B are
    trained on, the others aborted, pending tool runs with them, and training goes on."""
    tmp, _ = tool_run
    ok(torchrun(2, "spo.py", "--model", scripted_model, "--train", str(tmp / "tools.parquet"), "--run_dir",
                str(tmp_path / "run"), "--offline_values", "none", "--batch_size", "2", "--steps", "2",
                "--eval_every", "0", "--lr", "1e-5", "--oversample", "2", "--tools", "--sandbox_timeout",
                str(SNIPPET_TIMEOUT_S), "--max_turns", "3", "--max_prompt_len", "64"))
    for r in _metrics(tmp_path / "run")[1:]:
        assert all(np.isfinite(v) for v in r.values())
        assert (r["sampling/generated"], r["sampling/used"], r["oversample/kept_share"]) == (4, 2, 0.5)


@pytest.mark.slow
def test_eval_cli_with_tools(tool_run):
    tmp, _ = tool_run
    rows = _samples(tmp / "eval" / "tools.samples.jsonl")  # data order, 2 greedy samples each
    assert [r["ground_truth"] for r in rows] == [a for a in TOOL_ANSWERS.values() for _ in range(2)]
    where = {name: 2 * k for k, name in enumerate(TOOL_ANSWERS)}
    answer, unclosed = rows[where["answer"]: where["answer"] + 2], rows[where["open"]: where["open"] + 2]
    assert all(r["correct"] and "<interpreter>\n42\n</interpreter>" in r["response"] for r in answer)
    assert not any(r["correct"] for r in unclosed)
    assert json.loads((tmp / "eval" / "summary.json").read_text())["config"]["tools"]


if __name__ == "__main__":  # torchrun tests/test_end_to_end.py WORKER [spo.py ARGS...]
    globals()[sys.argv[1]](*sys.argv[2:])


@pytest.mark.slow
@pytest.mark.parametrize("program", ["spo.py --train", "eval.py --data", "offline_values.py --data"])
def test_bad_input_under_torchrun_is_what_the_readme_says(small_toy, tmp_path, program):
    """What the README promises about errors, held under torchrun: one `error:` line, the first rank to fail exits 2,
    and torchrun, which reports any failed worker as 1, exits 1 with that exit code 2 as its summary's root cause;
    the same command without torchrun exits 2. The input: a FIFO, where a data file is expected."""
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    script, flag = program.split()
    args = [script, "--model", small_toy["model"], flag, str(fifo), *{"spo.py": ["--run_dir", str(tmp_path / "r")],
            "offline_values.py": ["--out", str(tmp_path / "v.json")]}.get(script, [])]
    says = re.compile(rf"^error: .*{re.escape(str(fifo))}: a FIFO \(named pipe\), not a data file$", re.M)
    proc = torchrun(2, *args, timeout=300)
    assert proc.returncode == 1 and len(says.findall(proc.stderr)) == 1, proc.stderr[-3000:]
    root_cause = proc.stderr.partition("Root Cause (first observed failure):")[2]
    assert re.search(r"^\s*exitcode\s*: 2 ", root_cause, re.M), proc.stderr[-3000:]
    single = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    lines = single.stderr.strip().splitlines()
    assert single.returncode == 2 and len(lines) == 1 and says.match(lines[0]), single.stderr[-3000:]
