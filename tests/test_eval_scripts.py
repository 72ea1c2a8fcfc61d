"""The decode benchmark is the sweep: eval/bench_decode.py measures nothing any more (it rebuilds the
tables of the runs its former harness committed), and the draft-vocabulary benchmark reads the target's
responses from a sweep's rows."""
import importlib.util
import json
from types import SimpleNamespace
from pathlib import Path

import pytest

from adaptive_spec.errors import UserError

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


def test_bench_drafter_counts_tau_checks_greedy_equality_and_regenerates(tmp_path):
    """--tiny: a random feature drafter and, as the draft model, the target itself (every draft accepted, so
    tau is K + 1 per full round); the report regenerates from the folder alone, and a row whose output differs
    from the target alone's is reported (the control)."""
    mod, out = script("bench_drafter"), tmp_path / "run"
    target, _, _ = mod.make_tiny(out / "tiny_models")
    assert mod.main(["--tiny", "--prompts", "2", "--max-new-tokens", "12", "--ks", "2,3", "--draft", target,
                     "--out", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 5 and {r["n_tokens"] for r in rows} == {12}
    same = [r for r in rows if r["config"].startswith("draft model")]
    assert all(r["n_accepted"] == r["n_drafted"] > 0 for r in same)
    k3 = [r for r in same if r["config"] == "draft model K=3"]
    assert all(r["n_target_forwards"] == 3 and r["accepted_hist"] == {"3": 3} for r in k3)  # 3 rounds of 4
    md = (out / "report.md").read_text()
    assert "| HumanEval | 2 | 3 | " in md and "| 4.00 | 1.000 |" in md
    assert "Greedy equality: 8 of 8 speculative outputs" in md
    assert mod.main(["--report-only", "--out", str(out)]) == 0 and (out / "report.md").read_text() == md
    with pytest.raises(UserError, match="temperature 0, top-k 0"):  # another sampling would pool with these rows
        mod._main(["--tiny", "--prompts", "2", "--max-new-tokens", "12", "--ks", "2,3", "--draft", target,
                   "--temperature", "1", "--out", str(out)])
    bad = dict(rows[1], token_ids=rows[1]["token_ids"][:5] + [(rows[1]["token_ids"][5] + 1) % 32] + [0] * 6)
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [rows[0], bad, *rows[2:]]))
    assert mod.main(["--report-only", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "Greedy equality: 7 of 8" in md and f"| HumanEval | 0 | {bad['config']} | 5 | 12 |" in md


def test_bench_drafter_timed_reports_speeds_as_ratios_to_the_target_alone(tmp_path):
    """--timed records each row's decode time and the report pools tokens/s per configuration over the prompts
    that ran them all; halving one configuration's times doubles its ratio (the control: the table reads the
    rows). The tiny models have no GGUF, so no llama.cpp row: its column says so."""
    from adaptive_spec.heads.head import AcceptanceHead

    mod, out = script("bench_drafter"), tmp_path / "run"
    AcceptanceHead(24, depth=1).save_pretrained(tmp_path / "head")  # SpecDec++ rows: a head on the drafter's states
    assert mod.main(["--tiny", "--timed", "--prompts", "2", "--max-new-tokens", "8", "--ks", "2", "--drafts",
                     "feature", "--confidence", "0.3", "--k-max", "4", "--head", str(tmp_path / "head"),
                     "--thresholds", "0.5", "--out", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert {r["config"] for r in rows} == {"ar", "feature drafter K=2", "feature drafter conf=0.3",
                                           "feature drafter h=0.5"}
    assert all(r["decode_s"] > 0 for r in rows)
    assert all(max(map(int, r["accepted_hist"]), default=0) <= 4 for r in rows if r["config"] != "ar")
    assert "| feature drafter h=0.5 | " in (out / "report.md").read_text()
    md = (out / "report.md").read_text()
    assert "pooled over the 2 prompts" in md and "| ar | 1.00 | — | " in md and "| 1.00 | — |" in md
    speed_row = lambda text: next(ln for ln in text.split("Decode speed")[1].splitlines()  # noqa: E731
                                  if ln.startswith("| feature drafter K=2 | "))
    assert float(speed_row(md).split("|")[3]) > 0  # c, from the decoder's clock
    ratio = lambda text: float(speed_row(text).split("|")[5])  # noqa: E731
    before = ratio(md)
    fast = [dict(r, decode_s=r["decode_s"] / 2) if r["config"] != "ar" else r for r in rows]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fast))
    assert mod.main(["--report-only", "--out", str(out)]) == 0
    assert ratio((out / "report.md").read_text()) == pytest.approx(2 * before, rel=0.02)


def test_bench_llama_step_times_every_row_and_the_report_reads_them(tmp_path):
    """--tiny on tiny GGUF files: every row of the probe's one-row step is timed each round (the old cell, the
    decode's loop, the decoder's own runs and the cause rows), and the report regenerates from the folder alone;
    a cell made twice as dear in the data shows as +100% against the decoder's steps (the control: the report
    reads the samples, not fixed text)."""
    from adaptive_spec.backends.llamacpp import available

    if available() is not None:
        pytest.skip(available())
    from tiny import make_model, make_tokenizer, save_gguf

    models = tmp_path / "models"
    models.mkdir()
    make_tokenizer(32).save_pretrained(models)  # the pair's tokenizer, beside the files
    target = save_gguf(make_model(32, hidden_size=32, layers=2, seed=3, logit_scale=3.0), models / "t.gguf")
    draft = save_gguf(make_model(32, hidden_size=16, layers=1, seed=4, logit_scale=3.0), models / "d.gguf")
    mod, out = script("bench_llama_step"), tmp_path / "run"
    assert mod.main(["--tiny", "--target", str(target), "--draft", str(draft), "--threads", "1",
                     "--datasets", "humaneval", "--out", str(out)]) == 0
    data = json.loads((out / "steps.json").read_text())
    names = [name for name, _, _ in mod.ROWS if not name.startswith("decoder")]
    assert set(data["rows"]) == {*names, *mod.FOUR}
    assert all(len(rounds) == 2 and all(s > 0 for rnd in rounds for s in rnd) for rounds in data["rows"].values())
    assert all(len(rnd) == 2 for rnd in data["rows"]["cell alone"])  # --cells 2 a round
    assert len(data["runs"]) == 2 and all(r["n_tokens"] > 0 and r["forward_s"] > 0 for r in data["runs"])
    run = json.loads((out / "run.json").read_text())
    assert run["target"] == "t.gguf" and "flags:" in run["cpu"] and run["tiny"]
    md = (out / "report.md").read_text()
    assert "| probe cell (v5) | 2 |" in md and "| decoder, target alone: forward | 2 |" in md
    assert mod.main(["--report-only", "--out", str(out)]) == 0 and (out / "report.md").read_text() == md
    ref = mod.medians(data)["decoder, target alone: forward"]
    data["rows"]["probe cell (v5)"] = [[2 * ref], [2 * ref]]
    (out / "steps.json").write_text(json.dumps(data))
    assert mod.main(["--report-only", "--out", str(out)]) == 0
    assert f"| probe cell (v5) | 2 | {2e3 * ref:.2f} | +100.0% |" in (out / "report.md").read_text()


def test_the_fused_drafter_starts_as_the_last_layer_one_and_the_bench_resumes(tmp_path):
    """eval/bench_drafter_features.py --tiny: the fused input's fc starts as [0 ... 0 I], so both variants score
    the same before training (and a fused fc with weight on the other layers changes the output: the control);
    each variant trains; a rerun trains nothing again, and the report regenerates from the folder alone."""
    import torch

    mod, out, cache = script("bench_drafter_features"), tmp_path / "run", tmp_path / "cache"
    args = ["--tiny", "--train-seqs", "16", "--dev-seqs", "4", "--lr", "1e-2", "--out", str(out), "--cache", str(cache)]
    assert mod.main(args) == 0
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["last", "fused"] and all(r["steps"] == 4 for r in rows)
    assert rows[0]["accept_before"] == rows[1]["accept_before"] and rows[0]["top1_before"] == rows[1]["top1_before"]
    assert all(r["accept_after"] != r["accept_before"] for r in rows)
    from adaptive_spec.drafter.model import FeatureDrafter

    drafter = FeatureDrafter.from_pretrained(cache / "run" / "tiny" / "drafter").float()
    fused = mod.Fused(drafter, 3)
    f, emb, pos = torch.randn(1, 5, 24), torch.randn(1, 5, 24), torch.arange(5).view(1, 5)
    fused.aux = torch.randn(1, 6, 72)
    assert torch.allclose(fused(f, emb, pos), drafter(f, emb, pos), atol=1e-5)
    with torch.no_grad():
        fused.fc.weight[:, :24] += 0.1
    assert not torch.allclose(fused(f, emb, pos), drafter(f, emb, pos), atol=1e-3)
    stamp = (cache / "run" / "features.pt").stat().st_mtime
    assert mod.main(args) == 0 and len((out / "results.jsonl").read_text().splitlines()) == 2
    assert (cache / "run" / "features.pt").stat().st_mtime == stamp
    md = (out / "report.md").read_text()
    (out / "report.md").unlink()
    assert mod.main(["--report-only", "--out", str(out)]) == 0 and (out / "report.md").read_text() == md
    with pytest.raises(UserError, match=r"--layers must lie in 1..3 for this target \(4 layers\), got 1,4"):
        tiny = SimpleNamespace(target=str(cache / "run" / "tiny" / "target"))
        mod.load_features(mod.parse_args(["--layers", "1,4"]), tiny, tmp_path / "other")
