"""The small collectives every rank runs: numpy arrays and picklable objects gathered from all ranks, in rank order;
and FSDP2's two big ones on gloo through memory the ranks of one host share (SharedAllGather, SharedReduceScatter).

The small ones are built on all-gather. On gloo each collective has a fixed cost that dominates the toy's small
messages (its all-reduce of a few numbers costs more than its all-gather, and an all-gather of 64 KiB about
what one of 16 bytes does: docs/design.md), so a reduction is an all-gather and a sum, several arrays travel in
one collective, and objects travel in one fixed-size buffer. On nccl the same calls move GPU tensors.
FSDP2's weight gather and gradient reduce-scatter move the whole model each step: over gloo's loopback socket,
into fresh memory each time, they cost seconds on a 135M model; through a shared buffer they are a copy, a sum
and barriers (docs/benchmarks.md).
Not run on its own; tests/test_trainer.py checks them on two and three ranks.
"""
import math
import mmap
import os
import pickle
import tempfile

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


def _shared_buffer(nbytes, group):
    """(uint8 tensor, its mmap) of nbytes that every rank of `group` maps, the ranks of one host: rank 0 creates a
    file in /dev/shm (the temporary directory where there is none, or where it has less room: a container's is
    often 64 MiB, and a write past a full tmpfs kills the process), the others map it by name, and the name is
    removed once all have mapped it, so nothing outlives the processes."""
    rank, path = dist.get_rank(group), [None]
    if rank == 0:
        room = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
        shm = room is not None and room.f_bavail * room.f_frsize > nbytes
        fd, path[0] = tempfile.mkstemp(prefix="spo-fsdp-", dir="/dev/shm" if shm else None)
        os.ftruncate(fd, nbytes)
        os.close(fd)
    dist.broadcast_object_list(path, src=dist.get_global_rank(group, 0), group=group)
    with open(path[0], "r+b") as f:
        mapped = mmap.mmap(f.fileno(), nbytes)
    dist.barrier(group=group)
    if rank == 0:
        try:
            os.unlink(path[0])
        except OSError:  # (Windows keeps a mapped file's name until the last process closes it)
            pass
    return torch.frombuffer(mapped, dtype=torch.uint8), mapped


class _SharedComm:
    """FSDP2's custom-comm interface (allocate, then __call__; duck-typed: its base classes are private to torch)
    over one buffer the ranks share, grown when FSDP2 asks for more. Every rank asks for the same sizes in the same
    order, so a growth (a collective) happens on all ranks at once."""

    def __init__(self, group):
        self.group, self.buffer, self.mapped = group, None, None  # (the mmap held as long as its tensor)

    def _view(self, byte_offset, numel, dtype):  # (numel,) of dtype at byte_offset of the shared buffer
        end = byte_offset + numel * dtype.itemsize
        if self.buffer is None or self.buffer.numel() < end:
            self.buffer, self.mapped = _shared_buffer(end, self.group)
        return self.buffer[byte_offset: end].view(dtype)


class SharedAllGather(_SharedComm):
    """FSDP2's all-gather of the weights, the ranks on one host: what allocate returns is ONE output all ranks
    share, and FSDP2's copy-in writes each rank's shard straight into its own slice of it, so the gather is a
    barrier. The barrier in allocate keeps a rank from writing the next gather before every rank has copied the
    last one out (FSDP2 copies it into the parameters' own storage before it gathers again)."""

    def allocate(self, size, *, dtype, device):
        dist.barrier(group=self.group)
        return self._view(0, math.prod(size), dtype).view(*size)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        n, rank = input_tensor.numel(), dist.get_rank(group)
        mine = output_tensor.view(-1)[rank * n: (rank + 1) * n]
        if mine.data_ptr() != input_tensor.data_ptr():  # (FSDP2's input is that slice already)
            mine.copy_(input_tensor.view(-1))
        dist.barrier(group=group)  # every rank's shard is in
        return None  # done: FSDP2 waits only on a Work it is given


class SharedReduceScatter(_SharedComm):
    """FSDP2's gradient reduce-scatter, the ranks on one host: FSDP2 allocates twice per reduce-scatter, first its
    input (world x n: this rank's whole gradient), here this rank's slot of a buffer with one slot per rank, which
    FSDP2's copy-in fills; then its output (n, this rank's shard of the sum, kept as the sharded gradient), private
    memory. The call sums this rank's chunk over the slots, in rank order. Two ranks: gloo's bytes (a + b is b + a);
    more: the order of the sum may differ from gloo's in the last bit."""

    def __init__(self, group):
        super().__init__(group)
        self.input_numel = None  # between the input's allocate and the output's

    def allocate(self, size, *, dtype, device):
        numel, world = math.prod(size), dist.get_world_size(self.group)
        if self.input_numel is not None:  # the output
            if numel * world != self.input_numel:
                raise RuntimeError(f"SharedReduceScatter: an output of {numel} after an input of {self.input_numel}")
            self.input_numel = None
            return torch.empty(*size, dtype=dtype, device=device)
        dist.barrier(group=self.group)  # every rank has summed the last reduce-scatter out of the slots
        self._view(0, world * numel, dtype)  # (grown to every rank's slot at once)
        self.input_numel = numel
        return self._view(dist.get_rank(self.group) * numel * dtype.itemsize, numel, dtype).view(*size)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"SharedReduceScatter: {op} (SUM and AVG only)")
        dist.barrier(group=group)  # every rank's gradient is in its slot
        world, rank, n = dist.get_world_size(group), dist.get_rank(group), output_tensor.numel()
        slot = input_tensor.numel()
        parts = [self._view(k * slot * input_tensor.element_size(), slot, input_tensor.dtype)[rank * n: (rank + 1) * n]
                 for k in range(world)]  # this rank's chunk of every rank's gradient
        out = output_tensor.view(-1)
        torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out.add_(part)
        if op == dist.ReduceOp.AVG:
            out.div_(world)
        return None
