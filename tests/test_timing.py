"""The forward-time model (SpecDec++ Eq. 3.1, 3.2, 5.1): fits and throughput formulas."""
import math
import random

import pytest

from adaptive_spec.decoding.auto import timemodel

T_DRAFT, T_TARGET = 0.0234, 0.112  # the paper's speculative-setting times (section 5.2)


def synthetic_rows(n=40, seed=0, noise=0.0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.randint(1, 14)
        n_target = rng.randint(10, 60)
        n_draft = k * n_target - rng.randint(0, k)
        t = T_DRAFT * n_draft + T_TARGET * n_target
        rows.append((n_draft, n_target, t * (1 + rng.gauss(0, noise))))
    return rows


def test_fit_recovers_exact_times_and_r2_one():
    f = timemodel.fit_forward_times(synthetic_rows())
    assert f.t_draft == pytest.approx(T_DRAFT, rel=1e-9)
    assert f.t_target == pytest.approx(T_TARGET, rel=1e-9)
    assert f.r2 == pytest.approx(1.0, abs=1e-12)
    assert f.n_rows == 40 and f.rank_ok


def test_fit_noisy_rows_is_close():
    f = timemodel.fit_forward_times(synthetic_rows(n=300, seed=1, noise=0.02))
    assert f.t_draft == pytest.approx(T_DRAFT, rel=0.05)
    assert f.t_target == pytest.approx(T_TARGET, rel=0.05)
    assert 0.97 < f.r2 < 1.0


def test_fit_has_no_intercept():
    # T = 0.5 + 0.1 N_target: a model through the origin cannot hit it exactly
    rows = [(0, n, 0.5 + 0.1 * n) for n in (10, 20, 40, 80)]
    f = timemodel.fit_forward_times(rows)
    assert f.t_draft is None  # the draft never ran: left out of the fit
    assert f.t_target != pytest.approx(0.1, rel=1e-3)
    assert f.r2 < 1.0


def test_standalone_fits():
    t, r2, n = timemodel.fit_standalone([10, 20, 30], [1.08, 2.16, 3.24])
    assert t == pytest.approx(0.108) and r2 == pytest.approx(1.0) and n == 3
    # draft-only rows through the generic fit give t_draft and no t_target
    f = timemodel.fit_forward_times([(10, 0, 0.207), (30, 0, 0.621)])
    assert f.t_draft == pytest.approx(0.0207) and f.t_target is None


def test_collinear_rows_are_flagged():
    # a single fixed K: N_draft = K * N_target in every row, the two times are not identified
    rows = [(4 * n, n, T_DRAFT * 4 * n + T_TARGET * n) for n in (10, 20, 30)]
    assert not timemodel.fit_forward_times(rows).rank_ok


def test_eq_5_1_throughput_and_latency():
    # paper: stand-alone target t = 0.108 s -> 9.26 tokens/s
    assert timemodel.theoretical_tokens_per_s(100, 0, 100, 0.0207, 0.108) == pytest.approx(9.259, abs=1e-3)
    # N = 100, N_target = 20, N_discarded = 10 -> N_draft = N + N_disc - N_target = 90
    tps = timemodel.theoretical_tokens_per_s(100, 90, 20, T_DRAFT, T_TARGET)
    assert tps == pytest.approx(100 / (0.0234 * 90 + 0.112 * 20))
    lat = T_DRAFT + T_DRAFT * 10 / 100 + (T_TARGET - T_DRAFT) * 20 / 100  # Eq. 5.1 from the two rates
    assert lat == pytest.approx(1 / tps)  # Eq. 5.1 = Eq. 3.1 / N under the counting identity


def test_eq_3_2_decomposition_and_compare():
    d = timemodel.decompose(100, 10, 20, T_DRAFT, T_TARGET)
    assert d.oracle == pytest.approx(T_DRAFT * 100)
    assert d.discard == pytest.approx(T_DRAFT * 10)
    assert d.verification == pytest.approx((T_TARGET - T_DRAFT) * 20)
    assert d.total == pytest.approx(90 * T_DRAFT + 20 * T_TARGET)  # Lemma 3.1
    pt = d.per_token()
    assert pt["total"] == pytest.approx(T_DRAFT + T_DRAFT * 0.1 + (T_TARGET - T_DRAFT) * 0.2)  # Eq. 5.1
    # fewer verifications but more discards than the baseline: loses on the discard term
    ours = timemodel.decompose(100, 30, 15, T_DRAFT, T_TARGET)
    c = timemodel.compare_decompositions(ours, d)
    assert c["loses"] == "discard"
    assert c["discard"] == pytest.approx(T_DRAFT * 20 / 100)
    assert c["verification"] == pytest.approx(-(T_TARGET - T_DRAFT) * 5 / 100)
    assert timemodel.compare_decompositions(d, d)["loses"] is None


def test_relative_error_and_mean_std():
    assert timemodel.relative_error(106.2, 100) == pytest.approx(0.062)
    assert math.isnan(timemodel.relative_error(1.0, 0.0))
    m, s = timemodel.mean_std([0.0206, 0.0207, 0.0206])
    assert m == pytest.approx(0.020633, abs=1e-6) and s == pytest.approx(5.77e-5, rel=1e-2)


def test_timed_measures_the_block(monkeypatch):
    """The clock read on entering the block and again on leaving it, after the device is synced."""
    from adaptive_spec import timing

    ticks, synced = iter([10.0, 10.25]), []
    monkeypatch.setattr(timing, "clock", lambda: next(ticks))
    monkeypatch.setattr(timing, "sync", lambda device: synced.append(device))
    with timing.timed("cpu") as t:
        assert t.s == 0.0 and not synced
    assert t.s == 0.25 and synced == ["cpu"]


def test_timed_runs_syncs_a_timed_call_before_the_clock_stops_and_no_warm_up(monkeypatch):
    """With a device, each timed call's clock stops after the sync (as `timed`'s); a warm-up is not waited for;
    without one, nothing is synced (host work)."""
    from adaptive_spec import timing

    ticks, log = iter([0.0, 1.0, 2.0, 2.5, 4.0, 4.75]), []
    monkeypatch.setattr(timing, "clock", lambda: log.append("clock") or next(ticks))
    monkeypatch.setattr(timing, "sync", lambda device: log.append(("sync", device)))
    times, last = timing.timed_runs(lambda: log.append("call") or len(log), 2, warmup=1, device="cuda")
    assert times == [1.0, 1.5] and last == 8
    assert log == ["clock", "call"] + ["clock", "call", ("sync", "cuda"), "clock"] * 2
    log.clear()
    ticks = iter([0.0, 1.0])
    assert timing.timed_runs(lambda: log.append("call"), 1)[0] == [1.0] and ("sync", None) not in log
