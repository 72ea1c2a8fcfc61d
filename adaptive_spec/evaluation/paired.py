"""Paired benchmark rows: every configuration of a prompt run back to back, each row appended (fsynced)
to results.jsonl as soon as it is measured, and skipped on a rerun that finds it there (resumable).
The engine benchmarks (eval/bench_llama_cpp.py, eval/bench_ngram.py, eval/bench_ttft.py) share it."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from ..errors import UserError, get_logger
from ..runs import append_jsonl, atomic_write, read_json, read_jsonl, write_json

log = get_logger(__name__)


def row_key(row: dict) -> tuple:
    return row["dataset"], row["prompt_idx"], row["temperature"], row["engine"], row["config"]


def start(out_dir, threads: int) -> tuple[Path, Path, set]:
    """(the run folder, made; its results.jsonl; the keys of the rows it holds) with torch on `threads`."""
    import torch  # noqa: PLC0415 (the helpers above need none)

    torch.set_num_threads(threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    return out, results, {row_key(r) for r in read_jsonl(results)} if results.is_file() else set()


def pooled_tok_s(rows: list[dict], time_field: str = "decode_s") -> float:
    """Tokens over time pooled over prompts (a long prompt weighs by its tokens, as in sweeps); decode_s
    leaves prefill out, as llama-bench tg does, wall_s keeps it."""
    t = sum(r[time_field] for r in rows)
    return sum(r["n_tokens"] for r in rows) / t if t else float("nan")


def record(results: Path, done: set, row: dict, measure: Callable[[], dict]) -> dict | None:
    """`row` (its key fields) completed by `measure()` and appended, unless `done` has it already."""
    if row_key(row) in done:
        return None
    row.update(measure())
    append_jsonl(results, row)
    done.add(row_key(row))
    speed = row.get("decode_tok_s")
    log.info(f"{Path(str(row['dataset'])).stem} {row['prompt_idx']} T={row['temperature']:g} {row['engine']:20} "
             f"{row['config']:24} " + (f"{speed:6.2f} tok/s" if speed is not None else ""))
    return row


RUN = "run.json"


def run_header(out: Path, report_only: bool, measure: Callable[[], dict] | None = None) -> dict:
    """What a report says beside its rows (the CPU's flags, the build, constants timed on the machine,
    the settings its title names, when it was written): measured and kept in <out>/run.json by a run
    that measures, read back by --report-only, so that a committed report regenerates from its folder
    alone, on any machine, byte for byte (tests/test_regenerate_reports.py)."""
    path = out / RUN
    if report_only:
        if not path.is_file():
            raise UserError(f"{path} does not exist: --report-only regenerates a report from a run folder that "
                            "holds one; rerun the benchmark without --report-only (it resumes its rows)")
        return json.loads(path.read_text())
    header = {**(measure() if measure else {}), "written": time.strftime("%Y-%m-%d %H:%M")}
    write_json(path, header, indent=1)
    return header


def write_run(out: Path, script: str, subcommand: str, data_file: str, data, report_file: str,
              report: Callable[[dict, dict], str], measure: Callable[[], dict], indent: int = 1) -> str:
    """A measured run of one subcommand of an eval/ tool (bench_forward_costs.py, score_heads.py): its data
    file, run.json (`measure()`'s fields, naming the script and subcommand so --report-only finds them) and
    the report, which is returned."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / data_file, data, indent=indent, default=str)
    header = run_header(out, report_only=False, measure=lambda: {
        "script": script, "report_args": [subcommand], "report": report_file, **measure()})
    return rebuild_report(out, data_file, report_file, report, header)


def rebuild_report(out: Path, data_file: str, report_file: str, report: Callable[[dict, dict], str],
                   header: dict | None = None, data=None) -> str:
    """<out>'s report from its data file (or `data`) and run.json (`header`, read when not given): one path
    for a measuring run and --report-only, so a report reads the same whether just measured or rebuilt."""
    header = run_header(out, report_only=True) if header is None else header
    text = report(read_json(out / data_file, hint="rerun without --report-only") if data is None else data, header)
    atomic_write(out / report_file, text)
    return text
