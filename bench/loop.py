"""spo.py end to end on one device, as the device check runs it (`python -m bench gpu`, bench/gpu.py): every run a
plain `python spo.py` in a world of one (nccl on a GPU, gloo on a CPU), read back from its metrics.jsonl.

(b) The whole loop with only torch and transformers (`--engine hf`): the toy (its prompts written as JSON lines, so
no pyarrow is needed), then a Qwen3 shape with random weights and long responses, checkpointed, and the same run
stopped halfway and resumed, against the straight one. Per run: s/step, generation tokens/s, the update's MFU,
peak memory and the trainer-vs-engine log-prob gap; and the resume's largest metric and weight differences.
(6) Where vLLM imports on a GPU: spo.py for two steps on the toy under each of vLLM's model runners.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from bench.gpu import QWEN3_SHAPES, _forward_flops, dense_bf16_peak
from machinery.errors import fail

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAME_FIELDS = ("reward/", "advantage/", "response/", "policy/", "signal/", "tracker/", "sampling/")  # resume check


def write_toy_jsonl(folder):
    """The shipped toy's prompts and answers as JSON lines (tasks/toy.py:make_problems: the rows of its parquet
    files, so the same prompt keys), for a machine without pyarrow. Returns (train, test) paths."""
    from tasks.toy import make_problems
    paths = []
    for split, problems in zip(("train", "test"), make_problems(0, 2000, 500)):
        paths.append(os.path.join(folder, f"{split}.jsonl"))
        with open(paths[-1], "w") as f:
            for a, b in problems:
                f.write(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}) + "\n")
    return paths


def random_qwen3(folder, shape, max_len):
    """A Qwen3-shaped model with random weights (bf16, Qwen3's vocabulary) and the toy's tokenizer, built on the
    host (this process leaves the GPU to the spo.py runs): its samples are noise, never an end of turn, so every
    response runs to its token budget, which is what a throughput and memory check wants. Returns the folder."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(REPO, "tasks", "built", "toy", "model"))
    config = Qwen3Config(vocab_size=151_936, max_position_embeddings=max_len, rope_theta=1e6,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **QWEN3_SHAPES[shape])
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _child_env(**extra):
    """This process's environment without torch.distributed's variables (a world of one set them, and its port
    may still be held): each spo.py starts a world of one of its own."""
    drop = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def _device_name():
    """The GPU's name, asked in a child process: this one creates no CUDA context, which would sit on the card
    beside every spo.py run (counted in their memory, or locking them out of a card in exclusive-process mode)."""
    import torch
    if not torch.cuda.is_available():  # (asks the driver for a device count: no context)
        return None
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _spo(run_dir, flags, deadline, resume=False):
    """spo.py in a world of one (nccl on a GPU, gloo on a CPU), its output in run_dir.log; past the deadline it is
    killed, and a failure ends the check with the log's tail. Returns ({step: metrics row}, seconds)."""
    command = [sys.executable, "spo.py", *flags, "--resume" if resume else "--run_dir", run_dir]
    print(f"  +{time.time() - deadline[0]:.0f} s: spo.py {'--resume ' if resume else ''}{os.path.basename(run_dir)}",
          flush=True)
    t0 = time.time()
    # expandable segments: the transformers engine's KV cache grows by one token per step, and without them the
    # caching allocator keeps every outgrown block (memory/peak_gib would read the fragments, not the need).
    env = _child_env(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    with open(run_dir + ".log", "w") as log:
        try:
            code = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=max(1.0, deadline[1] - time.time())).returncode
        except subprocess.TimeoutExpired:
            code = "killed at the time budget (--loop_budget_s)"
    if code != 0:
        with open(run_dir + ".log", errors="replace") as log:
            print(log.read()[-5000:], flush=True)
        fail(f"whole loop: `{' '.join(command)}` failed ({code}); the end of its output is above", once=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = {row["step"]: row for row in map(json.loads, f)}
    return rows, time.time() - t0


def _loop_numbers(rows, config, prompt_len, batch, peak_tflops):
    """Per-step means over the steps after the first (compilation, allocator growth): generation tokens/s, the
    update's MFU (model FLOPs: forward + backward = 3 forwards, recompute not counted), peak device memory, and the
    trainer-vs-engine log-prob gap."""
    steps = [row for step, row in rows.items() if step > 1] or [row for step, row in rows.items() if step > 0]
    mean = lambda key: float(np.mean([row[key] for row in steps if key in row]))  # noqa: E731
    length = mean("response/length_mean")
    flops = 3 * _forward_flops(config, [round(prompt_len + length)] * batch, round(prompt_len))
    mfu = flops / mean("time/update") / (peak_tflops * 1e12) if peak_tflops else None
    return {"generate_tokens_per_s": mean("throughput/tokens_per_second"), "update_s": mean("time/update"),
            "step_s": mean("time/step"), "mfu": mfu, "peak_gib": max(row.get("memory/peak_gib", 0) for row in steps),
            "gap_mean": mean("policy/logprob_gap_mean"), "gap_max": max(r["policy/logprob_gap_max"] for r in steps),
            "response_len": length}


def _say_loop(name, numbers, seconds):
    mfu = f", update MFU {100 * numbers['mfu']:.1f}%" if numbers["mfu"] is not None else ""
    print(f"{name}: {seconds:.0f} s in all, {numbers['step_s']:.2f} s/step, generation "
          f"{numbers['generate_tokens_per_s']:.0f} tokens/s (responses {numbers['response_len']:.0f} tokens), "
          f"update {numbers['update_s']:.2f} s{mfu}, peak memory {numbers['peak_gib']:.2f} GiB, trainer-vs-engine "
          f"log-prob gap mean {numbers['gap_mean']:.2e} max {numbers['gap_max']:.2e}", flush=True)


def _weights(run_dir, step):
    from safetensors.torch import load_file
    folder = os.path.join(run_dir, "checkpoints", f"step_{step:06d}", "model")
    return {k: v for name in sorted(os.listdir(folder)) if name.endswith(".safetensors")
            for k, v in load_file(os.path.join(folder, name)).items()}


def _metric_gap(rows_a, rows_b, steps):
    return max((abs(rows_a[s][k] - rows_b[s].get(k, float("nan"))) for s in steps for k in rows_a[s]
                if k.startswith(SAME_FIELDS)), default=float("nan"))


def resume_gap(straight, stopped, resumed, steps):
    """How far a run stopped at steps // 2 and resumed is from the run that was never stopped: the largest
    difference of a training metric over the resumed steps and of a weight at the end (0 and 0: exact), and, as
    the floor a device's nondeterministic kernels set, the largest metric difference of the two runs' common
    first steps (both fresh, the same flags)."""
    (rows_a, dir_a), (rows_b, dir_b) = straight, resumed
    metric = _metric_gap(rows_a, rows_b, range(steps // 2 + 1, steps + 1))
    floor = _metric_gap(rows_a, stopped, range(1, steps // 2 + 1))
    wa, wb = _weights(dir_a, steps), _weights(dir_b, steps)
    weight = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    return metric, weight, floor


def whole_loop(root, shape="0.6b", response_len=512, batch=64, steps=2, toy_steps=4, peak_tflops=None,
               budget_s=360.0):
    """(b) spo.py end to end with the transformers engine (module docstring), in `root`, every spo.py killed past
    budget_s from the start; returns the numbers."""
    from transformers import AutoConfig
    from machinery.checkpoint import checkpoint_bytes
    from machinery.data import load_dataset, load_tokenizer
    deadline = (time.time(), time.time() + budget_s)
    name = _device_name()
    peak_tflops = peak_tflops or (dense_bf16_peak(name) if name else None)
    if name and peak_tflops is None:
        fail(f"--peak_tflops: no dense bf16 peak is known for {name!r}; pass its datasheet's dense bf16 TFLOPS "
             f"(without sparsity)", once=True)
    config = AutoConfig.for_model("qwen3", vocab_size=151_936, **QWEN3_SHAPES[shape])
    n_parameters = _forward_flops(config, [1], 0) / 2 + config.vocab_size * config.hidden_size  # (about)
    need = 3 * checkpoint_bytes(n_parameters, 2) + 2 * n_parameters  # straight's, stopped's two, the model
    if (free := shutil.disk_usage(root).free) < need:
        fail(f"--loop_shape {shape}: {root} has {free / 2**30:.0f} GiB free, the runs' checkpoints need about "
             f"{need / 2**30:.0f} GiB; set TMPDIR to a larger disk or use a smaller --loop_shape", once=True)
    print(f"(b) the whole loop in {root} ({free / 2**30:.0f} GiB free, about {need / 2**30:.0f} needed), "
          f"device {name or 'cpu'}, each spo.py killed past {budget_s:.0f} s from now", flush=True)
    train, test = write_toy_jsonl(root)
    common = ["--train", train, "--test", test, "--engine", "hf", "--offline_values", "none", "--log_every", "1",
              "--max_tokens_per_micro_batch", "16384"]  # whole long sequences per micro-batch, as part (a)
    toy_model = os.path.join(REPO, "tasks", "built", "toy", "model")
    prompt_len = float(np.mean([len(ids) for ids in
                                load_dataset(train, load_tokenizer(toy_model), 256, False).prompt_ids]))
    out = {}
    # The toy: its model learns, and the held-out evaluation runs on the engine.
    rows, seconds = _spo(os.path.join(root, "toy"), ["--model", toy_model, *common, "--steps", str(toy_steps),
                                                     "--eval_every", str(toy_steps), "--eval_max_prompts", "200",
                                                     "--save_every", "0"], deadline)
    out["toy"] = _loop_numbers(rows, AutoConfig.from_pretrained(toy_model), prompt_len, 64, peak_tflops)
    out["toy"]["held_out"] = (rows[0]["eval/accuracy"], rows[toy_steps]["eval/accuracy"])
    _say_loop(f"toy, --engine hf, {toy_steps} steps, held-out {out['toy']['held_out'][0]:.1%} -> "
              f"{out['toy']['held_out'][1]:.1%}", out["toy"], seconds)
    # A Qwen3 shape with random weights: long responses, bf16 with fp32 master weights, gradient checkpointing and
    # chunked log-probs (spo.py's GPU defaults), a checkpoint at the end; then the same run stopped at a
    # checkpoint halfway and resumed.
    model = random_qwen3(os.path.join(root, f"qwen3-{shape}"), shape, 512 + response_len)
    flags = ["--model", model, *common, "--batch_size", str(batch), "--max_response_len", str(response_len),
             "--max_prompt_len", "64", "--lr", "1e-6", "--eval_every", "0"]
    straight = _spo(os.path.join(root, "straight"), flags + ["--steps", str(steps), "--save_every", "0"], deadline)
    out["qwen3"] = _loop_numbers(straight[0], AutoConfig.from_pretrained(model), prompt_len, batch, peak_tflops)
    _say_loop(f"Qwen3-{shape} shape (random weights), --engine hf, {batch} x {response_len} tokens, {steps} steps",
              out["qwen3"], straight[1])
    stopped = os.path.join(root, "stopped")
    half = ["--save_every", str(steps // 2)]
    first, _ = _spo(stopped, flags + ["--steps", str(steps // 2)] + half, deadline)
    resumed = _spo(stopped, flags + ["--steps", str(steps)] + half, deadline, resume=True)
    out["resume"] = resume_gap((straight[0], os.path.join(root, "straight")), first, (resumed[0], stopped), steps)
    print(f"stopped at step {steps // 2} and --resume'd to {steps}, against the straight run: largest difference of "
          f"a training metric {out['resume'][0]:.2e}, of a weight {out['resume'][1]:.2e} (0 and 0: exact); the two "
          f"fresh runs' first {steps // 2} step(s) differ by up to {out['resume'][2]:.2e} (the device's own "
          f"nondeterminism)", flush=True)
    return out


RUNNERS = {"V1": "0", "V2": "1"}  # VLLM_USE_V2_MODEL_RUNNER (vllm/envs.py; unset: V2 where supported)


def vllm_runners(run_root, steps=2):
    """(6) spo.py for `steps` steps on the toy (one GPU, world of one) under each of vLLM's model runners, and the
    trainer-vs-engine log-prob gap of each (policy/logprob_gap_mean and _max in metrics.jsonl). vLLM's V2 runner
    (its default on CUDA since 0.3x) has never run this code: a weight push it did not take, or log-probs it
    processes otherwise, shows as a gap far above V1's. Skipped, in one line, where vLLM does not import."""
    if importlib.util.find_spec("vllm") is None:
        print("vLLM model runners V1 / V2: skipped (vLLM is not installed here)", flush=True)
        return None
    gaps = {}
    for runner, flag in RUNNERS.items():
        run_dir = os.path.join(run_root, f"runner_{runner}")
        command = [sys.executable, "spo.py", "--steps", str(steps), "--eval_every", "0", "--save_every", "0",
                   "--offline_values", "none", "--engine_compile", "off", "--log_every", "1", "--run_dir", run_dir]
        proc = subprocess.run(command, env=_child_env(VLLM_USE_V2_MODEL_RUNNER=flag), capture_output=True,
                              text=True, cwd=REPO)
        if proc.returncode != 0:
            print(f"vLLM model runner {runner}: spo.py failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}",
                  flush=True)
            gaps[runner] = None
            continue
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [row for row in map(json.loads, f) if "policy/logprob_gap_max" in row]
        gaps[runner] = (float(np.mean([r["policy/logprob_gap_mean"] for r in rows])),
                        max(r["policy/logprob_gap_max"] for r in rows))
        print(f"vLLM model runner {runner}: {len(rows)} steps, trainer-vs-engine log-prob gap mean "
              f"{gaps[runner][0]:.2e}, max {gaps[runner][1]:.2e}", flush=True)
    return gaps
