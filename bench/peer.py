"""`python -m bench peer`: spo.py against the library a user would pick instead, TRL's GRPOTrainer, on the same toy.

The same toy model, training prompts and held-out prompts, the same budget (steps x 64 responses per step) and
seed, run one after another in one process tree: TRL's GRPOTrainer (plain Hugging Face generation, one
process), then spo.py --algo grpo and spo.py (SPO) under torchrun, on 1 rank and on 2 (--spo_ranks), each with
vLLM eager and compiled (--engine_compile: spo.py's flag; compiled starts seconds later). Printed: the
median wall time per training step (start-up excluded: the first `warmup` steps; evaluation excluded: spo.py
evaluates only at step 0 and at the end, TRL not at all during training), the held-out accuracy at the end, and the
ratios to TRL.

Held-out accuracy is the same code for all three: eval.heldout_metrics (spo.py's own held-out evaluation: avg@2
over the toy's test prompts at temperature 1.0, seeds that depend on the prompt, not the step, scored by
reward.py) on the final weights. For TRL the saved model is loaded into the same vLLM engine class in a world of 1
(the samples do not depend on the world size: eval.sample_and_score).

What is the same: the toy model (fp32), prompts (spo's chat-templated prompt text; re-tokenised by TRL to the
same ids, checked), 64 responses per step as 8 prompts x 8 for GRPO, temperature 1.0 (top-p 1, no top-k),
the response budget (32 tokens), AdamW lr 2e-4 (constant), weight decay 0.01, betas (0.9, 0.999), gradient clip
1.0, one optimiser step per batch, PPO clip 0.2 / 0.28 (clip-higher), no KL (beta 0), the reward (reward.py's
boxed answer; a response cut off by the budget scores 0, as spo's default), the group z-score advantage.
What differs (SETTINGS_THAT_DIFFER, printed with the table): listed there.

TRL is a benchmark-only dependency, best kept in its own virtual environment (it pins its own transformers):

    python3 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 trl==1.16.0
    .venv/bin/python -m bench peer --trl_python /tmp/trlvenv/bin/python           # 150 steps
    .venv/bin/python -m bench peer --trl_python /tmp/trlvenv/bin/python --steps 3  # a quick check
    .venv/bin/python -m bench peer --trl_python /tmp/trlvenv/bin/python --engine_compile off --rounds 2

--rounds 2 runs everything twice, the second time in reverse order (TRL first and last), and pools each row's
steps: on a machine whose speed drifts over minutes, one pass favours whoever ran in the faster minutes.
(--trl_python defaults to $SPO_TRL_PYTHON, else this interpreter; without TRL the benchmark says how to install
it and skips.)
"""
import argparse
import functools
import json
import os
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
     "ranks 1 thread each (torchrun's default)", "1 process, --trl_threads threads (default 1, as TRL was first "
     "measured; --trl_threads 2 gives it both cores)"),
    ("loss aggregation", "token mean over the global batch (Eq. 10)", "loss_type='dapo': token mean over the "
     "global batch (the same)"),
    ("dual clip", "10 (negative advantages: loss at most -10 A)", "none (inactive here: ratio = 1 with one "
     "optimiser step per batch)"),
    ("KL", "none", "beta=0.0 (none)"),
    ("advantage", "GRPO: (r - group mean) / (group std + 1e-6)", "scale_rewards='group': the same with + 1e-4"),
    ("SPO", "spo.py --algo spo: 64 prompts x 1, tracker baseline, prioritised sampling", "not available in TRL"),
]


# ---------------------------------------------------------------------------------------------- TRL (its own venv)
def trl_worker(out_dir, toy_dir, steps, seed, max_tokens, threads):
    """GRPOTrainer on the toy; writes step_times.json (wall seconds per optimiser step) and the final model."""
    sys.path.insert(0, ROOT)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    from machinery.data import load_dataset, load_tokenizer
    from reward import boxed_reward
    model_dir, train_path = os.path.join(toy_dir, "model"), os.path.join(toy_dir, "train.parquet")
    tokenizer = load_tokenizer(model_dir)
    data = load_dataset(train_path, tokenizer, 256, False)
    prompts = [tokenizer.decode(p) for p in data.prompt_ids]
    # TRL tokenises plain-text prompts itself: the same ids spo.py trains on, or the comparison is off
    assert all(tokenizer(text=t)["input_ids"] == list(p) for t, p in zip(prompts, data.prompt_ids))
    dataset = Dataset.from_dict({"prompt": prompts, "answer": list(data.answers)})
    eos = tokenizer.eos_token_id

    def reward(prompts, completions, completion_ids, answer, **_):
        # reward.py's verifier; a response without EOS hit the budget and scores 0 (spo's truncated_reward zero)
        return [boxed_reward(c, a) * float(eos in ids) for c, ids, a in zip(completions, completion_ids, answer)]

    times = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.time()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.time() - self.t0)

    config = GRPOConfig(
        output_dir=out_dir, max_steps=steps, seed=seed, per_device_train_batch_size=64, num_generations=8,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, learning_rate=2e-4,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
        scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0, max_completion_length=max_tokens,
        mask_truncated_completions=False, use_vllm=False, logging_steps=1, save_strategy="no", report_to=[],
        bf16=False, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=False)  # TRL turns it on by default; spo.py does not on CPU (and it only costs here)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimes()])
    trainer.train()
    trainer.save_model(os.path.join(out_dir, "model"))
    tokenizer.save_pretrained(os.path.join(out_dir, "model"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    with open(os.path.join(out_dir, "step_times.json"), "w") as f:
        json.dump({"step_times": times, "reward": rewards, "threads": torch.get_num_threads(),
                   "versions": {"trl": __import__("trl").__version__, "torch": torch.__version__,
                                "transformers": __import__("transformers").__version__}}, f)


# ---------------------------------------------------------------------------------------------- held-out (spo's code)
def heldout_worker(model_dir, toy_dir, seed, max_tokens, out):
    """eval.heldout_metrics, exactly as spo.py calls it at its end, on `model_dir`, in a world of 1."""
    sys.path.insert(0, ROOT)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from machinery import trainer
    from machinery.data import load_dataset, load_tokenizer
    from eval import heldout_metrics
    from machinery.memory import set_cpu_kv_cache
    from rollout import Engine
    from spo import parse_args
    _, _, device = trainer.setup_distributed()
    set_cpu_kv_cache(None)
    args = parse_args(["--toy_dir", toy_dir, "--seed", str(seed), "--max_response_len", str(max_tokens)])
    test = load_dataset(os.path.join(toy_dir, "test.parquet"), load_tokenizer(model_dir), args.max_prompt_len, False)
    test = test[: args.eval_max_prompts] if args.eval_max_prompts else test
    engine = Engine(model_dir, seed=seed, max_model_len=args.max_prompt_len + max_tokens, device=device)
    metrics = heldout_metrics(engine, test, args, None)
    engine.shutdown()
    with open(out, "w") as f:
        json.dump(metrics, f)


# ---------------------------------------------------------------------------------------------- the benchmark
def _trl_row(python, tmp, toy_dir, steps, seed, max_tokens, trl_threads, warmup, env):
    """TRL (GRPO), then the held-out evaluation of its final weights with spo's code: one table row."""
    trl_dir = tempfile.mkdtemp(dir=tmp)
    t0 = time.time()
    proc = subprocess.run([python, "-m", "bench.peer", "_trl", trl_dir, toy_dir, str(steps), str(seed),
                           str(max_tokens), str(trl_threads)], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:  # TRL logs every step: its output only when it failed
        sys.exit(f"TRL failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    wall = time.time() - t0
    with open(os.path.join(trl_dir, "step_times.json")) as f:
        trl = json.load(f)
    heldout = os.path.join(trl_dir, "heldout.json")
    subprocess.run([sys.executable, "-m", "bench.peer", "_heldout", os.path.join(trl_dir, "model"),
                    toy_dir, str(seed), str(max_tokens), heldout], check=True, cwd=ROOT, env=env,
                   stdout=subprocess.DEVNULL)
    with open(heldout) as f:
        return {"steps": trl["step_times"][warmup:] or trl["step_times"], "accuracy": json.load(f)["eval/accuracy"],
                "wall": wall, "versions": trl["versions"], "threads": trl["threads"]}


def _spo_row(algo, ranks, compiled, tmp, toy_dir, steps, seed, max_tokens, warmup, env):
    """spo.py: evaluation only at step 0 and at the end; per-step wall time from metrics.jsonl. One table row."""
    run = tempfile.mkdtemp(dir=tmp)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "spo.py", "--algo", algo,
           "--steps", str(steps), "--toy_dir", toy_dir, "--seed", str(seed), "--eval_every", str(steps),
           "--save_every", "0", "--max_response_len", str(max_tokens), "--run_dir", os.path.join(run, "run"),
           "--engine_compile", compiled]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    wall = time.time() - t0
    metrics = [json.loads(line) for line in open(os.path.join(run, "run", "metrics.jsonl"))]
    training = [m for m in metrics if m["step"] > 0]
    # wall time between consecutive logged steps, the final (evaluated) step left out
    stamps = [metrics[0]["time"]] + [m["time"] for m in training]
    per_step = [b - a for a, b in zip(stamps[:-1], stamps[1:])][:-1] or [training[-1]["time/step"]]
    return {"steps": per_step[warmup:] or per_step, "accuracy": training[-1]["eval/accuracy"], "wall": wall,
            "phases": [{k[5:]: m[k] for k in m if k.startswith("time/")} for m in training[warmup:] or training]}


def bench_peer(steps=150, trl_python=None, toy_dir=None, seed=0, warmup=5, max_tokens=32, trl_threads=1,
               spo_ranks=(1, 2), engine_compile=("off", "on"), rounds=1):
    """TRL GRPO, spo.py GRPO and spo.py SPO on the toy, one after another, `rounds` times (every other round in
    reverse order, so that a machine growing slower or faster over the run weighs on every row alike); prints the
    table; returns its rows. Per row: every round's steps pooled into one median, the ratio to TRL's pooled
    median, and each round's own ratio (TRL measured in the same round)."""
    python = trl_python or os.environ.get("SPO_TRL_PYTHON") or sys.executable
    toy_dir = os.path.abspath(toy_dir or os.path.join(ROOT, "tasks", "built", "toy"))
    if subprocess.run([python, "-c", "import trl"], capture_output=True).returncode != 0:
        print("skipped: " + INSTALL_HINT.format(python=python), flush=True)
        return None
    if not os.path.isdir(os.path.join(toy_dir, "model")):
        print(f"skipped: no toy in {toy_dir} (run spo.py once, or pass --toy_dir)", flush=True)
        return None
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    trl_label = "TRL GRPOTrainer (GRPO)"
    runs = {trl_label: functools.partial(_trl_row, python, trl_threads=trl_threads)}
    for ranks, compiled, (algo, name) in [(n, c, a) for n in spo_ranks for c in engine_compile
                                          for a in (("grpo", "--algo grpo"), ("spo", "(SPO)"))]:
        label = f"spo.py {name}, {ranks} rank{'s' * (ranks > 1)}{', compiled' * (compiled == 'on')}"
        runs[label] = functools.partial(_spo_row, algo, ranks, compiled)
    measured = {label: [] for label in runs}  # label -> one row per round
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(rounds):
            for label in (list(runs) if k % 2 == 0 else list(runs)[::-1]):
                measured[label].append(runs[label](tmp=tmp, toy_dir=toy_dir, steps=steps, seed=seed,
                                                   max_tokens=max_tokens, warmup=warmup, env=env))
    trl = measured[trl_label][0]
    trl_step = statistics.median(t for row in measured[trl_label] for t in row["steps"])
    rows = {}
    for label, per_round in measured.items():
        step = statistics.median(t for row in per_round for t in row["steps"])
        rows[label] = {"step": step, "ratio": step / trl_step, "accuracy": per_round[0]["accuracy"],
                       "accuracies": [row["accuracy"] for row in per_round],
                       "round_ratios": [statistics.median(row["steps"]) / statistics.median(t["steps"])
                                        for row, t in zip(per_round, measured[trl_label])],
                       "wall": statistics.mean(row["wall"] for row in per_round)}
        if "phases" in per_round[0]:
            phases = [p for row in per_round for p in row["phases"]]
            rows[label]["phases"] = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    print(f"\nthe toy, {steps} steps x 64 responses, seed {seed}, {rounds} round{'s' * (rounds > 1)}; per-step "
          f"time: median wall seconds per step over all rounds, the first {warmup} (start-up) and the evaluated last "
          f"of each run left out; held-out: eval.heldout_metrics at step {steps}\nTRL {trl['versions']['trl']} "
          f"(transformers {trl['versions']['transformers']}, torch {trl['threads']} threads)")
    print(f"{'':>40} {'s/step':>8} {'vs TRL':>8} {'each round':>{6 * rounds + 4}} {'held-out':>9} "
          f"{'total wall s':>13}")
    for label, row in rows.items():
        each = "/".join(f"{r:.2f}" for r in row["round_ratios"])
        held = ("/".join(f"{a:.1%}" for a in row["accuracies"]) if len(set(row["accuracies"])) > 1
                else f"{row['accuracy']:.1%}")  # the same weights every round (seeded): one number
        print(f"{label:>40} {row['step']:>8.3f} {row['ratio']:>7.2f}x {each + 'x':>{6 * rounds + 4}} {held:>9} "
              f"{row['wall']:>13.0f}")
    for label, row in rows.items():
        if "phases" in row:
            print(f"{label} phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in row["phases"].items()))
    print("\nsettings that differ (spo.py | TRL):")
    for name, ours, theirs in SETTINGS_THAT_DIFFER:
        print(f"  {name}: {ours} | {theirs}")
    return rows


def main(argv=None):
    """`python -m bench peer [flags]`."""
    p = argparse.ArgumentParser(prog="python -m bench peer", description="spo.py against TRL's GRPOTrainer on the toy")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--trl_python", default=None, help="an interpreter with trl installed (default: "
                                                     "$SPO_TRL_PYTHON, else this one)")
    p.add_argument("--toy_dir", default=None, help="the built toy (default: the shipped tasks/built/toy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the median (start-up)")
    p.add_argument("--trl_threads", type=int, default=1, help="torch threads of the TRL process")
    p.add_argument("--spo_ranks", type=int, nargs="+", default=[1, 2], help="spo.py's ranks, each measured")
    p.add_argument("--engine_compile", choices=["off", "on"], nargs="+", default=["off", "on"],
                   help="spo.py's --engine_compile, each measured (on: faster steps, longer start-up)")
    p.add_argument("--rounds", type=int, default=1, help="run everything this many times, every other round "
                                                         "in reverse order (a drifting machine's speed cancels)")
    a = p.parse_args(argv)
    bench_peer(a.steps, a.trl_python, a.toy_dir, a.seed, a.warmup, trl_threads=a.trl_threads,
               spo_ranks=a.spo_ranks, engine_compile=a.engine_compile, rounds=a.rounds)


if __name__ == "__main__":  # the worker processes; run the benchmark itself through `python -m bench peer`
    if sys.argv[1:2] == ["_trl"]:
        trl_worker(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8]))
    elif sys.argv[1:2] == ["_heldout"]:
        heldout_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        main()
