"""The paper's Table 1 on one node, in one command: offline values, training, evaluation of the base and the trained
model on the five benchmarks, and the table with the paper's numbers beside ours (docs/scale.md: time and disk).

    python -m tasks.paper prepare --out data/paper               # the six datasets from hub names, once
    python -m experiments.paper --data data/paper --out runs/paper --model Qwen/Qwen3-8B --nproc 8
    python -m experiments.paper --data data/paper --out runs/paper_grpo --model Qwen/Qwen3-8B --nproc 8 --algo grpo
    python -m experiments.paper --dry_run --out /tmp/paper_dry  # every stage on this CPU in minutes (the toy)

Stages, each a program a user could run by hand (the command heads its log, OUT/logs/<stage>.log): values
(offline_values.py, SPO only: OUT/values.json), train (spo.py with SETTINGS below: OUT/train/), eval_base and eval
(eval.py on the base model and on the last checkpoint: OUT/eval_base/, OUT/eval/), table (OUT/table.md). A rerun
of the same command skips finished stages and resumes the others. Flags after `--` go to spo.py. maj@n is eval.py's
bootstrap expectation of the vote: the paper's maj@32 values are not multiples of 1/30 on 30-problem sets, so they
are an expectation too. The dry run's numbers mean nothing.
"""
import argparse
import json
import os
import sys
import time

from experiments.sweep import error_lines, launch, run_logged, run_state, start_flags

# (file stem of the prepared data: tasks/paper.py's names, the paper's column name), in Table 1's order
TRAIN = "dapo_math_17k_en"
BENCHMARKS = [("aime24", "AIME 24"), ("aime25", "AIME 25"), ("beyond_aime", "BeyondAIME"), ("brumo25", "BRUMO 25"),
              ("hmmt_feb25", "HMMT 25")]
# Table 1 (maj@32, avg@32) per benchmark in BENCHMARKS' order, then the average; Qwen3-8B with tools.
PAPER = {"Qwen3-8B": [(77.8, 64.4), (70.5, 58.4), (45.2, 38.0), (55.1, 49.4), (36.8, 30.3), (57.1, 48.1)],
         "GRPO": [(83.3, 77.6), (72.1, 64.2), (45.6, 39.0), (56.7, 56.9), (44.2, 40.9), (60.4, 55.7)],
         "SPO": [(84.0, 74.9), (76.5, 65.0), (46.9, 40.3), (64.0, 59.0), (47.5, 40.6), (63.8, 56.0)]}

# Appendix D on 8 x 80 GB (docs/scale.md sizes them): responses of 8k tokens in training, 32k in evaluation, tool-
# integrated reasoning, 1024 responses per step in 8 optimiser steps; the evaluation's sampling is the paper's.
SETTINGS = {
    "paper": {
        "common": ["--max_prompt_len", "2048"],
        "tools": ["--tools", "--tool_instruction", "--think_format"],
        "values": ["--n0", "8", "--max_response_len", "8192"],
        "train": ["--batch_size", "1024", "--ppo_steps", "8", "--lr", "1e-6", "--max_response_len", "8192",
                  "--max_tokens_per_micro_batch", "32768", "--gpu_memory_utilization", "0.6", "--steps", "500",
                  "--save_every", "20", "--eval_every", "25", "--eval_samples", "8", "--eval_temperature", "0.6",
                  "--eval_top_p", "0.95", "--eval_top_k", "20"],
        "grpo": ["--algo", "grpo", "--group_size", "8"],
        "eval": ["--n_samples", "32", "--temperature", "0.6", "--top_p", "0.95", "--top_k", "20",
                 "--max_response_len", "32768"],
    },
    "dry_run": {
        "common": ["--max_prompt_len", "256"],
        "tools": [],  # the toy has no tool format (its a*b tool toy is another model)
        "values": ["--n0", "2", "--max_response_len", "32"],
        "train": ["--batch_size", "16", "--steps", "2", "--save_every", "2", "--eval_every", "2",
                  "--eval_samples", "2", "--micro_batch_size", "8"],
        "grpo": ["--algo", "grpo", "--group_size", "4"],
        "eval": ["--n_samples", "4", "--max_response_len", "32", "--n_boot", "100"],
    },
}


def dry_run_data(out):
    """The toy in the prepared layout: 64 prompts of its train split, and five 8-problem slices of its test split
    named as the benchmarks. Returns (model, data directory)."""
    from machinery.data import load_prompts
    from tasks import toy
    model, train, test = toy.ensure_toy(toy.default_toy_dir(False))
    folder = os.path.join(out, "data")
    os.makedirs(folder, exist_ok=True)
    train, test = load_prompts(train), load_prompts(test)
    files = {TRAIN: (train, range(64))}
    files.update({stem: (test, range(8 * k, 8 * k + 8)) for k, (stem, _) in enumerate(BENCHMARKS)})
    for stem, (prompts, rows) in files.items():
        with open(os.path.join(folder, f"{stem}.jsonl"), "w") as f:
            f.writelines(json.dumps({"prompt": prompts.messages[i], "answer": prompts.answers[i]}) + "\n" for i in rows)
    return model, folder


def data_files(folder):
    """(train file, {benchmark stem: file}) of a prepared directory; one line naming what is missing."""
    def find(stem):
        found = [os.path.join(folder, stem + ext) for ext in (".jsonl", ".parquet")
                 if os.path.isfile(os.path.join(folder, stem + ext))]
        if not found:
            raise SystemExit(f"error: --data {folder}: no {stem}.jsonl or {stem}.parquet (prepare it with "
                             f"`python -m tasks.paper prepare --out {folder}`)")
        return found[0]
    return find(TRAIN), {stem: find(stem) for stem, _ in BENCHMARKS}


def run_stage(name, cmd, out):
    """Run one stage with its output in OUT/logs/<name>.log; a failure stops the pipeline with its error lines."""
    log_path = os.path.join(out, "logs", f"{name}.log")
    print(f"{name}: running (log: {log_path})", flush=True)
    t0 = time.time()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    code = run_logged(cmd, log_path, env)
    if code != 0:
        lines = "\n".join("  " + line for line in error_lines(log_path, tail=5))
        raise SystemExit(f"error: stage {name} failed (exit {code}); rerun the same command to continue. Its log "
                         f"{log_path} ends:\n{lines}")
    print(f"{name}: done in {time.time() - t0:.0f} s", flush=True)


def evaluated(eval_dir, model):
    """Whether eval_dir holds a finished evaluation of `model`: the pipeline's marker, written after eval.py
    succeeded (eval.py may record another path for the same model, e.g. a hub name's cached copy)."""
    try:
        with open(os.path.join(eval_dir, "pipeline.json")) as f:
            return json.load(f)["model"] == model and os.path.exists(os.path.join(eval_dir, "summary.json"))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def paper_table(ours):
    """Table 1's shape in markdown: the paper's rows, then ours. ours: {row name: eval.py summary.json "results"}
    (benchmark stem -> metrics as fractions). Cells are "maj@n / avg@n" in percent; the average is the unweighted
    mean over the five benchmarks, as the paper's (its SPO row: 63.8 = the mean of 84.0, 76.5, 46.9, 64.0, 47.5)."""
    rows = {f"{name} (paper, n = 32)": cells for name, cells in PAPER.items()}
    for name, results in ours.items():
        n = results[BENCHMARKS[0][0]]["samples"]
        cells = [(100 * results[stem][f"maj@{n}_boot_mean"], 100 * results[stem][f"avg@{n}"])
                 for stem, _ in BENCHMARKS]
        rows[f"{name} (ours, n = {n})"] = cells + [tuple(sum(c[i] for c in cells) / len(cells) for i in (0, 1))]
    header = "| | " + " | ".join(title for _, title in BENCHMARKS) + " | Average |"
    lines = [header, "|---" * (len(BENCHMARKS) + 2) + "|"] + [
        f"| {title} | " + " | ".join(f"{m:.1f} / {a:.1f}" for m, a in cells) + " |" for title, cells in rows.items()]
    return "\n".join(lines) + "\n\nEach cell: maj@n / avg@n in percent (maj@n: bootstrap expectation of the vote).\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # flags after -- go to spo.py
    p = argparse.ArgumentParser(description="The paper's Table 1: offline values, training, evaluation, the table")
    p.add_argument("--data", default=None, help="the prepared directory (python -m tasks.paper prepare)")
    p.add_argument("--out", required=True, help="the pipeline's directory (a rerun continues it)")
    p.add_argument("--model", default="Qwen/Qwen3-8B", help="the base model (hub name or directory)")
    p.add_argument("--algo", choices=["spo", "grpo"], default="spo", help="SPO, or GRPO at the same budget")
    p.add_argument("--nproc", type=int, default=8, help="processes (GPUs) of every stage")
    p.add_argument("--tools", action=argparse.BooleanOptionalAction, default=True,
                   help="tool-integrated reasoning, as the paper (--no-tools: plain reasoning)")
    p.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto", help="every stage's rollout engine")
    p.add_argument("--dry_run", action="store_true", help="the toy and tiny budgets: every stage in minutes on a CPU")
    args, extra = p.parse_args(argv[:cut]), argv[cut + 1:]
    if args.nproc < 1:
        p.error(f"--nproc must be at least 1, got {args.nproc}")
    settings = SETTINGS["dry_run" if args.dry_run else "paper"]
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    if args.dry_run:
        args.model, args.data = dry_run_data(args.out)
    elif args.data is None:
        p.error("--data is required (the prepared directory), or --dry_run")
    train, benchmarks = data_files(args.data)
    common = settings["common"] + (settings["tools"] if args.tools else []) + ["--engine", args.engine]
    values = os.path.join(args.out, "values.json")
    run_dir = os.path.join(args.out, "train")

    # 1. offline values (Algorithm 2), for SPO's tracker
    if args.algo == "spo" and os.path.exists(values):
        print(f"values: done ({values}), skipped", flush=True)
    elif args.algo == "spo":
        run_stage("values", launch(args.nproc, "offline_values.py", ["--model", args.model, "--data", train, "--out",
                                                                      values, *common, *settings["values"]]), args.out)
    # 2. training: new, resumed, or skipped when its last checkpoint is at its last step
    flags = [*common, *settings["train"], *(settings["grpo"] if args.algo == "grpo" else []), *extra]
    flags += ["--model", args.model, "--train", train, "--test", benchmarks["aime25"]]
    flags += ["--offline_values", values] if args.algo == "spo" else []
    import spo
    state = run_state(run_dir, spo.parse_args(flags).steps)
    if state == "finished":
        print(f"train: done ({run_dir}), skipped", flush=True)
    else:
        run_stage("train", launch(args.nproc, "spo.py", flags + start_flags(run_dir, state)), args.out)
    # 3. evaluation of the base model and of the trained one, on the five benchmarks
    from machinery.checkpoint import latest_step
    trained = os.path.join(run_dir, "checkpoints", f"step_{latest_step(run_dir):06d}", "model")
    rows = {}
    for stage, model, name in (("eval_base", args.model, f"base: {args.model}"), ("eval", trained, args.algo)):
        eval_dir = os.path.join(args.out, stage)
        if evaluated(eval_dir, model):
            print(f"{stage}: done ({eval_dir}), skipped", flush=True)
        else:
            run_stage(stage, launch(args.nproc, "eval.py", ["--model", model, "--data", *benchmarks.values(),
                                                             "--out_dir", eval_dir, *common, *settings["eval"]]),
                      args.out)
            with open(os.path.join(eval_dir, "pipeline.json"), "w") as f:
                json.dump({"model": model}, f)
        with open(os.path.join(eval_dir, "summary.json")) as f:
            rows[name] = json.load(f)["results"]
    # 4. the table
    table = paper_table(rows)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table)
    print(table, flush=True)


if __name__ == "__main__":
    main()
