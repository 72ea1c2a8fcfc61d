"""A sweep's rows aggregated for the report: every number the report shows comes from here (pooled: ratios of
sums, every token weighing the same; mean: of per-prompt values); report_tables.py and report_plots.py only
lay them out."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..decoding.auto import decode_s, fit_forward_times, fit_standalone, relative_error, theoretical_tokens_per_s
from ..errors import UserError
from ..runs import read_json, read_jsonl
from .sweep_files import RESULTS
from .tree_calibration import TREE_POLICIES, tunstall_accepted

SPEC_METHODS = ("fixed", "learned")  # the settings of Table 2's speculative fit (the paper's SpecDec, SpecDec++)
# SpecDec++ as a user runs it: a swept h, or the h `--threshold auto` picked for the machine
SPECDECPP = ("learned", "learned_auto")
HEURISTICS = ("confidence", "entropy", "heuristic")


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


def _f(r, k) -> float:
    v = r.get(k)
    return float(v) if v is not None else 0.0


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
    picks: tuple = ()  # an auto configuration's picks over its rows ("ar": the target alone), as auto_value holds them

    @property
    def speculated(self) -> bool:
        """Drafted something: neither model alone, nor an auto pick of the target alone."""
        return self.method not in ("ar", "draft_ar") and self.drafted_per_round > 0

    @property
    def chose_target_alone(self) -> bool:
        """An auto configuration that picked no drafting on every row: the target alone by another name."""
        return self.picks == ("ar",)

    def value_label(self) -> str:
        """The swept value, "h=0.7" or "K=3"; an auto configuration's pick, "h=0.3 (auto)" (several picks,
        from rows measured apart, joined), or "h=auto: the target alone" where it picked no drafting."""
        name = "K" if self.method in ("fixed", "fixed_auto") else "h"
        if self.method in ("fixed", "learned"):
            return f"{name}={self.k if name == 'K' else format(self.h, 'g')}"
        if self.chose_target_alone:
            return f"{name}=auto: the target alone"
        shown = "/".join("the target alone" if v == "ar" else f"{v:g}" for v in self.picks)
        return f"{name}={shown} (auto)" if shown else f"{name}=auto"

    def label(self) -> str:
        """Short: "K=3", "HEAD, h=0.3", with "(auto)" where auto picked it; else the config key."""
        if self.method in ("fixed", "fixed_auto"):
            return self.value_label()
        return f"{self.head}, {self.value_label()}" if self.method in SPECDECPP else self.config

    def name(self) -> str:
        """In words: "SpecDec++ HEAD h=0.3 (auto)", "fixed K=3"; a `policies` entry by its label."""
        if self.method == "ar":
            return "the target alone"
        value = f"{'K' if self.method == 'fixed_auto' else 'h'}=auto" if self.chose_target_alone else self.value_label()
        if self.method in SPECDECPP:
            return " ".join(str(v) for v in ("SpecDec++", self.head, value) if v)
        return f"fixed {value}" if self.method in ("fixed", "fixed_auto") else self.config


def geomean(values) -> float:
    v = [x for x in values if x and x > 0 and not math.isnan(x)]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


def _tps(r) -> float:
    return _f(r, "n_tokens") / max(_f(r, "wall_s"), 1e-12)


def aggregate(rows: list[dict], how: str = "pooled", ar_by_prompt: dict | None = None) -> Agg:
    r0 = rows[0]
    S = lambda k: sum(_f(r, k) for r in rows)  # noqa: E731
    N, NT, ND, NX = S("n_tokens"), S("n_target_forwards"), S("n_draft_forwards"), S("n_discarded")
    wall, dec = S("wall_s"), sum(decode_s(r) for r in rows)
    col = lambda k: lambda r: _f(r, k)  # noqa: E731
    tokens = lambda r: max(_f(r, "n_tokens"), 1)  # noqa: E731
    vr, dr = (_ratio(rows, how, col(k), tokens) for k in ("n_target_forwards", "n_discarded"))
    tps = _ratio(rows, how, col("n_tokens"), lambda r: max(_f(r, "wall_s"), 1e-12))
    accr = _ratio(rows, how, col("n_accepted"), col("n_drafted"))
    sp = float("nan")
    if ar_by_prompt:
        sp = geomean(_tps(r) / _tps(ar_by_prompt[_pkey(r)]) for r in rows if _pkey(r) in ar_by_prompt)
    a = Agg(r0["config"], r0["method"], r0.get("k"), r0.get("head"), r0.get("h"), r0.get("tau"), len(rows), N, ND,
            NT, NX, wall, dec, vr, dr, accr, tps, sp, bool(r0.get("counts_derived")))
    a.tokens_per_pass, a.accepted_per_pass, a.drafted_per_round = (  # one target pass per round
        _ratio(rows, how, col(k), col("n_target_forwards")) for k in ("n_tokens", "n_accepted", "n_drafted"))
    for attr, key in (("tree_depth", "tree_depth"), ("predicted_per_round", "predicted_accepted")):
        have = [r for r in rows if r.get(key) is not None]  # per-round means: weighed by rounds when pooled
        setattr(a, attr, _ratio(have, how, lambda r: _f(r, key) * _f(r, "rounds"), lambda r: _f(r, "rounds")))
    if r0["method"] in TREE_POLICIES:
        a.params = {k: r0.get(k) for k in ("drafting", "estimator", "budget", "max_budget", "num_drafts")}
    picks = {r["auto_value"] for r in rows if r.get("auto_value") is not None}
    a.picks = tuple(sorted(picks, key=lambda v: (isinstance(v, str), v)))  # values, then "ar"
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


def fit_settings(rows: list[dict]) -> dict:
    """Forward-time fits of one dataset: {"standalone": {...}, "specdec": ForwardFit, "specdecpp": ...,
    "speculative": ForwardFit (SpecDec + SpecDec++ pooled, used for Eq. 5.1)}."""
    m = lambda *ms: [r for r in rows if r["method"] in ms]  # noqa: E731
    tri = lambda rs: [(_f(r, "n_draft_forwards"), _f(r, "n_target_forwards"), decode_s(r)) for r in rs]  # noqa: E731
    ar, dar = m("ar"), m("draft_ar")
    t_t, r2_t, n_t = fit_standalone([_f(r, "n_target_forwards") for r in ar], [decode_s(r) for r in ar])
    t_d, r2_d, n_d = fit_standalone([_f(r, "n_draft_forwards") for r in dar], [decode_s(r) for r in dar])
    return {
        "standalone": {"t_draft": t_d, "t_target": t_t, "r2_draft": r2_d, "r2_target": r2_t, "n_draft": n_d,
                       "n_target": n_t},
        "specdec": fit_forward_times(tri(m("fixed"))),
        "specdecpp": fit_forward_times(tri(m("learned"))),
        "speculative": fit_forward_times(tri(m(*SPEC_METHODS))),
    }


def usable(fit) -> bool:
    return fit is not None and fit.t_draft is not None and fit.t_target is not None and fit.rank_ok


def modelled_tps(a: Agg, fit) -> float:
    if not usable(fit):
        return float("nan")
    return theoretical_tokens_per_s(a.n_tokens, a.n_draft, a.n_target, fit.t_draft, fit.t_target)


def rel_errors(rows: list[dict], t_draft: float, t_target: float) -> list[float]:
    """Per-prompt |Eq. 5.1 throughput - measured decode throughput| / measured."""
    errs = (relative_error(theoretical_tokens_per_s(_f(r, "n_tokens"), _f(r, "n_draft_forwards"),
                                                    _f(r, "n_target_forwards"), t_draft, t_target),
                           _f(r, "n_tokens") / decode_s(r)) for r in rows)
    return [e for e in errs if not math.isnan(e)]


@dataclass
class DatasetResult:
    name: str
    label: str
    aggs: dict  # config -> Agg
    rows: list  # the complete-prompt rows
    fits: dict
    n_prompts: int
    dropped_prompts: int

    def of(self, method: str | tuple) -> list[Agg]:
        """The configurations of a method, or of any of a tuple of them (SPECDECPP)."""
        methods = (method,) if isinstance(method, str) else method
        return [a for a in self.aggs.values() if a.method in methods]

    def best(self, method: str, key=lambda a: a.tokens_per_s) -> Agg | None:
        return fastest(self.of(method), key)

    def get(self, config: str) -> Agg | None:
        return self.aggs.get(config)

    def specdecpp(self, head: str | None = None) -> list[Agg]:
        """SpecDec++ in the paper's tables (of one head, or all): the swept h, or, where none was swept
        (thresholds: [auto]), the h = auto rows. Not both: an auto row reruns a swept h, and the best of more
        reruns of one configuration is higher by noise alone (the auto table compares the two)."""
        mine = lambda m: [a for a in self.of(m) if head is None or a.head == head]  # noqa: E731
        return mine("learned") or mine("learned_auto")

    def best_specdecpp(self, key=lambda a: a.tokens_per_s) -> Agg | None:
        return fastest(self.specdecpp(), key)


def fastest(aggs, key=lambda a: a.tokens_per_s) -> Agg | None:
    """The configuration of the highest `key` (tokens/s by default) that has one; None where none has."""
    return max((a for a in aggs if not math.isnan(key(a))), key=key, default=None)


def analyse(rows: list[dict], how: str = "pooled") -> list[DatasetResult]:
    """One result per dataset; a sweep with a `drafts` axis gives one per dataset and draft configuration
    (label DATASET-DRAFT), each holding the rows that ran with that draft beside the target alone's, so
    every table, fit and speed-up compares one draft configuration with the target alone on the same prompts."""
    order = list(dict.fromkeys((r["dataset"], r.get("draft")) for r in rows if r.get("draft") is not None))
    order = order or [(ds, None) for ds in dict.fromkeys(r["dataset"] for r in rows)]
    results = []
    for ds, draft in order:
        drows, dropped = complete_rows([r for r in rows if r["dataset"] == ds and r.get("draft") in (None, draft)])
        groups = by_config(drows)
        ar = {_pkey(r): r for r in groups.get("ar", [])}
        aggs = {c: aggregate(rs, how, ar or None) for c, rs in groups.items()}
        label = ds_label(ds) if draft is None else f"{ds_label(ds)}-{draft.replace(':', '-')}"
        results.append(DatasetResult(ds, label, aggs, drows, fit_settings(drows),
                                     len({_pkey(r) for r in drows}), dropped))
    return results


def paired_ratio(d: DatasetResult, a: Agg | None, b: Agg | None) -> float:
    """Geometric mean over prompts of tok/s(a) / tok/s(b) on the same prompt."""
    if a is None or b is None:
        return float("nan")
    ra = {_pkey(r): r for r in d.rows if r["config"] == a.config}
    rb = {_pkey(r): r for r in d.rows if r["config"] == b.config}
    return geomean(_tps(ra[p]) / _tps(rb[p]) for p in ra if p in rb)


def head_order(heads_info: dict, results: list[DatasetResult]) -> list[str]:
    """The heads in heads.json's order, then any the rows name that it lacks."""
    return list(dict.fromkeys([*heads_info, *(a.head for d in results for a in d.of(SPECDECPP))]))


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
    if a.params["drafting"] != "tree":
        return "tree, fixed shape"
    if a.params.get("budget") == "learned":
        return LEARNED_TREE
    return HEAD_TREE if a.params.get("estimator") == "head" else POS_TREE


def best_of(d: DatasetResult, fams) -> Agg | None:
    return fastest(a for a in d.aggs.values() if family(a) in fams)


def bound_curve(calibration: dict, method: str, ks) -> list[tuple[int, float]]:
    """(budget, Tunstall bound on accepted tokens per pass) under `method`'s calibrated rates; [] uncalibrated."""
    rates, vocab = calibration.get(method), calibration.get("settings", {}).get("vocab_size")
    return [(k, tunstall_accepted(rates["cond_rates"], k, vocab)) for k in ks] if rates and vocab else []
