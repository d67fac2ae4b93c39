"""The per-rank memory estimate (machinery/memory.py): it covers what autograd really saves, its arithmetic on
hand-made numbers, spo.py's refusal of a run that will not fit, before any model is loaded, and the CPU engine's KV
cache from the flag or the environment. How the trainer cuts its passes is tests/test_batching.py.

    .venv/bin/python -m pytest tests/test_memory.py -q
"""
import os

import pytest
import torch

from machinery import device, memory
from common import python, toy_args


def _llama_dir(tmp_path, **shape):
    """A directory holding only a Llama config.json (model_shape reads nothing else)."""
    from transformers import LlamaConfig
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **shape)
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def _saved_bytes_per_token(model_dir, checkpointing, lengths=(32, 96)):
    """Bytes autograd saves per token for the log-prob forward, from the growth between two lengths (constant
    items, such as weights saved by reference, cancel)."""
    from test_trainer import _saved_activation_bytes
    from transformers import AutoConfig, AutoModelForCausalLM
    from machinery import trainer
    saved = []
    for T in lengths:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
        trainer.prepare_for_training(model, checkpointing)
        saved.append(_saved_activation_bytes(model, torch.randint(0, 300, (2, T // 2)))[0])
    return (saved[1] - saved[0]) / (lengths[1] - lengths[0])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_activation_estimate_covers_what_autograd_saves(tmp_path, checkpointing):
    model_dir = _llama_dir(tmp_path)
    shape = memory.model_shape(model_dir)
    estimate = memory.rank_memory(shape, world=1, tokens=1000, on_gpu=False,
                                  gradient_checkpointing=checkpointing)["activations"] / 1000
    measured = _saved_bytes_per_token(model_dir, checkpointing)
    assert measured <= estimate, (measured, estimate)
    if not checkpointing:  # (checkpointing: the estimate adds the layer recomputed in the backward, not saved)
        assert estimate <= 2 * measured, (measured, estimate)


@pytest.mark.parametrize("on_gpu", [False, True])
def test_the_estimate_counts_a_reference_policy_only_with_a_kl_penalty(tmp_path, on_gpu):
    """--kl_coef: the reference's fp32 shards, 4 bytes a parameter over the ranks, added to the peak; 0: nothing."""
    shape = memory.model_shape(_llama_dir(tmp_path))
    common = dict(world=2, tokens=1000, on_gpu=on_gpu, gradient_checkpointing=False, gpu_bytes=80 * memory.GIB)
    without, with_ = memory.rank_memory(shape, **common), memory.rank_memory(shape, reference=True, **common)
    assert "reference weights (sharded)" not in without
    assert with_["peak"] - without["peak"] == pytest.approx(shape.parameters * 4 / 2)


def test_model_shape_counts_parameters_on_the_meta_device(tmp_path):
    shape = memory.model_shape(_llama_dir(tmp_path))
    H, I, V, L = 64, 176, 300, 3
    layer = H * H * 2 + 2 * H * (H // 2) + 3 * H * I + 2 * H  # q, o; k, v (2 of 4 heads); gate, up, down; 2 norms
    assert (shape.layers, shape.hidden, shape.intermediate, shape.vocab) == (L, H, I, V)
    assert shape.layer_parameters == layer
    assert shape.parameters == L * layer + V * H + H  # the tied output projection counted once
    assert shape.root_parameters == V * H + H


def test_tokens_per_forward_from_the_flags():
    # a budget bounds a forward pass, but one sequence longer than the budget is a micro-batch of its own
    assert memory.tokens_per_forward(64, 2048, 32, 300) == 2048
    assert memory.tokens_per_forward(64, 200, 32, 300) == 300
    assert memory.tokens_per_forward(4, 2048, 32, 300) == 1200  # 4 sequences of 300 tokens at most
    # no budget: micro_batch_size sequences of the longest length, but never more than the rank has
    assert memory.tokens_per_forward(64, None, 32, 300) == 32 * 300
    assert memory.tokens_per_forward(8, None, 32, 300) == 8 * 300


def test_the_suggested_budget_is_the_largest_that_fits(tmp_path):
    shape = memory.model_shape(_llama_dir(tmp_path))
    common = dict(world=2, on_gpu=False, gradient_checkpointing=False, kv_cache_gib=1.0)
    budget = memory.rank_memory(shape, tokens=5000, **common)["peak"] - 1
    fit = memory.fitting_tokens(shape, budget, **common)
    assert memory.rank_memory(shape, tokens=fit, **common)["peak"] <= budget
    assert memory.rank_memory(shape, tokens=fit + 1, **common)["peak"] > budget


def test_gpu_peak_is_the_larger_of_training_and_generating(tmp_path):
    """Training: the trainer's items and what stays on the card (CUDA context, NCCL, vLLM asleep); generating: the
    trainer's shards and the root unit the push left gathered, vLLM's share of the card, the context and NCCL."""
    shape = memory.model_shape(_llama_dir(tmp_path))
    gpu = 80 * memory.GIB
    items = memory.rank_memory(shape, world=8, tokens=4096, on_gpu=True, gradient_checkpointing=True,
                               gpu_bytes=gpu, gpu_memory_utilization=0.6)
    training = sum(v for k, v in items.items() if k != "peak")
    gathered = 2 * (shape.root_parameters + 2 * shape.layer_parameters)  # bf16, kept from the push (full_parameters)
    resident = memory.GPU_CONTEXT_BYTES + memory.GPU_NCCL_BYTES
    assert items["peak"] == max(training, shape.parameters * 12 / 8 + gathered + 0.6 * gpu + resident)


def test_the_gpu_estimate_counts_what_stays_on_the_card(tmp_path):
    """The CUDA context always, NCCL's communicator with more than one rank, vLLM's runtime asleep only with an
    engine, and FSDP2's fp32 reduce-scatter buffers: the root unit's and one layer's (layer units) or the whole
    model's, in fp32."""
    shape = memory.model_shape(_llama_dir(tmp_path))
    common = dict(tokens=1000, on_gpu=True, gradient_checkpointing=True, gpu_bytes=80 * memory.GIB)
    eight, one = memory.rank_memory(shape, world=8, **common), memory.rank_memory(shape, world=1, **common)
    alone = memory.rank_memory(shape, world=8, engine=False, **common)
    assert eight["CUDA context"] == one["CUDA context"] == memory.GPU_CONTEXT_BYTES > 0
    assert (eight["NCCL communicator"], one["NCCL communicator"]) == (memory.GPU_NCCL_BYTES, 0)
    assert eight["engine asleep (while training)"] == memory.GPU_ENGINE_ASLEEP_BYTES > alone[
        "engine asleep (while training)"] == 0
    assert alone["peak"] == sum(v for k, v in alone.items() if k != "peak")  # no engine: training is the peak
    assert eight["FSDP2 fp32 reduce-scatter buffers"] == 4 * (shape.root_parameters + shape.layer_parameters)
    whole = memory.rank_memory(shape, world=8, layer_units=False, **common)
    assert whole["FSDP2 fp32 reduce-scatter buffers"] == 4 * shape.parameters
    cpu = memory.rank_memory(shape, world=8, tokens=1000, on_gpu=False, gradient_checkpointing=True)
    assert not {"CUDA context", "NCCL communicator", "FSDP2 fp32 reduce-scatter buffers"} & set(cpu)


def test_gpu_memory_is_read_at_the_end_of_each_phase(tmp_path):
    """memory/peak_gib on GPU: the device memory in use (total - free) at the end of each phase, the largest so
    far, and each phase's of this step. No GPU here: torch.cuda.mem_get_info is replaced by a scripted card (80 GiB;
    30, 50, then 20, 10 GiB in use) in a world of one on gloo."""
    import json
    script = (
        "import json, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "from machinery import memory\n"
        "used = iter([30, 50, 20, 10])\n"
        "torch.cuda.mem_get_info = lambda: ((80 - next(used)) * 2**30, 80 * 2**30)\n"
        "steps = []\n"
        "for _ in range(2):\n"
        "    memory.phase_end(True, 'generate'); memory.phase_end(True, 'update')\n"
        "    steps.append(memory.peak_metrics(True))\n"
        "memory.phase_end(False, 'generate')  # CPU: nothing noted, VmHWM read\n"
        "steps.append(sorted(memory.peak_metrics(False)))\n"
        "print(json.dumps(steps))\n"
        "dist.destroy_process_group()\n")  # a gloo group left at exit can abort the interpreter (seen in CI)
    proc = python("-c", script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second, cpu = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first == {"memory/peak_gib": 50.0, "memory/generate_gib": 30.0, "memory/update_gib": 50.0}
    assert second == {"memory/peak_gib": 50.0, "memory/generate_gib": 20.0, "memory/update_gib": 10.0}
    assert cpu == ["memory/peak_gib"]


def test_whole_model_units_hold_every_weight_and_gradient_at_once(tmp_path):
    shape = memory.model_shape(_llama_dir(tmp_path))
    common = dict(world=2, tokens=1000, on_gpu=False, gradient_checkpointing=False)
    by_layer = memory.rank_memory(shape, layer_units=True, **common)["gathered weights and their gradients"]
    whole = memory.rank_memory(shape, layer_units=False, **common)["gathered weights and their gradients"]
    assert by_layer == 2 * 4 * (shape.root_parameters + 2 * shape.layer_parameters)  # fp32 on CPU
    assert whole == 2 * 4 * shape.parameters > by_layer
    assert [memory.use_layer_units(c, gpu) for c in ("auto", "layers", "model") for gpu in (False, True)] == \
        [False, False, True, True, False, False]  # auto: one GPU is one unit (nothing to gather, no casts per layer)
    assert memory.use_layer_units("auto", True, world=2) and not memory.use_layer_units("auto", False, world=2)


@pytest.mark.slow
def test_an_oversized_micro_batch_is_refused_before_the_model_loads(small_toy, tmp_path):
    """One line naming the flag and a budget that fits; nothing loaded, nothing run (no metrics)."""
    run = tmp_path / "run"
    proc = python(*toy_args(small_toy, run, "--max_tokens_per_micro_batch", "100000000",
                            "--micro_batch_size", "100000"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: --max_tokens_per_micro_batch 100000000: a rank needs"), \
        proc.stderr[-3000:]
    assert "pass --max_tokens_per_micro_batch" in errors[0] and "--ignore_memory_estimate" in errors[0]
    assert "memory per rank (estimate)" in proc.stdout and "training prompts" not in proc.stdout
    assert not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize("env, expected, error", [
    (None, "1", None), ("3", "3", None), ("", None, "VLLM_CPU_KVCACHE_SPACE=''"),
    ("0", None, "VLLM_CPU_KVCACHE_SPACE='0'"), ("1.5", None, "VLLM_CPU_KVCACHE_SPACE='1.5'")])
def test_cpu_kv_cache_space_from_the_environment(monkeypatch, env, expected, error):
    if env is None:
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", env)
    message = device.set_cpu_kv_cache()
    assert (message is None) if error is None else message.startswith(error)
    if expected is not None:
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == expected


def test_bf16_auto_is_gpu_only_and_on_without_bf16_units_is_one_line(monkeypatch, capsys):
    from machinery import memory
    assert (device.use_bf16("auto", True), device.use_bf16("auto", False)) == ("on", "off")
    monkeypatch.setattr(device, "native_bf16", lambda: ["avx512_bf16"])
    assert device.use_bf16("on", False) == "on"
    monkeypatch.setattr(device, "native_bf16", lambda: [])
    assert device.use_bf16("on", True) == "on" and device.use_bf16("off", False) == "off"  # a GPU has bf16
    with pytest.raises(SystemExit):
        device.use_bf16("on", False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--bf16 on: this CPU has no bf16 instructions" in err



def test_cudnn_attention_is_off_on_a_gpu_and_left_alone_on_a_cpu():
    import torch
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        device.prefer_flash_attention(on_gpu=False)
        assert torch.backends.cuda.cudnn_sdp_enabled()
        device.prefer_flash_attention(on_gpu=True)  # the flag is global, settable without a GPU
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_the_auto_budget_fits_16k_tokens_without_checkpointing_on_one_h200():
    """The decision on the Qwen3-1.7B config (no weights: the meta device) for one H200 (141 GB): 16,384 tokens per
    update micro-batch without gradient checkpointing; on 80 GB the same tokens only with it; a budget given keeps
    its tokens and gets checkpointing only where it needs it; the CPU keeps 2048 tokens without checkpointing."""
    from transformers import Qwen3Config
    from bench.gpu_trainer import QWEN3_SHAPES
    shape = memory.model_shape(None, Qwen3Config(vocab_size=151_936, **QWEN3_SHAPES["1.7b"]))

    def budget(gpu_bytes, tokens="auto", checkpointing="auto", on_gpu=True):
        return memory.auto_budget(shape, gpu_bytes, tokens, checkpointing, max_sequence_len=4096, world=1,
                                  on_gpu=on_gpu, layer_units=False, gpu_bytes=gpu_bytes, gpu_memory_utilization=0.5)
    assert budget(141e9)[:2] == (16384, False)
    assert budget(80e9)[:2] == (16384, True)
    assert budget(80e9, checkpointing="off")[:2] == (8192, False)  # the most that fits, in steps of 1024
    assert budget(141e9, tokens=2048)[:2] == (2048, False) and budget(141e9, checkpointing="on")[:2] == (16384, True)
    assert budget(141e9, on_gpu=False)[:2] == (2048, False)
