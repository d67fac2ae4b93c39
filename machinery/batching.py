"""Micro-batches by token budget, in packed rows with shared prefixes once, in place of padded (B, T) batches
(the gain: docs/benchmarks.md).

None of these choices changes the gradient (a token sum over a global count), only memory and time."""
from dataclasses import dataclass

import numpy as np
import torch

# One chunk of fp32 logits takes at most this many bytes (the backward holds a few tensors of this size).
LOGIT_CHUNK_BYTES = 2 ** 28


def plan_micro_batches(lengths, max_sequences, max_tokens=None, padded=False):
    """Micro-batches of at most max_sequences, first-fit decreasing within max_tokens as the packed row runs them."""
    n = len(lengths)
    if max_tokens is None:
        return [list(range(k, min(k + max_sequences, n))) for k in range(0, n, max_sequences)]
    plan, used = [], []  # the micro-batches, and the tokens of each
    for i in sorted(range(n), key=lambda i: -lengths[i]):  # stable: ties keep their order
        cost = (lambda k: (len(plan[k]) + 1) * lengths[plan[k][0]]) if padded else (lambda k: used[k] + lengths[i])
        candidates = range(max(len(plan) - 1, 0) if padded else 0, len(plan))  # padded: the last one only
        k = next((k for k in candidates if len(plan[k]) < max_sequences and cost(k) <= max_tokens), None)
        if k is None:  # a new micro-batch
            k = len(plan)
            plan.append([])
            used.append(0)
        plan[k].append(i)
        used[k] += lengths[i]
    return plan


def assign_by_tokens(lengths, world):
    """(n,) each sequence's rank: longest first, to the rank with the fewest tokens (counts would not balance)."""
    load, owner = np.zeros(world), np.zeros(len(lengths), dtype=np.int64)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep their order
        owner[i] = int(np.argmin(load))
        load[owner[i]] += lengths[i]
    return owner


def micro_batches(lengths, max_sequences, max_tokens=None, shares=None, padded=False):
    """plan_micro_batches padded to one count on every rank (FSDP2's passes are collectives)."""
    from machinery.collectives import all_reduce_np
    plan = plan_micro_batches(lengths, max_sequences, max_tokens, padded)
    count = (int(all_reduce_np([len(plan)], op="max")[0]) if shares is None else
             max(len(plan_micro_batches(share, max_sequences, max_tokens, padded)) for share in shares))
    return plan + [[]] * (count - len(plan))


def deal_by_tokens(items, length, budget=True):
    """(this rank's items, every rank's lengths, all items), dealt by tokens; without a budget (items, None, None)."""
    if not budget:
        return items, None, None
    import torch.distributed as dist
    from machinery.collectives import all_gather_objects
    everything, world = all_gather_objects(items), dist.get_world_size()
    lengths = [length(item) for item in everything]
    owner = assign_by_tokens(lengths, world)
    shares = [[n for n, o in zip(lengths, owner) if o == k] for k in range(world)]
    return [item for item, o in zip(everything, owner) if o == dist.get_rank()], shares, everything


@dataclass
class Sequence:
    """One sequence of a micro-batch (mask 0: tool output); owner, index: where old_logprobs sends its result."""
    prompt: list
    response: list
    mask: object
    old: object = None
    advantage: float = 0.0
    weights: object = None
    ref: object = None  # the reference policy's log-probs (--kl_coef)
    owner: int = 0
    index: int = 0

    def __len__(self):
        return len(self.prompt) + len(self.response)


IDLE = Sequence([0], [0], [0])  # a one-token dummy sequence with mask 0, for a rank with no work in a micro-batch


def pack(sequences, device="cpu"):
    """Right-padded (B, T) ids and the (B, T-1) loss mask (causal: no attention mask needed)."""
    sequences = [s if isinstance(s, Sequence) else Sequence(*s) for s in sequences]
    ids = np.zeros((len(sequences), max(map(len, sequences))), dtype=np.int64)
    mask = np.zeros((len(sequences), ids.shape[1] - 1), dtype=np.float32)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = list(s.prompt) + list(s.response)
        mask[i, len(s.prompt) - 1: len(s) - 1] = s.mask
    return to_device([torch.from_numpy(ids), torch.from_numpy(mask)], torch.device(device))


def loss_terms(sequences, weights=False, ref=False):
    """Each sequence's old log-probs, per-token weights (1 where none) and reference log-probs, laid out as pack's
    (B, T-1) mask, and the (B,) advantages. Weights and reference log-probs only where asked for (None else): a
    run without --tis or --kl_coef builds and moves nothing for them."""
    old = np.zeros((len(sequences), max(map(len, sequences)) - 1), dtype=np.float32)
    weights, ref = np.ones_like(old) if weights else None, np.zeros_like(old) if ref else None
    for i, s in enumerate(sequences):
        for values, row in ((s.old, old), (s.weights, weights), (s.ref, ref)):
            if values is not None and row is not None:
                row[i, len(s.prompt) - 1: len(s) - 1] = values
    return [None if a is None else torch.from_numpy(a) for a in (old, weights, ref)] + [
        torch.from_numpy(np.array([s.advantage for s in sequences], dtype=np.float32))]


def to_device(tensors, device):
    """Host tensors on `device` (None stays None); on CUDA in ONE non-blocking copy from a pinned buffer, so the
    host never waits."""
    if device.type != "cuda":
        return list(tensors)
    present = [t for t in tensors if t is not None]
    raw = [t.contiguous().reshape(-1).view(torch.uint8) for t in present]
    offsets = np.cumsum([0] + [-(-r.numel() // 8) * 8 for r in raw])  # each part 8-byte aligned, for its view
    buffer = torch.empty(int(offsets[-1]), dtype=torch.uint8, pin_memory=True)
    for r, at in zip(raw, offsets):
        buffer[at: at + r.numel()] = r
    moved = buffer.to(device, non_blocking=True)
    parts = iter([moved[at: at + r.numel()].view(t.dtype).view(t.shape) for t, r, at in zip(present, raw, offsets)])
    return [None if t is None else next(parts) for t in tensors]


def shared_prefix_groups(sequences):
    """[(shared prefix length, [positions])], every position once: runs of the sorted order that spare the most."""
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    common = []  # common[j]: the common prefix length of order[j] and order[j + 1]
    for a, b in zip(order[:-1], order[1:]):
        x, y = sequences[a], sequences[b]
        n = min(len(x), len(y))
        differ = np.flatnonzero(np.asarray(x[:n]) != np.asarray(y[:n]))
        common.append(int(differ[0]) if len(differ) else n)
    best, cut = [0] * (len(order) + 1), [0] * (len(order) + 1)  # over the first b sequences of the order
    for b in range(1, len(order) + 1):
        best[b], cut[b], shared = best[b - 1], b - 1, None  # order[b - 1] alone
        for a in range(b - 2, -1, -1):  # the run order[a:b]
            shared = common[a] if shared is None else min(shared, common[a])
            if best[a] + (b - a - 1) * shared > best[b]:
                best[b], cut[b] = best[a] + (b - a - 1) * shared, a
    groups, b = [], len(order)
    while b > 0:
        a = cut[b]
        groups.append((min(common[a: b - 1]) if b - a > 1 else 0, order[a: b]))
        b = a
    return groups[::-1]


@dataclass
class PackedLayout:
    """calls: (k, L) row positions per attention call, each row a prefix and one sequence, padded by repeating its
    last position; pick: (S,) each row position's output among the calls'; gather: the calls' positions, flat."""
    calls: list
    pick: torch.Tensor
    gather: torch.Tensor


# An attention call takes sequences side by side while their padded tokens stay within this factor of the real.
CALL_PADDING = 1.25


def _attention_calls(prefix, members):
    """[(members, (k, L) row positions)] for one group, longest first, within CALL_PADDING."""
    members = sorted(members, key=lambda m: m[0] - m[1])  # longest first (stable)
    calls, current = [], []
    for m in members:
        longest = current[0] if current else m
        width, real = len(prefix) + longest[1] - longest[0], sum(len(prefix) + hi - lo for lo, hi in current + [m])
        if current and (len(current) + 1) * width > CALL_PADDING * real:
            calls.append(current)
            current = []
        current.append(m)
    calls.append(current)
    out = []
    for call in calls:
        width = len(prefix) + call[0][1] - call[0][0]
        rows = [np.concatenate([prefix, np.arange(lo, hi)]) for lo, hi in call]
        out.append((call, np.stack([np.pad(row, (0, width - len(row)), mode="edge") for row in rows])))
    return out


def packed_row(ids, rows, cols):
    """The rows holding positions (rows, cols) as ONE row, each shared prefix once, each cut after its last target."""
    ids, rows, cols = (np.asarray(x.cpu() if torch.is_tensor(x) else x) for x in (ids, rows, cols))
    needed = np.zeros(len(ids), dtype=np.int64)  # (B,) tokens each row needs; 0 for rows nothing is asked of
    np.maximum.at(needed, rows, cols + 2)
    kept = np.flatnonzero(needed).tolist()
    sequences = [ids[row, :needed[row]].tolist() for row in kept]
    tokens, positions, calls, pick, base = [], [], [], [], 0  # base: outputs of the calls so far, flattened
    prefix_at, own_at, shared_of = np.zeros((3, len(ids)), dtype=np.int64)
    for shared, members in shared_prefix_groups(sequences):
        prefix = np.arange(len(tokens), len(tokens) + shared)  # its row positions
        tokens += sequences[members[0]][:shared]
        positions += range(shared)
        owns = []
        for m in members:
            row, own = kept[m], sequences[m][shared:]
            prefix_at[row], own_at[row], shared_of[row] = int(prefix[0]) if shared else 0, len(tokens), shared
            owns.append((len(tokens), len(tokens) + len(own)))
            tokens += own
            positions += range(shared, shared + len(own))
        start = {}  # a member's own (start, end) -> where its outputs begin among the calls' flattened outputs
        pick.append(np.arange(base, base + shared))  # the prefix's outputs: the first call's first member's
        for call, at in _attention_calls(prefix, owns):
            start.update({own: base + j * at.shape[1] + shared for j, own in enumerate(call)})
            calls.append(at)
            base += at.size
        pick += [np.arange(start[(lo, hi)], start[(lo, hi)] + hi - lo) for lo, hi in owns]
    layout = PackedLayout([torch.from_numpy(c) for c in calls], torch.from_numpy(np.concatenate(pick)),
                          torch.from_numpy(np.concatenate([c.ravel() for c in calls])))
    prefix_at, own_at, shared_of = prefix_at[rows], own_at[rows], shared_of[rows]
    index = np.where(cols < shared_of, prefix_at + cols, own_at + cols - shared_of)  # (N,)
    return torch.tensor(tokens)[None], torch.tensor(positions)[None], layout, torch.from_numpy(index)


# The name under which packed_attention is registered with transformers' AttentionInterface.
PACKED_ATTENTION = "spo_packed"


# Eager inside a compiled decoder layer (--compile on): its loop over the layout's calls would make dynamo guard on
# their count and shapes, a new graph for every micro-batch's layout until the recompile limit sends the layer eager.
@torch.compiler.disable
def packed_attention(module, query, key, value, attention_mask, packed_layout=None, sliding_window=None, **kwargs):
    """sdpa over ONE packed row, each sequence over its prefix and its own tokens only; without a layout, or with
    attention sinks, it refuses rather than attend across sequences."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward, use_gqa_in_sdpa
    if packed_layout is None or query.shape[0] != 1:
        raise RuntimeError("packed_attention: the model's attention is set for one packed row with its layout "
                           "(batching.packed_row, logprob_head.response_logprobs); this call passed none")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("packed_attention: attention sinks (s_aux) are not supported")
    # one gather per tensor for all the calls: a gather per call costs each backward a zero buffer of the row
    sizes = [positions.numel() for positions in packed_layout.calls]
    gathered = (x[0].index_select(1, packed_layout.gather).split(sizes, 1) for x in (query, key, value))
    out = []
    for positions, *qkv in zip(packed_layout.calls, *gathered):  # (k, L); each of q, k, v (heads, k L, d)
        q, k, v = (x.unflatten(1, positions.shape).transpose(0, 1) for x in qkv)  # (k, heads, L, d)
        n, mask = positions.shape[1], None  # None: causal (sdpa's is_causal)
        if sliding_window is not None and n > sliding_window:
            i = torch.arange(n, device=q.device)
            mask = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window))[None, None]
        # where transformers would pass enable_gqa (with a mask it repeats k and v itself)
        if use_gqa_in_sdpa(mask, k, v) and _needs_repeated_kv(q.device.type, q.dtype, q.shape[1], k.shape[1]):
            k, v = (repeat_kv(x, q.shape[1] // k.shape[1]) for x in (k, v))
        out.append(sdpa_attention_forward(module, q, k, v, mask, **kwargs)[0].flatten(0, 1))  # (k L, heads, d)
    return torch.cat(out).index_select(0, packed_layout.pick)[None], None  # (1, S, heads, d)


def _needs_repeated_kv(device_type, dtype, heads, kv_heads):
    """On CUDA in fp32 with GQA sdpa falls back to its math kernel (every head's scores): repeated heads avoid it."""
    return device_type == "cuda" and dtype == torch.float32 and kv_heads < heads


def use_packed_attention(model):
    """packed_attention for the model; False for one outside AttentionInterface (it then runs on padded rows)."""
    from transformers import AttentionInterface
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    try:
        model.set_attn_implementation(PACKED_ATTENTION)
    except (ValueError, AttributeError):
        return False
    return model.config._attn_implementation == PACKED_ATTENTION
