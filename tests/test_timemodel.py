"""timemodel: least-squares fits of Eq. 3.1 and the extended model on sweep-like rows made from
known times, and the side-by-side comparison (eval/fit_time_model.py)."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from adaptive_spec.decoding.auto import Costs
from adaptive_spec.decoding.auto import timemodel as TM

TRUE = {"t_draft": 0.06, "t_target": 0.14, "t_cand": 0.01}


def make_rows(seed=0, noise=0.0, t=TRUE, datasets=("alpaca", "gsm8k")):
    """Stand-alone runs (ar, draft_ar) and chain runs at K = 1..4 whose decode time is exactly
    t_draft N_draft + t_target N_target + t_cand N_drafted (times a noise factor), plus prefill."""
    rng = np.random.default_rng(seed)
    rows = []
    for ds in datasets:
        for prompt in range(6):
            n = int(rng.integers(60, 129))
            runs = [("ar", "ar", 0, n, 0), ("draft_ar", "draft_ar", n, 0, 0)]
            for k in (1, 2, 3, 4):
                rounds = int(np.ceil(n / (1 + k * rng.uniform(0.4, 0.9))))
                runs.append((f"fixed:k={k}", "fixed", k * rounds, rounds, k * rounds))
            for config, method, nd, nt, ndr in runs:
                T = (t["t_draft"] * nd + t["t_target"] * nt + t["t_cand"] * ndr) * (1 + noise * rng.standard_normal())
                pre = float(rng.uniform(0.2, 1.0))
                rows.append({"dataset": ds, "prompt_idx": prompt, "config": config, "method": method, "n_tokens": n,
                             "n_draft_forwards": nd, "n_target_forwards": nt, "n_drafted": ndr,
                             "wall_s": T + pre, "prefill_s": pre, "counts_derived": False})
    return rows


def test_extended_fit_recovers_known_times_and_eq31_cannot():
    rows = make_rows()
    spec = TM.speculative(rows)
    ext = TM.fit(rows, "extended", spec)
    assert ext.rank_ok and ext.coef == pytest.approx(TRUE, rel=1e-9)
    assert ext.r2 == pytest.approx(1.0, abs=1e-12) and ext.max_rel_error < 1e-9
    paper = TM.fit(rows, "paper", spec)
    assert set(paper.coef) == {"t_draft", "t_target"} and paper.r2 < ext.r2
    # one t_draft cannot serve the draft-only rows and the chain rows (which also pay t_cand): one of them is off
    draft_only = [r for r in rows if r["method"] == "draft_ar"]
    worst = max(paper.mean_rel_error, TM.fit(rows, "paper", draft_only).mean_rel_error)
    assert worst > 0.03
    # on chain rows alone N_draft = N_drafted: Eq. 3.1 fits them exactly, t_draft absorbing t_cand
    alone = TM.fit(spec, "paper")
    assert alone.coef["t_draft"] == pytest.approx(TRUE["t_draft"] + TRUE["t_cand"], rel=1e-9)
    assert not TM.fit(spec, "extended").rank_ok  # ... and the extended model is not identified there


def test_noisy_rows_still_recover_the_times():
    ext = TM.fit(make_rows(seed=3, noise=0.005), "extended")
    assert all(abs(ext.coef[k] - v) < 0.004 for k, v in TRUE.items()) and 0.9 < ext.r2 < 1.0


def test_throughput_errors_are_pooled_per_configuration():
    rows = make_rows()
    coef = {**TRUE, "t_target": TRUE["t_target"] * 1.1}  # every target pass predicted 10% slower
    errs = TM.throughput_errors(TM.speculative(rows), coef)
    assert set(errs) == {(ds, f"fixed:k={k}") for ds in ("alpaca", "gsm8k") for k in (1, 2, 3, 4)}
    for (ds, config), e in errs.items():
        rs = [r for r in rows if (r["dataset"], r["config"]) == (ds, config)]
        pred = sum(TM.predict_time(r, coef) for r in rs)
        meas = sum(TM.decode_s(r) for r in rs)
        n = sum(r["n_tokens"] for r in rs)
        assert e == pytest.approx(abs(n / pred - n / meas) / (n / meas)) and e > 0


def test_compare_with_measured_costs_and_the_verdict():
    rows = make_rows() + [{"dataset": "alpaca", "config": "hf", "method": "hf_assisted", "n_tokens": 128,
                           "n_draft_forwards": 1, "n_target_forwards": 1, "n_drafted": 0, "wall_s": 99.0,
                           "counts_derived": True}]  # derived counts never enter a fit
    costs = Costs(TRUE["t_draft"], TRUE["t_target"], TRUE["t_cand"], "key", "now")
    fits = dict(TM.compare(rows, costs))
    assert fits["extended, measured costs"].max_rel_error < 1e-9
    assert fits["paper, measured costs"].mean_rel_error > 0.01
    assert fits["extended, fitted on all rows"].n_rows == len(rows) - 1
    assert TM.better_model(list(fits.items())) == "extended"
    assert TM.better_model(TM.compare(rows)) == "extended"


def test_comparison_table_and_the_eval_script(tmp_path, capsys):
    rows = make_rows()
    table = TM.comparison_table(rows)
    lines = table.splitlines()
    assert lines[0].startswith("| dataset | model |")
    assert sum(ln.startswith("| pooled |") for ln in lines) == 3
    assert "alpaca: extended" in table and "pooled: extended" in table
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({**TRUE, "key": "k", "measured": "now"}))
    path = Path(__file__).resolve().parent.parent / "eval" / "fit_time_model.py"
    spec = importlib.util.spec_from_file_location("fit_time_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod._main([str(tmp_path), "--costs", str(costs)]) == 0
    out = capsys.readouterr().out
    assert "extended, measured costs" in out and "| gsm8k |" in out


def test_table_model_prices_each_pass_length_and_wins_on_step_costs():
    """Rows whose target passes cost a step function of their length (6 tokens as 3, 7+ double):
    the table model with those measured times predicts them exactly, the line models cannot."""
    step = (0.14,) * 6 + (0.28,) * 3
    costs = Costs(0.06, 0.14, 0.0, "key", "now", step)
    rng = np.random.default_rng(2)
    rows = []
    for prompt in range(6):
        for k in (2, 4, 6, 8):
            rounds = int(rng.integers(20, 40))
            hist = {str(k + 1): rounds - 3, "1": 3}  # a few plain steps among the rounds
            nd = k * (rounds - 3)
            T = 0.06 * nd + sum(costs.verify_s(int(n)) * c for n, c in hist.items())
            rows.append({"dataset": "d", "prompt_idx": prompt, "config": f"fixed:k={k}", "method": "fixed",
                         "n_tokens": 100, "n_draft_forwards": nd, "n_target_forwards": rounds, "n_drafted": nd,
                         "target_pass_hist": hist, "wall_s": T + 0.5, "prefill_s": 0.5, "counts_derived": False})
    fits = dict(TM.compare(rows, costs))
    assert fits["table, measured costs"].max_rel_error < 1e-9
    assert fits["extended, measured costs"].mean_rel_error > 0.05
    assert TM.better_model(list(fits.items())) == "table"
    # a row whose histogram does not cover its passes (a tree round) falls back to the line
    partial = {**rows[0], "target_pass_hist": {"3": 1}}
    coef = TM.coef_of(costs, "table")
    assert TM.predict_time(partial, coef) == pytest.approx(TM.predict_time(partial, TM.coef_of(costs, "extended")))
    assert "table" not in dict(TM.compare(rows, Costs(0.06, 0.14, 0.0, "key", "now")))  # no table measured
    assert "table, measured costs" not in dict(TM.compare(rows, Costs(0.06, 0.14, 0.0, "key", "now")))


def test_a_round_after_one_all_accepted_pays_the_drafts_two_token_step():
    """A curve point's n_all_accepted rounds each make the next round's first draft step feed two tokens
    (y_K and the bonus): the measured models add t_draft_two - t_draft per such round, Eq. 3.1 does not,
    and costs without a two-token time (older caches) price it as before."""
    point = {"n_tokens": 180, "n_target_forwards": 100, "n_draft_forwards": 100, "n_drafted": 100,
             "n_accepted": 80, "n_all_accepted": 80, "target_pass_hist": {"2": 100}}
    step = (0.1, 0.14) + (0.2,) * 7
    two = Costs(0.04, 0.1, 0.0, "key", "now", step, t_draft_two=0.055)
    one = Costs(0.04, 0.1, 0.0, "key", "now", step)
    for model in ("extended", "table"):
        base = TM.predict_time(point, TM.coef_of(one, model))
        assert TM.predict_time(point, TM.coef_of(two, model)) == pytest.approx(base + 80 * 0.015)
        assert TM.predict_time({**point, "n_all_accepted": 0}, TM.coef_of(two, model)) == pytest.approx(base)
    assert TM.predict_time(point, TM.coef_of(two, "paper")) == pytest.approx(TM.predict_time(point, TM.coef_of(one, "paper")))
    # a two-token step timed faster than a one-token one (noise) costs nothing extra
    assert Costs(0.04, 0.1, 0.0, "key", "now", step, t_draft_two=0.03).t_catch_up == 0.0
