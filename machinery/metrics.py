"""What a run records: each step's metrics no library knows for SPO (docs/flags.md), the logger (metrics.jsonl, the
console line, tqdm, --report_to's trackers if asked) and run.png, on json, tqdm and matplotlib."""
import contextlib
import json
import os
import sys
import time

import numpy as np
import torch.distributed as dist

from machinery.collectives import all_gather_np
from machinery.run_dir import atomic_write, run_file
from machinery.trackers import SAMPLES, SAMPLES_MAX_BYTES, open_trackers, sample_rows
from machinery.untrusted import parse_json, read_file


def tool_metrics(all_reward, rollouts):
    calls, errors, timeouts, turns = (all_gather_np(np.array([getattr(r, k) for r in rollouts], dtype=np.float64))
                                      for k in ("tool_calls", "tool_errors", "tool_timeouts", "turns"))
    reward, used = np.asarray(all_reward, dtype=np.float64), calls > 0
    return {"tools/use_rate": used.mean(), "tools/calls_mean": calls.mean(), "tools/turns_mean": turns.mean(),
            "tools/accuracy_with_tool": reward[used].mean() if used.any() else 0.0,
            "tools/accuracy_without_tool": reward[~used].mean() if (~used).any() else 0.0,
            "tools/error_rate": errors.sum() / max(calls.sum(), 1),
            "tools/timeout_rate": timeouts.sum() / max(calls.sum(), 1)}


def step_metrics(reward, raw_advantage, advantage, rollouts, acting, stats, times, group=1, tools=False):
    """What every algorithm reports over the global batch (each metric: docs/flags.md). acting: trainer.update's,
    the batch's log-probs under the acting policy and step 4's count of rescored sequences."""
    world = dist.get_world_size()
    reward, raw, adv, lengths, policy_tokens, truncated, scalars = all_gather_np(  # one collective
        reward, raw_advantage, np.asarray(advantage), np.array([len(r.response_ids) for r in rollouts]),
        np.array([sum(r.response_mask) for r in rollouts]),  # policy tokens: tool output left out
        np.array([r.finish_reason == "length" for r in rollouts], dtype=np.float64),
        np.array([acting["entropy"], acting["logprob_gap_mean"], acting["sequences"], acting["logprob_gap_max"],
                  acting["ratio_max"], acting["ratio_outside"], acting["tokens"]]))
    # per rank: entropy, mean gap, rescored sequences; max gap, max ratio; ratios outside [0.9, 1.1], tokens
    scalars = scalars.reshape(world, 7)
    gap_max, ratio_max, (outside, tokens) = scalars[:, 3].max(), scalars[:, 4].max(), scalars[:, 5:].sum(0)
    scalars = scalars[:, :3].sum(0)
    m = {"reward/mean": reward.mean(), "reward/all_equal": float(reward.min() == reward.max()),  # Logger counts it
         "advantage/mean": raw.mean(), "advantage/std": raw.std(),
         "advantage/p05": np.quantile(raw, 0.05), "advantage/p50": np.quantile(raw, 0.5),
         "advantage/p95": np.quantile(raw, 0.95), "advantage/normalised_std": adv.std(),
         "advantage/token_mean": (adv * policy_tokens).sum() / max(policy_tokens.sum(), 1),
         "response/length_mean": lengths.mean(), "response/length_max": lengths.max(),
         "response/truncated": truncated.mean(), "policy/entropy": scalars[0] / world,
         "policy/logprob_gap_mean": scalars[1] / world, "policy/logprob_gap_max": gap_max,
         "policy/ratio_outside": outside / max(tokens, 1), "policy/ratio_max": ratio_max,
         "policy/tis_truncated": stats["tis_truncated"], "policy/rescored_sequences": scalars[2],
         "policy/clip_fraction": stats["clip_fraction"], "policy/approx_kl": stats["approx_kl"],
         "policy/grad_norm": stats["grad_norm"], "policy/loss": stats["loss"], "policy/lr": stats["lr"],
         "policy/decoder_tokens": stats["decoder_tokens"]}
    if "kl_ref" in stats:  # --kl_coef: the estimate of KL(pi || pi_ref) per token (variants.kl_to_reference)
        m["policy/kl_ref"] = stats["kl_ref"]
    m.update(signal_metrics(raw, adv, reward, group))
    m.update({f"time/{k}": v for k, v in times.items()})
    m["time/step"] = sum(times.values())
    m["throughput/tokens_per_second"] = policy_tokens.sum() / max(times["generate"], 1e-9) / world
    if tools:
        m["response/policy_tokens_mean"] = policy_tokens.mean()
        m.update(tool_metrics(reward, rollouts))
    return {k: float(v) for k, v in m.items()}


def spo_metrics(all_raw_advantage, tracker, divergence, rho, revisit):
    """SPO's own: zero-signal samples (Fig. 3a), the tracker, D(x) and rho (quantiles over revisited prompts)."""
    raw, value, rho, revisit = np.asarray(all_raw_advantage), tracker.value, np.asarray(rho), np.asarray(revisit)
    m = {"zero_signal/abs_adv_le_1e-4": np.mean(np.abs(raw) <= 1e-4),
         "zero_signal/abs_adv_le_0.02": np.mean(np.abs(raw) <= 0.02),
         "tracker/value_mean": value.mean(), "tracker/value_p10": np.quantile(value, 0.1),
         "tracker/value_p50": np.quantile(value, 0.5), "tracker/value_p90": np.quantile(value, 0.9),
         "tracker/n_eff_mean": tracker.n_eff.mean(), "tracker/visits_mean": tracker.visits.mean(),
         "tracker/rho_mean": np.mean(rho), "tracker/divergence_mean": np.mean(divergence),
         "tracker/divergence_max": np.max(divergence), "tracker/revisit_share": np.mean(revisit)}
    if revisit.any():
        again = rho[revisit]
        m.update({"tracker/rho_p10": np.quantile(again, 0.1), "tracker/rho_p50": np.quantile(again, 0.5),
                  "tracker/rho_p90": np.quantile(again, 0.9),
                  "tracker/rho_at_min": np.mean(again <= tracker.rho_min + 1e-12),
                  "tracker/rho_at_max": np.mean(again >= tracker.rho_max - 1e-12),
                  "tracker/divergence_p50": np.quantile(np.asarray(divergence)[revisit], 0.5),
                  "tracker/divergence_revisit_mean": np.mean(np.asarray(divergence)[revisit])})
    return {k: float(v) for k, v in m.items()}


def signal_metrics(all_raw_advantage, all_advantage, all_reward, group, tol=1e-6):
    """How much of the batch carries a learning signal, for every estimator (the paper's Fig. 3)."""
    raw, adv = np.asarray(all_raw_advantage, np.float64), np.asarray(all_advantage, np.float64)
    carries = np.abs(raw) > tol
    m = {"signal/zero_advantage": np.mean(np.abs(adv) <= tol), "signal/adv_var_raw": raw.var(),
         "signal/adv_var_effective": raw[carries].var() if carries.any() else 0.0}
    if group > 1:
        r = np.asarray(all_reward).reshape(-1, group)
        m["zero_signal/degenerate_groups"] = np.mean(r.min(1) == r.max(1))
    return m


def _rows(path):
    """metrics.jsonl's (or samples.jsonl's) rows (one a crash cut off, or without its step: dropped) as (line, row)."""
    try:
        lines = read_file(path).decode("utf-8", errors="replace").split("\n")
    except (OSError, ValueError):  # none yet, or not a file (a FIFO would hang the read)
        return []
    rows = []
    for line in lines:
        with contextlib.suppress(ValueError):
            rows.append((line + "\n", parse_json(line, {"step": int})))
    return rows


def _open_cut(path, resume_step):
    """path for appending, its rows after resume_step (steps a resumed run replays) cut first; and the rows kept."""
    kept = []
    if resume_step is not None and os.path.exists(path):
        kept = [(line, row) for line, row in _rows(path) if row["step"] <= resume_step]
        with atomic_write(path) as f:
            f.writelines(line for line, _ in kept)
    return open(path, "a"), kept


class Logger:
    """Rank 0 logs. resume_step: rows after it (steps that will be replayed) are cut from metrics.jsonl and
    samples.jsonl."""

    def __init__(self, run_dir, config, is_main, report_to=(), resume_step=None):
        self.is_main, self.bar, self.trackers, self.run_dir = is_main, None, [], run_dir
        self.config, self.all_equal_steps = config, 0  # steps whose rewards were all equal, so far
        if not is_main:
            return
        os.makedirs(run_dir, exist_ok=True)
        with atomic_write(os.path.join(run_dir, "config.json")) as f:  # --resume reads it: never half-written
            json.dump(config, f, indent=1)
        self.file, kept = _open_cut(os.path.join(run_dir, "metrics.jsonl"), resume_step)
        self.all_equal_steps = int(sum(row.get("reward/all_equal", 0) for _, row in kept))
        self.samples_file = _open_cut(os.path.join(run_dir, SAMPLES), resume_step)[0]
        self.trackers = open_trackers(run_dir, config, report_to, resume_step)

    def progress(self, iterable, total, initial):
        if not self.is_main:
            return iterable
        from tqdm import tqdm
        self.bar = tqdm(iterable, total=total, initial=initial, desc="train", dynamic_ncols=True)
        return self.bar

    def console(self, message):
        if self.is_main:
            (self.bar.write if self.bar is not None else print)(message)

    def log(self, step, metrics, console=False):
        if not self.is_main:
            return
        if "reward/all_equal" in metrics:
            metrics = {**metrics, "reward/all_equal_steps": self.all_equal_steps + metrics["reward/all_equal"]}
            if metrics["reward/all_equal_steps"] == 1 and not self.all_equal_steps:
                self.console(f"step {step}: every reward of the batch is {metrics['reward/mean']:g} (counted in "
                             f"reward/all_equal_steps; said once). SPO still moves the policy (Eq. 9 scales r - v(x) "
                             f"to unit spread); GRPO-like estimators get no signal")
            self.all_equal_steps = metrics["reward/all_equal_steps"]
        with run_file(self.run_dir, "metrics.jsonl and the trackers' logs"):
            self.file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
            self.file.flush()
            for log in self.trackers:
                log(step, {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if self.bar is not None and "reward/mean" in metrics:
            self.bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}")
        if console or (self.bar is None) or "eval/accuracy" in metrics:
            shown = " ".join(f"{short}={metrics[k]:.4g}" for k, short in self.console_keys().items() if k in metrics)
            self.console(f"step {step}: {shown}")

    def samples(self, step, decode, prompt_ids, rollouts, columns):
        """A few of this step's generations (rank 0's first slots, trackers.sample_rows) in samples.jsonl and to the
        trackers as a table, until the file reaches SAMPLES_MAX_BYTES (said once)."""
        if not self.is_main or self.samples_file.closed:
            return
        rows = sample_rows(step, decode, prompt_ids, rollouts, columns)
        with run_file(self.run_dir, f"{SAMPLES} and the trackers' tables"):
            self.samples_file.writelines(json.dumps(row) + "\n" for row in rows)
            self.samples_file.flush()
            for log in self.trackers:
                log(step, None, rows)
        if self.samples_file.tell() >= SAMPLES_MAX_BYTES:
            self.samples_file.close()
            self.console(f"step {step}: {SAMPLES} reached {SAMPLES_MAX_BYTES >> 20} MiB; no more samples this run")

    def console_keys(self):
        """The console line's columns; kl only with --ppo_steps > 1 (one step starts on-policy: it is 0)."""
        keys = {"reward/mean": "reward", "eval/accuracy": "test_acc", "advantage/std": "adv_std",
                "tracker/value_mean": "value", "tracker/rho_mean": "rho", "tracker/divergence_revisit_mean": "D",
                "policy/entropy": "entropy", "policy/approx_kl": "kl", "policy/logprob_gap_max": "gap",
                "response/length_mean": "len", "response/truncated": "cut", "tools/use_rate": "tool_use",
                "eval/tool_use": "test_tool_use", "time/step": "sec"}
        if self.config.get("ppo_steps", 1) <= 1:
            del keys["policy/approx_kl"]
        return keys

    def close(self):
        if self.is_main:
            if self.bar is not None:
                self.bar.close()
            self.file.close()
            self.samples_file.close()
            for log in self.trackers:
                log(None, None)  # None: close


# The run's plot (plot_run): metrics.jsonl key, panel title; a panel without data is left out (GRPO: no tracker).
RUN_PLOT_PANELS = (("eval/accuracy", "held-out accuracy"), ("reward/mean", "training reward"),
                   ("tracker/value_mean", "tracker: mean value v(x)"), ("tracker/rho_mean", "tracker: mean rho"),
                   ("policy/entropy", "entropy"))


def plot_run(run_dir):
    """run_dir/run.png, a panel per RUN_PLOT_PANELS key: its path, or None (said in one line), never a failure."""
    path = os.path.join(run_dir, "run.png")
    try:
        rows = sorted((row for _, row in _rows(os.path.join(run_dir, "metrics.jsonl"))), key=lambda row: row["step"])
        series = {}  # key -> ([step], [value]), finite numbers only
        for key, _ in RUN_PLOT_PANELS:
            points = [(row["step"], float(row[key])) for row in rows if isinstance(row.get(key), (int, float))
                      and not isinstance(row[key], bool) and np.isfinite(row[key])]
            if points:
                series[key] = tuple(zip(*points))
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg: a PNG, no display
        from matplotlib.figure import Figure
        panels = [(key, title) for key, title in RUN_PLOT_PANELS if key in series]
        cols = min(max(len(panels), 1), 3)
        rows_of_panels = -(-max(len(panels), 1) // cols)
        fig = Figure(figsize=(4.2 * cols, 3.2 * rows_of_panels + 0.4), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(rows_of_panels, cols, squeeze=False).ravel()
        for ax in axes[len(panels):]:
            ax.set_axis_off()  # the grid's empty places (and the message below)
        for ax, (key, title) in zip(axes, panels):
            steps, values = series[key]
            ax.plot(steps, values, marker="o" if key.startswith("eval/") else None, markersize=3, linewidth=1.2)
            ax.set(title=title, xlabel="step")
            ax.grid(alpha=0.3)
        if not panels:
            axes[0].text(0.5, 0.5, "no metrics yet", ha="center", va="center", transform=axes[0].transAxes)
        fig.suptitle(os.path.basename(os.path.normpath(run_dir)))
        fig.savefig(path + ".tmp", format="png", dpi=100)
        os.replace(path + ".tmp", path)  # a reader never sees half a PNG
        return path
    except Exception as e:  # noqa: BLE001 - the plot is a convenience: the run's results are in metrics.jsonl
        print(f"run plot skipped ({type(e).__name__}: {e})", flush=True)
        return None


def run_summary(run_dir, plot, seconds, expected_range=None, test=None):
    """A run's last line: held-out accuracy first and last (beside the README's range), plot, how to evaluate."""
    evals = [row for _, row in _rows(os.path.join(run_dir, "metrics.jsonl")) if "eval/accuracy" in row]
    held_out = " -> ".join(f"{100 * r['eval/accuracy']:.1f}% (step {r['step']})" for r in evals[:1] + evals[1:][-1:])
    if held_out and expected_range:
        held_out += f"; one default run lands in {expected_range[0]}-{expected_range[1]}% (README)"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")  # the one that ran this (a venv's)
    torchrun = os.path.relpath(torchrun) if os.path.exists(torchrun) else "torchrun"
    held_out = held_out or "not measured (--eval_every 0, or no --test)"
    return (f"done, {seconds / 60:.1f} min of training: held-out accuracy {held_out}; run directory "
            f"{run_dir}, plot {plot}; next: {torchrun} --nproc_per_node=2 eval.py --model {run_dir}"
            + (f" --data {os.path.relpath(test)}" if test else ""))
