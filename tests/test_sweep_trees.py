"""Tree and multi-draft configurations (`trees`) in `adaptive-spec sweep`, on tiny random models:
config errors name the key, rows carry the tree fields and obey the count identities, the
acceptance rates are calibrated once on other prompts and frozen, runs resume, the report shows
every family."""
import json
from types import SimpleNamespace

import pytest

from adaptive_spec.evaluation import report
from adaptive_spec.evaluation import sweep, sweep_files
from adaptive_spec.evaluation import sweep_calibration
from adaptive_spec.evaluation import sweep_grid, tree_calibration
from adaptive_spec.config import load_config
from adaptive_spec.decoding import pipeline
from adaptive_spec.errors import UserError
from adaptive_spec.heads.head import AcceptanceHead
from adaptive_spec.evaluation.sweep import SweepConfig
import test_sweep
from test_sweep import interrupt_after, overrides, read_rows

inputs, keep_threads = test_sweep.inputs, test_sweep.keep_threads  # the sweep tests' fixtures, shared

TREES = ("[{tree_budget: 3, adapt_rates: false}, {tree_estimator: head, head: d1-wrej6, tree_budget: 3, adapt_rates: false}, "
         "{policy: ersd, drafting: sequence, tree_budget: 2, adapt_rates: false}, "
         "{drafting: batch, tree_budget: 2, adapt_rates: false}, {policy: spectr, num_drafts: 2, k: 2}, "
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
    # entries in generate's names, checked by the policy's params class
    ("[{tree_budget: 0}]", r"trees\[0\]\.tree_budget must be an integer >= 1 for policy tree, got 0"),
    ("[{tree_budget: 2}, {tree_budget: 2, tree_estimator: foo}]",
     r"trees\[1\]\.tree_estimator must be positional or head for policy tree, got 'foo'"),
    ("[{tree_estimator: head}]",
     r"trees\[0\]\.head: tree_estimator head needs an acceptance head; set head to a label of heads \(d1-wrej6\)"),
    ("[{tree_estimator: head, head: d1-wrej6, drafting: batch}]",
     r"trees\[0\]\.tree_estimator: the head estimator builds the optimal tree; use it with drafting tree"),
    ("[{head: d1-wrej6}]", r"trees\[0\]: head is read by the tree policies only with tree_estimator head"),
    ("[{tree_learned: true, drafting: specinfer}]",
     r"trees\[0\]\.tree_learned: a learned budget grows the tree node by node, which drafting specinfer cannot"),
    ("[{tree_node_cost: 0.3}]", r"trees\[0\]: tree_node_cost applies only with tree_learned"),
    ("[{tree_learned: true, tree_node_cost: .inf}]", r"trees\[0\]\.tree_node_cost must be > 0 and finite"),
    ("[{adapt_rates: maybe}]", r"trees\[0\]\.adapt_rates must be true or false for policy tree, got 'maybe'"),
    ("[{policy: ersd, num_drafts: 2}]", r"trees\[0\]: num_drafts applies to ersd only with drafting batch"),
    ("[{tree_rates: [0.5, 0.2]}]", r"trees\[0\]\.tree_rates: the sweep measures the acceptance rates itself"),
    ("[{tree_budget: 4, widht: 2}]",
     r"trees\[0\]\.widht: not a setting of policy tree; its settings: policy, tree_budget, tree_estimator"),
    ("[{tree_estimator: head, head: nowhere}]",
     r"trees\[0\]\.head: 'nowhere' is neither a label of heads \(d1-wrej6\) nor"),
    ("[{policy: sequoia}]", r"trees\[0\]\.policy: unknown policy 'sequoia'; use tree, ersd, spectr or batch-sd"),
    ("[{drafting: star}]",
     r"trees\[0\]\.drafting must be tree, sequence, batch or specinfer for policy tree, got 'star'"),
    ("[{policy: spectr, tree_budget: 4}]",
     r"trees\[0\]\.tree_budget: not a setting of policy spectr; its settings: policy, num_drafts, k"),
    ("[{policy: batch-sd, k: 0}]", r"trees\[0\]\.k must be an integer >= 1 for policy batch-sd, got 0"),
    ("[{tree_learned: true, tree_node_cost: -1}]", r"trees\[0\]\.tree_node_cost must be > 0 and finite"),
    ("[{tree_learned: true, tree_budget: 0}]", r"trees\[0\]\.tree_budget must be an integer >= 1"),
    ("[{tree_budget: 2}, {policy: tree, tree_budget: 2}]",
     r"trees\[1\] repeats trees\[0\] \(tree:tree:positional:b=2:adapt\)"),
    # the sweep's old names are refused, each naming what to write instead
    ("[{budget: 4}]", r"trees\[0\]\.budget: not a setting of policy tree \(the sweep's old name: write tree_budget "
                      r"\(budget: learned -> tree_learned: true\)\); its settings: policy, tree_budget, "),
    ("[{tree_budget: 4, adapt: true}]",
     r"trees\[0\]\.adapt: not a setting of policy tree \(the sweep's old name: write adapt_rates \(the old "
     r"default was adapt_rates: false\)\)"),
    ("[{tree_estimator: head, head: d1-wrej6, max_budget: 4}]",
     r"trees\[0\]\.max_budget: not a setting of policy tree \(the sweep's old name: write tree_budget\)"),
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
    assert sweep.main(tree_args(inputs, tmp_path / "o", trees="[{tree_budget: 0}]")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: trees[0].tree_budget must be ") and err.count("\n") == 1
    assert sweep.main(tree_args(inputs, tmp_path / "o", tree_calibration_prompts=0)) == 2
    assert "tree_calibration_prompts must be >= 1" in capsys.readouterr().err
    # a context head cannot tell siblings apart: refused when the heads load, still before the models
    ctx = tmp_path / "ctx"
    AcceptanceHead(16, depth=0, feature="context").save_pretrained(ctx)
    with pytest.raises(UserError, match=r"head .*ctx reads feature=context.*needs a head trained with feature=token"):
        sweep.run(cfg_of(inputs, tmp_path / "o", trees=f"[{{tree_estimator: head, head: {ctx}}}]"))
    assert not (tmp_path / "o" / "results.jsonl").exists()


# ----------------------------------------------------------------------------- one schema with generate

def tree_confs(cfg):
    """The grid's configurations from `trees` entries."""
    grid, _, _ = sweep_grid.build_grid(cfg)
    return [c for c in grid if c.source is sweep_grid.Source.TREES]


def specs_of(trees):
    return tree_confs(SweepConfig(heads=[], trees=trees))


@pytest.mark.parametrize("entry, key", [
    ({"tree_budget": 4, "adapt_rates": False}, "tree:tree:positional:b=4"),
    ({"tree_estimator": "positional", "tree_budget": 8}, "tree:tree:positional:b=8:adapt"),
    ({"policy": "ersd", "drafting": "sequence", "tree_budget": 8, "adapt_rates": False}, "ersd:sequence:positional:b=8"),
    ({"tree_learned": True, "tree_budget": 6, "tree_node_cost": 0.5, "adapt_rates": False},
     "tree:tree:positional:b=learned<=6:c=0.5"),
    ({"tree_learned": True, "tree_budget": 20}, "tree:tree:positional:b=learned<=20:c=auto:adapt"),
])
def test_an_entry_s_key_is_the_one_stored_results_have(entry, key):
    """Stored tree rows were written by entries in the sweep's old names; written in generate's names (frozen
    rates: adapt_rates false, the old default), the same configuration has the same key, so a rerun resumes them."""
    (conf,) = specs_of([entry])
    assert conf.key == key
    assert sweep_files.row_fields(conf)["adapt"] is entry.get("adapt_rates", True)


def test_an_entry_takes_generate_s_names_and_defaults():
    """An entry is the settings generate takes for its policy: its params class builds it, defaults and all
    (rates that adapt, the policy's own budget), and its key says what ran."""
    from adaptive_spec.params import policy_params

    entries = [{}, {"policy": "ersd", "drafting": "sequence"}, {"tree_learned": True},
               {"tree_estimator": "positional", "tree_learned": True, "tree_budget": 6, "tree_node_cost": 0.3},
               {"policy": "spectr"}]
    specs = specs_of(entries)
    for e, spec in zip(entries, specs):
        assert spec.policy == policy_params(e.get("policy", "tree"),
                                                            **{k: v for k, v in e.items() if k != "policy"})
    assert [s.key for s in specs] == ["tree:tree:positional:b=8:adapt", "ersd:sequence:positional:b=4:adapt",
                                      "tree:tree:positional:b=learned<=8:c=auto:adapt",
                                      "tree:tree:positional:b=learned<=6:c=0.3:adapt", "spectr:n=4:k=4"]
    assert sweep_files.row_fields(specs[0])["adapt"] is True and sweep_files.row_fields(specs[2])["max_budget"] == 8


@pytest.mark.parametrize("entry", [{}, {"k": 3}, {"tree_budget": 5, "k": 3}, {"drafting": "batch"},
                                   {"policy": "ersd", "drafting": "sequence", "tree_budget": 5},
                                   {"policy": "ersd", "drafting": "sequence", "k": 3, "tree_budget": 5},
                                   {"policy": "ersd", "drafting": "batch", "num_drafts": 3, "tree_budget": 5},
                                   {"policy": "ersd", "drafting": "batch"},
                                   {"policy": "ersd", "drafting": "specinfer"}])
def test_the_budget_in_key_and_row_is_the_one_the_policy_drafts(entry):
    from adaptive_spec.decoding.pipeline import make_policy
    from adaptive_spec.decoding.trees.policy import round_budget

    (spec,) = specs_of([entry])
    drafted = make_policy(spec.policy).budget
    assert round_budget(spec.policy) == sweep_files.row_fields(spec)["budget"] == drafted
    assert f":b={drafted}:" in spec.key


# the keys of the rows the shipped tree configs have run (runs/sweep/final): a rerun resumes them
SHIPPED_KEYS = {
    "trees.yaml": ["tree:tree:positional:b=4", "tree:tree:positional:b=8",
                   "tree:tree:head=checkpoints/qwen-coder-0.5b-int8-hidden-d3:b=4",
                   "tree:tree:head=checkpoints/qwen-coder-0.5b-int8-hidden-d3:b=8",
                   "tree:tree:positional:b=learned<=16:c=auto", "tree:tree:positional:b=learned<=16:c=auto:adapt",
                   "tree:tree:head=checkpoints/qwen-coder-0.5b-int8-hidden-d3:b=learned<=16:c=auto",
                   "ersd:tree:positional:b=4", "spectr:n=2:k=2", "batch-sd:n=2:k=2"],
    "trees_smoke.yaml": ["tree:tree:positional:b=4", "tree:tree:positional:b=learned<=8:c=auto",
                         "ersd:tree:positional:b=4", "spectr:n=2:k=2", "batch-sd:n=2:k=2"],
}


@pytest.mark.parametrize("name", sorted(SHIPPED_KEYS))
def test_shipped_tree_configs_keep_their_keys(name):
    from pathlib import Path

    cfg = load_config(SweepConfig, str(Path(__file__).resolve().parents[1] / "configs" / "sweep" / name), [])
    assert [s.key for s in tree_confs(cfg)] == SHIPPED_KEYS[name]


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
    real_measure, real_make = sweep_calibration.measure_rates, pipeline.make_policy
    monkeypatch.setattr(sweep_calibration, "measure_rates",
                        lambda pair, prompts, *a, **kw: measured.append((a[2], len(prompts)))
                        or real_measure(pair, prompts, *a, **kw))
    monkeypatch.setattr(pipeline, "make_policy",
                        lambda params, ctx=None, **kw: made.append(params) or real_make(params, ctx, **kw))
    real_append = interrupt_after(monkeypatch, 5)
    assert sweep.main(argv) == 130
    # calibrated once per verification method, on one prompt per dataset, before any run
    assert sorted(measured) == [("ersd", 2), ("gsd", 2)]
    cal_file = out / "tree_calibration.json"
    cal_bytes = cal_file.read_bytes()
    first = read_rows(out)
    assert len(first) == 5

    monkeypatch.setattr(sweep_files, "append_jsonl", real_append)
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
    tree_rows = [r for r in rows if r["method"] in tree_calibration.TREE_POLICIES]
    assert {r["config"] for r in tree_rows} == set(TREE_KEYS)
    for r in tree_rows:
        check_tree_row(r)
    assert {r["tree_calibration"] for r in tree_rows if r["method"] in ("tree", "ersd")} == \
        {sweep_files.settings_hash(cal["settings"])}
    # every tree policy got the calibrated rates, frozen (the entries say adapt_rates: false)
    for p in made:
        if p.name in ("tree", "ersd"):
            assert p.tree_rates == cal[{"tree": "gsd", "ersd": "ersd"}[p.name]]["cond_rates"]
            assert p.adapt_rates is False
    assert {p.name for p in made} >= {"tree", "ersd", "spectr", "batch-sd"}

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
        if r["method"] in tree_calibration.TREE_POLICIES:
            check_tree_row(r)


def test_learned_budget_node_cost_measured_once(inputs, tmp_path, monkeypatch):
    calls = []

    def measure_costs(pair, *a, **kw):
        calls.append(pair)
        return SimpleNamespace(node_cost=0.25, c=0.2, measured="test")

    monkeypatch.setattr(sweep_calibration, "measure_costs", measure_costs)
    made = []
    real_make = pipeline.make_policy
    monkeypatch.setattr(pipeline, "make_policy",
                        lambda params, ctx=None, **kw: made.append(params) or real_make(params, ctx, **kw))
    cfg = cfg_of(inputs, tmp_path / "l", heads="[]", thresholds="[0.5]", ks="[]",
                 trees="[{tree_learned: true, tree_budget: 4, adapt_rates: false}, "
                       "{tree_learned: true, tree_budget: 4, tree_node_cost: 0.5, adapt_rates: false}, "
                       "{tree_learned: true, tree_budget: 4}]")
    rows = read_rows(sweep.run(cfg))
    assert len(calls) == 1  # once per sweep, not per run
    by_key = {}
    for r in rows:
        by_key.setdefault(r["config"], []).append(r)
    auto, fixed = by_key["tree:tree:positional:b=learned<=4:c=auto"], by_key["tree:tree:positional:b=learned<=4:c=0.5"]
    adapted = by_key["tree:tree:positional:b=learned<=4:c=auto:adapt"]
    assert all(r["node_cost"] == 0.25 for r in auto + adapted) and all(r["node_cost"] == 0.5 for r in fixed)
    assert {p.tree_node_cost for p in made if getattr(p, "tree_learned", False)} == {0.25, 0.5}
    # adapt: true starts every run from the calibrated rates and lets them follow its rounds; the rest are frozen
    flags = [p.adapt_rates for p in made if getattr(p, "tree_learned", False)]
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
