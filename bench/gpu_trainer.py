"""The device check's part (a), `python -m bench gpu --part trainer` (bench/gpu.py: the command line): the trainer
path spo.py runs on a GPU, without vLLM. A random-weight Qwen3 shape loaded by trainer.build_policy, then rounds of
one old-log-prob pass and one PPO step, each over a fresh batch of responses of random lengths in groups that share
a prompt, cut and packed by the trainer itself (token-budget micro-batches, batching.packed_row): most micro-batches
bring attention shapes not met before. The same batches run at the new defaults first (eager), then at the old
settings on today's loops, then with compiled decoder layers (_settings), each with its device-busy share and
blocking syncs per step from one profiled PPO step. The first round is timed apart: what is paid once (kernels,
plans, compiles, the allocator's growth). After the new defaults' rounds: a profile of one PPO step, which attention
kernel runs, the bf16-vs-fp32 log-prob gap. A shape that cannot fit is refused in one line. Also Qwen3's shapes,
the devices' peaks and the FLOP count that part (b) uses.
"""
import collections
import functools
import os
import re
import tempfile
import time

import numpy as np

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


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def profile_step(run, on_gpu, top=8):
    """Where one run()'s time goes (lines to print), from torch.profiler: the wall clock against the device's busy
    time (its kernels and copies, summed; far below the wall clock: the host's launches, syncs and Python set the
    pace, not the kernels), the host's reads of tensor values (.item(), float(): aten::_local_scalar_dense; a sync
    where the tensor is on the device), the sync and kernel-launch calls, and the `top` ops by self time: the
    device's on a GPU, the host's on both."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    t0 = time.time()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_gpu) as prof:
        run()
        if on_gpu:
            torch.cuda.synchronize()
    wall, averages = time.time() - t0, prof.key_averages()
    count = {a.key: a.count for a in averages}
    busy = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU)
    reads = count.get("aten::_local_scalar_dense", 0)  # .item() and friends: each one a sync on a GPU
    syncs = sum(count.get(k, 0) for k in SYNC_CALLS)
    lines = [f"wall {wall:.2f} s" + (f", device busy {busy / 1e6:.2f} s ({100 * busy / 1e6 / wall:.0f}%)" if on_gpu
                                     else "") + f"; host reads of tensor values {reads}"
             + (f", sync calls {syncs}, kernel launches {sum(count.get(k, 0) for k in LAUNCH_CALLS)}" if on_gpu
                else "")]
    for label, key in (("device", "self_device_time_total"),) * on_gpu + (("host", "self_cpu_time_total"),):
        for a in sorted(averages, key=lambda a: getattr(a, key), reverse=True)[:top]:
            lines.append(f"  self {label} time {getattr(a, key) / 1e3:9.1f} ms  x{a.count:<6d} {a.key[:100]}")
    # (a CPU waits for nothing: there the reads stand for the syncs they would be on a GPU)
    return lines, {"busy": busy / 1e6 / wall, "syncs": syncs if on_gpu else reads}


def _settings(config, max_tokens, on_gpu, world, longest):
    """The settings run side by side, most important first: (label, tokens per update micro-batch, checkpointing,
    layer units, compiled layers): the new defaults (memory.auto_budget; on a CPU max_tokens), eager; the settings
    of before this project's GPU work (max_tokens, checkpointing, per-layer units) on today's loops, which is not
    the old code; on a GPU the new defaults with compiled decoder layers (--compile on)."""
    from machinery import memory
    old = (f"old settings on today's loops (not the old code): {max_tokens} tokens a micro-batch (no-grad pass "
           f"{2 * max_tokens if on_gpu else max_tokens}), checkpointing, layer units", max_tokens, True, True, False)
    units = memory.use_layer_units("auto", on_gpu, world)
    if not on_gpu:
        return [(f"new defaults: {max_tokens} tokens, checkpointing off, one unit, eager", max_tokens, False, False,
                 False), old]
    shape, have = memory.model_shape(None, config), memory.available_per_rank(True, world)
    tokens, ckpt, why = memory.auto_budget(shape, have, "auto", "auto", world=world, on_gpu=True, layer_units=units,
                                           gpu_bytes=have, engine=False, max_sequence_len=longest)
    new = f"new defaults: {tokens} tokens ({why}), {'layer units' if units else 'one unit'}"
    return [(new + ", eager", tokens, ckpt, units, False), old, (new + ", compiled layers", tokens, ckpt, units, True)]


def bench_gpu(shape="1.7b", prompts=8, samples=8, prompt_lens=(64, 512), response_lens=(200, 900), rounds=3,
              max_tokens=2048, seed=0, peak_tflops=None, profile=True):
    """(a) The trainer path spo.py runs on a GPU, without vLLM (module docstring), at each of _settings on the same
    batches; profile: one more PPO step on two responses of one prompt under torch.profiler at the new defaults,
    after the rounds (profile_step)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    import spo
    from machinery import logprob_head, memory
    from machinery.device import prefer_flash_attention, setup_distributed
    started, (rank, world, device) = time.time(), setup_distributed()
    on_gpu = device.type == "cuda"
    prefer_flash_attention(on_gpu)  # as spo.py (setup_distributed calls it too): the attention it runs is measured
    longest, prompts = prompt_lens[1] + response_lens[1], max(1, prompts // world)  # this rank's prompts
    config = Qwen3Config(vocab_size=151_936, max_position_embeddings=longest, rope_theta=1e6, **QWEN3_SHAPES[shape])
    _refuse_what_cannot_fit(config, shape, world, on_gpu,
                            memory.tokens_per_forward(64, max_tokens, prompts * samples, longest))
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    peak_tflops = device_peak(name, peak_tflops)
    say = functools.partial(print, flush=True) if rank == 0 else (lambda *a, **k: None)
    rng = np.random.default_rng([seed, rank])
    batches = [shared_prompt_batch(rng, config.vocab_size, prompts, samples, prompt_lens, response_lens)
               for _ in range(rounds)]
    advantages = [rng.choice([-1.0, 1.0], len(batch)) for batch in batches]
    loss_fn = functools.partial(spo.ppo_clip_loss, clip_low=0.2, clip_high=0.28, dual_clip=10.0)
    lengths = [[len(r.prompt_ids) + len(r.response_ids) for r in batch] for batch in batches]
    heads = [sum(len(r.response_ids) for r in batch) for batch in batches]  # the output projection's positions
    rows, packed_row = [], logprob_head.packed_row  # what the trainer packs, as it runs: each row's attention calls

    def recorded(*args):
        row = packed_row(*args)
        rows.append([tuple(call.shape) for call in row[2].calls])  # (sequences side by side, length) per call
        return row
    logprob_head.packed_row = recorded  # (response_logprobs finds it in logprob_head's namespace)
    with tempfile.TemporaryDirectory() as path:
        t0 = time.time()
        torch.manual_seed(0)
        with torch.device(device):  # every rank its own copy (its own temporary directory), the same weights
            Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
        say(f"Qwen3-{shape} shape, device {name}, world {world}: random init + save {time.time() - t0:.1f} s")
        for k, setting in enumerate(_settings(config, max_tokens, on_gpu, world, longest)):
            policy = optimizer = None  # (the previous setting's policy freed before the next is built)
            policy, optimizer, out = _run_setting(path, device, setting, batches, advantages, loss_fn, rows, say)
            _report(setting, out, config, lengths, heads, peak_tflops, on_gpu, world, k == 0, say)
            if k == 0:  # the new defaults' policy
                _checks(policy, optimizer, config, device, batches, advantages, loss_fn, max_tokens, samples,
                        out, profile, say)
    logprob_head.packed_row = packed_row
    say(f"(a) took {time.time() - started:.0f} s after its imports")
    torch.distributed.destroy_process_group()


def _checks(policy, optimizer, config, device, batches, advantages, loss_fn, max_tokens, samples, out, profile, say):
    """After a setting's rounds: one more PPO step profiled, the attention kernel, the bf16-vs-fp32 log-prob gap."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import Qwen3ForCausalLM
    from machinery import batching, logprob_head, trainer
    on_gpu = device.type == "cuda"
    if profile:  # after the rounds (nothing here warms the first), on two responses of one prompt: about 8,000
        state = {}  # profiled host events per layer and micro-batch (more on a GPU), a second to process per 20,000
        _step(policy, optimizer, "old log-probs", batches[-1][:2], state, advantages[-1][:2], loss_fn, max_tokens)
        lines, _ = profile_step(functools.partial(_step, policy, optimizer, "PPO step", batches[-1][:2], state,
                                                  advantages[-1][:2], loss_fn, max_tokens), on_gpu)
        say("profile of one more PPO step on two responses of one prompt (rank 0): " + "\n".join(lines))
    # One prompt's responses of the last batch, after the rounds (so nothing here warms the first): which attention
    # kernel runs, and the same weights (the fp32 masters, gathered) run unsharded in fp32 beside the policy.
    ids, mask = batching.pack([(r.prompt_ids, r.response_ids, r.response_mask) for r in batches[-1][:samples]])
    with torch.no_grad():
        said = attention_kernel(lambda: logprob_head.token_logprobs(policy, ids, mask, 1.0), on_gpu)
        policy_logp, _ = logprob_head.token_logprobs(policy, ids, mask, 1.0)
        with torch.device(device):
            reference = logprob_head.attach_logprob_forward(Qwen3ForCausalLM(config))  # (fp32: torch's default)
        # (full_parameters would give the root unit in bf16: FSDP2's unshard gathers in the compute dtype)
        reference.load_state_dict(get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True)))
        gap = (logprob_head.token_logprobs(reference, ids, mask, 1.0)[0] - policy_logp)[mask.to(device) > 0]
        gap = gap.abs().cpu().numpy()
    stats = out["timings"][-1]["PPO step"][5]
    say(f"attention: {said}")
    say(f"bf16 vs fp32 log-probs ({samples} responses' tokens, after the rounds): mean |gap| {gap.mean():.2e}, max "
        f"{gap.max():.2e}; last PPO step's loss {stats['loss']:.4f}, grad norm {stats['grad_norm']:.3f}")


def _step(policy, optimizer, phase, batch, state, advantage, loss_fn, max_tokens):
    """One of the trainer's two passes over `batch`; the old log-probs kept in state for the PPO step."""
    from machinery import trainer
    if phase == "old log-probs":
        state["old"] = trainer.old_logprobs(policy, batch, [], 1.0, 64, max_tokens)
        return state["old"]
    return trainer.ppo_update(policy, optimizer, batch, state["old"]["batch"], advantage, loss_fn, ppo_steps=1,
                              micro_batch_size=64, temperature=1.0, grad_clip=1.0, max_tokens=max_tokens)


def _peak_rss_bytes(run):
    """Peak resident memory added while `run()` executes (the CPU's peak): /proc's high-water mark, reset first."""
    def status(field):
        return 1024 * int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = status("VmRSS")
    run()
    return status("VmHWM") - before


def _run_setting(path, device, setting, batches, advantages, loss_fn, rows, say):
    """The rounds at one setting: a policy built for it (the previous one freed), then per round and pass the
    seconds, peak bytes (torch's on a GPU, resident growth on a CPU), bytes in use on the GPU, decoder tokens, the
    packed rows and the result; then one more PPO step under the profiler (busy share, syncs per step)."""
    import gc
    import torch
    from machinery import trainer
    label, tokens, checkpointing, units, compiled = setting
    rows.clear()
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    t0 = time.time()
    policy, optimizer = trainer.build_policy(path, device, lr=1e-6, weight_decay=0.01,
                                             gradient_checkpointing=checkpointing, layer_units=units,
                                             compile_layers=compiled)
    say(f"== {label}: build_policy (load + FSDP2) {time.time() - t0:.1f} s")
    on_gpu, timings = device.type == "cuda", []
    for batch, advantage in zip(batches, advantages):  # nothing runs before the first round
        state = {}
        timings.append({})
        for phase in ("old log-probs", "PPO step"):
            policy.decoder_tokens = 0  # (response_logprobs counts them on the model)
            run = functools.partial(_step, policy, optimizer, phase, batch, state, advantage, loss_fn, tokens)
            if on_gpu:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.time()
            result = run() if on_gpu else None
            if on_gpu:
                torch.cuda.synchronize()
                seconds, peak, in_use = time.time() - t0, torch.cuda.max_memory_allocated(), _in_use()
            else:
                peak = _peak_rss_bytes(lambda: state.update(result=run()))
                seconds, result, in_use = time.time() - t0, state.pop("result"), 0
            timings[-1][phase] = (seconds, peak, in_use, policy.decoder_tokens, rows[:], result)
            rows.clear()
    _, profiled = profile_step(functools.partial(_step, policy, optimizer, "PPO step", batches[-1], state,
                                                 advantages[-1], loss_fn, tokens), on_gpu)
    profiled["micro_batches"] = max(1, len(rows))
    rows.clear()
    return policy, optimizer, {"timings": timings, "profiled": profiled}


def _in_use():
    import torch
    free, total = torch.cuda.mem_get_info()
    return total - free


def _report(setting, out, config, lengths, heads, peak_tflops, on_gpu, world, first, say):
    """One setting's lines: the packing of round 1 (the first setting only), then per pass the seconds, MFU, HFU,
    peak memory, and the profiled PPO step's device-busy share and blocking syncs."""
    label, max_tokens, checkpointing, *_ = setting
    timings, profiled = out["timings"], out["profiled"]
    rounds = len(timings)
    if first:
        first = timings[0]["old log-probs"][4]  # one row per micro-batch
        seen = {shape for row in first for shape in row}
        new = {shape for timing in timings[1:] for row in timing["old log-probs"][4] for shape in row} - seen
        sizes = collections.Counter(sum(k for k, _ in row) for row in first)
        say(f"each round a fresh batch on rank 0; round 1: {sum(lengths[0])} tokens, the decoder ran "
            f"{timings[0]['old log-probs'][3]} (a prompt once per micro-batch), in {len(first)} micro-batches (budget "
            f"{max_tokens} tokens) of {', '.join(f'{n} x {k}' for k, n in sorted(sizes.items()))} sequences, "
            f"{sum(map(len, first))} attention calls of {len(seen)} shapes; rounds 2-{rounds} bring {len(new)} shapes "
            f"round 1 had not")
    # MFU counts the model's FLOPs only: forward, and backward at twice the forward. HFU also counts the recompute:
    # every decoder layer runs forward again in the backward under checkpointing (the log-prob chunks always do).
    for span, picked in (("round 1", range(1)), (f"rounds 2-{rounds}", range(1, rounds))):
        for phase, (mfu, hfu) in (("old log-probs", (1, 1)), ("PPO step", (3, 4 if checkpointing else 3))):
            if not picked:
                continue
            seconds, peak, in_use, ran, *_ = zip(*(timings[i][phase] for i in picked))
            flops = sum(_forward_flops(config, lengths[i], heads[i], n) for i, n in zip(picked, ran))
            per_s = flops / sum(seconds) / (peak_tflops * 1e12) if on_gpu else 0.0
            say(f"{span:10s} {phase:13s} {np.mean(seconds):7.2f} s"
                + (f" per round ({min(seconds):.2f} to {max(seconds):.2f})" if len(seconds) > 1 else "")
                + f"  {sum(sum(lengths[i]) for i in picked) * world / sum(seconds):.0f} tokens/s"
                + (f", MFU {100 * mfu * per_s:.1f}%, HFU {100 * hfu * per_s:.1f}%" if on_gpu else "")
                + f"  peak memory {max(peak) / 2**30:.2f} GiB"
                + (f" ({max(in_use) / 2**30:.2f} GiB in use on the device)" if on_gpu else ""))
    say(f"profiled PPO step ({label}): device busy {100 * profiled['busy']:.0f}% of the wall, blocking syncs "
        f"{profiled['syncs']} in the step ({profiled['micro_batches']} micro-batches; the loops' own: 0, the rest "
        "the step's reads and the optimiser's" + (")" if on_gpu else "; a CPU counts the host reads that would be "
                                                 "syncs on a GPU)"))
