"""Time models of a generation, fitted to sweep rows and compared.

    paper      T = t_draft N_draft + t_target N_target                     (Eq. 3.1)
    extended   T = t_draft N_draft + t_target N_target + t_cand N_drafted
    table      T = t_draft N_draft + sum_n t_verify(n) N_pass(n)            (measured costs only)

N_pass(n) counts the target passes of n tokens (a row's target_pass_hist; a curve point's
expected one). On a CPU t_verify(n) is a step function, not a line: oneDNN's packed GEMM blocks
rows, so a pass of 6 tokens costs what one of 3 does and one of 7 some 20% more. The table model
takes the measured t_verify(n) of costs.py as they are; it has too many coefficients to fit
from sweep rows, so it is scored with measured costs only. A row or point without a pass
histogram falls back to the extended model's terms.

t_cand is the extra target time per candidate in a verification pass (costs.py measures it:
about 10 ms on an AVX2-only CPU, near zero where the pass reads the weights once whatever K is).

T is the decode time, wall_s - prefill_s: prefill enters as a measured term, not a fitted
constant, because its cost depends on the prompt's length, which the counts do not carry, and
every row records it. A fitted constant would take prompt-length variation for model error,
and picking h or K (auto.py) never needs it: prefill is the same whatever the policy.

Identification. A chain round runs one draft forward per candidate, so on speculative rows
N_draft = N_drafted and the two models fit them equally well (t_draft + t_cand is all that is
identified). t_draft and t_cand separate only with rows where the two counts differ: draft-only
(draft_ar) rows, where N_drafted = 0, and tree rounds. The comparison therefore fits both
models on all rows (stand-alone included) and scores them on the speculative rows, beside the
report's own Eq. 3.1 fit on speculative rows only; `rank_ok` is False where a model's
coefficients are not identified by the rows given.

Scores: the centred R^2 of decode time (timing._r2), and per configuration the relative error of
predicted vs measured decode throughput, sum N / sum T over the configuration's rows.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..tables import fmt, md_table
from ..timing import _r2

COLUMNS = {"t_draft": "n_draft_forwards", "t_target": "n_target_forwards", "t_cand": "n_drafted"}
MODELS = {"paper": ("t_draft", "t_target"), "extended": ("t_draft", "t_target", "t_cand")}  # fitted or measured
MEASURED_ONLY = ("table",)
STANDALONE = ("ar", "draft_ar")


def _f(row: dict, key: str) -> float:
    v = row.get(key)
    return 0.0 if v is None or v != v else float(v)


def decode_s(row: dict) -> float:
    return max(_f(row, "wall_s") - _f(row, "prefill_s"), 1e-12)


def predict_time(row: dict, coef: dict) -> float:
    """Seconds the model gives a row's (or a curve point's) counts; missing coefficients count 0.
    With `verify_s` (the table model) the target term is the sum of its passes' measured times."""
    hist = row.get("target_pass_hist")
    if "verify_s" in coef and hist and abs(sum(hist.values()) - _f(row, "n_target_forwards")) < 1e-6:
        return coef["t_draft"] * _f(row, "n_draft_forwards") + sum(coef["verify_s"](int(n)) * float(c)
                                                                    for n, c in hist.items())
    return sum(coef.get(name, 0.0) * _f(row, col) for name, col in COLUMNS.items())


def coef_of(costs, model: str = "extended") -> dict:
    """Measured Costs as a model's coefficients (the paper's model has no t_cand). The table
    model's are the extended model's plus `verify_s` (Costs.verify_s); without measured
    per-length times it is the extended model (effective_model)."""
    model = effective_model(costs, _check_model(model))
    coef = {name: getattr(costs, name) for name in MODELS["extended" if model == "table" else model]}
    return {**coef, "verify_s": costs.verify_s} if model == "table" else coef


def effective_model(costs, model: str) -> str:
    """The model `coef_of` applies: the table model needs measured per-length times, else it is the extended one."""
    return "extended" if model == "table" and not getattr(costs, "t_verify", ()) else model


def _check_model(model: str) -> str:
    if model not in MODELS and model not in MEASURED_ONLY:
        from ..errors import UserError

        raise UserError(f"unknown time model {model!r}; use one of {', '.join((*MODELS, *MEASURED_ONLY))}")
    return model


@dataclass
class TimeFit:
    model: str
    coef: dict  # t_draft / t_target / t_cand -> seconds (None: not in the rows)
    r2: float  # centred R^2 of decode time on the scored rows
    n_rows: int  # rows fitted on
    rank_ok: bool
    rel_errors: dict = field(default_factory=dict)  # (dataset, config) -> |pred - meas| / meas throughput
    scope: str = "all"  # fitted on "speculative" rows, "all" rows, or "measured" (costs.py, nothing fitted)

    @property
    def mean_rel_error(self) -> float:
        v = list(self.rel_errors.values())
        return sum(v) / len(v) if v else float("nan")

    @property
    def max_rel_error(self) -> float:
        return max(self.rel_errors.values(), default=float("nan"))


def usable(rows: list[dict]) -> list[dict]:
    """Rows with measured counts and time (transformers' assisted generation derives its counts)."""
    return [r for r in rows if not r.get("counts_derived") and _f(r, "n_tokens") > 0 and _f(r, "wall_s") > 0]


def speculative(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("method") not in STANDALONE and _f(r, "n_target_forwards") > 0
            and _f(r, "n_draft_forwards") > 0]


def fit(rows: list[dict], model: str = "paper", score_rows: list[dict] | None = None, scope: str = "all") -> TimeFit:
    """Least squares (no intercept) of decode time on the model's counts over `rows`; scored on
    `score_rows` (default: the same rows). A count that is zero in every row is left out (its
    coefficient None), as timing.fit_forward_times does."""
    names = MODELS[_check_model(model)]
    score_rows = rows if score_rows is None else score_rows
    X = np.array([[_f(r, COLUMNS[n]) for n in names] for r in rows]).reshape(len(rows), len(names))
    y = np.array([decode_s(r) for r in rows])
    used = [j for j in range(len(names)) if np.any(X[:, j] != 0)]
    if not used:  # no rows, or none that involves a model
        return TimeFit(model, dict.fromkeys(names), float("nan"), len(rows), False, scope=scope)
    sol, _, rank, _ = np.linalg.lstsq(X[:, used], y, rcond=None)
    coef = dict.fromkeys(names)
    coef.update({names[j]: float(c) for j, c in zip(used, sol)})
    known = {k: v for k, v in coef.items() if v is not None}
    r2 = float("nan")
    if score_rows:
        pred = np.array([predict_time(r, known) for r in score_rows])
        r2 = _r2(np.array([decode_s(r) for r in score_rows]), pred)
    return TimeFit(model, coef, r2, len(rows), bool(rank == len(used)),
                   throughput_errors(score_rows, known), scope)


def throughput_errors(rows: list[dict], coef: dict) -> dict:
    """(dataset, config) -> |predicted - measured| / measured decode throughput, pooled over its rows."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r.get("dataset"), r.get("config"))].append(r)
    out = {}
    for key, rs in groups.items():
        pred = sum(predict_time(r, coef) for r in rs)
        meas = sum(decode_s(r) for r in rs)
        if pred > 0:
            # N / pred vs N / meas: the relative error of a throughput is meas / pred - 1
            out[key] = abs(meas / pred - 1.0)
    return out


def compare(rows: list[dict], costs=None) -> list[tuple[str, TimeFit]]:
    """The fits side by side on one set of sweep rows: Eq. 3.1 on speculative rows (the report's
    Table 2), Eq. 3.1 and the extended model on all rows; with `costs` (measured, costs.py) also
    both models with the measured times (nothing fitted), which is what `auto` uses."""
    rows = usable(rows)
    spec = speculative(rows)
    out = [("Eq. 3.1, fitted on speculative rows", fit(spec, "paper", scope="speculative")),
           ("Eq. 3.1, fitted on all rows", fit(rows, "paper", spec)),
           ("extended, fitted on all rows", fit(rows, "extended", spec))]
    if costs is not None:
        for model in (*MODELS, *(("table",) if getattr(costs, "t_verify", ()) else ())):
            coef = coef_of(costs, model)
            y = np.array([decode_s(r) for r in spec])
            r2 = _r2(y, np.array([predict_time(r, coef) for r in spec])) if spec else float("nan")
            shown = {k: v for k, v in coef.items() if k in MODELS["extended"]}
            out.append((f"{model}, measured costs", TimeFit(model, {**dict.fromkeys(MODELS["extended"]), **shown}, r2,
                                                            0, True, throughput_errors(spec, coef), "measured")))
    return out


def better_model(fits: list[tuple[str, TimeFit]]) -> str:
    """The model ('paper', 'extended' or 'table') with the lower mean throughput error on equal terms: with
    measured costs (what `auto` uses) where there are any, else both fitted on all rows."""
    scope = "measured" if any(f.scope == "measured" for _, f in fits) else "all"
    best = {}
    for _, f in fits:
        if f.scope != scope:
            continue
        err = f.mean_rel_error
        if f.rank_ok and not math.isnan(err) and err < best.get(f.model, math.inf):
            best[f.model] = err
    return min(best, key=best.get) if best else "extended"


def comparison_table(rows: list[dict], costs=None) -> str:
    """Markdown: per dataset and pooled, every fit of `compare` with its times (ms), R^2 and
    throughput errors per configuration; and which model predicts better."""
    ms = lambda v: fmt(None if v is None else 1e3 * v, ".2f")  # noqa: E731
    pct = lambda v: fmt(100 * v, ".1f") + "%" if v == v else "—"  # noqa: E731
    datasets = list(dict.fromkeys(r.get("dataset") for r in rows))
    groups = [(d, [r for r in rows if r.get("dataset") == d]) for d in datasets]
    if len(datasets) > 1:
        groups.append(("pooled", rows))
    body, verdict = [], []
    for name, rs in groups:
        fits = compare(rs, costs)
        for label, f in fits:
            body.append([name, label, ms(f.coef.get("t_draft")), ms(f.coef.get("t_target")), ms(f.coef.get("t_cand")),
                         fmt(f.r2, ".3f"), pct(f.mean_rel_error), pct(f.max_rel_error), str(len(f.rel_errors)),
                         "yes" if f.rank_ok else "no"])
        unidentified = [label for label, f in fits if not f.rank_ok]
        verdict.append(f"{name}: {better_model(fits)}" + (f" (not identified: {', '.join(unidentified)})"
                                                           if unidentified else ""))
    header = ["dataset", "model", "t_draft ms", "t_target ms", "t_cand ms", "R² (spec. rows)", "mean |err| tok/s",
              "max |err| tok/s", "configs", "identified"]
    return md_table(header, body) + "\n\nLower mean throughput error: " + "; ".join(verdict) + "\n"
