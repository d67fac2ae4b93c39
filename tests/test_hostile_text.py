"""Text from outside on the console (machinery/errors.py:shown): an offline-values key, a lock's owner, a run's
file names, a run's config, a failed run's log, printed with their control characters escaped, never raw (an OSC
sequence retitled the terminal, a CSI one cleared it or moved the cursor over the error line).

    .venv/bin/python -m pytest tests/test_hostile_text.py -q
"""
import json
import socket

import pytest

from machinery import run_dir
from machinery.errors import shown

# A title change (OSC), clear screen and cursor up (CSI), a C1 CSI, DEL, a bidi override: fit for a file name
HOSTILE = "\x1b]0;owned\x07\x1b[2J\x1b[1A\x9b1m\x7f\u202e"
ESCAPED = "\\x1b]0;owned\\x07\\x1b[2J\\x1b[1A\\x9b1m\\x7f\\u202e"


def _raw(text):
    """The unprintable characters of console text, its line ends aside."""
    return [c for c in text.replace("\n", "") if not c.isprintable()]


def test_shown_escapes_every_unprintable_character_and_keeps_the_rest():
    assert shown(f"key {HOSTILE}\r\n\t\x00\u200b é 中 \\ 'x'") == f"key {ESCAPED}\\r\\n\\t\\x00\\u200b é 中 \\ 'x'"


def _offline_values_key(tmp_path):
    import offline_values
    from machinery.data import Dataset
    from tracker import ValueTracker
    path = tmp_path / "values.json"
    path.write_text(json.dumps({"header": {}, "prompts": {f"k{HOSTILE}": {"scores": [1, 0]}}}))
    with pytest.raises(SystemExit):
        offline_values.init_tracker_from_file(ValueTracker(1), str(path), Dataset(["k0"], [[1]], ["1"]), "kt", False)


def _lock_owner(tmp_path):
    (tmp_path / "out.lock").write_text(f"{HOSTILE} 1 1\n")  # another host's: live
    print(run_dir.claim_output(str(tmp_path / "out"), "--out", "eval.py"))


def _earlier_files(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / f"{HOSTILE}.samples.jsonl").write_text("")
    assert run_dir.claim_output(str(tmp_path / "out"), "--out_dir", "eval.py", earlier=(".samples.jsonl",)) is None


def _run_config(tmp_path):
    from machinery.untrusted import foreign_values
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "train.parquet").write_text("")
    foreign_values("run", {"train": f"/{HOSTILE}/tasks/built/toy/train.parquet"}, {}, "m", (), str(tmp_path))


def _failed_runs_log(tmp_path):
    from experiments.sweep import error_lines
    (tmp_path / "run.log").write_text(f"error: the model wrote {HOSTILE}\n")
    print(error_lines(str(tmp_path / "run.log"))[-1])


@pytest.mark.parametrize("site", [_offline_values_key, _lock_owner, _earlier_files, _run_config, _failed_runs_log])
def test_text_from_outside_reaches_the_console_escaped(site, tmp_path, capsys):
    site(tmp_path)
    said = capsys.readouterr()
    assert _raw(said.out + said.err) == [] and ESCAPED in said.out + said.err, said
