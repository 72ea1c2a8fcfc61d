"""Run folders (adaptive_spec.runs), markdown tables (tables) and the one CLI error handler (errors.run_main)."""
import json
import os

import pytest

from adaptive_spec import runs
from adaptive_spec.errors import UserError, run_main
from adaptive_spec.tables import cell, fmt, md_table


def test_torn_last_line_is_repaired(tmp_path):
    p = tmp_path / "results.jsonl"
    p.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b"')  # killed mid-write
    assert runs.read_jsonl(p) == [{"a": 1}, {"a": 2}]
    assert p.read_text().endswith('"b"')  # reading alone leaves the file as it is
    assert runs.read_jsonl(p, repair=True) == [{"a": 1}, {"a": 2}]
    runs.append_jsonl(p, {"a": 4})
    assert runs.read_jsonl(p) == [{"a": 1}, {"a": 2}, {"a": 4}]
    assert runs.read_jsonl(tmp_path / "missing.jsonl") == []


def test_atomic_write_leaves_no_temp_file_and_replaces(tmp_path):
    p = tmp_path / "f.json"
    runs.atomic_write(p, "old")
    runs.write_json(p, {"x": 1})
    assert json.loads(p.read_text()) == {"x": 1} and p.read_text().endswith("\n")
    assert [f.name for f in tmp_path.iterdir()] == ["f.json"]


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    p = tmp_path / "f.json"
    runs.atomic_write(p, b"old")

    def dying_replace(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        runs.atomic_write(p, b"new")
    assert p.read_bytes() == b"old"


def test_read_manifest_has_one_contract(tmp_path):
    with pytest.raises(UserError, match="manifest.json does not exist; run datagen"):
        runs.read_manifest(tmp_path, hint="run datagen")
    assert runs.read_manifest(tmp_path, required=False) is None
    (tmp_path / "manifest.json").write_text("{not json")
    for required in (True, False):  # corrupt is never mistaken for absent
        with pytest.raises(UserError, match="not valid JSON"):
            runs.read_manifest(tmp_path, required=required)
    (tmp_path / "manifest.json").write_text('{"format": "x"}')
    assert runs.read_manifest(tmp_path) == {"format": "x"}


def test_other_settings_are_refused_with_the_difference(tmp_path):
    old = {"seed": 0, "lr": 0.1, "threads": 2}
    runs.check_settings(tmp_path, old, dict(old), fix="unused")  # same: fine
    runs.check_settings(tmp_path, old, {**old, "threads": 4}, fix="unused", ignore=("threads",))
    assert runs.settings_problem(tmp_path, old, dict(old)) is None
    with pytest.raises(UserError) as e:
        runs.check_settings(tmp_path, old, {**old, "seed": 1, "new": True}, fix="use the same config",
                            kind="training run")
    msg = str(e.value)
    assert f"{tmp_path} holds a training run made with other settings" in msg
    assert "new: None -> True" in msg and "seed: 0 -> 1" in msg and msg.endswith("use the same config")
    assert "lr" not in msg


def test_lock_dir_refuses_a_second_holder(tmp_path):
    held = runs.lock_dir(tmp_path, "datagen")
    with pytest.raises(UserError, match=rf"another datagen \(pid {os.getpid()}\)"):
        runs.lock_dir(tmp_path, "datagen")
    held.close()
    runs.lock_dir(tmp_path).close()


def test_project_path(tmp_path):
    assert runs.project_path(tmp_path) == tmp_path
    assert runs.project_path("runs/x") == runs.PROJECT_ROOT / "runs" / "x"


def test_md_table_and_cells():
    t = md_table(["a", "b", "c"], [["x", 1.5, None], ["y", 2.0, float("nan")], ["z", 0.123456, 7]])
    assert t.splitlines() == ["| a | b | c |", "|---|---|---|", "| x | 1.5000 | - |", "| y | 2 | - |",
                              "| z | 0.1235 | 7 |"]
    assert fmt(None) == "—" and fmt(float("nan"), dash="-") == "-" and fmt(1.234, ".1f") == "1.2"
    assert cell(3) == "3" and cell("s") == "s"


def test_run_main_one_line_per_outcome(capsys):
    def user_error(argv):
        raise UserError("bad thing; do this")

    def interrupted(argv):
        raise KeyboardInterrupt

    assert run_main(user_error, []) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: bad thing; do this"]
    assert run_main(interrupted, [], "finished shards are kept; rerun to resume") == 130
    assert capsys.readouterr().err.strip().splitlines() == ["interrupted: finished shards are kept; rerun to resume"]
    assert run_main(lambda argv: None, []) == 0 and run_main(lambda argv: 3, []) == 3


def test_jsonl_committed_compressed_then_appended(tmp_path):
    """A finished log committed as results.jsonl.gz reads as before; appends go to the plain file
    beside it and read after the compressed rows (a resumed sweep on a committed folder)."""
    import gzip

    p = tmp_path / "results.jsonl"
    (tmp_path / "results.jsonl.gz").write_bytes(gzip.compress(b'{"a": 1}\n{"a": 2}\n{"a": 3'))  # torn tail dropped
    assert runs.read_jsonl(p) == [{"a": 1}, {"a": 2}]
    runs.append_jsonl(p, {"a": 5})
    assert runs.read_jsonl(p) == [{"a": 1}, {"a": 2}, {"a": 5}]
