"""eval/gpu_check.py, the one prepared GPU check, end to end on tiny shapes on the CPU (--tiny): every section of
its report, every replay's counts as recorded in the committed traces, and the report rebuilt from its JSON."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACES = "eval/results/sweep_gpu_traces"


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "eval" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def multi_h_traces(folder: Path) -> Path:
    """The committed trace sweep with its SpecDec++ rows again as h = 0.5 (the same rounds): a trace set of two h
    and three K, as configs/sweep/gpu_traces_dev.yaml records."""
    folder.mkdir()
    cfg = json.loads((ROOT / TRACES / "config.json").read_text())
    cfg["config"]["thresholds"] = [0.5, 0.7]
    (folder / "config.json").write_text(json.dumps(cfg))
    rows = [json.loads(line) for line in (ROOT / TRACES / "results.jsonl").read_text().splitlines() if line.strip()]
    extra = [{**r, "h": 0.5, "config": r["config"].replace("h=0.7", "h=0.5")} for r in rows if r["method"] == "learned"]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + extra))
    return folder


@pytest.fixture(scope="module")
def drafter_traces(tmp_path_factory):
    """A feature drafter's trace sweep on tiny models, as configs/sweep/gpu_traces_drafter.yaml records the committed
    one: the target alone, fixed K = 2..4 and SpecDec++ with a head of the drafter's statistics, T = 1 top-k 50."""
    from transformers import AutoModelForCausalLM

    from adaptive_spec.drafter.model import FeatureDrafter
    from adaptive_spec.evaluation import sweep
    from adaptive_spec.heads.head import AcceptanceHead
    from tiny import save_model

    root = tmp_path_factory.mktemp("drafter_traces")
    target = save_model(root / "target", vocab_size=32, hidden_size=24, seed=2, logit_scale=4.0)
    FeatureDrafter.for_target(AutoModelForCausalLM.from_pretrained(target)).save_pretrained(root / "drafter")
    AcceptanceHead(24, depth=1, draft_model=f"feature:{root / 'drafter'}", feature="context", inputs="stats",
                   stats_sampling={"temperature": 1.0, "top_k": 50}).save_pretrained(root / "head")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("abc abc abc", "hello world")))
    out = root / "sweep"
    assert sweep.main([f"pair.draft=feature:{root / 'drafter'}", f"pair.target={target}", "pair.dtype=fp32",
                       "pair.threads=1", f"datasets=[{prompts}]", "n_prompts=2", "max_new_tokens=12", "ks=[2,3,4]",
                       f"heads=[{root / 'head'}]", "thresholds=[0.7]", "include_draft_ar=false", "temperature=1.0",
                       "top_k=50", f"out_dir={out}", "progress=false", "record_trace=true"]) == 0
    return out


def test_a_sweep_records_a_feature_drafters_traces(drafter_traces):
    """`draft: feature:PATH` with record_trace: every drafted round is the drafter's ("model"), and trace_pair names
    it as a feature drafter (no hub id)."""
    from adaptive_spec.decoding.replay import check_trace

    rows = [json.loads(line) for line in (drafter_traces / "results.jsonl").read_text().splitlines()]
    configs = [r["config"] for r in rows[:5]]
    assert configs[:4] == ["ar", "fixed:k=2", "fixed:k=3", "fixed:k=4"] and configs[4].startswith("learned:")
    for r in rows:  # the target alone books no rounds
        assert r["trace"] == [] if r["method"] == "ar" else {s for k, _, s in check_trace(r["trace"], r["n_tokens"])
                                                             if k} == {"model"}
    tp = json.loads((drafter_traces / "config.json").read_text())["trace_pair"]
    assert tp["draft"]["drafter"] == "feature" and tp["draft"]["hub_id"] is None and tp["preset"] is None
    assert tp["draft"]["name"].startswith("feature:") and tp["draft"]["fingerprint"].startswith("feature-")
    assert json.loads((drafter_traces / "settings.json").read_text())["settings"]["draft"] == tp["draft"]["name"]


def test_the_tiny_check_writes_every_section(tmp_path, drafter_traces):
    """About 30 s on 2 idle cores (a minute on busy ones): two chi-squares of 400 generations, 3 models, 2 pairs
    replayed with one host read a round, a profiled generation per policy, the drafter's traces replayed, two fresh
    processes' first token."""
    check = load_check()
    out = tmp_path / "check"
    traces_dir = multi_h_traces(tmp_path / "traces")
    assert check.main(["--tiny", "--device", "cpu", "--pairs", "default,coder-0.5b-7b", "--iters", "1",
                       "--host-reads", "round", "--traces", str(traces_dir), "--drafter-traces", str(drafter_traces),
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
        top = m["top_kernels"]["top"]
        assert top and top[0]["us_per_step"] > 0 and 0 < sum(t["share"] for t in top) <= 1 + 1e-9
    default, borrowed = res["replay"]
    assert default["label"].startswith("measured acceptance") and borrowed["label"].startswith("BORROWED")
    traces = check.load_traces(traces_dir)
    for rp in (default, borrowed):
        assert [p["config"] for p in rp["policies"]] == list(traces["by_config"])
        assert {p["method"] for p in rp["policies"]} == {"ar", "fixed", "learned"}
        assert all(p["counts_reproduced"] and p["tok_s"] > 0 for p in rp["policies"])
        assert all(p["est_speedup"] > 0 for p in rp["policies"] if p["method"] != "ar")
        assert rp["best_fixed"].startswith("fixed:")
        for p in rp["policies"]:  # one read of the device a round, device-decided stops included
            assert p["host_reads_per_round"] == 1.0
            prof, o = p["profile"], p["outside"]
            assert prof["per_round"]["aten_ops"] > 0 and prof["rounds"] > 0
            assert (prof["per_drafted"] is None) == (p["method"] == "ar")
            assert 0 < o["share"] < 1 and o["ms_per_round"] > 0
            assert (o["ms_per_drafted"] or 0) > 0 or p["method"] == "ar"
        h, k = rp["picks"]["h"], rp["picks"]["k"]
        assert h["best"] in (0.5, 0.7) and set(h["replayed"]) == {"0.5", "0.7"} and k["best"] in (1, 2, 3)
        for e in (h, k):  # auto priced the curve's points at the replayed values with the costs measured here
            assert e["auto"] == "ar" or e["auto"] in map(float, e["replayed"])
            assert 0 < e["auto_ratio"] <= 1 and e["within_3pct"] == (e["auto_ratio"] >= 0.97)
    assert res["loop_times"]["sample"]["row"] > 0
    assert [(f["runtime"], f["cache"]) for f in res["first_token"]] == [("eager", "cold"), ("eager", "warm")]
    for f in res["first_token"]:
        assert f["tokens"] == 1 and 0 < f["generate_s"] < f["first_token_s"] <= f["process_s"]
    assert [a["pair"] for a in res["assisted"]] == ["default:tiny", "coder-0.5b-7b:tiny"]
    assert all(a["assisted_tok_s"] > 0 for a in res["assisted"]) and "padded" in res["assisted"][1]["note"]
    assert set(res["elapsed_s"]) == {"start-up", "1 exactness", "2 runtimes", "2b drafter", "3 replay",
                                     "3b drafter replay", "4 assisted", "5 first token", "6 compile"}
    dr = res["drafter_replay"]
    assert [p["config"] for p in dr["policies"]] == list(check.load_traces(drafter_traces)["by_config"])
    assert dr["counts_reproduced"] and all(p["counts_reproduced"] and p["tok_s"] > 0 for p in dr["policies"])
    assert dr["target"] == "tiny:Qwen/Qwen2.5-Coder-1.5B-Instruct" and dr["best_fixed"].startswith("fixed:k=")
    assert [e["config"] for e in dr["specdec"]] == [p["config"] for p in dr["policies"] if p["method"] == "learned"]
    md = (out / "report.md").read_text()
    for section in ("## 1. Exactness", "## 2. Step times per model and runtime", "## 3. Replayed traces",
                    "## 4. transformers' assisted generation", "## 5. The first token", "CPU smoke run",
                    "**measured acceptance", "(best fixed K)", "Elapsed per phase", "Top of one fused one-token step",
                    "**BORROWED acceptance: traces of default replayed on coder-0.5b-7b:tiny's shapes**",
                    "Host work per round", "best replayed h:", "best replayed K:", "auto's pick from these costs",
                    "## 3b. The feature drafter's traces replayed", "x the target's own AR (bar >= 2.0",
                    "counts as recorded in every replayed policy: yes"):
        assert section in md, section
    assert json.loads((out / "run.json").read_text()) == {"script": "eval/gpu_check.py", "report": "report.md"}
    copy = shutil.copytree(out, tmp_path / "copy", ignore=shutil.ignore_patterns("report.md"))
    assert check.main(["--report-only", "--out", str(copy)]) == 0
    assert (copy / "report.md").read_text() == md
    drafter_step_is_timed_against_its_target(check, res, md, tmp_path)


def drafter_phase(check, folder: Path) -> dict:
    """Phase 3b alone on the tiny default target (eager), its traces from `folder`: (its entry, its report)."""
    from adaptive_spec.backends import presets

    pair = presets.preset("default", tiny=True)
    hub, model = pair.target.hub_id, presets.build_model(pair.target)
    args = check.parse_args(["--tiny", "--device", "cpu", "--drafter-traces", str(folder)])
    res = {"models": {hub: {"replay_runtime": "eager"}}, "notes": []}
    check.drafter_replay(args, res, check.Budget(600), pair, {hub: (model, "timed")})
    return res["drafter_replay"], "\n".join(check.dr_.drafter_replay_md(res))


def test_a_broken_drafter_trace_is_reported_and_none_is_skipped(drafter_traces, tmp_path):
    """A trace row whose accepted count is not what its rounds accept is replayed as NOT reproduced (its config
    only); a folder without traces skips the phase with the command that records them."""
    check = load_check()
    broken = shutil.copytree(drafter_traces, tmp_path / "broken")
    rows = [json.loads(line) for line in (broken / "results.jsonl").read_text().splitlines()]
    bad = next(r for r in rows if r["config"] == "fixed:k=3")
    bad["n_accepted"] += 1
    (broken / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got, md = drafter_phase(check, broken)
    assert len(got["policies"]) == 5 and all(p["tok_s"] > 0 for p in got["policies"])
    assert [p["config"] for p in got["policies"] if not p["counts_reproduced"]] == ["fixed:k=3"]
    line = next(x for x in md.splitlines() if x.startswith("| fixed:k=3"))
    assert not got["counts_reproduced"] and "| NO |" in line and "every replayed policy: NO" in md
    got, md = drafter_phase(check, tmp_path / "none")
    assert "no drafter traces" in got["skipped"] and "policies" not in got
    assert "Not run: no drafter traces at" in md and "configs/sweep/gpu_traces_drafter.yaml" in md


def reported_c(md: str) -> dict:
    """c per runtime as the drafter section's table prints it."""
    section = md.split("## 2b. Feature drafter step")[1].split("\n## ")[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ")]
    return {r[0].strip(): float(r[3]) for r in rows if len(r) == 5 and r[0].strip() != "runtime"}


def drafter_step_is_timed_against_its_target(check, res, md, tmp_path):
    """The drafter of the default target timed (runner and eager on a CPU, no graphs) and c computed from the
    run's numbers; the control: a JSON with the drafter's eager step halved reports half its c."""
    d = res["drafter"]
    assert d["target"] == "tiny:Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert d["context"] == res["models"][d["target"]]["context"]
    assert set(d["rows"]) == {"runner", "eager"} and "cudagraph" in d["skipped"]
    assert all(r["step_ms"] > 0 for r in d["rows"].values())
    best = min(r["step_ms"] for r in res["models"][d["target"]]["rows"].values())
    assert d["c"] == {rt: r["step_ms"] / best for rt, r in d["rows"].items()}
    assert "## 2b. Feature drafter step" in md and "| cudagraph | skipped: CUDA only" in md
    c = reported_c(md)
    assert set(c) == {"runner", "eager"} and all(abs(c[rt] - d["c"][rt]) <= 5e-4 for rt in c)
    halved = tmp_path / "halved"
    halved.mkdir()
    d["rows"]["eager"]["step_ms"] /= 2
    (halved / "gpu_check.json").write_text(json.dumps(res))
    assert check.main(["--report-only", "--out", str(halved)]) == 0
    got = reported_c((halved / "report.md").read_text())
    assert abs(got["eager"] - d["c"]["eager"] / 2) <= 5e-4 and got["runner"] == c["runner"]


def test_the_drafter_step_on_static_buffers_is_the_runners_step():
    """The step the check captures as a CUDA graph (static KV cache, fixed buffers) computes what FeatureRunner
    drafts at the same position; the control: without its prefilled context it does not."""
    import torch

    from adaptive_spec.backends import presets
    from adaptive_spec.drafter.source import FeatureRunner
    from adaptive_spec.drafter.step import DrafterStep
    from adaptive_spec.evaluation import drafter_step as ds

    pair, ctx = presets.preset("default", tiny=True), 40
    drafter, readout = ds.build_drafter(presets.build_model(pair.target), pair.vocab_size, tiny=True)
    states = ds.TargetStates(ctx, drafter.hidden_size, drafter.dtype, "cpu")
    ids = torch.randint(0, pair.vocab_size, (ctx + 1,), generator=torch.Generator().manual_seed(0))
    runner = FeatureRunner(drafter, readout, states)
    runner.forward(ids[:ctx], n_logits=0)
    want = torch.softmax(runner.forward(ids[ctx:ctx + 1], 1)[0][0, readout.kept_ids], -1)
    step = ds.static_step(drafter, readout, states, ids, ctx, max_cache=64)
    with torch.inference_mode():
        q, nxt = step.step()
    f_hat = runner._outs[ctx - 1]  # the runner's f^ of the drafted slot, which the step writes back to feed
    assert torch.allclose(q[0], want, atol=1e-6) and int(nxt) == int(readout.kept_ids[want.argmax()])
    assert torch.allclose(step.feat.view(-1), f_hat, atol=1e-5) and f_hat.abs().max() > 0.1
    assert int(step.pos) == ctx and int(step.tok) == int(nxt)
    bare = DrafterStep(drafter, readout, 64)
    bare.pos.fill_(ctx - 1)
    bare.tok.copy_(ids[ctx].view(1, 1))
    bare.feat.copy_(states.features(ctx - 1, ctx).view_as(bare.feat))
    with torch.inference_mode():
        bare.step()
    assert (bare.feat.view(-1) - f_hat).abs().max() > 1e-2


def test_replay_picks_check_auto_against_the_best_replayed():
    from adaptive_spec.decoding.auto import Costs
    from adaptive_spec.evaluation.gpu_bench import replay_picks

    point = lambda h, tgt: {"h": h, "n_tokens": 100, "n_target_forwards": tgt, "n_draft_forwards": 300 - 2 * tgt,
                            "n_drafted": 300 - 2 * tgt, "n_accepted": 100 - tgt, "n_discarded": 200 - tgt}
    curve = {"k_max": 20, "thresholds": [point(0.3, 60), point(0.5, 40), point(0.9, 30)], "fixed_k": []}
    costs = Costs(0.001, 0.010, 0.0, "k", "now")  # a cheap draft: the fewest target passes win (h = 0.9)
    pols = [{"method": "ar", "tok_s": 50.0}, {"method": "learned", "value": 0.3, "tok_s": 60.0},
            {"method": "learned", "value": 0.5, "tok_s": 70.0}, {"method": "learned", "value": 0.9, "tok_s": 69.0}]
    e = replay_picks(pols, curve, costs, "sample", 20)["h"]
    assert e["best"] == 0.5 and e["auto"] == 0.9 and e["within_3pct"] and e["unrestricted"] == 0.9
    pols[3]["tok_s"] = 60.0  # the control: auto's pick replays 14% below the best
    e = replay_picks(pols, curve, costs, "sample", 20)["h"]
    assert e["auto"] == 0.9 and not e["within_3pct"] and abs(e["auto_ratio"] - 60 / 70) < 1e-12
    assert "k" not in replay_picks(pols, curve, costs, "sample", 20)  # one K or none replayed: nothing to pick


def test_profiles_count_outermost_ops_and_rows_share_prompts():
    from adaptive_spec.decoding.replay import check_trace, covering_trace
    from adaptive_spec.evaluation.gpu_bench import select_rows
    from adaptive_spec.evaluation.round_profile import _outermost

    assert _outermost([(0, 10), (1, 5), (2, 3), (10, 12), (11, 12), (20, 21)]) == 3
    rows = lambda c: [{"config": c, "dataset": d, "prompt_idx": i} for d in ("a", "b") for i in range(3)]
    picked = select_rows({"x": rows("x"), "y": rows("y")}, 3)
    assert [(r["dataset"], r["prompt_idx"]) for r in picked["x"]] == [("a", 0), ("a", 1), ("b", 0)]
    assert [(r["dataset"], r["prompt_idx"]) for r in picked["y"]] == [("a", 0), ("a", 1), ("b", 0)]
    cover = covering_trace([[[3, 1, "model"], [0, 0, "none"]], [[1, 1, "model"], [2, 0, "ngram"]]])
    assert cover == [[1, 0, "model"], [1, 1, "model"], [3, 0, "model"], [3, 3, "model"]]
    check_trace(cover, sum(n + 1 for _, n, _ in cover))


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


def test_a_compiling_runner_keeps_the_compile_caches_in_the_project_cache(tmp_path, monkeypatch):
    import os

    import torch._inductor.config as inductor_config

    from adaptive_spec.backends.static_runner import StaticCausalLM
    from adaptive_spec.backends.toy import make_model

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_FX_GRAPH_CACHE", raising=False)
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    model = make_model(5, hidden_size=16, layers=1)
    # torch.compile writes inductor's default folder into the environment: not the user's choice, replaced
    StaticCausalLM(model, 5, max_cache_len=8, compile=True, compiler="eager")
    StaticCausalLM(model, 5, max_cache_len=8, compile=True)  # nothing compiles before a warm-up
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor") and inductor_config.fx_graph_cache
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's folder wins
    StaticCausalLM(model, 5, max_cache_len=8, compile=True)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
