"""The device check: spo.py's GPU path, measured with only torch and transformers (a GPU machine may lack vLLM).

Two commands, each planned to fit one command of a GPU lease with time left to rerun one (docs/benchmarks.md: what
to run, how long it takes, what each number means). "tiny" shapes run both on a CPU (tests/test_device_check.py).
(a) `--part trainer`: a random-weight Qwen3 shape loaded by trainer.build_policy, then rounds of one old-log-prob pass
and one PPO step, each over a fresh batch of responses of random lengths in groups that share a prompt, cut and
packed by the trainer itself (token-budget micro-batches, batching.packed_row): most micro-batches bring attention
shapes not met before. The first round is timed apart: what is paid once (kernels, plans, the allocator's growth).
Also which attention kernel runs, MFU and HFU, peak memory, the bf16-vs-fp32 log-prob gap. A shape that cannot fit
is refused in one line.
(b) `--part loop`: spo.py `--engine hf` on the toy, then on a random-weight Qwen3 shape twice from scratch (their
difference: the device's own nondeterminism, the floor) and once stopped halfway and resumed (its difference from
the first, printed beside the floor); every spo.py run under its own time budget.
`--part vllm`, where vLLM imports on a GPU: spo.py on the toy under each of vLLM's model runners (V1 and V2).

    python -m bench gpu --part trainer    # one GPU: the Qwen3-1.7B shape
    python -m bench gpu --part loop       # one GPU: the toy, then the Qwen3-0.6B shape
"""
import argparse
import collections
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

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


def _forward_flops(config, lengths, head_tokens, decoder_tokens=None):
    """Model FLOPs of one forward: 2 per weight per token for the decoder's matrices over the tokens it runs
    (default: every token of `lengths`, the sequences' prompt + response lengths; a prompt shared in a packed row
    runs once), causal attention (QK^T and AV) over each whole sequence, the output projection at head_tokens."""
    h, layers = config.hidden_size, config.num_hidden_layers
    attn = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_token = layers * (2 * h * (attn + 2 * kv) + 2 * attn * h + 3 * 2 * h * config.intermediate_size)
    decoder_tokens = sum(lengths) if decoder_tokens is None else decoder_tokens
    return float(per_token * decoder_tokens + layers * 2 * attn * sum(n * n for n in lengths)  # causal: half of 4n^2
                 + 2 * h * config.vocab_size * head_tokens)


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


def shared_prompt_batch(rng, vocab, prompts, samples, prompt_lens, response_lens):
    """Rollouts of random tokens: `samples` responses to each of `prompts` prompts, every length drawn uniformly
    from its (low, high) range, both ends included."""
    from rollout import Rollout
    batch = []
    for _ in range(prompts):
        prompt = rng.integers(0, vocab, rng.integers(prompt_lens[0], prompt_lens[1] + 1)).tolist()
        for n in rng.integers(response_lens[0], response_lens[1] + 1, samples):
            batch.append(Rollout(prompt, rng.integers(0, vocab, n).tolist(), [0.0] * n, "", "length"))
    return batch


def attention_kernel(run, on_gpu):
    """Which attention runs: the SDPA backends enabled, the backend op torch dispatched to and, on a GPU, the first
    device kernel whose name says attention, from one profiled run()."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    enabled = [b for b in ("flash", "mem_efficient", "cudnn", "math")
               if getattr(torch.backends.cuda, f"{b}_sdp_enabled")()]
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_gpu) as prof:
        run()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    op = next((e.name for e in events if e.name.startswith("aten::_scaled_dot_product")), "none")
    kernel = next((e.name for e in events if e.device_type != torch.autograd.DeviceType.CPU
                   and re.search("flash|fmha|sdpa|attention|attn", e.name, re.I)), "none seen")
    return (f"SDPA backends enabled {', '.join(enabled)}; dispatched to {op}; "
            + (f"first attention kernel {kernel[:160]}" if on_gpu else "(a CPU runs no device kernel)"))


def bench_gpu(shape="1.7b", prompts=8, samples=8, prompt_lens=(64, 512), response_lens=(200, 900), rounds=5,
              max_tokens=2048, seed=0, peak_tflops=None):
    """(a) The trainer path spo.py runs on a GPU, without vLLM (module docstring)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import Qwen3Config, Qwen3ForCausalLM
    import spo
    from machinery import batching, memory, trainer
    from machinery.device import prefer_flash_attention
    started, (rank, world, device) = time.time(), trainer.setup_distributed()
    on_gpu = device.type == "cuda"
    prefer_flash_attention(on_gpu)  # as spo.py (setup_distributed calls it too): the attention it runs is measured
    longest, prompts = prompt_lens[1] + response_lens[1], max(1, prompts // world)  # this rank's prompts
    config = Qwen3Config(vocab_size=151_936, max_position_embeddings=longest, rope_theta=1e6, **QWEN3_SHAPES[shape])
    _refuse_what_cannot_fit(config, shape, world, on_gpu,
                            memory.tokens_per_forward(64, max_tokens, prompts * samples, longest))
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    peak_tflops = device_peak(name, peak_tflops)
    say = functools.partial(print, flush=True) if rank == 0 else (lambda *a, **k: None)
    with tempfile.TemporaryDirectory() as path:
        t0 = time.time()
        torch.manual_seed(0)
        with torch.device(device):  # every rank its own copy (its own temporary directory), the same weights
            Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
        t1 = time.time()
        policy, optimizer = trainer.build_policy(path, device, lr=1e-6, weight_decay=0.01)
    say(f"Qwen3-{shape} shape, device {name}, world {world}: random init + save {t1 - t0:.1f} s, build_policy (load "
        f"+ FSDP2) {time.time() - t1:.1f} s")

    def measure(run):  # (seconds, peak bytes: torch's on a GPU, resident growth on a CPU; bytes in use on the GPU)
        if not on_gpu:
            t0 = time.time()
            grown = _peak_rss_bytes(run)
            return time.time() - t0, grown, 0
        torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        run()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return time.time() - t0, torch.cuda.max_memory_allocated(), total - free
    rng = np.random.default_rng([seed, rank])
    batches = [shared_prompt_batch(rng, config.vocab_size, prompts, samples, prompt_lens, response_lens)
               for _ in range(rounds)]
    loss_fn = functools.partial(spo.ppo_clip_loss, clip_low=0.2, clip_high=0.28, dual_clip=10.0)

    def run(phase, batch, out):  # one of the trainer's two passes; its result kept in out
        if phase == "old log-probs":
            out["old"] = trainer.old_logprobs(policy, batch, [], 1.0, 64, max_tokens)
        else:
            out["stats"] = trainer.ppo_update(policy, optimizer, batch, out["old"]["batch"],
                                              rng.choice([-1.0, 1.0], len(batch)), loss_fn, ppo_steps=1,
                                              micro_batch_size=64, temperature=1.0, grad_clip=1.0,
                                              max_tokens=max_tokens)
    lengths = [[len(r.prompt_ids) + len(r.response_ids) for r in batch] for batch in batches]
    heads = [sum(len(r.response_ids) for r in batch) for batch in batches]  # the output projection's positions
    rows, packed_row = [], trainer.packed_row  # what the trainer packs, as it runs: each row's attention calls

    def recorded(*args):
        row = packed_row(*args)
        rows.append([tuple(call.shape) for call in row[2].calls])  # (sequences side by side, length) per call
        return row
    trainer.packed_row = recorded  # (response_logprobs finds it in trainer's namespace)
    timings = []  # per round and pass: (seconds, peak bytes, bytes in use on the GPU, decoder tokens, packed rows)
    for batch in batches:  # nothing runs before the first round: what is paid once is paid there
        out = {}
        timings.append({})
        for phase in ("old log-probs", "PPO step"):
            policy.decoder_tokens = 0  # (response_logprobs counts them on the model)
            timings[-1][phase] = (*measure(functools.partial(run, phase, batch, out)), policy.decoder_tokens, rows[:])
            rows.clear()
    trainer.packed_row = packed_row
    first = timings[0]["old log-probs"][4]  # one row per micro-batch
    seen = {shape for row in first for shape in row}
    new = {shape for timing in timings[1:] for row in timing["old log-probs"][4] for shape in row} - seen
    sizes = collections.Counter(sum(k for k, _ in row) for row in first)
    say(f"each round a fresh batch on rank 0: {prompts} prompts x {samples} responses, prompts {prompt_lens[0]}-"
        f"{prompt_lens[1]} and responses {response_lens[0]}-{response_lens[1]} tokens (seed {seed}); round 1: "
        f"{sum(lengths[0])} tokens, the decoder ran {timings[0]['old log-probs'][3]} (a prompt once per micro-batch), "
        f"in {len(first)} micro-batches (budget {max_tokens} tokens) of "
        f"{', '.join(f'{n} x {k}' for k, n in sorted(sizes.items()))} sequences, {sum(map(len, first))} attention "
        f"calls of {len(seen)} shapes; rounds 2-{rounds} bring {len(new)} shapes round 1 had not")
    # MFU counts the model's FLOPs only: forward, and backward at twice the forward. HFU also counts the recompute:
    # every decoder layer and log-prob chunk runs forward again in the backward (gradient checkpointing).
    for label, picked in (("round 1", range(1)), (f"rounds 2-{rounds}", range(1, rounds))):
        for phase, (mfu, hfu) in (("old log-probs", (1, 1)), ("PPO step", (3, 4))) if picked else ():
            seconds, peak, in_use, ran, _ = zip(*(timings[i][phase] for i in picked))
            flops = sum(_forward_flops(config, lengths[i], heads[i], n) for i, n in zip(picked, ran))
            per_s = flops / sum(seconds) / (peak_tflops * 1e12) if on_gpu else 0.0
            say(f"{label:10s} {phase:13s} {np.mean(seconds):7.2f} s"
                + (f" per round ({min(seconds):.2f} to {max(seconds):.2f})" if len(seconds) > 1 else "")
                + f"  {sum(sum(lengths[i]) for i in picked) * world / sum(seconds):.0f} tokens/s"
                + (f", MFU {100 * mfu * per_s:.1f}%, HFU {100 * hfu * per_s:.1f}%" if on_gpu else "")
                + f"  peak memory {max(peak) / 2**30:.2f} GiB"
                + (f" ({max(in_use) / 2**30:.2f} GiB in use on the device)" if on_gpu else ""))
    # One prompt's responses of the last batch, after the rounds (so nothing here warms the first): which attention
    # kernel runs, and the same weights (the fp32 masters, gathered) run unsharded in fp32 beside the policy.
    ids, mask = batching.pack([(r.prompt_ids, r.response_ids, r.response_mask) for r in batches[-1][:samples]],
                              device)
    with torch.no_grad():
        said = attention_kernel(lambda: trainer.token_logprobs(policy, ids, mask, 1.0), on_gpu)
        policy_logp, _ = trainer.token_logprobs(policy, ids, mask, 1.0)
        with torch.device(device):
            reference = trainer.attach_logprob_forward(Qwen3ForCausalLM(config))  # (fp32: torch's default)
        # (full_parameters would give the root unit in bf16: FSDP2's unshard gathers in the compute dtype)
        reference.load_state_dict(get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True)))
        gap = (trainer.token_logprobs(reference, ids, mask, 1.0)[0] - policy_logp)[mask > 0].abs().cpu().numpy()
    say(f"attention: {said}")
    say(f"bf16 vs fp32 log-probs ({samples} responses' tokens, after the rounds): mean |gap| {gap.mean():.2e}, max "
        f"{gap.max():.2e}; last PPO step's loss {out['stats']['loss']:.4f}, grad norm {out['stats']['grad_norm']:.3f}; "
        f"(a) took {time.time() - started:.0f} s after its imports")
    torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------------------ (b) the whole loop
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY_MODEL = os.path.join(REPO, "tasks", "built", "toy", "model")
SAME_FIELDS = ("reward/", "advantage/", "response/", "policy/", "signal/", "tracker/", "sampling/")  # compared
# Each spo.py run's time budget in seconds (`--run_budget_s` sets one for all); their sum, with the model's build
# and the weights' reads, plans part (b) under six minutes. From the first H200 run (docs/benchmarks.md).
RUN_BUDGET_S = {"toy": 35, "fresh": 85, "stopped": 70, "resumed": 80}


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
          f"{max(r['policy/logprob_gap_max'] for r in steps):.2e}", flush=True)


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
    common = ["--train", train, "--test", test, "--engine", "hf", "--offline_values", "none", "--log_every", "1"]
    prompt_len = float(np.mean([len(ids) for ids in
                                load_dataset(train, load_tokenizer(TOY_MODEL), 256, False).prompt_ids]))
    # The toy: its model learns, and the held-out evaluation runs on the engine.
    rows, seconds = _spo(os.path.join(root, "toy"), ["--model", TOY_MODEL, *common, "--steps", str(toy_steps),
                                                     "--eval_every", str(toy_steps), "--eval_max_prompts", "200",
                                                     "--save_every", "0"], budget["toy"])
    if rows:
        _loop_numbers(f"toy, --engine hf, {toy_steps} steps, held-out {rows[0]['eval/accuracy']:.1%} -> "
                      f"{rows[toy_steps]['eval/accuracy']:.1%}", rows, seconds, AutoConfig.from_pretrained(TOY_MODEL),
                      prompt_len, 64, peak_tflops)
    # A Qwen3 shape with random weights, long responses and spo.py's GPU defaults (bf16 with fp32 master weights,
    # gradient checkpointing, chunked log-probs, its token budget per micro-batch): two fresh runs, then one
    # stopped at a checkpoint halfway and resumed.
    model = random_qwen3(os.path.join(root, f"qwen3-{shape}"), shape, 512 + response_len)
    flags = ["--model", model, *common, "--batch_size", str(batch), "--max_response_len", str(response_len),
             "--max_prompt_len", "64", "--lr", "1e-6", "--eval_every", "0"]
    runs = {}  # run: (metrics rows, fp32 weights at the end)
    for run in ("fresh_1", "fresh_2"):
        rows, seconds = _spo(os.path.join(root, run), flags + ["--steps", str(steps), "--save_every", "0"],
                             budget["fresh"])
        if rows and not runs:
            _loop_numbers(f"Qwen3-{shape} shape (random weights), --engine hf, {batch} x {response_len} tokens, "
                          f"{steps} steps", rows, seconds, AutoConfig.from_pretrained(model), prompt_len, batch,
                          peak_tflops)
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
                        "--engine_compile", "off", "--log_every", "1"], 600,
                       env={"VLLM_USE_V2_MODEL_RUNNER": flag})  # vLLM refuses expandable segments
        if rows:
            rows = [row for step, row in rows.items() if step]
            print(f"vLLM model runner {runner}: {steps} steps, trainer-vs-engine log-prob gap mean "
                  f"{np.mean([r['policy/logprob_gap_mean'] for r in rows]):.2e}, max "
                  f"{max(r['policy/logprob_gap_max'] for r in rows):.2e}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench gpu", description="the GPU device check, two commands: "
                                     "--part trainer, --part loop (docs/benchmarks.md#the-gpu-device-check)")
    parser.add_argument("--part", choices=["trainer", "loop", "vllm"], required=True,
                        help="(a) the trainer path, (b) spo.py's whole loop, or spo.py under vLLM's two model runners")
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="the device's dense bf16 peak (default: known for H100, H200, A100, L40S, L4, A10)")
    parser.add_argument("--shape", choices=sorted(QWEN3_SHAPES), default="1.7b", help="(a): the model's shape")
    parser.add_argument("--prompts", type=int, default=8, help="(a): prompts per round (over all ranks)")
    parser.add_argument("--samples", type=int, default=8, help="(a): responses per prompt, sharing it")
    for flag, lens in (("--prompt_lens", [64, 512]), ("--response_lens", [200, 900])):
        parser.add_argument(flag, type=int, nargs=2, default=lens, metavar=("LOW", "HIGH"), help="(a): tokens, drawn")
    parser.add_argument("--rounds", type=int, default=5, help="(a): old log-probs + PPO step, the first timed apart")
    parser.add_argument("--max_tokens_per_micro_batch", type=int, default=2048,
                        help="(a): the micro-batch token budget (spo.py's default)")
    parser.add_argument("--loop_shape", choices=sorted(QWEN3_SHAPES), default="0.6b", help="(b): the model's shape")
    parser.add_argument("--loop_response_len", type=int, default=128, help="(b): tokens per response")
    parser.add_argument("--loop_batch", type=int, default=64, help="(b): responses per step")
    parser.add_argument("--loop_steps", type=int, default=2, help="(b): steps of the random-weight runs (even)")
    parser.add_argument("--toy_steps", type=int, default=2, help="(b): steps of the toy run")
    parser.add_argument("--run_budget_s", type=float, default=None,
                        help="(b): every spo.py run's time budget (default: bench/gpu.py:RUN_BUDGET_S, per run)")
    args = parser.parse_args(argv)
    if args.part == "loop" and (args.loop_steps < 2 or args.loop_steps % 2):
        fail(f"--loop_steps {args.loop_steps}: give an even number of at least 2 (the resume check stops halfway)")
    if args.part == "trainer":
        bench_gpu(args.shape, args.prompts, args.samples, args.prompt_lens, args.response_lens, args.rounds,
                  args.max_tokens_per_micro_batch, peak_tflops=args.peak_tflops)
        return
    # a `timeout` or a lease's end: the spo.py running (in a process group of its own) killed, the directory removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as root:
        if args.part == "loop":
            whole_loop(root, args.loop_shape, args.loop_response_len, args.loop_batch, args.loop_steps,
                       args.toy_steps, args.peak_tflops, args.run_budget_s)
        else:
            vllm_runners(root)


if __name__ == "__main__":
    main()
