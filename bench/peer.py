"""`python -m bench peer`: spo.py against the library a user would pick instead, TRL's GRPOTrainer, on one task.

The toy (--task toy) or SmolLM2-135M-Instruct on tasks/smollm.py's arithmetic (--task smollm: `python -m
tasks.smollm` builds ./smollm); the same model, prompts, budget, seed and optimiser on both sides, one after
another: TRL's GRPOTrainer, spo.py --algo grpo and spo.py (SPO). --rounds 2 runs everything twice, the second time
reversed: on a machine whose speed drifts, one pass favours whoever ran in the faster minutes. TRL lives in its own
interpreter (it pins its own transformers):

    python3 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 trl==1.16.0
    python -m bench peer --trl_python /tmp/trlvenv/bin/python --steps 3   # a quick check (the toy's default: 150)
    SPO_TRL_PYTHON=/tmp/trlvenv/bin/python python -m bench peer --task smollm --rounds 3
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: programs run from there
INSTALL = "python3 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 trl==1.16.0"
SETTINGS_THAT_DIFFER = [  # (what, spo.py, TRL); what is the same is set in trl_worker
    ("generation", "vLLM (CPU), an engine per rank, weights pushed each step", "generate() in the training process"),
    ("processes", "--spo_ranks (torchrun, FSDP2; torchrun's threads)", "1 process: the toy 1 thread, SmolLM2 all"),
    ("dual clip", "10 (negative advantages: loss at most -10 A)", "none (inactive: ratio 1, one optimiser step)"),
    ("advantage", "GRPO: (r - group mean) / (group std + 1e-6)", "scale_rewards='group': the same with + 1e-4"),
    ("SPO", "B prompts x 1, tracker baseline, Eq. 11 sampling; offline values: the toy's cached, SmolLM2 none", "none"),
    ("phases", "spo.py's time/* metrics (rank 0)", "generate, score (the rest of the batch), update (the rest)")]
# The toy's default run, SmolLM2's of docs/own-model-and-data.md (TRL on the toy: one thread, as first measured)
TASKS = {"toy": dict(train="train.parquet", steps=150, warmup=5, batch_size=64, lr=2e-4, max_response_len=32,
                     trl_threads=1),
         "smollm": dict(train="train.jsonl", steps=8, warmup=2, batch_size=16, lr=1e-5, max_response_len=48,
                        trl_threads=os.cpu_count() or 1)}
SAME = ("steps", "seed", "batch_size", "lr", "max_response_len")  # spo.py's flags, given to TRL too (trl_worker)


def trl_worker(run_dir, spec):
    """GRPOTrainer on bench_peer's spec (model, train, trl_threads and SAME); writes run_dir/metrics.jsonl, a row
    per optimiser step as spo.py's: a time stamp, time/* phases, peak resident memory (and what ran: `about`)."""
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
    about = f"TRL {trl.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} thread(s)"

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

    config = trl.GRPOConfig(
        output_dir=run_dir, max_steps=spec["steps"], seed=spec["seed"], model_init_kwargs={"dtype": "float32"},
        num_generations=8, per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, learning_rate=spec["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group", temperature=1.0,
        top_p=1.0, top_k=0, max_completion_length=spec["max_response_len"], mask_truncated_completions=False,
        use_vllm=False, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        gradient_checkpointing=False)  # TRL's default is on; spo.py's on CPU off (it only costs)
    trainer = trl.GRPOTrainer(model=spec["model"], reward_funcs=reward, args=config, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompts, "answer": list(data.answers)}),
                              callbacks=[StepTimes()])
    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
    trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions)
    spent.update(generate=0.0, rollout=0.0, end=time.perf_counter())
    trainer.train()


def step_seconds(metrics):
    """Wall seconds of each training step of a metrics.jsonl (rows in order): the gaps between consecutive training
    rows' stamps, the first step's its phases' sum (no row before it: runs here evaluate nothing at step 0)."""
    training = [m for m in metrics if m["step"] > 0]
    return [training[0]["time/step"]] + [b["time"] - a["time"] for a, b in zip(training[:-1], training[1:])]


def run_program(cmd, run_dir):
    """A program run from the repository root, its output (a line per step) shown only when it fails: the rows of
    the metrics.jsonl it writes in run_dir."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{shlex.join(cmd[:6])} ... failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-6000:]}")
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def spo_metrics(run_dir, ranks, *flags):
    """torchrun spo.py FLAGS without evaluations or checkpoints between steps: its metrics.jsonl's rows."""
    return run_program([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "spo.py",
                        "--eval_every", "0", "--save_every", "0", "--run_dir", run_dir, *flags], run_dir)


def run_row(who, run_dir, spec, trl_python, spo_ranks):
    """One run of TRL or spo.py (who: 'trl', 'grpo' or 'spo') on bench_peer's spec: {steps: wall seconds, phases:
    seconds by phase, each by step after the warm-up; peak_gib; about}."""
    metrics = (run_program([trl_python, "-m", "bench.peer", "_trl", run_dir, json.dumps(spec)], run_dir)
               if who == "trl" else spo_metrics(run_dir, spo_ranks, "--algo", who,
                                                *(f"--{k}={spec[k]}" for k in SAME), *spec["spo_flags"]))
    training, warmup = [m for m in metrics if m["step"] > 0], spec["warmup"]
    return {"steps": step_seconds(metrics)[warmup:], "peak_gib": max(m["memory/peak_gib"] for m in training),
            "phases": [{k[5:]: m[k] for k in m if k.startswith("time/")} for m in training[warmup:]],
            "about": training[0].get("about")}


def summarise(measured, trl_label):
    """{label: one row per round} -> {label: median s/step over all rounds' steps, its ratio to TRL's, each round's
    own ratio (TRL of the same round), peak GiB, median phases}."""
    trl_step = statistics.median(s for row in measured[trl_label] for s in row["steps"])
    rows = {}
    for label, per_round in measured.items():
        step = statistics.median(s for row in per_round for s in row["steps"])
        rows[label] = {"step": step, "ratio": step / trl_step, "peak_gib": max(r["peak_gib"] for r in per_round),
                       "rounds": [statistics.median(row["steps"]) / statistics.median(trl["steps"])
                                  for row, trl in zip(per_round, measured[trl_label])],
                       "phases": {k: statistics.median(p[k] for row in per_round for p in row["phases"])
                                  for k in per_round[0]["phases"][0]}}
    return rows


def bench_peer(task="toy", steps=None, trl_python=None, data_dir=None, seed=0, spo_ranks=2, rounds=1, spo_args=()):
    """TRL, spo.py --algo grpo and spo.py (SPO), one after another, `rounds` times (every other round reversed);
    prints the table and returns its rows, or None (one 'skipped: ...' line) without the task or TRL."""
    t, steps = TASKS[task], steps or TASKS[task]["steps"]
    trl_python = trl_python or os.environ.get("SPO_TRL_PYTHON") or sys.executable
    data_dir = os.path.abspath(data_dir or (os.path.join(ROOT, "tasks", "built", "toy") if task == "toy" else "smollm"))
    if not os.path.isdir(os.path.join(data_dir, "model")):
        build = "python -m tasks.smollm, or --data_dir" if task == "smollm" else "pass --data_dir"
        return print(f"skipped: no {task} in {data_dir} ({build})", flush=True)
    if subprocess.run(f"{shlex.quote(trl_python)} -c 'import trl'", shell=True, capture_output=True).returncode:
        return print(f"skipped: TRL is not installed for {trl_python}: {INSTALL}, then pass --trl_python "
                     f"/tmp/trlvenv/bin/python (or set SPO_TRL_PYTHON)", flush=True)
    model, train = os.path.join(data_dir, "model"), os.path.join(data_dir, t["train"])
    spec = {**t, "steps": steps, "seed": seed, "model": model, "train": train, "warmup": min(t["warmup"], steps - 1),
            "spo_flags": [*(["--toy_dir", data_dir] if task == "toy" else ["--model", model, "--train", train,
                                                                         "--offline_values", "none"]), *spo_args]}
    labels = {"trl": "TRL GRPOTrainer (GRPO)", "grpo": "spo.py --algo grpo", "spo": "spo.py (SPO)"}
    measured = {label: [] for label in labels.values()}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(rounds):
            for who in (list(labels) if k % 2 == 0 else list(labels)[::-1]):
                measured[labels[who]].append(run_row(who, tempfile.mkdtemp(dir=tmp), spec, trl_python, spo_ranks))
    rows, about = summarise(measured, labels["trl"]), measured[labels["trl"]][0]["about"]
    print(f"\n{task}: " + ", ".join(f"{k} {spec[k]}" for k in SAME) + f"; {rounds} round(s); spo.py on {spo_ranks} "
          f"rank(s), {shlex.join(spo_args) or 'its defaults'}; s/step: median wall time over the rounds, the first "
          f"{spec['warmup']} steps of each left out; peak: resident GiB of one process; {about}")
    print(f"{'':>24} {'s/step':>8} {'vs TRL':>7} {'each round':>{6 * rounds + 4}} {'peak GiB':>9}")
    for label, row in rows.items():
        each = "/".join(f"{r:.2f}" for r in row["rounds"]) + "x"
        print(f"{label:>24} {row['step']:>8.3f} {row['ratio']:>6.2f}x {each:>{6 * rounds + 4}} {row['peak_gib']:>9.2f}")
    for label, row in rows.items():
        print(f"{label} phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in row["phases"].items()))
    print("settings that differ (spo.py | TRL):\n" + "\n".join(f"  {a}: {b} | {c}" for a, b, c in SETTINGS_THAT_DIFFER))
    return rows


def main(argv=None):
    """`python -m bench peer [flags]`."""
    p = argparse.ArgumentParser(prog="python -m bench peer", description="spo.py against TRL's GRPOTrainer")
    p.add_argument("--task", choices=sorted(TASKS), default="toy", help="the toy, or SmolLM2-135M (tasks/smollm.py)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: toy 150, smollm 8; the first "
                   "5 and 2 left out of the medians)")
    p.add_argument("--trl_python", default=None, help="an interpreter with trl (default: $SPO_TRL_PYTHON, else this)")
    p.add_argument("--data_dir", default=None, help="the task's built folder (default: tasks/built/toy, ./smollm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spo_ranks", type=int, default=2, help="spo.py's ranks (torchrun --nproc_per_node)")
    p.add_argument("--rounds", type=int, default=1, help="run everything N times, every other round reversed")
    p.add_argument("--spo_args", default="", help="more spo.py flags, one quoted string (e.g. \"--compile on\")")
    a = p.parse_args(argv)
    bench_peer(**{**vars(a), "spo_args": shlex.split(a.spo_args)})


if __name__ == "__main__":  # the TRL worker; run the benchmark itself through `python -m bench peer`
    trl_worker(sys.argv[2], json.loads(sys.argv[3])) if sys.argv[1:2] == ["_trl"] else main()
