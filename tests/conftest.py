"""Fixtures shared by the test modules: a small toy, one short SPO run, and the scripted tool model.

They are session-scoped: each is built once and read by several modules. Tests that start vLLM or torchrun carry
the `slow` marker, so `pytest -m "not slow" test_spo.py tests` is a quick loop (the README's test command runs
everything).
"""
import math

import pytest
import torch

from common import SCRIPT_ENDS, ok, one_thread, script_responses, toy_args, torchrun


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts vLLM or torchrun (minutes in all on 2 cores)")


@pytest.fixture(scope="session")
def small_toy(tmp_path_factory):
    """A toy built in seconds: fewer prompts and warm-start steps than the default, same recipe."""
    from tasks import toy
    toy_dir = str(tmp_path_factory.mktemp("toy") / "toy")
    with one_thread():
        toy.build_toy(toy_dir, seed=0, n_train=200, n_test=40, steps=150)
    return {"model": f"{toy_dir}/model", "train": f"{toy_dir}/train.parquet", "test": f"{toy_dir}/test.parquet"}


@pytest.fixture(scope="session")
def spo_run(small_toy, tmp_path_factory):
    """4 SPO steps on 2 ranks, checkpoints at steps 2 and 4: read by the end-to-end, resume and eval tests."""
    run = tmp_path_factory.mktemp("runs") / "spo"
    proc = ok(torchrun(2, *toy_args(small_toy, run, "--steps", "4", "--save_every", "2")))
    return run, proc


@pytest.fixture(scope="session")
def scripted_model(tmp_path_factory):
    """The toy's architecture trained to say exactly common.script_responses() to each script's name: a model
    whose tool calls (a good one, an error, a timeout, an endless loop, an unclosed block) are known."""
    from tasks import toy
    out = str(tmp_path_factory.mktemp("scripted") / "model")
    tokenizer = toy.build_tokenizer(out)
    model = toy.build_model(tokenizer, seed=0)
    scripts = script_responses()
    prompts = list(scripts)
    batches = [toy.encode_segments(tokenizer, [p for p in prompts if (p in SCRIPT_ENDS) == end],
                                   [scripts[p] for p in prompts if (p in SCRIPT_ENDS) == end], end_of_turn=end)
               for end in (True, False)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    with one_thread():
        for step in range(300):
            loss = sum(-toy.response_logprob(model, ids, mask).sum() / mask[:, 1:].sum() for ids, mask in batches)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            nll = max(float(-toy.response_logprob(model, ids, mask).min()) for ids, mask in batches)
    # Tests sample these scripts at temperature 1 (offline values: 2 samples each) and expect them said as written:
    # every whole script has probability above 0.86. After 130 steps the mean token loss was below 0.05, yet one
    # script had probability 0.07 on one machine and the offline-values test failed there; 300 steps: 0.94.
    assert nll < 0.15, f"a script has probability {math.exp(-nll):.2f}: train the scripted model longer"
    model.save_pretrained(out)
    return out
