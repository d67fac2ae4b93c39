"""How the trainer cuts its work so that every forward pass fits a token budget, the same way on every rank.

- `plan_micro_batches`: sequences packed longest first into micro-batches of at most --max_tokens_per_micro_batch
  tokens (padding included) and --micro_batch_size sequences;
- `assign_by_tokens` / `deal_by_tokens`: all ranks' sequences dealt to the ranks by tokens, so the slowest rank
  is not the one that drew the longest responses;
- `micro_batches`: the plan padded to one count on every rank (FSDP2's passes are collectives);
- `LOGIT_CHUNK_BYTES`: the output projection's share, computed a chunk of positions at a time;
- `pack`: a micro-batch as right-padded rows, the layout of the loss; `packed_row`: the same sequences as ONE row
  without padding, the layout the decoder runs on (`packed_attention`: each sequence attends to itself only).
The loss is a token sum over a global count, so none of these choices changes the gradient, only the memory a
pass needs and how long the slowest rank takes. memory.py estimates a rank's peak from the same numbers.
"""
import numpy as np
import torch

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


# ------------------------------------------------------------------------------------------------ packing
def pack(sequences, device):
    """Right-padded (B, T) ids and the (B, T-1) mask of predicted response tokens that count in the loss.

    Right padding needs no attention mask: with causal attention real tokens never see the pads after them. The
    decoder does not run on these rows where the model takes packed_attention (packed_row)."""
    T = max(len(p) + len(r) for p, r, _ in sequences)
    ids = torch.zeros(len(sequences), T, dtype=torch.long)
    mask = torch.zeros(len(sequences), T - 1)
    for i, (p, r, m) in enumerate(sequences):
        ids[i, : len(p) + len(r)] = torch.tensor(list(p) + list(r))
        mask[i, len(p) - 1: len(p) - 1 + len(r)] = torch.as_tensor(m, dtype=torch.float)
    return ids.to(device), mask.to(device)


IDLE = ([0], [0], [0])  # a one-token dummy sequence with mask 0, for a rank with no work in a micro-batch


def packed_row(ids, rows, cols):
    """The rows of (B, T) ids that hold the N positions (rows, cols) asked for, concatenated into ONE row without
    padding: (1, S) ids, (1, S) positions (each sequence from 0), (k+1,) int32 sequence bounds on the host (the
    cumulative lengths, flash-attention's cu_seq_lens) and (N,) the index of each asked position in the row.

    A row is cut after its last asked position + 1 (the target): with causal attention the tokens after it change
    nothing asked for. Padding costs a micro-batch's decoder (longest x count) / (sum of lengths) in FLOPs: 1.23x
    for 8 SmolLM2 sequences of 99 prompt tokens and up to 48 response tokens."""
    needed = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device).scatter_reduce_(
        0, rows, cols + 2, "amax")  # (B,) tokens each row needs; 0 for rows nothing is asked of
    kept = needed.nonzero().squeeze(1).tolist()
    lengths = needed[kept].tolist()
    bounds = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)  # (k+1,)
    start = torch.zeros(ids.shape[0], dtype=torch.long)
    start[kept] = bounds[:-1].long()
    flat = torch.cat([ids[row, :n] for row, n in zip(kept, lengths)])[None]  # (1, S)
    positions = torch.cat([torch.arange(n, device=ids.device) for n in lengths])[None]  # (1, S)
    return flat, positions, bounds, start.to(ids.device)[rows] + cols


# The name under which packed_attention is registered with transformers' AttentionInterface.
PACKED_ATTENTION = "spo_packed"


def packed_attention(module, query, key, value, attention_mask, cu_seq_lens_q=None, sliding_window=None, **kwargs):
    """transformers' attention-function interface over ONE packed row (packed_row): torch's scaled-dot-product
    attention (transformers' sdpa integration, GQA included) on each sequence's own slice of the (1, heads, S, d)
    query, key and value, causal within it, so no sequence sees another and none pays for another's padding.
    cu_seq_lens_q: the row's sequence bounds, passed down from the decoder's call. A sliding window (Mistral,
    some Qwen layers) becomes an explicit mask where a sequence is longer than it. Anything else that lives in
    the mask transformers would have built is not here: called without bounds, or with attention sinks, it
    refuses rather than attend across sequences."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise RuntimeError("packed_attention: the model's attention is set for one packed row with its sequence "
                           "bounds (batching.packed_row, trainer.response_logprobs); this call passed none")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("packed_attention: attention sinks (s_aux) are not supported")
    bounds = cu_seq_lens_q.tolist()
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        mask = None  # causal (sdpa's is_causal)
        if sliding_window is not None and hi - lo > sliding_window:
            i = torch.arange(hi - lo, device=query.device)
            mask = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window))[None, None]  # (1,1,n,n)
        out.append(sdpa_attention_forward(module, query[:, :, lo:hi], key[:, :, lo:hi], value[:, :, lo:hi], mask,
                                          **kwargs)[0])  # (1, n, heads, d)
    return torch.cat(out, 1), None


def use_packed_attention(model):
    """Make the model's attention packed_attention (registered with transformers once). True if the model took
    it; False for a model that does not route attention through transformers' AttentionInterface (it then runs
    on padded rows, as before)."""
    from transformers import AttentionInterface
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    try:
        model.set_attn_implementation(PACKED_ATTENTION)
    except (ValueError, AttributeError):
        return False
    return model.config._attn_implementation == PACKED_ATTENTION
