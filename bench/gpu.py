"""The device check: spo.py's GPU path, measured with only torch and transformers (a GPU machine may lack vLLM).

Two commands, each planned for at most 4 minutes on one H200 with its model's build and compile warm-up (since
2026-12-06, 270a46d; docs/benchmarks.md: what to run, what each number means, the ranges expected). `--log FILE`:
every line unbuffered to the console and to FILE, torch's recompiles and CUDA graph records with them (TORCH_LOGS).
"tiny" shapes run both on a CPU (tests/test_device_check.py).
(a) `--part trainer` (bench/gpu_trainer.py): the trainer alone on packed, shared-prompt micro-batches of a Qwen3
shape, its first round timed apart from the rest: the new defaults first, then the old settings, then compiled.
(b) `--part loop` (here): spo.py `--engine hf` on the toy (the engine under CUDA graphs, the evaluation, the weight
push), the engine's decode alone eager and compiled (ms a token, in a child process), then on a random-weight Qwen3
shape with the engine eager twice from scratch (their difference: the device's own nondeterminism, the floor) and
once stopped halfway and resumed (its difference from the first, printed beside the floor); every spo.py run under
its own time budget.
`--part vllm` (here), where vLLM imports on a GPU: spo.py on the toy under each of vLLM's model runners (V1, V2).

    python -m bench gpu --part trainer --log $OUT/trainer.log   # one GPU: the Qwen3-1.7B shape
    python -m bench gpu --part loop --log $OUT/loop.log         # one GPU: the toy, then the Qwen3-0.6B shape
"""
import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

from bench.gpu_trainer import QWEN3_SHAPES, _forward_flops, bench_gpu, device_peak
from machinery.errors import fail

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY_MODEL = os.path.join(REPO, "tasks", "built", "toy", "model")
SAME_FIELDS = ("reward/", "advantage/", "response/", "policy/", "signal/", "tracker/", "sampling/")  # compared
# Each spo.py run's time budget in seconds (`--run_budget_s` sets one for all), and the decode's child process's:
# with the model's build, part (b) within about 4 minutes. From the first H200 run (docs/benchmarks.md): a 0.6B
# process ~20 s to start and ~20 s a step with the eager decode of then; the toy's budget holds its engine's compile.
RUN_BUDGET_S = {"toy": 50, "fresh": 50, "stopped": 40, "resumed": 45, "decode": 60}


def write_toy_jsonl(folder):
    """The shipped toy's prompts and answers as JSON lines (tasks/toy.py:make_problems: the rows of its parquet
    files, so the same prompt keys), for a machine without pyarrow. Returns (train, test) paths."""
    from tasks.toy import make_problems
    paths = [os.path.join(folder, f"{split}.jsonl") for split in ("train", "test")]
    for path, problems in zip(paths, make_problems(0, 2000, 500)):
        with open(path, "w") as f:
            f.writelines(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)})
                         + "\n" for a, b in problems)
    return paths


def random_qwen3(folder, shape, max_len):
    """A Qwen3 shape with random weights (bf16, Qwen3's vocabulary) and the toy's tokenizer, built on the host (the
    GPU is left to the spo.py runs): its samples are noise, never an end of turn, so every response runs to its
    token budget, which is what a throughput and memory check wants. Returns the folder."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(TOY_MODEL)
    config = Qwen3Config(vocab_size=151_936, max_position_embeddings=max_len, rope_theta=1e6,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **QWEN3_SHAPES[shape])
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def random_values(path, train, max_tokens, model, n0=8, seed=0):
    """An offline-values file of random 0/1 scores for every training prompt, with the header of the runs' settings.
    A random model's rewards are all 0, so from the uninformed prior (v = 0.5 everywhere) every advantage of step 1
    is equal, 0 once normalised, and step 1 moves nothing: the resume check would restore AdamW moments of zero.
    From v0 that differ by prompt the advantages -v0(x) do too, so every step moves the weights and the moments."""
    from machinery.data import load_prompts
    rng = np.random.default_rng(seed)
    header = {"model": os.path.realpath(model), "dataset": train, "n0": n0, "temperature": 1.0,
              "top_p": 1.0, "max_tokens": max_tokens, "seed": seed, "truncated_reward": "zero"}
    prompts = {key: {"scores": rng.integers(0, 2, n0).astype(float).tolist()} for key in load_prompts(train).keys}
    with open(path, "w") as f:
        json.dump({"header": header, "prompts": prompts}, f)
    return path


def _device_name():
    """The GPU's name, asked in a child process: this one creates no CUDA context, which would sit on the card
    beside every spo.py run (counted in their memory, or locking them out of a card in exclusive-process mode)."""
    import torch
    if not torch.cuda.is_available():  # (asks the driver for a device count: no context)
        return None
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _spo(run_dir, flags, budget_s, resume=False, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}):
    """spo.py in a world of one, its output in run_dir.log, `env` added, killed with its children past budget_s:
    ({step: metrics row}, seconds). A run that fails or is killed prints its log's tail and gives None rows.
    Expandable segments: the transformers engine's KV cache grows by one token per step, and without them the
    caching allocator keeps every outgrown block (memory/peak_gib would read the fragments, not the need)."""
    command = [sys.executable, "spo.py", *flags, "--resume" if resume else "--run_dir", run_dir]
    t0 = time.time()
    with open(run_dir + ".log", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: a kill reaches its children too
        try:
            code = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            code = "killed at its time budget"
        finally:  # past its budget, or this check stopped (a SIGTERM is a SystemExit here: main)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds, said = time.time() - t0, f"spo.py {'--resume ' if resume else ''}{os.path.basename(run_dir)}"
    if code != 0:
        with open(run_dir + ".log", errors="replace") as log:
            print(log.read()[-5000:], flush=True)
        print(f"{said} failed ({code}) after {seconds:.0f} s; the end of its output is above", flush=True)
        return None, seconds
    print(f"  {said}: {seconds:.0f} s of its {budget_s:.0f} s budget", flush=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {row["step"]: row for row in map(json.loads, f)}, seconds


def _loop_numbers(name, rows, seconds, config, prompt_len, batch, peak_tflops):
    """Per-step means over the steps after the first (compilation, allocator growth), said: generation tokens/s, the
    update's MFU (forward + backward = 3 forwards, recompute not counted), peak memory, the log-prob gap."""
    steps = [row for step, row in rows.items() if step > 1] or [row for step, row in rows.items() if step > 0]
    mean = lambda key: float(np.mean([row[key] for row in steps if key in row]))  # noqa: E731
    length = mean("response/length_mean")
    flops = 3 * _forward_flops(config, [round(prompt_len + length)] * batch, batch * round(length))
    mfu = f", update MFU {100 * flops / mean('time/update') / (peak_tflops * 1e12):.1f}%" if peak_tflops else ""
    print(f"{name}: {seconds:.0f} s in all, {mean('time/step'):.2f} s/step, generation "
          f"{mean('throughput/tokens_per_second'):.0f} tokens/s (responses {length:.0f} tokens), update "
          f"{mean('time/update'):.2f} s{mfu}, peak memory {max(r.get('memory/peak_gib', 0) for r in steps):.2f} GiB, "
          f"trainer-vs-engine log-prob gap mean {mean('policy/logprob_gap_mean'):.2e} max "
          f"{max(r['policy/logprob_gap_max'] for r in steps):.2e}, step 1's grad norm "
          f"{rows[1]['policy/grad_norm']:.2e}", flush=True)


def decode_speeds(model, batch, response_len):
    """The transformers engine alone on the toy's first prompts (a random model: every row runs its full length), in
    ms a token: compile off beside auto (the one-token step under CUDA graphs on a GPU, eager on a CPU), timed on
    the third call (the first compiles and records, the second replays over the same cache, as spo.py's steps do).
    Run as `--part decode` in a child process: its CUDA context and graph pool leave with it."""
    import torch
    from hf_engine import HFEngine
    from machinery.data import load_dataset, load_tokenizer
    with tempfile.TemporaryDirectory() as root:
        prompts = load_dataset(write_toy_jsonl(root)[0], load_tokenizer(TOY_MODEL), 256, False).prompt_ids[:batch]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for label, compile_model in (("compile off", False), ("auto", None)):
        engine = HFEngine(model, seed=0, max_model_len=max(map(len, prompts)) + response_len, device=device,
                          compile_model=compile_model)
        for _ in range(1 + 2 * engine.compiled):
            start = time.time()
            engine.generate(prompts, range(len(prompts)), max_tokens=response_len)
        print(f"decode, {len(prompts)} rows x {response_len} tokens, {label}: "
              f"{1000 * (time.time() - start) / response_len:.1f} ms a token", flush=True)
        del engine


def trained_weights(run_dir, step):
    """The fp32 weights of run_dir's checkpoint at `step`, from its DCP shards (the HF export is bf16 on a GPU, too
    coarse to show a learning rate's steps); the run's checkpoints are then removed, to leave the disk to the next."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    shards = os.path.join(run_dir, "checkpoints", f"step_{step:06d}", "shards")
    weights = {key: torch.empty(m.size, dtype=m.properties.dtype)
               for key, m in dcp.FileSystemReader(shards).read_metadata().state_dict_metadata.items()
               if key.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    warnings.filterwarnings("ignore", "torch.distributed is disabled")  # (none here: read as a world of one)
    dcp.load(weights, checkpoint_id=shards)
    shutil.rmtree(os.path.join(run_dir, "checkpoints"))
    return weights


def run_gap(run, other, steps):
    """Between two runs' (metrics rows, fp32 weights): the largest |difference| of a training metric over `steps`,
    and the largest and the mean |difference| of a weight at the end (0, 0, 0: the same run)."""
    (rows_a, wa), (rows_b, wb) = run, other
    metric = max((abs(rows_a[s][k] - rows_b[s][k]) for s in steps for k in rows_a[s] if k.startswith(SAME_FIELDS)),
                 default=float("nan"))
    diffs = [(wa[k] - wb[k]).abs() for k in wa]
    mean = sum(float(d.sum()) for d in diffs) / sum(d.numel() for d in diffs)
    return metric, max(float(d.max()) for d in diffs), mean


def disk_need(shape, on_gpu):
    """Bytes (b) holds on the disk at once: the random-weight model (bf16) and, while the stopped run resumes, its
    two checkpoints (run_dir.checkpoint_bytes: fp32 weights and AdamW moments, the export in bf16 on a GPU and fp32
    on a CPU); each run's checkpoints are removed once its weights are read. A tied head is one tensor, once."""
    from transformers import AutoConfig
    from machinery import memory
    from machinery.run_dir import checkpoint_bytes
    config = AutoConfig.for_model("qwen3", vocab_size=151_936, **QWEN3_SHAPES[shape])
    n_parameters = memory.model_shape(None, config).parameters  # (parameters() yields a tied tensor once)
    return 2 * n_parameters + 2 * checkpoint_bytes(n_parameters, 2 if on_gpu else 4)


def whole_loop(root, shape="0.6b", response_len=128, batch=64, steps=2, toy_steps=2, peak_tflops=None,
               budget_s=None):
    """(b) spo.py end to end with the transformers engine (module docstring), in root; exit 1 where a run did not
    finish. budget_s: every spo.py run's time budget (None: RUN_BUDGET_S's)."""
    from transformers import AutoConfig
    from machinery.data import load_dataset, load_tokenizer
    t0, budget = time.time(), {kind: budget_s or s for kind, s in RUN_BUDGET_S.items()}
    name = _device_name()
    peak_tflops = device_peak(name, peak_tflops)
    if (free := shutil.disk_usage(root).free) < (need := disk_need(shape, on_gpu=name is not None)):
        fail(f"--loop_shape {shape}: {root} has {free / 2**30:.0f} GiB free, the runs' checkpoints need about "
             f"{need / 2**30:.0f} GiB; set TMPDIR to a larger disk or use a smaller --loop_shape", once=True)
    print(f"(b) the whole loop in {root} ({free / 2**30:.0f} GiB free, about {need / 2**30:.1f} needed), device "
          f"{name or 'cpu'}; spo.py time budgets: {', '.join(f'{k} {v:.0f} s' for k, v in budget.items())}", flush=True)
    train, test = write_toy_jsonl(root)
    common = ["--train", train, "--test", test, "--engine", "hf", "--log_every", "1"]
    prompt_ids = load_dataset(train, load_tokenizer(TOY_MODEL), 256, False).prompt_ids
    prompt_len = float(np.mean([len(ids) for ids in prompt_ids]))
    # The toy: its model learns, and the held-out evaluation runs on the engine.
    rows, seconds = _spo(os.path.join(root, "toy"), ["--model", TOY_MODEL, *common, "--offline_values", "none",
                                                     "--steps", str(toy_steps), "--eval_every", str(toy_steps),
                                                     "--eval_max_prompts", "200", "--save_every", "0"], budget["toy"])
    if rows:
        _loop_numbers(f"toy, --engine hf, {toy_steps} steps, held-out {rows[0]['eval/accuracy']:.1%} -> "
                      f"{rows[toy_steps]['eval/accuracy']:.1%}", rows, seconds, AutoConfig.from_pretrained(TOY_MODEL),
                      prompt_len, 64, peak_tflops)
    # A Qwen3 shape with random weights, long responses and spo.py's GPU defaults (bf16 with fp32 master weights,
    # gradient checkpointing, chunked log-probs, its token budget per micro-batch) and random v0 (random_values):
    # two fresh runs, then one stopped at a checkpoint halfway and resumed.
    model = random_qwen3(os.path.join(root, f"qwen3-{shape}"), shape, 512 + response_len)
    try:
        subprocess.run([sys.executable, "-m", "bench", "gpu", "--part", "decode", "--decode_model", model,
                        "--loop_batch", str(batch), "--loop_response_len", str(response_len)], cwd=REPO,
                       timeout=budget["decode"], check=True)
    except (subprocess.SubprocessError, OSError) as e:
        print(f"decode speeds failed: {e}", flush=True)
    values = random_values(os.path.join(root, "values.json"), train, response_len, model)
    # the engine eager here: CUDA graphs ran on the toy and in the decode's child; each process would trace again
    flags = ["--model", model, *common, "--offline_values", values, "--batch_size", str(batch), "--max_response_len",
             str(response_len), "--max_prompt_len", "64", "--lr", "1e-6", "--eval_every", "0", "--compile", "off"]
    runs = {}  # run: (metrics rows, fp32 weights at the end)
    for run in ("fresh_1", "fresh_2"):
        rows, seconds = _spo(os.path.join(root, run), flags + ["--steps", str(steps), "--save_every", "0"],
                             budget["fresh"])
        if rows and not runs:
            _loop_numbers(f"Qwen3-{shape} shape (random weights), --engine hf --compile off, {batch} x "
                          f"{response_len} tokens, {steps} steps", rows, seconds, AutoConfig.from_pretrained(model),
                          prompt_len, batch, peak_tflops)
        if rows:
            runs[run] = rows, trained_weights(os.path.join(root, run), steps)
    stopped, half = os.path.join(root, "stopped"), ["--save_every", str(steps // 2)]
    if _spo(stopped, flags + ["--steps", str(steps // 2)] + half, budget["stopped"])[0]:
        rows, _ = _spo(stopped, flags + ["--steps", str(steps)] + half, budget["resumed"], resume=True)
        if rows:
            runs["resumed"] = rows, trained_weights(stopped, steps)
    for run, said, over in (("fresh_2", "two fresh runs (the floor: the device's own nondeterminism)", range(steps)),
                            ("resumed", f"stopped at step {steps // 2} and --resume'd, against fresh_1",
                             range(steps // 2, steps))):
        if "fresh_1" in runs and run in runs:
            metric, largest, mean = run_gap(runs["fresh_1"], runs[run], [step + 1 for step in over])
            print(f"{said}: largest difference of a training metric {metric:.2e}, of an fp32 weight after step "
                  f"{steps} {largest:.2e} (mean {mean:.2e}; --lr 1e-6)", flush=True)
    print(f"(b) took {time.time() - t0:.0f} s in all", flush=True)
    if failed := [run for run in ("fresh_1", "fresh_2", "resumed") if run not in runs]:
        print(f"(b) incomplete: {', '.join(failed)} did not finish (above), so not everything is compared", flush=True)
        sys.exit(1)


def vllm_runners(run_root, steps=2):
    """spo.py on the toy under each of vLLM's model runners and the trainer-vs-engine log-prob gap of each: vLLM's
    V2 runner (its default on CUDA since 0.3x) has never run this code, and a weight push it did not take, or
    log-probs it processes otherwise, shows as a gap far above V1's. Skipped, in one line, without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        print("vLLM model runners V1 / V2: skipped (vLLM is not installed here)", flush=True)
        return
    for runner, flag in {"V1": "0", "V2": "1"}.items():  # VLLM_USE_V2_MODEL_RUNNER (unset: V2 where supported)
        rows, _ = _spo(os.path.join(run_root, f"runner_{runner}"),
                       ["--steps", str(steps), "--eval_every", "0", "--save_every", "0", "--offline_values", "none",
                        "--compile", "off", "--log_every", "1"], 600,
                       env={"VLLM_USE_V2_MODEL_RUNNER": flag})  # vLLM refuses expandable segments
        if rows:
            rows = [row for step, row in rows.items() if step]
            print(f"vLLM model runner {runner}: {steps} steps, trainer-vs-engine log-prob gap mean "
                  f"{np.mean([r['policy/logprob_gap_mean'] for r in rows]):.2e}, max "
                  f"{max(r['policy/logprob_gap_max'] for r in rows):.2e}", flush=True)


def tee(argv, path):
    """This command again in a child, unbuffered, with TORCH_LOGS=recompiles,cudagraphs: every line to the console and
    to `path` as it comes (a timeout leaves the file whole up to there). Exits with its code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    at = argv.index("--log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_LOGS": "recompiles,cudagraphs"}
    with open(path, "a") as log, subprocess.Popen([sys.executable, "-m", "bench", "gpu", *argv[:at], *argv[at + 2:]],
                                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                  text=True) as proc:
        for line in proc.stdout:
            for out in (sys.stdout, log):
                out.write(line)
                out.flush()
    sys.exit(proc.returncode)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench gpu", description="the GPU device check, two commands: "
                                     "--part trainer, --part loop (docs/benchmarks.md#the-gpu-device-check)")
    parser.add_argument("--part", choices=["trainer", "loop", "vllm", "decode"], required=True,
                        help="(a) the trainer path, (b) spo.py's whole loop, or spo.py under vLLM's two model runners "
                             "(decode: (b)'s child)")
    parser.add_argument("--log", help="also write every line to this file (TORCH_LOGS=recompiles,cudagraphs)")
    parser.add_argument("--decode_model", help=argparse.SUPPRESS)  # --part decode's model
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="the device's dense bf16 peak (default: known for H100, H200, A100, L40S, L4, A10)")
    parser.add_argument("--shape", choices=sorted(QWEN3_SHAPES), default="1.7b", help="(a): the model's shape")
    parser.add_argument("--prompts", type=int, default=8, help="(a): prompts per round (over all ranks)")
    parser.add_argument("--samples", type=int, default=8, help="(a): responses per prompt, sharing it")
    for flag, lens in (("--prompt_lens", [64, 512]), ("--response_lens", [200, 900])):
        parser.add_argument(flag, type=int, nargs=2, default=lens, metavar=("LOW", "HIGH"), help="(a): tokens, drawn")
    parser.add_argument("--rounds", type=int, default=3, help="(a): old log-probs + PPO step, the first timed apart")
    parser.add_argument("--max_tokens_per_micro_batch", type=int, default=2048,
                        help="(a): the micro-batch token budget (spo.py's default)")
    parser.add_argument("--profile", choices=["on", "off"], default="on",
                        help="(a): one more PPO step under torch.profiler: device busy time, host syncs, top ops")
    parser.add_argument("--loop_shape", choices=sorted(QWEN3_SHAPES), default="0.6b", help="(b): the model's shape")
    parser.add_argument("--loop_response_len", type=int, default=128, help="(b): tokens per response")
    parser.add_argument("--loop_batch", type=int, default=64, help="(b): responses per step")
    parser.add_argument("--loop_steps", type=int, default=2, help="(b): steps of the random-weight runs (even)")
    parser.add_argument("--toy_steps", type=int, default=2, help="(b): steps of the toy run")
    parser.add_argument("--run_budget_s", type=float, default=None,
                        help="(b): every spo.py run's time budget (default: bench/gpu.py:RUN_BUDGET_S, per run)")
    args = parser.parse_args(argv)
    if args.log:
        return tee(argv, args.log)
    if args.part == "loop" and (args.loop_steps < 2 or args.loop_steps % 2):
        fail(f"--loop_steps {args.loop_steps}: give an even number of at least 2 (the resume check stops halfway)")
    if args.part == "decode":
        return decode_speeds(args.decode_model, args.loop_batch, args.loop_response_len)
    if args.part == "trainer":
        bench_gpu(args.shape, args.prompts, args.samples, args.prompt_lens, args.response_lens, args.rounds,
                  args.max_tokens_per_micro_batch, peak_tflops=args.peak_tflops, profile=args.profile == "on")
        return
    # a `timeout` or the GPU time running out: the spo.py running (its own process group) killed, the directory removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as root:
        if args.part == "loop":
            whole_loop(root, args.loop_shape, args.loop_response_len, args.loop_batch, args.loop_steps,
                       args.toy_steps, args.peak_tflops, args.run_budget_s)
        else:
            vllm_runners(root)


if __name__ == "__main__":
    main()
