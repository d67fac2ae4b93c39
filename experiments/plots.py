"""The plots of a sweep, as PNG files (matplotlib, Agg backend: no display): each plot draws a variant's mean with a
95% t-interval band over its seeds. What each of the five shows: docs/experiments.md ("What a sweep does", Plots).
A plot without data in any run is skipped (named). A single run draws its own plot: run.png (machinery/metrics.py).
"""
import os

import numpy as np

from experiments.analysis import eval_curve, mean_ci

SMOOTH = 10  # steps in the trailing mean of per-step curves (one step is 64 samples: noisy)


def _smooth(y):
    """Trailing mean over SMOOTH steps, NaN-aware (a step without the metric does not count)."""
    out = np.full(len(y), np.nan)
    for i in range(len(y)):
        chunk = y[max(0, i - SMOOTH + 1): i + 1]
        if np.isfinite(chunk).any():
            out[i] = np.nanmean(chunk)
    return out


def step_matrix(runs, key):
    """(steps, (runs, steps) matrix) of a per-step metric over training (step 0 left out), smoothed per run; no step
    logged it: (runs, 0)."""
    steps = sorted({s for run in runs for s, row in run["rows"].items() if s > 0 and key in row})
    return np.array(steps), np.array([_smooth(np.array([run["rows"].get(s, {}).get(key, np.nan) for s in steps],
                                                       np.float64)) for run in runs])


# ------------------------------------------------------------------------------------------------ the plots
def _line(ax, x, matrix, color, label, style="-"):
    """The mean over runs (rows of matrix) and, with 2 runs or more, its 95% t-interval band."""
    mean, low, high = np.array([mean_ci(col)[:3] for col in matrix.T]).reshape(-1, 3).T
    ax.plot(x, mean, style, color=color, label=label, lw=1.5)
    if np.isfinite(low).any():
        ax.fill_between(x, low, high, color=color, alpha=0.15, lw=0)


def plot_accuracy(groups, colors, ax):
    for name, runs in groups.items():
        curves = [eval_curve(run) for run in runs]
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if steps:
            x = np.mean([[c[s][0] for s in steps] for c in curves], axis=0)
            _line(ax, x, np.array([[100 * c[s][1] for s in steps] for c in curves]), colors[name],
                  f"{name} (n={len(runs)})")
    ax.set(xlabel="generated samples", ylabel="held-out accuracy (%)", title="held-out accuracy at equal budget")


def plot_zero_signal(groups, colors, ax):
    for name, runs in groups.items():
        for key, style, what in (("zero_signal/degenerate_groups", "-", "all-equal groups"),
                                 ("zero_signal/abs_adv_le_0.02", "-", "|A| <= 0.02"),
                                 ("zero_signal/abs_adv_le_1e-4", "--", "|A| <= 1e-4")):
            if key.startswith("zero_signal/abs") and any(r["config"].get("baseline") == "none" for r in runs):
                continue  # v = 0: the raw A is r itself, |A| small means r = 0, not "no signal"
            steps, m = step_matrix(runs, key)
            if len(steps):
                _line(ax, steps, 100 * m, colors[name], f"{name}: {what}", style)
    ax.set(xlabel="step", ylabel="samples without signal (%)", title="Fig. 3a: zero-signal samples")


def plot_adv_variance(groups, colors, ax):
    for name, runs in groups.items():
        steps, m = step_matrix(runs, "signal/adv_var_raw")
        if len(steps):
            _line(ax, steps, m, colors[name], f"{name}: raw")
        if any("zero_signal/degenerate_groups" in row for r in runs for row in r["rows"].values()):
            steps, m = step_matrix(runs, "signal/adv_var_effective")
            if len(steps):
                _line(ax, steps, m, colors[name], f"{name}: effective", "--")
    ax.set(xlabel="step", ylabel="variance of the raw advantage", title="Fig. 3b: advantage variance", yscale="log")


def plot_probe(groups, colors, ax_mae, ax_scatter):
    for name, runs in groups.items():
        probed = [r for r in runs if r["probe"]]
        if not probed:
            continue
        steps = sorted(set.intersection(*(set(r["probe"]) for r in probed)))
        for key, style, what in (("probe/mae", "-", "MAE"), ("probe/mae_floor", ":", "noise floor")):
            _line(ax_mae, steps, np.array([[r["probe"][s][key] for s in steps] for r in probed]), colors[name],
                  f"{name}: {what}", style)
        last = [r["probe"][max(r["probe"])] for r in probed]
        ax_scatter.scatter(np.concatenate([p["value"] for p in last]), np.concatenate([p["success"] for p in last]),
                           s=8, alpha=0.5, color=colors[name], label=f"{name} (step {max(probed[0]['probe'])})")
    ax_mae.set(xlabel="step", ylabel="|v(x) - measured success rate|", title="tracker probe: mean absolute error")
    ax_scatter.plot([0, 1], [0, 1], color="grey", lw=0.8)
    ax_scatter.set(xlabel="tracker v(x)", ylabel="measured success rate", title="calibration at the last probe",
                   xlim=(-0.02, 1.02), ylim=(-0.02, 1.02))


def plot_rho(groups, colors, ax_q, ax_clip):
    for name, runs in groups.items():
        steps, p50 = step_matrix(runs, "tracker/rho_p50")
        if not len(steps):
            continue
        (_, p10), (_, p90) = step_matrix(runs, "tracker/rho_p10"), step_matrix(runs, "tracker/rho_p90")
        ax_q.plot(steps, np.nanmean(p50, 0), color=colors[name], label=f"{name}: median", lw=1.5)
        ax_q.fill_between(steps, np.nanmean(p10, 0), np.nanmean(p90, 0), color=colors[name], alpha=0.15, lw=0)
        for key, style in (("tracker/rho_at_min", "-"), ("tracker/rho_at_max", "--")):
            s, m = step_matrix(runs, key)
            _line(ax_clip, s, 100 * m, colors[name], f"{name}: at rho_{key[-3:]}", style)
    ax_q.set(xlabel="step", ylabel="rho (revisited prompts)", title="rho: median and p10-p90")
    ax_clip.set(xlabel="step", ylabel="revisits at the clip bound (%)", title="rho pinned at rho_min / rho_max")


def make_plots(groups, out_dir):
    """groups: {name: [read_run(...), ...]}. Writes the PNGs whose first panel has data into out_dir; returns
    ({plot: path}, [names of the plots skipped for lack of data])."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    palette = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
    colors = {name: palette(i % palette.N) for i, name in enumerate(groups)}
    plots = {"accuracy": (1, plot_accuracy), "zero_signal": (1, plot_zero_signal),
             "adv_variance": (1, plot_adv_variance), "tracker_probe": (2, plot_probe), "rho": (2, plot_rho)}
    written, skipped = {}, []
    for name, (panels, draw) in plots.items():
        fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
        draw(groups, colors, *axes[0])
        if not axes[0][0].has_data():  # no run logged what this plot draws
            plt.close(fig)
            skipped.append(name)
            continue
        for ax in axes[0]:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written[name] = path
    return written, skipped
