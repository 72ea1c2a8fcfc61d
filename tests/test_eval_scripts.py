"""The torch benchmark scripts run end to end on a tiny pair (their measuring path: a model load, a decode, the
report), and the report a run writes is what --report-only rebuilds from the folder alone."""
import importlib.util
import json
from pathlib import Path

EVAL = Path(__file__).resolve().parent.parent / "eval"


def script(name):
    spec = importlib.util.spec_from_file_location(name, EVAL / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_decode_runs_and_its_table_regenerates(tiny_pair, tmp_path):
    draft, target = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("abc", "hello")))
    out = tmp_path / "run"
    bench = script("bench_decode")
    assert bench.main(["--draft", str(draft), "--target", str(target), "--dataset", str(prompts), "--prompts", "2",
                       "--max-new-tokens", "6", "--ks", "1,2", "--temperatures", "0", "--dtype", "fp32",
                       "--threads", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["config"] for r in rows} == {"ar", "k1", "k2"} and len(rows) == 6
    out_of = {(r["prompt_idx"], r["config"]): r["output_sha"] for r in rows}
    assert all(out_of[(i, c)] == out_of[(i, "ar")] for i, c in out_of)  # greedy speculative = greedy target
    written = (out / "table.md").read_text()
    (out / "table.md").unlink()
    assert bench.main(["--report-only", "--out", str(out)]) == 0
    assert (out / "table.md").read_text() == written
