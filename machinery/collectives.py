"""Stands in for torch.distributed's all_gather_object and all_reduce on numpy: one collective, not two (bench).

The small collectives every rank runs: numpy arrays and picklable objects gathered from all ranks, in rank order,
built on all-gather. On gloo each collective has a fixed cost that dominates the toy's small messages (its
all-reduce of a few numbers costs more than its all-gather, and an all-gather of 64 KiB about what one of 16 bytes
does: docs/design.md), so a reduction is an all-gather and a sum, several arrays travel in one collective, and
objects travel in one fixed-size buffer. On nccl the same calls move GPU tensors. FSDP2's own collectives move the
weights and gradients (machinery/trainer.py).
Not run on its own; tests/test_trainer.py checks them on three ranks.
"""
import pickle

import numpy as np
import torch
import torch.distributed as dist


def _comm_device():
    """nccl moves only GPU tensors; gloo only CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_np(values, op="sum"):
    """Element-wise sum (or max) of a small float array over all ranks, in rank order: an all-gather and a sum,
    since gloo's all-reduce of a few numbers takes longer than its all-gather (docs/design.md)."""
    parts = all_gather_np(np.asarray(values, dtype=np.float64).reshape(1, -1))  # (world, n)
    return parts.max(0) if op == "max" else parts.sum(0)


def all_gather_np(*arrays):
    """Concatenate numpy arrays from all ranks, in rank order: all_gather_np(a) -> a of every rank;
    all_gather_np(a, b, ...) -> (a of every rank, b of every rank, ...) in ONE collective (each has a fixed cost).
    Each array has the same size on every rank; several travel as float64 (exact for int and bool arrays)."""
    if len(arrays) == 1:
        t = torch.as_tensor(np.ascontiguousarray(arrays[0]), device=_comm_device())
        out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t)
        return torch.cat(out).cpu().numpy()
    arrays = [np.asarray(a) for a in arrays]
    rows = all_gather_np(np.concatenate([a.astype(np.float64).reshape(-1) for a in arrays])[None])  # (world, n)
    cuts = np.cumsum([0] + [a.size for a in arrays])
    return tuple(rows[:, lo:hi].reshape(-1).astype(a.dtype) for a, lo, hi in zip(arrays, cuts[:-1], cuts[1:]))


# all_gather_objects' fixed first buffer: gloo gathers 64 KiB in about the time it gathers 16 bytes
# (docs/design.md).
OBJECT_BUCKET_BYTES = 2 ** 16


def all_gather_objects(items):
    """Concatenate per-rank lists of picklable objects from all ranks, in rank order. torch's all_gather_object
    spends two collectives (the sizes, then the padded pickles); here each rank sends a fixed OBJECT_BUCKET_BYTES
    buffer (its pickle's length, then the pickle), and only if a pickle overflows it do all ranks (each knowing
    every length now) gather the overflows too."""
    data, room = np.frombuffer(pickle.dumps(items), dtype=np.uint8), OBJECT_BUCKET_BYTES - 8
    first = np.zeros(OBJECT_BUCKET_BYTES, dtype=np.uint8)
    first[:8], first[8: 8 + min(len(data), room)] = np.array([len(data)], np.int64).view(np.uint8), data[:room]
    gathered = all_gather_np(first[None])  # (world, OBJECT_BUCKET_BYTES)
    lengths = gathered[:, :8].copy().view(np.int64)[:, 0]  # (world,)
    spill = int(lengths.max()) - room
    overflow = all_gather_np(np.pad(data[room:], (0, spill - len(data[room:])))[None]) if spill > 0 else None
    return [item for r, n in enumerate(lengths) for item in pickle.loads(
        gathered[r, 8: 8 + min(n, room)].tobytes() + (overflow[r, : n - room].tobytes() if n > room else b""))]

