"""What pickle and a config file would otherwise do: a run directory from elsewhere read as data, nothing in it run.

--resume reads a run directory that may come from someone else (a shared disk, a download, a moved copy). Its
pickles are read allowing no code: state.pt with torch's weights_only (`read_state`), DCP's shards/.metadata with an
unpickler that allows DCP's metadata types only (`read_shards_metadata`). Its config.json (`read_config`) is read
as values, and a value that names code or a place is used only where this command line agrees (`foreign_values`):
a verifier that is not built in runs only when --reward names it now, a wandb project is logged to only when --wandb
names it now, and the training and held-out files are found where the run left them, in this checkout's shipped toy,
or where --train / --test name them now (their prompts are checked against the run's: `same_held_out` and the
checkpoint's prompt keys). The model always comes from the checkpoint's own model/ (weights and tokenizer).
"""
import hashlib
import json
import os
import pickle
import re

import torch

from machinery.errors import fail


def read_config(run_dir):
    """The run's flags as spo.py wrote them (a JSON object): anything else is one line, not a traceback later."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"--resume {run_dir}: cannot read its config.json ({e})", once=True)
    if not isinstance(config, dict) or not isinstance(config.get("steps"), int):
        fail(f"--resume {run_dir}: its config.json is not a run's configuration (a JSON object of spo.py's flags, "
             f"with steps); was it edited?", once=True)
    return config


# Flags that name where a file is, not what is computed: on --resume they may name where it is now (its content is
# checked instead). --model: a resumed run always loads its checkpoint's model/.
LOCATIONS = {"model", "train", "test", "toy_dir"}
SHIPPED = re.compile(r".*[/\\]tasks[/\\]built[/\\](\w+)[/\\](\w+\.parquet)")  # a shipped toy's data, in any checkout


def foreign_values(run_dir, settings, given, model_dir, built_in, shipped):
    """--resume: the settings read from run_dir's config.json with every value that names code or a place checked
    (given: the flags this command line names; model_dir: the checkpoint's model/; built_in: the --reward specs that
    are ours; shipped: this checkout's built toys, tasks/built). Returns (settings, errors): error lines for a
    verifier that is not built in and not named now, and for data that is not where the run left it. The training
    and held-out files: named now, where the run left them, or (moved from another checkout) this checkout's copy
    of the shipped toy's file, said in one line."""
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
    """The held-out prompts' identity (a digest of their keys, recorded in config.json), or None without a held-out
    set; on --resume a held-out set with other prompts than the run's (where it recorded them) is one line."""
    digest = hashlib.sha1("\n".join(keys).encode()).hexdigest()[:16] if keys is not None else None
    if resumed and settings.get("held_out", digest) != digest:
        fail(f"--test {settings['test']}: not the run's held-out set (its prompts differ from those the run "
             f"evaluated on): name the run's held-out file with --test", once=True)
    return digest


def nested(x, f):
    """x with f applied to each value of its nested dicts: state.pt's numpy arrays <-> tensors."""
    return {k: nested(v, f) for k, v in x.items()} if isinstance(x, dict) else f(x)


def read_state(path):
    """A checkpoint's state.pt (save_checkpoint's), its tensors back to numpy arrays. weights_only: plain data
    and tensors only, so a state file from elsewhere cannot run code when read."""
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
    """DCP's metadata file (shards/.metadata), unpickled with only DCP's metadata types allowed: DCP's own reader
    unpickles it with code execution allowed."""
    with open(path, "rb") as f:
        return _MetadataUnpickler(f).load()
