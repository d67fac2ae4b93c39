"""The device check: the trainer path spo.py runs on a GPU, measured without vLLM (which a GPU machine may lack).

A Qwen3-shaped model with random weights is saved and loaded by trainer.build_policy (FSDP2 over a world of one,
bf16 compute with fp32 master weights, gradient checkpointing), then one old-log-prob pass and one PPO step run
over long responses in token-budget micro-batches. It prints tokens/s, model FLOPs utilisation, peak memory and
the gap between the bf16 log-probs and those of the same weights in fp32. Kept apart from bench/parts.py: that file
measures this CPU machine side by side; this one is the single command a GPU lease runs. `--shape tiny` keeps
Qwen3's vocabulary on a model small enough for a CPU (tests/test_trainer.py runs it so).

    python -m bench gpu                                          # one GPU: Qwen3-1.7B shape, 4 x 8192 tokens
    python -m bench gpu --shape tiny --response_len 96 --sequences 3 --max_tokens_per_micro_batch 700   # CPU
"""
import argparse
import functools
import tempfile
import time

import numpy as np

from bench.parts import _peak_rss_bytes


QWEN3_SHAPES = {  # Qwen3's published shapes; "tiny" keeps the vocabulary (the log-prob chunks) for a CPU test
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
}


def _training_flops(config, sequences, prompt_len):
    """Model FLOPs of one forward over `sequences` (prompt + response token lists): 2 per weight per token for
    the decoder's matrices, causal attention (QK^T and AV), and the output projection at response positions."""
    h, layers = config.hidden_size, config.num_hidden_layers
    attn = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_token = layers * (2 * h * (attn + 2 * kv) + 2 * attn * h + 3 * 2 * h * config.intermediate_size)
    flops = 0.0
    for n in sequences:
        flops += per_token * n + layers * 2 * attn * n * n  # causal: half of 2 x 2 x n^2 x attn
        flops += 2 * h * config.vocab_size * (n - prompt_len)
    return flops


def bench_gpu(shape="1.7b", response_len=8192, prompt_len=512, n_sequences=4, max_tokens=16384,
              peak_tflops=989.0):
    """The trainer path spo.py runs on a GPU, without vLLM: a Qwen3-shaped model with random weights saved and
    loaded by trainer.build_policy (FSDP2 over a world of one, bf16 compute with fp32 master weights, gradient
    checkpointing), the old-log-prob pass and one PPO step over `n_sequences` responses of `response_len` tokens
    in token-budget micro-batches. Prints tokens/s, model FLOPs utilisation against `peak_tflops` (the H200's
    dense bf16 figure; 0 on a CPU: not printed), peak memory, and the gap between the bf16 log-probs and those
    of the same weights in fp32."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen3Config, Qwen3ForCausalLM
    import spo
    from machinery import trainer
    from rollout import Rollout
    rank, world, device = trainer.setup_distributed()
    on_gpu = device.type == "cuda"
    config = Qwen3Config(vocab_size=151_936, max_position_embeddings=prompt_len + response_len, rope_theta=1e6,
                         **QWEN3_SHAPES[shape])
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    def peak(run):
        if not on_gpu:
            return _peak_rss_bytes(run)
        torch.cuda.reset_peak_memory_stats()
        run()
        return torch.cuda.max_memory_allocated()
    with tempfile.TemporaryDirectory() as path:
        t0 = time.time()
        torch.manual_seed(0)
        with torch.device(device):
            Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
        init_s = time.time() - t0
        t0 = time.time()
        policy, optimizer = trainer.build_policy(path, device, lr=1e-6, weight_decay=0.01)
        sync()
        load_s = time.time() - t0
        rng = np.random.default_rng(0)
        rollouts = [Rollout(rng.integers(0, config.vocab_size, prompt_len).tolist(),
                            rng.integers(0, config.vocab_size, response_len).tolist(), [0.0] * response_len, "",
                            "length") for _ in range(n_sequences)]
        out, seconds = {}, {}

        def score():
            t0 = time.time()
            out["old"] = trainer.old_logprobs(policy, rollouts, [], 1.0, 64, max_tokens)
            sync()
            seconds["old"] = time.time() - t0

        def update():
            t0 = time.time()
            loss_fn = functools.partial(spo.ppo_clip_loss, clip_low=0.2, clip_high=0.28, dual_clip=10.0)
            out["stats"] = trainer.ppo_update(policy, optimizer, rollouts, out["old"]["batch"],
                                              rng.choice([-1.0, 1.0], n_sequences), loss_fn, ppo_steps=1,
                                              micro_batch_size=64, temperature=1.0, grad_clip=1.0,
                                              max_tokens=max_tokens)
            sync()
            seconds["update"] = time.time() - t0
        memory = {"old": peak(score), "update": peak(update)}
        # The same weights in fp32, unsharded: how far the bf16 forward's log-probs are from full precision.
        reference = trainer.attach_logprob_forward(Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
                                                   .to(device))
        ids, mask = trainer.pack([(r.prompt_ids, r.response_ids, r.response_mask) for r in rollouts[:1]], device)
        with torch.no_grad():
            fp32, _ = trainer.token_logprobs(reference, ids, mask, 1.0)
        gap = np.abs(fp32[0, prompt_len - 1:].cpu().numpy() - out["old"]["batch"][0])
    tokens = n_sequences * (prompt_len + response_len)
    flops = _training_flops(config, [prompt_len + response_len] * n_sequences, prompt_len)
    n_params = sum(p.numel() for p in reference.parameters())
    print(f"Qwen3-{shape} shape ({n_params / 1e9:.2f}B parameters), {n_sequences} x ({prompt_len} + {response_len}) "
          f"tokens, micro-batches of {max_tokens} tokens, device {device.type}, world {world}", flush=True)
    print(f"random init + save {init_s:.1f} s, build_policy (load + FSDP2) {load_s:.1f} s", flush=True)
    for name, factor in (("old", 1), ("update", 4)):  # update: forward, recomputed forward, backward (2x)
        utilisation = f", MFU {100 * factor * flops / seconds[name] / (peak_tflops * 1e12):.1f}%" if on_gpu else ""
        print(f"{'old log-probs' if name == 'old' else 'PPO step':14s} {seconds[name]:7.2f} s  "
              f"{tokens / seconds[name]:9.0f} tokens/s{utilisation}  peak memory {memory[name] / 2**30:.2f} GiB",
              flush=True)
    print(f"bf16 vs fp32 log-probs (response tokens): mean |gap| {gap.mean():.2e}, max {gap.max():.2e}; "
          f"loss {out['stats']['loss']:.4f}, grad norm {out['stats']['grad_norm']:.3f}", flush=True)
    dist.destroy_process_group()
    return {"seconds": seconds, "memory": memory, "gap_mean": float(gap.mean()), "gap_max": float(gap.max()),
            "stats": out["stats"]}


def main(argv=None):
    """`python -m bench gpu [flags]`."""
    parser = argparse.ArgumentParser(prog="python -m bench gpu",
                                     description="the trainer path on one device, without vLLM")
    parser.add_argument("--shape", choices=sorted(QWEN3_SHAPES), default="1.7b", help="the model's shape")
    parser.add_argument("--response_len", type=int, default=8192, help="tokens per response")
    parser.add_argument("--sequences", type=int, default=4, help="responses in the batch")
    parser.add_argument("--max_tokens_per_micro_batch", type=int, default=16384, help="micro-batch token budget")
    args = parser.parse_args(argv)
    bench_gpu(args.shape, args.response_len, n_sequences=args.sequences, max_tokens=args.max_tokens_per_micro_batch)


if __name__ == "__main__":
    main()
