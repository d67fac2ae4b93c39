"""A hub dataset by name (owner/name[:config][@split]) as --train / --test / --data: read from huggingface_hub's
cache of the hub's parquet export, with no network (HF_HUB_OFFLINE=1), or whatever the network says (a loopback
proxy or hub that answers 503, or never: within a deadline); a name that is neither a file nor a cached dataset, a
config or split the dataset lacks, and a config or split that is no plain name ("..") are one line each.

    .venv/bin/python -m pytest tests/test_hub_data.py -q
"""
import contextlib
import http.server
import json
import shutil
import subprocess
import sys
import threading
import time

import pytest

from common import ENV, ROOT, write_parquet

COMMIT = "0123456789abcdef0123456789abcdef01234567"
# load_prompts in a fresh process: huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when it is imported
READ = ("import json, sys; from machinery.data import load_prompts\n"
        "try:\n    p = load_prompts(sys.argv[1])\nexcept (ValueError, FileNotFoundError) as e:\n"
        "    sys.exit(f'error: {e}')\nprint(json.dumps([p.messages, p.answers, p.n_rows]))")


@pytest.fixture
def hub(tmp_path):
    """A cache holding owner/maths's parquet export as the hub lays it out: config default (train in two shards,
    test) and config hard (train), the export's ref naming its snapshot."""
    repo = tmp_path / "hf" / "hub" / "datasets--owner--maths"
    snapshot = repo / "snapshots" / COMMIT
    shards = {("default", "train", "0000"): (["1+1=", "2+2="], ["2", "4"]),
              ("default", "train", "0001"): (["3+3="], ["6"]),
              ("default", "test", "0000"): (["5+5="], ["10"]),
              ("hard", "train", "0000"): (["99+1="], ["100"])}
    for (config, split, shard), (problems, answers) in shards.items():
        (snapshot / config / split).mkdir(parents=True, exist_ok=True)
        write_parquet(snapshot / config / split / f"{shard}.parquet", {"problem": problems, "answer": answers})
    (repo / "refs" / "refs" / "convert").mkdir(parents=True)
    (repo / "refs" / "refs" / "convert" / "parquet").write_text(COMMIT)
    write_parquet(repo / "outside.parquet", {"problem": ["secret="], "answer": ["0"]})  # two levels above the snapshot
    env = {**ENV, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "HF_HUB_OFFLINE": "1"}
    return lambda name, cwd=ROOT, **more: subprocess.run([sys.executable, "-c", READ, name], cwd=cwd,
                                                         env={**env, **more}, capture_output=True, text=True,
                                                         timeout=300)


def _read(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    messages, answers, n_rows = json.loads(proc.stdout)
    return [m[0]["content"] for m in messages], answers, n_rows


@pytest.mark.parametrize("name, problems, answers", [
    ("owner/maths", ["1+1=", "2+2=", "3+3="], ["2", "4", "6"]),  # default config, train split: both shards, in order
    ("owner/maths@test", ["5+5="], ["10"]),
    ("owner/maths:hard", ["99+1="], ["100"]),
    ("owner/maths:hard@train", ["99+1="], ["100"])])
def test_a_cached_hub_dataset_reads_by_name_offline(hub, name, problems, answers):
    assert _read(hub(name)) == (problems, answers, len(problems))


@pytest.mark.parametrize("name, says", [
    ("owner/maths@validation", "error: owner/maths@validation: the dataset owner/maths has no split 'validation' in "
                               "config 'default' (splits there: test, train; name one as owner/maths@SPLIT)"),
    ("owner/maths:hard@test", "error: owner/maths:hard@test: the dataset owner/maths has no split 'test' in config "
                              "'hard' (splits there: train; name one as owner/maths:hard@SPLIT)"),
    ("owner/maths:hardest", "error: owner/maths:hardest: the dataset owner/maths has no config 'hardest' (configs "
                            "there: default, hard; name one as owner/maths:CONFIG)"),
    ("owner/missing", "error: owner/missing: no such file, nor a dataset on the hub or in its cache ("),
    ("data/missing.parquet", "error: data/missing.parquet: no such file")])
def test_a_name_that_is_no_file_and_no_cached_dataset_or_split_is_one_line(hub, name, says):
    proc = hub(name)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(says), proc.stderr[-3000:]


@pytest.mark.parametrize("name, what, part", [("owner/maths:..@..", "config", ".."), ("owner/maths@..", "split", ".."),
                                              ("owner/maths:hard@.", "split", "."), ("owner/maths:.x", "config", ".x")])
def test_a_config_or_split_is_a_plain_name_never_a_path(hub, name, what, part):
    """Names are data: owner/maths:..@.. read the parquet files two levels above the dataset's snapshot."""
    proc = hub(name)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"error: --data {name}: the {what} {part!r} is not a plain name (letters, digits, '_', '.', '-', not first): "
        f"a hub dataset is owner/name[:config][@split]"], proc.stderr[-3000:]


@contextlib.contextmanager
def loopback(status):
    """An HTTP server on 127.0.0.1 that answers every request (a proxy's CONNECT too) with `status`, or never."""
    never = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self):
            if status is None:
                never.wait()
            else:
                self.send_error(status)
        do_GET = do_HEAD = do_POST = do_CONNECT = answer

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        never.set()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("via", ["proxy", "hub"])
@pytest.mark.parametrize("status", [503, None], ids=["answers 503", "never answers"])
def test_a_cached_dataset_is_read_whatever_the_network_says_within_a_deadline(hub, via, status):
    """The cache is read "when the hub cannot be reached": behind a proxy that answered 503 it was not, and behind one
    that never answered the lookup waited for ever. Every request's deadline is HF_HUB_ETAG_TIMEOUT (2 s here)."""
    with loopback(status) as url:
        network = {"HF_HUB_OFFLINE": "0", "HF_HUB_ETAG_TIMEOUT": "2", "NO_PROXY": "", "no_proxy": ""}
        network.update({k: url if via == "proxy" else "" for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY",
                                                                   "http_proxy", "ALL_PROXY", "all_proxy")})
        if via == "hub":
            network["HF_ENDPOINT"] = url
        start = time.monotonic()
        proc = hub("owner/maths:hard", **network)
    assert _read(proc) == (["99+1="], ["100"], 1) and time.monotonic() - start < 120


def test_a_file_named_like_a_dataset_is_read_as_the_file(hub, tmp_path):
    """A local path wins over the hub name it also spells: ./owner/maths is read as a file (and, having no suffix,
    refused as one), never looked up in the cache that holds owner/maths."""
    (tmp_path / "owner").mkdir()
    (tmp_path / "elsewhere").mkdir()
    write_parquet(tmp_path / "owner" / "maths", {"problem": ["7+7="], "answer": ["14"]})
    assert _read(hub("owner/maths", cwd=tmp_path / "elsewhere"))[0] == ["1+1=", "2+2=", "3+3="]  # no such file there
    proc = hub("owner/maths", cwd=tmp_path)
    assert proc.returncode == 1 and "unsupported file type ''" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_eval_reads_a_cached_hub_dataset_and_says_a_missing_split_in_one_line(small_toy, tmp_path):
    """eval.py --data owner/toy@test, the toy's test set cached as a hub export: evaluated under the dataset's name;
    owner/toy@validation is one line before the engine starts."""
    repo = tmp_path / "hf" / "hub" / "datasets--owner--toy"
    (repo / "snapshots" / COMMIT / "default" / "test").mkdir(parents=True)
    shutil.copy(small_toy["test"], repo / "snapshots" / COMMIT / "default" / "test" / "0000.parquet")
    (repo / "refs" / "refs" / "convert").mkdir(parents=True)
    (repo / "refs" / "refs" / "convert" / "parquet").write_text(COMMIT)
    env = {**ENV, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}

    def eval_py(data):
        return subprocess.run([sys.executable, "eval.py", "--model", small_toy["model"], "--data", data, "--n_samples",
                               "2", "--max_tokens", "32", "--out_dir", str(tmp_path / "eval")], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
    proc = eval_py("owner/toy@validation")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: owner/toy@validation: the dataset owner/toy has no split 'validation' in config 'default' (splits "
        "there: test; name one as owner/toy@SPLIT)"], proc.stderr[-3000:]
    proc = eval_py("owner/toy@test")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "eval" / "summary.json").read_text())["results"]
    assert list(results) == ["toy@test"] and results["toy@test"]["problems"] == 40
