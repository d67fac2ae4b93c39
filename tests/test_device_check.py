"""The device check (bench/gpu.py, bench/gpu_trainer.py; `python -m bench gpu --part trainer` and `--part loop`): the
two commands a GPU run executes, here on a CPU with tiny shapes: (a) the trainer path on a Qwen3 shape over packed,
variable-length, shared-prompt micro-batches, (b) spo.py's whole loop with the transformers engine (the toy, then a
random-weight Qwen3 shape run twice from scratch and once stopped halfway and resumed), each spo.py under its own
time budget; and its refusals.

    .venv/bin/python -m pytest tests/test_device_check.py -q
"""
import os
import re
import subprocess

import pytest

from common import ENV, PYTHON, ROOT, live_pids_with, ok, python


@pytest.mark.slow
def test_the_trainer_part_times_its_first_round_apart_over_packed_shared_prompt_batches():
    """--part trainer on a tiny Qwen3 shape (the real vocabulary). Every round is a fresh batch of responses of
    random lengths that share their prompts, packed by the trainer itself: prompts shared in a micro-batch run once,
    and later rounds bring attention shapes the first had not; one more PPO step is profiled. On a CPU the policy
    computes in fp32, so its log-probs must equal the unsharded fp32 copy's."""
    proc = ok(python("-m", "bench", "gpu", "--part", "trainer", "--shape", "tiny", "--prompts", "2", "--samples", "3",
                     "--prompt_lens", "8", "24", "--response_lens", "20", "60", "--rounds", "3",
                     "--max_tokens_per_micro_batch", "200"))
    out = proc.stdout
    for label, phase in [("round 1", "old log-probs"), ("round 1", "PPO step")]:
        assert re.search(rf"{label} +{phase} +[\d.]+ s +\d+ tokens/s +peak memory [\d.]+ GiB", out), out
    for phase in ("old log-probs", "PPO step"):
        assert re.search(rf"rounds 2-3 +{phase} +[\d.]+ s per round \([\d.]+ to [\d.]+\) +\d+ tokens/s", out), out
    packing = re.search(r"round 1: (\d+) tokens, the decoder ran (\d+) .* in (\d+) micro-batches \(budget 200 "
                        r"tokens\) .* rounds 2-3 bring (\d+) shapes round 1 had not", out)
    total, ran, micro_batches, new_shapes = map(int, packing.groups())
    assert ran < total and micro_batches > 1 and new_shapes > 0, out
    profile = re.search(r"profile of one more PPO step on two responses of one prompt \(rank 0\): wall ([\d.]+) s; "
                        r"host reads of tensor values (\d+)\n((?:  self host time +[\d.]+ ms  x\d+ +\S.*\n){8})",
                        out)  # the top ops: aten ops or autograd nodes
    assert profile and float(profile.group(1)) > 0 and int(profile.group(2)) > 0, out  # (the loss, AdamW's steps)
    # the new defaults first, then the old settings, each with its profiled step (on a CPU: no device, busy 0%)
    sides = re.findall(r"== (old|new)\b.*\n(?:.*\n)*?profiled PPO step \((?:old|new)[^\n]*: device busy \d+% of the "
                       r"wall, blocking syncs (\d+) in the step \((\d+) micro-batches", out)
    assert [side for side, *_ in sides] == ["new", "old"] and all(int(n) > 0 for _, n, _ in sides), out
    assert out.index("== new") < out.index("profile of one more PPO step") < out.index("== old"), out
    assert re.search(r"attention: SDPA backends enabled .*; dispatched to aten::_scaled_dot_product_\w+", out), out
    gap_mean, gap_max, grad_norm = map(float, re.search(r"mean \|gap\| (\S+), max (\S+); last PPO step's loss \S+, "
                                                         r"grad norm ([\d.]+)\n", out).groups())
    assert gap_mean <= gap_max < 1e-5 and 0 < grad_norm < float("inf"), out


@pytest.mark.slow
def test_the_device_check_refuses_a_shape_that_cannot_fit_in_one_line():
    """--shape 8b in fp32 master weights: 8.19B x 16 bytes of weights, gradients and AdamW moments alone are 122 GiB,
    more than this machine (or one H200) has: exit 2 with one line, before any model is built."""
    proc = python("-m", "bench", "gpu", "--part", "trainer", "--shape", "8b")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: --shape 8b: one rank needs about") and "take 122 GiB for 8.19B" in errors[0]
    assert "random init" not in proc.stdout


def test_the_device_peak_comes_from_the_device_name():
    from bench.gpu_trainer import dense_bf16_peak
    names = {"NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0, "NVIDIA H200": 989.0,
             "NVIDIA H200 NVL": 835.0, "NVIDIA GH200 480GB": 989.0, "NVIDIA A100-SXM4-80GB": 312.0,
             "NVIDIA A100 80GB PCIe": 312.0, "NVIDIA L40S": 362.0, "NVIDIA L4": 121.0, "NVIDIA A10": 125.0,
             "NVIDIA A10G": None, "NVIDIA GeForce RTX 4090": None}  # unknown: --peak_tflops is asked for
    assert {name: dense_bf16_peak(name) for name in names} == names


def test_the_whole_loops_disk_need_counts_a_tied_head_once():
    """Qwen3-0.6B has 596,049,920 parameters with its output head tied to the embedding (one tensor). On the disk
    at once: the bf16 model (2 bytes each) and two checkpoints of fp32 weights, two fp32 AdamW moments and the bf16
    export (14 bytes each) on a GPU; on a CPU the export is fp32 (16)."""
    from bench.gpu import disk_need
    assert disk_need("0.6b", on_gpu=True) == 596_049_920 * (2 + 2 * 14)
    assert disk_need("0.6b", on_gpu=False) == 596_049_920 * (2 + 2 * 16)


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
def test_the_loop_part_trains_checkpoints_and_resumes_exactly_at_the_floor(tmp_path):
    """--part loop on a CPU: the toy learns nothing in 2 steps but must run and evaluate; on the tiny Qwen3 shape the
    engine's log-probs are the trainer's (fp32 both) and, from random v0, step 1 already moves the weights; a CPU is
    deterministic, so the floor (two fresh runs) and the resume's difference are both exactly 0, in the metrics and
    in the fp32 weights."""
    log = tmp_path / "loop.log"
    proc = ok(python("-m", "bench", "gpu", "--part", "loop", "--loop_shape", "tiny", "--loop_response_len", "16",
                     "--loop_batch", "4", "--run_budget_s", "900", "--log", str(log),
                     timeout=3600))  # the GPU's budgets are not a CPU's
    out = proc.stdout
    toy = re.search(r"toy, --engine hf, 2 steps, held-out ([\d.]+)% -> ([\d.]+)%: .* generation (\d+) tokens/s", out)
    assert toy and 0 < float(toy.group(1)) < 40 and int(toy.group(3)) > 0, out
    qwen = re.search(r"Qwen3-tiny shape \(random weights\), --engine hf --compile off, 4 x 16 tokens, 2 steps: .* "
                     r"\(responses 16 tokens\), .* peak memory ([\d.]+) GiB, trainer-vs-engine log-prob gap mean (\S+) "
                     r"max (\S+), step 1's grad norm (\S+)", out)
    assert qwen and float(qwen.group(1)) > 0 and float(qwen.group(3)) < 1e-5, out  # noise never ends early
    assert float(qwen.group(4)) > 0, out  # random v0: step 1 moves the weights and the moments the resume restores
    assert len(re.findall(r"decode, 4 rows x 16 tokens, (compile off|auto): [\d.]+ ms a token", out)) == 2, out
    assert "(b) the whole loop" in open(log).read()  # --log: every line in the file too
    assert len(re.findall(r"spo\.py .*: \d+ s of its 900 s budget", out)) == 5, out
    for said in ("two fresh runs", "stopped at step 1 and --resume'd"):
        gap = re.search(rf"{said}.*: largest difference of a training metric (\S+), of an fp32 weight after step 2 "
                        r"(\S+) \(mean (\S+);", out)
        assert gap and all(float(x) == 0 for x in gap.groups()), out


@pytest.mark.slow
def test_a_run_past_its_budget_is_killed_with_its_children_and_named(tmp_path):
    """Every spo.py run of --part loop has its own budget: at one second each is killed (its process group: nothing
    of it outlives the check), its log's tail printed, and the check ends with exit 1 naming what did not finish."""
    proc = subprocess.run([PYTHON, "-m", "bench", "gpu", "--part", "loop", "--loop_shape", "tiny",
                           "--loop_response_len", "16", "--loop_batch", "4", "--run_budget_s", "1"], cwd=ROOT,
                          env={**ENV, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(re.findall(r"failed \(killed at its time budget\) after \d+ s", proc.stdout)) == 4, proc.stdout
    assert "(b) incomplete: fresh_1, fresh_2, resumed did not finish" in proc.stdout, proc.stdout
    assert live_pids_with(str(tmp_path)) == []


def test_the_device_check_asks_for_an_even_step_count_in_one_line():
    proc = python("-m", "bench", "gpu", "--part", "loop", "--loop_steps", "3")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors == ["error: --loop_steps 3: give an even number of at least 2 (the resume "
                                               "check stops halfway)"], proc.stderr[-2000:]
