"""The paper's data: the training set and the five evaluation sets, from their Hugging Face hub names to the plain
JSONL files that spo.py, offline_values.py and eval.py read (docs/scale.md: what it changes, the manifest).

    python -m tasks.paper prepare --out data/paper          # fetch, convert, de-duplicate; rerun: a no-op
    HF_HUB_OFFLINE=1 python -m tasks.paper prepare --out data/paper     # from a populated hub cache only

Every prompt ends with the authors' BOX_LINE (the DAPO prompts ask for an `Answer:` line, which the strict verifier,
reward.py:exact_match, does not read), and answers are written the way a box holds them (normalise_answer).

Sources: the hub's dataset cards and file listings, open-r1's build script (BytedTsinghua-SIA/DAPO-Math-17k
de-duplicated by prompt, split into `en` and `cn` by a test for Chinese characters) and the authors' recipe, which
loads all six by these names. Not confirmed: the training set's `en/` path, aime25's `data/train-*` and
BeyondAIME's file name (any `*test*` parquet or JSONL). A layout that has changed stops with one line naming the
dataset, the file and the columns found (or the file patterns that matched nothing).
"""
import argparse
import fnmatch
import hashlib
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from machinery.data import prompt_key, read_rows, unfinished_download
from machinery.errors import fail, shown
from reward import BOX, extract_boxed

CONVERTER_VERSION = 1  # bump when the conversion below changes, so that a rerun rewrites every dataset
BOX_LINE = "\nThe answer format must be: \\boxed{'The final answer goes here.'}"  # the authors' line, verbatim
DAPO_HEAD = ("Solve the following math problem step by step. The last line of your response should be of the form "
             "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_TAIL = "\n\nRemember to put your answer on its own line after \"Answer:\"."
# Chinese (as open-r1's split tests), plus kana and hangul; not CJK punctuation, which English math text can carry.
CJK = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
NORMALISATION = ("strip whitespace; remove $...$, $$...$$, \\(...\\), \\[...\\] and \\boxed{...} around the whole "
                 "answer, repeatedly; numbers written plainly (17.0 -> 17); integers without leading zeros "
                 "(033 -> 33); rows whose answer is then empty are dropped")


@dataclass(frozen=True)
class Source:
    name: str                 # output file stem and manifest key
    repo: str                 # hub dataset name
    config: str | None        # the hub config (subset) the files belong to
    split: str
    files: tuple              # snapshot_download allow_patterns: that config's and split's data files
    problem: str              # column with the problem (training set: the whole DAPO prompt)
    answer: str
    source_id: str | None     # column naming the row at the source ("a.b": field b of struct a); else file#row
    expected: int             # prompts the paper's sets have; another count is printed as a warning
    train: bool = False


SOURCES = (
    Source("dapo_math_17k_en", "open-r1/DAPO-Math-17k-Processed", "en", "train", ("en/train-*.parquet",),
           "prompt", "solution", "extra_info.index", 14100, train=True),
    Source("aime24", "Maxwell-Jia/AIME_2024", None, "train", ("aime_2024_problems.parquet",),
           "Problem", "Answer", "ID", 30),
    Source("aime25", "yentinglin/aime_2025", None, "train", ("data/train-*.parquet",), "problem", "answer", "id", 30),
    Source("beyond_aime", "ByteDance-Seed/BeyondAIME", None, "test", ("*test*.parquet", "*test*.jsonl"),
           "problem", "answer", None, 100),
    Source("brumo25", "MathArena/brumo_2025", None, "train", ("data/train-*.parquet",),
           "problem", "answer", "problem_idx", 30),
    Source("hmmt_feb25", "MathArena/hmmt_feb_2025", None, "train", ("data/train-*.parquet",),
           "problem", "answer", "problem_idx", 30),
)


# ---------------------------------------------------------------------------------------------- answers, prompts
def normalise_answer(value) -> str | None:
    """The ground truth as a box holds it: `$...$`, `$$...$$`, `\\(...\\)`, `\\[...\\]` and a `\\boxed{...}` around the
    whole answer removed (repeatedly), numbers written plainly (17.0 -> 17, AIME's `033` -> `33`); nothing else
    changes (`\\dfrac` stays, `1,000` stays). None if empty or not text / a number."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        return None
    text, before = str(value).strip(), None
    while text != before:
        before = text
        for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            inner = text[len(left):-len(right)] if len(text) >= len(left) + len(right) else ""
            # "$5$ and $6$" starts and ends with $ but is two formulas: only a delimiter pair around it all counts
            if text.startswith(left) and text.endswith(right) and left not in inner and right not in inner:
                text = inner.strip()
                break
        # the last box (reward.extract_boxed) spans the whole text: one box around the answer, not "\boxed{1}+\boxed{2}"
        if text.startswith(BOX) and text.endswith("}") and extract_boxed(text) == text[len(BOX):-1]:
            text = text[len(BOX):-1].strip()
    if re.fullmatch(r"[0-9]+", text):
        text = str(int(text))
    return text or None


def make_prompt(problem: str, source: Source, eval_prompt: str) -> str:
    """Training: the DAPO prompt + BOX_LINE. Evaluation: the same DAPO sentences around the problem + BOX_LINE, or
    (eval_prompt "authors") the problem + BOX_LINE, as the authors evaluate."""
    if source.train or eval_prompt == "authors":
        return problem + BOX_LINE
    return DAPO_HEAD + problem.strip() + DAPO_TAIL + BOX_LINE


def _field(row: dict, column: str | None):
    """row[column], or a struct's field for "a.b"; None where absent."""
    if column is None:
        return None
    value = row
    for part in column.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


# ---------------------------------------------------------------------------------------------- fetching
def fetch(source: Source) -> tuple[Path, str, list[str]]:
    """The snapshot folder, its commit and the data files in it (relative paths), downloaded or from the cache
    (HF_HUB_OFFLINE=1, or the hub unreachable); either failure is one line naming the dataset."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import disable_progress_bars
    disable_progress_bars()  # one progress line per dataset is ours
    try:
        folder = Path(snapshot_download(source.repo, repo_type="dataset", allow_patterns=list(source.files)))
    except Exception as e:  # noqa: BLE001 - not cached, offline, renamed, gated, hub down: one line, same advice
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else \
            f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        fail(f"{source.name}: cannot get the dataset {source.repo} from the Hugging Face hub ({why}) nor from the "
             f"cache {constants.HF_HUB_CACHE}; run `python -m tasks.paper prepare` once with network access, or point "
             f"HF_HOME at a hub cache that has it")
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    files = [f for f in files if any(fnmatch.fnmatch(f, pattern) for pattern in source.files)]
    if not files:
        fail(f"{source.name}: " + (unfinished_download(folder) or (
             f"the snapshot {folder.name} of {source.repo} has no file matching {', '.join(source.files)} (found: "
             f"{', '.join(p.name for p in folder.iterdir())[:200]}); has the dataset's layout changed? (SOURCES in "
             f"tasks/paper.py)")))
    return folder, folder.name, files


# ---------------------------------------------------------------------------------------------- converting
def convert(source: Source, folder: Path, files: list[str], eval_prompt: str) -> tuple[list[dict], dict]:
    """Rows in the loader's plain schema, one per distinct prompt (the first row's answer kept, as load_prompts
    does), and the counts for the manifest. Rows with CJK characters are dropped from the training set."""
    out, first, dropped = [], {}, Counter()
    n_in = duplicates = conflicting = normalised = 0
    for file in files:
        try:
            rows, columns = read_rows(folder / file)
        except ValueError as e:
            fail(f"{source.name} ({source.repo}): {e}")
        if missing := [c for c in (source.problem, source.answer) if c not in columns]:
            fail(f"{source.name} ({source.repo}): {file} has columns {columns}; the converter expects "
                 f"{source.problem!r} (the problem) and {source.answer!r} (the answer): has the layout changed?")
        for i, row in enumerate(rows):
            n_in += 1
            problem, original = row.get(source.problem), row.get(source.answer)
            answer = normalise_answer(original)
            if not isinstance(problem, str) or not problem.strip():
                dropped["empty problem"] += 1
            elif source.train and CJK.search(problem):
                dropped["non-English (CJK characters)"] += 1
            elif answer is None:
                dropped["empty answer (or not text or a number)"] += 1
            else:
                prompt = make_prompt(problem, source, eval_prompt)
                key = prompt_key([{"role": "user", "content": prompt}])
                if key in first:
                    duplicates += 1
                    conflicting += out[first[key]]["answer"] != answer
                    continue
                first[key] = len(out)
                normalised += answer != str(original).strip()
                sid = _field(row, source.source_id)
                out.append({"prompt": prompt, "answer": answer, "answer_original": original,
                            "source_id": str(sid) if sid is not None else f"{file}#{i}"})
    if not out:
        fail(f"{source.name} ({source.repo}): no rows left after conversion ({n_in} read, dropped: {dict(dropped)})")
    stats = {"rows_in": n_in, "rows_out": len(out), "duplicates_dropped": duplicates,
             "duplicates_with_another_answer": conflicting, "rows_dropped": dict(dropped),
             "answers_normalised": normalised}
    return out, stats


# ---------------------------------------------------------------------------------------------- writing
def sha256(path) -> str | None:
    if not os.path.isfile(path):
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomically(path, text: str):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    os.replace(tmp, path)


def read_manifest(out: Path) -> dict:
    path = out / "manifest.json"
    if not path.is_file():
        return {"datasets": {}}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        fail(f"{path}: not a readable manifest ({e}); delete it to rebuild every dataset")
    return manifest if isinstance(manifest.get("datasets"), dict) else {"datasets": {}}


def prepare(out, names=None, eval_prompt="authors"):
    """Fetch, convert and write each dataset, skipping those up to date; the manifest is rewritten after each."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    manifest.update({"converter_version": CONVERTER_VERSION, "answer_normalisation": NORMALISATION,
                     "box_line": BOX_LINE})
    for source in (s for s in SOURCES if names is None or s.name in names):
        folder, revision, files = fetch(source)
        template = "training" if source.train else eval_prompt
        settings = {"revision": revision, "converter_version": CONVERTER_VERSION, "prompt_template": template}
        entry, output = manifest["datasets"].get(source.name, {}), out / f"{source.name}.jsonl"
        if all(entry.get(k) == v for k, v in settings.items()) and sha256(output) == entry.get("sha256"):
            print(f"{source.name}: up to date ({source.repo}@{revision[:12]}, {entry['rows_out']} prompts)", flush=True)
            continue
        rows, stats = convert(source, folder, files, eval_prompt)
        write_atomically(output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        manifest["datasets"][source.name] = {
            "hub": source.repo, "config": source.config, "split": source.split, **settings,
            "files": [{"path": f, "sha256": sha256(folder / f)} for f in files], "output": output.name,
            "sha256": sha256(output), **stats, "expected_rows": source.expected}
        write_atomically(out / "manifest.json", json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
        drops = "".join(f"; {n} {why}" for why, n in stats["rows_dropped"].items())
        print(f"{source.name}: {source.repo}@{revision[:12]} {shown(', '.join(files))}: {stats['rows_in']} rows -> "
              f"{stats['rows_out']} prompts (duplicates dropped: {stats['duplicates_dropped']}{drops}) -> {output}",
              flush=True)
        # the paper's sets: 30 problems (100 for BeyondAIME), about 14.1k training prompts
        if abs(stats["rows_out"] - source.expected) > 0.01 * source.expected:
            print(f"warning: {source.name}: {stats['rows_out']} prompts, the paper's set has "
                  f"{'about ' if source.train else ''}{source.expected}; check {out / 'manifest.json'}", flush=True)
    return manifest


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tasks.paper", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="fetch the six datasets and write them in the plain schema")
    p.add_argument("--out", default="data/paper", help="output folder (JSONL files and manifest.json)")
    p.add_argument("--only", nargs="+", choices=[s.name for s in SOURCES], default=None,
                   help="prepare only these datasets")
    p.add_argument("--eval_prompt", choices=["authors", "training"], default="authors",
                   help="evaluation prompts: the authors' bare problem (default: as Table 1), or the training "
                        "prompts' DAPO instruction around it; both end with the box line")
    args = parser.parse_args()
    prepare(args.out, args.only, args.eval_prompt)
    print(f"wrote {args.out}/manifest.json; e.g. spo.py --train {args.out}/dapo_math_17k_en.jsonl "
          f"--test {args.out}/aime25.jsonl", flush=True)
