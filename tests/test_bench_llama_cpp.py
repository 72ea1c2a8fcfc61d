"""The peer benchmark's arithmetic (eval/bench_llama_cpp.py): Eq. 3.2's break-even acceptance, the
ceiling a perfect draft would reach, and the goal rows of the report, on costs and rows made up here."""
import importlib.util
import math
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parent.parent / "eval" / "bench_llama_cpp.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_llama_cpp", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# a draft step costs 0.1 target steps; a pass of N tokens costs 1 + 0.2 (N - 1) steps
CHEAP = {"t_draft": 0.01, "t_verify": [0.1, 0.12, 0.14, 0.16, 0.18]}
# a draft step costs half a target step, and verification a whole step a token: nothing can pay
LINEAR = {"t_draft": 0.05, "t_verify": [0.1, 0.2, 0.3, 0.4, 0.5]}


def test_ceiling_is_eq_3_2_at_full_acceptance(bench):
    assert bench.ceiling(CHEAP, 1) == pytest.approx(2 / 1.3)
    assert bench.ceiling(CHEAP, 2) == pytest.approx(3 / 1.6)
    assert bench.ceiling(LINEAR, 1) == pytest.approx(2 / 2.5)


def test_break_even_solves_for_the_acceptance(bench):
    draft, excess, alpha = bench.break_even(CHEAP, 1)
    assert (draft, excess) == (pytest.approx(0.1), pytest.approx(0.2))
    assert alpha == pytest.approx(0.3, abs=1e-9)  # 1 + alpha tokens for 1.3 steps
    assert bench.break_even(CHEAP, 2)[2] == pytest.approx((math.sqrt(1 + 4 * 0.6) - 1) / 2, abs=1e-9)
    assert bench.break_even(LINEAR, 1)[2] is None  # even alpha = 1 falls short


def test_cost_section_names_the_best_ceiling(bench):
    text = "\n".join(bench.cost_section({"cheap": CHEAP, "linear": LINEAR}))
    assert "cheap 2.27x at K = 4" in text and "linear 0.80x at K = 1" in text
    assert "| linear | 100.0 | 0.50 | 1.00 / 2.00 / 3.00 / 4.00 / 5.00 | 1 | 0.50 | 1.00 | none | 0.80x |" in text


def _rows(engine, config, tok_s, auto=None):
    # two prompts of 100 tokens; wall time includes a 1 s prefill
    return [{"dataset": "gsm8k", "prompt_idx": i, "temperature": 1.0, "engine": engine, "config": config,
             "n_tokens": 100, "decode_s": 100 / tok_s, "wall_s": 1 + 100 / tok_s, "decode_tok_s": tok_s,
             "acceptance": None, "auto": auto} for i in range(2)]


def test_goals_compare_auto_with_auto_and_the_best_h(bench):
    rows = (_rows("llama.cpp", "ar", 25.0) + _rows("llama.cpp", "specdec++ h=0.3", 15.0)
            + _rows("llama.cpp", "specdec++ h=auto", 25.0, auto="ar") + _rows("torch", "specdec++ h=auto", 10.0))
    header = {"llama_bench": {"empty context": 26.0, "100-token context": 26.0}, "cpu": "cpu", "build": "flags",
              "max_new_tokens": 100, "threads": 2, "drafts": "none", "target_quant": "none", "written": "2026-01-01 00:00"}
    md = bench.report(rows, header)
    wall = {cfg: 200 / (2 + 200 / s) for cfg, s in (("auto", 25.0), ("h", 15.0), ("torch", 10.0))}
    lines = {ln.split(" | ")[0]: ln for ln in md.splitlines() if ln.startswith("| T=1")}
    auto_line = lines["| T=1: SpecDec++ h=auto on llama.cpp / on torch, wall tok/s (>= 2)"]
    assert f"{wall['auto'] / wall['torch']:.2f}x | yes" in auto_line
    best_h = lines["| T=1: SpecDec++ on llama.cpp (specdec++ h=0.3) / on torch (auto), wall tok/s (>= 2)"]
    assert f"{wall['h'] / wall['torch']:.2f}x | **no**" in best_h
    assert "| T=1: SpecDec++ h=auto on llama.cpp / llama.cpp alone, decode (>= 1.2) | gsm8k | 1.00x | **no** |" in md
    assert "on the fetched target" not in md  # no fetched-file row in this run
    # a run without auto rows (stopped early, or another grid) gets no auto goals, and no crash
    partial = [r for r in rows if r["config"] != "specdec++ h=auto"]
    md = bench.report(partial, header)
    assert "h=auto" not in md and "specdec++ h=0.3) / on torch" not in md


def test_overhead_report_pairs_each_prompt_with_its_llama_bench_run(monkeypatch):
    monkeypatch.syspath_prepend(str(PATH.parent))  # the script imports its sibling, as `python eval/...` does
    spec = importlib.util.spec_from_file_location("bench_llama_cpp_overhead", PATH.parent / "bench_llama_cpp_overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = []
    for i, tg in enumerate((20.0, 40.0)):  # a slow spell, then a fast one: each prompt has its own tg
        rows.append({"dataset": "gsm8k", "prompt_idx": i, "temperature": None, "torch_threads": None, "tg_tok_s": tg})
        for threads in (1, 2):
            rows.append({"dataset": "gsm8k", "prompt_idx": i, "temperature": 0.0, "torch_threads": threads,
                         "n_tokens": 100, "decode_s": 100 / (tg * (0.99 if threads == 1 else 0.9)),
                         "forward_s": 100 / tg})
    md = mod.report(rows, {"cpu": "cpu", "build": "flags", "max_new_tokens": 100, "written": "2026-01-01 00:00"})
    line = {ln.split(" | ")[1]: ln for ln in md.splitlines() if ln.startswith("| greedy")}
    assert "| 0.990 |" in line["1"] and "| 0.900 |" in line["2"]
    # llama-bench pooled as our time is: 200 tokens over 100/20 + 100/40 s
    assert f"| {200 / 7.5:.2f} |" in line["1"]
