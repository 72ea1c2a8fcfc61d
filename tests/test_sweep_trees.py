"""Tree and multi-draft configurations (`trees`) in `adaptive-spec sweep`, on tiny random models:
config errors name the key, rows carry the tree fields and obey the count identities, the
acceptance rates are calibrated once on other prompts and frozen, runs resume, the report shows
every family."""
import json
from types import SimpleNamespace

import pytest

from adaptive_spec.evaluation import report
from adaptive_spec.evaluation import sweep
from adaptive_spec.evaluation import tree_calibration
from adaptive_spec.config import load_config
from adaptive_spec.errors import UserError
from adaptive_spec.heads.head import AcceptanceHead
from adaptive_spec.evaluation.sweep import SweepConfig
import test_sweep
from test_sweep import interrupt_after, overrides, read_rows

inputs, keep_threads = test_sweep.inputs, test_sweep.keep_threads  # the sweep tests' fixtures, shared

TREES = ("[{budget: 3}, {estimator: head, head: d1-wrej6, budget: 3}, {policy: ersd, drafting: sequence, budget: 2}, "
         "{drafting: batch, budget: 2}, {policy: spectr, num_drafts: 2, k: 2}, "
         "{policy: batch-sd, num_drafts: 2, k: 2}]")
TREE_KEYS = ["tree:tree:positional:b=3", "tree:tree:head=d1-wrej6:b=3", "ersd:sequence:positional:b=2",
             "tree:batch:positional:b=2", "spectr:n=2:k=2", "batch-sd:n=2:k=2"]


def tree_args(inp, out, **kw):
    base = dict(ks="[2]", thresholds="[0.5]", confidence_taus="[]", heuristic="false", hf_assisted="false",
                include_draft_ar="false", trees=TREES, tree_calibration_prompts=1)
    return overrides(inp, out, **{**base, **kw})


def cfg_of(inp, out, **kw) -> SweepConfig:
    return load_config(SweepConfig, None, tree_args(inp, out, **kw))


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("trees, match", [
    ("[{budget: 0}]", r"trees\[0\]\.budget: must be an integer >= 1 .*got 0"),
    ("[{budget: 2}, {budget: 2, estimator: foo}]",
     r"trees\[1\]\.estimator: unknown estimator 'foo'; use positional or head"),
    ("[{estimator: head, budget: 4}]",
     r"trees\[0\]\.head: estimator head needs an acceptance head; set head to a label of heads \(d1-wrej6\)"),
    ("[{estimator: head, head: nowhere}]", r"trees\[0\]\.head: 'nowhere' is neither a label of heads \(d1-wrej6\) nor"),
    ("[{head: d1-wrej6}]", r"trees\[0\]\.head: only estimator head reads a head"),
    ("[{estimator: head, head: d1-wrej6, drafting: batch}]",
     r"trees\[0\]\.estimator: the head estimator builds the optimal"),
    ("[{policy: sequoia}]", r"trees\[0\]\.policy: unknown policy 'sequoia'; use tree, ersd, spectr or batch-sd"),
    ("[{drafting: star}]", r"trees\[0\]\.drafting: unknown drafting 'star'; use tree, sequence, batch or specinfer"),
    ("[{budget: 4, widht: 2}]", r"trees\[0\]\.widht: unknown key for policy tree; valid keys: policy, drafting"),
    ("[{policy: spectr, budget: 4}]",
     r"trees\[0\]\.budget: unknown key for policy spectr; valid keys: policy, num_drafts, k"),
    ("[{policy: batch-sd, k: 0}]", r"trees\[0\]\.k: must be an integer >= 1, got 0"),
    ("[{budget: learned, node_cost: -1}]", r"trees\[0\]\.node_cost: must be a number > 0"),
    ("[{budget: learned, max_budget: 0}]", r"trees\[0\]\.max_budget: must be an integer >= 1"),
    ("[{budget: learned, drafting: specinfer}]", r"trees\[0\]\.budget: a learned budget grows the tree node by node"),
    ("[{budget: 4, max_budget: 8}]", r"trees\[0\]\.max_budget: only used with budget: learned"),
    ("[{budget: 4, adapt: 1}]", r"trees\[0\]\.adapt: must be true .* or false \(frozen\), got 1"),
    ("[{budget: 2}, {policy: tree, budget: 2}]", r"trees\[1\] repeats trees\[0\] \(tree:tree:positional:b=2\)"),
    ("[3]", r"trees\[0\] must be a mapping"),
])
def test_bad_tree_entries_name_their_key(inputs, tmp_path, trees, match):
    with pytest.raises(UserError, match=match):
        cfg_of(inputs, tmp_path / "o", trees=trees)  # SweepConfig.validate: before anything loads
    assert not (tmp_path / "o").exists()


def test_bad_input_errors_are_one_line_before_models_load(inputs, tmp_path, monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("models were loaded before the input was checked")

    monkeypatch.setattr("adaptive_spec.decoding.pipeline.SpecPair.load", no_load)
    assert sweep.main(tree_args(inputs, tmp_path / "o", trees="[{budget: 0}]")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: trees[0].budget: ") and err.count("\n") == 1
    assert sweep.main(tree_args(inputs, tmp_path / "o", tree_calibration_prompts=0)) == 2
    assert "tree_calibration_prompts must be >= 1" in capsys.readouterr().err
    # a context head cannot tell siblings apart: refused when the heads load, still before the models
    ctx = tmp_path / "ctx"
    AcceptanceHead(16, depth=0, feature="context").save_pretrained(ctx)
    with pytest.raises(UserError, match=r"head .*ctx reads feature=context.*needs a head trained with feature=token"):
        sweep.run(cfg_of(inputs, tmp_path / "o", trees=f"[{{estimator: head, head: {ctx}}}]"))
    assert not (tmp_path / "o" / "results.jsonl").exists()


# ----------------------------------------------------------------------------- end to end

def check_tree_row(r):
    hist_rounds = sum(r["accepted_hist"].values())
    assert r["rounds"] == hist_rounds == r["n_target_forwards"]  # one target pass per round
    assert r["n_drafted"] == r["n_accepted"] + r["n_discarded"]
    assert r["n_tokens"] == r["n_accepted"] + r["rounds"] - r["n_final_cut"]
    assert r["drafted_per_round"] == pytest.approx(r["n_drafted"] / r["rounds"])
    assert r["tokens_per_target_forward"] == pytest.approx(r["n_tokens"] / r["n_target_forwards"])
    if r["method"] in ("tree", "ersd"):
        assert r["predicted_accepted"] is not None and r["predicted_accepted"] > 0
        assert 0 < r["tree_depth"] <= r["drafted_per_round"]
        if r["drafting"] == "sequence":  # a chain: its depth is its size
            assert r["tree_depth"] == pytest.approx(r["drafted_per_round"])
        if r["drafting"] == "batch":  # siblings at the root: depth 1, budget nodes per drafted round
            assert r["tree_depth"] * r["budget"] == pytest.approx(r["drafted_per_round"])
    else:
        assert r["drafted_per_round"] <= r["num_drafts"] * r["k"]
        # each round drafts tries of depth k (less only where the length limit cuts the round)
        assert 0 < r["tree_depth"] <= r["k"] and r["tree_depth"] >= r["drafted_per_round"] / r["num_drafts"]


def test_tree_sweep_rows_calibration_resume_and_report(inputs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    argv = tree_args(inputs, out)
    measured, made = [], []
    real_measure, real_make = sweep.measure_rates, sweep.make_policy
    monkeypatch.setattr(sweep, "measure_rates",
                        lambda pair, prompts, *a, **kw: measured.append((a[2], len(prompts)))
                        or real_measure(pair, prompts, *a, **kw))
    monkeypatch.setattr(sweep, "make_policy",
                        lambda name, ctx=None, **kw: made.append((name, kw)) or real_make(name, ctx, **kw))
    real_append = interrupt_after(monkeypatch, 5)
    assert sweep.main(argv) == 130
    # calibrated once per verification method, on one prompt per dataset, before any run
    assert sorted(measured) == [("ersd", 2), ("gsd", 2)]
    cal_file = out / "tree_calibration.json"
    cal_bytes = cal_file.read_bytes()
    first = read_rows(out)
    assert len(first) == 5

    monkeypatch.setattr(sweep, "append_jsonl", real_append)
    measured.clear()
    assert sweep.main(argv) == 0
    assert measured == [] and cal_file.read_bytes() == cal_bytes  # reused, not measured again
    rows = read_rows(out)
    assert rows[:5] == first  # kept as they were
    grid = ["ar", "fixed:k=2", "learned:head=d1-wrej6:h=0.5"] + TREE_KEYS
    keys = [(r["dataset"], r["prompt_idx"], r["config"]) for r in rows]
    assert len(keys) == len(set(keys)) == 2 * 2 * len(grid)
    assert json.loads((out / "config.json").read_text())["grid"] == grid

    cal = json.loads(cal_file.read_text())
    evaluated = {p["prompt_sha"] for ps in json.loads((out / "prompts.json").read_text()).values() for p in ps}
    assert len(cal["settings"]["prompts"]) == 2 and not set(cal["settings"]["prompts"]) & evaluated
    tree_rows = [r for r in rows if r["method"] in sweep.TREE_POLICIES]
    assert {r["config"] for r in tree_rows} == set(TREE_KEYS)
    for r in tree_rows:
        check_tree_row(r)
    assert {r["tree_calibration"] for r in tree_rows if r["method"] in ("tree", "ersd")} == \
        {sweep.settings_hash(cal["settings"])}
    # every tree policy got the calibrated rates, frozen
    for name, kw in made:
        if name in ("tree", "ersd"):
            assert kw["tree_rates"] == cal[{"tree": "gsd", "ersd": "ersd"}[name]]["cond_rates"]
            assert kw["adapt_rates"] is False
    assert {name for name, _ in made} >= {"tree", "ersd", "spectr", "batch-sd"}

    assert sweep.main(argv) == 0  # nothing left to do
    assert read_rows(out) == rows
    capsys.readouterr()
    # tree rows used this calibration: other calibration settings are refused, not mixed in
    assert sweep.main(argv + ["tree_calibration_width=4"]) == 2
    assert "tree calibration made with other settings (width: 8 -> 4)" in capsys.readouterr().err

    assert report.main(["--sweep-dir", str(out)]) == 0
    md = (out / "report.md").read_text()
    t1 = md.split("## Table 1")[1].split("## Table 2")[0]
    for fam in ("fixed K", "SpecDec++", "optimal tree, positional R", "optimal tree, head-estimated R",
                "tree, fixed shape", "ERSD", "SpecTr", "batch SD"):
        assert f"| {fam} |" in t1
    assert "## ERSD Fig. 3" in t1 and "head-estimated vs positional optimal tree" in t1
    for label in ("a", "b"):
        png = out / f"accepted_vs_drafted_{label}.png"
        assert png.is_file() and png.stat().st_size > 1000


def test_greedy_trees_give_the_target_output(inputs, tmp_path):
    """At temperature 0 every tree and multi-draft configuration must reproduce the target's own
    greedy output, token for token."""
    cfg = cfg_of(inputs, tmp_path / "g", datasets=f"[{inputs['a']}]", n_prompts=1, temperature=0, ks="[]",
                 heads=f"[{inputs['head']}]", thresholds="[0.5]")
    rows = read_rows(sweep.run(cfg))
    by = {r["config"]: r for r in rows}
    assert set(TREE_KEYS) <= set(by)
    assert {r["output_sha"] for r in rows} == {by["ar"]["output_sha"]}
    for r in rows:
        if r["method"] in sweep.TREE_POLICIES:
            check_tree_row(r)


def test_learned_budget_node_cost_measured_once(inputs, tmp_path, monkeypatch):
    calls = []

    def measure_costs(pair, *a, **kw):
        calls.append(pair)
        return SimpleNamespace(node_cost=0.25, c=0.2, measured="test")

    monkeypatch.setattr(sweep, "measure_costs", measure_costs)
    made = []
    real_make = sweep.make_policy
    monkeypatch.setattr(sweep, "make_policy",
                        lambda name, ctx=None, **kw: made.append(kw) or real_make(name, ctx, **kw))
    cfg = cfg_of(inputs, tmp_path / "l", heads="[]", thresholds="[0.5]", ks="[]",
                 trees="[{budget: learned, max_budget: 4}, {budget: learned, max_budget: 4, node_cost: 0.5}, "
                       "{budget: learned, max_budget: 4, adapt: true}]")
    rows = read_rows(sweep.run(cfg))
    assert len(calls) == 1  # once per sweep, not per run
    by_key = {}
    for r in rows:
        by_key.setdefault(r["config"], []).append(r)
    auto, fixed = by_key["tree:tree:positional:b=learned<=4:c=auto"], by_key["tree:tree:positional:b=learned<=4:c=0.5"]
    adapted = by_key["tree:tree:positional:b=learned<=4:c=auto:adapt"]
    assert all(r["node_cost"] == 0.25 for r in auto + adapted) and all(r["node_cost"] == 0.5 for r in fixed)
    assert {kw["tree_node_cost"] for kw in made if kw.get("tree_learned")} == {0.25, 0.5}
    # adapt: true starts every run from the calibrated rates and lets them follow its rounds; the rest are frozen
    flags = [kw["adapt_rates"] for kw in made if kw.get("tree_learned")]
    assert flags.count(True) == len(adapted) and flags.count(False) >= len(auto) + len(fixed)
    for r in auto + fixed + adapted:
        check_tree_row(r)
        assert r["drafted_per_round"] <= 4


# ----------------------------------------------------------------------------- the 0-th order predictions

def all_trees(k: int):
    """Every tree of k drafted nodes as (parents, sibs), a node's children in sibling order 0, 1, ...
    (with repeats: the same tree arises in several insertion orders)."""
    def grow(parents, sibs, kids):
        if len(parents) == k + 1:
            yield parents, sibs
            return
        for v in range(len(parents)):
            yield from grow(parents + [v], sibs + [kids[v]], kids[:v] + [kids[v] + 1] + kids[v + 1:] + [0])
    yield from grow([-1], [0], [0])


@pytest.mark.parametrize("cond", [[0.6, 0.3, 0.2], [0.9, 0.05], [0.3, 0.3, 0.3, 0.3]])
def test_zeroth_order_predictions_and_tunstall_bound(cond):
    from adaptive_spec.decoding.trees.shapes import acceptance_distribution, tree_value

    V = 32
    for k in range(1, 7):
        r = acceptance_distribution(cond, k)
        best = max(tree_value(p, s, r) for p, s in all_trees(k))  # enumeration of every k-node tree
        opt = tree_calibration.zeroth_order_accepted(cond, "tree", k, V)
        assert opt == pytest.approx(best)
        # closed forms: a chain accepts its i-th token with probability c_0^i; a batch takes at most one
        assert tree_calibration.zeroth_order_accepted(cond, "sequence", k, V) == \
            pytest.approx(sum(cond[0] ** i for i in range(1, k + 1)))
        miss = 1.0
        for i in range(k):
            miss *= 1 - cond[min(i, len(cond) - 1)]
        assert tree_calibration.zeroth_order_accepted(cond, "batch", k, V) == pytest.approx(1 - miss)
        assert tree_calibration.tunstall_accepted(cond, k, V) >= opt - 1e-9
        assert tree_calibration.tunstall_accepted(cond, k, V) <= k
