"""The README's measured results are what the committed benchmark reports give (generated, never typed)."""
import json

from adaptive_spec.evaluation import summary
from adaptive_spec.runs import PROJECT_ROOT

README = PROJECT_ROOT / "README.md"


def test_the_readme_holds_the_table_and_the_machine_kinds_the_committed_reports_give():
    text = README.read_text()
    fix = "run: python -m adaptive_spec.evaluation.summary --write"
    assert summary.readme_block() in text, fix
    assert summary.kinds_block() in text, fix
    # the first section says which machine kinds gain what, before the table
    assert text.index(summary.KINDS_BEGIN) < text.index(summary.BEGIN) < text.index("\n## Set-up")


def test_no_speed_figure_of_the_readme_is_typed_by_hand():
    """A ratio (1.36x) or a rate (4.8 tok/s) in the prose is a number nothing regenerates: it goes stale, as a
    Q8_0 figure once did; the generated blocks say them."""
    text = README.read_text()
    assert summary.typed_figures(text) == [], "state them through the generated blocks (summary.py) instead"
    assert summary.typed_figures("a pass costs 1.6 steps, auto gives 0.97-1.32x, 4.82 tok/s") == \
        ["0.97-1.32x", "4.82 tok/s"]


def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 250, "move details to docs/ and link them"


def write_bench(tmp_path, rows, cpu="Some CPU | ISA AVX2"):
    folder = tmp_path / "bench_ngram_x"
    folder.mkdir()
    (folder / "report.md").write_text(f"# t\n\nCPU: {cpu} | flags: avx2\n")
    (folder / "results.jsonl").write_text("".join(json.dumps(
        {"dataset": ds, "prompt_idx": 0, "temperature": 0.0, "engine": e, "config": c, "n_tokens": n, "decode_s": t})
        + "\n" for ds, e, c, n, t in rows))


def test_the_table_pools_tokens_over_time_and_divides_by_llama_cpp_alone(tmp_path):
    write_bench(tmp_path, [("edit", "llama.cpp", "ar", 100, 4.0), ("edit", "llama.cpp", "ar", 100, 6.0),
                           ("edit", "llama.cpp", "ngram k=auto", 100, 2.0), ("edit", "llama.cpp", "ngram k=auto", 100, 3.0),
                           ("edit", "torch", "ar", 200, 40.0), ("edit", "torch", "ngram k=auto", 200, 10.0)])
    (row_llama, row_torch) = summary.rows_of(tmp_path)
    assert row_llama["cpu"] == "Some CPU, AVX2" and row_llama["alone"] == 20.0  # 200 tokens / 10 s
    assert row_llama["ngram_x"] == 2.0 and row_torch["alone_x"] == 0.25 and row_torch["ngram_x"] == 1.0


def test_the_machine_kinds_say_the_rows_best_gain_per_prompt_group(tmp_path):
    write_bench(tmp_path, [("edit", "llama.cpp", "ar", 100, 10.0), ("edit", "llama.cpp", "ngram k=auto", 100, 5.0),
                           ("followups.jsonl", "llama.cpp", "ar", 100, 10.0),
                           ("followups.jsonl", "llama.cpp", "specdec++ h=auto", 100, 12.5),
                           ("edit", "torch", "ar", 100, 40.0)])
    line = summary.machine_kinds(tmp_path)
    assert line.startswith("- **Some CPU, AVX2**: llama.cpp alone decodes 10.0 tok/s.")
    # 10 s / 5 s: copies double the speed on edits; 10 / 12.5: SpecDec++ loses a fifth on second turns
    assert "edit up to 2.00x (ngram k=auto)" in line and "second turns at best 0.80x (specdec++ h=auto)" in line
    assert "SpecDec++ h=auto 0.80x" in line and "torch's target alone: 0.25x" in line
