"""The built-in toys (tasks/toy.py): the shipped toys are the bytes their SHA256SUMS name and loading checks them, a
build is deterministic for a seed, in the verl schema, and a tool trace keeps the interpreter text out of the loss.

    .venv/bin/python -m pytest tests/test_toy.py -q
"""
import os
import shutil

import pyarrow.parquet as pq
import pytest

from common import ROOT, one_thread, python
from machinery.data import load_prompts


@pytest.mark.slow
def test_toy_is_deterministic_and_in_the_verl_schema(small_toy, tmp_path):
    from tasks import toy
    with one_thread():  # as conftest.small_toy was built
        toy.build_toy(str(tmp_path / "again"), seed=0, n_train=200, n_test=40, steps=150)
    dirs = (os.path.dirname(small_toy["model"]), tmp_path / "again")
    same = [open(f"{d}/model/model.safetensors", "rb").read() for d in dirs]
    if same[0] != same[1]:  # say how far apart they are (a flake was seen once, not reproduced in 8 rebuilds)
        from safetensors.torch import load_file
        a, b = (load_file(f"{d}/model/model.safetensors") for d in dirs)
        diff = {k: (a[k] - b[k]).abs().max().item() for k in a if a[k].shape == b[k].shape}
        pytest.fail(f"rebuilt toy differs: tensors {sorted(set(a) ^ set(b))} unmatched, max |diff| "
                    f"{max(diff.values(), default=None)} in {max(diff, key=diff.get, default=None)}")
    table = pq.read_table(small_toy["train"])
    assert {"prompt", "reward_model"} <= set(table.column_names)
    assert load_prompts(small_toy["train"]).n_rows == 200


def test_a_tool_trace_keeps_the_interpreter_text_out_of_the_loss():
    """The tool toy's warm start (recipe at 2d63bad) trained on such traces: the interpreter's output is context."""
    from transformers import AutoTokenizer
    from tasks import toy
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(toy.default_toy_dir(tools=True), "model"))
    trace = [("<code>\n```python\nprint(12*34)\n```\n</code>", True), ("<interpreter>\n408\n</interpreter>\n\n", False),
             *toy.boxed(408)]
    ids, mask = toy.encode_segments(tokenizer, ["12*34="], [trace])
    text = tokenizer.decode(ids[0][mask[0] == 0])
    assert "<interpreter>\n408\n</interpreter>\n\n" in text and "print(12*34)" not in text
    assert tokenizer.decode(ids[0][mask[0] == 1]) == "<code>\n```python\nprint(12*34)\n```\n</code>\\boxed{408}" \
        + tokenizer.eos_token


@pytest.mark.parametrize("tools", [False, True])
def test_the_shipped_toy_is_the_bytes_its_checksums_name(tools):
    """Every file of a shipped toy is listed (model, tokenizer, data, toy.json) and matches its SHA-256."""
    from tasks import toy
    toy_dir = toy.default_toy_dir(tools)
    with open(os.path.join(toy_dir, toy.CHECKSUMS)) as f:
        listed = {line.split("  ", 1)[1].strip() for line in f}
    on_disk = {os.path.relpath(os.path.join(d, n), toy_dir) for d, _, names in os.walk(toy_dir) for n in names
               if n != toy.CHECKSUMS}
    on_disk = {n for n in on_disk if not n.startswith("offline_values_") or n in listed}  # (cached ones: not shipped)
    assert listed == on_disk and {"model/model.safetensors", "train.parquet", "test.parquet", "toy.json"} <= listed
    assert toy.checksum_error(toy_dir, tools) is None
    assert toy.ensure_toy(tools=tools)[0] == os.path.join(toy_dir, "model")


@pytest.mark.parametrize("damage", ["flip a byte", "remove"])
def test_a_damaged_toy_stops_spo_with_one_line(damage, tmp_path):
    """spo.py checks the toy's bytes before anything heavy starts: one line naming the file and how to restore it."""
    from tasks import toy
    copy = tmp_path / "toy"
    shutil.copytree(toy.default_toy_dir(), copy, ignore=shutil.ignore_patterns("offline_values_*"))
    weights = copy / "model" / "model.safetensors"
    if damage == "remove":
        weights.unlink()
    else:
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 1
        weights.write_bytes(bytes(data))
    proc = python("spo.py", "--toy_dir", str(copy), "--run_dir", str(tmp_path / "run"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: {weights}: {'missing' if damage == 'remove' else 'checksum mismatch'}")
    assert f"python -m tasks.toy --toy_dir {os.path.relpath(copy, ROOT)}" in lines[0]


def test_a_damaged_tool_toy_is_restored_from_git_not_rebuilt(tmp_path):
    """The tool toy's recipe is not in the tree (it ships built): its one line names git, not a rebuild."""
    from tasks import toy
    copy = tmp_path / "toy_tools"
    shutil.copytree(toy.default_toy_dir(tools=True), copy)
    (copy / "toy.json").write_text("{}")
    error = toy.checksum_error(str(copy), tools=True)
    assert error.startswith(f"{copy / 'toy.json'}: checksum mismatch") and "git checkout" in error
    assert "rebuild" not in error and "rebuild" in toy.checksum_error(str(copy))


def test_the_range_the_last_line_shows_is_the_readmes():
    """spo.py's last line puts a default run's held-out accuracy beside toy.DEFAULT_RUN_RANGE: the README's range."""
    import os
    from common import ROOT
    from tasks import toy
    low, high = toy.DEFAULT_RUN_RANGE
    assert f"one run falls in **[{low}, {high}]**" in open(os.path.join(ROOT, "README.md")).read()
