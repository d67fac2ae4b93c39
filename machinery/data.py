"""On pyarrow, huggingface_hub's cache and transformers' chat templates (no datasets package): stable prompt keys and
one-line file errors; a hub dataset by name (owner/name[:config][@split]) through the hub's parquet export.

A prompt's key is a hash of its chat messages, not its row number: programs and files agree on it."""
import fnmatch
import functools
import glob
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from machinery.errors import fail
from machinery.untrusted import HUB_DATASET, parse_json, read_file, read_json, special


PROMPT_COLUMNS = ("prompt", "problem", "question")  # first one present wins
# reward_model before solution: in plain math files `solution` is often a worked solution, not the answer
ANSWER_COLUMNS = ("answer", "ground_truth", "reward_model", "solution")


@dataclass
class PromptSet:
    keys: list[str]                 # prompt_key(messages): stable across files, reorderings and programs
    messages: list[list[dict]]      # chat messages [{"role", "content"}, ...]
    answers: list[str]              # ground truths, stripped strings
    rows: list[int]                 # the file row each prompt comes from (its first occurrence), for messages
    path: str
    n_rows: int                     # rows in the file
    n_duplicates: int               # rows dropped because their prompt appeared earlier
    n_conflicting: int              # of those, rows whose answer differed from the kept one
    sources: list = None            # each prompt's data_source (verl's column), None where the file has none


def prompt_key(messages: list[dict]) -> str:
    """sha1 of the messages' canonical JSON: a string prompt gets its user message's key (verl = open-r1 DAPO)."""
    canonical = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(canonical.encode("utf-8")).hexdigest()[:16]


def read_rows(path: Path) -> tuple[list[dict], list[str]]:
    if path.suffix == ".parquet":
        import pyarrow as pa  # here: JSON lines need no pyarrow (a bare torch + transformers machine has none)
        import pyarrow.parquet as pq
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: not a readable parquet file ({e})") from None
        for k, field in enumerate(table.schema):  # float32 answers as written: 0.1, not 0.10000000149011612
            if field.type == pa.float32():
                table = table.set_column(k, field.name, table.column(k).cast(pa.string()))
        return table.to_pylist(), table.column_names
    if path.suffix not in (".jsonl", ".ndjson", ".json"):
        raise ValueError(f"{path}: unsupported file type '{path.suffix}' (use .parquet, .jsonl or .json)")
    rows, columns = [], []
    try:
        text = read_file(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); JSON lines must be UTF-8") from None
    except OSError as e:  # permission denied, a directory, an I/O error: as a parquet file says it
        raise ValueError(f"{path}: not a readable JSON lines file ({e.strerror or e})") from None
    # lines end at \n only: str.splitlines would also split at U+2028 and others, which JSON strings may hold
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = parse_json(line, dict)
        except ValueError as e:  # not JSON, too deep, a lone surrogate, not an object
            raise ValueError(f"{path} line {line_no}: not a JSON lines row ({e})") from None
        rows.append(row)
        columns += [c for c in row if c not in columns]
    return rows, columns


def _messages(value, where: str) -> list[dict]:
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: missing or empty prompt")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in value):
        raise ValueError(f"{where}: prompt must be a string or a list of {{'role', 'content'}} string messages")
    if not any(m["content"].strip() for m in value):
        raise ValueError(f"{where}: missing or empty prompt")
    return [{"role": m["role"], "content": m["content"]} for m in value]  # drop extra fields: stable keys


def _answer(value, where: str) -> str:
    if isinstance(value, dict):                                       # verl's reward_model struct
        value = value.get("ground_truth")
    if isinstance(value, float) and value.is_integer():               # parquet float64 answers: 17.0 -> "17"
        value = int(value)
    if isinstance(value, bool) or (value is not None and not isinstance(value, (str, int, float))):
        # bool first: it is an int to Python, and JSON's true would become the answer "True", which no box matches
        raise ValueError(f"{where}: the answer must be a string or a number, got a {type(value).__name__} "
                         f"({str(value)[:40]})")
    if value is None or (isinstance(value, float) and math.isnan(value)) or not str(value).strip():
        raise ValueError(f"{where}: missing or empty answer")
    if isinstance(value, float) and math.isinf(value):  # JSON's Infinity, a parquet inf: no response can match it
        raise ValueError(f"{where}: the answer {value} is not a finite number")
    return str(value).strip()


PARQUET_EXPORT = "refs/convert/parquet"  # the hub's own parquet copy of every dataset: <config>/<split>/*.parquet


def hub_rows(name, flag):
    """Rows and columns of a hub dataset's parquet export (config default, split train), via huggingface_hub's
    cache: read under HF_HUB_OFFLINE=1 and whatever the hub says (unreachable, refusing, a proxy's 503). Each request
    has a deadline (HF_HUB_ETAG_TIMEOUT, 10 s): huggingface_hub's lookups have none (a mute proxy held one forever)."""
    match = HUB_DATASET.fullmatch(name)
    repo, config, split = match[1], match[2] or "default", match[3] or "train"
    for what, part in (("config", config), ("split", split)):  # a folder's name, never a path to another ("..")
        if part[0] in ".-":  # (HUB_DATASET: all else is letters, digits, '_', '.', '-')
            raise ValueError(f"{flag} {name}: the {what} {part!r} is not a plain name (letters, digits, '_', '.', "
                             f"'-', not first): a hub dataset is owner/name[:config][@split]")
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
    where, deadline = dict(repo_id=repo, repo_type="dataset", revision=PARQUET_EXPORT), constants.HF_HUB_ETAG_TIMEOUT
    pattern = f"{config}/{split}/*.parquet"
    try:  # the hub lists every config and split
        listed = [s.rfilename for s in HfApi().dataset_info(repo, revision=PARQUET_EXPORT, timeout=deadline).siblings]
        files = [hf_hub_download(**where, filename=f, etag_timeout=deadline) for f in fnmatch.filter(listed, pattern)]
    except Exception as e:  # noqa: BLE001 - whatever the hub said, the cache (which holds only what was read)
        try:
            folder = snapshot_download(**where, allow_patterns=pattern, local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached either: none of them is a dataset to read
            raise FileNotFoundError(f"{name}: no such file, nor a dataset on the hub or in its cache "
                                    f"({constants.HF_HUB_CACHE}): {type(e).__name__}") from None
        listed = [os.path.relpath(f, folder) for f in glob.glob(os.path.join(glob.escape(folder), "*", "*", "*"))]
        files = glob.glob(os.path.join(glob.escape(folder), config, split, "*.parquet"))
    if not files:
        parts = [p for f in listed if len(p := f.replace(os.sep, "/").split("/")) == 3]  # <config>/<split>/<file>
        splits, named = sorted({p[1] for p in parts if p[0] == config}), f"{repo}:{match[2]}" if match[2] else repo
        if not splits:
            raise ValueError(f"{name}: the dataset {repo} has no config {config!r} (configs there: "
                             f"{', '.join(sorted({p[0] for p in parts})) or 'none'}; name one as {repo}:CONFIG)")
        raise ValueError(f"{name}: the dataset {repo} has no split {split!r} in config {config!r} (splits there: "
                         f"{', '.join(splits)}; name one as {named}@SPLIT)")
    rows, columns = [], []
    for f in sorted(files):  # the export's shards, in order
        more, names = read_rows(Path(f))
        rows += more
        columns += [c for c in names if c not in columns]
    return rows, columns


def load_prompts(path, flag="--data") -> PromptSet:
    """Prompts and answers of a parquet / JSONL file or a hub dataset (named by `flag`), one key per distinct prompt
    (the first answer kept)."""
    path = Path(path)
    if kind := special(path):  # a FIFO would hang the read
        raise ValueError(f"{path}: {kind}, not a data file")
    if path.is_file():
        rows, columns = read_rows(path)
    elif HUB_DATASET.fullmatch(str(path)) and path.suffix not in (".parquet", ".jsonl", ".ndjson", ".json"):
        rows, columns = hub_rows(str(path), flag)
    else:
        raise FileNotFoundError(f"{path}: no such file")
    if not rows:
        raise ValueError(f"{path}: the dataset is empty (no rows)")
    prompt_col = next((c for c in PROMPT_COLUMNS if c in columns), None)
    answer_col = next((c for c in ANSWER_COLUMNS if c in columns), None)
    if prompt_col is None or answer_col is None:
        raise ValueError(f"{path}: unrecognised columns {columns}; need a prompt column (one of "
                         f"{', '.join(PROMPT_COLUMNS)}) and an answer column (one of {', '.join(ANSWER_COLUMNS)})")
    first, n_duplicates, n_conflicting = {}, 0, 0  # prompt key -> (row, messages, answer) of its first row
    for i, row in enumerate(rows):
        where = f"{path} row {i}"
        msgs, answer = _messages(row.get(prompt_col), where), _answer(row.get(answer_col), where)
        if (key := prompt_key(msgs)) in first:
            n_duplicates, n_conflicting = n_duplicates + 1, n_conflicting + (first[key][2] != answer)
        else:
            first[key] = (i, msgs, answer)
    kept_rows, messages, answers = (list(column) for column in zip(*first.values()))
    sources = [None if (s := rows[i].get("data_source")) is None else str(s) for i in kept_rows]
    return PromptSet(list(first), messages, answers, kept_rows, str(path), len(rows), n_duplicates, n_conflicting,
                     sources)


# Without tokenizer files transformers quietly builds an empty tokenizer; without weights a traceback comes later.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def find_model(name, flag="--model"):
    """A --model every loader can open, asked once: an unreachable hub costs each loader a minute of retries (flag:
    what the errors name it)."""
    import urllib.request
    if Path(name).expanduser().is_dir() or os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "false", ""):
        return name  # local, or offline by request: the libraries then read the cache without retrying
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        fail(f"{flag} {name}: no such directory", once=True)
    from huggingface_hub import constants, snapshot_download
    try:
        urllib.request.urlopen(constants.ENDPOINT, timeout=10).close()
        return name
    except urllib.error.HTTPError:  # it answered
        return name
    except OSError as e:  # no route, no DNS, a timeout: use the cache
        offline = str(getattr(e, "reason", e))
    try:
        path = snapshot_download(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (or not a valid name): either way there is nothing to load
        fail(f"{flag} {name}: not a local directory, and the Hugging Face hub cannot be reached ({offline}) nor has "
             f"the cache ({constants.HF_HUB_CACHE}) a copy of it", once=True)
    if os.environ.get("RANK", "0") == "0":
        print(f"{flag} {name}: the hub cannot be reached ({offline}); using the cached copy {path}", flush=True)
    return path


def _few(items, n=3):
    return ", ".join(map(str, items[:n])) + (f" and {len(items) - n} more" if len(items) > n else "")


def unfinished_download(folder):
    """Why files may be missing from a Hugging Face cache snapshot, naming them, or None."""
    folder = Path(folder)
    if folder.parent.name != "snapshots" or not folder.is_dir():
        return None
    inside = sorted(folder.rglob("*"))
    found = [f"{p.relative_to(folder)} (a link to a missing blob)" for p in inside if p.is_symlink() and not p.exists()]
    found += [f"{p} ({p.stat().st_size / 2 ** 20:.1f} MiB so far)"
              for p in sorted((folder.parent.parent / "blobs").glob("*.incomplete"))]
    found += [f"{p.relative_to(folder)}/ (empty)" for p in [folder] + inside if p.is_dir() and not any(p.iterdir())]
    if not found:
        return None
    repo = folder.parent.parent.name.split("--", 1)[-1].replace("--", "/")  # models--owner--name
    return f"the download of {repo} into {folder} did not finish: {_few(found)}; rerun it with network access"


def weights_disagreement(folder):
    """How a directory's safetensors differ from what config.json builds, or None (transformers would load it)."""
    import torch
    import transformers
    from safetensors import SafetensorError, safe_open
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    try:
        files = sorted(set(read_json(index, {"weight_map": {str: str}})["weight_map"].values())) if index.is_file() \
            else ["model.safetensors"] if (folder / "model.safetensors").is_file() else []
    except (OSError, ValueError) as e:
        return f"{index.name} is not a weight index ({e})"
    if missing := [name for name in files if not (folder / name).is_file()]:
        return f"{len(missing)} weight files named in {index.name} are missing ({_few(missing)})"
    if not files:
        return None
    state = {}
    for name in files:
        try:
            with safe_open(folder / name, "pt") as f:
                state.update({k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()})
        except (OSError, SafetensorError) as e:
            return f"{name}: an unreadable safetensors file ({str(e).splitlines()[0][:100]})"
    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # its load report and progress bar: ours is the one line below
    transformers.logging.disable_progress_bar()
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        # transformers' own loading on meta tensors: a name-by-name comparison would refuse models it renames
        _, info = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
            None, config=config, state_dict=state, device_map="meta", ignore_mismatched_sizes=True,
            output_loading_info=True)
    except Exception:  # noqa: BLE001 - a model this cannot build (remote code, quantised...): its loader reports it
        return None
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()
    found = []
    if missing := sorted(info["missing_keys"]):
        found.append(f"{len(missing)} weights missing from the files ({_few(missing)})")
    if unexpected := sorted(info["unexpected_keys"]):
        found.append(f"{len(unexpected)} weights in the files that config.json has no place for ({_few(unexpected)})")
    if mismatched := sorted(info["mismatched_keys"]):
        shapes = [f"{name} {list(have)} in the files, {list(want)} by the config" for name, have, want in mismatched]
        found.append(f"{len(mismatched)} of another shape ({_few(shapes, 1)})")
    return "; ".join(found) or None


@functools.cache  # spo.py asks twice (check_context, load_tokenizer); a failure raises, so it is never cached
def check_model_dir(path):
    folder = Path(path)
    if not folder.is_dir():
        return
    for name in sorted(os.listdir(folder)):  # first: a FIFO would hang a reader, and transformers' errors name no file
        try:
            if name.endswith(".json"):
                read_json(folder / name)
            elif (kind := special(folder / name)) not in (None, "a directory"):
                raise ValueError(f"{kind}, not a regular file")
        except (OSError, ValueError) as e:
            download = unfinished_download(folder)
            fail(f"--model {path}: its {name} is unreadable ({e})" + (f"; {download}" if download else ""), once=True)
    needed = {"config.json": ("config.json",), f"weights ({', '.join(WEIGHT_FILES)})": WEIGHT_FILES,
              f"tokenizer files ({', '.join(TOKENIZER_FILES)})": TOKENIZER_FILES}
    for what, names in needed.items():
        if not any((folder / name).is_file() for name in names):
            fail(f"--model {path}: the directory has no {what}; " + (
                unfinished_download(folder) or "a model directory is what save_pretrained writes (a run "
                                               "directory's checkpoints/step_N/model is one)"), once=True)
    if why := weights_disagreement(folder):
        download = unfinished_download(folder)
        fail(f"--model {path}: its weights do not match its config.json: {why}" + (f"; {download}" if download else
             "; were the weights saved with another config?"), once=True)


def load_tokenizer(path):
    from transformers import AutoConfig, AutoTokenizer
    check_model_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        fail(f"--model {path}: not a model directory and not loadable from the Hugging Face hub "
             f"({str(e).splitlines()[0][:200]})", once=True)
    if len(tokenizer) < 2:
        fail(f"--model {path}: its tokenizer has {len(tokenizer)} tokens; are the tokenizer files complete?", once=True)
    rows = getattr(AutoConfig.from_pretrained(path), "vocab_size", None)
    if rows is not None and len(tokenizer) > rows:  # the engine would stop at the first sampled or prompted new id
        fail(f"--model {path}: its tokenizer has {len(tokenizer)} tokens, more than the {rows} rows of the model's "
             f"embedding (config.json vocab_size): tokens were added without resizing the embedding", once=True)
    if not tokenizer.chat_template:
        fail(f"--model {path}: its tokenizer has no chat template (chat_template.jinja, or chat_template in "
             f"tokenizer_config.json); prompts are chat messages, so a base model needs one added", once=True)
    return tokenizer


def plain_text_ids(tokenizer, text):
    """Token ids of tool output, no added token among them (Qwen3's <tool_call> is added but not special)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # no tokenizers backend (a slow tokenizer): the special tokens, at least, are split
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    text = backend.normalizer.normalize_str(text) if backend.normalizer else text
    pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer else [(text, None)]
    return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]

def check_context(model, tokens, flags):
    """tokens fit --model's max_position_embeddings: vLLM refuses a longer context with a traceback."""
    from transformers import AutoConfig
    check_model_dir(model)  # a directory without config.json: one line, not AutoConfig's traceback
    limit = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    if limit is not None and tokens > limit:
        fail(f"{flags} = {tokens} tokens, more than --model {model}'s {limit} positions (max_position_embeddings)",
             once=True)


@dataclass
class Dataset:
    keys: list         # stable prompt keys (prompt_key); the tracker is indexed by position in this list
    prompt_ids: list   # token ids of each chat-formatted prompt
    answers: list
    sources: list = None  # data_source per prompt (held-out accuracy is also logged per source where they differ)

    def __getitem__(self, s):
        """The prompts at s, a slice or a list of positions."""
        take = (lambda column: column[s]) if isinstance(s, slice) else (lambda column: [column[i] for i in s])
        return Dataset(take(self.keys), take(self.prompt_ids), take(self.answers), self.sources and take(self.sources))


def with_system(messages, system_prompt):
    if not system_prompt:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": system_prompt + "\n\n" + messages[0]["content"]}] + messages[1:]
    return [{"role": "system", "content": system_prompt}] + messages


def load_dataset(path, tokenizer, max_prompt_len, verbose, system_prompt=None, flag="--data"):
    """Chat-formatted prompt token ids; system_prompt changes what the model sees, not the keys."""
    try:
        prompts = load_prompts(path, flag)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e), once=True)  # every rank reads the same file: one line, not one per rank
    texts = []
    for i, messages in enumerate(prompts.messages):
        try:
            texts.append(tokenizer.apply_chat_template(with_system(messages, system_prompt), add_generation_prompt=True,
                                                       tokenize=False))
        except Exception as e:  # noqa: BLE001 - jinja raises its own kinds (e.g. a template that rejects a role)
            roles = ", ".join(m["role"] for m in with_system(messages, system_prompt))
            fail(f"{path} row {prompts.rows[i]}: the prompt (roles {roles}) is rejected by the chat template of "
                 f"--model {tokenizer.name_or_path}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", once=True)
    # A token spans at most its own string's characters and NFC merges at most 4 code points into one: a longer
    # text cannot fit and is left out untokenised (a 4 MiB prompt took 2 GB to tokenise).
    max_chars = max_prompt_len * 4 * max(map(len, tokenizer.get_vocab()))
    prompt_ids = [tokenizer.encode(t, add_special_tokens=False) if len(t) <= max_chars else None for t in texts]
    keep = [i for i, p in enumerate(prompt_ids) if p is not None and len(p) <= max_prompt_len]
    if verbose and prompts.n_duplicates:
        print(f"{path}: {prompts.n_duplicates} duplicate prompts merged (one key per distinct prompt; "
              f"{prompts.n_conflicting} had a different answer, the first was kept)", flush=True)
    if verbose and len(keep) < len(prompt_ids):
        left_out = [prompts.rows[i] for i in sorted(set(range(len(texts))) - set(keep))]
        untokenised = sum(p is None for p in prompt_ids)
        print(f"{path}: {len(left_out)} prompts longer than --max_prompt_len {max_prompt_len} tokens left out (rows "
              f"{_few(left_out)}" + (f"; {untokenised} of them over {max_chars} characters, not tokenised"
                                     if untokenised else "") + ")", flush=True)
    if not keep:
        fail(f"{path}: no prompt fits in --max_prompt_len {max_prompt_len} tokens", once=True)
    return Dataset(prompts.keys, prompt_ids, prompts.answers, prompts.sources)[keep]


def load_train_and_test(tokenizer, train, test, *, max_prompt_len, train_prompts, test_prompts, min_prompts,
                        system_prompt, verbose, pool_seed=-1):
    """The training prompts (the first train_prompts, or with pool_seed >= 0 that many drawn by it, kept in file
    order) and the held-out ones."""
    data = load_dataset(train, tokenizer, max_prompt_len, verbose, system_prompt, "--train")
    if train_prompts > len(data.keys):
        fail(f"--train_prompts {train_prompts}: --train {train} has only {len(data.keys)} prompts", once=True)
    if train_prompts and pool_seed >= 0:
        data = data[np.sort(np.random.default_rng(pool_seed).choice(len(data.keys), train_prompts, replace=False))]
    data = data[: train_prompts or None]
    if len(data.keys) < min_prompts:
        fail(f"--train {train}: {len(data.keys)} prompts, fewer than the {min_prompts} distinct prompts each step "
             f"draws (--batch_size / --group_size, x --oversample)", once=True)
    if test is None:
        return data, None
    test = load_dataset(test, tokenizer, max_prompt_len, verbose, system_prompt, "--test")[: test_prompts or None]
    if verbose and (shared := len(set(test.keys) & set(data.keys))):  # e.g. --test = --train
        print(f"warning: {shared} of the {len(test.keys)} held-out prompts (--test) are also training prompts "
              f"(--train): held-out accuracy counts them", flush=True)
    return data, test
