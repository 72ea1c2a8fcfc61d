"""Time models of a generation: SpecDec++'s Eq. 3.1 (and Lemma 3.1's decomposition), and the models fitted to
sweep rows and compared.

    paper      T = t_draft N_draft + t_target N_target                     (Eq. 3.1)
    extended   T = t_draft N_draft + t_target N_target + t_cand N_drafted
    table      T = t_draft N_draft + sum_n t_verify(n) N_pass(n)            (measured costs only)

T is the decode time, wall_s - prefill_s: the counts are of decoding forwards only (prefill is the same
whatever the policy). Fits are least squares through the origin, scored by the centred R^2 and per
configuration by the relative error of the predicted throughput. On speculative chain rows N_draft =
N_drafted, so only t_draft + t_cand is identified: models are fitted on all rows and scored on the
speculative ones (`rank_ok` False where the rows do not identify a model). Measured costs add t_catch_up
(a two-token draft step after an all-accepted round) and t_feed (the tokens a draft's first step feeds
after copying rounds)."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from typing import Iterable, Sequence

import numpy as np

from ...errors import UserError
from ...tables import fmt, md_table

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
    """Seconds the model gives a row's (or a curve point's) counts; missing coefficients count 0. With
    `verify_s` (the table model) the target term sums its passes' measured times; with `loop_row` /
    `loop_round` (Costs.loop) the decode loop's own time per row and per verification is added."""
    hist = row.get("target_pass_hist")
    if "verify_s" in coef and hist and abs(sum(hist.values()) - _f(row, "n_target_forwards")) < 1e-6:
        t = coef["t_draft"] * _f(row, "n_draft_forwards") + sum(coef["verify_s"](int(n)) * float(c)
                                                                for n, c in hist.items())
    else:
        t = sum(coef.get(name, 0.0) * _f(row, col) for name, col in COLUMNS.items())
    # the draft's two-token first steps, after rounds whose candidates were all accepted (a curve point
    # counts them; a sweep row does not, and its time is fitted without the term)
    t += coef.get("t_catch_up", 0.0) * _f(row, "n_all_accepted")
    # and the tokens beyond two such a step feeds after copying rounds (prompt lookup with the draft model
    # in the other rounds: ngram.replay_copies counts them), at the draft's prefill rate
    t += coef.get("t_feed", 0.0) * _f(row, "n_fed_extra")
    if "loop_row" in coef:
        if hist:
            rows = sum(int(n) * float(c) for n, c in hist.items())
            verifications = sum(float(c) for n, c in hist.items() if int(n) > 1)
        else:
            rows = _f(row, "n_target_forwards") + _f(row, "n_drafted")
            verifications = _f(row, "n_target_forwards") if _f(row, "n_drafted") else 0.0
        t += coef["loop_row"] * (rows + _f(row, "n_draft_forwards")) + coef.get("loop_round", 0.0) * verifications
    return t


def rate_of(point: dict, coef: dict) -> float:
    """Tokens a second of a row's (a curve point's) counts under `coef`."""
    return point["n_tokens"] / predict_time(point, coef)


def coef_of(costs, model: str = "extended", loop: str | None = None) -> dict:
    """Measured Costs as a model's coefficients (the table model's: the extended one's plus `verify_s`, where
    measured). `loop`: the sampling mode ("greedy", "sample") whose loop time (Costs.loop) is added."""
    model = effective_model(costs, _check_model(model))
    coef = {name: getattr(costs, name) for name in MODELS["extended" if model == "table" else model]}
    if model != "paper":  # Eq. 3.1 prices every draft step alike
        if getattr(costs, "t_catch_up", 0.0):
            coef["t_catch_up"] = costs.t_catch_up
        if getattr(costs, "t_prefill_draft", 0.0):  # whether or not a two-token step costs more than one
            coef["t_feed"] = costs.t_prefill_draft
    if loop is not None and getattr(costs, "loop", None):
        coef.update(loop_row=costs.loop_s(loop, "row"), loop_round=costs.loop_s(loop, "round"))
    return {**coef, "verify_s": costs.verify_s} if model == "table" else coef


# the target alone's token: one one-row pass
ONE_STEP = {"n_tokens": 1.0, "n_target_forwards": 1.0, "n_draft_forwards": 0.0, "n_drafted": 0.0,
            "target_pass_hist": {"1": 1.0}}


def round_costs(counts: dict, coef: dict) -> dict:
    """Per round (one target pass) of counts: tokens, drafted tokens, draft steps, the share accepted, the
    commonest pass length, and the round's time in one-row target steps (ONE_STEP) under `coef`."""
    rounds = counts["n_target_forwards"]
    hist = counts.get("target_pass_hist") or {}
    drafted = counts.get("n_drafted", 0.0)
    return {"tokens": counts["n_tokens"] / rounds, "drafted": drafted / rounds,
            "draft_steps": counts.get("n_draft_forwards", 0.0) / rounds,
            "accepted": counts.get("n_accepted", 0.0) / drafted if drafted else float("nan"),
            "rows": int(max(hist, key=hist.get)) if hist else None,
            "steps": predict_time(counts, coef) / rounds / predict_time(ONE_STEP, coef)}


def effective_model(costs, model: str) -> str:
    """The model `coef_of` applies: the table model needs measured per-length times, else it is the extended one."""
    return "extended" if model == "table" and not getattr(costs, "t_verify", ()) else model


def _check_model(model: str) -> str:
    if model not in MODELS and model not in MEASURED_ONLY:
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
    """Least squares (no intercept) of decode time on the model's counts over `rows`, scored on `score_rows`
    (default: the same rows); a count zero in every row gets coefficient None."""
    names = MODELS[_check_model(model)]
    score_rows = rows if score_rows is None else score_rows
    X = np.array([[_f(r, COLUMNS[n]) for n in names] for r in rows]).reshape(len(rows), len(names))
    sol, used, rank_ok = _lstsq(X, np.array([decode_s(r) for r in rows]))
    coef = dict(zip(names, sol))
    if not used:  # no rows, or none that involves a model
        return TimeFit(model, coef, float("nan"), len(rows), False, scope=scope)
    return _scored(model, {k: v for k, v in coef.items() if v is not None}, score_rows, coef, len(rows), rank_ok, scope)


def _scored(model: str, coef: dict, rows: list[dict], shown: dict, n_rows: int, rank_ok: bool, scope: str) -> TimeFit:
    """`coef` scored on `rows` (R^2 of decode time, throughput errors), reported with coefficients `shown`."""
    r2 = _r2(np.array([decode_s(r) for r in rows]), np.array([predict_time(r, coef) for r in rows]))
    return TimeFit(model, shown, r2, n_rows, rank_ok, throughput_errors(rows, coef), scope)


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
    """The fits side by side on one set of sweep rows: Eq. 3.1 on speculative rows, Eq. 3.1 and the extended
    model on all rows; with measured `costs` also each model with them (nothing fitted: what `auto` uses)."""
    rows = usable(rows)
    spec = speculative(rows)
    out = [("Eq. 3.1, fitted on speculative rows", fit(spec, "paper", scope="speculative")),
           ("Eq. 3.1, fitted on all rows", fit(rows, "paper", spec)),
           ("extended, fitted on all rows", fit(rows, "extended", spec))]
    if costs is not None:
        for model in (*MODELS, *(("table",) if getattr(costs, "t_verify", ()) else ())):
            coef = coef_of(costs, model)
            shown = {k: coef.get(k) for k in MODELS["extended"]}
            out.append((f"{model}, measured costs", _scored(model, coef, spec, shown, 0, True, "measured")))
    return out


def better_model(fits: list[tuple[str, TimeFit]]) -> str:
    """The model ('paper', 'extended' or 'table') with the lower mean throughput error on equal terms: with
    measured costs (what `auto` uses) where there are any, else both fitted on all rows."""
    scope = "measured" if any(f.scope == "measured" for _, f in fits) else "all"
    errs = [(f.mean_rel_error, f.model) for _, f in fits
            if f.scope == scope and f.rank_ok and not math.isnan(f.mean_rel_error)]  # one fit a model in a scope
    return min(errs, key=lambda em: em[0])[1] if errs else "extended"


def comparison_table(rows: list[dict], costs=None) -> str:
    """Markdown: per dataset and pooled, every fit of `compare`, and which model predicts better."""
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


@dataclass
class ForwardFit:
    """Fitted forward times in seconds; None for a model the rows do not involve."""

    t_draft: float | None
    t_target: float | None
    r2: float  # centred R^2 of the fit (nan for fewer than 2 rows, constant T, or identical counts in every row)
    n_rows: int
    rank_ok: bool = True  # False: the columns were collinear (e.g. a single fixed K), t's not identified


def _lstsq(X: np.ndarray, y: np.ndarray) -> tuple[list, list[int], bool]:
    """Least squares through the origin over the columns not zero in every row: (coefficients, None for
    the columns left out; the columns used; whether they were identified)."""
    used = [j for j in range(X.shape[1]) if np.any(X[:, j] != 0)]
    coef = [None] * X.shape[1]
    if not used:
        return coef, used, False
    sol, _, rank, _ = np.linalg.lstsq(X[:, used], y, rcond=None)
    for j, c in zip(used, sol):
        coef[j] = float(c)
    return coef, used, bool(rank == len(used))


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    if len(y) < 2:
        return float("nan")
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float(((y - pred) ** 2).sum())
    if ss_tot == 0.0:
        return 1.0 if ss_res == 0.0 else float("nan")
    return 1.0 - ss_res / ss_tot


def fit_forward_times(rows: Iterable[Sequence[float]]) -> ForwardFit:
    """Eq. 3.1 fitted to (N_draft, N_target, T) triples; a model whose count is zero in every row is left
    out (its time None), so target-only or draft-only runs fit a single coefficient."""
    a = np.asarray([tuple(map(float, r)) for r in rows], dtype=np.float64).reshape(-1, 3)
    X, y = a[:, :2], a[:, 2]
    t, used, rank_ok = _lstsq(X, y)
    if not used:  # no rows, or none that involves a model
        return ForwardFit(None, None, float("nan"), len(a), False)
    Xu = X[:, used]
    # with the same counts in every row (e.g. every target-only run made 128 tokens) the fit is a
    # mean and explains no variance by construction: R^2 would read 0, which is not a finding
    r2 = float("nan") if np.all(np.ptp(Xu, axis=0) == 0) else _r2(y, Xu @ np.array([t[j] for j in used]))
    return ForwardFit(t[0], t[1], r2, len(a), rank_ok)


def fit_standalone(counts: Iterable[float], times: Iterable[float]) -> tuple[float | None, float, int]:
    """Stand-alone (one model, autoregressive) fit T = t * N: (t, R^2, n rows)."""
    f = fit_forward_times((0.0, n, t) for n, t in zip(counts, times))
    return f.t_target, f.r2, f.n_rows


def theoretical_tokens_per_s(n_tokens: float, n_draft: float, n_target: float, t_draft: float,
                             t_target: float) -> float:
    """Eq. (5.1) as a throughput: N / (t_draft * N_draft + t_target * N_target)."""
    t = t_draft * n_draft + t_target * n_target  # Eq. 3.1
    return n_tokens / t if t > 0 else float("nan")


def relative_error(predicted: float, measured: float) -> float:
    if not measured or measured != measured:
        return float("nan")
    return abs(predicted - measured) / abs(measured)


@dataclass
class Decomposition:
    """Lemma 3.1 (Eq. 3.2): total = oracle + discard + verification, all in seconds."""

    oracle: float  # T_0 = t_draft * N
    discard: float  # t_draft * N_discarded
    verification: float  # (t_target - t_draft) * N_target
    n_tokens: float

    @property
    def total(self) -> float:
        return self.oracle + self.discard + self.verification

    def per_token(self) -> dict:
        n = max(self.n_tokens, 1)
        return {"oracle": self.oracle / n, "discard": self.discard / n, "verification": self.verification / n,
                "total": self.total / n}


def decompose(n_tokens: float, n_discarded: float, n_target: float, t_draft: float, t_target: float) -> Decomposition:
    """Eq. (3.2) for counts summed over any set of generations."""
    return Decomposition(t_draft * n_tokens, t_draft * n_discarded, (t_target - t_draft) * n_target, n_tokens)


def compare_decompositions(ours: Decomposition, baseline: Decomposition) -> dict:
    """Per-token differences ours - baseline of each term (negative: ours is cheaper), and `loses`: the
    avoidable term (discard, verification) where ours loses the most (None: neither)."""
    a, b = ours.per_token(), baseline.per_token()
    diff = {k: a[k] - b[k] for k in ("discard", "verification", "total")}
    worse = {k: diff[k] for k in ("discard", "verification") if diff[k] > 0}
    diff["loses"] = max(worse, key=worse.get) if worse else None
    return diff


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    v = [x for x in values if x is not None and not math.isnan(x)]
    if not v:
        return float("nan"), float("nan")
    m = sum(v) / len(v)
    s = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return m, s
