"""Tables and Pareto plots from a sweep (SpecDec++ Figure 3, Tables 1-3), and the peer comparison.

    adaptive-spec report --sweep-dir runs/sweep/paper [--out report.md] [--aggregate pooled|mean]

Reads <sweep-dir>/results.jsonl (+ heads.json, config.json) written by `adaptive-spec sweep` and
writes a markdown report (default <sweep-dir>/report.md) with one Pareto plot per dataset
(pareto_<dataset>.png beside it):

  Figure 3  verification rate N_target/N (y) vs discard rate N_discarded/N (x): fixed K joined
            as a curve, SpecDec++ per head (one colour/marker per head, points labelled h), the
            training-free heuristics, the oracle, transformers' assisted generation.
  Table 1   best measured tokens/s of SpecDec++ vs the best fixed K vs autoregressive, relative
            improvement, SpecDec++ at h = 0.7, the share of the gap to the oracle (greedy sweeps);
            and the same under Eq. (5.1) with fitted times.
  Table 2   fitted t_draft, t_target with R^2: stand-alone, SpecDec, SpecDec++; Eq. (5.1)
            throughput vs measured, relative error per prompt.
  Eq. 3.2   per-token decomposition oracle + discard + verification: which term loses.
  Table 3   per head: depth, w_rej, train/dev KL, best tokens/s and best h per dataset.
  Peer      transformers assisted generation vs our best fixed K and SpecDec++, wall clock.
With tree / multi-draft rows (the sweep's `trees`), also:
  Table 1   + the best configuration of every family (fixed K, SpecDec++, optimal tree with
            positional / head-estimated R / learned budget, ERSD, SpecTr, batch SD, transformers
            assisted, ...): tokens/s, speed-up over the target alone, tokens per target pass;
            head vs positional tree and learned vs best fixed budget, paired per prompt.
  Fig. A    accepted tokens per target pass (y) vs drafted tokens per round (x), every family
            (accepted_vs_drafted_<dataset>.png), with the trees' predicted values and the Tunstall
            bound of the calibrated rates.
  ERSD Fig. 3  per tree configuration: measured vs predicted accepted tokens per pass (the
            policy's sum of R, and the 0-th order model of tree_calibration.json) and the bound.

Aggregation over prompts. "pooled" (default): ratios of sums, e.g. N_target/N = sum N_target /
sum N and tokens/s = sum N / sum wall time, i.e. every token weighs the same (this matches total
time, Eq. 3.1, summed over prompts). "mean": the mean over prompts of the per-prompt values.
Speed-ups against autoregressive decoding are always paired per prompt (the configurations of a
prompt ran back to back) and averaged geometrically. Only prompts on which every configuration of
the dataset finished are used, so an interrupted sweep compares like with like.
Measured tokens/s are end to end (wall time, prompt prefill included); the forward-time fits use
decode time, wall - prefill, because N_draft / N_target count decoding forwards only.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..decoding import timemodel
from ..decoding.timemodel import comparison_table
from ..errors import UserError, run_main
from ..runs import read_json, read_jsonl
from ..tables import fmt, md_table
from .sweep import RESULTS, stored_pair
from .tree_calibration import TREE_POLICIES, VERIFICATION, tunstall_accepted, zeroth_order_accepted

SPEC_METHODS = ("fixed", "learned")  # the settings of Table 2's speculative fit (the paper's SpecDec, SpecDec++)
HEURISTICS = ("confidence", "entropy", "heuristic")
H_REF = 0.7  # the paper's recommended threshold


# ----------------------------------------------------------------------------- loading

def load_sweep(sweep_dir: Path) -> tuple[list[dict], dict, dict]:
    """(rows, heads info, config info) of a sweep folder."""
    sweep_dir = Path(sweep_dir)
    rpath = sweep_dir / RESULTS
    if not rpath.is_file() and not rpath.with_name(RESULTS + ".gz").is_file():
        raise UserError(f"{sweep_dir} has no {RESULTS}; run `adaptive-spec sweep --config ...` first or pass the "
                        "sweep's out_dir to --sweep-dir")
    rows = read_jsonl(rpath)
    if not rows:
        raise UserError(f"{rpath} holds no results yet; let the sweep run (it resumes where it stopped)")
    need = ("dataset", "config", "method", "n_tokens", "n_target_forwards", "wall_s")
    bad = [k for k in need if k not in rows[0]]
    if bad:
        raise UserError(f"{rpath} is not a sweep results file (rows lack {', '.join(bad)})")

    def read(name):
        return read_json(sweep_dir / name, required=False, hint="rerun the sweep to rewrite it") or {}

    return rows, read("heads.json"), read("config.json")


def ds_label(name: str) -> str:
    return Path(name).stem if name.endswith((".json", ".jsonl")) else name.replace("/", "_")


def _pkey(r: dict):
    return (r.get("prompt_idx"), r.get("prompt_sha"))


def complete_rows(rows: list[dict]) -> tuple[list[dict], int]:
    """Rows of the prompts on which every configuration seen in `rows` ran (or all rows when no
    prompt is complete); and the number of prompts left out."""
    configs = {r["config"] for r in rows}
    by_prompt = defaultdict(set)
    for r in rows:
        by_prompt[_pkey(r)].add(r["config"])
    full = {p for p, cs in by_prompt.items() if cs == configs}
    if not full:
        return rows, 0
    return [r for r in rows if _pkey(r) in full], len(by_prompt) - len(full)


# ----------------------------------------------------------------------------- aggregation

def _f(r, k) -> float:
    v = r.get(k)
    return float(v) if v is not None else 0.0


def _decode_s(r) -> float:
    return max(_f(r, "wall_s") - _f(r, "prefill_s"), 1e-12)


@dataclass
class Agg:
    """One configuration on one dataset, aggregated over prompts."""

    config: str
    method: str
    k: int | None
    head: str | None
    h: float | None
    tau: float | None
    n_prompts: int
    n_tokens: float
    n_draft: float
    n_target: float
    n_discarded: float
    wall_s: float
    decode_s: float
    verification_rate: float
    discard_rate: float
    acceptance_rate: float
    tokens_per_s: float
    speedup: float  # geometric mean over prompts of tok/s / AR tok/s on the same prompt (nan without AR)
    derived: bool  # counts derived (hf_assisted)
    # per target pass (= per round): tokens, accepted and drafted tokens; a tree's depth and the
    # accepted tokens its policy predicted (sum of R), where the rows have them
    tokens_per_pass: float = float("nan")
    accepted_per_pass: float = float("nan")
    drafted_per_round: float = float("nan")
    tree_depth: float = float("nan")
    predicted_per_round: float = float("nan")
    params: dict = field(default_factory=dict)  # a tree configuration's keys (drafting, estimator, budget, ...)

    def label(self) -> str:
        if self.method == "fixed":
            return f"K={self.k}"
        if self.method == "learned":
            return f"{self.head}, h={self.h:g}"
        return self.config


def geomean(values) -> float:
    v = [x for x in values if x and x > 0 and not math.isnan(x)]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


def _tps(r) -> float:
    return _f(r, "n_tokens") / max(_f(r, "wall_s"), 1e-12)


def aggregate(rows: list[dict], how: str = "pooled", ar_by_prompt: dict | None = None) -> Agg:
    r0 = rows[0]
    S = lambda k: sum(_f(r, k) for r in rows)  # noqa: E731
    N, NT, ND, NX = S("n_tokens"), S("n_target_forwards"), S("n_draft_forwards"), S("n_discarded")
    wall, dec = S("wall_s"), sum(_decode_s(r) for r in rows)
    acc, drafted = S("n_accepted"), S("n_drafted")
    if how == "mean":
        mean = lambda f: sum(f(r) for r in rows) / len(rows)  # noqa: E731
        vr = mean(lambda r: _f(r, "n_target_forwards") / max(_f(r, "n_tokens"), 1))
        dr = mean(lambda r: _f(r, "n_discarded") / max(_f(r, "n_tokens"), 1))
        tps = mean(_tps)
        ar_ = [_f(r, "n_accepted") / _f(r, "n_drafted") for r in rows if _f(r, "n_drafted")]
        accr = sum(ar_) / len(ar_) if ar_ else float("nan")
    else:
        vr, dr, tps = NT / max(N, 1), NX / max(N, 1), N / max(wall, 1e-12)
        accr = acc / drafted if drafted else float("nan")
    sp = float("nan")
    if ar_by_prompt:
        sp = geomean(_tps(r) / _tps(ar_by_prompt[_pkey(r)]) for r in rows if _pkey(r) in ar_by_prompt)
    a = Agg(r0["config"], r0["method"], r0.get("k"), r0.get("head"), r0.get("h"), r0.get("tau"), len(rows), N, ND,
            NT, NX, wall, dec, vr, dr, accr, tps, sp, bool(r0.get("counts_derived")))
    passes = lambda r: _f(r, "n_target_forwards")  # noqa: E731  (one target pass per round)
    a.tokens_per_pass, a.accepted_per_pass, a.drafted_per_round = (
        _ratio(rows, how, lambda r, k=k: _f(r, k), passes) for k in ("n_tokens", "n_accepted", "n_drafted"))
    for attr, key in (("tree_depth", "tree_depth"), ("predicted_per_round", "predicted_accepted")):
        have = [r for r in rows if r.get(key) is not None]  # per-round means: weighed by rounds when pooled
        setattr(a, attr, _ratio(have, how, lambda r: _f(r, key) * _f(r, "rounds"), lambda r: _f(r, "rounds")))
    if r0["method"] in TREE_POLICIES:
        a.params = {k: r0.get(k) for k in ("drafting", "estimator", "budget", "max_budget", "num_drafts")}
    return a


def _ratio(rows: list[dict], how: str, num, den) -> float:
    """sum num / sum den over the rows (pooled), or the mean over rows of num / den (mean)."""
    if how == "mean":
        v = [num(r) / den(r) for r in rows if den(r)]
        return sum(v) / len(v) if v else float("nan")
    d = sum(den(r) for r in rows)
    return sum(num(r) for r in rows) / d if d else float("nan")


def by_config(rows: list[dict]) -> dict[str, list[dict]]:
    out = defaultdict(list)
    for r in rows:
        out[r["config"]].append(r)
    return dict(out)


# ----------------------------------------------------------------------------- fits

def fit_settings(rows: list[dict]) -> dict:
    """Forward-time fits of one dataset: {"standalone": {...}, "specdec": ForwardFit, "specdecpp": ...,
    "speculative": ForwardFit (SpecDec + SpecDec++ pooled, used for Eq. 5.1)}."""
    m = lambda *ms: [r for r in rows if r["method"] in ms]  # noqa: E731
    tri = lambda rs: [(_f(r, "n_draft_forwards"), _f(r, "n_target_forwards"), _decode_s(r)) for r in rs]  # noqa: E731
    ar, dar = m("ar"), m("draft_ar")
    t_t, r2_t, n_t = timemodel.fit_standalone([_f(r, "n_target_forwards") for r in ar], [_decode_s(r) for r in ar])
    t_d, r2_d, n_d = timemodel.fit_standalone([_f(r, "n_draft_forwards") for r in dar], [_decode_s(r) for r in dar])
    return {
        "standalone": {"t_draft": t_d, "t_target": t_t, "r2_draft": r2_d, "r2_target": r2_t, "n_draft": n_d,
                       "n_target": n_t},
        "specdec": timemodel.fit_forward_times(tri(m("fixed"))),
        "specdecpp": timemodel.fit_forward_times(tri(m("learned"))),
        "speculative": timemodel.fit_forward_times(tri(m(*SPEC_METHODS))),
    }


def _usable(fit) -> bool:
    return fit is not None and fit.t_draft is not None and fit.t_target is not None and fit.rank_ok


def modelled_tps(a: Agg, fit) -> float:
    if not _usable(fit):
        return float("nan")
    return timemodel.theoretical_tokens_per_s(a.n_tokens, a.n_draft, a.n_target, fit.t_draft, fit.t_target)


def rel_errors(rows: list[dict], t_draft: float, t_target: float) -> list[float]:
    """Per-prompt |Eq. 5.1 throughput - measured decode throughput| / measured."""
    out = []
    for r in rows:
        th = timemodel.theoretical_tokens_per_s(_f(r, "n_tokens"), _f(r, "n_draft_forwards"),
                                             _f(r, "n_target_forwards"), t_draft, t_target)
        out.append(timemodel.relative_error(th, _f(r, "n_tokens") / _decode_s(r)))
    return [e for e in out if not math.isnan(e)]


# ----------------------------------------------------------------------------- per-dataset analysis

@dataclass
class DatasetResult:
    name: str
    label: str
    aggs: dict  # config -> Agg
    rows: list  # the complete-prompt rows
    fits: dict
    n_prompts: int
    dropped_prompts: int

    def of(self, method: str) -> list[Agg]:
        return [a for a in self.aggs.values() if a.method == method]

    def best(self, method: str, key=lambda a: a.tokens_per_s) -> Agg | None:
        c = [a for a in self.of(method) if not math.isnan(key(a))]
        return max(c, key=key) if c else None

    def get(self, config: str) -> Agg | None:
        return self.aggs.get(config)


def analyse(rows: list[dict], how: str = "pooled") -> list[DatasetResult]:
    order = list(dict.fromkeys(r["dataset"] for r in rows))
    results = []
    for ds in order:
        drows, dropped = complete_rows([r for r in rows if r["dataset"] == ds])
        groups = by_config(drows)
        ar = {_pkey(r): r for r in groups.get("ar", [])}
        aggs = {c: aggregate(rs, how, ar or None) for c, rs in groups.items()}
        results.append(DatasetResult(ds, ds_label(ds), aggs, drows, fit_settings(drows),
                                     len({_pkey(r) for r in drows}), dropped))
    return results


def paired_ratio(d: DatasetResult, a: Agg | None, b: Agg | None) -> float:
    """Geometric mean over prompts of tok/s(a) / tok/s(b) on the same prompt."""
    if a is None or b is None:
        return float("nan")
    ra = {_pkey(r): r for r in d.rows if r["config"] == a.config}
    rb = {_pkey(r): r for r in d.rows if r["config"] == b.config}
    return geomean(_tps(ra[p]) / _tps(rb[p]) for p in ra if p in rb)


# ----------------------------------------------------------------------------- formatting

def pct(x) -> str:
    return "—" if x is None or math.isnan(x) else f"{100 * x:+.1f}%"


def fmt_t(x) -> str:
    return fmt(x, ".4g")


# ----------------------------------------------------------------------------- plots

def _pyplot():
    import matplotlib  # heavy, and the [eval] extra: only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # as above; after use("Agg"), so no display is needed

    return plt


def _finish(plt, fig, ax, d, how: str, path: Path, **legend):
    """A dataset plot's title (prompts, aggregation), grid and legend; saved to `path` and closed."""
    ax.set_title(f"{d.label}: {d.n_prompts} prompts ({'ratio of sums' if how == 'pooled' else 'mean over prompts'})")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", **legend)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pareto_plot(d: DatasetResult, path: Path, heads_order: list[str], agg_how: str):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    fixed = sorted(d.of("fixed"), key=lambda a: a.k)
    if fixed:
        ax.plot([a.discard_rate for a in fixed], [a.verification_rate for a in fixed], "-o", color="black",
                ms=4, label="SpecDec (fixed K)")
        for a in fixed:
            ax.annotate(f"K={a.k}", (a.discard_rate, a.verification_rate), textcoords="offset points",
                        xytext=(4, 3), fontsize=7, color="dimgray")
    markers = "s^vD<>ph*"
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    learned = d.of("learned")
    heads = [h for h in heads_order if any(a.head == h for a in learned)]
    heads += sorted({a.head for a in learned} - set(heads))
    for j, head in enumerate(heads):
        pts = sorted((a for a in learned if a.head == head), key=lambda a: a.h)
        c = colors[j % len(colors)]
        ax.plot([a.discard_rate for a in pts], [a.verification_rate for a in pts], linestyle=":",
                marker=markers[j % len(markers)], color=c, ms=5, label=f"SpecDec++ {head}")
        for a in pts:
            ax.annotate(f"h={a.h:g}", (a.discard_rate, a.verification_rate), textcoords="offset points",
                        xytext=(4, -8), fontsize=7, color=c)
    other = [("confidence", "P", "tab:olive"), ("entropy", "X", "tab:cyan"), ("heuristic", "d", "tab:brown"),
             ("oracle", "*", "gold"), ("hf_assisted", "x", "tab:red")]
    for method, mk, c in other:
        pts = d.of(method)
        if not pts:
            continue
        name = {"hf_assisted": "transformers assisted (derived counts)", "heuristic": "heuristic +2/-1"}.get(method, method)
        ax.scatter([a.discard_rate for a in pts], [a.verification_rate for a in pts], marker=mk, color=c,
                   s=70 if method == "oracle" else 40, label=name, zorder=3, edgecolors="black" if method == "oracle" else None)
        if method in ("confidence", "entropy"):
            for a in pts:
                ax.annotate(f"τ={a.tau:g}", (a.discard_rate, a.verification_rate), textcoords="offset points",
                            xytext=(4, 3), fontsize=7, color=c)
    ax.set_xlabel("discard rate  N_discarded / N")
    ax.set_ylabel("verification rate  N_target / N")
    _finish(plt, fig, ax, d, agg_how, path, fontsize=7)


# ----------------------------------------------------------------------------- tree and multi-draft families

FAMILY_OF = {"fixed": "fixed K", "learned": "SpecDec++", "ersd": "ERSD", "spectr": "SpecTr", "batch-sd": "batch SD",
             "confidence": "confidence", "entropy": "entropy", "heuristic": "heuristic +2/-1", "oracle": "oracle",
             "hf_assisted": "transformers assisted"}
POS_TREE, HEAD_TREE, LEARNED_TREE = "optimal tree, positional R", "optimal tree, head-estimated R", \
    "optimal tree, learned budget"
FAMILIES = ("fixed K", "SpecDec++", POS_TREE, HEAD_TREE, LEARNED_TREE, "tree, fixed shape", "ERSD", "SpecTr",
            "batch SD", "confidence", "entropy", "heuristic +2/-1", "oracle", "transformers assisted")


def family(a: Agg) -> str | None:
    """The family a configuration belongs to (None: the target or draft alone). `tree` (GSD) splits
    by shape: the optimal tree by how R is estimated or a learned budget, and the fixed shapes."""
    if a.method != "tree":
        return FAMILY_OF.get(a.method)
    if a.params.get("drafting", "tree") != "tree":
        return "tree, fixed shape"
    if a.params.get("budget") == "learned":
        return LEARNED_TREE
    return HEAD_TREE if a.params.get("estimator") == "head" else POS_TREE


def best_of(d: DatasetResult, fams) -> Agg | None:
    c = [a for a in d.aggs.values() if family(a) in fams and not math.isnan(a.tokens_per_s)]
    return max(c, key=lambda a: a.tokens_per_s) if c else None


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
    pairs = [("head-estimated vs positional optimal tree", (HEAD_TREE,), (POS_TREE,)),
             ("learned vs best fixed budget", (LEARNED_TREE,), (POS_TREE, HEAD_TREE)),
             ("best tree / multi-draft vs best SpecDec++", (POS_TREE, HEAD_TREE, LEARNED_TREE, "tree, fixed shape",
                                                           "ERSD", "SpecTr", "batch SD"), ("SpecDec++",)),
             ("best tree / multi-draft vs best fixed K", (POS_TREE, HEAD_TREE, LEARNED_TREE, "tree, fixed shape",
                                                         "ERSD", "SpecTr", "batch SD"), ("fixed K",))]
    rows = []
    for title, fa, fb in pairs:
        cells = []
        for d in results:
            a, b = best_of(d, fa), best_of(d, fb)
            cells.append(f"{pct(paired_ratio(d, a, b) - 1)} ({a.config} vs {b.config})" if a and b else "—")
        rows.append([title] + cells)
    return md_table(["tokens/s, paired per prompt"] + [d.label for d in results], rows)


def _bound_curve(calibration: dict, method: str, ks) -> list[tuple[int, float]]:
    rates, vocab = calibration.get(method), calibration.get("settings", {}).get("vocab_size")
    return [(k, tunstall_accepted(rates["cond_rates"], k, vocab)) for k in ks] if rates and vocab else []


def accepted_vs_drafted_plot(d: DatasetResult, path: Path, calibration: dict, how: str):
    """Accepted tokens per target pass vs drafted tokens per round, one colour per family; hollow
    markers: the trees' own predictions (sum of R); dotted: the Tunstall bound of the GSD rates."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.8, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "osDv^<>ph*Xd8P"
    for j, fam in enumerate(FAMILIES):
        pts = sorted((a for a in d.aggs.values() if family(a) == fam), key=lambda a: a.drafted_per_round)
        if not pts:
            continue
        c, mk = colors[j % len(colors)], markers[j % len(markers)]
        ax.plot([a.drafted_per_round for a in pts], [a.accepted_per_pass for a in pts], marker=mk, color=c, ms=5,
                label=fam, linestyle="-" if len(pts) > 1 else "none")
        pred = [a for a in pts if not math.isnan(a.predicted_per_round)]
        if pred:
            ax.scatter([a.drafted_per_round for a in pred], [a.predicted_per_round for a in pred], marker=mk,
                       facecolors="none", edgecolors=c, s=40, label=f"{fam} (predicted)")
    budgets = sorted({a.params["budget"] for a in d.aggs.values()
                      if isinstance(a.params.get("budget"), int) and a.method in VERIFICATION})
    curve = _bound_curve(calibration, "gsd", range(1, max(budgets) + 1)) if budgets else []
    if curve:
        ax.plot([k for k, _ in curve], [b for _, b in curve], ":", color="black", label="Tunstall bound (GSD rates)")
    ax.set_xlabel("drafted tokens per round")
    ax.set_ylabel("accepted tokens per target pass")
    _finish(plt, fig, ax, d, how, path, fontsize=6, ncol=2)


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
        bound = _bound_curve(calibration, VERIFICATION[a.method], [k])[0][1] if fixed else None
        rows.append([a.config, fmt(a.drafted_per_round), fmt(a.tree_depth), fmt(a.accepted_per_pass, ".3f"),
                     fmt(a.predicted_per_round, ".3f"), fmt(zeroth, ".3f"), fmt(bound, ".3f"), fmt(a.tokens_per_s)])
    return md_table(["config", "drafted / round", "depth", "accepted / pass (measured)", "predicted (policy, sum R)",
                     "predicted (0-th order, calibration)", "Tunstall bound", "tok/s"], rows)


def tree_sections(results: list[DatasetResult], calibration: dict, folder: Path, how: str) -> list[str]:
    """The family table, the accepted-vs-drafted plots and the ERSD Fig. 3 comparison; `calibration`:
    the sweep's tree_calibration.json ({} when missing)."""
    md = ["", "### Best configuration per family", "",
          "Every family's fastest configuration (tokens/s end to end; speed-up paired per prompt, geometric mean).",
          "", family_table(results), "", tree_comparisons(results), "",
          "## Accepted tokens per target pass vs drafted tokens per round", "",
          "Every family; hollow markers: what a tree policy predicted (its sum of R per round); dotted: the "
          "Tunstall bound (ERSD Lemma 4.2) of the calibrated GSD rates, at x = the budget.", ""]
    for d in results:
        png = folder / f"accepted_vs_drafted_{d.label}.png"
        accepted_vs_drafted_plot(d, png, calibration, how)
        md.append(f"![{d.label}]({png.name})")
    rates = "; ".join(f"{m}: c = {[round(c, 3) for c in calibration[m]['cond_rates'][:6]]}" for m in ("gsd", "ersd")
                      if m in calibration)
    md += ["", "## ERSD Fig. 3: predicted vs measured accepted tokens per pass", "",
           "Per-sibling acceptance rates measured once on " + (f"{len(calibration['settings']['prompts'])} calibration "
           f"prompts ({rates})" if calibration.get("settings") else "no calibration (tree_calibration.json missing)") +
           "; 0-th order = sum of R of the configuration's shape under those rates; Tunstall bound on accepted "
           "tokens per pass for its budget.", ""]
    for d in results:
        md += [f"### {d.label}", "", ersd_fig3_table(d, calibration), ""]
    return md


# ----------------------------------------------------------------------------- the report

def _head_order(heads_info: dict, results: list[DatasetResult]) -> list[str]:
    names = list(heads_info)
    for d in results:
        for a in d.of("learned"):
            if a.head not in names:
                names.append(a.head)
    return names


def table1(results: list[DatasetResult]) -> str:
    cols = [d.label for d in results]
    rows = {k: [] for k in ("ar", "k", "pp", "imp", "imp_p", "pp07", "gap", "gap_p", "mk", "mpp", "mimp")}
    for d in results:
        ar, bk, bp, o = d.get("ar"), d.best("fixed"), d.best("learned"), d.get("oracle")
        # the auto pick's yardstick: how much of the room between the best fixed K and the hindsight
        # oracle SpecDec++ takes, (S - S_K) / (S_O - S_K); pooled tokens/s and paired speed-ups
        for key, attr, unit in (("gap", "tokens_per_s", "{:.2f} tok/s"), ("gap_p", "speedup", "{:.3f}×")):
            s, k, top = [getattr(a, attr) for a in (bp, bk, o)] if bp and bk and o else [math.nan] * 3
            rows[key].append(f"{pct((s - k) / (top - k))} (oracle {unit.format(top)})" if top > k else "—")
        rows["ar"].append(f"{fmt(ar.tokens_per_s)} tok/s" if ar else "—")
        rows["k"].append(f"{fmt(bk.tokens_per_s)} (K={bk.k}; {fmt(bk.speedup)}×)" if bk else "—")
        rows["pp"].append(f"{fmt(bp.tokens_per_s)} ({bp.head}, h={bp.h:g}; {fmt(bp.speedup)}×)" if bp else "—")
        rows["imp"].append(pct(bp.tokens_per_s / bk.tokens_per_s - 1) if bp and bk else "—")
        rows["imp_p"].append(pct(paired_ratio(d, bp, bk) - 1) if bp and bk else "—")
        at = [a for a in d.of("learned") if a.h is not None and abs(a.h - H_REF) < 1e-9]
        a07 = max(at, key=lambda a: a.tokens_per_s) if at else None
        rows["pp07"].append(f"{fmt(a07.tokens_per_s)} ({a07.head}; {100 * a07.tokens_per_s / bp.tokens_per_s:.1f}% of best)"
                            if a07 and bp else "—")
        fit = d.fits["speculative"]
        mk = d.best("fixed", key=lambda a: modelled_tps(a, fit))
        mp = d.best("learned", key=lambda a: modelled_tps(a, fit))
        rows["mk"].append(f"{fmt(modelled_tps(mk, fit))} (K={mk.k})" if mk and _usable(fit) else "—")
        rows["mpp"].append(f"{fmt(modelled_tps(mp, fit))} ({mp.head}, h={mp.h:g})" if mp and _usable(fit) else "—")
        rows["mimp"].append(pct(modelled_tps(mp, fit) / modelled_tps(mk, fit) - 1) if mk and mp and _usable(fit) else "—")
    names = {"ar": "autoregressive (target alone)", "k": "SpecDec, best fixed K (speed-up)",
             "pp": "SpecDec++, best head and h (speed-up)", "imp": "relative improvement, SpecDec++ vs best K",
             "imp_p": "same, paired per prompt (geometric mean)", "pp07": f"SpecDec++ at h = {H_REF:g} (best head)",
             "gap": "share of the oracle gap taken by SpecDec++, (S − S_K)/(S_oracle − S_K), tokens/s",
             "gap_p": "same, on speed-ups paired per prompt",
             "mk": "Eq. 5.1 with fitted t: best fixed K", "mpp": "Eq. 5.1 with fitted t: best SpecDec++",
             "mimp": "Eq. 5.1: relative improvement"}
    if not any(d.get("oracle") for d in results):
        del rows["gap"], rows["gap_p"]
    return md_table(["tokens/s"] + cols, [[names[k]] + v for k, v in rows.items()])


def table2(results: list[DatasetResult]) -> tuple[str, str]:
    body = []
    per_setting = defaultdict(list)
    for setting, title in (("standalone", "stand-alone"), ("specdec", "SpecDec"), ("specdecpp", "SpecDec++"),
                           ("speculative", "SpecDec + SpecDec++")):
        for d in results:
            f = d.fits[setting]
            if setting == "standalone":
                if f["n_draft"] == 0 and f["n_target"] == 0:
                    continue
                row = [title, d.label, fmt_t(f["t_draft"]), fmt_t(f["t_target"]),
                       f"{fmt(f['r2_draft'], '.4f')} & {fmt(f['r2_target'], '.4f')}", f"{f['n_draft']} & {f['n_target']}"]
                per_setting[setting].append((f["t_draft"], f["t_target"]))
            else:
                if f.n_rows == 0:
                    continue
                note = "" if f.rank_ok else " (collinear: one K only?)"
                row = [title, d.label, fmt_t(f.t_draft), fmt_t(f.t_target), fmt(f.r2, ".4f") + note, str(f.n_rows)]
                per_setting[setting].append((f.t_draft, f.t_target))
            body.append(row)
        vals = per_setting.get(setting)
        if vals and len(results) > 1:
            md, sd = timemodel.mean_std(v[0] for v in vals)
            mt, st = timemodel.mean_std(v[1] for v in vals)
            body.append([title, "**average**", f"{fmt_t(md)} ± {fmt_t(sd)}", f"{fmt_t(mt)} ± {fmt_t(st)}", "", ""])
    t2 = md_table(["setting", "dataset", "t_draft (s)", "t_target (s)", "R²", "runs"], body)

    err_rows = []
    for d in results:
        sa, sp = d.fits["standalone"], d.fits["speculative"]
        checks = []
        if sa["t_target"] is not None:
            checks.append(("autoregressive (stand-alone fit)", [r for r in d.rows if r["method"] == "ar"],
                           0.0, sa["t_target"]))
        if _usable(sp):
            for method, title in (("fixed", "SpecDec"), ("learned", "SpecDec++"),
                                  ("heuristics", "heuristics (conf./entropy/+2-1)"), ("oracle", "oracle")):
                ms = HEURISTICS if method == "heuristics" else (method,)
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
        if not _usable(fit):
            continue
        bk, bp = d.best("fixed"), d.best("learned")
        cands = [("best fixed K", bk), ("best SpecDec++", bp)]
        for method in HEURISTICS + ("oracle",):
            b = d.best(method)
            if b is not None:
                cands.append((method if method != "heuristic" else "heuristic +2/-1", b))
        rows, decs = [], {}
        for title, a in cands:
            if a is None:
                continue
            dec = timemodel.decompose(a.n_tokens, a.n_discarded, a.n_target, fit.t_draft, fit.t_target)
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
            c = timemodel.compare_decompositions(decs["best SpecDec++"], decs["best fixed K"])
            verdict = (f"SpecDec++ loses most on the **{c['loses']}** term" if c["loses"]
                       else "SpecDec++ is no worse on either term")
            txt.append(f"\nSpecDec++ vs best fixed K (ms/token): discard {1e3 * c['discard']:+.3f}, verification "
                       f"{1e3 * c['verification']:+.3f}, total {1e3 * c['total']:+.3f}; {verdict}.")
        parts.append("\n".join(txt))
    return "\n\n".join(parts) if parts else "_needs fitted speculative forward times_"


def table3(results: list[DatasetResult], heads_info: dict) -> str:
    names = _head_order(heads_info, results)
    if not names:
        return "_no SpecDec++ heads in this sweep_"
    best = {}  # (head, dataset) -> Agg
    for d in results:
        for h in names:
            c = [a for a in d.of("learned") if a.head == h]
            if c:
                best[(h, d.label)] = max(c, key=lambda a: a.tokens_per_s)
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
            cells.append(f"{s} (h={a.h:g})")
        rows.append(cells)
    return md_table(["head", "depth D", "w_rej", "train KL", "dev KL"] + [d.label for d in results], rows)


def peer_table(results: list[DatasetResult]) -> str:
    rows = []
    for d in results:
        hf = d.get("hf_assisted")
        if hf is None:
            continue
        ar, bk, bp = d.get("ar"), d.best("fixed"), d.best("learned")
        rows.append([d.label, fmt(ar.tokens_per_s) if ar else "—", fmt(hf.tokens_per_s),
                     f"{fmt(bk.tokens_per_s)} (K={bk.k})" if bk else "—",
                     f"{fmt(bp.tokens_per_s)} ({bp.head}, h={bp.h:g})" if bp else "—",
                     f"{fmt(bk.tokens_per_s / hf.tokens_per_s, '.3f')}× ({fmt(paired_ratio(d, bk, hf), '.3f')}×)" if bk else "—",
                     f"{fmt(bp.tokens_per_s / hf.tokens_per_s, '.3f')}× ({fmt(paired_ratio(d, bp, hf), '.3f')}×)" if bp else "—",
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
            # an h picked with a cap on K (the table time model) reads "h@cap"
            picks = sorted({_pick_label(r, a.method) for r in mine if r.get("auto_value") is not None})
            predicted = [r["auto_predicted_tokens_per_s"] for r in mine if r.get("auto_predicted_tokens_per_s")]
            swept = [b for b in d.of(AUTO_OF[a.method]) if a.method == "fixed_auto" or b.head == a.head]
            best = max(swept, key=lambda b: b.tokens_per_s) if swept else None
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
    aggs = sorted(d.aggs.values(), key=lambda a: (order.get(a.method, 9), a.k or 0, a.head or "", a.h or 0, a.tau or 0))
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


def build_report(sweep_dir: Path, out: Path | None = None, how: str = "pooled", beside: list[Path] = ()) -> Path:
    """The report of one sweep; `beside`: sweeps of the same prompts on other engines, tabled with it."""
    sweep_dir = Path(sweep_dir)
    if how not in ("pooled", "mean"):
        raise UserError(f"--aggregate must be pooled or mean, got {how!r}")
    rows, heads_info, cfg_info = load_sweep(sweep_dir)
    out = Path(out) if out else sweep_dir / "report.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    results = analyse(rows, how)
    md = _intro(sweep_dir.name, cfg_info, how, results, cpu_lines(rows))
    if beside:
        sweeps = [(_backend(cfg_info), results)]
        for other in beside:
            o_rows, _, o_cfg = load_sweep(Path(other))
            sweeps.append((_backend(o_cfg), analyse(o_rows, how)))
        md += engines_section(sweeps)
    md += _figure3(results, out.parent, _head_order(heads_info, results), how)
    trees = []
    if any(r["method"] in TREE_POLICIES for r in rows):
        calibration = read_json(sweep_dir / "tree_calibration.json", required=False, hint="rerun the sweep") or {}
        trees = tree_sections(results, calibration, out.parent, how)
    md += _tables(results, heads_info, trees)
    out.write_text("\n".join(md) + "\n")
    return out


def _backend(cfg_info: dict) -> str:
    return stored_pair(cfg_info.get("config") or {}).get("backend", "torch")


def _intro(name: str, cfg_info: dict, how: str, results: list[DatasetResult], cpu: list[str]) -> list[str]:
    """Title, the CPU (cpu_lines), the sweep's settings, how prompts are aggregated, notes, and
    what each dataset holds."""
    cfg = cfg_info.get("config", {})
    pair = stored_pair(cfg)
    md = [f"# SpecDec++ sweep report: {name}", "", *cpu]
    if cfg:
        md.append(f"Target `{pair.get('target')}`, draft `{pair.get('draft')}`, {pair.get('dtype')}, device "
                  f"{cfg_info.get('device', '?')} ({cfg_info.get('threads', '?')} threads); temperature "
                  f"{cfg.get('temperature')}, top-k {cfg.get('top_k')}, top-p {cfg.get('top_p')}, "
                  f"{cfg.get('max_new_tokens')} new tokens, chat template {'on' if cfg.get('chat') else 'off'}, "
                  f"seed {cfg.get('seed')}.")
    md.append("Aggregation over prompts: " + ("**ratio of sums** (sum over prompts of the numerator / of the "
              "denominator; every token weighs the same)" if how == "pooled" else "**mean of per-prompt values**")
              + ". Speed-ups are paired per prompt (geometric mean). tokens/s are end to end (wall time); "
              "the forward-time fits use decode time (wall − prefill).")
    md += [f"\n> note: {note}" for note in cfg_info.get("notes", [])]
    md.append("")
    for d in results:
        extra = f"; {d.dropped_prompts} incomplete prompt(s) left out" if d.dropped_prompts else ""
        md.append(f"- {d.label}: {d.n_prompts} prompts, {len(d.aggs)} configurations{extra}")
    return md


def _figure3(results: list[DatasetResult], folder: Path, heads_order: list[str], how: str) -> list[str]:
    """One Pareto plot per dataset, written beside the report."""
    md = ["", "## Figure 3: verification rate vs discard rate", ""]
    for d in results:
        png = folder / f"pareto_{d.label}.png"
        pareto_plot(d, png, heads_order, how)
        md.append(f"![{d.label}]({png.name})")
    return md


def _tables(results: list[DatasetResult], heads_info: dict, trees: list[str]) -> list[str]:
    """Tables 1-3 (`trees`, the tree sections, after Table 1), Eq. 3.2, the peer comparison and
    every configuration."""
    t2, terr = table2(results)
    md = ["", "## Table 1: throughput (tokens/s)", "", table1(results)] + trees + ["",
          "## Table 2: forward times (Eq. 3.1 least squares, no intercept)", "",
          "Stand-alone: target alone T = t_target·N_target (ar) and draft alone T = t_draft·N_draft (draft_ar); "
          "R² and runs given as draft & target. Speculative: T = t_draft·N_draft + t_target·N_target.", "", t2, "",
          "### Eq. 5.1 throughput vs measured decode throughput (per run)", "", terr, "",
          "### Time models: Eq. 3.1 against the extended model (t_cand per candidate)", "",
          "Decode time T = wall − prefill. Both models fitted on all rows (stand-alone rows identify t_draft "
          "apart from t_cand) and scored on the speculative rows; `python eval/fit_time_model.py SWEEP_DIR "
          "--costs FILE` adds the costs measured at load.", "",
          comparison_table([r for d in results for r in d.rows]), "",
          "## Eq. 3.2: where the time goes (ms per token)", "",
          "T/N = t_draft (oracle) + t_draft·N_discarded/N + (t_target − t_draft)·N_target/N, with the "
          "speculative fit's times.", "", decomposition(results), "",
          "## Table 3: acceptance heads", "",
          "Best tokens/s over h per dataset (bold: within 99% of the best head on that dataset); KL = binary KL "
          "between true and predicted acceptance probability, from the head's training metrics.", "",
          table3(results, heads_info), "",
          "## auto: the h and K picked for this machine", "",
          "Picked once per machine from the curve `adaptive-spec autotune` saved and the t_draft, t_target, t_cand "
          "measured once per sweep (pinned in costs.json; picked lists every value where rows were picked from "
          "different measurements); predicted tokens/s is decoding only (no prefill), measured tokens/s is wall-clock. "
          "Goal: within 3% of the best swept value, never below the best fixed K.", "",
          auto_table(results), "",
          "## Peer: transformers assisted generation", "",
          "Wall-clock tokens/s of `target.generate(..., assistant_model=draft)` with transformers' default "
          "candidate schedule, run back to back with ours on the same prompts; ratios pooled (paired per-prompt "
          "geometric mean in parentheses).", "", peer_table(results), "",
          "## All configurations", ""]
    for d in results:
        md += [f"### {d.label}", "", all_configs_table(d), ""]
    tables = [(d.label, breakdown_table(d)) for d in results]
    if any(t for _, t in tables):
        md += ["## Where the time goes", "",
               "Per generated token: prefill (both models), the draft's and the target's decode forwards, drafting "
               "outside the draft forward (sampling q, the stop rule, an n-gram lookup), verification outside the "
               "target pass (processing p, rejection sampling, the round's one host read), cache rollback, and the "
               "rest (the round loop, Python); the last column is the time outside both models' forwards as a share "
               "of decode time.", ""]
        for label, t in tables:
            if t:
                md += [f"### {label}", "", t, ""]
    return md


def _main(argv) -> int:
    parser = argparse.ArgumentParser(prog="adaptive-spec report", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep-dir", required=True, help="a sweep's out_dir (holds results.jsonl)")
    parser.add_argument("--out", default=None, help="markdown file to write (default <sweep-dir>/report.md)")
    parser.add_argument("--aggregate", default="pooled", choices=("pooled", "mean"),
                        help="pooled: ratio of sums over prompts (default); mean: mean of per-prompt values")
    parser.add_argument("--beside", action="append", default=[], metavar="SWEEP_DIR",
                        help="a sweep of the same prompts on another engine, tabled beside this one (repeatable)")
    args = parser.parse_args(argv)
    out = build_report(Path(args.sweep_dir), Path(args.out) if args.out else None, args.aggregate,
                       [Path(b) for b in args.beside])
    print(f"report written to {out}")
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, "no report was written; run the same command again")


if __name__ == "__main__":
    sys.exit(main())
