"""Collectives on numpy arrays and objects, several in one (in place of torch.distributed's all_gather_object
and all_reduce one by one: bench), and the policy's full parameters gathered from FSDP2's shards.

On gloo each collective has a fixed cost that dominates small messages (docs/design.md), so few travel."""
import math
import pickle
import re

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


_PEER_GONE = re.compile(r"Connection (closed|reset) by peer")  # gloo's words when a rank's process has ended


def all_reduce_np(values, op="sum"):
    """Element-wise sum (or max) over all ranks: an all-gather and a sum (gloo's all-reduce is slower)."""
    parts = all_gather_np(np.asarray(values, dtype=np.float64).reshape(1, -1))  # (world, n)
    return parts.max(0) if op == "max" else parts.sum(0)


def all_gather_np(*arrays):
    """Numpy arrays of every rank, concatenated; several arrays in ONE collective, as float64 (exact for ints)."""
    if len(arrays) == 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        t = torch.as_tensor(np.ascontiguousarray(arrays[0]), device=device)
        out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        try:
            dist.all_gather(out, t)
        except RuntimeError as e:  # a rank that stopped on an error of its own (a verifier's, say) printed it: one
            if not _PEER_GONE.search(str(e)):  # line from this rank too, not a traceback beneath it
                raise
            from machinery.errors import fail
            fail(f"rank {dist.get_rank()} stopped too: another rank stopped first (its error is above)")
        return torch.cat(out).cpu().numpy()
    arrays = [np.asarray(a) for a in arrays]
    rows = all_gather_np(np.concatenate([a.astype(np.float64).reshape(-1) for a in arrays])[None])  # (world, n)
    cuts = np.cumsum([0] + [a.size for a in arrays])
    return tuple(rows[:, lo:hi].reshape(-1).astype(a.dtype) for a, lo, hi in zip(arrays, cuts[:-1], cuts[1:]))


def barrier():
    """dist.barrier, as an all-gather of nothing: a rank that stopped first is one line here too (all_gather_np)."""
    all_gather_np(np.zeros(1))


# all_gather_objects' fixed first buffer: gloo gathers 64 KiB in about the time of 16 bytes (docs/design.md)
OBJECT_BUCKET_BYTES = 2 ** 16


def all_gather_objects(items):
    """Per-rank lists of objects, concatenated, in one collective (two only when a pickle overflows the bucket)."""
    data, room = np.frombuffer(pickle.dumps(items), dtype=np.uint8), OBJECT_BUCKET_BYTES - 8
    first = np.zeros(OBJECT_BUCKET_BYTES, dtype=np.uint8)
    first[:8], first[8: 8 + min(len(data), room)] = np.array([len(data)], np.int64).view(np.uint8), data[:room]
    gathered = all_gather_np(first[None])  # (world, OBJECT_BUCKET_BYTES)
    lengths = gathered[:, :8].copy().view(np.int64)[:, 0]  # (world,)
    spill = int(lengths.max()) - room
    overflow = all_gather_np(np.pad(data[room:], (0, spill - len(data[room:])))[None]) if spill > 0 else None
    return [item for r, n in enumerate(lengths) for item in pickle.loads(
        gathered[r, 8: 8 + min(n, room)].tobytes() + (overflow[r, : n - room].tobytes() if n > room else b""))]


# One all-gather for many shards (every gloo collective has a fixed cost); the bound keeps a second full copy out.
PUSH_BUCKET_BYTES = 2 ** 28


def full_parameters(model, dtype=None, bucket_bytes=PUSH_BUCKET_BYTES):
    """(name, full tensor), one all-gather per bucket (dtype: cast before it), on every rank; tied weights under
    both names (vLLM's CPU backend packs a tied lm_head apart). The root unit stays gathered for the next forward."""
    if hasattr(model, "unshard"):  # an FSDP2 module (not a plain one)
        model.unshard()
    bucket, size = [], 0
    for name, p in model.named_parameters(remove_duplicate=False):
        p = p.detach() if dtype is None else p.detach().to(dtype)
        if not isinstance(p, DTensor) or tuple(p.placements) != (Shard(0),):  # unsharded, or not FSDP2's layout
            yield from _gather_bucket(bucket)
            bucket, size = [], 0
            yield name, p.full_tensor() if isinstance(p, DTensor) else p
            continue
        nbytes = p.numel() * p.element_size()
        if bucket and (size + nbytes > bucket_bytes or p.dtype != bucket[0][1].dtype):
            yield from _gather_bucket(bucket)
            bucket, size = [], 0
        bucket.append((name, p))
        size += nbytes
    yield from _gather_bucket(bucket)


def _shard_rows(rows, world):
    """Rows of dim 0 on each rank under FSDP2's Shard(0) (torch.chunk: ceil(rows / world) each, the rest last)."""
    per = -(-rows // world)
    return [max(0, min(per, rows - r * per)) for r in range(world)]


def _gather_bucket(bucket):
    if not bucket:
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = [_shard_rows(p.shape[0], world) for _, p in bucket]
    for (name, p), r in zip(bucket, rows):
        if p.to_local().shape[0] != r[rank]:
            raise RuntimeError(f"full_parameters: {name} has {p.to_local().shape[0]} rows here, not {r[rank]}")
    numel = [[n * math.prod(p.shape[1:]) for n in r] for (_, p), r in zip(bucket, rows)]  # elements per rank
    per_rank = [sum(n[k] for n in numel) for k in range(world)]
    flat = torch.cat([p.to_local().reshape(-1) for _, p in bucket])
    flat = torch.nn.functional.pad(flat, (0, max(per_rank) - flat.numel()))  # all_gather needs equal sizes
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat)
    offset = [0] * world
    for (name, p), n in zip(bucket, numel):  # each rank's part holds its rows of every tensor, in bucket order
        yield name, torch.cat([parts[k][offset[k]: offset[k] + n[k]] for k in range(world)]).view(p.shape)
        offset = [o + m for o, m in zip(offset, n)]
