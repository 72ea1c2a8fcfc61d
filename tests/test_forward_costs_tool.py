"""eval/bench_forward_costs.py, the one forward-cost tool: its subcommands parse and keep the defaults, files and
torch-free --report-only of the scripts they replace (bench_cpu_kernels, bench_linear_rows, bench_verify_lengths,
bench_pass_costs); a measuring run's files are written by one path for all (shown with a canned measurement: no
model is loaded, nothing is timed). That every committed folder's report regenerates is
tests/test_regenerate_reports.py's."""
import json
import runpy
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from script_tools import heavy_imports

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "eval" / "bench_forward_costs.py"
RESULTS = ROOT / "eval" / "results"
SUBCOMMANDS = ("kernels", "linear-rows", "lengths", "llama-cpp")
# a committed folder per subcommand, and the report file it holds
FOLDERS = {"kernels": ("bench_cpu_kernels_avx2", "table.md"), "linear-rows": ("bench_linear_rows_avx2", "table.md"),
           "lengths": ("bench_verify_lengths_avx512_rows", "table.md"),
           "llama-cpp": ("bench_pass_costs_vocab_avx512_epyc", "report.md")}


@pytest.fixture(scope="module")
def tool():
    """The script's names, run as an imported module is, not as __main__ (MODES is the dict main() reads)."""
    return SimpleNamespace(**runpy.run_path(str(TOOL)))


def exit_code(tool, argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        tool.main(argv)
    return e.value.code


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_help_parses(tool, name, capsys):
    assert exit_code(tool, [name, "--help"]) == 0
    usage = capsys.readouterr().out
    assert usage.startswith(f"usage: eval/bench_forward_costs.py {name} ")
    assert all(o in usage for o in ("--out OUT", "--report-only", "--threads THREADS", "--reps REPS")), usage


@pytest.mark.parametrize("argv", [["bench_pass_costs"], [], ["--report-only", "--out", "x"]])
def test_an_unknown_or_missing_subcommand_lists_the_valid_ones(tool, argv, capsys):
    assert exit_code(tool, argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "{kernels,linear-rows,lengths,llama-cpp}" in err, err


def test_each_subcommand_keeps_its_former_scripts_defaults(tool):
    """The shared options are defined once, yet each subcommand has its former script's defaults (one argparse
    parent shared by all would hand every subcommand the same)."""
    p = tool.parser()
    k = p.parse_args(["kernels"])
    assert (k.models, k.lens, k.prefill, k.reps, k.rounds, k.threads, k.paths, k.out) == (
        "draft,target", "1,2,3,5,9", 235, 7, 3, 2, None, None)
    r = p.parse_args(["linear-rows"])
    assert (r.model, r.rows, r.reps, r.rounds, r.threads, r.out) == ("target", "1,2,3,5,9", 5, 3, 2, None)
    n = p.parse_args(["lengths"])
    assert (n.draft_quant, n.lengths, n.draft_lengths, n.short, n.long, n.reps, n.threads, n.out) == (
        "int8", "1-12", "1-8", 32, 256, 5, 2, "eval/results/bench_verify_lengths")
    c = p.parse_args(["llama-cpp", "--out", "o"])
    assert (c.targets, c.drafts, c.reps, c.threads, c.quality, c.acceptance, c.quality_prompts, c.quality_tokens) == (
        "none,q4_0-pure,q4_k-pure,iq4_nl-pure", "none,q4_0,q4_0-pure", 5, None, False, False, 4, 64)
    assert not any(a.report_only for a in (k, r, n, c))
    with pytest.raises(SystemExit):
        p.parse_args(["llama-cpp"])  # --out is required there, as it was
    with pytest.raises(SystemExit):
        p.parse_args(["lengths", "--prefill", "3"])  # another subcommand's option


def test_report_only_needs_a_folder_where_there_is_no_default(tool, capsys):
    assert exit_code(tool, ["kernels", "--report-only"]) == 2
    assert "kernels --report-only rewrites the report of a run folder: name it with --out" in capsys.readouterr().err


def test_the_former_scripts_are_gone_and_their_results_name_the_tool():
    for old in ("bench_cpu_kernels", "bench_linear_rows", "bench_verify_lengths", "bench_pass_costs"):
        assert not (ROOT / "eval" / f"{old}.py").exists()
    named = {}
    for run in RESULTS.glob("*/run.json"):
        header = json.loads(run.read_text())
        if header["script"] == "eval/bench_forward_costs.py":
            named[run.parent.name] = header["report_args"]
    assert {name: [sub] for sub, (name, _) in FOLDERS.items()}.items() <= named.items(), named
    assert all(args[0] in SUBCOMMANDS for args in named.values()), named


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_report_only_imports_no_torch(name, tmp_path):
    """--report-only rebuilds a committed report on a machine without torch, as each former script did."""
    folder, report = FOLDERS[name]
    copy = shutil.copytree(RESULTS / folder, tmp_path / folder, ignore=shutil.ignore_patterns(report))
    assert heavy_imports(TOOL, [name, "--report-only", "--out", str(copy)]) == []
    assert (copy / report).read_text() == (RESULTS / folder / report).read_text()


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_a_measuring_run_writes_the_files_its_report_only_reads(tool, name, tmp_path, monkeypatch, capsys):
    """The write path every subcommand shares, with the measurement replaced by a committed run's numbers: the
    data file, a run.json that names the tool, its subcommand and the command, and the report --report-only
    rebuilds from them."""
    folder, report = FOLDERS[name]
    mode = tool.MODES[name]
    data = json.loads((RESULTS / folder / mode.data).read_text())
    committed = json.loads((RESULTS / folder / "run.json").read_text())
    fields = {k: v for k, v in committed.items() if k not in ("script", "report_args", "report", "command", "written")}
    monkeypatch.setitem(tool.MODES, name, mode._replace(measure=lambda args: (data, fields)))
    out = tmp_path / "run"
    assert tool.main([name, "--out", str(out), "--reps", "1"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert (run["script"], run["report_args"], run["report"]) == ("eval/bench_forward_costs.py", [name], report)
    assert run["command"] == f"python eval/bench_forward_costs.py {name} --out {out} --reps 1"
    assert json.loads((out / mode.data).read_text()) == data
    text = (out / report).read_text()
    assert capsys.readouterr().out == text
    (out / report).unlink()
    assert tool.main([*run["report_args"], "--report-only", "--out", str(out)]) == 0
    assert (out / report).read_text() == text


def test_timed_runs_times_only_past_the_warm_ups_and_resets_before_each_call():
    from adaptive_spec import timing

    calls = []
    times, last = timing.timed_runs(lambda: calls.append("call") or len(calls), 3, warmup=2,
                                    before=lambda: calls.append("reset"))
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert calls == ["reset", "call"] * 5 and last == 10


def test_time_forward_rolls_back_before_every_pass_and_returns_the_last_logits():
    import torch

    from adaptive_spec.evaluation.forward_costs import time_forward

    class LM:  # a runner's surface: a cache that grows by what it is fed and rolls back
        vocab_size, length, log = 1000, 0, []

        def reset(self):
            self.length = 0

        def rollback(self, n):
            self.log.append(("rollback", n))
            self.length = n

        def forward(self, ids, n_logits):
            self.length += len(ids)
            self.log.append(("forward", len(ids), self.length))
            return torch.full((n_logits, 3), float(len(self.log))), None

    lm = LM()
    seconds, logits = time_forward(lm, torch.arange(64), 5, reps=2)
    assert seconds >= 0 and logits.shape == (5, 3) and logits[0, 0].item() == len(lm.log)
    # the prompt once, then 3 warm-ups and 2 timed passes, each fed after the prompt's 64 tokens
    assert lm.log == [("forward", 64, 64)] + [("rollback", 64), ("forward", 5, 69)] * 5
