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
