"""The README's measured results are what the committed benchmark reports give (generated, never typed)."""
import json
import re

from adaptive_spec.evaluation import summary
from adaptive_spec.runs import PROJECT_ROOT

README = PROJECT_ROOT / "README.md"

# a speed figure: a ratio (1.36x, 0.97-1.32x) or a rate (4.82 tok/s)
FIGURE = re.compile(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b|\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?tok/s")


def typed_figures(text: str) -> list[str]:
    """The speed figures of a README outside its generated blocks: each is typed by hand, so none may be."""
    for begin, end in summary.BLOCKS:
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            text = head + rest.split(end, 1)[1]
    return FIGURE.findall(text)


def test_the_readme_holds_the_table_and_the_machine_kinds_the_committed_reports_give():
    text = README.read_text()
    fix = "run: python -m adaptive_spec.evaluation.summary --write"
    assert summary.readme_block() in text, fix
    assert summary.kinds_block() in text, fix
    assert summary.gpu_block() in text, fix
    # the first section says which machine kinds gain what, before the table; the GPU table is in its section
    assert text.index(summary.KINDS_BEGIN) < text.index(summary.BEGIN) < text.index("\n## Set-up")
    assert text.index("\n## GPU\n") < text.index(summary.GPU_BEGIN) < text.index("\n## Stop policies")


def test_no_speed_figure_of_the_readme_is_typed_by_hand():
    """A ratio (1.36x) or a rate (4.8 tok/s) in the prose is a number nothing regenerates: it goes stale, as a
    Q8_0 figure once did; the generated blocks say them."""
    text = README.read_text()
    assert typed_figures(text) == [], "state them through the generated blocks (summary.py) instead"
    assert typed_figures("a pass costs 1.6 steps, auto gives 0.97-1.32x, 4.82 tok/s") == \
        ["0.97-1.32x", "4.82 tok/s"]


def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 300, "move details to docs/ and link them"


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


def test_the_gpu_table_says_what_the_committed_check_measured_and_how():
    """Its caption names the machine and how the figures were made; the numbers are the check's own."""
    block = summary.gpu_block()
    for said in ("NVIDIA H200", "torch 2.11.0+cu130", "bf16, batch 1", "random weights of the real shapes",
                 "replaying the acceptance recorded on the CPU", "eval/results/gpu_check_h200/report.md"):
        assert said in block, said
    # the 7B's fused step: 5.082 ms against a 2.949 ms roofline; SpecDec++ on 0.5B / 7B: 345.4 / 178.0 tok/s
    assert "| Coder-7B | 7.62B | 2.95 | " in block and "5.08 (58%)" in block and "487 (fused)" in block
    assert "| `coder-0.5b-7b`: Coder-0.5B / Coder-7B | borrowed from `default` | 178 | " in block
    assert block.splitlines()[-3].endswith("| 1.43x |") and "| 1.94x |" in block


def write_check(folder, passed=True):
    row = {"step_ms": 4.0, "roofline_ms": 1.0, "kernels": 100}
    check = {"env": {"device_name": "GPU X", "torch": "9.9", "dtype": "bfloat16", "iters": 5, "bandwidth_tbs": 1.0},
             "traces": {"preset": "small", "folder": "t", "sampling": "T = 1"},
             "models": {"Org/Qwen2.5-Big-Instruct": {"bytes": {"n_params": 2e9}, "replay_runtime": "fused",
                                                      "rows": {"eager": {**row, "kernels": 300},
                                                               "fused": {**row, "step_ms": 2.0},
                                                               "fused-compile": {"step_ms": 1.25}}}},
             "exactness": {"distribution": [{"runtime": "fused", "p_value": 0.5, "pass": passed}], "greedy": []},
             "replay": [{"pair": pair, "hub_ids": ["Org/Qwen2.5-Small-Instruct", "Org/Qwen2.5-Big-Instruct"],
                         "policies": [{"config": "ar", "tok_s": 50.0, "speedup": 1.0, "rows": 2, "tokens": 9},
                                      {"config": "fixed:k=2", "tok_s": 75.0, "speedup": 1.5},
                                      {"config": "learned:head=h:h=0.6", "tok_s": 100.0, "speedup": 2.0}]}
                        for pair in ("small", "big")]}
    folder.mkdir(exist_ok=True)
    (folder / "gpu_check.json").write_text(json.dumps(check))
    return folder


def test_the_gpu_table_divides_the_roofline_by_each_step_and_labels_borrowed_acceptance(tmp_path):
    block = summary.gpu_block(write_check(tmp_path / "check"))
    # roofline 1 ms: a 4 ms eager step is 25% of it, a 2 ms fused one 50%, the compiled 1.25 ms one 80%
    assert "| Big | 2.00B | 1.00 | 4.00 (25%) | 2.00 (50%) | 1.25 (80%) | 300 (eager), 100 (fused) | — |" in block
    assert "| `small`: Small / Big | measured (its own traces) | 50 | 1.50x | 2.00x |" in block
    assert "| `big`: Small / Big | borrowed from `small` | 50 | 1.50x | 2.00x |" in block
    assert "| fixed K=2 | SpecDec++ h=0.6 |" in block and "GPU X (torch 9.9, bf16, batch 1" in block
    assert "through fused (chi-square, p = 0.50)" in block and "FAILED" not in block
    # a check whose exactness failed says so in the caption (the control: the same figures, passed=False)
    failed = summary.gpu_block(write_check(tmp_path / "failed", passed=False))
    assert "FAILED exactness: fused." in failed and "through fused (chi-square" not in failed
