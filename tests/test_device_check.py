"""The device check (bench/gpu.py, `python -m bench gpu`): the command a GPU lease runs, here on a CPU with tiny
shapes: (a) the trainer path on a Qwen3 shape, (b) spo.py's whole loop with the transformers engine (the toy, then
a random-weight Qwen3 shape checkpointed, stopped halfway and resumed), and its refusals.

    .venv/bin/python -m pytest tests/test_device_check.py -q
"""
import os
import re

import pytest

from common import ok, python


@pytest.mark.slow
def test_the_device_check_runs_the_trainer_path_on_a_tiny_qwen3_shape():
    """`python -m bench gpu` is the device check (docs/scale.md); here on a CPU with a tiny Qwen3 shape (the real
    vocabulary).
    Its fp32 "reference" is the same weights unsharded, so on a CPU the FSDP2 log-probs must equal it."""
    proc = ok(python("-m", "bench", "gpu", "--parts", "trainer", "--shape", "tiny", "--response_len", "96",
                     "--sequences", "3", "--max_tokens_per_micro_batch", "700"))
    assert re.search(r"old log-probs +[\d.]+ s +\d+ tokens/s +peak memory [\d.]+ GiB", proc.stdout), proc.stdout
    assert re.search(r"PPO step +[\d.]+ s +\d+ tokens/s +peak memory [\d.]+ GiB", proc.stdout), proc.stdout
    gap_mean, gap_max, grad_norm = map(float, re.search(r"mean \|gap\| (\S+), max (\S+); loss \S+, grad norm (\S+)",
                                                         proc.stdout).groups())
    assert gap_mean <= gap_max < 1e-5 and 0 < grad_norm < float("inf")
    # what really runs: 608 tokens per sequence, two would need 1216 > 700, so one sequence per micro-batch
    assert "3 micro-batches on rank 0: 3 x (1 sequence of 608 tokens) (budget 700 tokens" in proc.stdout, proc.stdout
    assert "1 warm-up round(s) not timed" in proc.stdout


@pytest.mark.slow
def test_the_device_check_refuses_a_shape_that_cannot_fit_in_one_line():
    """--shape 8b in fp32 master weights: 8.19B x 16 bytes of weights, gradients and AdamW moments alone are 122 GiB,
    more than this machine (or one H200) has: exit 2 with one line, before any model is built."""
    proc = python("-m", "bench", "gpu", "--shape", "8b")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: --shape 8b: one rank needs about") and "take 122 GiB for 8.19B" in errors[0]
    assert "random init" not in proc.stdout


def test_the_device_peak_comes_from_the_device_name():
    from bench.gpu import dense_bf16_peak
    names = {"NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0, "NVIDIA H200": 989.0,
             "NVIDIA H200 NVL": 835.0, "NVIDIA GH200 480GB": 989.0, "NVIDIA A100-SXM4-80GB": 312.0,
             "NVIDIA A100 80GB PCIe": 312.0, "NVIDIA L40S": 362.0, "NVIDIA L4": 121.0, "NVIDIA A10": 125.0,
             "NVIDIA A10G": None, "NVIDIA GeForce RTX 4090": None}  # unknown: --peak_tflops is asked for
    assert {name: dense_bf16_peak(name) for name in names} == names


def test_the_device_checks_toy_data_is_the_shipped_toys(tmp_path):
    """The whole-loop check writes the toy's prompts as JSON lines (a GPU machine may lack pyarrow): the same
    prompts, keys and answers as the shipped parquet files, in the same order."""
    from bench.gpu import write_toy_jsonl
    from machinery.data import load_prompts
    from tasks.toy import BUILT
    shipped = [os.path.join(BUILT, "toy", f"{split}.parquet") for split in ("train", "test")]
    for jsonl, parquet in zip(write_toy_jsonl(str(tmp_path)), shipped):
        a, b = load_prompts(jsonl), load_prompts(parquet)
        assert a.keys == b.keys and a.answers == b.answers and len(a.keys) in (2000, 500)


@pytest.mark.slow
def test_the_device_checks_whole_loop_trains_checkpoints_and_resumes_exactly(tmp_path):
    """(b) on a CPU: the toy learns nothing in 2 steps but must run and evaluate; on the tiny Qwen3 shape the
    engine's log-probs are the trainer's (fp32 both), and the resumed run equals the straight one exactly."""
    proc = ok(python("-m", "bench", "gpu", "--parts", "loop", "--loop_shape", "tiny", "--loop_response_len", "16",
                     "--loop_batch", "4", "--loop_steps", "2", "--toy_steps", "2",
                     "--loop_budget_s", "3600", timeout=3600))  # the device's 6-minute budget is not a test's
    toy = re.search(r"toy, --engine hf, 2 steps, held-out ([\d.]+)% -> ([\d.]+)%: .* generation (\d+) tokens/s", proc.stdout)
    assert toy and 0 < float(toy.group(1)) < 40 and int(toy.group(3)) > 0, proc.stdout
    qwen = re.search(r"Qwen3-tiny shape \(random weights\), --engine hf, 4 x 16 tokens, 2 steps: .* \(responses "
                     r"16 tokens\), .* peak memory ([\d.]+) GiB, trainer-vs-engine log-prob gap mean (\S+) max (\S+)",
                     proc.stdout)
    assert qwen and float(qwen.group(1)) > 0 and float(qwen.group(3)) < 1e-5, proc.stdout  # noise never ends early
    resume = re.search(r"largest difference of a training metric (\S+), of a weight (\S+)", proc.stdout)
    assert resume and float(resume.group(1)) == 0 and float(resume.group(2)) == 0, proc.stdout
    assert re.search(r"fresh runs' first 1 step\(s\) differ by up to 0\.00e\+00", proc.stdout), proc.stdout


def test_the_device_check_asks_for_an_even_step_count_in_one_line():
    proc = python("-m", "bench", "gpu", "--parts", "loop", "--loop_steps", "3")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors == ["error: --loop_steps 3: give an even number of at least 2 (the resume "
                                               "check stops halfway)"], proc.stderr[-2000:]
