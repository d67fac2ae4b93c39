"""The device check: spo.py's GPU path, measured with only torch and transformers (a GPU machine may lack vLLM).

(a) The trainer path: a random-weight Qwen3 shape loaded by trainer.build_policy (FSDP2, bf16 compute, fp32 master
weights, gradient checkpointing); after `--warmup` untimed rounds, one old-log-prob pass and one PPO step over long
responses in token-budget micro-batches: the micro-batches each rank runs, tokens/s, MFU and HFU against the
device's dense bf16 peak, peak memory, and the bf16-vs-fp32 log-prob gap of the same weights.
(b) The whole loop: spo.py `--engine hf` on the toy, then on a random-weight Qwen3 shape with long responses,
checkpointed, and the same run stopped halfway and resumed, against the straight one.
(6) Where vLLM imports on a GPU: spo.py for two steps on the toy under each of vLLM's model runners (V1 and V2), the
trainer-vs-engine log-prob gap of each.
This is the one command a GPU lease runs; "tiny" shapes run it on a CPU (tests/test_device_check.py). A shape that
cannot fit (`--shape 8b` on one GPU: 122 GiB of fp32 weights, gradients and AdamW moments) is refused in one line.

    python -m bench gpu          # one GPU: (a) Qwen3-1.7B shape, 4 x 8704 tokens; (b) toy, Qwen3-0.6B 64 x 512
    python -m bench gpu --parts trainer --shape tiny --response_len 96 --sequences 3 --max_tokens_per_micro_batch 700
    python -m bench gpu --parts loop --loop_shape tiny --loop_response_len 16 --loop_batch 4 --toy_steps 2   # CPU
"""
import argparse
import collections
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.parts import _peak_rss_bytes
from machinery.errors import fail


QWEN3_SHAPES = {  # Qwen3's published shapes; "tiny" keeps the vocabulary (the log-prob chunks) for a CPU test
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
}
# Dense bf16 tensor-core peaks in TFLOPS, by device name (torch.cuda.get_device_name; the first whole-word match
# wins): half NVIDIA's datasheet figures, which are "with sparsity" (H100 SXM and H200 SXM: 1,979; H100 PCIe:
# 1,513; H100 NVL and H200 NVL: 1,671; A100: 624; L40S: 733; L40: 362; L4: 242; A10: 250).
BF16_PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.0),
                    ("H200", 989.0), ("GH200", 989.0), ("A100", 312.0), ("L40S", 362.0), ("L40", 181.0),
                    ("L4", 121.0), ("A10", 125.0)]


def dense_bf16_peak(device_name):
    return next((peak for key, peak in BF16_PEAK_TFLOPS if re.search(rf"\b{re.escape(key)}\b", device_name)), None)


def device_peak(name, peak_tflops=None):
    """--peak_tflops, else the device's known peak (one line and exit 2 for a GPU not known); None on a CPU."""
    if not name or name == "cpu":
        return None
    if (peak := peak_tflops or dense_bf16_peak(name)) is None:
        fail(f"--peak_tflops: no dense bf16 peak is known for {name!r}; pass its datasheet's dense bf16 TFLOPS "
             f"(without sparsity)", once=True)
    return peak


def _forward_flops(config, sequences, prompt_len):
    """Model FLOPs of one forward over `sequences` (prompt + response token lists): 2 per weight per token for
    the decoder's matrices, causal attention (QK^T and AV), and the output projection at response positions."""
    h, layers = config.hidden_size, config.num_hidden_layers
    attn = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_token = layers * (2 * h * (attn + 2 * kv) + 2 * attn * h + 3 * 2 * h * config.intermediate_size)
    return float(sum(per_token * n + layers * 2 * attn * n * n  # causal attention: half of 2 x 2 x n^2 x attn
                     + 2 * h * config.vocab_size * (n - prompt_len) for n in sequences))  # the head: responses only


def _micro_batches_said(lengths, world, rank, max_tokens):
    """What each rank really runs: its share of the sequences (dealt by tokens, as the trainer does) packed under
    the token budget, e.g. "4 micro-batches on rank 0: 4 x (1 sequence of 8704 tokens)"."""
    from machinery.batching import assign_by_tokens, plan_micro_batches
    mine = [n for n, owner in zip(lengths, assign_by_tokens(lengths, world)) if owner == rank]
    plan = plan_micro_batches(mine, 64, max_tokens)
    kinds = collections.Counter((len(group), mine[group[0]]) for group in plan)  # longest first in each
    said = ", ".join(f"{count} x ({k} sequence{'s' * (k > 1)} of {n} tokens)" for (k, n), count in kinds.items())
    return f"{len(plan)} micro-batches on rank {rank}: {said} (budget {max_tokens} tokens, padding included)"


def _refuse_what_cannot_fit(config, shape, world, on_gpu, tokens):
    """One line and exit 2, before anything is built, where machinery/memory.py's estimate of a rank is too big."""
    from machinery import memory
    model = memory.model_shape(None, config)
    items = memory.rank_memory(model, world=world, tokens=tokens, on_gpu=on_gpu, gradient_checkpointing=on_gpu,
                               layer_units=on_gpu, engine=False)
    have = memory.available_per_rank(on_gpu, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if items["peak"] > have:
        fail(f"--shape {shape}: one rank needs about {items['peak'] / memory.GIB:.0f} GiB (fp32 master weights, "
             f"gradients and AdamW moments alone take {items['trainer state (sharded)'] / memory.GIB:.0f} GiB for "
             f"{model.parameters / 1e9:.2f}B parameters on {world} rank(s)) but has {have / memory.GIB:.0f} GiB; use "
             f"a smaller --shape or more GPUs (torchrun --nproc_per_node)", once=True)


def bench_gpu(shape="1.7b", response_len=8192, prompt_len=512, n_sequences=4, max_tokens=16384, warmup=1,
              peak_tflops=None):
    """(a) The trainer path spo.py runs on a GPU, without vLLM (module docstring); returns the numbers."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    import spo
    from machinery import batching, memory, trainer
    from rollout import Rollout
    rank, world, device = trainer.setup_distributed()
    on_gpu = device.type == "cuda"
    config = Qwen3Config(vocab_size=151_936, max_position_embeddings=prompt_len + response_len, rope_theta=1e6,
                         **QWEN3_SHAPES[shape])
    lengths = [prompt_len + response_len] * n_sequences
    _refuse_what_cannot_fit(config, shape, world, on_gpu,
                            memory.tokens_per_forward(64, max_tokens, max(1, n_sequences // world), lengths[0]))
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    peak_tflops = device_peak(name, peak_tflops)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    def peak(run):  # (peak bytes allocated by torch, bytes in use on the device after it: total - free)
        if not on_gpu:
            return _peak_rss_bytes(run), None
        torch.cuda.reset_peak_memory_stats()
        run()
        free, total = torch.cuda.mem_get_info()
        return torch.cuda.max_memory_allocated(), total - free
    with tempfile.TemporaryDirectory() as path:
        t0 = time.time()
        torch.manual_seed(0)
        with torch.device(device):  # every rank its own copy (its own temporary directory), the same weights
            Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
        t1 = time.time()
        policy, optimizer = trainer.build_policy(path, device, lr=1e-6, weight_decay=0.01)
        sync()
        init_s, load_s = t1 - t0, time.time() - t1
        rng = np.random.default_rng(rank)
        rollouts = [Rollout(rng.integers(0, config.vocab_size, prompt_len).tolist(),
                            rng.integers(0, config.vocab_size, response_len).tolist(), [0.0] * response_len, "",
                            "length") for _ in range(max(1, n_sequences // world))]
        # the same weights in fp32, unsharded, before any update: how far the bf16 log-probs are from full precision
        reference = trainer.attach_logprob_forward(Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
                                                   .to(device))
        n_params = sum(p.numel() for p in reference.parameters())
        ids, mask = batching.pack([(r.prompt_ids, r.response_ids, r.response_mask) for r in rollouts[:1]], device)
        with torch.no_grad():
            fp32, _ = trainer.token_logprobs(reference, ids, mask, 1.0)
        bf16 = trainer.old_logprobs(policy, rollouts, [], 1.0, 64, max_tokens)["batch"][0]
        gap = np.abs(fp32[0, prompt_len - 1:].cpu().numpy() - bf16)
        del reference, fp32
        torch.cuda.empty_cache()  # (nothing on a CPU)
    loss_fn = functools.partial(spo.ppo_clip_loss, clip_low=0.2, clip_high=0.28, dual_clip=10.0)
    out, seconds = {}, {}

    def run(phase):
        t0 = time.time()
        out[phase] = (trainer.old_logprobs(policy, rollouts, [], 1.0, 64, max_tokens) if phase == "old" else
                      trainer.ppo_update(policy, optimizer, rollouts, out["old"]["batch"],
                                         rng.choice([-1.0, 1.0], len(rollouts)), loss_fn, ppo_steps=1,
                                         micro_batch_size=64, temperature=1.0, grad_clip=1.0, max_tokens=max_tokens))
        sync()
        seconds[phase] = time.time() - t0
    for _ in range(warmup):  # kernels chosen, the allocator grown, caches warm: not timed
        run("old")
        run("update")
    peaks = {phase: peak(functools.partial(run, phase)) for phase in ("old", "update")}
    tokens = len(rollouts) * world * (prompt_len + response_len)
    flops = _forward_flops(config, lengths, prompt_len)
    say = functools.partial(print, flush=True) if rank == 0 else (lambda *a, **k: None)
    say(f"Qwen3-{shape} shape ({n_params / 1e9:.2f}B parameters), {n_sequences} x ({prompt_len} + {response_len}) "
        f"tokens, device {name}, world {world}; {_micro_batches_said(lengths, world, rank, max_tokens)}")
    say(f"random init + save {init_s:.1f} s, build_policy (load + FSDP2) {load_s:.1f} s, {warmup} warm-up round(s) "
        "not timed")
    # MFU counts the model's FLOPs only: forward, and backward at twice the forward. HFU also counts the recompute:
    # every decoder layer and log-prob chunk runs forward again in the backward (gradient checkpointing).
    for phase, (mfu, hfu) in (("old", (1, 1)), ("update", (3, 4))):
        per_s = flops / seconds[phase] / (world * peak_tflops * 1e12) if on_gpu else 0.0
        rates = f", MFU {100 * mfu * per_s:.1f}%, HFU {100 * hfu * per_s:.1f}%" if on_gpu else ""
        on_card = f" ({peaks[phase][1] / 2**30:.2f} GiB in use on the device)" if on_gpu else ""
        say(f"{'old log-probs' if phase == 'old' else 'PPO step':14s} {seconds[phase]:7.2f} s  "
            f"{tokens / seconds[phase]:9.0f} tokens/s{rates}  peak memory {peaks[phase][0] / 2**30:.2f} GiB"
            f"{on_card}")
    say(f"bf16 vs fp32 log-probs (response tokens): mean |gap| {gap.mean():.2e}, max {gap.max():.2e}; "
        f"loss {out['update']['loss']:.4f}, grad norm {out['update']['grad_norm']:.3f}")
    torch.distributed.destroy_process_group()
    return {"seconds": seconds, "memory": peaks, "gap_mean": float(gap.mean()), "gap_max": float(gap.max()),
            "stats": out["update"]}


# ------------------------------------------------------------------------------------------------ (b) the whole loop
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY_MODEL = os.path.join(REPO, "tasks", "built", "toy", "model")
SAME_FIELDS = ("reward/", "advantage/", "response/", "policy/", "signal/", "tracker/", "sampling/")  # resume check


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


def _spo(run_dir, flags, deadline, resume=False, env=None, must=True):
    """spo.py in a world of one, its output in run_dir.log, `env` added, killed past deadline[1]: ({step: metrics
    row}, seconds). A failure prints the log's tail and ends the check (must), else gives None rows."""
    command = [sys.executable, "spo.py", *flags, "--resume" if resume else "--run_dir", run_dir]
    print(f"  +{time.time() - deadline[0]:.0f} s: spo.py {'--resume ' if resume else ''}{os.path.basename(run_dir)}",
          flush=True)
    t0 = time.time()
    # expandable segments: the transformers engine's KV cache grows by one token per step, and without them the
    # caching allocator keeps every outgrown block (memory/peak_gib would read the fragments, not the need).
    env = _child_env(**({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if env is None else env))
    with open(run_dir + ".log", "w") as log:
        try:
            code = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=max(1.0, deadline[1] - time.time())).returncode
        except subprocess.TimeoutExpired:
            code = "killed at the time budget (--loop_budget_s)"
    if code != 0:
        with open(run_dir + ".log", errors="replace") as log:
            print(log.read()[-5000:], flush=True)
        if must:
            fail(f"`{' '.join(command)}` failed ({code}); the end of its output is above", once=True)
        print(f"spo.py {os.path.basename(run_dir)} failed ({code}); the end of its output is above", flush=True)
        return None, time.time() - t0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = {row["step"]: row for row in map(json.loads, f)}
    return rows, time.time() - t0


def _loop_numbers(name, rows, seconds, config, prompt_len, batch, peak_tflops):
    """Per-step means over the steps after the first (compilation, allocator growth), said and returned: generation
    tokens/s, the update's MFU (forward + backward = 3 forwards, recompute not counted), peak memory, the gap."""
    steps = [row for step, row in rows.items() if step > 1] or [row for step, row in rows.items() if step > 0]
    mean = lambda key: float(np.mean([row[key] for row in steps if key in row]))  # noqa: E731
    length = mean("response/length_mean")
    flops = 3 * _forward_flops(config, [round(prompt_len + length)] * batch, round(prompt_len))
    mfu = flops / mean("time/update") / (peak_tflops * 1e12) if peak_tflops else None
    n = {"generate_tokens_per_s": mean("throughput/tokens_per_second"), "update_s": mean("time/update"),
         "step_s": mean("time/step"), "mfu": mfu, "peak_gib": max(r.get("memory/peak_gib", 0) for r in steps),
         "gap_mean": mean("policy/logprob_gap_mean"), "gap_max": max(r["policy/logprob_gap_max"] for r in steps),
         "response_len": length}
    mfu_said = f", update MFU {100 * mfu:.1f}%" if mfu is not None else ""
    print(f"{name}: {seconds:.0f} s in all, {n['step_s']:.2f} s/step, generation {n['generate_tokens_per_s']:.0f} "
          f"tokens/s (responses {length:.0f} tokens), update {n['update_s']:.2f} s{mfu_said}, peak memory "
          f"{n['peak_gib']:.2f} GiB, trainer-vs-engine log-prob gap mean {n['gap_mean']:.2e} max {n['gap_max']:.2e}",
          flush=True)
    return n


def resume_gap(straight, stopped, resumed, steps):
    """How far a run stopped at steps // 2 and resumed is from the one never stopped: the largest difference of a
    training metric over the resumed steps and of a weight at the end (0 and 0: exact), and, the floor a device's
    nondeterministic kernels set, the largest metric difference over the two fresh runs' common first steps."""
    from safetensors.torch import load_file
    (rows_a, dir_a), (rows_b, dir_b) = straight, resumed

    def metric_gap(other, over):  # the largest difference from the straight run's metrics over those steps
        return max((abs(rows_a[s][k] - other[s].get(k, float("nan"))) for s in over for k in rows_a[s]
                    if k.startswith(SAME_FIELDS)), default=float("nan"))
    metric, floor = metric_gap(rows_b, range(steps // 2 + 1, steps + 1)), metric_gap(stopped, range(1, steps // 2 + 1))
    wa, wb = ({k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors") for k, v in
               load_file(os.path.join(d, f)).items()}
              for d in (os.path.join(run, "checkpoints", f"step_{steps:06d}", "model") for run in (dir_a, dir_b)))
    weight = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    return metric, weight, floor


def whole_loop(root, shape="0.6b", response_len=512, batch=64, steps=2, toy_steps=4, peak_tflops=None,
               budget_s=360.0):
    """(b) spo.py end to end with the transformers engine (module docstring), in root; returns the numbers."""
    from transformers import AutoConfig
    from machinery.run_dir import checkpoint_bytes
    from machinery.data import load_dataset, load_tokenizer
    deadline = (time.time(), time.time() + budget_s)
    name = _device_name()
    peak_tflops = device_peak(name, peak_tflops)
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
    prompt_len = float(np.mean([len(ids) for ids in
                                load_dataset(train, load_tokenizer(TOY_MODEL), 256, False).prompt_ids]))
    out = {}
    # The toy: its model learns, and the held-out evaluation runs on the engine.
    rows, seconds = _spo(os.path.join(root, "toy"), ["--model", TOY_MODEL, *common, "--steps", str(toy_steps),
                                                     "--eval_every", str(toy_steps), "--eval_max_prompts", "200",
                                                     "--save_every", "0"], deadline)
    held_out = (rows[0]["eval/accuracy"], rows[toy_steps]["eval/accuracy"])
    out["toy"] = _loop_numbers(f"toy, --engine hf, {toy_steps} steps, held-out {held_out[0]:.1%} -> "
                               f"{held_out[1]:.1%}", rows, seconds, AutoConfig.from_pretrained(TOY_MODEL),
                               prompt_len, 64, peak_tflops) | {"held_out": held_out}
    # A Qwen3 shape with random weights, long responses and spo.py's GPU defaults (bf16 with fp32 master weights,
    # gradient checkpointing, chunked log-probs); then the same run stopped at a checkpoint halfway and resumed.
    model = random_qwen3(os.path.join(root, f"qwen3-{shape}"), shape, 512 + response_len)
    flags = ["--model", model, *common, "--batch_size", str(batch), "--max_response_len", str(response_len),
             "--max_prompt_len", "64", "--lr", "1e-6", "--eval_every", "0"]
    straight = _spo(os.path.join(root, "straight"), flags + ["--steps", str(steps), "--save_every", "0"], deadline)
    out["qwen3"] = _loop_numbers(f"Qwen3-{shape} shape (random weights), --engine hf, {batch} x {response_len} "
                                 f"tokens, {steps} steps", *straight, AutoConfig.from_pretrained(model), prompt_len,
                                 batch, peak_tflops)
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


def vllm_runners(run_root, steps=2):
    """(6) spo.py on the toy under each of vLLM's model runners and the trainer-vs-engine log-prob gap of each:
    vLLM's V2 runner (its default on CUDA since 0.3x) has never run this code, and a weight push it did not take,
    or log-probs it processes otherwise, shows as a gap far above V1's. Skipped, in one line, without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        print("vLLM model runners V1 / V2: skipped (vLLM is not installed here)", flush=True)
        return None
    gaps, deadline = {}, (time.time(), time.time() + 3600)
    for runner, flag in {"V1": "0", "V2": "1"}.items():  # VLLM_USE_V2_MODEL_RUNNER (unset: V2 where supported)
        rows, _ = _spo(os.path.join(run_root, f"runner_{runner}"),
                       ["--steps", str(steps), "--eval_every", "0", "--save_every", "0", "--offline_values", "none",
                        "--engine_compile", "off", "--log_every", "1"], deadline,
                       env={"VLLM_USE_V2_MODEL_RUNNER": flag}, must=False)  # vLLM refuses expandable segments
        gaps[runner] = rows and (float(np.mean([r["policy/logprob_gap_mean"] for r in rows.values() if r["step"]])),
                                 max(r["policy/logprob_gap_max"] for r in rows.values() if r["step"]))
        if rows:
            print(f"vLLM model runner {runner}: {steps} steps, trainer-vs-engine log-prob gap mean "
                  f"{gaps[runner][0]:.2e}, max {gaps[runner][1]:.2e}", flush=True)
    return gaps


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench gpu", description="the trainer path on one device "
                                     "without vLLM, and vLLM's two model runners where vLLM is installed")
    parser.add_argument("--shape", choices=sorted(QWEN3_SHAPES), default="1.7b", help="the model's shape")
    parser.add_argument("--response_len", type=int, default=8192, help="tokens per response")
    parser.add_argument("--sequences", type=int, default=4, help="responses in the batch (over all ranks)")
    parser.add_argument("--max_tokens_per_micro_batch", type=int, default=16384, help="micro-batch token budget")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds (old log-probs + PPO step) first")
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="the device's dense bf16 peak (default: known for H100, H200, A100, L40S, L4, A10)")
    parser.add_argument("--vllm_runners", choices=["auto", "on", "off"], default="auto",
                        help="spo.py on the toy under vLLM's V1 and V2 model runners (auto: on a GPU)")
    parser.add_argument("--parts", nargs="+", choices=["trainer", "loop"], default=["trainer", "loop"],
                        help="(a) the trainer path, (b) spo.py's whole loop with the transformers engine")
    parser.add_argument("--loop_shape", choices=sorted(QWEN3_SHAPES), default="0.6b",
                        help="(b): the random-weight model's shape (its checkpoints must fit on the disk twice)")
    parser.add_argument("--loop_response_len", type=int, default=512, help="(b): tokens per response")
    parser.add_argument("--loop_batch", type=int, default=64, help="(b): responses per step")
    parser.add_argument("--loop_steps", type=int, default=2, help="(b): steps of the random-weight runs (even)")
    parser.add_argument("--toy_steps", type=int, default=4, help="(b): steps of the toy run")
    parser.add_argument("--loop_budget_s", type=float, default=360.0,
                        help="(b): every spo.py run is killed this many seconds after (b) starts")
    args = parser.parse_args(argv)
    if args.loop_steps < 2 or args.loop_steps % 2:
        fail(f"--loop_steps {args.loop_steps}: give an even number of at least 2 (the resume check stops halfway)")
    if "trainer" in args.parts and "loop" in args.parts:
        # (a) in a process of its own (these flags, the last --parts winning), so that this one never makes a CUDA
        # context: (b)'s spo.py runs must find the device as a user's would (nothing else's memory on it, and a
        # card in exclusive-process mode free)
        code = subprocess.run([sys.executable, "-m", "bench", "gpu", *(sys.argv[1:] if argv is None else argv),
                               "--parts", "trainer", "--vllm_runners", "off"], env=_child_env()).returncode
        if code:
            sys.exit(code)  # (its refusal or traceback is above)
    elif "trainer" in args.parts:
        bench_gpu(args.shape, args.response_len, n_sequences=args.sequences,
                  max_tokens=args.max_tokens_per_micro_batch, warmup=args.warmup, peak_tflops=args.peak_tflops)
    if "loop" in args.parts:
        with tempfile.TemporaryDirectory() as root:
            whole_loop(root, args.loop_shape, args.loop_response_len, args.loop_batch, args.loop_steps,
                       args.toy_steps, args.peak_tflops, args.loop_budget_s)
    import torch
    if args.vllm_runners == "on" or (args.vllm_runners == "auto" and torch.cuda.is_available()):
        with tempfile.TemporaryDirectory() as run_root:
            vllm_runners(run_root)


if __name__ == "__main__":
    main()
