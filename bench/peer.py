"""`python -m bench peer`: spo.py against the library a user would pick instead, TRL's GRPOTrainer, on one task.

The toy (--task toy) or SmolLM2-135M-Instruct on tasks/smollm.py's arithmetic (--task smollm: `python -m
tasks.smollm` builds ./smollm); the same model, prompts, budget, seed and optimiser on both sides, one after
another: TRL's GRPOTrainer, then spo.py --algo grpo and spo.py (SPO) for each launch of --spo_ranks (1: one rank
with every thread; 2: two ranks of one thread each on 2 cores), at each --precision (fp32; bf16 where the CPU has
bf16 instructions: TRL bf16=True beside spo.py --bf16 on). Each row prints its precision and launch, and its phases;
each spo.py launch with more ranks, where its time went against one rank. --rounds 2 runs everything twice, the
second time reversed: on a machine whose speed drifts, one pass favours whoever ran in the faster minutes. TRL lives
in its own interpreter (it pins its own transformers):

    python3 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 trl==1.16.0
    python -m bench peer --steps 3                   # a quick check (the toy's default: 150; TRL: /tmp/trlvenv's)
    python -m bench peer --task smollm --rounds 2    # or --trl_python P, or SPO_TRL_PYTHON=P
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
INSTALL = "python3 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 trl==1.16.0"
TRL_VENV_PYTHON = "/tmp/trlvenv/bin/python"  # INSTALL's; the interpreter used when none is named
SETTINGS_THAT_DIFFER = [  # (what, spo.py, TRL); what is the same is set in trl_config_kwargs (printed with the table)
    ("generation", "vLLM (CPU), an engine per rank, weights pushed each step", "generate() in the training process"),
    ("processes", "the launch column: torchrun ranks x OMP_NUM_THREADS each",
     "1 process: the toy 1 thread, SmolLM2 all"),
    ("fp32", "--bf16 off: fp32 weights, compute and engine", "bf16=False (TRL's default, not fp16, is True)"),
    ("bf16", "--bf16 on: FSDP2 bf16 compute, fp32 master weights and reductions; a bf16 engine",
     "bf16=True: accelerate's CPU autocast around forward, fp32 weights"),
    ("batching", "packed rows of at most 2048 tokens, each shared prompt prefix once",
     "the batch padded to its longest prompt and completion"),
    ("AdamW", "torch.optim.AdamW(foreach=True)", "optim='adamw_torch_fused' (TRL's default on torch >= 2.8)"),
    ("prompt order", "GRPO: B/G distinct prompts drawn each step; SPO: Eq. 11", "RepeatSampler: shuffled passes"),
    ("dual clip", "10 (negative advantages: loss at most -10 A)", "none (inactive: ratio 1, one optimiser step)"),
    ("advantage", "GRPO: (r - group mean) / (group std + 1e-6)", "scale_rewards='group': the same with + 1e-4"),
    ("SPO", "B prompts x 1, tracker baseline, Eq. 11 sampling; offline values: the toy's cached, SmolLM2 none", "none"),
    ("phases", "spo.py's time/* metrics (rank 0); untimed: the step's wall time less them",
     "generate, score (the rest of the batch), update (the rest)")]
# The toy's default run, SmolLM2's of docs/own-model-and-data.md (TRL on the toy: one thread, as first measured)
TASKS = {"toy": dict(train="train.parquet", steps=150, warmup=5, batch_size=64, lr=2e-4, max_response_len=32,
                     trl_threads=1),
         "smollm": dict(train="train.jsonl", steps=8, warmup=2, batch_size=16, lr=1e-5, max_response_len=48,
                        trl_threads=os.cpu_count() or 1)}
SAME = ("steps", "seed", "batch_size", "lr", "max_response_len")  # spo.py's flags, given to TRL too (trl_worker)
PRECISIONS = ("fp32", "bf16")
PHASES = ("generate", "score", "old_logprobs", "update", "weight_push", "untimed")  # the order printed
WHERE = ("old_logprobs opens with the first collective after generation (the sequences dealt to the ranks by "
         "tokens: the wait for the slower rank's engine) and FSDP2's weight gathers; update FSDP2's weight gathers "
         "and gradient reduce-scatters; weight_push the full weights' gather and the engine's load; untimed the "
         "object gathers of step 5 and of the metrics; all on rank 0's clock")


def trl_config_kwargs(spec, run_dir):
    """GRPOConfig's keyword arguments for a row (spec: bench_peer's, with precision): every setting the comparison
    depends on given, so that no TRL default decides it. TRL 1.16.0's defaults, where spo.py differs from them
    (trl/trainer/base_config.py, grpo_config.py; transformers 5.25.0's training_args.py): in the comments."""
    return dict(
        output_dir=run_dir, max_steps=spec["steps"], seed=spec["seed"], use_cpu=True,  # seed: 42
        bf16=spec["precision"] == "bf16", fp16=False,  # bf16: None, then `not fp16`: bf16 autocast on a CPU
        model_init_kwargs={"dtype": "float32"}, disable_dropout=True,  # dropout kept; spo.py sets it to 0
        gradient_checkpointing=False,  # on; spo.py's on a CPU off
        num_generations=8, per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, shuffle_dataset=True,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,  # 1e-6, linear decay to 0
        optim="adamw_torch_fused", weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,  # wd 0
        max_grad_norm=1.0, beta=0.0, loss_type="dapo", importance_sampling_level="token", epsilon=0.2,
        epsilon_high=0.28, delta=None, scale_rewards="group", mask_truncated_completions=False,  # epsilon_high: 0.2
        top_entropy_quantile=1.0, entropy_coef=0.0, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
        repetition_penalty=1.0, max_completion_length=spec["max_response_len"], use_vllm=False,  # length: 512
        torch_compile=False, dataloader_num_workers=0, dataloader_drop_last=False,
        dataloader_pin_memory=False,  # True: nothing to pin without a GPU
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)  # 10, "steps", "none", None


def trl_worker(run_dir, spec):
    """GRPOTrainer on a row's spec (model, train, precision, trl_threads and SAME); writes run_dir/metrics.jsonl, a
    row per optimiser step as spo.py's: a time stamp, time/* phases, peak resident memory (and what ran: `about`)."""
    sys.path.insert(0, ROOT)
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from machinery.data import load_dataset, load_tokenizer
    from machinery.device import peak_resident_bytes
    from reward import boxed_reward
    torch.set_num_threads(spec["trl_threads"])
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

    config = trl.GRPOConfig(**trl_config_kwargs(spec, run_dir))
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
    """The rows of one round, in order, and the line that says what was left out (or None): for each precision,
    TRL, then spo.py GRPO and SPO at each launch (ranks x cpus // ranks threads). bf16 without bf16 instructions
    (bf16_flags: machinery.device.native_bf16()) is left out: spo.py refuses --bf16 on there."""
    skipped = None
    if "bf16" in precisions and not bf16_flags:
        precisions = [p for p in precisions if p != "bf16"]
        skipped = ("bf16 rows skipped: this CPU has no bf16 instructions (none of avx512_bf16, amx_bf16, bf16 in "
                   "/proc/cpuinfo), so spo.py refuses --bf16 on and bf16 matmuls would be emulated")
    rows = []
    for precision in precisions:
        trl = f"TRL GRPOTrainer (GRPO), {precision}"
        rows.append({"who": "trl", "precision": precision, "ranks": 1, "threads": trl_threads, "label": trl,
                     "trl": trl, "launch": f"1 process x {trl_threads}"})
        for ranks in spo_ranks:
            threads = max(1, cpus // ranks)
            for who, name in (("grpo", "spo.py --algo grpo"), ("spo", "spo.py (SPO)")):
                rows.append({"who": who, "precision": precision, "ranks": ranks, "threads": threads, "trl": trl,
                             "launch": f"{ranks} rank{'s' * (ranks > 1)} x {threads}",
                             "label": f"{name}, {precision}, {ranks} rank{'s' * (ranks > 1)}"})
    return rows, skipped


def step_seconds(metrics):
    """Wall seconds of each training step of a metrics.jsonl (rows in order): the gaps between consecutive training
    rows' stamps, the first step's its phases' sum (no row before it: runs here evaluate nothing at step 0)."""
    training = [m for m in metrics if m["step"] > 0]
    return [training[0]["time/step"]] + [b["time"] - a["time"] for a, b in zip(training[:-1], training[1:])]


def run_program(cmd, run_dir, env=None):
    """A program run from the repository root (env: more variables), its output (a line per step) shown only when
    it fails: the rows of the metrics.jsonl it writes in run_dir."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{shlex.join(cmd[:6])} ... failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-6000:]}")
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def spo_command(run_dir, row, spec):
    """torchrun spo.py for a row: its ranks and precision, SAME, the task's flags, then --spo_args (the later flag
    wins), without evaluations or checkpoints between steps."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={row['ranks']}", "spo.py",
            "--eval_every", "0", "--save_every", "0", "--run_dir", run_dir, "--algo", row["who"],
            "--bf16", "on" if row["precision"] == "bf16" else "off", "--gradient_checkpointing", "off",
            *(f"--{k}={spec[k]}" for k in SAME), *spec["spo_flags"]]


def run_row(row, run_dir, spec, trl_python):
    """One run of a row (plan_rows') on bench_peer's spec: {steps: wall seconds, phases: seconds by phase (untimed:
    the wall step less the timed phases), each by step after the warm-up; peak_gib; about}."""
    threads = {"OMP_NUM_THREADS": str(row["threads"])}  # torchrun's own default: 1 with more than one rank
    if row["who"] == "trl":
        trl_spec = {**spec, "precision": row["precision"], "trl_threads": row["threads"]}
        metrics = run_program([trl_python, "-m", "bench.peer", "_trl", run_dir, json.dumps(trl_spec)], run_dir, threads)
    else:
        metrics = run_program(spo_command(run_dir, row, spec), run_dir, threads)
    training, warmup, wall = [m for m in metrics if m["step"] > 0], spec["warmup"], step_seconds(metrics)
    phases = [{**{k[5:]: m[k] for k in m if k.startswith("time/") and k != "time/step"},
               "untimed": max(0.0, w - m["time/step"])} for m, w in zip(training[warmup:], wall[warmup:])]
    return {"steps": wall[warmup:], "peak_gib": max(m["memory/peak_gib"] for m in training), "phases": phases,
            "about": training[0].get("about")}


def summarise(measured, trl_of):
    """{label: one row per round} and {label: its TRL row's label} -> {label: median s/step over all rounds' steps,
    its ratio to its TRL's, each round's own ratio (TRL of the same round), peak GiB, median phases}."""
    rows = {}
    for label, per_round in measured.items():
        trl = measured[trl_of[label]]
        step = statistics.median(s for row in per_round for s in row["steps"])
        rows[label] = {"step": step, "ratio": step / statistics.median(s for row in trl for s in row["steps"]),
                       "peak_gib": max(r["peak_gib"] for r in per_round),
                       "rounds": [statistics.median(row["steps"]) / statistics.median(t["steps"])
                                  for row, t in zip(per_round, trl)],
                       "phases": {k: statistics.median(p[k] for row in per_round for p in row["phases"])
                                  for k in per_round[0]["phases"][0]}}
    return rows


def second_rank(plan, rows):
    """Lines: for each spo.py row on more ranks than the same algorithm and precision's first launch, the change
    in each median phase and in the step (s; + more, - less)."""
    lines = []
    for row in plan:
        base = next(r for r in plan if r["who"] == row["who"] and r["precision"] == row["precision"])
        if row["who"] != "trl" and row["ranks"] != base["ranks"]:
            new, old = rows[row["label"]], rows[base["label"]]
            change = [f"{k} {new['phases'].get(k, 0.0) - old['phases'].get(k, 0.0):+.3f}" for k in PHASES
                      if k in new["phases"] or k in old["phases"]]
            lines.append(f"  {row['label']} against {base['ranks']} rank(s): " + ", ".join(change) +
                         f"; step {new['step'] - old['step']:+.3f}")
    return lines


def table(plan, rows, rounds):
    """The printed table: a line per row with its precision and launch (processes x threads each), then its
    median phases."""
    w, each = max(len(r["label"]) for r in plan), 6 * rounds + 4
    out = [f"{'row':<{w}} {'precision':>9} {'launch':>14} {'s/step':>8} {'vs TRL':>7} {'each round':>{each}} "
           f"{'peak GiB':>9}"]
    for r in plan:
        row = rows[r["label"]]
        ratios = "/".join(f"{x:.2f}" for x in row["rounds"]) + "x"
        out.append(f"{r['label']:<{w}} {r['precision']:>9} {r['launch']:>14} {row['step']:>8.3f} "
                   f"{row['ratio']:>6.2f}x {ratios:>{each}} {row['peak_gib']:>9.2f}")
    shown = [k for k in PHASES if any(k in rows[r["label"]]["phases"] for r in plan)]
    out.append(f"\nphases, median s per step:\n{'row':<{w}} " + " ".join(f"{k:>12}" for k in shown))
    for r in plan:
        phases = rows[r["label"]]["phases"]
        out.append(f"{r['label']:<{w}} " + " ".join(f"{phases[k]:>12.3f}" if k in phases else f"{'':>12}"
                                                    for k in shown))
    return out


def bench_peer(task="toy", steps=None, trl_python=None, data_dir=None, seed=0, spo_ranks=(1, 2), rounds=1,
               precision=PRECISIONS, spo_args=()):
    """The rows of plan_rows, one after another, `rounds` times (every other round reversed); prints the table and
    returns its rows, or None (one 'skipped: ...' line) without the task or TRL."""
    t, steps = TASKS[task], steps or TASKS[task]["steps"]
    trl_python = trl_python or os.environ.get("SPO_TRL_PYTHON") or (
        TRL_VENV_PYTHON if os.path.exists(TRL_VENV_PYTHON) else sys.executable)
    data_dir = os.path.abspath(data_dir or (os.path.join(ROOT, "tasks", "built", "toy") if task == "toy" else "smollm"))
    if not os.path.isdir(os.path.join(data_dir, "model")):
        build = "python -m tasks.smollm, or --data_dir" if task == "smollm" else "pass --data_dir"
        return print(f"skipped: no {task} in {data_dir} ({build})", flush=True)
    if subprocess.run(f"{shlex.quote(trl_python)} -c 'import trl'", shell=True, capture_output=True).returncode:
        return print(f"skipped: TRL is not installed for {trl_python}: {INSTALL}, then pass --trl_python "
                     f"/tmp/trlvenv/bin/python (or set SPO_TRL_PYTHON)", flush=True)
    from machinery.device import native_bf16
    model, train = os.path.join(data_dir, "model"), os.path.join(data_dir, t["train"])
    spec = {**t, "steps": steps, "seed": seed, "model": model, "train": train, "warmup": min(t["warmup"], steps - 1),
            "spo_flags": [*(["--toy_dir", data_dir] if task == "toy" else ["--model", model, "--train", train,
                                                                         "--offline_values", "none"]), *spo_args]}
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
    spo = shlex.join(spo_command("RUN", {"ranks": "RANKS", "who": "ALGO", "precision": "fp32"}, spec)[2:])
    print("\n" + textwrap.fill(
        f"{task}: " + ", ".join(f"{k} {spec[k]}" for k in SAME) + f"; {rounds} round(s); spo.py: {spo} (RANKS and "
        f"ALGO per row, --bf16 on in bf16 rows); s/step: median wall time over the rounds, the first {spec['warmup']} "
        f"steps of each left out; vs TRL: against TRL at the row's precision; launch: processes x threads each "
        f"(OMP_NUM_THREADS); peak: resident GiB of one process; {about}", 118, subsequent_indent="  "))
    print("\n".join(table(plan, rows, rounds)))
    if extra := second_rank(plan, rows):
        print(f"where more ranks' time went (median s per step; {WHERE}):\n" + "\n".join(extra))
    settings = ", ".join(f"{k}={v!r}" for k, v in trl_config_kwargs({**spec, "precision": "fp32"}, "RUN").items()
                         if k not in ("output_dir", "bf16"))
    print(textwrap.fill(f"TRL's GRPOConfig, every setting given (bf16 per row): {settings}", 118,
                        subsequent_indent="  "))
    print("settings that differ (spo.py | TRL):\n" + "\n".join(f"  {a}: {b} | {c}" for a, b, c in SETTINGS_THAT_DIFFER))
    return rows


def _choices(kind, allowed=None):
    """argparse type: a comma-separated list (of ints, or of `allowed` words)."""
    def parse(text):
        items = [kind(x) for x in text.split(",") if x]
        if not items or (allowed and not set(items) <= set(allowed)):
            raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list{f' of {allowed}' if allowed else ''}")
        return items
    return parse


def main(argv=None):
    """`python -m bench peer [flags]`."""
    p = argparse.ArgumentParser(prog="python -m bench peer", description="spo.py against TRL's GRPOTrainer")
    p.add_argument("--task", choices=sorted(TASKS), default="toy", help="the toy, or SmolLM2-135M (tasks/smollm.py)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: toy 150, smollm 8; the first "
                   "5 and 2 left out of the medians)")
    p.add_argument("--trl_python", default=None, help="an interpreter with trl (default: "
                   f"$SPO_TRL_PYTHON, else {TRL_VENV_PYTHON} where it exists, else this)")
    p.add_argument("--data_dir", default=None, help="the task's built folder (default: tasks/built/toy, ./smollm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spo_ranks", type=_choices(int), default=[1, 2], help="spo.py's launches, comma-separated "
                   "(torchrun --nproc_per_node; the CPU's threads shared among the ranks; default 1,2)")
    p.add_argument("--precision", type=_choices(str, PRECISIONS), default=list(PRECISIONS),
                   help="fp32 and/or bf16 rows (default fp32,bf16; bf16 only with bf16 instructions)")
    p.add_argument("--rounds", type=int, default=1, help="run everything N times, every other round reversed")
    p.add_argument("--spo_args", default="", help="more spo.py flags, one quoted string (e.g. \"--compile on\")")
    a = p.parse_args(argv)
    bench_peer(**{**vars(a), "spo_args": shlex.split(a.spo_args)})


if __name__ == "__main__":  # the TRL worker; run the benchmark itself through `python -m bench peer`
    trl_worker(sys.argv[2], json.loads(sys.argv[3])) if sys.argv[1:2] == ["_trl"] else main()
