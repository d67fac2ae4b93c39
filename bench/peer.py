"""`python -m bench peer`: spo.py against the library a user would pick instead, TRL's GRPOTrainer, on one task.

The toy (--task toy) or SmolLM2-135M-Instruct on tasks/smollm.py's arithmetic (--task smollm; `python -m
tasks.smollm` builds ./smollm): the same model, prompts, budget, seed and optimiser; TRL, then spo.py GRPO and SPO at
each --spo_ranks launch, at each --precision (bf16: only with bf16 instructions). --rounds 2 runs it all twice, the
second time reversed (a drifting machine favours whoever ran in its faster minutes). TRL has its own interpreter:

    python3 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 trl==1.16.0
    python -m bench peer --steps 3                   # a quick check (the toy's default: 150)
    python -m bench peer --task smollm --rounds 2    # TRL: /tmp/trlvenv's, else --trl_python P or SPO_TRL_PYTHON=P
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: programs run from there
TRL_VENV = "/tmp/trlvenv/bin/python"  # INSTALL's interpreter: TRL's when none is named
INSTALL = "python3 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 trl==1.16.0"
SETTINGS_THAT_DIFFER = [  # (what, spo.py, TRL); what is the same is set in trl_config and printed
    ("generation", "vLLM (CPU), an engine per rank, weights pushed each step", "generate() in the training process"),
    ("precision", "fp32: --bf16 off; bf16: --bf16 on (FSDP2 bf16 compute, bf16 engine)", "bf16=False; bf16=True"),
    ("batching", "packed rows of at most 2048 tokens, shared prefixes once", "padded to the longest in the batch"),
    ("AdamW", "torch.optim.AdamW(foreach=True)", "optim='adamw_torch_fused' (TRL's default on torch >= 2.8)"),
    ("prompt order", "GRPO: B/G distinct prompts a step; SPO: Eq. 11", "RepeatSampler: shuffled passes"),
    ("dual clip", "10 (negative advantages: loss at most -10 A)", "none (inactive: ratio 1, one optimiser step)"),
    ("advantage", "GRPO: (r - group mean) / (group std + 1e-6)", "scale_rewards='group': the same with + 1e-4"),
    ("SPO", "B prompts x 1, tracker baseline, Eq. 11; offline values: the toy's cached, SmolLM2 none", "none"),
    ("phases", "time/* metrics (rank 0); untimed: the wall step less them", "generate, score, update (the rest)")]
# The toy's default run, SmolLM2's of docs/own-model-and-data.md (TRL on the toy: one thread, as first measured)
TASKS = {"toy": dict(train="train.parquet", steps=150, warmup=5, batch_size=64, lr=2e-4, max_response_len=32,
                     trl_threads=1),
         "smollm": dict(train="train.jsonl", steps=8, warmup=2, batch_size=16, lr=1e-5, max_response_len=48,
                        trl_threads=os.cpu_count() or 1)}
SAME = ("steps", "seed", "batch_size", "lr", "max_response_len")  # spo.py's flags, given to TRL too (trl_config)
PHASES = ("generate", "score", "old_logprobs", "update", "weight_push", "untimed")  # printed in this order


def trl_config(spec, run_dir):
    """GRPOConfig's arguments for a row (spec: with precision), none left to TRL 1.16's defaults (in the comments)."""
    return dict(output_dir=run_dir, max_steps=spec["steps"], seed=spec["seed"], use_cpu=True, fp16=False,  # seed 42
                bf16=spec["precision"] == "bf16",  # None, then `not fp16`: a bf16 autocast, even on a CPU
                model_init_kwargs={"dtype": "float32"}, disable_dropout=True, gradient_checkpointing=False,  # kept, on
                num_generations=8, per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=1,
                steps_per_generation=1, num_iterations=1, shuffle_dataset=True, learning_rate=spec["lr"],  # 1e-6
                lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch_fused", weight_decay=0.01,  # linear, 0
                adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, beta=0.0, loss_type="dapo",
                importance_sampling_level="token", epsilon=0.2, epsilon_high=0.28, delta=None,  # epsilon_high 0.2
                scale_rewards="group", mask_truncated_completions=False, top_entropy_quantile=1.0, entropy_coef=0.0,
                temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, use_vllm=False,
                max_completion_length=spec["max_response_len"], torch_compile=False, dataloader_num_workers=0,  # 512
                dataloader_drop_last=False, dataloader_pin_memory=False,  # pin: True, nothing to pin without a GPU
                logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)  # 10, "steps", "none"


def trl_worker(run_dir, spec):
    """GRPOTrainer on a row's spec; run_dir/metrics.jsonl as spo.py's: time stamps, time/* phases, peak memory."""
    sys.path.insert(0, ROOT)
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from machinery.data import load_dataset, load_tokenizer
    from machinery.memory import peak_resident_bytes
    from reward import boxed_reward
    torch.set_num_threads(spec["threads"])
    tokenizer = load_tokenizer(spec["model"])
    data = load_dataset(spec["train"], tokenizer, 256, False)
    prompts = [tokenizer.decode(p) for p in data.prompt_ids]
    # TRL tokenises plain-text prompts itself: the same ids spo.py trains on, or the comparison is off
    assert all(tokenizer(text=t)["input_ids"] == list(p) for t, p in zip(prompts, data.prompt_ids))
    eos, spent, log = tokenizer.eos_token_id, {}, open(os.path.join(run_dir, "metrics.jsonl"), "w", buffering=1)

    def reward(prompts, completions, completion_ids, answer, **_):  # reward.py's; no EOS: the budget hit, 0
        return [boxed_reward(c, a) * float(eos in ids) for c, ids, a in zip(completions, completion_ids, answer)]

    def timed(name, fn):  # a trainer method, wrapped to add its wall time to spent[name]
        def run(*a, **kw):
            t0, out = time.perf_counter(), fn(*a, **kw)
            spent[name] += time.perf_counter() - t0
            return out
        return run

    class StepTimes(transformers.TrainerCallback):  # a step: from the end of the one before (the first: train())
        def on_step_end(self, args, state, control, **kw):
            step, spent["end"] = time.perf_counter() - spent["end"], time.perf_counter()
            log.write(json.dumps({"step": state.global_step, "time": time.time(), "time/generate": spent["generate"],
                                  "time/score": spent["rollout"] - spent["generate"], "time/update": step -
                                  spent["rollout"], "time/step": step, "about": about,
                                  "memory/peak_gib": peak_resident_bytes() / 2**30}) + "\n")
            spent.update(generate=0.0, rollout=0.0)

    config = trl.GRPOConfig(**trl_config(spec, run_dir))
    assert config.bf16 == (spec["precision"] == "bf16") and not config.fp16, "TRL changed the precision asked for"
    trainer = trl.GRPOTrainer(model=spec["model"], reward_funcs=reward, args=config, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompts, "answer": list(data.answers)}),
                              callbacks=[StepTimes()])
    about = (f"TRL {trl.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} thread(s), "
             f"bf16 {config.bf16}, weights {trainer.model.dtype}")
    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
    trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions)
    spent.update(generate=0.0, rollout=0.0, end=time.perf_counter())
    trainer.train()


def plan_rows(precisions, spo_ranks, cpus, trl_threads, bf16_flags):
    """One round's rows, and what was left out (or None): at each precision TRL, then GRPO and SPO at each launch
    (ranks x cpus // ranks threads); bf16 only with bf16 instructions (bf16_flags: machinery.device.native_bf16)."""
    rows = []
    for precision in [p for p in precisions if p == "fp32" or bf16_flags]:
        trl = f"TRL GRPOTrainer (GRPO), {precision}"
        rows += [dict(who="trl", precision=precision, ranks=1, threads=trl_threads, label=trl, trl=trl)] + [
            dict(who=who, precision=precision, ranks=n, threads=max(1, cpus // n), trl=trl,
                 label=f"spo.py {name}, {precision}, {n} rank{'s' * (n > 1)}")
            for n in spo_ranks for who, name in (("grpo", "--algo grpo"), ("spo", "(SPO)"))]
    return rows, None if bf16_flags or "bf16" not in precisions else (
        "bf16 rows skipped: this CPU has no bf16 instructions (none of avx512_bf16, amx_bf16, bf16 in /proc/cpuinfo)")


def step_seconds(metrics):
    """Wall seconds of each training step of a metrics.jsonl: the gaps between stamps, the first its phases' sum."""
    training = [m for m in metrics if m["step"] > 0]
    return [training[0]["time/step"]] + [b["time"] - a["time"] for a, b in zip(training[:-1], training[1:])]


def run_program(cmd, run_dir, env):
    """A program run from the repository root, its output shown only when it fails: its metrics.jsonl's rows."""
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={
        **os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **env})
    if proc.returncode:
        sys.exit(f"{shlex.join(cmd[:6])} ... failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-6000:]}")
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def run_row(row, run_dir, spec, trl_python):
    """One run of a row: {steps: wall s, phases: s by phase (untimed: the step less the timed ones), each step after
    the warm-up; peak_gib; about}. spo.py: torchrun, the row's ranks and flags, then spec's (SAME, the task's)."""
    spo = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={row['ranks']}", "spo.py", "--run_dir",
           run_dir, "--algo", row["who"], "--bf16", "on" if row["precision"] == "bf16" else "off", *spec["spo_flags"]]
    trl = [trl_python, "-m", "bench.peer", "_trl", run_dir, json.dumps({**spec, **row})]
    metrics = run_program(trl if row["who"] == "trl" else spo, run_dir, {"OMP_NUM_THREADS": str(row["threads"])})
    training, warmup, wall = [m for m in metrics if m["step"] > 0], spec["warmup"], step_seconds(metrics)
    phases = [{**{k[5:]: m[k] for k in m if k.startswith("time/") and k != "time/step"},
               "untimed": max(0.0, w - m["time/step"])} for m, w in zip(training[warmup:], wall[warmup:])]
    return {"steps": wall[warmup:], "peak_gib": max(m["memory/peak_gib"] for m in training), "phases": phases,
            "about": training[0].get("about")}


def summarise(measured, trl_of):
    """{label: a row per round}, {label: its TRL's} -> {label: median s/step over all rounds, its ratio to its TRL's,
    each round's own ratio (TRL of the same round), peak GiB, median phases}."""
    rows, median = {}, statistics.median
    for label, per_round in measured.items():
        step, trl = median(s for row in per_round for s in row["steps"]), measured[trl_of[label]]
        rows[label] = {"step": step, "ratio": step / median(s for row in trl for s in row["steps"]),
                       "peak_gib": max(r["peak_gib"] for r in per_round),
                       "rounds": [median(row["steps"]) / median(t["steps"]) for row, t in zip(per_round, trl)],
                       "phases": {k: median(p[k] for row in per_round for p in row["phases"])
                                  for k in per_round[0]["phases"][0]}}
    return rows


def table(plan, rows, rounds):
    """The lines printed: each row's settings, times and peak; its median phases; more ranks' change by phase."""
    w, each, first = max(len(r["label"]) for r in plan), 6 * rounds + 4, {}
    shown = [k for k in PHASES if any(k in rows[r["label"]]["phases"] for r in plan)]
    out = [[f"{'row':<{w}} precision {'launch':>14} {'s/step':>8} {'vs TRL':>7} {'each round':>{each}} peak GiB"],
           [f"phases, median s per step:\n{'row':<{w}} " + " ".join(f"{k:>12}" for k in shown)],
           ["more ranks than the first launch: each phase's change, s per step (docs/benchmarks.md: what each holds)"]]
    for r in plan:
        row, base = rows[r["label"]], first.setdefault((r["who"], r["precision"]), r)
        kind = "process" if r["who"] == "trl" else "rank" + "s" * (r["ranks"] > 1)
        launch, each_round = f"{r['ranks']} {kind} x {r['threads']}", "/".join(f"{x:.2f}" for x in row["rounds"]) + "x"
        out[0].append(f"{r['label']:<{w}} {r['precision']:>9} {launch:>14} {row['step']:>8.3f} {row['ratio']:>6.2f}x "
                      f"{each_round:>{each}} {row['peak_gib']:>8.2f}")
        out[1].append(f"{r['label']:<{w}} " + " ".join(f"{row['phases'][k]:>12.3f}" if k in row["phases"] else
                                                        " " * 12 for k in shown))
        old = rows[base["label"]]
        out[2] += [f"  {r['label']} against {base['ranks']} rank(s): " + ", ".join(
            f"{k} {row['phases'][k] - old['phases'].get(k, 0):+.3f}" for k in shown if k in row["phases"]) +
            f"; step {row['step'] - old['step']:+.3f}"] if base is not r else []
    return out[0] + out[1] + (out[2] if len(out[2]) > 1 else [])


def bench_peer(task="toy", steps=None, trl_python=None, data_dir=None, seed=0, spo_ranks=(1, 2), rounds=1,
               precision=("fp32", "bf16"), spo_args=()):
    """The rows of plan_rows, one after another, `rounds` times (every other round reversed); prints the table and
    returns its rows, or None (one 'skipped: ...' line) without the task or TRL."""
    t, steps = TASKS[task], steps or TASKS[task]["steps"]
    trl_python = trl_python or os.environ.get("SPO_TRL_PYTHON") or (TRL_VENV if os.path.exists(TRL_VENV) else
                                                                     sys.executable)
    data_dir = os.path.abspath(data_dir or (os.path.join(ROOT, "tasks", "built", "toy") if task == "toy" else "smollm"))
    if not os.path.isdir(os.path.join(data_dir, "model")):
        build = "python -m tasks.smollm, or --data_dir" if task == "smollm" else "pass --data_dir"
        return print(f"skipped: no {task} in {data_dir} ({build})", flush=True)
    if subprocess.run(f"{shlex.quote(trl_python)} -c 'import trl'", shell=True, capture_output=True).returncode:
        return print(f"skipped: TRL is not installed for {trl_python}: {INSTALL}, then pass --trl_python "
                     f"/tmp/trlvenv/bin/python (or set SPO_TRL_PYTHON)", flush=True)
    from machinery.device import native_bf16
    model, train = os.path.join(data_dir, "model"), os.path.join(data_dir, t["train"])
    spec = {**t, "steps": steps, "seed": seed, "model": model, "train": train, "warmup": min(t["warmup"], steps - 1)}
    spec["spo_flags"] = ["--eval_every", "0", "--save_every", "0", "--gradient_checkpointing", "off",
                         *(f"--{k}={spec[k]}" for k in SAME), *(["--toy_dir", data_dir] if task == "toy" else [
                             "--model", model, "--train", train, "--offline_values", "none"]), *spo_args]
    plan, skipped = plan_rows(precision, spo_ranks, os.cpu_count() or 1, t["trl_threads"], native_bf16())
    if skipped:
        print(skipped, flush=True)
    measured = {r["label"]: [] for r in plan}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(rounds):
            for row in (plan if k % 2 == 0 else plan[::-1]):
                measured[row["label"]].append(run_row(row, tempfile.mkdtemp(dir=tmp), spec, trl_python))
    rows = summarise(measured, {r["label"]: r["trl"] for r in plan})
    about = "; ".join(dict.fromkeys(measured[r["label"]][0]["about"] for r in plan if r["who"] == "trl"))
    config = ", ".join(f"{k}={v!r}" for k, v in trl_config({**spec, "precision": "fp32"}, "").items()
                       if k not in ("output_dir", "bf16"))
    print("", *(textwrap.fill(s, 118, subsequent_indent="  ") for s in (
        f"{task}: {rounds} round(s); spo.py: torchrun --nproc_per_node=RANKS spo.py --algo ALGO --bf16 off|on "
        f"{shlex.join(spec['spo_flags'])}; s/step: median wall time over the rounds, the first {spec['warmup']} "
        f"steps of each left out; vs TRL: TRL at the row's precision; launch: processes x threads (OMP_NUM_THREADS) "
        f"each; peak: resident GiB of one process; {about}",)), *table(plan, rows, rounds),
        textwrap.fill(f"TRL's GRPOConfig (bf16 per row): {config}", 118, subsequent_indent="  "),
        "settings that differ (spo.py | TRL):", *(f"  {a}: {b} | {c}" for a, b, c in SETTINGS_THAT_DIFFER), sep="\n")
    return rows


def main(argv=None):
    """`python -m bench peer [flags]`."""
    p = argparse.ArgumentParser(prog="python -m bench peer", description="spo.py against TRL's GRPOTrainer")
    p.add_argument("--task", choices=sorted(TASKS), default="toy", help="the toy, or SmolLM2-135M (tasks/smollm.py)")
    p.add_argument("--steps", type=int, help="training steps (default: toy 150, smollm 8; 5 and 2 not timed)")
    p.add_argument("--trl_python", help=f"an interpreter with trl (default: $SPO_TRL_PYTHON, {TRL_VENV}, this)")
    p.add_argument("--data_dir", help="the task's built folder (default: tasks/built/toy, ./smollm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spo_ranks", type=int, nargs="+", default=[1, 2], help="spo.py's launches (default: 1 2)")
    p.add_argument("--precision", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"], help="(default: "
                   "both; bf16 only with bf16 instructions)")
    p.add_argument("--rounds", type=int, default=1, help="run everything N times, every other round reversed")
    p.add_argument("--spo_args", default="", help="more spo.py flags, one quoted string (e.g. \"--compile on\")")
    a = p.parse_args(argv)
    bench_peer(**{**vars(a), "spo_args": shlex.split(a.spo_args)})


if __name__ == "__main__":  # the TRL worker; run the benchmark itself through `python -m bench peer`
    trl_worker(sys.argv[2], json.loads(sys.argv[3])) if sys.argv[1:2] == ["_trl"] else main()
