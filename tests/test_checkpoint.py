"""Checkpoints and run directories (machinery/checkpoint.py): an old checkpoint is refused in one line, one run per
directory and one job at a time, a resume keeps the run's settings and cuts metrics back to the checkpoint, and a
full disk is found before the engine starts. The exact-resume runs are in tests/test_end_to_end.py.

    .venv/bin/python -m pytest tests/test_checkpoint.py -q
"""
import pytest


@pytest.mark.parametrize("keys_field", ["prompt_ids", "prompt_keys"])  # before the renames; before shards
def test_a_checkpoint_from_an_older_spo_is_refused_in_one_line(tmp_path, capsys, keys_field):
    import torch
    from machinery import checkpoint
    step = tmp_path / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_000002")
    torch.save({"step": 2, "world_size": 1, keys_field: ["0123456789abcdef"]}, step / "state.pt")  # no shards/
    with pytest.raises(SystemExit):
        checkpoint.load_checkpoint(str(tmp_path), 1, ["0123456789abcdef"])
    err = capsys.readouterr().err
    assert "older spo.py" in err and str(step / "model") in err and len(err.strip().splitlines()) == 1


# ---- run directories (checkpoint.py): one run per directory, one job at a time
def test_a_fresh_run_refuses_a_directory_that_holds_a_run(tmp_path):
    from machinery import checkpoint
    (tmp_path / "metrics.jsonl").write_text('{"step": 20}\n')
    error = checkpoint.claim_run_dir(str(tmp_path), resume=False, name="spo.py")
    assert "already holds a run (metrics.jsonl)" in error and f"--resume {tmp_path}" in error
    assert not (tmp_path / ".lock").exists()  # refused before anything was written
    assert "no run with checkpoints" in checkpoint.claim_run_dir(str(tmp_path / "new"), resume=True, name="spo.py")


def test_a_live_lock_keeps_a_second_job_out_and_a_stale_one_is_taken_over(tmp_path):
    import os
    import socket
    import subprocess
    from machinery import checkpoint
    run, host = tmp_path / "run", socket.gethostname()
    assert checkpoint.claim_run_dir(str(run), resume=False, name="spo.py") is None
    assert (run / ".lock").read_text().split() == [host, str(os.getpid())]
    with subprocess.Popen(["sleep", "60"]) as live:  # another job, alive
        (run / ".lock").write_text(f"{host} {live.pid}\n")
        error = checkpoint.claim_run_dir(str(run), resume=False, name="spo.py")  # still fresh: no run files yet
        live.kill()
    assert "in use by another job" in error and str(live.pid) in error
    (run / ".lock").write_text("")  # a job between creating its lock and writing it: in use...
    assert "in use by another job (one starting now" in checkpoint.claim_run_dir(str(run), False, "spo.py")
    os.utime(run / ".lock", (0, 0))  # ...unless the empty lock is old
    assert checkpoint.claim_run_dir(str(run), resume=False, name="spo.py") is None
    for pid in (live.pid, os.getpid()):  # gone; ours (a restarted container handed this process a dead job's pid)
        (run / ".lock").write_text(f"{host} {pid}\n")
        assert checkpoint.claim_run_dir(str(run), resume=False, name="spo.py") is None
        assert (run / ".lock").read_text().split() == [host, str(os.getpid())]


def test_resume_keeps_the_runs_settings_and_names_each_changed_one():
    from machinery import checkpoint
    saved = {"lr": 2e-4, "seed": 0, "steps": 20, "algo": "spo", "eval_every": 25}
    settings, errors = checkpoint.resumed_settings(saved, {"steps": 40, "eval_every": 5})
    assert not errors and settings == {**saved, "steps": 40, "eval_every": 5}
    settings, errors = checkpoint.resumed_settings(saved, {"lr": 1e-3, "seed": 0, "algo": "grpo"})
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
    code = ("import torch, torch.distributed as dist\nfrom machinery import checkpoint\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
            "model = torch.nn.Linear(10**6, 10**6, bias=False, device='meta')\n"
            f"checkpoint.check_disk({str(tmp_path)!r}, model, export_bytes_per_parameter=4)\n")
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
    rank, _, device = trainer.setup_distributed()
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


if __name__ == "__main__":  # torchrun tests/test_checkpoint.py WORKER OUT [ARGS...]
    import sys
    globals()[sys.argv[1]](*sys.argv[2:])
