"""A run directory from elsewhere read as data, nothing in it run: what pickle and a config file would otherwise do.

Its pickles are read allowing no code; a value that names code or a place is used only where the command agrees.
Every file from outside (data, offline values, a run's files, a checkpoint's headers) is read by read_file, and its
JSON by parse_json: a FIFO or a device, a file too large, JSON too deep or of another shape is a ValueError saying
so, which the caller turns into one line naming the file, never a hang or a traceback."""
import hashlib
import json
import os
import pickle
import re
import stat

import torch

from machinery.errors import fail, shown

_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory"}


def special(path):
    """What path is when it is there but not a regular file ("a FIFO (named pipe)", "a directory"...), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "a special file")


def open_file(path):
    """A regular file opened to read bytes; ValueError when it is something else (reading a FIFO would wait for a
    writer, a device might never end), OSError when it cannot be opened."""
    if kind := special(path):
        raise ValueError(f"{kind}, not a regular file")
    return open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb")  # a FIFO put there since: read as empty, at once


def read_file(path, max_bytes=1 << 32):
    """open_file(path)'s bytes; ValueError also when it holds more than max_bytes."""
    with open_file(path) as f:
        if (size := os.fstat(f.fileno()).st_size) > max_bytes:
            raise ValueError(f"{size} bytes, more than the {max_bytes} such a file may hold")
        return f.read()


def parse_json(data, shape=object, max_depth=64):
    """JSON from outside, checked: ValueError saying what is wrong: not JSON, nested deeper than max_depth (deeper
    JSON was a RecursionError), a lone surrogate in a string (no text holds one: no response could match it), or
    another shape than `shape` (misfit)."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth}") from None
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth}")
        if isinstance(item, str) and not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"a lone surrogate (\\u{ord(item[e.start]):x}) in {item[:60]!r}") from None
        elif isinstance(item, (dict, list)):
            stack += [(x, depth + 1) for x in (item if isinstance(item, list) else [*item, *item.values()])]
    if (where := misfit(value, shape)) is not None:
        raise ValueError(f"its JSON has another shape (at {where or 'the top level'})")
    return value


def misfit(value, shape, at=""):
    """Where value departs from shape ("": the top level), or None. A shape is a type (float takes ints too, object
    anything), [the shape of every item], {str: the shape of every value}, or {key: shape} (those keys at least)."""
    if isinstance(shape, type):
        return None if shape is object or type(value) in {float: (int, float)}.get(shape, (shape,)) else at
    if type(value) is not type(shape):
        return at
    parts = (enumerate(value) if isinstance(shape, list) else value.items() if list(shape) == [str] else
             ((key, value.get(key, misfit)) for key in shape))
    each = shape[0] if isinstance(shape, list) else shape.get(str)
    return next((where for key, item in parts if (where := misfit(item, each or shape[key], f"{at}/{key}")) is not
                 None), None)


def read_json(path, shape=object, max_bytes=1 << 32):
    """parse_json of read_file(path): ValueError or OSError, for the caller to name path."""
    return parse_json(read_file(path, max_bytes), shape)


def read_config(run_dir):
    try:
        config = read_json(os.path.join(run_dir, "config.json"), {"steps": int})
    except OSError as e:
        fail(f"--resume {run_dir}: cannot read its config.json ({e})", once=True)
    except ValueError as e:
        fail(f"--resume {run_dir}: its config.json is not a run's configuration (a JSON object of spo.py's flags, "
             f"with steps: {e}); was it edited?", once=True)
    return config


HUB_DATASET = re.compile(r"([\w-][\w.-]*/[\w-][\w.-]*)(?::([\w.-]+))?(?:@([\w.-]+))?")  # owner/name[:config][@split]
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
    settings.pop("wandb", None)  # (a run from before --report_to: its trackers are not resumed)
    for flag in ("train", "test"):
        path = settings.get(flag)
        if flag in given or (path is None and flag == "test") or (isinstance(path, str) and (
                os.path.isfile(path) or HUB_DATASET.fullmatch(path))):  # a hub name: its prompts are checked
            continue
        toy = SHIPPED.fullmatch(path) if isinstance(path, str) else None
        here = toy and shipped and os.path.join(shipped, toy[1], toy[2])
        if here and os.path.isfile(here):
            if os.environ.get("RANK", "0") == "0":  # every rank reads the config; one says it
                print(f"--resume {run_dir}: --{flag} {shown(path)} is not there; using this checkout's {here} (the "
                      f"same shipped toy: its prompts are checked against the run's)", flush=True)
            settings[flag] = here
        else:
            errors.append(f"--resume {run_dir}: its --{flag} {path} is not there (a run moved, or made in another "
                          f"checkout): name where the file is now with --{flag} (checked against the run's prompts)")
    return settings, errors


def same_held_out(settings, keys, resumed):
    """A digest of the held-out prompts' keys (None: no held-out set); on --resume another set's is one line."""
    held_out = digest(list(keys)) if keys is not None else None
    if resumed and settings.get("held_out", held_out) != held_out:
        fail(f"--test {settings['test']}: not the run's held-out set (its prompts differ from those the run "
             f"evaluated on): name the run's held-out file with --test", once=True)
    return held_out


def digest(path_or_lines):
    """A short digest of what a rank reads: a list of lines (prompt keys, in order), a file's bytes, or a folder's
    file names and sizes with the bytes of its files under 1 MiB (a model's config and tokenizer, not its weights:
    reading 16 GB of weights on every rank to compare them would cost minutes). None for None or nothing there."""
    h = hashlib.sha1()
    if isinstance(path_or_lines, list):
        h.update("\n".join(path_or_lines).encode())
    elif path_or_lines is None or not os.path.exists(path_or_lines):
        return None
    elif os.path.isfile(path_or_lines):
        h.update(read_file(path_or_lines, 2 ** 31))
    else:
        for folder, _, names in sorted(os.walk(path_or_lines)):
            for name in sorted(names):
                path = os.path.join(folder, name)
                size = os.path.getsize(path) if os.path.exists(path) else -1  # (a link to nothing: -1)
                h.update(f"{os.path.relpath(path, path_or_lines)} {size}\n".encode())
                h.update(read_file(path, size) if 0 <= size < 2 ** 20 and not special(path) else b"")
    return h.hexdigest()[:16]


def same_everywhere(inputs, gather):
    """Every rank reads what rank 0 reads: inputs {flag: digest} (nodes read node-local copies: a --train copy with
    its rows in another order would put another prompt behind each of the tracker's keys). gather: all_gather_objects.
    A difference is one line naming the flag and the hosts that differ, on every rank."""
    import socket
    seen = gather([(socket.gethostname(), inputs)])
    (host0, first), hosts = seen[0], {}
    for host, mine in seen:
        for flag in (f for f in first if mine[f] != first[f]):
            hosts.setdefault(flag, set()).add(host)
    for flag, where in hosts.items():
        fail(f"{flag}: the ranks on {', '.join(sorted(where))} read other contents than rank 0 on {host0} (node-local "
             f"copies that differ: other rows, another order, another model or values file); give every node the "
             f"same", once=True)


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
