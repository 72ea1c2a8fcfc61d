"""Every committed sweep report under eval/results/ is what `adaptive-spec report` writes today, and every
committed paired-benchmark report (a folder with run.json) is what its script's --report-only writes today.

A report is built from the sweep's logs alone (no model loads), so a change to the analysis, the
tables or their wording shows up here: rerun `adaptive-spec report --sweep-dir eval/results/<sweep>`
and commit the new report.md with the change that made it.
"""
import importlib.util
import json
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


def benchmark_folders() -> list[Path]:
    """Benchmark script runs: the run.json their report reads (evaluation/paired.run_header), naming the
    script, the report file (report.md unless "report" says otherwise) and any arguments --report-only needs
    ("report_args", given before it: a subcommand goes there)."""
    return sorted(d for d in RESULTS.iterdir() if (d / "run.json").is_file())


def test_the_committed_benchmarks_are_found():
    names = {d.name for d in benchmark_folders()}
    assert {"bench_ngram_avx512_epyc", "bench_ttft_avx512_epyc", "bench_llama_cpp_peer_avx512_epyc"} <= names, names


def test_every_committed_result_regenerates():
    """Every folder under eval/results/ is a sweep (`adaptive-spec report` regenerates it) or a benchmark run
    whose script regenerates its report from the folder alone: a report nothing can rebuild is not kept."""
    rebuilt = set(sweep_folders()) | set(benchmark_folders())
    orphans = sorted(d.name for d in RESULTS.iterdir() if d.is_dir() and d not in rebuilt)
    assert not orphans, f"no run.json (script and report) and no sweep config: {orphans}"


@pytest.mark.parametrize("folder", benchmark_folders(), ids=lambda d: d.name)
def test_committed_benchmark_report_regenerates_identically(folder, tmp_path):
    """From the folder alone (no model, no llama.cpp build, no prompt set): the CPU's flags, the build and
    the timed constants come from run.json, so the report reads the same on any machine."""
    run = json.loads((folder / "run.json").read_text())
    script, name = run["script"], run.get("report", "report.md")
    spec = importlib.util.spec_from_file_location(Path(script).stem, RESULTS.parent.parent / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    copy = shutil.copytree(folder, tmp_path / folder.name, ignore=shutil.ignore_patterns(name))
    # report_args first: a tool with subcommands (eval/bench_forward_costs.py kernels ...) names its mode there
    args = run.get("report_args", [])
    assert mod.main([*args, "--report-only", "--out", str(copy)]) in (0, None)
    assert (copy / name).read_text() == (folder / name).read_text(), \
        f"rerun `python {' '.join([script, *args])} --report-only --out eval/results/{folder.name}` and commit its {name}"


def test_report_only_needs_the_run_header_and_reads_what_the_run_wrote(tmp_path):
    from adaptive_spec.errors import UserError
    from adaptive_spec.evaluation.paired import run_header

    with pytest.raises(UserError, match="run.json does not exist: --report-only regenerates"):
        run_header(tmp_path, report_only=True)
    written = run_header(tmp_path, report_only=False, measure=lambda: {"cpu": "flags: x", "threads": 2})
    assert set(written) == {"cpu", "threads", "written"}
    assert run_header(tmp_path, report_only=True) == written
