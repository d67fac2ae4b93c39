"""Checkpoints and run directories (machinery/checkpoint.py): a damaged checkpoint (a file cut off or missing, the
manifest included) is named with the newest intact one before anything reads it, one run per directory and one
job at a time, a run that saved no checkpoint leaves a directory a fresh run takes over, a resume keeps the run's
settings and cuts metrics back to the checkpoint, and a full disk is found before the engine starts (and, met while
writing a checkpoint, is one line that keeps the previous one). The exact-resume runs are in tests/test_end_to_end.py;
crafted checkpoint files in tests/test_checkpoint_untrusted.py.

    .venv/bin/python -m pytest tests/test_checkpoint.py -q
"""
import pytest

from machinery import run_dir
from machinery import device as devices
from machinery import logprob_head


# ---- damaged checkpoints: named, with the newest intact one, before anything heavy reads them
@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run directory with two real checkpoints (steps 2 and 4, written by save_checkpoint in a world of one):
    DCP shards, the HF export, state.pt, manifest.json."""
    from common import ENV, ROOT, ok
    import subprocess
    import sys
    run = tmp_path_factory.mktemp("saved") / "run"
    ok(subprocess.run([sys.executable, "tests/test_checkpoint.py", "checkpoint_worker", str(run)], cwd=ROOT, env=ENV,
                      capture_output=True, text=True, timeout=600))
    return run


def run_state():
    """The run's own state the worker saves: numpy arrays of the dtypes a run keeps, and a numpy RNG's state."""
    import numpy as np
    return {"tracker": {"alpha": np.array([1.5, 2.0]), "visits": np.array([3, 0])},
            "sampler": {"rng_state": np.random.default_rng(7).bit_generator.state},
            "previous": {1: {"response_ids": np.array([5, 6], np.int32), "logprobs": np.array([-0.5, -1.0], np.float32),
                             "mask": np.array([1, 0], np.int8)}}}


def checkpoint_worker(run, full=None):
    """Run by the fixture above: a tiny policy, checkpointed at steps 2 and 4 (full: on a disk that fills up while
    writing the file whose name ends so, `_fill_disk`)."""
    import os
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from machinery import checkpoint, trainer
    from tasks import toy
    _, world, device = devices.setup_distributed()
    state = run_state()
    initial = os.path.join(run, "initial")
    tokenizer = toy.build_tokenizer(initial)
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)).save_pretrained(initial)
    model, optimizer = trainer.build_policy(initial, device, lr=1e-3, weight_decay=0.0)
    for step in (2, 4):
        # Adam moments in the optimiser state (the policy's forward is its log-probs: the decoder on packed rows)
        logprob_head.token_logprobs(model, torch.tensor([[1, 2, 3]]), torch.ones(1, 2), 1.0)[0].sum().backward()
        optimizer.step()
        if full and step == 4:
            (_out_of_inodes_at_the_tokenizer if full == "inodes" else _fill_disk)(full, tokenizer, run)
        checkpoint.save_checkpoint(run, step, model, optimizer, tokenizer, world, ["k0", "k1"], state["tracker"],
                                   state["sampler"], state["previous"], {"steps": 8})
    torch.distributed.destroy_process_group()


def _out_of_inodes_at_the_tokenizer(_, tokenizer, run):
    """From the tokenizer's own files on (its Rust part writes tokenizer.json), the file system under run (a small
    tmpfs: tests/test_resume_moved.py) has no inode left: empty files fill it first."""
    import itertools
    import os
    real = tokenizer._save_pretrained

    def save(*args, **kwargs):
        with __import__("contextlib").suppress(OSError):
            for k in itertools.count():
                open(os.path.join(os.path.dirname(run), f"filler_{k}"), "w").close()
        return real(*args, **kwargs)
    tokenizer._save_pretrained = save


def _fill_disk(name_end, *_):
    """From now on, writing a file whose name ends with name_end fails as on a full disk: ENOSPC from its writes, or
    for the export's safetensors (written by safetensors' Rust code) the error safetensors raises on a full tmpfs."""
    import builtins
    import errno
    import io
    import os
    import safetensors.torch
    if name_end.endswith(".safetensors"):
        def save_file(*args, **kwargs):
            raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os "
                                              "error 28)")
        safetensors.torch.save_file = save_file
        return

    class Full(io.FileIO):
        def write(self, b):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real = io.open

    def full_open(file, mode="r", *args, **kwargs):  # builtins' open, and pathlib's (DCP's shards)
        if "w" not in mode or not str(file).endswith(name_end):
            return real(file, mode, *args, **kwargs)
        return Full(file, "w") if "b" in mode else io.TextIOWrapper(io.BufferedWriter(Full(file, "w")))
    builtins.open = io.open = full_open


def _damage(run, how):
    """A copy of the run whose step-4 checkpoint is damaged `how`; the damaged file."""
    import shutil
    step = run / "checkpoints" / "step_000004"
    target = {"shard": step / "shards" / "__0_0.distcp", "export": step / "model" / "model.safetensors",
              "state": step / "state.pt", "shards/": step / "shards", "manifest": step / "manifest.json"}[how]
    if how == "shards/":
        shutil.rmtree(target)
    else:
        with open(target, "r+b") as f:
            f.truncate(target.stat().st_size // 2)
    return target


def _one_error(capsys, call):
    with pytest.raises(SystemExit):
        call()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("how", ["shard", "export", "state", "shards/", "manifest"])
def test_a_damaged_checkpoint_is_named_with_the_newest_intact_one(saved_run, tmp_path, capsys, how):
    """A cut-off DCP shard or HF export, a deleted shards/ or manifest: one line names the damaged file and the
    checkpoint to resume from; deleting the damaged one, as it says, resumes from that one."""
    import shutil
    from machinery import checkpoint
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    damaged = _damage(run, how)
    err = _one_error(capsys, lambda: checkpoint.load_checkpoint(str(run), 1, ["k0", "k1"]))
    assert str(damaged) in err, err
    assert f"the newest intact one is step_000002: delete {run / 'checkpoints' / 'step_000004'}" in err
    shutil.rmtree(run / "checkpoints" / "step_000004")  # what the line says; `latest` still names it
    state = checkpoint.load_checkpoint(str(run), 1, ["k0", "k1"])
    assert state["step"] == 2 and state["shards"] == str(run / "checkpoints" / "step_000002" / "shards")


def test_the_runs_own_state_comes_back_as_it_was_saved(saved_run):
    """state.pt holds tensors (read with weights_only): numpy arrays come back as numpy, each with its dtype, and the
    RNG's state whole."""
    import numpy as np
    from machinery import checkpoint

    def plain(x):
        return ({k: plain(v) for k, v in x.items()} if isinstance(x, dict) else
                (x.dtype, x.tolist()) if isinstance(x, np.ndarray) else x)
    state = checkpoint.load_checkpoint(str(saved_run), 1, ["k0", "k1"])
    assert {k: plain(state[k]) for k in run_state()} == plain(run_state())


@pytest.mark.parametrize("name_end", [".distcp", "model.safetensors", "state.pt", "manifest.json"])
def test_a_full_disk_while_writing_a_checkpoint_is_one_line_and_the_previous_one_is_kept(tmp_path, name_end):
    """A disk that fills up in the shards (DCP), the export (safetensors), the state file or the manifest: one
    line says the disk is full, the partial directory is gone, and the previous checkpoint is resumed from."""
    import subprocess
    import sys
    from common import ENV, ROOT
    from machinery import checkpoint
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "tests/test_checkpoint.py", "checkpoint_worker", str(run), name_end],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("error: disk full (No space left on device) while writing checkpoint step 4 to ")
    assert "the previous checkpoint (step_000002) is intact" in errors[0], errors[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000002"]
    assert checkpoint.load_checkpoint(str(run), 1, ["k0", "k1"])["step"] == 2


def test_resume_removes_and_names_a_checkpoint_whose_writing_did_not_finish(saved_run, tmp_path, capsys):
    """A save killed mid-write leaves step_N.tmp holding its space: --resume removes it and says so."""
    import shutil
    from machinery import checkpoint
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    (run / "checkpoints" / "step_000006.tmp" / "shards").mkdir(parents=True)
    assert checkpoint.load_checkpoint(str(run), 1, ["k0", "k1"])["step"] == 4
    assert not (run / "checkpoints" / "step_000006.tmp").exists()
    assert f"--resume {run}: removed step_000006.tmp" in capsys.readouterr().out


def test_the_manifest_lists_every_file_of_the_checkpoint_with_its_size(saved_run):
    import json
    step = saved_run / "checkpoints" / "step_000004"
    written = json.loads((step / "manifest.json").read_text())["files"]
    on_disk = {str(f.relative_to(step)): f.stat().st_size for f in step.rglob("*") if f.is_file()}
    assert written == {name: size for name, size in on_disk.items() if name != "manifest.json"}
    assert {"state.pt", "shards/.metadata", "model/model.safetensors", "model/config.json"} <= set(written)


# ---- run directories (checkpoint.py): one run per directory, one job at a time
def test_a_fresh_run_refuses_a_directory_that_holds_a_run(tmp_path):
    (tmp_path / "checkpoints" / "step_000020").mkdir(parents=True)
    error = run_dir.claim_run_dir(str(tmp_path), resume=False, name="spo.py")
    assert "already holds a run" in error and "step_000020" in error and f"--resume {tmp_path}" in error
    assert not (tmp_path / ".lock").exists()  # refused before anything was written
    assert "no checkpoint there" in run_dir.claim_run_dir(str(tmp_path / "new"), resume=True, name="spo.py")


RUN_DIRS = {  # what a directory holds -> its files
    "made by the user": {}, "the user's notes": {"notes.txt": "mine"},
    "died before its first step": {"config.json": "{}", "metrics.jsonl": ""},
    "died after logging, before its first checkpoint": {"config.json": "{}", "metrics.jsonl": '{"step": 0}\n',
                                                        "probe.jsonl": "{}\n"},
    "killed while writing its first checkpoint": {"config.json": "{}", "metrics.jsonl": '{"step": 1}\n',
                                                  "checkpoints/step_000002.tmp/state.pt": ""},
    "with checkpoints": None}  # saved_run's


def _make(run, holds, saved_run=None):
    import shutil
    if RUN_DIRS[holds] is None:
        return shutil.copytree(saved_run, run)
    for name, text in RUN_DIRS[holds].items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    return run


@pytest.mark.parametrize("holds", list(RUN_DIRS))
def test_a_run_directory_always_has_a_way_out(tmp_path, saved_run, holds):
    """A run that failed before its first checkpoint left config.json and metrics.jsonl: a fresh run there said
    "continue it with --resume", and --resume said "no run with checkpoints there" (or, killed during its first
    checkpoint, "no complete checkpoint found"). Now a refusal of either names the other, and the other is
    accepted. --resume is refused by resumed_config (resume_point) first, then by claim_run_dir."""
    from machinery import checkpoint

    def refusal(run, resume):
        return ((resume and checkpoint.resume_point(str(run))[1])
                or run_dir.claim_run_dir(str(run), resume=resume, name="spo.py"))
    for resume, way_out in ((False, "continue it with --resume"), (True, "start it afresh with --run_dir")):
        run = _make(tmp_path / str(resume), holds, saved_run)
        error = refusal(run, resume)
        if error:
            assert way_out in error, error
            assert refusal(run, not resume) is None


def test_a_fresh_run_takes_over_a_run_that_saved_no_checkpoint_and_keeps_its_files(tmp_path, capsys):
    _make(tmp_path, "killed while writing its first checkpoint")
    (tmp_path / "notes.txt").write_text("mine")
    assert run_dir.claim_run_dir(str(tmp_path), resume=False, name="spo.py") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "earlier_attempt_1", "notes.txt"]
    aside = tmp_path / "earlier_attempt_1"
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n' and (aside / "checkpoints").is_dir()
    assert f"moved to {aside}" in capsys.readouterr().out


def test_a_live_lock_keeps_a_second_job_out_and_a_stale_one_is_taken_over(tmp_path):
    import os
    import socket
    import subprocess
    run, host = tmp_path / "run", socket.gethostname()
    assert run_dir.claim_run_dir(str(run), resume=False, name="spo.py") is None
    assert (run / ".lock").read_text().split()[:2] == [host, str(os.getpid())]
    with subprocess.Popen(["sleep", "60"]) as live:  # another job, alive
        (run / ".lock").write_text(f"{host} {live.pid}\n")
        error = run_dir.claim_run_dir(str(run), resume=False, name="spo.py")  # still fresh: no run files yet
        live.kill()
    assert "in use by another job" in error and str(live.pid) in error
    (run / ".lock").write_text("")  # a job between creating its lock and writing it: in use...
    assert "in use by another job (one starting now" in run_dir.claim_run_dir(str(run), False, "spo.py")
    os.utime(run / ".lock", (0, 0))  # ...unless the empty lock is old
    assert run_dir.claim_run_dir(str(run), resume=False, name="spo.py") is None
    for pid in (live.pid, os.getpid()):  # gone; ours (a restarted container handed this process a dead job's pid)
        (run / ".lock").write_text(f"{host} {pid}\n")
        assert run_dir.claim_run_dir(str(run), resume=False, name="spo.py") is None
        assert (run / ".lock").read_text().split()[:2] == [host, str(os.getpid())]


def test_resume_keeps_the_runs_settings_and_names_each_changed_one():
    from machinery import resume
    saved = {"lr": 2e-4, "seed": 0, "steps": 20, "algo": "spo", "eval_every": 25}
    settings, errors = resume.resumed_settings(saved, {"steps": 40, "eval_every": 5})
    assert not errors and settings == {**saved, "steps": 40, "eval_every": 5}
    settings, errors = resume.resumed_settings(saved, {"lr": 1e-3, "seed": 0, "algo": "grpo"})
    assert len(errors) == 2 and settings["lr"] == 2e-4
    assert errors[0].startswith("--algo grpo: the run being resumed has spo")
    assert errors[1].startswith("--lr 0.001: the run being resumed has 0.0002")


def test_metrics_are_cut_back_to_the_checkpoint_on_resume(tmp_path):
    import json
    from machinery.metrics import Logger
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(7)))
    Logger(str(tmp_path), {}, True, resume_step=4).close()
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    # a crash mid-write (the reason to resume) leaves a row cut off, or a last row without its newline
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "rew\n{"step": 3}')
    logger = Logger(str(tmp_path), {}, True, resume_step=3)
    logger.log(4, {"reward/mean": 0.5})
    logger.close()
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [0, 1, 3, 4]


def test_no_room_for_a_checkpoint_is_found_before_the_engine_starts(tmp_path):
    """check_disk estimates a checkpoint from the parameter count (fp32 weights, Adam moments, the export): a
    model of 10^12 parameters (on the meta device: no memory) needs 14.5 TiB, which this disk does not have."""
    import subprocess
    import sys
    from common import ENV, ROOT
    code = ("import torch, torch.distributed as dist\nfrom machinery import run_dir\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
            "model = torch.nn.Linear(10**6, 10**6, bias=False, device='meta')\n"
            f"run_dir.check_disk({str(tmp_path)!r}, model, export_bytes_per_parameter=4)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith(f"error: --run_dir {tmp_path}:")
    assert "a checkpoint needs about 14901.2 GiB" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_the_hf_export_is_written_file_by_file_and_loads_as_the_trained_weights(tmp_path, tied):
    """machinery/checkpoint.py:export_hf on 2 ranks (FSDP2, per-layer units, shards changed after loading): in one
    file, byte for byte what the old export wrote (save_file of the full state dict, a tied output projection once);
    in files of at most 20 kB (a tensor larger than that alone in its file) with an index, transformers loads
    exactly the trained weights; in bf16, the trained weights rounded to bf16."""
    from common import ok, torchrun
    ok(torchrun(2, "tests/test_checkpoint.py", "export_worker", str(tmp_path), str(tied)))
    assert (tmp_path / "ok").exists()


def export_worker(out, tied):
    """Run under torchrun by the test above."""
    import json
    import os
    import torch
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from machinery import checkpoint, trainer
    from common import end_worker
    rank, _, device = devices.setup_distributed()
    config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied == "True")
    path = os.path.join(out, "initial")
    if rank == 0:
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).save_pretrained(path)
    torch.distributed.barrier()
    model, _ = trainer.build_policy(path, device, lr=1e-3, weight_decay=0.0, layer_units=True)
    with torch.no_grad():  # "trained": every shard moved, so the export cannot be the file it was loaded from
        for p in model.parameters():
            p.to_local().add_(0.01 * (rank + 1))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    one, many, half = (os.path.join(out, name) for name in ("one", "many", "half"))
    for d in (one, many, half):
        os.makedirs(d, exist_ok=True)
    assert checkpoint.export_hf(model, one) is None
    assert checkpoint.export_hf(model, many, file_bytes=20_000) is None
    assert checkpoint.export_hf(model, half, torch.bfloat16) is None
    if rank == 0:
        if config.tie_word_embeddings:  # what the old export did: the full state dict, a tied projection once
            full.pop("lm_head.weight")
        save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(out, "old.safetensors"),
                  metadata={"format": "pt"})
        assert os.listdir(one) == ["model.safetensors"]
        with open(os.path.join(one, "model.safetensors"), "rb") as a, open(os.path.join(out, "old.safetensors"),
                                                                          "rb") as b:
            assert a.read() == b.read()
        files = sorted(f for f in os.listdir(many) if f.endswith(".safetensors"))
        assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        for f in files:
            tensors = load_file(os.path.join(many, f))
            assert len(tensors) == 1 or sum(t.numel() * 4 for t in tensors.values()) <= 20_000
        with open(os.path.join(many, "model.safetensors.index.json")) as f:
            assert sorted(json.load(f)["weight_map"]) == sorted(full)
        config.save_pretrained(many)
        loaded = AutoModelForCausalLM.from_pretrained(many, dtype=torch.float32).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in full.items())
        halves = load_file(os.path.join(half, "model.safetensors"))
        assert sorted(halves) == sorted(full)
        assert all(v.dtype == torch.bfloat16 and torch.equal(v, full[k].to(torch.bfloat16)) for k, v in halves.items())
        open(os.path.join(out, "ok"), "w").close()
    end_worker()


if __name__ == "__main__":  # [torchrun] tests/test_checkpoint.py WORKER OUT [ARGS...]
    import sys
    globals()[sys.argv[1]](*sys.argv[2:])


@pytest.mark.parametrize("content", ["[1, 2]", '"spo"', '{"lr": 0.1}', '{"steps": true}', "[" * 100000,
                                     '{"steps": 4, "lr": ' + "[" * 500 + "]" * 500 + "}"])
def test_a_config_that_parses_but_is_not_a_runs_is_one_line(tmp_path, capsys, content):
    """JSON from a file, of any depth or shape: a config.json that is a list (or lacks the run's steps) was a
    traceback on --resume, and one nested deeply a RecursionError."""
    from machinery.untrusted import read_config
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(SystemExit):
        read_config(str(tmp_path))
    err = capsys.readouterr().err
    assert err.startswith(f"error: --resume {tmp_path}: its config.json is not a run's configuration")
    assert len(err.strip().splitlines()) == 1
