"""What pickle and a config file would otherwise do: a run directory from elsewhere read as data, nothing in it run.

Its pickles are read allowing no code; a value that names code or a place is used only where the command agrees."""
import hashlib
import json
import os
import pickle
import re

import torch

from machinery.errors import fail


def read_config(run_dir):
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"--resume {run_dir}: cannot read its config.json ({e})", once=True)
    if not isinstance(config, dict) or not isinstance(config.get("steps"), int):
        fail(f"--resume {run_dir}: its config.json is not a run's configuration (a JSON object of spo.py's flags, "
             f"with steps); was it edited?", once=True)
    return config


# Flags that name where a file is: on --resume they may change (the content is checked instead).
LOCATIONS = {"model", "train", "test", "toy_dir"}
SHIPPED = re.compile(r".*[/\\]tasks[/\\]built[/\\](\w+)[/\\](\w+\.parquet)")  # a shipped toy's data, in any checkout


def foreign_values(run_dir, settings, given, model_dir, built_in, shipped):
    """--resume: (settings, errors), every value that names code or a place checked (shipped: this checkout's toy)."""
    settings, errors = {**settings, "model": model_dir}, []
    if "reward" in settings and settings["reward"] not in built_in and "reward" not in given:  # (absent: the default)
        errors.append(f"--resume {run_dir}: its config.json names the verifier {settings['reward']!r}, which is "
                      f"not built in, and --resume runs no code a run directory names: pass --reward "
                      f"{settings['reward']} to run it (if you trust it)")
    if settings.get("wandb") and "wandb" not in given:
        _say(f"--resume {run_dir}: its run logged to the wandb project {settings['wandb']!r}; not logging there "
             f"unless --wandb names it now")
        settings["wandb"] = None
    for flag in ("train", "test"):
        path = settings.get(flag)
        if flag in given or (path is None and flag == "test") or (isinstance(path, str) and os.path.isfile(path)):
            continue
        toy = SHIPPED.fullmatch(path) if isinstance(path, str) else None
        here = toy and shipped and os.path.join(shipped, toy[1], toy[2])
        if here and os.path.isfile(here):
            _say(f"--resume {run_dir}: --{flag} {path} is not there; using this checkout's {here} (the same "
                 f"shipped toy: its prompts are checked against the run's)")
            settings[flag] = here
        else:
            errors.append(f"--resume {run_dir}: its --{flag} {path} is not there (a run moved, or made in another "
                          f"checkout): name where the file is now with --{flag} (checked against the run's prompts)")
    return settings, errors


def _say(line):
    if os.environ.get("RANK", "0") == "0":  # every rank reads the config; one says it
        print(line, flush=True)


def same_held_out(settings, keys, resumed):
    """A digest of the held-out prompts' keys (None: no held-out set); on --resume another set's is one line."""
    digest = hashlib.sha1("\n".join(keys).encode()).hexdigest()[:16] if keys is not None else None
    if resumed and settings.get("held_out", digest) != digest:
        fail(f"--test {settings['test']}: not the run's held-out set (its prompts differ from those the run "
             f"evaluated on): name the run's held-out file with --test", once=True)
    return digest


def nested(x, f):
    return {k: nested(v, f) for k, v in x.items()} if isinstance(x, dict) else f(x)


def read_state(path):
    """A checkpoint's state.pt, its tensors back to numpy arrays; weights_only: reading it runs no code."""
    return nested(torch.load(path, weights_only=True), lambda v: v.numpy() if isinstance(v, torch.Tensor) else v)


# DCP's .metadata is a pickle of these, nothing else (`read_shards_metadata`).
DCP_METADATA_TYPES = {("torch", name) for name, v in vars(torch).items() if isinstance(v, torch.dtype)} | {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), *(("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"))}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):  # checked before anything is imported: an import runs a module's code
        if (module, name) not in DCP_METADATA_TYPES:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not one of DCP's metadata types")
        return super().find_class(module, name)


def read_shards_metadata(path):
    """shards/.metadata unpickled with only DCP's metadata types allowed (DCP's own reader allows code)."""
    with open(path, "rb") as f:
        return _MetadataUnpickler(f).load()
