"""`adaptive-spec report` on a hand-made results file whose numbers are known exactly.

Every run obeys Eq. 3.1 with t_draft = 0.01 s and t_target = 0.05 s on its decode time, plus
0.02 s of prefill in the wall time; prompt 2 has half the counts of prompt 1.
"""
import json

import pytest

from adaptive_spec.evaluation import report
from adaptive_spec.evaluation.report_data import analyse, load_sweep, modelled_tps, rel_errors
from adaptive_spec.evaluation.report_plots import pareto_series
from adaptive_spec.evaluation.report_tables import table1
from adaptive_spec.cli import main as cli_main
from adaptive_spec.errors import UserError

TD, TT, PREFILL = 0.01, 0.05, 0.02
# config -> (method, params, N, N_draft, N_target) for prompt 1 (N_discarded = N_draft + N_target - N)
CONFIGS = {
    "ar": ("ar", {}, 100, 0, 100),
    "draft_ar": ("draft_ar", {}, 100, 100, 0),
    "fixed:k=2": ("fixed", {"k": 2}, 100, 80, 40),
    "fixed:k=4": ("fixed", {"k": 4}, 100, 100, 25),
    "learned:head=d3-wrej6:h=0.3": ("learned", {"head": "d3-wrej6", "h": 0.3}, 100, 75, 30),
    "learned:head=d3-wrej6:h=0.7": ("learned", {"head": "d3-wrej6", "h": 0.7}, 100, 88, 22),
    "learned:head=d0-wrej1:h=0.7": ("learned", {"head": "d0-wrej1", "h": 0.7}, 100, 96, 24),
    "heuristic": ("heuristic", {}, 100, 110, 20),
    "hf_assisted": ("hf_assisted", {}, 100, 90, 30),
}
HF_WALL = 3.0  # per prompt-1 run; prompt 2: half


def make_rows(datasets=("alpaca", "gsm8k")):
    rows = []
    for ds in datasets:
        for p, scale in ((0, 1.0), (1, 0.5)):
            for cfg, (method, params, n, nd, nt) in CONFIGS.items():
                n, nd, nt = n * scale, nd * scale, nt * scale
                decode = TD * nd + TT * nt
                derived = method == "hf_assisted"
                wall = HF_WALL * scale if derived else decode + PREFILL
                row = {"dataset": ds, "prompt_idx": p, "prompt_sha": f"{ds}{p}", "config": cfg, "method": method,
                       "k": params.get("k"), "head": params.get("head"), "h": params.get("h"), "tau": None,
                       "n_tokens": n, "n_draft_forwards": nd, "n_target_forwards": nt,
                       "n_discarded": max(0.0, nd + nt - n) if method not in ("ar", "draft_ar") else 0,
                       "n_accepted": n - nt if method not in ("ar", "draft_ar") else 0,
                       "n_drafted": nd if method not in ("ar", "draft_ar") else 0,
                       "wall_s": wall, "prefill_s": 0.0 if derived else PREFILL, "counts_derived": derived}
                rows.append(row)
    return rows


def write_sweep(tmp_path, rows):
    d = tmp_path / "sweep"
    d.mkdir()
    with open(d / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    heads = {"d3-wrej6": {"label": "d3-wrej6", "path": "checkpoints/d3-wrej6/head", "depth": 3, "w_rej": 6,
                          "metrics": {"train_kl": 0.617, "dev_kl": 0.582}},
             "d0-wrej1": {"label": "d0-wrej1", "path": "checkpoints/d0-wrej1/head", "depth": 0, "w_rej": 1,
                          "metrics": {"train_kl": 0.422, "dev_kl": 0.412}}}
    (d / "heads.json").write_text(json.dumps(heads))
    (d / "config.json").write_text(json.dumps({"config": {"target": "T", "draft": "D", "temperature": 1.0},
                                               "notes": ["oracle skipped: test note"], "device": "cpu"}))
    return d


def tps(cfg, wall_of=None):
    """Pooled measured tokens/s of a config over both prompts."""
    method, params, n, nd, nt = CONFIGS[cfg]
    if method == "hf_assisted":
        return 1.5 * n / (1.5 * HF_WALL)
    return 1.5 * n / (1.5 * (TD * nd + TT * nt) + 2 * PREFILL)


def test_numbers(tmp_path):
    d = write_sweep(tmp_path, make_rows())
    results = analyse(load_sweep(d)[0])
    assert [r.label for r in results] == ["alpaca", "gsm8k"]
    a = results[0]
    # forward-time fits recover the times exactly
    sa = a.fits["standalone"]
    assert sa["t_draft"] == pytest.approx(TD) and sa["t_target"] == pytest.approx(TT)
    for setting in ("specdec", "specdecpp", "speculative"):
        f = a.fits[setting]
        assert f.t_draft == pytest.approx(TD) and f.t_target == pytest.approx(TT) and f.r2 == pytest.approx(1.0)
    # pooled rates and throughputs
    k4 = a.get("fixed:k=4")
    assert k4.verification_rate == pytest.approx(25 / 100) and k4.discard_rate == pytest.approx(25 / 100)
    assert k4.tokens_per_s == pytest.approx(tps("fixed:k=4"))
    assert a.best("fixed").k == 4
    best = a.best("learned")
    assert (best.head, best.h) == ("d3-wrej6", 0.7)
    assert best.tokens_per_s == pytest.approx(tps("learned:head=d3-wrej6:h=0.7"))
    # speed-up vs AR: paired per prompt
    ar1 = 100 / (TT * 100 + PREFILL)
    ar2 = 50 / (TT * 50 + PREFILL)
    k1 = 100 / (TD * 100 + TT * 25 + PREFILL)
    k2 = 50 / (TD * 50 + TT * 12.5 + PREFILL)
    assert k4.speedup == pytest.approx(((k1 / ar1) * (k2 / ar2)) ** 0.5)
    # Eq. 5.1 modelled throughput with the exact fit
    assert modelled_tps(best, a.fits["speculative"]) == pytest.approx(150 / (TD * 132 + TT * 33))
    # the errors of Eq. 5.1 against decode throughput are zero for exact rows
    ours = [r for r in a.rows if r["method"] != "hf_assisted"]
    assert max(rel_errors(ours, TD, TT)) == pytest.approx(0.0, abs=1e-9)


def test_markdown_tables_and_plots(tmp_path, capsys):
    rows = make_rows()
    for i, r in enumerate(rows):  # the sweep records the CPU of each run; two machines here
        r.update(isa="AVX512" if i % 3 else "AVX2", cpu_flags="avx2 avx512f" if i % 3 else "avx2",
                 paths={"target": {"dtype": "bfloat16" if i % 3 else "float32"}})
    d = write_sweep(tmp_path, rows)
    out = tmp_path / "out" / "report.md"
    assert cli_main(["report", "--sweep-dir", str(d), "--out", str(out)]) == 0
    md = out.read_text()
    for ds in ("alpaca", "gsm8k"):
        png = out.parent / f"pareto_{ds}.png"
        assert png.is_file() and png.stat().st_size > 1000
        assert f"]({png.name})" in md
    for title in ("## Table 1", "## Table 2", "## Table 3", "## Peer", "Eq. 3.2", "note: oracle skipped"):
        assert title in md
    n_avx2 = len(range(0, len(rows), 3))
    assert (f'CPU: ISA AVX2 | flags: avx2 | kernels: {{"target": {{"dtype": "float32"}}}} ({n_avx2} runs)' in md
            and f"CPU: ISA AVX512 | flags: avx2 avx512f | kernels: " in md and f"({len(rows) - n_avx2} runs)" in md)
    t1 = md.split("## Table 1")[1].split("## Table 2")[0]
    assert "oracle gap" not in t1  # no oracle rows here
    pp, k4, ar = tps("learned:head=d3-wrej6:h=0.7"), tps("fixed:k=4"), tps("ar")
    assert f"{ar:.2f} tok/s" in t1
    assert f"{k4:.2f} (K=4;" in t1
    assert f"{pp:.2f} (d3-wrej6, h=0.7;" in t1
    assert f"{100 * (pp / k4 - 1):+.1f}%" in t1
    assert f"{150 / (TD * 132 + TT * 33):.2f} (d3-wrej6, h=0.7)" in t1  # Eq. 5.1 row
    t2 = md.split("## Table 2")[1].split("## Table 3")[0]
    assert "| stand-alone | alpaca | 0.01 | 0.05 | 1.0000 & 1.0000 | 2 & 2 |" in t2
    assert "| SpecDec | alpaca | 0.01 | 0.05 | 1.0000 | 4 |" in t2
    assert "| SpecDec++ | alpaca | 0.01 | 0.05 | 1.0000 | 6 |" in t2
    assert "0.01 ± 0" in t2  # averages over the two datasets
    assert "| alpaca | SpecDec | 4 | 0.0% | 0.0% |" in t2
    # Eq. 3.2: SpecDec++ (22 target passes, 10 discards) beats K=4 (25, 25) on both terms
    assert "SpecDec++ is no worse on either term" in md
    t3 = md.split("## Table 3")[1].split("## Peer")[0]
    other = tps("learned:head=d0-wrej1:h=0.7")
    assert f"| d3-wrej6 | 3 | 6 | 0.617 | 0.582 | **{pp:.2f}** (h=0.7) |" in t3
    assert f"| d0-wrej1 | 0 | 1 | 0.422 | 0.412 | {other:.2f} (h=0.7) |" in t3  # below 99% of the best: not bold
    peer = md.split("## Peer")[1].split("## All configurations")[0]
    hf = tps("hf_assisted")
    assert f"| alpaca | {ar:.2f} | {hf:.2f} | {k4:.2f} (K=4) | {pp:.2f} (d3-wrej6, h=0.7) | {k4 / hf:.3f}×" in peer
    assert f"{pp / hf:.3f}×" in peer


def test_oracle_gap_share(tmp_path):
    """With oracle rows (a greedy sweep), Table 1 says what share of the gap between the best fixed K
    and the oracle SpecDec++ takes; without them (test above) the rows are absent."""
    rows = make_rows()
    for r in [r for r in rows if r["config"] == "ar"]:
        n = r["n_tokens"]  # the oracle: 18 target passes per 100 tokens, no discards
        nd, nt = 0.82 * n, 0.18 * n
        rows.append(dict(r, config="oracle", method="oracle", n_draft_forwards=nd, n_target_forwards=nt,
                         n_discarded=0, n_accepted=n - nt, n_drafted=nd, wall_s=TD * nd + TT * nt + PREFILL))
    d = write_sweep(tmp_path, rows)
    t1 = table1(analyse(load_sweep(d)[0]))
    o = 150 / (1.5 * (TD * 82 + TT * 18) + 2 * PREFILL)
    pp, k4 = tps("learned:head=d3-wrej6:h=0.7"), tps("fixed:k=4")
    assert 0 < (pp - k4) / (o - k4) < 1
    assert f"{100 * (pp - k4) / (o - k4):+.1f}% (oracle {o:.2f} tok/s)" in t1
    assert "same, on speed-ups paired per prompt" in t1
    assert "oracle gap" not in table1(analyse([r for r in rows if r["method"] != "oracle"]))


def test_mean_aggregation_and_incomplete_prompts(tmp_path):
    rows = make_rows(("alpaca",))
    # drop one config of prompt 2: prompt 2 is incomplete and left out everywhere
    rows = [r for r in rows if not (r["prompt_idx"] == 1 and r["config"] == "fixed:k=2")]
    res = analyse(rows, how="mean")[0]
    assert res.n_prompts == 1 and res.dropped_prompts == 1
    assert res.get("fixed:k=4").tokens_per_s == pytest.approx(100 / (TD * 100 + TT * 25 + PREFILL))


def test_errors(tmp_path, capsys):
    assert report.main(["--sweep-dir", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    (tmp_path / "results.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(UserError, match="not a sweep results file"):
        report.build_report(tmp_path)


# ----------------------------------------------------------------------------- tree and multi-draft rows

# config -> (method, params, N, N_draft, N_target, n_drafted, tree depth, predicted accepted per round), prompt 1
TREE_CONFIGS = {
    "tree:tree:positional:b=4": ("tree", {"drafting": "tree", "estimator": "positional", "budget": 4},
                                 100, 60, 30, 120, 2.0, 2.5),
    "tree:tree:head=d3-wrej6:b=4": ("tree", {"drafting": "tree", "estimator": "head", "budget": 4, "head": "d3-wrej6"},
                                    100, 60, 25, 100, 2.5, 3.2),
    "tree:tree:positional:b=learned<=8:c=auto": ("tree", {"drafting": "tree", "estimator": "positional",
                                                          "budget": "learned", "max_budget": 8},
                                                 100, 50, 26, 90, 2.2, 2.9),
    "ersd:tree:positional:b=4": ("ersd", {"drafting": "tree", "estimator": "positional", "budget": 4},
                                 100, 60, 28, 112, 2.1, 2.6),
    "spectr:n=2:k=2": ("spectr", {"num_drafts": 2, "k": 2}, 100, 80, 40, 160, None, None),
}
CALIBRATION = {"settings": {"prompts": ["p1", "p2"], "vocab_size": 32},
               "gsd": {"cond_rates": [0.6, 0.3, 0.2]}, "ersd": {"cond_rates": [0.7, 0.35, 0.2]}}


def make_tree_rows(datasets=("alpaca", "gsm8k")):
    rows = []
    for ds in datasets:
        for p, scale in ((0, 1.0), (1, 0.5)):
            for cfg, (method, params, n, nd, nt, drafted, depth, pred) in TREE_CONFIGS.items():
                n, nd, nt, drafted = n * scale, nd * scale, nt * scale, drafted * scale
                rows.append({"dataset": ds, "prompt_idx": p, "prompt_sha": f"{ds}{p}", "config": cfg, "method": method,
                             "k": params.get("k"), "head": params.get("head"), "h": None, "tau": None, **params,
                             "n_tokens": n, "n_draft_forwards": nd, "n_target_forwards": nt, "rounds": nt,
                             "n_accepted": n - nt, "n_drafted": drafted, "n_discarded": drafted - (n - nt),
                             "tree_depth": depth, "predicted_accepted": pred,
                             "wall_s": TD * nd + TT * nt + PREFILL, "prefill_s": PREFILL, "counts_derived": False})
    return rows


def tree_tps(cfg, scale=None):
    """Measured tokens/s: pooled over both prompts, or of one prompt (scale 1 or 0.5)."""
    _, _, n, nd, nt, *_ = TREE_CONFIGS[cfg] if cfg in TREE_CONFIGS else CONFIGS[cfg]
    if scale is None:
        return 1.5 * n / (1.5 * (TD * nd + TT * nt) + 2 * PREFILL)
    return scale * n / (scale * (TD * nd + TT * nt) + PREFILL)


def paired(a, b):
    return (tree_tps(a, 1.0) / tree_tps(b, 1.0) * tree_tps(a, 0.5) / tree_tps(b, 0.5)) ** 0.5


def test_tree_rows_family_table_plots_and_fig3(tmp_path):
    from adaptive_spec.evaluation.tree_calibration import tunstall_accepted, zeroth_order_accepted

    d = write_sweep(tmp_path, make_rows() + make_tree_rows())
    (d / "tree_calibration.json").write_text(json.dumps(CALIBRATION))
    out = report.build_report(d)
    md = out.read_text()
    t1 = md.split("## Table 1")[1].split("## Table 2")[0]
    head, pos = "tree:tree:head=d3-wrej6:b=4", "tree:tree:positional:b=4"
    learned = "tree:tree:positional:b=learned<=8:c=auto"
    # the best of each family, with tokens/s, paired speed-up over the target alone, tokens and drafted per pass
    for cfg, fam, tok_pass, drafted in ((head, "optimal tree, head-estimated R", "4.000", "4.00"),
                                        (pos, "optimal tree, positional R", "3.333", "4.00"),
                                        ("spectr:n=2:k=2", "SpecTr", "2.500", "4.00")):
        line = (f"| alpaca | {fam} | {cfg} | {tree_tps(cfg):.2f} | {paired(cfg, 'ar'):.3f}× | {tok_pass} | "
                f"{drafted} |")
        assert line in t1
    assert f"| alpaca | fixed K | fixed:k=4 | {tree_tps('fixed:k=4'):.2f} |" in t1
    assert f"| gsm8k | optimal tree, learned budget | {learned} |" in t1
    assert "| alpaca | ERSD | ersd:tree:positional:b=4 |" in t1 and "batch SD" not in t1  # no such rows
    # head vs positional tree, learned vs best fixed budget (the head tree here), paired per prompt
    assert f"{100 * (paired(head, pos) - 1):+.1f}% ({head} vs {pos})" in t1
    assert f"{100 * (paired(learned, head) - 1):+.1f}% ({learned} vs {head})" in t1
    # ERSD Fig. 3: measured (105 accepted / 45 passes), the policy's prediction, the 0-th order model
    # and the Tunstall bound of the calibrated rates; none of the latter for a learned budget or SpecTr
    z, b = zeroth_order_accepted([0.6, 0.3, 0.2], "tree", 4, 32), tunstall_accepted([0.6, 0.3, 0.2], 4, 32)
    assert b >= z
    fig3 = md.split("## ERSD Fig. 3")[1]
    assert f"| {pos} | 4.00 | 2.00 | 2.333 | 2.500 | {z:.3f} | {b:.3f} |" in fig3
    assert f"| {learned} | 3.46 | 2.20 | 2.846 | 2.900 | — | — |" in fig3
    assert "| spectr:n=2:k=2 | 4.00 | — | 1.500 | — | — | — |" in fig3
    assert "2 calibration prompts (gsd: c = [0.6, 0.3, 0.2]; ersd: c = [0.7, 0.35, 0.2])" in fig3
    for ds in ("alpaca", "gsm8k"):
        png = d / f"accepted_vs_drafted_{ds}.png"
        assert png.is_file() and png.stat().st_size > 1000 and f"]({png.name})" in md
    # the chain tables keep their numbers
    assert f"{tps('fixed:k=4'):.2f} (K=4;" in t1


def test_report_without_tree_rows_has_no_tree_sections(tmp_path):
    d = write_sweep(tmp_path, make_rows())
    md = report.build_report(d).read_text()
    assert "per family" not in md and "ERSD" not in md and "accepted_vs_drafted" not in md
    assert not list(d.glob("accepted_vs_drafted_*.png"))


def test_the_report_says_in_words_what_was_fastest_and_why(tmp_path, capsys):
    """At the top: the fastest configuration per dataset, its ratio to the target alone, and its round priced
    in target steps with the times fitted to the rows (no costs.json): t_draft / t_target = 0.2 exactly."""
    d = write_sweep(tmp_path, make_rows())
    assert report.main(["--sweep-dir", str(d)]) == 0
    md = (d / "report.md").read_text()
    top = md.split("\n## ")[0]
    assert top.startswith("# SpecDec++ sweep report: sweep\n\n**In short**")  # under the title
    pp, ar = tps("learned:head=d3-wrej6:h=0.7"), tps("ar")
    # 1.5 x (100 tokens, 88 drafted, 22 passes): 4.55 tokens and 4 drafted a round, (0.88 + 1.1) / 1.1 steps
    assert (f"- **alpaca (2 prompts)**: the fastest here was SpecDec++ d3-wrej6 h=0.7, {pp:.2f} tok/s, "
            f"{pp / ar:.2f}x the target alone. Why: its rounds made 4.55 tokens for 4.00 drafted and took 1.80 "
            "one-row target steps each (the forward times fitted to these rows: a draft step 0.20 target steps): "
            "speculation pays here") in top
    # the command prints the same lines
    assert "- **gsm8k (2 prompts)**: the fastest here was SpecDec++ d3-wrej6 h=0.7" in capsys.readouterr().out


def test_in_words_beside_another_engine_with_the_measured_costs(tmp_path):
    """With --beside: against the first engine's target alone; where the sweep pinned costs for auto
    (costs.json), the round is priced with them under the engine's time model (llama.cpp: per-length table)."""
    from adaptive_spec.decoding.auto import Costs

    def sweep(name, backend, configs):
        rows = []
        for p in (0, 1):
            for cfg, (method, k, nd, nt, hist, wall) in configs.items():
                rows.append({"dataset": "humaneval", "prompt_idx": p, "prompt_sha": str(p), "config": cfg,
                             "method": method, "k": k, "n_tokens": 64, "n_draft_forwards": nd, "n_target_forwards": nt,
                             "n_drafted": nd, "n_accepted": 64 - nt if nd else 0, "n_discarded": max(0, nd + nt - 64),
                             "target_pass_hist": hist, "wall_s": wall, "prefill_s": 0.5,
                             **({"auto_value": "ar", "head": "d3", "h": "auto"} if method == "learned_auto" else {})})
        folder = tmp_path / name
        folder.mkdir()
        (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / "config.json").write_text(json.dumps({"config": {"pair": {"backend": backend}}}))
        return folder

    # auto picked the target alone: a row as fast as it, drafting nothing, is no speculative configuration
    llama = sweep("llama", "llama.cpp", {"ar": ("ar", None, 0, 64, {"1": 64}, 13.0),
                                         "fixed:k=3": ("fixed", 3, 60, 20, {"4": 20}, 16.0),
                                         "learned:h=auto": ("learned_auto", None, 0, 64, {"1": 64}, 13.1)})
    torch = sweep("torch", "torch", {"ar": ("ar", None, 0, 64, {"1": 64}, 26.0)})
    # a 4-row pass costs 2.8 steps, a draft step 0.88: K = 3 rounds of 3.2 tokens cost 2.8 + 3 x 0.88 steps
    t1 = 0.2
    costs = Costs(0.88 * t1, t1, 0.0, "k", "now", tuple(t1 * v for v in (1, 1.5, 2, 2.8, 3, 3.2, 3.4, 3.6, 3.8)))
    (llama / "costs.json").write_text(json.dumps(costs.to_dict()))
    assert report.main(["--sweep-dir", str(llama), "--beside", str(torch)]) == 0
    top = (llama / "report.md").read_text().split("\n## ")[0]
    assert ("- **humaneval (2 prompts)**: `auto` chose the target alone (SpecDec++ d3 h=auto on llama.cpp), drafting "
            "nothing; the fastest here was the target alone on llama.cpp, 4.92 tok/s; the fastest configuration that "
            "speculated, fixed K=3 on llama.cpp, ran at 0.81x of it; torch's fastest, the target alone, 0.50x. "
            "Why: its rounds made 3.20 tokens for 3.00 drafted and took 5.44 one-row target steps each (the costs "
            "measured for auto, costs.json: a draft step 0.88 target steps, a 4-row pass 2.80): speculation does "
            "not pay here (0.81x its engine's target alone, paired per prompt).") in top


# ----------------------------------------------------------------------------- a sweep of h = auto only

# `make run`'s sweep: the target alone, fixed K = 3, SpecDec++ at h = auto, prompt lookup and the two combined
# (`policies` entries: method ngram, under their labels); config -> (method, fields, N_draft, N_target, drafted,
# wall) of prompt 1 (64 tokens; prompt 2: half of every count and of the wall time)
QUICK = {"ar": ("ar", {}, 0, 64, 0, 13.0),
         "fixed:k=3": ("fixed", {"k": 3}, 60, 20, 60, 16.0),
         "learned:head=d3-wrej6:h=auto": ("learned_auto", {"head": "d3-wrej6", "h": "auto", "auto_value": 0.3},
                                          50, 18, 50, 11.0),
         "ngram k=auto": ("ngram", {"k": "auto", "settings": {"k": "auto"}}, 0, 30, 50, 14.0),
         "combined auto": ("ngram", {"head": "checkpoints/d3-wrej6", "h": "auto",
                                     "settings": {"fallback": "learned", "threshold": "auto"}}, 20, 25, 60, 14.5)}


def quick_rows(**change):
    """QUICK's rows, with `change`: config -> new (method, fields, N_draft, N_target, drafted, wall)."""
    rows = []
    for p, scale in ((0, 1.0), (1, 0.5)):
        for cfg, (method, fields, nd, nt, drafted, wall) in {**QUICK, **change}.items():
            accepted = 64 - nt if drafted else 0
            rows.append({"dataset": "humaneval", "prompt_idx": p, "prompt_sha": str(p), "config": cfg, "method": method,
                         "k": None, "head": None, "h": None, "tau": None, **fields, "n_tokens": 64 * scale,
                         "n_draft_forwards": nd * scale, "n_target_forwards": nt * scale, "n_drafted": drafted * scale,
                         "n_accepted": accepted * scale, "n_discarded": (drafted - accepted) * scale,
                         "wall_s": wall * scale, "prefill_s": 0.5 * scale})
    return rows


def quick_tps(cfg):
    return 64 / QUICK[cfg][5]


def test_an_auto_only_sweep_fills_table1_table3_and_the_plot(tmp_path):
    """thresholds: [auto] alone: Table 1's SpecDec++ rows are the h = auto row, labelled with the h auto picked,
    and Figure 3 holds a point for every configuration, each at its measured rates."""
    d = write_sweep(tmp_path, quick_rows())
    out = report.build_report(d)
    md = out.read_text()
    t1 = md.split("## Table 1")[1].split("## Table 2")[0]
    pp = quick_tps("learned:head=d3-wrej6:h=auto")
    assert f"| SpecDec++, best head and h (speed-up) | {pp:.2f} (d3-wrej6, h=0.3 (auto); " in t1
    k3 = quick_tps("fixed:k=3")
    assert f"| relative improvement, SpecDec++ vs best K | {100 * (pp / k3 - 1):+.1f}% |" in t1
    t3 = md.split("## Table 3")[1].split("## auto:")[0]
    assert f"| d3-wrej6 | 3 | 6 | 0.617 | 0.582 | **{pp:.2f}** (h=0.3 (auto)) |" in t3
    assert "the fastest here was SpecDec++ d3-wrej6 h=0.3 (auto)" in md.split("\n## ")[0]

    result = analyse(load_sweep(d)[0])[0]
    series = pareto_series(result, ["d3-wrej6"])
    points = {p[0]: (s.label, p) for s in series for p in s.points}
    assert sorted(points) == sorted(QUICK)  # every configuration once: no draft alone in this sweep
    assert sum(len(s.points) for s in series) == len(QUICK)
    for cfg, (method, fields, nd, nt, drafted, _) in QUICK.items():
        accepted = 64 - nt if drafted else 0
        _, x, y, _ = points[cfg][1]
        assert (x, y) == (pytest.approx((drafted - accepted) / 64), pytest.approx(nt / 64)), cfg
    assert points["learned:head=d3-wrej6:h=auto"][0] == "SpecDec++ d3-wrej6, h = auto"
    assert points["learned:head=d3-wrej6:h=auto"][1][3] == "h=0.3 (auto)"  # the note beside the point
    assert points["ngram k=auto"][0] == "ngram k=auto" and points["combined auto"][0] == "combined auto"
    assert points["ar"][0] == "target alone" and points["fixed:k=3"][1][3] == "K=3"
    png = out.parent / "pareto_humaneval.png"
    assert png.is_file() and png.stat().st_size > 1000

    # beside a swept h, Table 1 keeps to the swept values (the auto row reruns one of them), the plot shows both
    swept = ("learned", {"head": "d3-wrej6", "h": 0.7}, 60, 20, 60, 12.0)
    result = analyse(quick_rows(**{"learned:head=d3-wrej6:h=0.7": swept}))[0]
    assert f"| SpecDec++, best head and h (speed-up) | {64 / 12:.2f} (d3-wrej6, h=0.7; " in table1([result])
    assert {p[0] for s in pareto_series(result, []) for p in s.points} == set(QUICK) | {
        "learned:head=d3-wrej6:h=0.7"}


def test_in_short_when_auto_ran_the_target_alone(tmp_path):
    """auto picked the target alone and its row, drafting nothing, ran faster than the target alone's by
    noise: the verdict says first that auto ran the target alone, never names that row the fastest, and then
    names the fastest configuration that speculated with its ratio."""
    alone = ("learned_auto", {"head": "d3-wrej6", "h": "auto", "auto_value": "ar"}, 0, 64, 0, 12.9)
    rows = quick_rows(**{"learned:head=d3-wrej6:h=auto": alone})
    d = write_sweep(tmp_path, rows)
    result = analyse(load_sweep(d)[0])[0]
    auto, ar = result.get("learned:head=d3-wrej6:h=auto"), result.get("ar")
    assert auto.tokens_per_s > ar.tokens_per_s  # the control: the fastest row of all is the one that drafted nothing
    top = report.build_report(d).read_text().split("\n## ")[0]
    ng = quick_tps("ngram k=auto")
    assert (f"- **humaneval (2 prompts)**: `auto` chose the target alone (SpecDec++ d3-wrej6 h=auto), drafting "
            f"nothing; the fastest here was the target alone, {64 / 13:.2f} tok/s; the fastest configuration that "
            f"speculated, ngram k=auto, ran at {ng / (64 / 13):.2f}x of it.") in top
    assert "the fastest here was SpecDec++" not in top
    t1 = table1([result])
    assert f"{auto.tokens_per_s:.2f} (d3-wrej6, h=auto: the target alone; " in t1

    # prompt lookup faster than the target alone: named the fastest, after what auto did
    faster = ("ngram", {"k": "auto", "settings": {"k": "auto"}}, 0, 30, 50, 10.0)
    (tmp_path / "faster").mkdir()
    d2 = write_sweep(tmp_path / "faster", quick_rows(**{"learned:head=d3-wrej6:h=auto": alone, "ngram k=auto": faster}))
    top = report.build_report(d2).read_text().split("\n## ")[0]
    assert ("`auto` chose the target alone (SpecDec++ d3-wrej6 h=auto), drafting nothing; the fastest here was "
            f"ngram k=auto, 6.40 tok/s, {6.4 / (64 / 13):.2f}x the target alone.") in top
