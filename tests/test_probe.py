"""`adaptive-spec probe`: each configuration priced as `auto` prices it, from fixed cost tables (no timing);
one run on tiny models for the measuring path, the cache and the JSON."""
import json
from types import SimpleNamespace

import pytest

from adaptive_spec.decoding import auto as A
from adaptive_spec.decoding.auto import Costs, coef_of, predict_time, resolve_auto
from adaptive_spec.backends import engines
from adaptive_spec.evaluation import probe
from adaptive_spec.heads.curve import curve_path
from adaptive_spec.params import policy_params

HEAD = probe.DEFAULT_HEAD  # committed, with its threshold_curve.json
DEV = probe.dev_answers()  # the committed heads' dev answers, which the probe replays prompt lookup on
LOOP = {"sample": {"row": 0.0005, "round": 0.0002}, "greedy": {"row": 0.0002, "round": 0.0001}}


def costs(t1, v, c, longs=None, prefill=0.02, prefill_draft=0.01):
    """A cost table: one-row step t1 seconds, v(1..9) in steps, a draft step c target steps."""
    return Costs(c * t1, t1, 0.0, "fixed", "test", tuple(t1 * x for x in v), prefill, prefill_draft, LOOP,
                 {n: t1 * x for n, x in (longs or {}).items()} or None)


# the 2-core AVX2 EPYC on llama.cpp: a 4-row pass costs 2.81 steps, a draft step 0.88
SLOW_PASSES = costs(0.2075, (1.00, 1.52, 2.00, 2.81, 3.2, 3.6, 4.0, 4.4, 4.8), 0.88,
                    {12: 6.0, 16: 8.0, 24: 12.0, 32: 16.0, 48: 24.0})
# a memory-bound step: passes of up to 9 rows cost about one step, a draft step 0.3
CHEAP_PASSES = costs(0.1, (1.0, 1.0, 1.02, 1.04, 1.06, 1.1, 1.2, 1.3, 1.4), 0.3,
                     {12: 1.6, 16: 1.9, 24: 2.6, 32: 3.3, 48: 4.8})


def fake_pair(c, engine="llama.cpp", draft=True):
    """What resolve_auto and measure_costs read of a pair: its engine, its picks, its pinned costs."""
    return SimpleNamespace(engine=engines.get(engine), auto_picks={}, pinned_costs=c,
                           draft=object() if draft else None)


by_name = A.by_name


def predict(pair, *args, **kw):
    """auto's prediction as the probe makes it: prompt lookup and combined replayed on the dev answers."""
    return A.predict(pair, *args, answers=kw.pop("answers", DEV), **kw)


@pytest.mark.parametrize("engine", ["llama.cpp", "torch"])
def test_where_passes_cost_steps_drafting_does_not_pay_and_auto_runs_the_target_alone(engine):
    result = predict(fake_pair(SLOW_PASSES, engine), HEAD, 1.0, 128, 128)
    rows = by_name(result)
    ar = rows["target alone"]["decode_tokens_per_s"]
    # one step and the loop's time per row: what auto's target-alone rate is
    assert ar == pytest.approx(1 / (0.2075 + 0.0005))
    assert rows["SpecDec++ h=auto"]["pick"] == "ar" and rows["SpecDec++ h=auto"]["decode_tokens_per_s"] == ar
    assert "runs the target alone" in rows["SpecDec++ h=auto"]["reason"]
    assert rows["SpecDec++ h=auto"]["best"]["speedup"] < 1 and rows["fixed"]["speedup"] < 1
    assert "drafting does not pay" in rows["fixed"]["reason"]
    # its fallback is the target alone: combined is prompt lookup's rounds
    assert rows["combined"]["decode_tokens_per_s"] == rows["prompt lookup"]["decode_tokens_per_s"]
    assert "joint" not in rows["combined"] and not rows["combined"]["drafts"]
    # where every row costs most of a step, prompt lookup copies little on the dev answers: about the target
    # alone (on the table model; torch's line model prices a pass at one step whatever its rows)
    if engine == "llama.cpp":
        assert rows["prompt lookup"]["speedup"] == pytest.approx(1.0, abs=0.03)
    fastest = max(result["configurations"], key=lambda r: r["decode_tokens_per_s"])
    assert fastest["name"] in ("target alone", "prompt lookup")
    assert f"fastest here: {fastest['name']}" in probe.render(result)


def test_where_passes_are_cheap_the_rows_are_autos_picks_and_their_reasons_hold_their_numbers():
    pair = fake_pair(CHEAP_PASSES, "torch")
    result = predict(pair, HEAD, 1.0, 128, 128)
    rows = by_name(result)
    learned = resolve_auto(fake_pair(CHEAP_PASSES, "torch"), policy_params("learned", head=HEAD, threshold="auto"),
                           temperature=1.0)[1]
    assert learned["value"] != "ar" and rows["SpecDec++ h=auto"]["pick"] == learned["value"]
    assert rows["SpecDec++ h=auto"]["decode_tokens_per_s"] == pytest.approx(learned["tokens_per_s"])
    assert rows["SpecDec++ h=auto"]["speedup"] > 1.2 and "drafting pays" in rows["SpecDec++ h=auto"]["reason"]
    fixed = rows["fixed"]
    k = fixed["policy"]["k"]
    assert fixed["decode_tokens_per_s"] == max(pair.auto_picks[next(key for key in pair.auto_picks
                                                                    if key[1] == "k")]["predicted"].values())
    # the reason's round (tokens and steps) is the prediction: speed-up = tokens a round / steps a round
    r = fixed["round"]
    assert fixed["speedup"] == pytest.approx(r["tokens"] / r["steps"])
    assert f"a {k + 1}-row pass costs" in fixed["reason"] and f"{r['tokens']:.2f} tokens" in fixed["reason"]
    # combined is replayed jointly: SpecDec++'s rounds where nothing is copied, so its rounds are about SpecDec++'s
    # with some copying rounds among them, and the draft catches up on what those made
    joint, auto = rows["combined"]["joint"], rows["SpecDec++ h=auto"]["round"]
    assert joint["n_tokens"] / joint["n_target_forwards"] == pytest.approx(auto["tokens"], rel=0.15)
    assert joint["n_fed_extra"] > 0 and "replayed on" in rows["combined"]["reason"]


def test_a_second_measurement_prices_the_configurations_the_first_one_chose():
    """predict(ran=...): the K and h another probe chose, priced at these costs (eval/bench_probe.py's measurement
    after the runs), not these costs' own choice: on SLOW_PASSES alone auto would run the target alone."""
    cheap = predict(fake_pair(CHEAP_PASSES, "torch"), HEAD, 1.0, 128, 128)
    ran = A.picks_of(cheap)
    assert ran["pick"][0] != "ar"
    own = by_name(predict(fake_pair(SLOW_PASSES, "torch"), HEAD, 1.0, 128, 128))
    assert own["SpecDec++ h=auto"]["pick"] == "ar"  # the control: its own choice differs
    slow_pair = fake_pair(SLOW_PASSES, "torch")
    rows = by_name(predict(slow_pair, HEAD, 1.0, 128, 128, ran=ran))
    auto = rows["SpecDec++ h=auto"]
    assert (auto["pick"], auto["pick_k_max"]) == ran["pick"] and rows["fixed"]["policy"]["k"] == ran["k"]
    choice = next(c for key, c in slow_pair.auto_picks.items() if key[1] == "h")
    h, cap = ran["pick"]
    assert auto["decode_tokens_per_s"] == pytest.approx(choice["predicted_capped"][f"{h:g}@{cap}"] if cap
                                                        else choice["predicted"][h])
    assert auto["decode_tokens_per_s"] < own["SpecDec++ h=auto"]["decode_tokens_per_s"]  # drafting at slow costs
    assert f"h = {h:g}" in auto["reason"] and "drafting does not pay" in auto["reason"]
    assert rows["combined"]["drafts"] and "joint" in rows["combined"]  # its fallback drafts at the h that ran
    # a result without drafting has no picks to carry
    assert A.picks_of(predict(fake_pair(CHEAP_PASSES, draft=False), None, 1.0, 128, 128)) is None


def test_prompt_lookup_pays_in_a_long_copy_only_where_a_many_row_pass_is_cheap():
    coef = lambda c: {"t_draft": c.t_draft, "t_target": c.t_target, "t_cand": 0.0, "verify_s": c.verify_s}  # noqa: E731
    cheap = A.copy_round(CHEAP_PASSES, coef(CHEAP_PASSES), 48)
    assert cheap["k"] >= 8 and cheap["tokens_per_s"] * 0.1 > 3  # > 3x a 0.1 s step
    # every row a step (v(n) = n): no copy pays for its row
    linear = costs(0.1, tuple(range(1, 10)), 0.3, {n: n for n in (12, 16, 24, 32, 48)})
    none = A.copy_round(linear, coef(linear), 48)
    assert none["k"] == 0 and none["tokens_per_s"] == pytest.approx(10.0)
    rows = by_name(predict(fake_pair(linear, draft=False), None, 1.0, 128, 128))
    assert set(rows) == {"target alone", "prompt lookup"}  # no draft: no draft configurations
    assert rows["prompt lookup"]["copying"]["speedup"] == 1.0 and "no copy pays" in rows["prompt lookup"]["reason"]


def test_prompt_lookup_is_the_policy_replayed_along_the_dev_answers(tmp_path):
    """copy_counts: NgramPolicy's own rounds along the committed dev answers, priced at the costs' v(n): cheap
    passes make its copies pay, passes of a step a row make it copy nothing (every round a plain step: exactly
    the target alone); without the data the row says it prices plain steps."""
    from adaptive_spec.decoding.ngram import NgramPolicy, replay_copies

    cheap = by_name(predict(fake_pair(CHEAP_PASSES, "torch"), HEAD, 1.0, 128, 128))["prompt lookup"]
    c = cheap["copies"]
    assert c["n_responses"] > 100 and c["n_drafted"] > 0 and 0 < c["n_accepted"] < c["n_drafted"]
    assert cheap["speedup"] > 1.05 and "dev answers" in cheap["reason"]
    linear = costs(0.1, tuple(range(1, 10)), 0.3, {n: n for n in (12, 16, 24, 32, 48)})
    none = by_name(predict(fake_pair(linear, draft=False), None, 1.0, 128, 128))["prompt lookup"]
    assert none["copies"]["n_drafted"] == 0 and none["speedup"] == pytest.approx(1.0)
    absent = by_name(predict(fake_pair(CHEAP_PASSES, "torch"), HEAD, 1.0, 128, 128,
                             answers=probe.dev_answers(tmp_path)))["prompt lookup"]
    assert absent["speedup"] == 1.0 and "a plain step where nothing is copied" in absent["reason"]
    # one answer by hand, rows free (every copy pays, up to the match's length): "1", "2" find no 2-gram; after
    # "1 2" the prompt's continuation "3 4" is copied (a 2-token match: 2 copies) and accepted, "5" follows;
    # after "2 3 4 5" (a 5-token match) one copy fits before the end, "6", rejected for "9"; the last "9" alone
    policy = NgramPolicy(2, 4, "auto", 48, verify_steps=lambda n: 1.0)
    r = replay_copies(policy, [7, 1, 2, 3, 4, 5, 6, 8], [1, 2, 3, 4, 5, 9, 9])
    assert (r["n_drafted"], r["n_accepted"], r["n_target_forwards"]) == (3, 2, 5)
    assert r["target_pass_hist"] == {"1": 3, "3": 1, "2": 1}


def test_wall_adds_the_prompts_prefill_at_the_measured_rates():
    rows = by_name(predict(fake_pair(CHEAP_PASSES, "torch"), HEAD, 1.0, 101, 128))
    for name, drafts in (("target alone", False), ("SpecDec++ h=auto", True), ("prompt lookup", False),
                         ("combined", True)):
        r = rows[name]
        prefill = 100 * (0.02 + (0.01 if drafts else 0.0))
        assert r["wall_tokens_per_s"] == pytest.approx(128 / (128 / r["rate_tokens_per_s"] + prefill))
    # the combined policy's draft reads the prompt in its first model round: in decode time
    auto, combined = rows["SpecDec++ h=auto"], rows["combined"]
    assert auto["decode_tokens_per_s"] == auto["rate_tokens_per_s"]
    assert combined["decode_tokens_per_s"] == pytest.approx(128 / (128 / combined["rate_tokens_per_s"] + 100 * 0.01))


def test_greedy_prices_the_greedy_loop():
    slow_loop = costs(0.1, (1.0,) * 9, 0.3)
    slow_loop.loop = {"greedy": {"row": 0.05, "round": 0.0}, "sample": {"row": 0.0, "round": 0.0}}
    greedy = by_name(predict(fake_pair(slow_loop, draft=False), None, 0.0, 128, 128))
    sampled = by_name(predict(fake_pair(slow_loop, draft=False), None, 1.0, 128, 128))
    assert greedy["target alone"]["decode_tokens_per_s"] == pytest.approx(1 / 0.15)
    assert sampled["target alone"]["decode_tokens_per_s"] == pytest.approx(1 / 0.1)


@pytest.mark.parametrize("argv, needle", [
    (["--head", "no/such/head"], "no/such/head"),
    (["--prompt-tokens", "0"], "--prompt-tokens must be >= 1, got 0"),
    (["--backend", "onnx"], "onnx"),
    (["--draft-quant", "int3"], "int3"),
    (["--workload", "poetry"], "unknown kind 'poetry'"),
])
def test_refusals_are_one_line_before_any_model_loads(argv, needle, capsys):
    assert probe.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_a_probe_on_tiny_models_measures_once_then_reads_the_cache(tmp_path, monkeypatch, capsys):
    from adaptive_spec.backends.toy import save_model

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path / "cache"))
    target = save_model(tmp_path / "target", vocab_size=32, hidden_size=16, seed=1)
    argv = ["--target", str(target), "--draft", "none", "--dtype", "fp32", "--device", "cpu", "--threads", "1",
            "--reps", "1", "--json"]
    assert probe.main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert not first["cached"] and (tmp_path / "cache" / "costs").is_dir()
    assert [r["name"] for r in first["configurations"]] == ["target alone", "prompt lookup"]
    assert probe.main(argv) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["cached"] and second["costs"] == first["costs"] and second["cache"] == first["cache"]
    assert probe.main(argv[:-1]) == 0
    assert "fastest here:" in capsys.readouterr().out


def test_the_benchmark_sweeps_what_the_probe_priced_and_tables_the_errors(tmp_path):
    """eval/bench_probe.py: the sweep it runs holds each configuration the probe priced (the drafting h too where
    auto runs the target alone), and its report sets each prediction beside the pooled measured rows."""
    import importlib.util

    from adaptive_spec.evaluation.paired import run_header
    from adaptive_spec.evaluation.sweep_config import SweepConfig
    from adaptive_spec.evaluation.sweep_grid import Source, build_grid
    from adaptive_spec.runs import PROJECT_ROOT

    spec = importlib.util.spec_from_file_location("bench_probe", PROJECT_ROOT / "eval" / "bench_probe.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = predict(fake_pair(SLOW_PASSES), HEAD, 1.0, 128, 64)
    args = SimpleNamespace(threads=2, torch_draft_quant="int8", datasets="humaneval", prompts=1, max_new_tokens=64)
    cfg = bench.sweep_config(result, "llama.cpp", args)
    typed = SweepConfig(**{k: v for k, v in cfg.items() if k != "pair"})
    grid = build_grid(typed)[0]
    assert [s.key for s in grid][:3] == ["ar", "fixed:k=1", f"learned:head={HEAD.split('/')[-1]}:h=auto"]
    assert [s.key for s in grid if s.source is Source.POLICIES] == ["prompt lookup", "combined", bench.BEST_H]
    # measured rows: every configuration at the target alone's speed but the fixed K, 10% under its prediction
    ar = result["configurations"][0]["decode_tokens_per_s"]
    k = next(r for r in result["configurations"] if r["name"].startswith("fixed"))
    rows = [{"config": c, "method": m, "n_tokens": 64, "n_prompt_tokens": 101, "prefill_s": 0.0,
             "wall_s": 64 / tps, "n_target_forwards": 64, "target_pass_hist": {"1": 64}} for c, m, tps in (("ar", "ar", ar), ("fixed:k=1", "fixed", 0.9 * k["decode_tokens_per_s"]),
                                                   ("x", "learned_auto", ar), ("prompt lookup", "ngram", ar),
                                                   ("combined", "ngram", ar), (bench.BEST_H, "learned", ar))]
    out = tmp_path / "bench"
    (out / "sweep_llama.cpp").mkdir(parents=True)
    (out / "probe_llama.cpp.json").write_text(json.dumps(result))
    (out / "sweep_llama.cpp" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_header(out, False, lambda: {"script": "eval/bench_probe.py", "engines": ["llama.cpp"], "datasets": "humaneval",
                                    "prompts": 1, "max_new_tokens": 64, "threads": 2, "cpu": "CPU: test"})
    assert bench.main(["--report-only", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "| target alone | 1 | " in md and "| +0.0% |" in md
    # 1 / 0.9 - 1: the fixed K row misses the goal; prefill 0 in the rows against 100 tokens of it predicted
    assert f"| fixed K=1 | 1 | {k['decode_tokens_per_s']:.2f} | {0.9 * k['decode_tokens_per_s']:.2f} | +11.1% |" in md
    assert "**no**" in md and "Largest error:" in md
    # measured again after the runs, 20% slower: each row judged on the mean of the two (per token)
    slow = costs(0.2075 * 1.2, (1.00, 1.52, 2.00, 2.81, 3.2, 3.6, 4.0, 4.4, 4.8), 0.88,
                 {12: 6.0, 16: 8.0, 24: 12.0, 32: 16.0, 48: 24.0})
    after = predict(fake_pair(slow), HEAD, 1.0, 128, 64, ran=A.picks_of(result))
    (out / "probe_llama.cpp_after.json").write_text(json.dumps(after))
    assert bench.main(["--report-only", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    a = after["configurations"][0]["decode_tokens_per_s"]
    mean = 2 / (1 / ar + 1 / a)
    assert f"| target alone | 1 | {ar:.2f} | {ar:.2f} (+0.0%) | {a:.2f} ({100 * (a / ar - 1):+.1f}%) | {mean:.2f} | " \
           f"{100 * (mean / ar - 1):+.1f}% |" in md, md
    assert "+20.0%" in md and "Largest error of the mean of both:" in md
    # the error split: the rows' own counts (64 one-row passes each) priced at the mean costs are the target
    # alone's rate, whatever configuration ran them
    assert "Where the error comes from" in md and f"| target alone | 1.00 | — | — | {mean:.2f} | " in md, md
    # speed-ups over the target alone, measured and predicted side by side: the fixed K row's 10% shortfall stays
    kd = k["decode_tokens_per_s"]
    assert "Speed-ups over the target alone" in md and f"| fixed K=1 | {0.9 * kd / ar:.2f}x | {kd / ar:.2f}x | +11.1% |" in md


def test_the_combined_replay_runs_draft_rounds_where_nothing_is_copied_and_counts_the_drafts_catch_up():
    """replay_copies with a model_round: by hand. Rows free and draft steps dear (10 steps), so every copy found
    beats the draft model's rounds; those (a fake: 2 drafted, both accepted, or 3 drafted, 1 accepted, capped as
    the decoder caps them) run where no copy is found."""
    from adaptive_spec.decoding.interfaces import StopPolicy
    from adaptive_spec.decoding.ngram import NgramPolicy, replay_copies

    policy = NgramPolicy(2, 4, "auto", 48, verify_steps=lambda n: 1.0, fallback=StopPolicy(), draft_steps=10.0)
    calls = []

    def model_round(s, remaining):
        calls.append(s)
        k, a = (2, 2) if s == 0 else (3, 1)
        return min(k, remaining - 1), min(a, remaining - 1)

    # prompt 7 1 2 3 4 8, answer 1 2 3 4 5 6 9 9. s=0: no 2-gram yet, a model round: 2 drafted and accepted, with
    # the bonus "1 2 3". s=3: "1 2 3" recurs in the prompt: a copy round, "4" accepted, "8" rejected for "5". s=5:
    # "4 5" recurs nowhere: a model round of 2 (3 capped by the 3 tokens left), 1 accepted ("6 9"). s=7: one token
    # left, a round of 0 candidates
    r = replay_copies(policy, [7, 1, 2, 3, 4, 8], [1, 2, 3, 4, 5, 6, 9, 9], model_round)
    assert calls == [0, 5, 7] and r["n_target_forwards"] == 4 and r["n_tokens"] == 8
    assert r["n_accepted"] == 2 + 1 + 1 and r["n_draft_forwards"] == 2 + 2 and r["target_pass_hist"]["1"] == 1
    # the first model round was all accepted (y_2 and the bonus unseen by the draft), then the copy round made 2
    # tokens: the second model round's first step feeds those 4, one wide step and 2 tokens beyond two
    assert r["n_all_accepted"] == 1 and r["n_fed_extra"] == 2


def test_where_no_copy_pays_the_combined_replay_samples_specdec_rounds_as_autotune_expects_them():
    """With no copies allowed (at most 0 a round) the joint replay is SpecDec++ alone, its accepted counts drawn
    from P: its tokens a round and all-accepted rounds match the curve's exact expectation (autotune's replay)."""
    import json as _json

    curve = _json.loads((curve_path(HEAD)).read_text())
    point = next(p for p in curve["thresholds"] if p["h"] == 0.3)
    joint = A.combined_counts(CHEAP_PASSES, HEAD, 0.3, curve["k_max"], 0, DEV)
    assert joint["n_responses"] == curve["n_responses"] and joint["n_tokens"] == 4 * curve["n_tokens"]
    assert joint["n_fed_extra"] == 0 and joint["target_pass_hist"].get("1", 0) < 0.01 * joint["n_target_forwards"]
    assert joint["n_tokens"] / joint["n_target_forwards"] == pytest.approx(point["tokens_per_round"], rel=0.02)
    assert joint["n_all_accepted"] / joint["n_target_forwards"] == pytest.approx(
        point["n_all_accepted"] / point["n_target_forwards"], rel=0.05)


def test_a_workload_prices_its_kinds_counts_in_equal_parts():
    import json as _json


    curve = _json.loads((curve_path(HEAD)).read_text())
    coef = coef_of(CHEAP_PASSES, "extended", "sample")
    k_of = lambda section, k: next(p for p in section["fixed_k"] if p["k"] == k)  # noqa: E731
    math = by_name(predict(fake_pair(CHEAP_PASSES, "torch"), HEAD, 1.0, 128, 128, workload=("math",)))
    K = math["fixed"]["policy"]["k"]
    point = k_of(curve["by_source"]["gsm8k-train"], K)
    assert math["fixed"]["rate_tokens_per_s"] == pytest.approx(point["n_tokens"] / predict_time(point, coef))
    # two kinds in equal parts of tokens: the time per token is the mean of theirs
    both = by_name(predict(fake_pair(CHEAP_PASSES, "torch"), HEAD, 1.0, 128, 128, workload=("math", "chat"),
                                 ran=A.picks_of({"configurations": list(math.values())})))
    chat = k_of(curve["by_source"]["sharegpt"], K)
    per_token = [predict_time(p, coef) / p["n_tokens"] for p in (point, chat)]
    assert both["fixed"]["rate_tokens_per_s"] == pytest.approx(2 / sum(per_token))
    # a workload's kinds price prompt lookup on their own answers: math copies more than chat here
    chat_only = by_name(predict(fake_pair(CHEAP_PASSES, "torch"), HEAD, 1.0, 128, 128, workload=("chat",)))
    assert math["prompt lookup"]["copies"]["n_accepted"] / math["prompt lookup"]["copies"]["n_tokens"] > \
        chat_only["prompt lookup"]["copies"]["n_accepted"] / chat_only["prompt lookup"]["copies"]["n_tokens"]
    assert A.parse_workload("mix") is None and A.parse_workload("code, math") == ("code", "math")
    with pytest.raises(Exception, match="unknown kind 'poetry'.*chat, code, math"):
        A.parse_workload("code,poetry")
    with pytest.raises(Exception, match="no counts for prompt source 'sharegpt'"):
        A.check_workload({"by_source": {}}, ("chat",))


def test_a_draft_step_that_feeds_copied_tokens_costs_them_at_the_drafts_prefill_rate():

    c = costs(0.1, (1.0,) * 9, 0.3, prefill_draft=0.004)
    c.t_draft_two = c.t_draft + 0.01
    coef = coef_of(c, "extended")
    row = {"n_tokens": 10, "n_target_forwards": 4, "n_draft_forwards": 6, "n_drafted": 6}
    base = predict_time(row, coef)
    assert predict_time({**row, "n_all_accepted": 2, "n_fed_extra": 5}, coef) == pytest.approx(base + 0.02 + 0.02)
    assert "t_feed" not in coef_of(c, "paper")  # Eq. 3.1 prices every draft step alike
    # fed tokens cost the prefill rate even where a two-token step measured no dearer than a one-token one
    c.t_draft_two = c.t_draft
    assert predict_time({**row, "n_all_accepted": 2, "n_fed_extra": 5}, coef_of(c, "extended")) == \
        pytest.approx(base + 0.02)


# ----------------------------------------------------------------------------- --prompts: the user's own acceptance

class _Head:
    """A context head on MockLM's two-number state: p̂ = sigmoid(0.3 * last token - 0.1 * length)."""
    feature, inputs, depth = "context", "hidden", 0

    def acceptance_prob(self, h):
        import torch

        return torch.sigmoid(0.3 * h[0] - 0.1 * h[1])


def _mock_pair(eos=()):
    from tiny import MockLM

    return SimpleNamespace(target=MockLM(12, seed=1, scale=1.5), draft=MockLM(12, seed=2, scale=1.5),
                           eos_token_ids=list(eos))


def _rounds_by_hand(P, K):
    """Expected (rounds, accepted) over one answer, K[s] candidates from position s (capped at the end): each
    candidate accepted with probability P[s + j] while the ones before it were, by recursion over the outcomes."""
    from functools import lru_cache

    T = len(P)

    @lru_cache(None)
    def f(s):
        if s >= T:
            return 0.0, 0.0
        k = min(K[s], T - s - 1)
        rounds, accepted, reach = 1.0, 0.0, 1.0
        for j in range(k + 1):  # exactly j accepted
            stop = reach * ((1 - P[s + j]) if j < k else 1.0)
            r, a = f(s + j + 1)
            rounds, accepted = rounds + stop * r, accepted + stop * (j + a)
            reach *= P[s + j] if j < k else 0.0
        return rounds, accepted

    return f(0)


def test_the_prompts_curve_is_the_replay_of_what_was_recorded_along_the_targets_answers():
    """acceptance.record on tiny table models: P_i = min(1, p_i(Y_i) / q_i(Y_i)) from the two models' own
    distributions at the target's answer so far, p̂_i the head on the state that produced q_i; the curve made
    from them (autotune.curve_of) equals the expectation worked out by hand per fixed K and per h; shuffling the
    recorded P (the broken control) does not."""
    import numpy as np
    import torch

    from adaptive_spec.decoding.auto import acceptance

    pair, head = _mock_pair(), _Head()
    records = acceptance.record(pair, [[1, 2, 3], [4, 5], [6]], head, 1.0, max_new_tokens=7, budget_s=60)
    assert len(records) == 3 and all(len(r["x"]) == 7 for r in records)
    for r in records:
        seq = list(r["prompt"])
        for i, (x, y) in enumerate(zip(r["x"], r["y"])):
            a = seq[-2] if len(seq) > 1 else 12
            p, q = (m.table[a, seq[-1]].softmax(-1) for m in (pair.target, pair.draft))
            assert r["P"][i] == pytest.approx(min(1.0, float(p[y] / q[y])), rel=1e-5)
            assert r["phat"][i] == pytest.approx(float(head.acceptance_prob(torch.tensor([seq[-1], len(seq)],
                                                                                        dtype=torch.float))))
            seq.append(x)
    curve = acceptance.curve(records, head, "no-head-dir", "tiny", 1.0, k_max=6)
    assert curve["n_tokens"] == 21 and curve["n_responses"] == 3
    for K in (1, 2, 4):
        by_hand = np.sum([_rounds_by_hand(r["P"], [K] * 7) for r in records], axis=0)
        point = next(p for p in curve["fixed_k"] if p["k"] == K)
        assert (point["n_target_forwards"], point["n_accepted"]) == pytest.approx(tuple(by_hand))
    h = 0.5
    stops = [[next((j for j in range(1, 7) if 1 - np.prod(r["phat"][s:s + j]) > h), 6) for s in range(7)]
             for r in records]
    by_hand = np.sum([_rounds_by_hand(r["P"], K) for r, K in zip(records, stops)], axis=0)
    point = next(p for p in curve["thresholds"] if p["h"] == h)
    assert (point["n_target_forwards"], point["n_accepted"]) == pytest.approx(tuple(by_hand))
    shuffled = [{**r, "P": r["P"][::-1]} for r in records]
    wrong = next(p for p in acceptance.curve(shuffled, head, "x", "tiny", 1.0, 6)["fixed_k"] if p["k"] == 4)
    assert wrong["n_accepted"] != pytest.approx(next(p for p in curve["fixed_k"] if p["k"] == 4)["n_accepted"])


def _prompts_measured(tmp_path, P: float):
    """What acceptance.measure_prompts gives, for answers whose every candidate is accepted with probability P (and
    p̂ = P), written as its curve file (with the committed head's weights, as load_curve checks)."""
    import random

    from adaptive_spec.decoding.auto import acceptance
    from adaptive_spec.heads import head as heads

    head = heads.load_head(HEAD, inputs=heads.INPUTS)
    rng = random.Random(0)
    records = [{"prompt": [rng.randrange(50) for _ in range(20)], "x": [rng.randrange(50) for _ in range(64)],
                "y": [], "P": [P] * 64, "phat": [P] * 64} for _ in range(4)]
    path = tmp_path / f"curve_{P}.json"
    path.write_text(json.dumps(acceptance.curve(records, head, HEAD, "mine.jsonl", 1.0)))
    return acceptance._summary("mine.jsonl", records, path)


def test_with_prompts_every_configuration_is_priced_at_their_acceptance_and_the_source_is_said(tmp_path):

    dev = predict(fake_pair(CHEAP_PASSES, "torch"), HEAD, 1.0, 128, 128)
    high = _prompts_measured(tmp_path, 0.97)
    mine = predict(fake_pair(CHEAP_PASSES, "torch"), HEAD, 1.0, 128, 128, prompts=high)
    rows, dev_rows = by_name(mine), by_name(dev)
    assert mine["acceptance"]["source"] == "prompts" and dev["acceptance"]["source"] == "dev answers"
    text = probe.render(mine)
    assert "acceptance: your prompts (4 prompts, 256 tokens: mine.jsonl)" in text and high["curve_file"] in text
    assert "acceptance: the dev answers" in probe.render(dev)
    # fixed K at the prompts' counts: their curve's point, priced at these costs
    curve = json.loads(open(high["curve_file"]).read())
    K = rows["fixed"]["policy"]["k"]
    point = next(p for p in curve["fixed_k"] if p["k"] == K)
    coef = coef_of(CHEAP_PASSES, mine["time_model"], "sample")
    assert rows["fixed"]["rate_tokens_per_s"] == pytest.approx(point["n_tokens"] / predict_time(point, coef))
    # accepted more often than on the dev answers: more tokens a round, faster, for both drafting rows
    for name in ("fixed", "SpecDec++ h=auto"):
        assert rows[name]["round"]["tokens"] > dev_rows[name]["round"]["tokens"]
        assert rows[name]["decode_tokens_per_s"] > dev_rows[name]["decode_tokens_per_s"]
    assert "answers to your prompts" in rows["prompt lookup"]["reason"]
    assert rows["prompt lookup"]["copies"]["n_tokens"] == 256  # replayed along the recorded answers
    # the broken control: answers accepted as rarely as a coin make drafting slower than on the dev answers
    low = by_name(predict(fake_pair(CHEAP_PASSES, "torch"), HEAD, 1.0, 128, 128,
                                prompts=_prompts_measured(tmp_path, 0.5)))
    assert low["fixed"]["decode_tokens_per_s"] < dev_rows["fixed"]["decode_tokens_per_s"]


@pytest.mark.parametrize("text, needle", [
    (None, "no such file and no such prompt set"),
    ('{"text": "hello"}\n', "no record with a non-empty 'prompt' field"),
    ("not json\n", "not JSON lines"),
])
def test_prompts_refusals_name_the_known_sets_before_any_model_loads(text, needle, tmp_path, capsys):
    spec = "no-such-set" if text is None else str(tmp_path / "p.jsonl")
    if text is not None:
        (tmp_path / "p.jsonl").write_text(text)
    assert probe.main(["--prompts", spec, "--target", "no/such/model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "humaneval" in err[0] and "sharegpt" in err[0], err
    assert probe.main(["--prompts", spec, "--workload", "chat"]) == 2
    assert "pass one" in capsys.readouterr().err


def test_probe_and_generate_on_tiny_models_read_the_prompts_curve(tmp_path, monkeypatch, capsys):
    """--prompts on a tiny pair: answers recorded, their curve cached and named; a second probe reads it back,
    and `generate --threshold auto --auto-prompts` picks h from that same file."""
    from adaptive_spec import cli
    from adaptive_spec.backends.toy import save_model
    from adaptive_spec.heads.curve import load_curve
    from adaptive_spec.heads.head import AcceptanceHead

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path / "cache"))
    models = [str(save_model(tmp_path / n, vocab_size=32, hidden_size=16, seed=s)) for n, s in (("t", 1), ("d", 2))]
    AcceptanceHead(16, depth=0).save_pretrained(tmp_path / "head")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}"}) + "\n" for i in range(3)))
    pair = ["--target", models[0], "--draft", models[1], "--dtype", "fp32", "--device", "cpu", "--threads", "1"]
    argv = [*pair, "--reps", "1", "--head", str(tmp_path / "head"), "--prompts", str(tmp_path / "p.jsonl"), "--json"]
    assert probe.main(argv) == 0
    first = json.loads(capsys.readouterr().out)["acceptance"]
    assert first["source"] == "prompts" and first["n_prompts"] == 3 and first["n_tokens"] > 0
    assert load_curve(first["curve_file"], "h", str(tmp_path / "head"))["n_tokens"] == first["n_tokens"]
    assert probe.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["acceptance"] == first  # read from the cache
    assert cli.main(["generate", *pair, "--prompt", "w1", "--policy", "learned", "--head", str(tmp_path / "head"),
                     "--threshold", "auto", "--auto-prompts", str(tmp_path / "p.jsonl"), "--max-new-tokens", "4",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["auto"]["curve"] == first["curve_file"]
    assert cli.main(["generate", "--prompt", "w1", "--policy", "fixed", "--k", "2", "--auto-prompts", "x.jsonl"]) == 2
    assert "--auto-prompts is read by --threshold auto and --k auto only" in capsys.readouterr().err


def test_a_second_measurement_prices_at_the_answers_the_first_one_recorded(tmp_path, monkeypatch):
    """probe.run(cache=False, prompts_cache=True): the costs measured afresh, the prompts' answers read back from
    the first probe's recording (eval/bench_probe.py's measurement after the runs); without prompts_cache the
    answers are recorded again and nothing is cached (the control)."""
    from adaptive_spec import params
    from adaptive_spec.backends.toy import save_model
    from adaptive_spec.decoding.auto import load_texts
    from adaptive_spec.heads.head import AcceptanceHead

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path / "cache"))
    models = [str(save_model(tmp_path / n, vocab_size=32, hidden_size=16, seed=s)) for n, s in (("t", 1), ("d", 2))]
    AcceptanceHead(16, depth=0).save_pretrained(tmp_path / "head")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}"}) + "\n" for i in range(2)))
    pair = params.pair_params(target=models[0], draft=models[1], dtype="fp32", device="cpu", threads=1)
    texts = load_texts(str(tmp_path / "p.jsonl"))
    first = probe.run(pair, str(tmp_path / "head"), 1.0, 128, 128, reps=1, prompts=texts)
    again = probe.run(pair, str(tmp_path / "head"), 1.0, 128, 128, reps=1, cache=False, prompts=texts,
                      prompts_cache=True, ran=A.picks_of(first))
    assert again["acceptance"] == first["acceptance"] and first["acceptance"]["curve_file"]
    assert again["cache"] is None and again["costs"]["measured"]  # the costs: measured again, uncached
    # the control: recorded afresh and written nowhere, no curve of the prompts is there for auto to read
    with pytest.raises(Exception, match="needs the predicted curve"):
        probe.run(pair, str(tmp_path / "head"), 1.0, 128, 128, reps=1, cache=False, prompts=texts)


def test_prompts_take_a_slice_of_a_set_held_out_from_its_other_part():
    from adaptive_spec.decoding.auto import MAX_PROMPTS, load_texts
    from adaptive_spec.prompts import prompt_texts

    every = prompt_texts("humaneval")
    late, label = load_texts("humaneval:100:")
    assert label == "humaneval:100:" and len(late) == MAX_PROMPTS and set(late) <= set(every[100:])
    assert not set(load_texts("humaneval::100")[0]) & set(every[100:])  # the other part: disjoint
    with pytest.raises(Exception, match="START and STOP of SET:START:STOP are prompt indices"):
        load_texts("humaneval:x:")
    with pytest.raises(Exception, match="the slice holds no prompt"):
        load_texts("humaneval:500:")


def test_the_benchmark_runs_the_probes_own_prompts_and_says_whose_counts_priced_it(tmp_path, capsys):
    """eval/bench_probe.py --prompts FILE|SET: the prompts are kept in <out>/prompts.jsonl, the sweep runs all of
    them, and the report names the probe's recorded answers as the counts' source (the dev answers' wording is
    the control); a bad set is refused before any model loads."""
    import importlib.util

    from adaptive_spec.evaluation.paired import run_header
    from adaptive_spec.evaluation.sweep_config import SweepConfig
    from adaptive_spec.prompts import load_prompts
    from adaptive_spec.runs import PROJECT_ROOT

    spec = importlib.util.spec_from_file_location("bench_probe", PROJECT_ROOT / "eval" / "bench_probe.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.prompts_arg("5") == (5, None) and bench.prompts_arg("alpaca:402:") == (None, "alpaca:402:")
    out = tmp_path / "bench"
    texts, label = bench.own_prompts("humaneval:100:", out)
    assert label == "humaneval:100:" and sorted(load_prompts(str(out / "prompts.jsonl"))) == sorted(texts)
    assert bench.own_prompts("alpaca", out)[0] == texts  # a rerun reads the kept prompts back
    args = SimpleNamespace(threads=2, torch_draft_quant="int8", datasets=str(out / "prompts.jsonl"),
                           prompts=len(texts), max_new_tokens=64)
    mine = predict(fake_pair(CHEAP_PASSES, "torch"), HEAD, 1.0, 128, 64, prompts=_prompts_measured(tmp_path, 0.9))
    cfg = bench.sweep_config(mine, "torch", args)
    assert cfg["datasets"] == [str(out / "prompts.jsonl")] and cfg["n_prompts"] == len(texts)
    SweepConfig(**{k: v for k, v in cfg.items() if k != "pair"}).validate()
    rows = [{"config": "ar", "method": "ar", "n_tokens": 64, "n_prompt_tokens": 100, "prefill_s": 0.0, "wall_s": 8.0,
             "n_target_forwards": 64, "target_pass_hist": {"1": 64}}]
    (out / "sweep_torch").mkdir()
    (out / "sweep_torch" / "results.jsonl").write_text(json.dumps(rows[0]) + "\n")
    for name, result in (("probe_torch.json", mine), ("probe_torch_after.json", mine)):
        (out / name).write_text(json.dumps(result))
    run_header(out, False, lambda: {"script": "eval/bench_probe.py", "engines": ["torch"], "datasets": label,
                                    "prompts": len(texts), "max_new_tokens": 64, "threads": 2, "cpu": "CPU: test"})
    assert bench.main(["--report-only", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "acceptance: your prompts (4 prompts, 256 tokens: mine.jsonl)" in md
    assert "the counts of the answers the probe recorded on these prompts" in md and "| probe's answers |" in md
    dev = predict(fake_pair(CHEAP_PASSES, "torch"), HEAD, 1.0, 128, 64)
    (out / "probe_torch.json").write_text(json.dumps(dev))
    (out / "probe_torch_after.json").write_text(json.dumps(dev))
    assert bench.main(["--report-only", "--out", str(out)]) == 0
    assert "the counts of the head's dev answers" in (out / "report.md").read_text()
    capsys.readouterr()
    assert bench.main(["--prompts", "no-such-set", "--out", str(tmp_path / "x")]) == 2
    assert "no such file and no such prompt set" in capsys.readouterr().err


def test_a_probe_prices_a_feature_drafter_from_its_own_step(tmp_path, monkeypatch, capsys):
    """`--draft feature:PATH`: the probe loads the drafter over the target, measures the drafter's step as the draft
    step and prices the drafting configurations with a head on the drafter's statistics; the same probe without a
    draft prices none of them (the control)."""
    from transformers import AutoModelForCausalLM

    from adaptive_spec.backends.toy import save_model
    from adaptive_spec.drafter.model import FeatureDrafter
    from adaptive_spec.heads.head import AcceptanceHead

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path / "cache"))
    target = save_model(tmp_path / "t", vocab_size=40, hidden_size=24, layers=2, seed=2, logit_scale=4.0)
    FeatureDrafter.for_target(AutoModelForCausalLM.from_pretrained(target)).save_pretrained(tmp_path / "d")
    AcceptanceHead(24, depth=0, inputs="stats", feature="context").save_pretrained(tmp_path / "head")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}"}) + "\n" for i in range(3)))
    argv = ["--target", str(target), "--dtype", "fp32", "--device", "cpu", "--threads", "1", "--reps", "1",
            "--head", str(tmp_path / "head"), "--prompts", str(tmp_path / "p.jsonl"), "--json"]
    assert probe.main([*argv, "--draft", f"feature:{tmp_path / 'd'}"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in out["configurations"]]
    assert any(n.startswith("fixed") for n in names) and "SpecDec++ h=auto" in names, names
    assert out["costs"]["t_draft"] > 0
    assert probe.main([*argv, "--draft", "none"]) == 0
    names = [r["name"] for r in json.loads(capsys.readouterr().out)["configurations"]]
    assert not any(n.startswith(("fixed", "SpecDec++")) for n in names), names
