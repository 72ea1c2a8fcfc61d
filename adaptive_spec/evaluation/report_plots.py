"""The report's plots (matplotlib, the [eval] extra): Figure 3's Pareto plot and the accepted vs
drafted tokens plot of the tree and multi-draft families, one PNG per dataset."""
from __future__ import annotations

import math
from pathlib import Path

from .report_data import FAMILIES, DatasetResult, bound_curve, family
from .tree_calibration import VERIFICATION


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
    """Figure 3: verification rate vs discard rate, fixed K as a curve, one curve per head over h,
    the heuristics, the oracle and transformers assisted as points."""
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
    curve = bound_curve(calibration, "gsd", range(1, max(budgets) + 1)) if budgets else []
    if curve:
        ax.plot([k for k, _ in curve], [b for _, b in curve], ":", color="black", label="Tunstall bound (GSD rates)")
    ax.set_xlabel("drafted tokens per round")
    ax.set_ylabel("accepted tokens per target pass")
    _finish(plt, fig, ax, d, how, path, fontsize=6, ncol=2)
