"""The report's markdown tables, each from report_data.py's analysis."""
from __future__ import annotations

import json
import math
from collections import Counter

from ..decoding.auto import compare_decompositions, decompose, mean_std
from ..tables import fmt, md_table
from .report_data import (FAMILIES, HEAD_TREE, HEURISTICS, LEARNED_TREE, POS_TREE, DatasetResult, best_of,
                          bound_curve, by_config, fastest, head_order, modelled_tps, paired_ratio, rel_errors, usable)
from .tree_calibration import TREE_POLICIES, VERIFICATION, zeroth_order_accepted

H_REF = 0.7  # the paper's recommended threshold


def pct(x) -> str:
    return "—" if x is None or math.isnan(x) else f"{100 * x:+.1f}%"


def fmt_t(x) -> str:
    return fmt(x, ".4g")


def family_table(results: list[DatasetResult]) -> str:
    rows = []
    for d in results:
        for fam in FAMILIES:
            a = best_of(d, (fam,))
            if a is not None:
                rows.append([d.label, fam, a.config, fmt(a.tokens_per_s), f"{fmt(a.speedup, '.3f')}×",
                             fmt(a.tokens_per_pass, ".3f"), fmt(a.drafted_per_round, ".2f")])
    return md_table(["dataset", "family", "best configuration", "tokens/s", "speed-up vs target alone",
                     "tokens / target pass", "drafted / round"], rows)


def tree_comparisons(results: list[DatasetResult]) -> str:
    """Paired per-prompt tokens/s ratios: the questions the tree baselines answer."""
    trees = (POS_TREE, HEAD_TREE, LEARNED_TREE, "tree, fixed shape", "ERSD", "SpecTr", "batch SD")
    pairs = [("head-estimated vs positional optimal tree", (HEAD_TREE,), (POS_TREE,)),
             ("learned vs best fixed budget", (LEARNED_TREE,), (POS_TREE, HEAD_TREE)),
             ("best tree / multi-draft vs best SpecDec++", trees, ("SpecDec++",)),
             ("best tree / multi-draft vs best fixed K", trees, ("fixed K",))]
    rows = []
    for title, fa, fb in pairs:
        cells = []
        for d in results:
            a, b = best_of(d, fa), best_of(d, fb)
            cells.append(f"{pct(paired_ratio(d, a, b) - 1)} ({a.config} vs {b.config})" if a and b else "—")
        rows.append([title] + cells)
    return md_table(["tokens/s, paired per prompt"] + [d.label for d in results], rows)


def ersd_fig3_table(d: DatasetResult, calibration: dict) -> str:
    """Per tree configuration: measured accepted tokens per pass, the policy's prediction, the 0-th
    order model's for its shape (calibrated rates) and the Tunstall bound for its budget."""
    vocab = calibration.get("settings", {}).get("vocab_size")
    rows = []
    for a in sorted((a for a in d.aggs.values() if a.method in TREE_POLICIES), key=lambda a: a.config):
        rates = calibration.get(VERIFICATION.get(a.method, ""), {}).get("cond_rates")
        k, shape = a.params.get("budget"), a.params.get("drafting")
        fixed = isinstance(k, int) and rates and vocab
        zeroth = zeroth_order_accepted(rates, shape, k, vocab) if fixed else None
        bound = bound_curve(calibration, VERIFICATION[a.method], [k])[0][1] if fixed else None
        rows.append([a.config, fmt(a.drafted_per_round), fmt(a.tree_depth), fmt(a.accepted_per_pass, ".3f"),
                     fmt(a.predicted_per_round, ".3f"), fmt(zeroth, ".3f"), fmt(bound, ".3f"), fmt(a.tokens_per_s)])
    return md_table(["config", "drafted / round", "depth", "accepted / pass (measured)", "predicted (policy, sum R)",
                     "predicted (0-th order, calibration)", "Tunstall bound", "tok/s"], rows)


# Table 1's rows, in order: key -> its name
TABLE1 = {"ar": "autoregressive (target alone)", "k": "SpecDec, best fixed K (speed-up)",
          "pp": "SpecDec++, best head and h (speed-up)", "imp": "relative improvement, SpecDec++ vs best K",
          "imp_p": "same, paired per prompt (geometric mean)", "pp07": f"SpecDec++ at h = {H_REF:g} (best head)",
          "gap": "share of the oracle gap taken by SpecDec++, (S − S_K)/(S_oracle − S_K), tokens/s",
          "gap_p": "same, on speed-ups paired per prompt",
          "mk": "Eq. 5.1 with fitted t: best fixed K", "mpp": "Eq. 5.1 with fitted t: best SpecDec++",
          "mimp": "Eq. 5.1: relative improvement"}


def table1(results: list[DatasetResult]) -> str:
    rows = {k: [] for k in TABLE1}
    for d in results:
        # SpecDec++: a sweep of h = auto alone has its auto rows here, labelled with the h auto picked
        ar, bk, bp, o = d.get("ar"), d.best("fixed"), d.best_specdecpp(), d.get("oracle")
        # the auto pick's yardstick: how much of the room between the best fixed K and the hindsight
        # oracle SpecDec++ takes, (S - S_K) / (S_O - S_K); pooled tokens/s and paired speed-ups
        for key, attr, unit in (("gap", "tokens_per_s", "{:.2f} tok/s"), ("gap_p", "speedup", "{:.3f}×")):
            s, k, top = [getattr(a, attr) for a in (bp, bk, o)] if bp and bk and o else [math.nan] * 3
            rows[key].append(f"{pct((s - k) / (top - k))} (oracle {unit.format(top)})" if top > k else "—")
        rows["ar"].append(f"{fmt(ar.tokens_per_s)} tok/s" if ar else "—")
        rows["k"].append(f"{fmt(bk.tokens_per_s)} (K={bk.k}; {fmt(bk.speedup)}×)" if bk else "—")
        rows["pp"].append(f"{fmt(bp.tokens_per_s)} ({bp.label()}; {fmt(bp.speedup)}×)" if bp else "—")
        rows["imp"].append(pct(bp.tokens_per_s / bk.tokens_per_s - 1) if bp and bk else "—")
        rows["imp_p"].append(pct(paired_ratio(d, bp, bk) - 1) if bp and bk else "—")
        a07 = fastest(a for a in d.of("learned") if a.h is not None and abs(a.h - H_REF) < 1e-9)
        rows["pp07"].append(f"{fmt(a07.tokens_per_s)} ({a07.head}; {100 * a07.tokens_per_s / bp.tokens_per_s:.1f}% of best)"
                            if a07 and bp else "—")
        fit = d.fits["speculative"]
        mk = d.best("fixed", key=lambda a: modelled_tps(a, fit))
        mp = d.best_specdecpp(key=lambda a: modelled_tps(a, fit))
        rows["mk"].append(f"{fmt(modelled_tps(mk, fit))} (K={mk.k})" if mk and usable(fit) else "—")
        rows["mpp"].append(f"{fmt(modelled_tps(mp, fit))} ({mp.label()})" if mp and usable(fit) else "—")
        rows["mimp"].append(pct(modelled_tps(mp, fit) / modelled_tps(mk, fit) - 1) if mk and mp and usable(fit) else "—")
    if not any(d.get("oracle") for d in results):
        del rows["gap"], rows["gap_p"]
    return md_table(["tokens/s"] + [d.label for d in results], [[TABLE1[k]] + v for k, v in rows.items()])


def table2(results: list[DatasetResult]) -> tuple[str, str]:
    body = []
    for setting, title in (("standalone", "stand-alone"), ("specdec", "SpecDec"), ("specdecpp", "SpecDec++"),
                           ("speculative", "SpecDec + SpecDec++")):
        vals = []  # (t_draft, t_target) per dataset
        for d in results:
            f = d.fits[setting]
            if setting == "standalone":
                if f["n_draft"] == 0 and f["n_target"] == 0:
                    continue
                vals.append((f["t_draft"], f["t_target"]))
                fit = [f"{fmt(f['r2_draft'], '.4f')} & {fmt(f['r2_target'], '.4f')}", f"{f['n_draft']} & {f['n_target']}"]
            else:
                if f.n_rows == 0:
                    continue
                vals.append((f.t_draft, f.t_target))
                fit = [fmt(f.r2, ".4f") + ("" if f.rank_ok else " (collinear: one K only?)"), str(f.n_rows)]
            body.append([title, d.label, *map(fmt_t, vals[-1]), *fit])
        if vals and len(results) > 1:
            md, sd = mean_std(v[0] for v in vals)
            mt, st = mean_std(v[1] for v in vals)
            body.append([title, "**average**", f"{fmt_t(md)} ± {fmt_t(sd)}", f"{fmt_t(mt)} ± {fmt_t(st)}", "", ""])
    t2 = md_table(["setting", "dataset", "t_draft (s)", "t_target (s)", "R²", "runs"], body)

    err_rows = []
    for d in results:
        sa, sp = d.fits["standalone"], d.fits["speculative"]
        checks = []
        if sa["t_target"] is not None:
            checks.append(("autoregressive (stand-alone fit)", [r for r in d.rows if r["method"] == "ar"],
                           0.0, sa["t_target"]))
        if usable(sp):
            for ms, title in ((("fixed",), "SpecDec"), (("learned",), "SpecDec++"),
                              (HEURISTICS, "heuristics (conf./entropy/+2-1)"), (("oracle",), "oracle")):
                checks.append((title, [r for r in d.rows if r["method"] in ms], sp.t_draft, sp.t_target))
        for title, rs, td, tt in checks:
            errs = rel_errors(rs, td, tt)
            if errs:
                err_rows.append([d.label, title, str(len(errs)), f"{100 * sum(errs) / len(errs):.1f}%",
                                 f"{100 * max(errs):.1f}%"])
    terr = md_table(["dataset", "configurations", "runs", "mean rel. error", "max rel. error"], err_rows) \
        if err_rows else "_no fitted times (the sweep needs several fixed K / heads, and ar for the stand-alone fit)_"
    return t2, terr


def decomposition(results: list[DatasetResult]) -> str:
    parts = []
    for d in results:
        fit = d.fits["speculative"]
        if not usable(fit):
            continue
        cands = [("best fixed K", d.best("fixed")), ("best SpecDec++", d.best_specdecpp())]
        cands += [("heuristic +2/-1" if m == "heuristic" else m, d.best(m)) for m in HEURISTICS + ("oracle",)]
        rows, decs = [], {}
        for title, a in cands:
            if a is None:
                continue
            dec = decompose(a.n_tokens, a.n_discarded, a.n_target, fit.t_draft, fit.t_target)
            decs[title] = dec
            pt = dec.per_token()
            rows.append([f"{title} ({a.label()})", f"{1e3 * pt['oracle']:.3f}", f"{1e3 * pt['discard']:.3f}",
                         f"{1e3 * pt['verification']:.3f}", f"{1e3 * pt['total']:.3f}",
                         f"{1e3 * a.decode_s / max(a.n_tokens, 1):.3f}"])
        if not rows:
            continue
        txt = [f"**{d.label}** (t_draft = {fmt_t(fit.t_draft)} s, t_target = {fmt_t(fit.t_target)} s)\n",
               md_table(["configuration", "T0/N = t_draft", "t_draft·N_disc/N", "(t_target−t_draft)·N_target/N",
                         "Eq. 5.1 total", "measured decode"], rows)]
        if "best fixed K" in decs and "best SpecDec++" in decs:
            c = compare_decompositions(decs["best SpecDec++"], decs["best fixed K"])
            verdict = (f"SpecDec++ loses most on the **{c['loses']}** term" if c["loses"]
                       else "SpecDec++ is no worse on either term")
            txt.append(f"\nSpecDec++ vs best fixed K (ms/token): discard {1e3 * c['discard']:+.3f}, verification "
                       f"{1e3 * c['verification']:+.3f}, total {1e3 * c['total']:+.3f}; {verdict}.")
        parts.append("\n".join(txt))
    return "\n\n".join(parts) if parts else "_needs fitted speculative forward times_"


def table3(results: list[DatasetResult], heads_info: dict) -> str:
    names = head_order(heads_info, results)
    if not names:
        return "_no SpecDec++ heads in this sweep_"
    best = {(h, d.label): fastest(d.specdecpp(h)) for d in results for h in names if d.specdecpp(h)}
    top = {d.label: max((best[(h, d.label)].tokens_per_s for h in names if (h, d.label) in best), default=None)
           for d in results}
    rows = []
    for h in names:
        info = heads_info.get(h, {})
        met = info.get("metrics") or {}
        cells = [h, fmt(info.get("depth"), "d"), fmt(info.get("w_rej"), "g"), fmt(met.get("train_kl"), ".3f"),
                 fmt(met.get("dev_kl"), ".3f")]
        for d in results:
            a = best.get((h, d.label))
            if a is None:
                cells.append("—")
                continue
            s = f"{a.tokens_per_s:.2f}"
            if top[d.label] and a.tokens_per_s >= 0.99 * top[d.label]:
                s = f"**{s}**"
            cells.append(f"{s} ({a.value_label()})")
        rows.append(cells)
    return md_table(["head", "depth D", "w_rej", "train KL", "dev KL"] + [d.label for d in results], rows)


def peer_table(results: list[DatasetResult]) -> str:
    rows = []
    for d in results:
        hf = d.get("hf_assisted")
        if hf is None:
            continue
        ar, bk, bp = d.get("ar"), d.best("fixed"), d.best_specdecpp()
        rows.append([d.label, fmt(ar.tokens_per_s) if ar else "—", fmt(hf.tokens_per_s),
                     f"{fmt(bk.tokens_per_s)} (K={bk.k})" if bk else "—",
                     f"{fmt(bp.tokens_per_s)} ({bp.label()})" if bp else "—",
                     *(f"{fmt(a.tokens_per_s / hf.tokens_per_s, '.3f')}× ({fmt(paired_ratio(d, a, hf), '.3f')}×)"
                       if a else "—" for a in (bk, bp)),
                     fmt(hf.verification_rate, ".3f"), fmt(hf.discard_rate, ".3f")])
    if not rows:
        return "_no transformers assisted-generation runs in this sweep (hf_assisted: true)_"
    return md_table(["dataset", "autoregressive", "transformers assisted", "our best fixed K", "our best SpecDec++",
                     "best K / assisted (paired)", "SpecDec++ / assisted (paired)", "assisted N_target/N",
                     "assisted N_disc/N (derived)"], rows)


AUTO_OF = {"learned_auto": "learned", "fixed_auto": "fixed"}


def _pick_label(row: dict, method: str) -> str:
    """An auto row's pick: "ar" (no drafting paid), the value, or "h@cap" for an h picked with a cap on K
    (the table time model)."""
    v = row["auto_value"]
    if isinstance(v, str):
        return v
    cap = row.get("auto_k_max")
    return f"{v:g}" + (f"@{cap}" if cap is not None and method == "learned_auto" else "")


def auto_table(results: list[DatasetResult]) -> str:
    """`auto` (h or K picked from the offline curve and the costs measured at load) against the
    best swept value of the same policy on each dataset, and against the best fixed K."""
    rows = []
    for d in results:
        bk = d.best("fixed")
        for a in d.aggs.values():
            if a.method not in AUTO_OF:
                continue
            mine = [r for r in d.rows if r["config"] == a.config]
            picks = sorted({_pick_label(r, a.method) for r in mine if r.get("auto_value") is not None})
            predicted = [r["auto_predicted_tokens_per_s"] for r in mine if r.get("auto_predicted_tokens_per_s")]
            best = fastest(b for b in d.of(AUTO_OF[a.method]) if a.method == "fixed_auto" or b.head == a.head)
            rows.append([d.label, a.config, ", ".join(picks) or "—",
                         fmt(sum(predicted) / len(predicted)) if predicted else "—", fmt(a.tokens_per_s),
                         f"{fmt(best.tokens_per_s)} ({best.label()})" if best else "—",
                         f"{fmt(paired_ratio(d, a, best), '.3f')}×" if best else "—",
                         f"{fmt(paired_ratio(d, a, bk), '.3f')}×" if bk else "—"])
    if not rows:
        return "_no auto configurations in this sweep (auto in ks or thresholds)_"
    return md_table(["dataset", "config", "picked", "predicted tok/s (decoding)", "measured tok/s",
                     "best swept (same policy)", "auto / best swept (paired)", "auto / best fixed K (paired)"], rows)


def all_configs_table(d: DatasetResult) -> str:
    fit = d.fits["speculative"]
    order = {"ar": 0, "draft_ar": 1, "fixed": 2, "fixed_auto": 2.5, "learned": 3, "learned_auto": 3.5,
             "confidence": 4, "entropy": 5, "heuristic": 6, "oracle": 7, "hf_assisted": 8}
    num = lambda v: (1, v) if isinstance(v, str) else (0, v or 0)  # noqa: E731  (k or h may read "auto")
    aggs = sorted(d.aggs.values(), key=lambda a: (order.get(a.method, 9), num(a.k), str(a.head or ""), num(a.h),
                                                  num(a.tau)))
    rows = []
    for a in aggs:
        spec = a.method not in ("ar", "draft_ar")
        rows.append([a.config, str(a.n_prompts), fmt(a.tokens_per_s), fmt(a.speedup, ".3f"),
                     fmt(a.verification_rate, ".3f") if a.method != "draft_ar" else "—",
                     fmt(a.discard_rate, ".3f") if spec else "—", fmt(a.acceptance_rate, ".3f") if spec else "—",
                     fmt(modelled_tps(a, fit)) if spec and not a.derived else "—"])
    return md_table(["config", "prompts", "tok/s", "speed-up vs AR", "N_target/N", "N_disc/N", "accept",
                     "Eq. 5.1 tok/s"], rows)


BREAKDOWN = ("prefill", "draft_forward", "target_forward", "draft_other", "verify_other", "rollback", "rest")


def breakdown_table(d: DatasetResult) -> str | None:
    """Where each configuration's time went, ms per generated token pooled over its rows (Metrics.breakdown),
    and the decode time outside both models' forwards as a share of decode time (prefill left out);
    None where the rows predate the breakdown."""
    by = by_config([r for r in d.rows if isinstance(r.get("breakdown"), dict)])
    if not by:
        return None
    out = []
    for config, rows in by.items():
        n = sum(r["n_tokens"] for r in rows) or 1
        parts = {k: sum(r["breakdown"].get(k, 0.0) for r in rows) for k in BREAKDOWN}
        decode = sum(parts.values()) - parts["prefill"]
        outside = parts["draft_other"] + parts["verify_other"] + parts["rollback"] + parts["rest"]
        out.append([config] + [fmt(1e3 * parts[k] / n, ".2f") for k in BREAKDOWN]
                   + [fmt(100 * outside / decode if decode else float("nan"), ".1f")])
    return md_table(["config", *(f"{k} ms/tok" for k in BREAKDOWN), "outside forwards % of decode"], out)


def cpu_lines(rows: list[dict]) -> list[str]:
    """The CPU each run measured on (ISA, flags, the kernels each model ran): timings from one CPU
    say little about another, so the report names it; one line per distinct machine."""
    seen = Counter((r.get("isa"), r.get("cpu_flags"), json.dumps(r.get("paths"), sort_keys=True))
                   for r in rows if r.get("isa") or r.get("cpu_flags"))
    return [f"CPU: ISA {isa or '?'} | flags: {flags or '-'} | kernels: {paths} ({n} runs)" for (isa, flags, paths), n
            in seen.items()] + ([""] if seen else [])


def engines_section(sweeps: list[tuple[str, list[DatasetResult]]]) -> list[str]:
    """Sweeps run on different engines (torch, llama.cpp) on the same prompts, one table per dataset:
    wall tokens/s of every configuration and its ratio to the first engine's target alone."""
    md = ["## Engines side by side", "",
          "The same prompts and settings through each engine's sweep (`backend` in the sweep config); tokens/s is "
          "wall-clock, prefill included; ×ar is the ratio to the first engine's target alone, ×own ar to the "
          "same engine's.", ""]
    labels = list(dict.fromkeys(d.label for _, results in sweeps for d in results))
    for label in labels:
        rows, base = [], None
        for engine, results in sweeps:
            d = next((d for d in results if d.label == label), None)
            if d is None:
                continue
            own = d.get("ar")
            base = base or own
            for a in sorted(d.aggs.values(), key=lambda a: (a.method != "ar", -a.tokens_per_s)):
                rows.append([engine, a.config, str(a.n_prompts), fmt(a.tokens_per_s),
                             fmt(a.tokens_per_s / base.tokens_per_s, ".2f") if base else "—",
                             fmt(a.tokens_per_s / own.tokens_per_s, ".2f") if own else "—",
                             fmt(a.acceptance_rate, ".3f") if a.method not in ("ar", "draft_ar") else "—"])
        md += [f"### {label}", "", md_table(["engine", "config", "prompts", "tok/s", "×ar", "×own ar", "accept"], rows),
               ""]
    return md
