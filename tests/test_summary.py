"""The README's results table is what the committed benchmark reports give (generated, never typed)."""
import json

from adaptive_spec.evaluation import summary
from adaptive_spec.runs import PROJECT_ROOT


def test_the_readme_holds_the_table_the_committed_reports_give():
    text = (PROJECT_ROOT / "README.md").read_text()
    assert summary.readme_block() in text, "run: python -m adaptive_spec.evaluation.summary --write"


def test_the_table_pools_tokens_over_time_and_divides_by_llama_cpp_alone(tmp_path):
    folder = tmp_path / "bench_ngram_x"
    folder.mkdir()
    (folder / "report.md").write_text("# t\n\nCPU: Some CPU | ISA AVX2 | flags: avx2\n")
    rows = [("edit", "llama.cpp", "ar", 100, 4.0), ("edit", "llama.cpp", "ar", 100, 6.0),
            ("edit", "llama.cpp", "ngram k=auto", 100, 2.0), ("edit", "llama.cpp", "ngram k=auto", 100, 3.0),
            ("edit", "torch", "ar", 200, 40.0), ("edit", "torch", "ngram k=auto", 200, 10.0)]
    (folder / "results.jsonl").write_text("".join(json.dumps(
        {"dataset": ds, "prompt_idx": 0, "temperature": 0.0, "engine": e, "config": c, "n_tokens": n, "decode_s": t})
        + "\n" for ds, e, c, n, t in rows))
    (row_llama, row_torch) = summary.rows_of(tmp_path)
    assert row_llama["cpu"] == "Some CPU, AVX2" and row_llama["alone"] == 20.0  # 200 tokens / 10 s
    assert row_llama["ngram_x"] == 2.0 and row_torch["alone_x"] == 0.25 and row_torch["ngram_x"] == 1.0
