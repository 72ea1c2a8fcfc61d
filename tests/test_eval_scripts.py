"""The decode benchmark is the sweep: eval/bench_decode.py measures nothing any more (it rebuilds the
tables of the runs its former harness committed), and the draft-vocabulary benchmark reads the target's
responses from a sweep's rows."""
import importlib.util
import json
from pathlib import Path

import pytest

EVAL = Path(__file__).resolve().parent.parent / "eval"


def script(name):
    spec = importlib.util.spec_from_file_location(name, EVAL / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_decode_points_a_measuring_run_at_the_sweep(tmp_path):
    with pytest.raises(SystemExit, match=r"error: the decode benchmark is the sweep now: `make bench`"):
        script("bench_decode").main(["--out", str(tmp_path)])


def test_make_bench_is_the_bench_sweep():
    make = (EVAL.parent / "Makefile").read_text()
    bench = make[make.index("\nbench:"):].split("\n\n")[0]
    assert "sweep --config configs/sweep/bench.yaml" in bench and "eval/bench_decode.py" not in bench


@pytest.mark.parametrize("row, settings, want", [
    ({"config": "ar", "temperature": 0.0, "settings": {"top_k": 5}}, None, {"temperature": 0.0, "top_k": 5}),
    ({"config": "ar"}, {"temperature": 1.0, "top_k": 50}, {"temperature": 1.0, "top_k": 50}),
])
def test_draft_vocab_reads_the_sampling_of_a_sweep_or_a_former_run(tmp_path, row, settings, want):
    if settings is not None:
        (tmp_path / "settings.json").write_text(json.dumps({"settings": settings, "hash": "x"}))
    assert script("bench_draft_vocab").sampling_of(row, tmp_path / "results.jsonl") == want
