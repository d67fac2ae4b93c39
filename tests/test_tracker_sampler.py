"""The tracker's and the sampler's guards and saved state: bad input is refused with an error that says what is
wrong, and a saved state restores exactly (and refuses another training set's size). Their math is in test_spo.py.

    .venv/bin/python -m pytest tests/test_tracker_sampler.py -q
"""
import numpy as np
import pytest

from sampler import PromptSampler
from tracker import ValueTracker


@pytest.mark.parametrize("index, reward, rho, match", [
    ([0, 0], [1.0, 0.0], [0.9, 0.8], "different rho"),
    ([0], [np.nan], 0.9, "NaN"),
    ([7], [1.0], 0.9, "out of range"),
    ([-1], [1.0], 0.9, "out of range"),
    ([0, 1], [1.0], 0.9, "same length"),
    ([0.0], [1.0], 0.9, "integer"),
    ([0], [1.0], 1.5, r"\[0, 1\]"),
])
def test_update_rejects_bad_input(index, reward, rho, match):
    with pytest.raises(ValueError, match=match):
        ValueTracker(3).update(np.array(index), np.array(reward), rho)


def test_tracker_state_round_trip_and_size_check():
    tracker = ValueTracker(4, rho_constant=0.9)
    tracker.update(np.array([0, 2]), np.array([1.0, 0.0]), 0.9)
    state = tracker.state_dict()
    tracker.update(np.array([0]), np.array([0.0]), 0.9)  # the saved state must not alias the live arrays
    restored = ValueTracker(4)
    restored.load_state_dict(state)
    assert restored.rho_constant == 0.9
    np.testing.assert_array_equal(restored.alpha, [1.45, 0.5, 0.45, 0.5])
    with pytest.raises(ValueError, match="4 prompts, this run has 5"):
        ValueTracker(5).load_state_dict(state)


@pytest.mark.parametrize("call, match", [
    (lambda s: s.draw(11), "batch_size"),
    (lambda s: s.draw(0), "batch_size"),
    (lambda s: s.set_weights(np.ones(9)), "expected 10 weights"),
    (lambda s: s.set_weights(-np.ones(10)), ">= 0"),
    (lambda s: s.set_weights(np.full(10, np.nan)), "finite"),
    (lambda s: s.set_weights(np.ones(2), np.array([3, 3])), "repeated"),
    (lambda s: s.set_weights(np.ones(1), np.array([10])), "out of range"),
    (lambda s: s.set_weights(np.zeros(10)) or s.draw(2), "all prompt weights are 0"),
    (lambda s: s.set_weights(np.array([1.0, 1.0] + [0.0] * 8)) or s.draw(3), "fewer prompts with weight > 0"),
])
def test_sampler_rejects_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call(PromptSampler(10, seed=0))


def test_tracker_counts_visits_and_keeps_them_in_its_state():
    """visits: rewards absorbed per prompt (a prompt repeated in a batch counts each time); the count survives a
    checkpoint, and a checkpoint from before it existed resumes with zeros."""
    t = ValueTracker(4)
    t.update(np.array([0, 2, 2]), np.array([1.0, 0.0, 1.0]), 0.9)
    t.update(np.array([2]), np.array([1.0]), 0.9)
    assert t.visits.tolist() == [1, 0, 3, 0]
    again = ValueTracker(4)
    again.load_state_dict(t.state_dict())
    assert again.visits.tolist() == [1, 0, 3, 0]
    old = {k: v for k, v in t.state_dict().items() if k != "visits"}
    again.load_state_dict(old)
    assert again.visits.tolist() == [0, 0, 0, 0] and np.array_equal(again.alpha, t.alpha)


def test_sampler_state_size_check():
    with pytest.raises(ValueError, match="10 prompts"):
        PromptSampler(11, seed=0).load_state_dict(PromptSampler(10, seed=0).state_dict())
