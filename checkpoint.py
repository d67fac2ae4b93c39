"""Checkpoints: nothing lost, resume exact.

A checkpoint is a directory written atomically (into step_N.tmp, renamed when complete, then `latest` replaced):
- shards/: the fp32 weights and the optimiser state as torch.distributed.checkpoint shards, every rank writing
  its own in parallel: no rank gathers the optimiser state (66 GB for an 8B model under Adam), and resume reads
  exactly what was written;
- model/: a plain Hugging Face model (config, weights, tokenizer) that transformers, vLLM and eval.py load as it
  is, gathered to rank 0;
- state.pt: the run's own state: step, world size, the training set's prompt keys, the tracker, the sampler's
  RNG, SPO's previous responses and the run's flags.
Resume checks the world size and the training set, builds the policy from model/ and loads shards/ over it.
Not run on its own: spo.py calls it; tests/test_end_to_end.py resumes runs and compares them with straight ones.
"""
import os
import shutil

import torch
import torch.distributed as dist

from data import fail


def save_checkpoint(run_dir, step, model, optimizer, tokenizer, world, prompt_keys, tracker_state,
                    sampler_state, previous, config, keep=2, export_dtype=None):
    """Write checkpoints/step_N atomically: everything goes into step_N.tmp, which is renamed only when
    complete, then `latest` is replaced atomically. A crash mid-write leaves the previous checkpoint intact.

    step_N/shards: the fp32 weights and the optimiser state as torch.distributed.checkpoint shards, each rank
    writing its own in parallel (what resume reads: exact). step_N/model: a plain Hugging Face model that
    transformers, vLLM and eval.py load, gathered to rank 0 in export_dtype (spo.py: bf16 on GPU, the engine's
    dtype, half the bytes; None: fp32). step_N/state.pt: the run's own state, small next to the weights."""
    import copy
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    root = os.path.join(run_dir, "checkpoints")
    final, tmp = os.path.join(root, f"step_{step:06d}"), os.path.join(root, f"step_{step:06d}.tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "model"))
    dist.barrier()
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=os.path.join(tmp, "shards"))
    model_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        if model.config.tie_word_embeddings:
            model_state.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses aliases
        save_file({k: (v if export_dtype is None else v.to(export_dtype)).contiguous() for k, v in model_state.items()},
                  os.path.join(tmp, "model", "model.safetensors"), metadata={"format": "pt"})
        hf_config = copy.deepcopy(model.config)
        if export_dtype is not None:
            hf_config.dtype = export_dtype  # what vLLM's dtype="auto" reads
        hf_config.save_pretrained(os.path.join(tmp, "model"))
        tokenizer.save_pretrained(os.path.join(tmp, "model"))
        torch.save({"step": step, "world_size": world, "prompt_keys": prompt_keys, "tracker": tracker_state,
                    "sampler": sampler_state, "previous": previous, "config": config},
                   os.path.join(tmp, "state.pt"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(os.path.basename(final))
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
        for old in done[:-keep]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    dist.barrier()


def load_checkpoint(run_dir, world, prompt_keys):
    """The latest complete checkpoint of run_dir, checked against this run's world size and dataset."""
    root = os.path.join(run_dir, "checkpoints")
    try:
        with open(os.path.join(root, "latest")) as f:
            path = os.path.join(root, f.read().strip())
        state = torch.load(os.path.join(path, "state.pt"), weights_only=False)  # our own file: numpy inside
    except (OSError, EOFError, RuntimeError) as e:
        fail(f"--resume {run_dir}: no complete checkpoint found ({e.__class__.__name__}: {e})")
    if "prompt_keys" not in state or not os.path.isdir(os.path.join(path, "shards")):  # README, "Choices"
        fail(f"--resume {run_dir}: the checkpoint was written by an older spo.py and cannot be resumed by this one; "
             f"its model directory still loads (--model {os.path.join(path, 'model')})")
    if state["prompt_keys"] != prompt_keys:
        fail(f"--resume {run_dir}: the checkpoint was made with another training set "
             f"({len(state['prompt_keys'])} prompts there, {len(prompt_keys)} here, or a different order)")
    if state["world_size"] != world:
        fail(f"--resume {run_dir}: the checkpoint was made with world size {state['world_size']}, this run has "
             f"{world}: per-rank sampling would differ, so it cannot resume exactly; use --nproc_per_node="
             f"{state['world_size']}")
    state["model_dir"], state["shards"] = os.path.join(path, "model"), os.path.join(path, "shards")
    return state


def restore_training_state(model, optimizer, shards):
    """Load a checkpoint's fp32 weights and optimiser state (save_checkpoint's shards) into the built policy and
    its optimiser: each rank reads its own shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optim_state = get_state_dict(model, optimizer)  # the optimiser's state is created first
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=shards)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
