"""bench/limits.py (`python -m bench limits`): the arithmetic of its table on hand-made metrics and configs, and
its ceilings' measurement on tiny sizes (finite positive numbers; how fast is a benchmark's business, not a test's).

    .venv/bin/python -m pytest tests/test_bench_limits.py -q
"""
import math

import pytest

from bench import limits
from common import one_thread


def tiny_config():
    """A Qwen3 shape small enough to count by hand: hidden 2, intermediate 4, one layer, one head of 2, vocab 3."""
    from transformers import AutoConfig
    return AutoConfig.for_model("qwen3", vocab_size=3, hidden_size=2, intermediate_size=4, num_hidden_layers=1,
                                num_attention_heads=1, num_key_value_heads=1, head_dim=2, tie_word_embeddings=True)


MEANS = {"time/update": 1e-6, "time/old_logprobs": 0.0, "time/generate": 2.0, "time/weight_push": 1e-3,
         "response/length_mean": 3.0, "response/length_max": 10.0, "throughput/tokens_per_second": 50.0,
         "policy/rescored_sequences": 0.0, "policy/decoder_tokens": 0.0}  # 0: a run from before the metric


def table(means=None, checkpointing=False, ceilings=limits.Ceilings(matmul=1e6, read=4000.0, copy=8e6)):
    rows = limits.phase_table({**MEANS, **(means or {})}, tiny_config(), prompt_len=2.0, batch_size=4, ranks=2,
                              checkpointing=checkpointing, ceilings=ceilings, weights=(100, 1000))
    return {phase.rsplit(",", 1)[0]: (achieved, ceiling) for phase, achieved, ceiling in rows}  # (unit dropped)


def test_the_update_counts_three_forwards_of_the_ranks_share_and_what_the_recompute_adds():
    # One forward of a 5-token sequence (2 prompt + 3 response), by hand: the matrices 2 x (q 4 + k 4 + v 4 + o 4
    # + MLP 24) = 80 per token, 400; causal attention 2 x 2 x 5^2 = 100; the head at 3 response positions
    # 2 x 2 x 3 x 3 = 36: 536. The rank's share: 4 sequences over 2 ranks = 2, so 1072 FLOPs (72 of the head), in
    # 1e-6 s. The hardware ran the head's chunks again in the backward; with checkpointing the whole forward.
    rows = table()
    assert rows["update, model FLOPs 3F (6N)"] == pytest.approx((3 * 1072 / 1e-6 / 1e9, 1e6 / 1e9))
    assert rows["update, hardware FLOPs 3F' + head"][0] == pytest.approx((3 * 1072 + 72) / 1e-6 / 1e9)
    rows = table(checkpointing=True)
    assert rows["update, model FLOPs 3F (6N)"][0] == pytest.approx(3 * 1072 / 1e-6 / 1e9)
    assert rows["update, hardware FLOPs 4F' (8N)"][0] == pytest.approx(4 * 1072 / 1e-6 / 1e9)


def test_the_hardware_row_counts_the_tokens_the_decoder_really_ran():
    # The rank's 2 sequences of 5 tokens, packed with a shared 2-token prefix: 2 + 3 + 3 = 8 tokens of 10. The
    # decoder's share of F (1072 - 72 = 1000) scales to 800; the head (72) is unchanged: 3 x 800 + 4 x 72.
    # Model FLOPs still count every token.
    rows = table({"policy/decoder_tokens": 8.0})
    assert rows["update, hardware FLOPs 3F' + head"][0] == pytest.approx((3 * 800 + 4 * 72) / 1e-6 / 1e9)
    assert rows["update, model FLOPs 3F (6N)"][0] == pytest.approx(3 * 1072 / 1e-6 / 1e9)


def test_the_old_logprob_row_is_one_forward_of_the_rescored_sequences_and_absent_without_any():
    assert not [phase for phase in table() if phase.startswith("old log-probs")]
    rows = table({"policy/rescored_sequences": 4.0, "time/old_logprobs": 1e-6})  # 2 per rank
    assert rows["old log-probs, 1 forward"][0] == pytest.approx(1072 / 1e-6 / 1e9)


def test_the_generation_bound_is_the_prefill_at_the_matmul_peak_then_each_decoding_step_at_its_slower_limit():
    # 50 tokens/s for 2 s: 100 tokens over 10 decoding steps, 10 per step. The prefill: the rank's 2 prompts of 2
    # tokens, each 2 x 80 + causal attention 2 x 2 x 2^2 + the head at its last token 2 x 2 x 3 = 188 FLOPs, 376
    # at 1e6 FLOP/s. A decoding step: reading 100 weights x 4 B at 4000 B/s takes 0.1 s; its 10 tokens x 2 x 100
    # FLOPs 0.002 s. Fastest: 100 tokens in 376e-6 + 10 x 0.1 s.
    assert table()["generate"] == (50.0, pytest.approx(100 / (376e-6 + 10 * 0.1)))
    slow = limits.Ceilings(matmul=1e4, read=4000.0, copy=8e6)  # compute now the slower: 0.2 s a step
    assert table(ceilings=slow)["generate"] == (50.0, pytest.approx(100 / (376e-4 + 10 * 0.2)))


def test_the_push_moves_every_parameter_in_fp32_against_the_copy_rate():
    assert table()["weight push"] == pytest.approx((1000 * 4 / 1e-3 / 1e9, 8e6 / 1e9))


def test_the_printed_fraction_is_achieved_over_ceiling(capsys):
    limits.print_table("t", [("a phase", 3.0, 12.0)])
    assert capsys.readouterr().out.splitlines()[-1].split()[-1] == "0.250"


def test_the_decoding_weights_are_the_matrices_the_update_counts():
    # Linear weights: q, k, v, o 4 each, MLP 3 x 8, the tied head 6: 46. Parameters: the embedding (the head's
    # tensor, once) 6, the layer's matrices 40, five norms of 2: 56.
    config = tiny_config()
    assert limits.matrix_weights(config) == (46, 56)
    from bench.gpu import _forward_flops
    # one token, no prompt: 2 FLOPs per matrix weight, plus attention's 2 x 2 x 1^2 = 4, which holds no weight
    assert 2 * 46 == _forward_flops(config, [1], 0) - 4


def test_phase_means_leave_out_the_warmup_and_the_rows_without_an_update():
    rows = [{"step": 0, "eval/accuracy": 0.5}] + [{"step": s, "time/update": float(s)} for s in range(1, 6)]
    means, n = limits.phase_means(rows, warmup=3)
    assert n == 2 and means["time/update"] == 4.5


def test_a_ranks_ceiling_is_the_lower_of_its_threads_alone_and_its_share_of_all_cores():
    measured = {"matmul": {("a", "float32", 1): 10.0, ("b", "float32", 1): 30.0, ("b", "bfloat16", 1): 99.0,
                           ("a", "float32", 4): 100.0, ("b", "float32", 4): 80.0},
                "read": {1: 5.0, 4: 8.0}, "copy": {1: 3.0, 4: 40.0}}
    c = limits.rank_ceilings(measured, rank_threads=1, all_threads=4, ranks=2)
    assert (c.matmul, c.read, c.copy) == (30.0, 4.0, 3.0)  # best fp32 shape alone; 8 / 2; alone


def test_threads_per_rank_follow_torchruns_rule(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert (limits.threads_per_rank(2, 8), limits.threads_per_rank(1, 8)) == (1, 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert limits.threads_per_rank(2, 8) == 3


def test_the_ceilings_measured_on_tiny_sizes_are_positive_and_finite():
    import torch
    with one_thread():
        rates = [limits.matmul_rate(8, 16, 8, dtype, 1, repeats=2) for dtype in (torch.float32, torch.bfloat16)]
        rates += list(limits.memory_rates(2**16, 1, repeats=2))
    assert all(math.isfinite(r) and r > 0 for r in rates)


def test_a_run_directory_without_its_files_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        limits.main(["--run", str(tmp_path)])
    assert stop.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        f"error: --run {tmp_path}: no config.json there (a spo.py --run_dir is needed)"]


def test_a_run_with_no_step_after_the_warmup_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time/update": 1.0}\n')
    with pytest.raises(SystemExit):
        limits.main(["--run", str(tmp_path), "--warmup", "1"])
    assert "no training step after --warmup 1" in capsys.readouterr().err
