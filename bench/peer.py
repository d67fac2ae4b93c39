"""`python -m bench peer`: spo.py against the library a user would pick instead, TRL's GRPOTrainer, on the same task.

Two tasks (--task): the toy (fixed costs decide) and SmolLM2-135M-Instruct on tasks/smollm.py's arithmetic (a real
model: generation and the update decide; `python -m tasks.smollm` builds it). The same model, prompts, budget
(steps x responses per step) and seed, one after another: TRL's GRPOTrainer (Hugging Face generation, one
process), then spo.py --algo grpo and spo.py (SPO) under torchrun on each of --spo_ranks, each with vLLM eager and
compiled (--engine_compile). Printed: the median wall time per step (the first `warmup` steps and spo.py's
evaluated last step left out), the ratios to TRL, each row's phases and peak resident memory, and (the toy) the
held-out accuracy of the final weights by spo's own probes.heldout_metrics, TRL's loaded into the same vLLM engine.
What is the same on both sides (model dtype, prompt ids, temperature, budget, AdamW settings, PPO clip 0.2 / 0.28,
no KL, reward.py's verifier, the group z-score) is set in trl_worker; what differs is SETTINGS_THAT_DIFFER,
printed with the table. --rounds 2 runs everything twice, the second time in reverse order, and pools each row's
steps: on a machine whose speed drifts, one pass favours whoever ran in the faster minutes.

TRL is a benchmark-only dependency, best kept in its own virtual environment (it pins its own transformers):

    python3 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 trl==1.16.0
    .venv/bin/python -m bench peer --trl_python /tmp/trlvenv/bin/python           # 150 steps
    .venv/bin/python -m bench peer --trl_python /tmp/trlvenv/bin/python --steps 3  # a quick check
    .venv/bin/python -m bench peer --trl_python /tmp/trlvenv/bin/python --task smollm --engine_compile off  # 8 steps
"""
import argparse
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: programs run from there
INSTALL_HINT = ("TRL is not installed for {python}: python3 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install "
                "torch==2.13.0 trl==1.16.0, then pass --trl_python /tmp/trlvenv/bin/python (or set SPO_TRL_PYTHON)")
SETTINGS_THAT_DIFFER = [
    ("generation backend", "vLLM (CPU), one colocated engine per rank, weights pushed each step; eager, or "
     "compiled by torch.compile (--engine_compile on: C++ kernels built at start-up)",
     "transformers generate() in the training process (use_vllm=False)"),
    ("processes / threads", "--spo_ranks ranks (torchrun, FSDP2): 1 rank uses both cores (torch's default), 2 "
     "ranks 1 thread each (torchrun's default)", "1 process, --trl_threads threads (default: the toy 1, as TRL was "
     "first measured there; SmolLM2 all cores)"),
    ("loss aggregation", "token mean over the global batch (Eq. 10)", "loss_type='dapo': token mean over the "
     "global batch (the same)"),
    ("dual clip", "10 (negative advantages: loss at most -10 A)", "none (inactive here: ratio = 1 with one "
     "optimiser step per batch)"),
    ("KL", "none", "beta=0.0 (none)"),
    ("--bf16", "spo.py --bf16 on: bf16 forward and backward (FSDP2 mixed precision, fp32 master weights) and a bf16 "
     "engine", "bf16=True: the Trainer's bf16 autocast around the update; generate() stays fp32"),
    ("advantage", "GRPO: (r - group mean) / (group std + 1e-6)", "scale_rewards='group': the same with + 1e-4"),
    ("SPO", "spo.py --algo spo: B prompts x 1, tracker baseline, prioritised sampling; offline values: the toy's "
     "cached ones, none on SmolLM2 (a start-up cost, not a per-step one)", "not available in TRL"),
    ("phases", "spo.py's own time/* metrics (rank 0)", "generate: GRPOTrainer._generate_single_turn; score: the "
     "rest of _generate_and_score_completions; update: the rest of the step (wrapped in bench/peer.py)"),
]


# Per task: its budget. The toy's numbers are the default run's; the SmolLM2 ones docs/own-model-and-data.md's,
# with no offline values for SPO (a start-up cost outside the per-step times). trl_threads: the toy's TRL
# measurements used one thread (docs/benchmarks.md); on SmolLM2 TRL gets both cores, as spo.py does.
TASKS = {
    "toy": dict(steps=150, warmup=5, batch=64, lr=2e-4, max_tokens=32, trl_threads=1, heldout=True),
    "smollm": dict(steps=8, warmup=2, batch=16, lr=1e-5, max_tokens=48, trl_threads=os.cpu_count() or 1,
                   heldout=False),
}


def task_files(task, data_dir):
    """(model dir, training prompts, spo.py's flags that name them) of a task's built folder."""
    if task == "toy":
        return (os.path.join(data_dir, "model"), os.path.join(data_dir, "train.parquet"), ["--toy_dir", data_dir])
    model, train = os.path.join(data_dir, "model"), os.path.join(data_dir, "train.jsonl")
    return model, train, ["--model", model, "--train", train, "--offline_values", "none"]


# ---------------------------------------------------------------------------------------------- TRL (its own venv)
def trl_worker(out_dir, spec):
    """GRPOTrainer on a task; writes step_times.json (wall seconds per optimiser step, by phase; peak memory) and
    the final model. spec: model, train, steps, seed, max_tokens, threads, batch, lr, bf16 (the Trainer's bf16
    autocast for the update; generation stays fp32)."""
    sys.path.insert(0, ROOT)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    from machinery.data import load_dataset, load_tokenizer
    from machinery.device import peak_resident_bytes
    from reward import boxed_reward
    tokenizer = load_tokenizer(spec["model"])
    data = load_dataset(spec["train"], tokenizer, 256, False)
    prompts = [tokenizer.decode(p) for p in data.prompt_ids]
    # TRL tokenises plain-text prompts itself: the same ids spo.py trains on, or the comparison is off
    assert all(tokenizer(text=t)["input_ids"] == list(p) for t, p in zip(prompts, data.prompt_ids))
    dataset = Dataset.from_dict({"prompt": prompts, "answer": list(data.answers)})
    eos = tokenizer.eos_token_id

    def reward(prompts, completions, completion_ids, answer, **_):
        # reward.py's verifier; a response without EOS hit the budget and scores 0 (spo's truncated_reward zero)
        return [boxed_reward(c, a) * float(eos in ids) for c, ids, a in zip(completions, completion_ids, answer)]

    steps, spent = [], {"generate": 0.0, "rollout": 0.0}

    def timed(name, fn):  # the trainer's own methods, wrapped to add their wall time to `spent`
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0
        return run

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            spent.update(generate=0.0, rollout=0.0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step = time.perf_counter() - self.t0
            # generate: the model's sampling alone; score: the rest of building the batch (rewards, advantages);
            # update: forward, backward and the optimiser step
            steps.append({"generate": spent["generate"], "score": spent["rollout"] - spent["generate"],
                          "update": step - spent["rollout"], "step": step})

    config = GRPOConfig(
        output_dir=out_dir, max_steps=spec["steps"], seed=spec["seed"], per_device_train_batch_size=spec["batch"],
        num_generations=8, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, beta=0.0, loss_type="dapo", epsilon=0.2,
        epsilon_high=0.28, scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0,
        max_completion_length=spec["max_tokens"], mask_truncated_completions=False, use_vllm=False, logging_steps=1,
        save_strategy="no", report_to=[], bf16=spec.get("bf16", False), use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, gradient_checkpointing=False)  # TRL's default is on; spo.py's on CPU off (it only costs)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimes()])
    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
    trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions)
    trainer.train()
    trainer.save_model(os.path.join(out_dir, "model"))
    tokenizer.save_pretrained(os.path.join(out_dir, "model"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    peak = peak_resident_bytes()  # this one process: model, optimiser, generation
    with open(os.path.join(out_dir, "step_times.json"), "w") as f:
        json.dump({"steps": steps, "reward": rewards, "threads": torch.get_num_threads(), "peak_gib": peak / 2**30,
                   "versions": {"trl": __import__("trl").__version__, "torch": torch.__version__,
                                "transformers": __import__("transformers").__version__}}, f)


# ---------------------------------------------------------------------------------------------- held-out (spo's code)
def heldout_worker(model_dir, toy_dir, seed, max_tokens, out):
    """probes.heldout_metrics, exactly as spo.py calls it at its end, on `model_dir`, in a world of 1."""
    sys.path.insert(0, ROOT)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from machinery import trainer
    from machinery.data import load_dataset, load_tokenizer
    from probes import ProbeSettings, heldout_metrics
    from hf_engine import set_cpu_kv_cache
    from rollout import Engine
    from spo import parse_args
    _, _, device = trainer.setup_distributed()
    set_cpu_kv_cache(None)
    args = parse_args(["--toy_dir", toy_dir, "--seed", str(seed), "--max_response_len", str(max_tokens)])
    test = load_dataset(os.path.join(toy_dir, "test.parquet"), load_tokenizer(model_dir), args.max_prompt_len, False)
    test = test[: args.eval_max_prompts] if args.eval_max_prompts else test
    engine = Engine(model_dir, seed=seed, max_model_len=args.max_prompt_len + max_tokens, device=device)
    metrics = heldout_metrics(engine, test, ProbeSettings.pick(vars(args)), None)
    engine.shutdown()
    with open(out, "w") as f:
        json.dump(metrics, f)


# ---------------------------------------------------------------------------------------------- the benchmark
def _kept_dir(keep, tmp, name):
    """A fresh folder for one row's outputs: under keep (never an existing one), else a temporary one."""
    if not keep:
        return tempfile.mkdtemp(dir=tmp)
    path = os.path.join(keep, name)
    while os.path.exists(path):  # a kept run is never overwritten
        path = os.path.join(keep, f"{name}-{time.strftime('%H%M%S')}-{os.urandom(2).hex()}")
    os.makedirs(path)
    return path


def _trl_row(python, tmp, task, data_dir, steps, seed, warmup, threads, env, spo_args=(), keep=None, bf16=False):
    """TRL (GRPO), then (the toy) the held-out evaluation of its final weights with spo's code: one table row."""
    t = TASKS[task]
    model, train, _ = task_files(task, data_dir)
    trl_dir = _kept_dir(keep, tmp, f"{task}-trl-seed{seed}")
    spec = dict(model=model, train=train, steps=steps, seed=seed, max_tokens=t["max_tokens"], threads=threads,
                batch=t["batch"], lr=t["lr"], bf16=bf16)
    t0 = time.time()
    proc = subprocess.run([python, "-m", "bench.peer", "_trl", trl_dir, json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode:  # TRL logs every step: its output only when it failed
        sys.exit(f"TRL failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    wall = time.time() - t0
    with open(os.path.join(trl_dir, "step_times.json")) as f:
        trl = json.load(f)
    kept = trl["steps"][warmup:] or trl["steps"]
    row = {"steps": [s["step"] for s in kept], "phases": kept, "wall": wall, "versions": trl["versions"],
           "threads": trl["threads"], "peak_gib": trl["peak_gib"],
           "reward": statistics.mean(trl["reward"][warmup:] or trl["reward"]), "accuracy": None}
    if t["heldout"]:
        heldout = os.path.join(trl_dir, "heldout.json")
        subprocess.run([sys.executable, "-m", "bench.peer", "_heldout", os.path.join(trl_dir, "model"),
                        data_dir, str(seed), str(t["max_tokens"]), heldout], check=True, cwd=ROOT, env=env,
                       stdout=subprocess.DEVNULL)
        with open(heldout) as f:
            row["accuracy"] = json.load(f)["eval/accuracy"]
    return row


def step_seconds(metrics, evaluated_last):
    """Wall seconds of each training step of a spo.py metrics.jsonl (rows in order): the time between consecutive
    rows' stamps; the first step's from step 0's evaluation row, or without one its phases' sum (time/step). The
    last step is left out when it was evaluated (evaluated_last), unless it is the only one."""
    training = [m for m in metrics if m["step"] > 0]
    first = training[0]["time"] - metrics[0]["time"] if metrics[0]["step"] == 0 else training[0]["time/step"]
    per_step = [first] + [b["time"] - a["time"] for a, b in zip(training[:-1], training[1:])]
    return per_step[:-1 if evaluated_last else None] or [training[-1]["time/step"]]


def _spo_row(algo, ranks, compiled, tmp, task, data_dir, steps, seed, warmup, env, spo_args=(), keep=None,
             bf16=False):
    """spo.py: (the toy) evaluation only at step 0 and at the end; per-step wall time from metrics.jsonl. One table
    row. keep: a folder for the run directory, else a temporary one. spo_args: more spo.py flags, last (they win)."""
    t = TASKS[task]
    run = os.path.join(_kept_dir(keep, tmp, f"{task}-{algo}-{ranks}rank-compile_{compiled}-seed{seed}"), "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "spo.py", "--algo", algo,
           "--steps", str(steps), *task_files(task, data_dir)[2], "--seed", str(seed),
           "--eval_every", str(steps if t["heldout"] else 0), "--save_every", "0", "--batch_size", str(t["batch"]),
           "--lr", str(t["lr"]), "--max_response_len", str(t["max_tokens"]), "--run_dir", run,
           "--engine_compile", compiled, *(["--bf16", "on"] if bf16 else []), *spo_args]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    wall = time.time() - t0
    metrics = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    training = [m for m in metrics if m["step"] > 0]
    per_step = step_seconds(metrics, t["heldout"])
    kept = training[warmup:] or training
    return {"steps": per_step[warmup:] or per_step, "accuracy": training[-1].get("eval/accuracy"), "wall": wall,
            "phases": [{k[5:]: m[k] for k in m if k.startswith("time/")} for m in kept],
            "peak_gib": max(m["memory/peak_gib"] for m in training),
            "reward": statistics.mean(m["reward/mean"] for m in kept)}


def bench_peer(task="toy", steps=None, trl_python=None, data_dir=None, seed=0, warmup=None, trl_threads=None,
               spo_ranks=(1, 2), engine_compile=("off", "on"), rounds=1, keep=None, spo_args=(), bf16=False):
    """TRL GRPO, spo.py GRPO and spo.py SPO on a task, one after another, `rounds` times (every other round in
    reverse order, so that a machine growing slower or faster over the run weighs on every row alike); prints the
    table; returns its rows. Per row: every round's steps pooled into one median, the ratio to TRL's pooled
    median, and each round's own ratio (TRL measured in the same round). Unset numbers: the task's (TASKS)."""
    t = TASKS[task]
    steps, warmup = steps or t["steps"], t["warmup"] if warmup is None else warmup
    trl_threads = trl_threads or t["trl_threads"]
    python = trl_python or os.environ.get("SPO_TRL_PYTHON") or sys.executable
    data_dir = os.path.abspath(data_dir or (os.path.join(ROOT, "tasks", "built", "toy") if task == "toy"
                                            else os.path.join(ROOT, "smollm")))
    if not os.path.isdir(os.path.join(data_dir, "model")):
        build = "run spo.py once, or pass --data_dir" if task == "toy" else "python -m tasks.smollm, or --data_dir"
        print(f"skipped: no {task} in {data_dir} ({build})", flush=True)
        return None
    if subprocess.run([python, "-c", "import trl"], capture_output=True).returncode != 0:
        print("skipped: " + INSTALL_HINT.format(python=python), flush=True)
        return None
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    trl_label = "TRL GRPOTrainer (GRPO)"
    runs = {trl_label: functools.partial(_trl_row, python, threads=trl_threads)}
    for ranks, compiled, (algo, name) in [(n, c, a) for n in spo_ranks for c in engine_compile
                                          for a in (("grpo", "--algo grpo"), ("spo", "(SPO)"))]:
        label = f"spo.py {name}, {ranks} rank{'s' * (ranks > 1)}{', compiled' * (compiled == 'on')}"
        runs[label] = functools.partial(_spo_row, algo, ranks, compiled)
    measured = {label: [] for label in runs}  # label -> one row per round
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(rounds):
            for label in (list(runs) if k % 2 == 0 else list(runs)[::-1]):
                measured[label].append(runs[label](tmp=tmp, task=task, data_dir=data_dir, steps=steps, seed=seed,
                                                   warmup=warmup, env=env, keep=keep,
                                                   spo_args=spo_args, bf16=bf16))
    trl = measured[trl_label][0]
    trl_step = statistics.median(s for row in measured[trl_label] for s in row["steps"])
    rows = {}
    for label, per_round in measured.items():
        step = statistics.median(s for row in per_round for s in row["steps"])
        rows[label] = {"step": step, "ratio": step / trl_step, "accuracies": [row["accuracy"] for row in per_round],
                       "round_ratios": [statistics.median(row["steps"]) / statistics.median(r["steps"])
                                        for row, r in zip(per_round, measured[trl_label])],
                       "wall": statistics.mean(row["wall"] for row in per_round),
                       "peak_gib": max(row["peak_gib"] for row in per_round),
                       "reward": statistics.mean(row["reward"] for row in per_round),
                       "phases": {k: statistics.median(p[k] for row in per_round for p in row["phases"])
                                  for k in per_round[0]["phases"][0]}}
    model = "the toy" if task == "toy" else "SmolLM2-135M"
    print(f"\n{model}{', bf16 on both sides' * bf16}, {steps} steps x {t['batch']} responses (at most "
          f"{t['max_tokens']} tokens), seed {seed}, "
          f"{rounds} round{'s' * (rounds > 1)}; per-step time: median wall seconds per step over all rounds, the "
          f"first {warmup} (start-up){' and the evaluated last' * t['heldout']} of each run left out"
          f"{f'; held-out: probes.heldout_metrics at step {steps}' * t['heldout']}\nTRL {trl['versions']['trl']} "
          f"(transformers {trl['versions']['transformers']}, torch {trl['threads']} threads); peak: resident GiB "
          f"of one process (spo.py: its largest rank); reward: mean training reward of the measured steps")
    print(f"{'':>40} {'s/step':>8} {'vs TRL':>8} {'each round':>{6 * rounds + 4}} {'peak GiB':>9} {'reward':>7} "
          f"{'held-out' * t['heldout']:>9} {'total wall s':>13}")
    for label, row in rows.items():
        each = "/".join(f"{r:.2f}" for r in row["round_ratios"])
        accs = row["accuracies"]  # the same weights every round (seeded): one number
        held = "" if accs[0] is None else ("/".join(f"{a:.1%}" for a in accs) if len(set(accs)) > 1
                                           else f"{accs[0]:.1%}")
        print(f"{label:>40} {row['step']:>8.3f} {row['ratio']:>7.2f}x {each + 'x':>{6 * rounds + 4}} "
              f"{row['peak_gib']:>9.2f} {row['reward']:>7.3f} {held:>9} {row['wall']:>13.0f}")
    for label, row in rows.items():
        print(f"{label} phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in row["phases"].items()))
    print("\nsettings that differ (spo.py | TRL):")
    for name, ours, theirs in SETTINGS_THAT_DIFFER:
        print(f"  {name}: {ours} | {theirs}")
    return rows


def main(argv=None):
    """`python -m bench peer [flags]`."""
    p = argparse.ArgumentParser(prog="python -m bench peer", description="spo.py against TRL's GRPOTrainer")
    p.add_argument("--task", choices=sorted(TASKS), default="toy", help="the toy, or SmolLM2-135M (tasks/smollm.py)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: toy 150, smollm 8)")
    p.add_argument("--trl_python", default=None, help="an interpreter with trl installed (default: "
                                                     "$SPO_TRL_PYTHON, else this one)")
    p.add_argument("--data_dir", "--toy_dir", default=None,
                   help="the task's built folder (default: the shipped tasks/built/toy, or ./smollm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=None, help="first steps left out of the median (start-up; "
                                                             "default: toy 5, smollm 2)")
    p.add_argument("--trl_threads", type=int, default=None, help="torch threads of the TRL process (default: toy "
                                                                  "1, smollm all cores)")
    p.add_argument("--spo_ranks", type=int, nargs="+", default=[1, 2], help="spo.py's ranks, each measured")
    p.add_argument("--engine_compile", choices=["off", "on"], nargs="+", default=["off", "on"],
                   help="spo.py's --engine_compile, each measured (on: faster steps, longer start-up)")
    p.add_argument("--rounds", type=int, default=1, help="run everything this many times, every other round "
                                                         "in reverse order (a drifting machine's speed cancels)")
    p.add_argument("--bf16", action="store_true", help="bf16 on both sides: spo.py --bf16 on (trainer and "
                                                           "engine), TRL's bf16=True (autocast in its update)")
    p.add_argument("--spo_args", default="", help="more spo.py flags for every spo.py row, one quoted string "
                                                  "(e.g. \"--max_tokens_per_micro_batch 1024\")")
    p.add_argument("--keep", default=None, help="keep spo.py's run directories in this folder")
    a = p.parse_args(argv)
    if a.keep:
        os.makedirs(a.keep, exist_ok=True)
    bench_peer(a.task, a.steps, a.trl_python, a.data_dir, a.seed, a.warmup, a.trl_threads, a.spo_ranks,
               a.engine_compile, a.rounds, a.keep and os.path.abspath(a.keep), shlex.split(a.spo_args), a.bf16)


if __name__ == "__main__":  # the worker processes; run the benchmark itself through `python -m bench peer`
    if sys.argv[1:2] == ["_trl"]:
        trl_worker(sys.argv[2], json.loads(sys.argv[3]))
    elif sys.argv[1:2] == ["_heldout"]:
        heldout_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        main()
