"""On TensorBoard (and wandb, trackio if installed): what --report_to shows live, metrics.jsonl's scalars and a few
generations a step as a table, one history across --resume; and samples.jsonl, those generations kept in the run
dir, for reading what the scalars hide (format errors, truncation, reward hacking; TRL's log_completions)."""
import argparse
import contextlib
import importlib.util
import json
import os
import uuid

from machinery.errors import fail
from machinery.untrusted import read_file

# --report_to's trackers, each in its own viewer (module = pip package)
TRACKERS = ("tensorboard", "trackio", "wandb")
TRACKER_IDS = "tracker_ids.json"  # a resumed run continues the same wandb / trackio run: the ids it was given
SAMPLES = "samples.jsonl"
SAMPLES_PER_STEP = 4  # rank 0's first slots: enough to read a step, few enough for a 10,000-step run
SAMPLE_CHARS = 2000  # a prompt's or response's text is cut here (its start kept) ...
SAMPLES_MAX_BYTES = 64 * 2 ** 20  # ... and the file stops growing here, said once: bounded whatever the run
SAMPLE_COLUMNS = ("step", "prompt", "response", "truncated", "reward", "advantage", "value", "rho", "divergence")


def check_trackers(names, run_dir=None):
    """Each tracker --report_to names is installed, before anything heavy (else one line naming the pip command);
    with a run directory (--resume's), TensorBoard's folder there is a folder."""
    for name in names:
        if name != "none" and importlib.util.find_spec(name) is None:
            fail(f"--report_to {name}: {name} is not installed; pip install {name}", once=True)
    board = os.path.join(run_dir or "", "tensorboard")
    if run_dir and "tensorboard" in names and os.path.lexists(board) and not os.path.isdir(board):
        fail(f"--report_to tensorboard: {board} is not a directory (TensorBoard writes its events there); move it "
             f"aside and resume again", once=True)


class _ReportTo(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        check_trackers(values)  # at parse time: before the engine or the model loads
        setattr(namespace, self.dest, values)


def add_logging_flags(p):
    p.add_argument("--report_to", nargs="+", choices=("none", *TRACKERS), default=["none"], action=_ReportTo,
                   help="trackers shown metrics.jsonl's scalars and samples live (wandb, trackio: project "
                        "$WANDB_PROJECT)")
    p.add_argument("--log_every", type=int, default=10, help=argparse.SUPPRESS)  # the console line every N steps


def tracker_ids(run_dir, resumed):
    """The run's ids in run_dir/tracker_ids.json: kept on --resume, new otherwise (written whole, never half)."""
    path = os.path.join(run_dir, TRACKER_IDS)
    with contextlib.suppress(OSError, ValueError):
        ids = json.loads(read_file(path)) if resumed else None
        if isinstance(ids, dict) and all(isinstance(ids.get(k), str) and ids[k].isalnum() for k in TRACKERS):
            return ids
    ids = {name: uuid.uuid4().hex[:16] for name in TRACKERS}
    with open(path + ".tmp", "w") as f:
        json.dump(ids, f)
    os.replace(path + ".tmp", path)
    return ids


def sample_rows(step, decode, prompt_ids, rollouts, columns, n=SAMPLES_PER_STEP):
    """The first n slots as samples.jsonl rows: prompt and response text (each cut to SAMPLE_CHARS), whether the
    response hit its budget, and columns' per-slot numbers (reward, advantage; SPO's value, rho, divergence)."""
    return [{"step": step, "prompt": decode(ids)[:SAMPLE_CHARS], "response": r.text[:SAMPLE_CHARS],
             "truncated": r.finish_reason == "length", **{k: float(v[j]) for k, v in columns.items()}}
            for j, (ids, r) in enumerate(zip(prompt_ids[:n], rollouts[:n]))]


def _markdown(rows):
    """rows as one markdown table (TensorBoard's text panel): | and line breaks kept out of the cells' way."""
    def cell(v):
        return str(v).replace("|", "\\|").replace("\n", "<br>") if not isinstance(v, float) else f"{v:.4g}"
    columns = [c for c in SAMPLE_COLUMNS if c in rows[0]]
    return "\n".join([" | ".join(columns), " | ".join("---" for _ in columns),
                      *(" | ".join(cell(row[c]) for c in columns) for row in rows)])


def _tensorboard(run_dir, resume_step):
    from torch.utils.tensorboard import SummaryWriter
    # purge_step: a reader drops the events a killed run logged past its checkpoint, which the resumed run replays
    writer = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=None if resume_step is None
                           else resume_step + 1)

    def log(step, scalars, samples=None):
        if scalars is None and samples is None:
            return writer.close()
        for key, value in (scalars or {}).items():
            writer.add_scalar(key, value, step)
        if samples:
            writer.add_text("samples", _markdown(samples), step)
        writer.flush()  # live, and a killed run keeps what it logged
    return log


def _table_logger(run, finish, table):
    """wandb's or trackio's log: the scalars as they are, samples as its Table (the same call in both)."""
    def log(step, scalars, samples=None):
        if scalars is None and samples is None:
            return finish()
        if samples:
            columns = [c for c in SAMPLE_COLUMNS if c in samples[0]]
            scalars = {**(scalars or {}), "samples": table(columns=columns,
                                                            data=[[row[c] for c in columns] for row in samples])}
        run.log(scalars, step=step)
    return log


def open_trackers(run_dir, config, report_to, resume_step):
    """One log(step, scalars, samples=None) per tracker (log(None, None) closes it); a resumed run continues its own
    history: TensorBoard drops the events past the checkpoint (purge_step), wandb and trackio resume their run by
    its id."""
    names = [n for n in (report_to or ()) if n != "none"]
    check_trackers(names, run_dir)  # (spo.py's start checked them already: --resume's come from config.json)
    ids, logs = tracker_ids(run_dir, resume_step is not None) if names else {}, []
    project = os.environ.get("WANDB_PROJECT", "spo")  # wandb's own variable; trackio shares it
    if "tensorboard" in names:
        logs.append(_tensorboard(run_dir, resume_step))
    if "wandb" in names:
        import wandb
        run = wandb.init(project=project, id=ids["wandb"], resume="allow", config=config, dir=run_dir)
        logs.append(_table_logger(run, run.finish, wandb.Table))
    if "trackio" in names:
        import trackio
        trackio.init(project=project, name=ids["trackio"], resume="allow", config=config)
        logs.append(_table_logger(trackio, trackio.finish, trackio.Table))
    return logs
