"""Every committed sweep report under eval/results/ is what `adaptive-spec report` writes today.

A report is built from the sweep's logs alone (no model loads), so a change to the analysis, the
tables or their wording shows up here: rerun `adaptive-spec report --sweep-dir eval/results/<sweep>`
and commit the new report.md with the change that made it.
"""
import shutil
from pathlib import Path

import pytest

from adaptive_spec.evaluation import report

RESULTS = Path(__file__).resolve().parent.parent / "eval" / "results"


def sweep_folders() -> list[Path]:
    """The folders `adaptive-spec report` wrote: a sweep's results and config beside a report.md (the
    benchmark scripts' report.md folders have no config.json)."""
    return sorted(d for d in RESULTS.iterdir()
                  if (d / "report.md").is_file() and (d / "config.json").is_file()
                  and any((d / n).is_file() for n in ("results.jsonl", "results.jsonl.gz")))


def test_the_committed_sweeps_are_found():
    names = {d.name for d in sweep_folders()}
    assert {"sweep_cpu", "sweep_final", "sweep_final_greedy"} <= names, names


@pytest.mark.parametrize("folder", sweep_folders(), ids=lambda d: d.name)
def test_committed_report_regenerates_identically(folder, tmp_path):
    committed = (folder / "report.md").read_text()
    # built without --beside: one built beside another engine's sweep would need that sweep too
    assert "## Engines side by side" not in committed, f"{folder.name}: add its --beside sweep to this test"
    # the same folder name: the report's title is the sweep folder's name
    copy = shutil.copytree(folder, tmp_path / folder.name, ignore=shutil.ignore_patterns("*.png", "report.md"))
    assert report.main(["--sweep-dir", str(copy)]) == 0  # what `adaptive-spec report --sweep-dir` runs
    # compared verbatim: a report holds no timestamp and no absolute path (plots are linked by file name)
    assert (copy / "report.md").read_text() == committed, \
        f"rerun `adaptive-spec report --sweep-dir eval/results/{folder.name}` and commit its report.md"
