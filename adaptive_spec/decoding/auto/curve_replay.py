"""The threshold curve's replay (`curve_of`): the counts a policy produces per token on recorded answers, per h
of H_GRID, fixed K of K_GRID and (h, cap) of CAP_GRID (the format: heads/curve.py).

A response X_1..X_T stores at each position P_i = min(1, p_i(Y_i)/q_i(Y_i)) for a draft token Y_i ~ q_i, and
the head's p̂_i. A round at s drafts K(s) candidates (where the policy stops, capped) and accepts at least j
with probability prod_{i<j} P_{s+i}: X stands in for the accepted prefix, as the output is distributed as
the target's, so the products are unbiased. Carrying the probability w[s] that a round starts at s makes
every count an exact expectation."""
from __future__ import annotations

import numpy as np

from ...heads.curve import FORMAT

H_GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))
K_GRID = tuple(range(1, 17))
# Caps on K replayed with every h: under a constant verification cost a cap only loses (Theorem 4.3), but
# where a longer pass costs a step more the best rule is a threshold inside the cheap lengths; only the
# `table` time model, which sees that, picks one.
CAP_GRID = (3, 4, 5, 6, 7, 8, 10, 12)


def window_products(x: np.ndarray, width: int) -> np.ndarray:
    """[T, width + 1]: entry (s, j) = prod x[s:s+j] (1 past the end: those rounds are capped anyway)."""
    T = len(x)
    padded = np.concatenate([np.asarray(x, dtype=np.float64), np.ones(width)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, width)[:T]  # row s: x[s:s+width]
    return np.concatenate([np.ones((T, 1)), np.cumprod(windows, axis=1)], axis=1)


def stop_lengths(phat_windows: np.ndarray, h: float, k_max: int, lag: int) -> np.ndarray:
    """K(s) of SpecDec++ at threshold h: with m the first j such that 1 - prod p̂[s:s+j] > h
    (k_max if none), K = min(m + lag, k_max); lag 1 for a token head (it scores y_j one step late)."""
    stop = (1.0 - phat_windows[:, 1:k_max + 1]) > h
    m = np.where(stop.any(axis=1), stop.argmax(axis=1) + 1, k_max)
    return np.minimum(m + lag, k_max)


def replay(accept_windows: np.ndarray, K: np.ndarray) -> np.ndarray:
    """Expected (rounds, drafted, accepted, rounds all accepted, rounds of 0 candidates, of 1, ..., of k_hi) over
    one response of T = len(K) tokens, a round from position s drafting K[s] candidates; accept_windows from
    window_products(P, >= max K)."""
    T = len(K)
    w = np.zeros(T + 1)
    w[0] = 1.0
    rounds = drafted = accepted = full = 0.0
    by_k = np.zeros(accept_windows.shape[1])
    for s in range(T):
        ws = w[s]
        if ws == 0.0:
            continue
        k = int(min(K[s], T - s - 1))
        c = accept_windows[s, :k + 1]  # c[j] = P(at least j accepted)
        pmf = c.copy()
        pmf[:-1] -= c[1:]
        w[s + 1:s + k + 2] += ws * pmf
        rounds += ws
        drafted += ws * k
        accepted += ws * float(c[1:].sum())
        full += ws * float(c[k]) if k else 0.0
        by_k[k] += ws
    return np.concatenate([[rounds, drafted, accepted, full], by_k])


def counts_row(T: int, totals: np.ndarray) -> dict:
    """Curve counts, named as sweep rows name them (timemodel.predict_time reads either):
    target_pass_hist maps a verification pass's length (K + 1 tokens) to its expected count."""
    rounds, drafted, accepted, full = map(float, totals[:4])
    passes = {str(k + 1): float(v) for k, v in enumerate(totals[4:]) if v > 0}
    return {"n_tokens": T, "n_target_forwards": rounds, "n_draft_forwards": drafted, "n_drafted": drafted,
            "n_accepted": accepted, "n_all_accepted": full, "n_discarded": drafted - accepted,
            "verification_rate": rounds / max(T, 1), "discard_rate": (drafted - accepted) / max(T, 1),
            "tokens_per_round": T / rounds if rounds else float("nan"), "target_pass_hist": passes}


def curve_of(records, lag: int, k_max: int = 20, with_head: bool = True) -> dict | None:
    """The curve's counts over responses as training/autotune.responses yields them, (source, P, p̂, prompt ids,
    response ids); `lag` the head's (1: a token head); with_head False: the per-K part only. None without any."""
    width = max(k_max, max(K_GRID))
    caps = [c for c in CAP_GRID if c < k_max]
    tallies = {}
    for source, P, phat, _, _ in records:
        P = np.asarray(P, dtype=np.float64)
        phat = None if phat is None or not with_head else np.asarray(phat, dtype=np.float64)
        T = len(P)
        AP = window_products(P, width)
        by_k = [replay(AP, np.full(T, k)) for k in K_GRID]
        by_h, by_cap = [], []
        if phat is not None:
            PH = window_products(phat, k_max)
            by_h = [replay(AP, stop_lengths(PH, h, k_max, lag)) for h in H_GRID]
            by_cap = [replay(AP, stop_lengths(PH, h, cap, lag)) for cap in caps for h in H_GRID]
        for name in {None, source}:
            t = tallies.setdefault(name, {"n_responses": 0, "n_tokens": 0, "h": 0.0, "k": 0.0, "cap": 0.0})
            t["n_responses"] += 1
            t["n_tokens"] += T
            t["h"], t["k"], t["cap"] = t["h"] + np.array(by_h), t["k"] + np.array(by_k), t["cap"] + np.array(by_cap)
    if not tallies:
        return None

    def section(t: dict) -> dict:
        T = t["n_tokens"]
        grid = [(cap, h) for cap in caps for h in H_GRID]
        return {"n_responses": t["n_responses"], "n_tokens": T,
                "thresholds": [{"h": h, **counts_row(T, c)} for h, c in zip(H_GRID, t["h"])] if with_head else [],
                "capped": [{"h": h, "k_max": cap, **counts_row(T, c)} for (cap, h), c in zip(grid, t["cap"])]
                if with_head else [],
                "fixed_k": [{"k": k, **counts_row(T, c)} for k, c in zip(K_GRID, t["k"])]}

    pooled = section(tallies.pop(None))
    return {"format": FORMAT, "k_max": k_max, **pooled, "by_source": {n: section(t) for n, t in tallies.items()}}
