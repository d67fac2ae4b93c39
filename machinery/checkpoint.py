"""The checkpoint format: atomic steps, named damage, exact resume, on torch.distributed.checkpoint (shards) and
transformers (export).

step_N.tmp, fsynced, renamed when complete: shards/ (each rank its own), model/ (for vLLM and eval.py), state.pt
and manifest.json (every file's size). A damaged newest checkpoint is never stepped back from silently."""
import copy
import errno
import itertools
import json
import os
import re
import shutil
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from machinery.collectives import all_gather_objects, barrier, full_parameters
from machinery.errors import fail
from machinery.untrusted import (misfit, nested, open_file, parse_json, read_file, read_json, read_shards_metadata,
                                 read_state)


@dataclass
class Run:
    """What spo.py's start built for its loop, handed over once with the final flags: where this process runs,
    the task, the policy and its engine, and the state a checkpoint saves and resume restores."""
    rank: int
    world: int
    device: torch.device
    tools: object  # a rollout.Tools, or None
    tokenizer: object
    data: object  # the training prompts (machinery.data.Dataset)
    test: object  # the held-out prompts, or None
    on_toy: bool
    policy: torch.nn.Module  # FSDP2
    optimizer: torch.optim.Optimizer
    reference: object  # --kl_coef's reference, the initial policy (FSDP2, never trained), or None at 0
    engine: object  # the colocated rollout engine
    tracker: object  # tracker.ValueTracker
    sampler: object  # sampler.PromptSampler
    previous: dict  # prompt -> spo.PreviousResponse (SPO only)
    resampling: object  # variants.Resampling: --oversample's draws per prompt
    start_step: int  # 0, or the checkpoint's

    def close(self):
        """The sandbox workers, then the engine (whose shutdown also tears down the process group)."""
        if self.tools:
            self.tools.pool.close()
        self.engine.shutdown()

    def save(self, run_dir, step, config, export_dtype=None):
        save_checkpoint(run_dir, step, self.policy, self.optimizer, self.tokenizer, self.world, self.data.keys,
                        self.tracker.state_dict(), self.sampler.state_dict(),
                        {i: vars(p) for i, p in self.previous.items()}, config, reach=self.resampling.state_dict(),
                        export_dtype=export_dtype)


def latest_step(run_dir):
    try:
        return int(read_file(os.path.join(run_dir, "checkpoints", "latest"), 64).strip().removeprefix(b"step_"))
    except (OSError, ValueError):
        return None


def checkpoint_dirs(run_dir):
    """run_dir's published step_N directories, oldest first (not `latest`: it may name one the user deleted)."""
    root = os.path.join(run_dir, "checkpoints")
    try:
        names = [n for n in os.listdir(root) if STEP.fullmatch(n)]
    except OSError:
        return []
    return [os.path.join(root, n) for n in sorted(names, key=lambda n: int(n[5:]))
            if os.path.isdir(os.path.join(root, n))]


STEP = re.compile(r"step_[0-9]{6,}")  # save_checkpoint's names: only these are read, rotated and replaced


def remove(path):
    """path gone, a symbolic link itself (never what it points to); whether it is gone (read-only trees stay)."""
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    else:
        shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def no_checkpoint(run_dir):
    return (f"--resume {run_dir}: no checkpoint there to continue from (a run that stopped before its first "
            f"checkpoint saved nothing); start it afresh with --run_dir {run_dir}")


def resume_point(run_dir):
    """(the newest checkpoint, None) or (None, one error line): going back past a damaged one is the user's choice."""
    found = checkpoint_dirs(run_dir)
    if not found:
        return None, no_checkpoint(run_dir)
    problem = damaged(found[-1])
    if problem is None:
        return found[-1], None
    bad = [found[-1]]
    for path in reversed(found[:-1]):
        if damaged(path) is None:
            return None, (f"--resume {run_dir}: its latest checkpoint is damaged ({problem}); the newest intact one "
                          f"is {os.path.basename(path)}: delete {' and '.join(bad)} to resume from it")
        bad.append(path)
    return None, (f"--resume {run_dir}: its latest checkpoint is damaged ({problem}) and no earlier one is intact: "
                  f"start a new run with another --run_dir")


def _fsync_tree(root):
    """Every file and directory under root on disk: a rename must never publish bytes only in the page cache."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(folder, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


MANIFEST = "manifest.json"


def _write_manifest(folder):
    sizes = {os.path.relpath(os.path.join(d, n), folder).replace(os.sep, "/"): os.path.getsize(os.path.join(d, n))
             for d, _, names in os.walk(folder) for n in names}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"files": dict(sorted(sizes.items()))}, f, indent=0)


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _safetensors_problem(path):
    size = _size(path)
    try:
        with open_file(path) as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                return f"{path}: {size} bytes, shorter than its header says"
            header = parse_json(f.read(n), {str: dict})
        header.pop("__metadata__", None)
        if (where := misfit(header, {str: {"data_offsets": [int]}})) is not None:
            raise ValueError(f"its JSON has another shape (at {where})")
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
    except (OSError, ValueError, IndexError) as e:
        return f"{path}: unreadable safetensors header ({e})"
    return None if size == 8 + n + end else f"{path}: {size} bytes, its header describes {8 + n + end}"


def damaged(path, part=""):
    """The first damaged file under path/part (sizes against manifest.json, then safetensors headers), or None."""
    try:
        written = read_json(os.path.join(path, MANIFEST), {"files": {str: int}})["files"]
    except FileNotFoundError:
        return f"{os.path.join(path, MANIFEST)}: missing (the checkpoint's last file: its writing did not finish)"
    except (OSError, ValueError) as e:
        return f"{os.path.join(path, MANIFEST)}: unreadable ({e})"
    problems = []
    for name, size in written.items():
        have = _size(os.path.join(path, name)) if name.startswith(part) else size
        if have != size:
            problems.append(f"{os.path.join(path, name)}: {'missing' if have is None else f'{have} bytes'}, {size} "
                            f"were written")
    if not problems:
        model = os.path.join(path, "model")
        names = sorted(n for n in os.listdir(model) if n.endswith(".safetensors")) if os.path.isdir(model) else []
        problems = [p for p in (_safetensors_problem(os.path.join(model, n)) for n in names) if p]
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "") if problems else None


# The HF export's safetensors files hold at most this many bytes each: rank 0 holds one file's tensors at a time.
EXPORT_FILE_BYTES = 2 ** 32


def _export_plan(model, dtype, file_bytes):
    """The HF export's files as lists of names in full_parameters' order, each within file_bytes."""
    tensors = list(model.named_parameters())  # a tied output projection once, under the embedding's name
    state = model.state_dict()  # (FSDP2: DTensors, nothing gathered) persistent buffers are in it, others not
    tensors += [(name, b) for name, b in model.named_buffers() if name in state]
    files, size = [[]], 0
    for name, t in tensors:
        nbytes = t.numel() * (dtype or t.dtype).itemsize
        if files[-1] and size + nbytes > file_bytes:
            files, size = files + [[]], 0
        files[-1].append(name)
        size += nbytes
    return files


def export_hf(model, out_dir, dtype=None, write=True, file_bytes=EXPORT_FILE_BYTES):
    """Hugging Face safetensors in out_dir, rank 0 writing each file once its tensors are in; its error or None."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    files = _export_plan(model, dtype, file_bytes)
    names = ([f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))] if len(files) > 1
             else ["model.safetensors"])
    where = {name: k for k, file in enumerate(files) for name in file}
    buffers = ((name, b) for name, b in model.named_buffers() if name in where)
    write, error, pending, total = write and dist.get_rank() == 0, None, {}, 0
    for name, tensor in itertools.chain(full_parameters(model, dtype), buffers):
        if not write or error or name not in where:  # a tied weight's second name, or nothing to write here
            continue
        k = where[name]
        pending.setdefault(k, {})[name] = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
        total += tensor.numel() * (dtype or tensor.dtype).itemsize
        if len(pending[k]) == len(files[k]):  # the file is complete: write it, let its tensors go
            try:
                save_file(pending.pop(k), os.path.join(out_dir, names[k]), metadata={"format": "pt"})
            except (OSError, SafetensorError) as e:
                error = _why(e)
    if write and not error and len(files) > 1:
        try:
            with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total},
                           "weight_map": {name: names[k] for name, k in where.items()}}, f, indent=2)
        except OSError as e:
            error = _why(e)
    return error


def save_checkpoint(run_dir, step, model, optimizer, tokenizer, world, prompt_keys, tracker_state,
                    sampler_state, previous, config, keep=2, export_dtype=None, reach=None):
    """Write checkpoints/step_N atomically: a crash mid-write leaves the previous checkpoint intact."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.checkpoint.api import CheckpointException
    root = os.path.join(run_dir, "checkpoints")
    final, tmp = os.path.join(root, f"step_{step:06d}"), os.path.join(root, f"step_{step:06d}.tmp")
    error = None

    def agree(error):  # every rank learns of any rank's failure, so all stop together with one line
        error = next((e for e in all_gather_objects([error]) if e), None)
        if error is None:
            return
        if dist.get_rank() == 0:
            remove(tmp)
        kept = ([f"the previous checkpoint ({os.path.basename(p)}) is intact" for p in checkpoint_dirs(run_dir)]
                or ["there is no previous checkpoint"])[-1]
        if error in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)):
            fail(f"disk full ({error}) while writing checkpoint step {step} to {tmp}: the partial directory was "
                 f"removed ({shutil.disk_usage(root).free / 2**30:.1f} GiB free now) and {kept}; free space, then "
                 f"--resume {run_dir}", once=True)
        fail(f"checkpoint of step {step} not written to {tmp} ({error}); the partial directory was removed "
             f"and {kept}", once=True)
    if dist.get_rank() == 0:
        try:
            remove(tmp)  # a link there is removed, not followed: nothing is written outside the run directory
            os.makedirs(os.path.join(tmp, "model"))
        except OSError as e:
            error = _why(e)
    agree(error)
    try:
        dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=os.path.join(tmp, "shards"))
    except (OSError, CheckpointException) as e:
        error = _why(e)
    error = export_hf(model, os.path.join(tmp, "model"), export_dtype, write=error is None) or error
    if dist.get_rank() == 0 and error is None:
        try:
            hf_config = copy.deepcopy(model.config)
            if export_dtype is not None:
                hf_config.dtype = export_dtype  # what vLLM's dtype="auto" reads
            hf_config.save_pretrained(os.path.join(tmp, "model"))
            tokenizer.save_pretrained(os.path.join(tmp, "model"))
            state = {"step": step, "world_size": world, "prompt_keys": prompt_keys, "tracker": tracker_state,
                     "sampler": sampler_state, "previous": previous, "config": config, "reach": reach}
            with open(os.path.join(tmp, "state.pt"), "wb") as f:  # a Python file: a full disk raises an OSError
                torch.save(nested(state, lambda v: torch.from_numpy(v) if isinstance(v, np.ndarray) else v), f)
            _write_manifest(tmp)  # last: every rank's shards are in (dcp.save returned on every rank)
            remove(os.path.join(root, "latest.tmp"))  # a link there is not written through
            with open(os.path.join(root, "latest.tmp"), "x") as f:  # written now: publishing is renames only
                f.write(os.path.basename(final))
                f.flush()
                os.fsync(f.fileno())
            _fsync_tree(tmp)
        except Exception as e:  # noqa: BLE001 - OSError; torch.save's RuntimeError; the Rust tokenizer's Exception
            error = _why(e)
    agree(error)
    if dist.get_rank() == 0:
        remove(final)
        os.replace(tmp, final)
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        for old in checkpoint_dirs(run_dir)[:-keep]:  # its own step_N only: a user's step_N_best stays
            remove(old)
    barrier()  # (collectives: a rank that stopped first is one line here too)


def _why(e):
    """Why a checkpoint's write or read failed: the OSError's reason wherever it is under e, else its first line."""
    found = [e]
    for x in found:
        if isinstance(x, OSError):
            return x.strerror or str(x)
        found += [f[0] for f in getattr(x, "failures", {}).values()] + [c for c in (x.__cause__, x.__context__) if c]
    code, last = re.search(r"os error (\d+)\)", str(e)), found[-1]
    return os.strerror(int(code[1])) if code else f"{last.__class__.__name__}: {(str(last).splitlines() or [''])[0]}"


def load_checkpoint(run_dir, world, prompt_keys):
    """The newest checkpoint's state, checked against this run; rank 0 removes the saves that did not finish."""
    path, error = resume_point(run_dir)
    if error:
        fail(error, once=True)
    for name in sorted(os.listdir(os.path.dirname(path))) if os.environ.get("RANK", "0") == "0" else []:
        if STEP.fullmatch(name.removesuffix(".tmp")) and name.endswith(".tmp"):
            link = os.path.islink(os.path.join(os.path.dirname(path), name))
            gone = remove(os.path.join(os.path.dirname(path), name))
            print(f"--resume {run_dir}: {'removed' if gone else 'cannot remove'} {name}, " + (
                "a symbolic link (not followed: what it names is untouched)" if link else
                "a checkpoint whose writing did not finish"), flush=True)

    def read(file, reader):
        try:
            return reader(os.path.join(path, file))
        except Exception as e:  # noqa: BLE001 - sizes checked; a file changed since (a cut pickle raises anything)
            fail(f"--resume {run_dir}: {_read_error(os.path.join(path, file), e)}", once=True)
    state = read("state.pt", read_state)
    read(os.path.join("shards", ".metadata"), read_shards_metadata)  # before anything heavy; DCP reads it again
    if state["prompt_keys"] != prompt_keys:
        fail(f"--resume {run_dir}: the checkpoint was made with another training set "
             f"({len(state['prompt_keys'])} prompts there, {len(prompt_keys)} here, or a different order)")
    if state["world_size"] != world:
        fail(f"--resume {run_dir}: the checkpoint was made by {state['world_size']} ranks, this run has {world}: "
             f"per-rank sampling and shards would differ, so it cannot resume exactly; resume with "
             f"{state['world_size']} ranks in all (--nnodes x --nproc_per_node = {state['world_size']})")
    state["model_dir"], state["shards"] = os.path.join(path, "model"), os.path.join(path, "shards")
    return state


def _read_error(path, e):
    """Why a checkpoint file cannot be read: refused where reading would call something ("GLOBAL module.name")."""
    call = re.search(r"GLOBAL (\S+)", str(e))
    return (f"{path} refused: reading it would call {call[1]}, and a run directory from elsewhere is data: nothing "
            f"in it is run" if call else f"{path} unreadable ({_why(e)})")


def restore_training_state(model, optimizer, shards):
    """save_checkpoint's shards into the policy and optimiser; DCP's two pickles read as data."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):  # FileSystemReader's, with read_shards_metadata's unpickler
            metadata = read_shards_metadata(self._get_metadata_path(kwargs.get("rank")))
            metadata.storage_meta.load_id = self.load_id  # (save_checkpoint's metadata always has storage_meta)
            return metadata

    class Planner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):  # DefaultLoadPlanner's (flattened), with weights_only
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                        torch.load(value, weights_only=True))
    model_state, optim_state = get_state_dict(model, optimizer)  # the optimiser's state is created first
    state = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, storage_reader=Reader(shards), planner=Planner())
    except CheckpointException as e:  # on every rank: DCP shares each rank's failure
        fail(f"--resume: {_read_error(shards, e)}", once=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
