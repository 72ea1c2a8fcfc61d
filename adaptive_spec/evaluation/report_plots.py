"""The report's plots (matplotlib, the [eval] extra): Figure 3's Pareto plot and the accepted vs
drafted tokens plot of the tree and multi-draft families, one PNG per dataset."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .report_data import FAMILIES, SPECDECPP, DatasetResult, bound_curve, family
from .tree_calibration import TREE_POLICIES, VERIFICATION


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


@dataclass
class Series:
    """One legend entry of a plot: its points, each (config, x, y, note: the text beside it, "" for none),
    and how it is drawn (kind "line" joins the points, "points" does not; the rest are matplotlib keywords)."""

    label: str
    points: list
    style: dict
    note_style: dict = field(default_factory=lambda: {"xytext": (4, 3), "color": "dimgray"})


def _point(a, note: str = "") -> tuple:
    return (a.config, a.discard_rate, a.verification_rate, note)


# the chain heuristics, the oracle and the peer: (method, marker, colour)
OTHERS = (("confidence", "P", "tab:olive"), ("entropy", "X", "tab:cyan"), ("heuristic", "d", "tab:brown"),
          ("oracle", "*", "gold"), ("hf_assisted", "x", "tab:red"))
OTHER_NAMES = {"hf_assisted": "transformers assisted (derived counts)", "heuristic": "heuristic +2/-1"}
MARKERS = "s^vD<>ph*"
# the other policies' colours: none of the heads' (C0, C1, ...) or the heuristics'
REST_COLORS = ("tab:purple", "tab:pink", "teal", "navy", "maroon", "darkorange", "olive", "slategray")


def pareto_series(d: DatasetResult, heads_order: list[str]) -> list[Series]:
    """Figure 3's series: every configuration of the dataset but the draft alone (it verifies nothing) is a
    point of one of them: the target alone, fixed K as a curve and K = auto, one curve per head over h with its
    h = auto point (labelled with the h auto picked), the heuristics, the oracle, transformers assisted, the
    tree families, and each other policy (prompt lookup, combined, ...) under its own label."""
    # a ring, not a dot: an auto pick of the target alone lands on it and stays visible inside
    out = [Series("target alone", [_point(a) for a in d.of("ar")],
                  {"kind": "points", "marker": "o", "s": 160, "facecolors": "none", "edgecolors": "gray",
                   "linewidths": 1.5})]
    fixed = sorted(d.of("fixed"), key=lambda a: a.k)
    out.append(Series("SpecDec (fixed K)", [_point(a, f"K={a.k}") for a in fixed],
                      {"kind": "line", "linestyle": "-", "marker": "o", "color": "black", "ms": 4}))
    # auto's notes below the point: it often sits on the swept value it picked, whose note is above
    out.append(Series("SpecDec, K = auto", [_point(a, a.value_label()) for a in d.of("fixed_auto")],
                      {"kind": "points", "marker": "o", "facecolors": "none", "edgecolors": "black", "s": 60},
                      {"xytext": (5, -11), "color": "black"}))
    learned = d.of(SPECDECPP)
    heads = [h for h in heads_order if any(a.head == h for a in learned)]
    heads += sorted({a.head for a in learned} - set(heads))
    for j, head in enumerate(heads):
        c, mk = f"C{j % 10}", MARKERS[j % len(MARKERS)]
        pts = sorted((a for a in learned if a.head == head and a.method == "learned"), key=lambda a: a.h)
        out.append(Series(f"SpecDec++ {head}", [_point(a, f"h={a.h:g}") for a in pts],
                          {"kind": "line", "linestyle": ":", "marker": mk, "color": c, "ms": 5},
                          {"xytext": (4, -8), "color": c}))
        auto = [a for a in learned if a.head == head and a.method == "learned_auto"]
        out.append(Series(f"SpecDec++ {head}, h = auto", [_point(a, a.value_label()) for a in auto],
                          {"kind": "points", "marker": "H", "color": c, "s": 90, "edgecolors": "black"},
                          {"xytext": (-6, -12), "ha": "right", "color": c}))
    for method, mk, c in OTHERS:
        tau = method in ("confidence", "entropy")
        out.append(Series(OTHER_NAMES.get(method, method), [_point(a, f"τ={a.tau:g}" if tau else "")
                                                             for a in d.of(method)],
                          {"kind": "points", "marker": mk, "color": c, "s": 70 if method == "oracle" else 40,
                           "edgecolors": "black" if method == "oracle" else None}, {"xytext": (4, 3), "color": c}))
    return [s for s in out if s.points] + _rest(d, {p[0] for s in out for p in s.points})


def _rest(d: DatasetResult, shown: set) -> list[Series]:
    """The configurations no series above holds: the tree and multi-draft families (one series each: their
    configurations are many, and their own plot names them), and every other policy under its label."""
    groups = {}
    for a in d.aggs.values():
        if a.config not in shown and a.method != "draft_ar":
            key = family(a) if a.method in TREE_POLICIES else a.config
            groups.setdefault(key, []).append(a)
    out = []
    for i, (name, aggs) in enumerate(groups.items()):
        out.append(Series(name, [_point(a) for a in sorted(aggs, key=lambda a: a.discard_rate)],
                          {"kind": "points", "marker": "p8<>^vDsh"[i % 9], "color": REST_COLORS[i % len(REST_COLORS)],
                           "s": 45, "edgecolors": "black"}))
    return out


def pareto_plot(d: DatasetResult, path: Path, heads_order: list[str], agg_how: str):
    """Figure 3: verification rate vs discard rate, one point per configuration (pareto_series)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for s in pareto_series(d, heads_order):
        style = dict(s.style)
        xs, ys = [p[1] for p in s.points], [p[2] for p in s.points]
        if style.pop("kind") == "line":
            ax.plot(xs, ys, label=s.label, **style)
        else:
            ax.scatter(xs, ys, label=s.label, zorder=3, **style)
        for _, x, y, note in s.points:
            if note:
                ax.annotate(note, (x, y), textcoords="offset points", fontsize=7, **s.note_style)
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
