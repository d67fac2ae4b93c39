"""A run directory from elsewhere is data (machinery/checkpoint.py): a checkpoint file crafted to run code when read
(state.pt, DCP's .metadata, the optimiser's settings in the shards) is refused with one line naming it, and its
code never runs; an honest checkpoint still resumes (here, and exactly in tests/test_end_to_end.py).

    .venv/bin/python -m pytest tests/test_checkpoint_untrusted.py -q
"""
import json
import os
import pickle
import shutil

import pytest
import torch

import test_checkpoint
from test_checkpoint import _one_error

saved_run = test_checkpoint.saved_run  # the fixture: a run directory with two real checkpoints

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, on purpose


class Payload:
    """What a crafted pickle holds: unpickling it runs a shell command, here one that creates a marker file."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _forge(run, name, data):
    """run's step-4 checkpoint with its file `name` replaced by data, and the manifest's size to match (as a
    crafted download would have it): the size check passes, only reading can tell."""
    step = run / "checkpoints" / "step_000004"
    (step / name).write_bytes(data)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"][name] = len(data)
    (step / "manifest.json").write_text(json.dumps(manifest))
    return step / name


@pytest.mark.parametrize("name", ["state.pt", "shards/.metadata"])
def test_a_crafted_state_file_or_shard_metadata_is_refused_before_anything_runs(saved_run, tmp_path, capsys, name):
    from machinery import checkpoint
    run, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(saved_run, run)
    if name == "state.pt":
        torch.save({"step": 4, "world_size": 1, "prompt_keys": ["k0", "k1"], "tracker": Payload(marker)},
                   tmp_path / "state.pt")
        data = (tmp_path / "state.pt").read_bytes()
    else:
        data = pickle.dumps(Payload(marker))
    path = _forge(run, name, data)
    err = _one_error(capsys, lambda: checkpoint.load_checkpoint(str(run), 1, ["k0", "k1"]))
    assert err.startswith(f"error: --resume {run}: {path} refused: reading it would call posix.system"), err
    assert not marker.exists()


def _shards(out, lr):
    """A policy (a linear layer), its AdamW after a step, and DCP shards of both, the optimiser's lr replaced by lr
    (DCP pickles such non-tensors into the shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    optim_state["param_groups"][0]["lr"] = lr
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=out)
    return model, optimizer


@pytest.mark.parametrize("part", ["optimiser settings", ".metadata"])
def test_crafted_shards_are_refused_when_loaded(tmp_path, capsys, part):
    """restore_training_state reads DCP's two pickles as data, whatever was checked before."""
    from machinery import checkpoint
    shards, marker = tmp_path / "shards", tmp_path / "ran"
    model, optimizer = _shards(shards, Payload(marker) if part == "optimiser settings" else 1e-3)
    if part == ".metadata":
        (shards / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    err = _one_error(capsys, lambda: checkpoint.restore_training_state(model, optimizer, str(shards)))
    assert err.startswith(f"error: --resume: {shards} refused: reading it would call posix.system"), err
    assert not marker.exists()


def test_honest_shards_restore_the_optimisers_settings(tmp_path):
    from machinery import checkpoint
    _shards(tmp_path / "shards", 0.5)
    model, optimizer = _shards(tmp_path / "other", 1e-3)
    checkpoint.restore_training_state(model, optimizer, str(tmp_path / "shards"))
    assert optimizer.param_groups[0]["lr"] == 0.5


# A header's JSON, of any depth or shape: valid JSON that is not a safetensors header, and JSON too deep to read.
HEADERS = {"a list": b"[1, 2]", "a tensor without offsets": b'{"w": {"dtype": "F32"}}',
           "offsets as strings": b'{"w": {"data_offsets": ["0", "8"]}}',
           "offsets cut short": b'{"w": {"data_offsets": []}}',
           "metadata only, of a list": b'{"__metadata__": [1]}', "too deep to parse": b"[" * 100000 + b"]" * 100000,
           "deep": b'{"w": {"data_offsets": [0, 0], "x": ' + b"[" * 500 + b"]" * 500 + b"}}"}


@pytest.mark.parametrize("header", HEADERS)
def test_a_safetensors_header_of_any_depth_or_shape_names_the_step_and_the_newest_intact_one(saved_run, tmp_path,
                                                                                            capsys, header):
    """JSON from a file, of any depth or shape: a model.safetensors whose header is JSON of another shape was an
    AttributeError or TypeError traceback in --resume and eval.py, and one nested deeply a RecursionError."""
    from machinery import checkpoint, run_dir
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    path = _forge(run, "model/model.safetensors", len(HEADERS[header]).to_bytes(8, "little") + HEADERS[header])
    err = _one_error(capsys, lambda: checkpoint.load_checkpoint(str(run), 1, ["k0", "k1"]))
    assert f"({path}: " in err and "the newest intact one is step_000002" in err, err
    model, _, error = run_dir.checkpoint_model(str(run))  # eval.py's --model
    assert model is None and f"({path}: " in error and error.endswith("--model " + str(path.parent.parent.parent /
                                                                                        "step_000002")), error


@pytest.mark.parametrize("manifest", ['{"files": [1]}', '{"files": {"state.pt": "9"}}', '"files"', "[" * 100000])
def test_a_manifest_of_any_depth_or_shape_is_damage_named_in_one_line(saved_run, tmp_path, capsys, manifest):
    """JSON from a file, of any depth or shape: the manifest that --resume and eval.py check first."""
    from machinery import checkpoint
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    (run / "checkpoints" / "step_000004" / "manifest.json").write_text(manifest)
    err = _one_error(capsys, lambda: checkpoint.load_checkpoint(str(run), 1, ["k0", "k1"]))
    assert "manifest.json: unreadable (" in err and "the newest intact one is step_000002" in err, err
