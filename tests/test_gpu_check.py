"""eval/gpu_check.py, the one prepared GPU check, end to end on tiny shapes on the CPU (--tiny): every section of
its report, every replay's counts as recorded in the committed traces, and the report rebuilt from its JSON."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "eval" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_tiny_check_writes_every_section(tmp_path):
    """About 10 s on 2 idle cores (40 s on busy ones): two chi-squares of 400 generations, 3 models, 2 pairs."""
    check = load_check()
    out = tmp_path / "check"
    assert check.main(["--tiny", "--device", "cpu", "--pairs", "default,coder-0.5b-7b", "--iters", "1",
                       "--out", str(out)]) == 0
    res = json.loads((out / "gpu_check.json").read_text())
    ex = res["exactness"]
    runtimes = ["eager", "fused"]
    assert [r["runtime"] for r in ex["distribution"]] == runtimes and all(r["pass"] for r in ex["distribution"])
    assert [g["runtime"] for g in ex["greedy"]] == runtimes and all(g["equal"] for g in ex["greedy"])
    assert len(res["models"]) == 3  # tiny 0.5B, 1.5B and 7B shapes
    for m in res["models"].values():
        assert set(m["rows"]) == set(runtimes) and m["replay_runtime"] == runtimes[-1]
        for r in m["rows"].values():
            assert r["step_ms"] > 0 and sorted(map(int, r["verify_ms"])) == list(range(1, 10))
            assert r["kernels"] is None or r["kernels"] > 0
    default, borrowed = res["replay"]
    assert default["label"].startswith("measured acceptance") and borrowed["label"].startswith("BORROWED")
    traces = check.load_traces(ROOT / check.TRACES)
    for rp in (default, borrowed):
        assert [p["config"] for p in rp["policies"]] == list(traces["by_config"])
        assert {p["method"] for p in rp["policies"]} == {"ar", "fixed", "learned"}
        assert all(p["counts_reproduced"] and p["tok_s"] > 0 for p in rp["policies"])
        assert all(p["est_speedup"] > 0 for p in rp["policies"] if p["method"] != "ar")
        assert rp["best_fixed"].startswith("fixed:")
    assert [a["pair"] for a in res["assisted"]] == ["default:tiny", "coder-0.5b-7b:tiny"]
    assert all(a["assisted_tok_s"] > 0 for a in res["assisted"]) and "padded" in res["assisted"][1]["note"]
    assert set(res["elapsed_s"]) == {"start-up", "1 exactness", "2 runtimes", "3 replay", "4 assisted", "5 compile"}
    md = (out / "report.md").read_text()
    for section in ("## 1. Exactness", "## 2. Step times per model and runtime", "## 3. Replayed traces",
                    "## 4. transformers' assisted generation", "CPU smoke run", "**measured acceptance",
                    "**BORROWED acceptance: traces of default replayed on coder-0.5b-7b:tiny's shapes**",
                    "(best fixed K)", "Elapsed per phase"):
        assert section in md, section
    assert json.loads((out / "run.json").read_text()) == {"script": "eval/gpu_check.py", "report": "report.md"}
    copy = shutil.copytree(out, tmp_path / "copy", ignore=shutil.ignore_patterns("report.md"))
    assert check.main(["--report-only", "--out", str(copy)]) == 0
    assert (copy / "report.md").read_text() == md


def test_the_committed_traces_name_their_pair_and_replay_as_chains():
    check = load_check()
    traces = check.load_traces(ROOT / check.TRACES)
    assert traces["pair"]["preset"] == "default"
    assert traces["pair"]["draft"]["hub_id"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    from adaptive_spec.decoding.replay import check_trace

    for rows in traces["by_config"].values():
        for r in rows:
            if r["method"] != "ar":
                check_trace(r["trace"], r["n_tokens"])


def test_too_few_samples_are_refused(capsys):
    with pytest.raises(SystemExit):
        load_check().main(["--tiny", "--samples", "100"])
    assert "--samples must be >= 300" in capsys.readouterr().err
