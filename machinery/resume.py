"""The rules of --resume: a run continues with its own settings, and only the flags that change how long it runs,
what it logs or how its work is split may differ (exactness); --resume auto continues --run_dir's run if it has a
checkpoint, so that a restart or a requeue can repeat its first command."""
import argparse
import copy
import os

import torch.distributed as dist

from machinery.checkpoint import checkpoint_dirs, resume_point
from machinery.collectives import all_gather_objects
from machinery.errors import fail
from machinery.untrusted import LOCATIONS, foreign_values, read_config


# Flags that may differ on --resume: they change how long, what is logged, or how work is split, not the result.
RESUME_MAY_CHANGE = {"steps", "resume", "run_dir", "log_every", "eval_every", "save_every", "report_to",
                     "micro_batch_size", "max_tokens_per_micro_batch", "gpu_memory_utilization", "sandbox_workers",
                     "given", "probe_every", "probe_prompts", "probe_samples", "gradient_checkpointing", "fsdp_units",
                     "ignore_memory_estimate", "compile", "eval_reference"}


def resumed_settings(saved, given):
    settings, errors = dict(saved), []
    for flag, value in sorted(given.items()):
        if flag in RESUME_MAY_CHANGE or flag in LOCATIONS or flag not in saved:
            settings[flag] = value
        elif value != saved[flag]:
            errors.append(f"--{flag} {value}: the run being resumed has {saved[flag]}, and --resume continues a run "
                          f"with its own settings (exactness); start a new run to change it")
    return settings, errors


def given_flags(parser, argv):
    """The flags argv typed: argparse has no public way to tell a typed flag from its default."""
    quiet = copy.deepcopy(parser)
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    return sorted(vars(quiet.parse_args(argv)))


def resumed_config(run_dir, given, built_in=(), shipped=""):
    """--resume: the run's settings, checked (resumed_settings, foreign_values, --steps past the checkpoint)."""
    path, error = resume_point(run_dir)  # before the config: "no checkpoint" is the error that says what to do
    if error:
        fail(error, once=True)
    settings, errors = resumed_settings(read_config(run_dir), given)
    settings, foreign = foreign_values(run_dir, settings, given, os.path.join(path, "model"), built_in, shipped)
    errors = foreign + errors
    step = int(os.path.basename(path).removeprefix("step_"))
    if settings["steps"] <= step:
        errors.append(f"--steps {settings['steps']}: the run's latest checkpoint is at step {step}; pass a larger "
                      f"--steps to continue it")
    if errors:
        fail(errors[0] + (f" (and {len(errors) - 1} more: {'; '.join(e.split(':')[0] for e in errors[1:])})"
                          if len(errors) > 1 else ""), once=True)
    return {**settings, "resume": run_dir, "run_dir": run_dir}


def resumed_flags(flags, built_in=(), shipped=""):
    """--resume: the run's own settings over the parsed flags ({flag: value}; only RESUME_MAY_CHANGE's may
    differ), or one line. --resume auto: --run_dir's run resumed if it has a checkpoint (rank 0 looks), else a new
    run there, so that a restart or a requeue can repeat the first command."""
    if flags["resume"] == "auto":
        if not flags["run_dir"]:
            fail("--resume auto resumes the run in --run_dir: give --run_dir", once=True)
        saved = all_gather_objects([bool(checkpoint_dirs(flags["run_dir"])) if dist.get_rank() == 0 else None])[0]
        flags = {**flags, "resume": flags["run_dir"] if saved else None}
    if not flags["resume"]:
        return flags
    given = {f: flags[f] for f in flags["given"]}
    return {**flags, **resumed_config(flags["resume"], given, built_in, shipped), "given": flags["given"]}
