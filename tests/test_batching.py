"""How the trainer cuts its work (machinery/batching.py): micro-batches within the token budget, and sequences
dealt to the ranks by tokens. The same plan under torchrun is tested in tests/test_trainer.py.

    .venv/bin/python -m pytest tests/test_batching.py -q
"""
import numpy as np

from machinery import batching


def test_token_budget_micro_batches_cover_every_sequence_once_within_the_budget():
    lengths = [5, 17, 3, 9, 9, 30, 1, 12]
    plan = batching.plan_micro_batches(lengths, max_sequences=3, max_tokens=20)
    assert sorted(i for group in plan for i in group) == list(range(len(lengths)))
    for group in plan:
        longest = max(lengths[i] for i in group)  # sequences are padded to the micro-batch's longest
        assert len(group) <= 3 and (len(group) * longest <= 20 or len(group) == 1)
        assert [lengths[i] for i in group] == sorted((lengths[i] for i in group), reverse=True)
    assert plan[0] == [5]  # 30 tokens: over the budget, alone
    assert batching.plan_micro_batches(lengths, max_sequences=3) == [[0, 1, 2], [3, 4, 5], [6, 7]]  # no budget


def test_ranks_get_tokens_not_counts():
    """Longest first to the least-loaded rank: no rank ends with more than the lightest one plus the longest
    sequence, where slicing by count (first half / second half) gives one rank nearly all the tokens."""
    lengths = [16000, 15000, 14000, 900, 800, 700, 600, 500]
    owner = batching.assign_by_tokens(lengths, world=2)
    load = np.bincount(owner, weights=lengths, minlength=2)
    assert load.max() - load.min() <= max(lengths) and load.max() < 0.6 * sum(lengths)
    assert list(batching.assign_by_tokens([5, 5, 5, 5], world=2)) == [0, 1, 0, 1]  # ties: in order, lowest rank
