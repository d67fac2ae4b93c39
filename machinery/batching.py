"""How the trainer cuts its work so that every forward pass fits a token budget, the same way on every rank.

- `plan_micro_batches`: sequences packed longest first into micro-batches of at most --max_tokens_per_micro_batch
  tokens (padding included) and --micro_batch_size sequences;
- `assign_by_tokens` / `deal_by_tokens`: all ranks' sequences dealt to the ranks by tokens, so the slowest rank
  is not the one that drew the longest responses;
- `micro_batches`: the plan padded to one count on every rank (FSDP2's passes are collectives);
- `LOGIT_CHUNK_BYTES`: the output projection's share, computed a chunk of positions at a time.
The loss is a token sum over a global count, so none of these choices changes the gradient, only the memory a
pass needs and how long the slowest rank takes. memory.py estimates a rank's peak from the same numbers.
"""
import numpy as np

# One chunk of fp32 logits takes at most this many bytes: 441 positions at Qwen3's vocabulary of 151,936. The
# backward of a chunk holds a few tensors of this size (the logits, their softmax, their gradient).
LOGIT_CHUNK_BYTES = 2 ** 28


def plan_micro_batches(lengths, max_sequences, max_tokens=None):
    """Micro-batches as lists of positions into `lengths` (prompt + response tokens per sequence).

    max_tokens None: consecutive groups of max_sequences. Otherwise a token budget: sequences sorted longest first
    and packed while (sequences x the longest one) stays within max_tokens, padding included (sequences in a
    micro-batch are padded to its longest); a sequence longer than the budget gets a micro-batch of its own.
    The loss is a sum over tokens divided by a global count, so how sequences are grouped never changes the
    gradient, only the memory each forward needs."""
    n = len(lengths)
    if max_tokens is None:
        return [list(range(k, min(k + max_sequences, n))) for k in range(0, n, max_sequences)]
    plan, current = [], []
    for i in sorted(range(n), key=lambda i: -lengths[i]):  # stable: ties keep their order
        if current and ((len(current) + 1) * lengths[current[0]] > max_tokens or len(current) >= max_sequences):
            plan.append(current)
            current = []
        current.append(i)
    return plan + ([current] if current else [])


def assign_by_tokens(lengths, world):
    """(n,) the rank that computes each sequence: longest first, each to the rank with the fewest tokens so far
    (ties: the lowest rank). Every rank derives the same assignment from the same list. Which rank computes a
    sequence never changes the gradient (the loss is a token sum over a global count), only how long the
    slowest rank takes: with responses of 1k to 16k tokens, slicing by count can leave one rank several times
    the tokens of another."""
    load, owner = np.zeros(world), np.zeros(len(lengths), dtype=np.int64)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep their order
        owner[i] = int(np.argmin(load))
        load[owner[i]] += lengths[i]
    return owner


def micro_batches(lengths, max_sequences, max_tokens=None, shares=None):
    """plan_micro_batches, padded with empty micro-batches to the same count on every rank: FSDP2's forward and
    backward are collectives, so a rank with less work still runs as many (on a dummy sequence). shares: every
    rank's lengths (deal_by_tokens), from which each rank plans them all; None: one collective finds the most."""
    from machinery.collectives import all_reduce_np
    plan = plan_micro_batches(lengths, max_sequences, max_tokens)
    count = (int(all_reduce_np([len(plan)], op="max")[0]) if shares is None else
             max(len(plan_micro_batches(share, max_sequences, max_tokens)) for share in shares))
    return plan + [[]] * (count - len(plan))


def deal_by_tokens(items, length, budget=True):
    """Token budgets: all ranks' items dealt to the ranks by tokens (assign_by_tokens; `length`: an item's
    tokens). Returns this rank's items, every rank's lengths (for micro_batches) and all items; without a
    budget: items, None, None (every rank keeps its own)."""
    if not budget:
        return items, None, None
    import torch.distributed as dist
    from machinery.collectives import all_gather_objects
    everything, world = all_gather_objects(items), dist.get_world_size()
    lengths = [length(item) for item in everything]
    owner = assign_by_tokens(lengths, world)
    shares = [[n for n, o in zip(lengths, owner) if o == k] for k in range(world)]
    return [item for item, o in zip(everything, owner) if o == dist.get_rank()], shares, everything
