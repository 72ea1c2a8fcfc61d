"""The forward-time model of SpecDec++ (section 3.2, 5.1-5.2, appendix D.2).

Eq. (3.1)   T_total = t_draft * N_draft + t_target * N_target
Lemma 3.1   with N_draft + N_target = N + N_discarded (one target pass per round, one draft pass
            per candidate), T_total = T_0 + t_draft * N_discarded + (t_target - t_draft) * N_target,
            T_0 = t_draft * N being the oracle time (Eq. 3.2)
Eq. (5.1)   latency T_total / N = t_draft + t_draft * N_discarded/N + (t_target - t_draft) * N_target/N

`fit_forward_times` fits t_draft, t_target from (N_draft, N_target, T) rows by least squares
through the origin (no intercept, as Eq. 3.1 has none) and reports R^2. R^2 here is the centred
one, 1 - SS_res / sum (T - mean T)^2 (what e.g. scikit-learn's `score` reports for a fit without
intercept): it compares the model with predicting the mean time, the stricter of the two usual
definitions. Stand-alone runs fit one coefficient (target-only: T = t_target * N_target; draft-only:
T = t_draft * N_draft).

The rows' T should be the time the counted forwards account for: the sweep counts decoding forwards
only (prompt prefill is not counted in N_draft / N_target), so the report fits
T = wall_s - prefill_s ("decode time").
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import numpy as np

# ----------------------------------------------------------------------------- measuring forwards

def sync(device) -> None:
    """Wait for the device to finish its queued work (CUDA runs asynchronously; CPU is a no-op)."""
    if getattr(device, "type", str(device).split(":")[0]) == "cuda":
        import torch

        torch.cuda.synchronize(device)


class timed:
    """Wall time of a block of device work: `with timed(device) as t: ...; t.s` seconds.

    The clock stops only after the device is idle, because a CUDA forward returns before its
    kernels ran and timing the call alone would measure the launch, not the work."""

    def __init__(self, device="cpu"):
        self.device, self.s = device, 0.0

    def __enter__(self) -> "timed":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        sync(self.device)
        self.s = time.perf_counter() - self.t0
        return False


# ----------------------------------------------------------------------------- the model


@dataclass
class ForwardFit:
    """Fitted forward times in seconds; None for a model the rows do not involve."""

    t_draft: float | None
    t_target: float | None
    r2: float  # centred R^2 of the fit (nan for fewer than 2 rows, constant T, or identical counts in every row)
    n_rows: int
    rank_ok: bool = True  # False: the columns were collinear (e.g. a single fixed K), t's not identified

    def to_dict(self) -> dict:
        return asdict(self)


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    if len(y) < 2:
        return float("nan")
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float(((y - pred) ** 2).sum())
    if ss_tot == 0.0:
        return 1.0 if ss_res == 0.0 else float("nan")
    return 1.0 - ss_res / ss_tot


def fit_forward_times(rows: Iterable[Sequence[float]]) -> ForwardFit:
    """Least squares T = t_draft * N_draft + t_target * N_target (no intercept).

    rows: (N_draft, N_target, T) triples. A model whose count is zero in every row is left out of
    the fit (its time is None), so target-only or draft-only runs fit a single coefficient.
    """
    a = np.asarray([tuple(map(float, r)) for r in rows], dtype=np.float64).reshape(-1, 3)
    if len(a) == 0:
        return ForwardFit(None, None, float("nan"), 0, False)
    X, y = a[:, :2], a[:, 2]
    used = [j for j in range(2) if np.any(X[:, j] != 0)]
    if not used:
        return ForwardFit(None, None, float("nan"), len(a), False)
    Xu = X[:, used]
    coef, _, rank, _ = np.linalg.lstsq(Xu, y, rcond=None)
    t = [None, None]
    for j, c in zip(used, coef):
        t[j] = float(c)
    # with the same counts in every row (e.g. every target-only run made 128 tokens) the fit is a
    # mean and explains no variance by construction: R^2 would read 0, which is not a finding
    r2 = float("nan") if np.all(np.ptp(Xu, axis=0) == 0) else _r2(y, Xu @ coef)
    return ForwardFit(t[0], t[1], r2, len(a), bool(rank == len(used)))


def fit_standalone(counts: Iterable[float], times: Iterable[float]) -> tuple[float | None, float, int]:
    """Stand-alone (one model, autoregressive) fit T = t * N: (t, R^2, n rows)."""
    f = fit_forward_times((0.0, n, t) for n, t in zip(counts, times))
    return f.t_target, f.r2, f.n_rows


def model_time(n_draft: float, n_target: float, t_draft: float, t_target: float) -> float:
    """Eq. (3.1)."""
    return t_draft * n_draft + t_target * n_target


def theoretical_tokens_per_s(n_tokens: float, n_draft: float, n_target: float, t_draft: float,
                             t_target: float) -> float:
    """Eq. (5.1) as a throughput: N / (t_draft * N_draft + t_target * N_target)."""
    t = model_time(n_draft, n_target, t_draft, t_target)
    return n_tokens / t if t > 0 else float("nan")


def latency_per_token(discard_rate: float, verification_rate: float, t_draft: float, t_target: float) -> float:
    """Eq. (5.1): T/N from the two rates (hardware-independent) and the forward times."""
    return t_draft + t_draft * discard_rate + (t_target - t_draft) * verification_rate


def relative_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured."""
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


def compare(ours: Decomposition, baseline: Decomposition) -> dict:
    """Per-token differences ours - baseline of each term (negative = ours is cheaper) and which of
    the two avoidable terms (discard, verification) loses the most time for `ours` relative to the
    baseline; `loses` is None when ours is no worse on either."""
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
