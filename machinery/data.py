"""Prompt datasets: the one loader that spo.py, offline_values.py and eval.py share.

A prompt's key is a hash of its chat messages, not its row number, so the tracker, the offline values and the
evaluation agree on it across files, orderings and programs; duplicate prompts are merged and counted. Accepted
files: verl DAPO parquet (chat-message `prompt`, `reward_model.ground_truth`), open-r1 processed DAPO (string
`prompt`, `solution`), and any parquet / JSONL with a prompt column in PROMPT_COLUMNS and an answer column in
ANSWER_COLUMNS. Bad files stop with an error that names the file, the row and what was found.

    from machinery.data import load_prompts, load_dataset, load_tokenizer
    prompts = load_prompts("dapo_math_17k.parquet")            # keys, chat messages, answers (no tokenizer)
    data = load_dataset("dapo_math_17k.parquet", load_tokenizer("Qwen/Qwen3-8B"), max_prompt_len=2048,
                        verbose=True)                           # + chat-templated token ids, long prompts left out
"""
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from machinery.errors import fail


# ---------------------------------------------------------------------------------------------- files
PROMPT_COLUMNS = ("prompt", "problem", "question")  # first one present wins
# reward_model (a struct with ground_truth) comes before solution: in the open-r1 processed DAPO files both hold
# the answer, while in plain math files `solution` is often a worked solution and `answer` the short answer.
ANSWER_COLUMNS = ("answer", "ground_truth", "reward_model", "solution")


@dataclass
class PromptSet:
    keys: list[str]                 # prompt_key(messages): stable across files, reorderings and programs
    messages: list[list[dict]]      # chat messages [{"role", "content"}, ...]
    answers: list[str]              # ground truths, stripped strings
    path: str
    n_rows: int                     # rows in the file
    n_duplicates: int               # rows dropped because their prompt appeared earlier
    n_conflicting: int              # of those, rows whose answer differed from the kept one


def prompt_key(messages: list[dict]) -> str:
    """First 16 hex digits of sha1 of the messages' canonical JSON. A plain string prompt s and
    [{"role": "user", "content": s}] get the same key, so the verl and open-r1 DAPO files agree."""
    canonical = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(canonical.encode("utf-8")).hexdigest()[:16]


def _read_rows(path: Path) -> tuple[list[dict], list[str]]:
    """Rows as dicts and the column names, from parquet or JSON lines (.jsonl / .ndjson / .json)."""
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
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); JSON lines must be UTF-8") from None
    # lines end at \n only: str.splitlines would also split at U+2028 and others, which JSON strings may hold
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {line_no}: not JSON lines ({e.msg})") from None
        except RecursionError:
            raise ValueError(f"{path} line {line_no}: JSON nested too deeply") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {line_no}: each line must be a JSON object")
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
    if value is not None and not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: the answer must be a string or a number, got a {type(value).__name__} "
                         f"({str(value)[:40]})")
    if value is None or (isinstance(value, float) and math.isnan(value)) or not str(value).strip():
        raise ValueError(f"{where}: missing or empty answer")
    return str(value).strip()


def load_prompts(path) -> PromptSet:
    """Load prompts and answers; one key per distinct prompt (the first occurrence's answer is kept).

    Accepted: verl DAPO parquet (prompt = chat messages, reward_model.ground_truth), open-r1 processed DAPO
    (prompt = string, solution), and any parquet / JSONL with a prompt column in PROMPT_COLUMNS (string or
    messages) and an answer column in ANSWER_COLUMNS. Row numbers in errors count data rows from 0.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    rows, columns = _read_rows(path)
    if not rows:
        raise ValueError(f"{path}: the dataset is empty (no rows)")
    prompt_col = next((c for c in PROMPT_COLUMNS if c in columns), None)
    answer_col = next((c for c in ANSWER_COLUMNS if c in columns), None)
    if prompt_col is None or answer_col is None:
        raise ValueError(f"{path}: unrecognised columns {columns}; need a prompt column (one of "
                         f"{', '.join(PROMPT_COLUMNS)}) and an answer column (one of {', '.join(ANSWER_COLUMNS)})")
    keys, messages, answers, first_index, n_duplicates, n_conflicting = [], [], [], {}, 0, 0
    for i, row in enumerate(rows):
        where = f"{path} row {i}"
        msgs, answer = _messages(row.get(prompt_col), where), _answer(row.get(answer_col), where)
        key = prompt_key(msgs)
        if key in first_index:
            n_duplicates += 1
            n_conflicting += answers[first_index[key]] != answer
            continue
        first_index[key] = len(keys)
        keys.append(key)
        messages.append(msgs)
        answers.append(answer)
    return PromptSet(keys, messages, answers, str(path), len(rows), n_duplicates, n_conflicting)


# ---------------------------------------------------------------------------------------------- tokenised
def load_tokenizer(path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        fail(f"--model {path}: not a model directory and not loadable from the Hugging Face hub "
             f"({str(e).splitlines()[0][:200]})")


@dataclass
class Dataset:
    keys: list         # stable prompt keys (prompt_key); the tracker is indexed by position in this list
    prompt_ids: list   # token ids of each chat-formatted prompt
    answers: list

    def __getitem__(self, s):
        return Dataset(self.keys[s], self.prompt_ids[s], self.answers[s])


def with_system(messages, system_prompt):
    """Messages with system_prompt first: a system message of its own, or joined to the data's system message."""
    if not system_prompt:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": system_prompt + "\n\n" + messages[0]["content"]}] + messages[1:]
    return [{"role": "system", "content": system_prompt}] + messages


def load_dataset(path, tokenizer, max_prompt_len, verbose, system_prompt=None):
    """Chat-formatted prompt token ids. system_prompt (e.g. the tool instruction) changes the prompts the model
    sees, not their keys: the keys are hashes of the data's own messages."""
    try:
        prompts = load_prompts(path)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    texts = [tokenizer.apply_chat_template(with_system(m, system_prompt), add_generation_prompt=True, tokenize=False)
             for m in prompts.messages]
    prompt_ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    keep = [i for i, p in enumerate(prompt_ids) if len(p) <= max_prompt_len]
    if verbose and prompts.n_duplicates:
        print(f"{path}: {prompts.n_duplicates} duplicate prompts merged (one key per distinct prompt; "
              f"{prompts.n_conflicting} had a different answer, the first was kept)", flush=True)
    if verbose and len(keep) < len(prompt_ids):
        print(f"{path}: {len(prompt_ids) - len(keep)} prompts longer than --max_prompt_len {max_prompt_len} "
              f"tokens left out", flush=True)
    if not keep:
        fail(f"{path}: no prompt fits in --max_prompt_len {max_prompt_len} tokens")
    return Dataset([prompts.keys[i] for i in keep], [prompt_ids[i] for i in keep], [prompts.answers[i] for i in keep])
