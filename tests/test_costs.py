"""costs.measure_costs: real timed forwards of tiny models, the verification fit, and the cache
per machine and configuration (hit, miss on a key change, a corrupt file measured again)."""
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from adaptive_spec.backends.contract import Counters
from adaptive_spec.decoding.auto import cost_timing as CT
from adaptive_spec.decoding.auto import costs as C
from adaptive_spec.errors import UserError
from adaptive_spec.decoding.pipeline import SpecPair
from adaptive_spec.decoding.auto import coef_of
from tiny import make_model, make_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path))
    return tmp_path / "costs"


@pytest.fixture(scope="module")
def pair():
    tok = make_tokenizer(32)
    return SpecPair.from_models(make_model(32, 24, seed=2, logit_scale=4.0), tok, make_model(32, 16, seed=1, logit_scale=4.0), tok)


def test_measured_times_and_the_runners_are_left_as_they_were(pair, cache):
    before = pair.generate([5, 6, 7], policy="fixed", k=3, temperature=0, max_new_tokens=12)
    pair.target.counters.restore((1.5, 7, 0.0))
    c = C.measure_costs(pair, reps=1)
    assert c.t_draft > 0 and c.t_target > 0 and c.t_cand >= 0
    assert c.t_draft_two >= c.t_draft and c.t_catch_up == c.t_draft_two - c.t_draft  # the draft's 2-token step
    assert c.c == pytest.approx(c.t_draft / c.t_target)
    assert c.node_cost == pytest.approx((c.t_draft + c.t_cand) / c.t_target)
    # measuring shows up in no counter and leaves no cached position behind
    assert pair.target.counters.saved() == (1.5, 7, 0.0)
    assert pair.target.length == 0 and pair.draft.length == 0
    after = pair.generate([5, 6, 7], policy="fixed", k=3, temperature=0, max_new_tokens=12)
    assert after.token_ids == before.token_ids
    assert after.metrics.n_target_forwards == before.metrics.n_target_forwards
    saved = json.loads((cache / f"{c.key}.json").read_text())
    assert saved["t_target"] == c.t_target and saved["config"]["draft_fingerprint"]
    assert C.costs_from_json(saved) == c


def test_verification_fit(monkeypatch):
    """t_target and t_cand come from the fit of a K + 1-token pass over K; a pass that does not grow
    with K (a negative slope is timing noise) has t_cand = 0 and t_target its mean time."""
    def fake(verify):
        return lambda cells, reps, prefill=None: [verify[n] if all_rows else 0.03 for _, n, all_rows in cells]

    runners = SimpleNamespace(draft=object(), target=SimpleNamespace(vocab_size=50, device=torch.device("cpu")))
    lengths = C.VERIFY_LENGTHS + C.LONG_LENGTHS
    # the one-row pass is the decode's step (decode_step_time), here the line's own value
    monkeypatch.setattr(C, "decode_loop_times", lambda lm, reps: (0.1, 0.0))
    monkeypatch.setattr(C, "interleaved_times", fake({n: 0.1 + 0.01 * (n - 1) for n in lengths}))
    c = C._measure(runners, 3, "k")
    assert (c.t_draft, c.t_target, c.t_cand) == pytest.approx((0.03, 0.1, 0.01))
    assert c.verify_s(16) == pytest.approx(0.25) and c.verify_s(20) == pytest.approx(0.29)  # measured, interpolated
    monkeypatch.setattr(C, "interleaved_times", fake({n: 0.2 - 0.001 * n for n in lengths}))
    monkeypatch.setattr(C, "decode_loop_times", lambda lm, reps: (0.2 - 0.001, 0.0))
    c = C._measure(runners, 3, "k")
    assert c.t_cand == 0.0 and c.t_target == pytest.approx(0.2 - 0.005)
    flat = sum(0.2 - 0.001 * n for n in lengths) / len(lengths)  # a falling table, long passes included, pools flat
    assert c.t_verify == pytest.approx([flat] * len(C.VERIFY_LENGTHS)) and c.verify_s(48) == pytest.approx(flat)


def test_monotone_pools_dips_and_keeps_steps():
    """Pool adjacent violators: a dip is averaged with what it undercuts, a rising step is kept."""
    assert CT.monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert CT.monotone([0.150, 0.130, 0.14, 0.19, 0.18]) == pytest.approx([0.14, 0.14, 0.14, 0.185, 0.185])
    assert CT.monotone([3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert CT.monotone([]) == []
    measured = [0.133, 0.120, 0.150, 0.120, 0.127, 0.139, 0.190, 0.175, 0.184]
    out = CT.monotone(measured)
    assert all(a <= b for a, b in zip(out, out[1:])) and sum(out) == pytest.approx(sum(measured))


def test_rounds_interleave_every_cell():
    """Each round feeds the draft step and every length once (a slow spell hits them alike): one
    warm-up round, then `reps` timed ones; one time per cell comes back."""
    fed = []

    class Lm:
        device = torch.device("cpu")
        vocab_size, max_length = 32, None

        def __init__(self, name):
            self.name = name
            self.counters = Counters()

        def reset(self):
            pass

        def rollback(self, n):
            assert n == CT.PREFIX

        def forward(self, ids, n_logits):
            if n_logits:
                fed.append((self.name, len(ids)))

    draft, target = Lm("d"), Lm("t")
    cells = [(draft, 1, False), (target, 1, True), (target, 3, True)]
    out = CT.interleaved_times(cells, reps=2)
    assert fed == [("d", 1), ("t", 1), ("t", 3)] * 3 and len(out) == 3


class _Clock:
    """A fake clock the runner below advances by what each forward costs (costs.timed reads it)."""
    now = 0.0

    @classmethod
    def timed(cls, device=None):
        import contextlib

        @contextlib.contextmanager
        def span():
            t = SimpleNamespace(s=0.0)
            start = cls.now
            yield t
            t.s = cls.now - start
        return span()


class _RebuildingLM:
    """A runner whose forward costs 10 ms where the last call fed as many tokens at the next position (llama.cpp
    reuses its compute graph for a batch of the last one's shape) and 30 ms otherwise (a graph built again)."""

    def __init__(self):
        from tiny import MockLM

        self.lm = MockLM(32, seed=3, max_length=400)
        self.device, self.vocab_size, self.max_length = self.lm.device, 32, 400
        self.counters, self.last = Counters(), None

    @property
    def length(self):
        return self.lm.length

    def reset(self):
        self.lm.reset()
        self.last = None

    def rollback(self, n):
        self.lm.rollback(n)

    def forward(self, ids, n_logits=1):
        shape = (len(ids), n_logits, self.lm.length)
        same = self.last is not None and shape[:2] == self.last[:2] and shape[2] == self.last[2] + self.last[0]
        cost = 0.010 if same else 0.030
        self.last = shape
        _Clock.now += cost
        self.counters.add(cost)
        return self.lm.forward(ids, n_logits)


def test_the_one_row_step_is_timed_in_the_decoders_own_loop_not_as_an_interleaved_cell(monkeypatch):
    """decode_step_time runs the target-alone loop (one step after another, no rollback): a runner that is
    cheaper for a call of the last one's shape reads its cheap step there; the interleaved cell (the broken
    control: the measurement before v6) reads the dear one. _measure prices the one-row pass at the decode's
    step and keeps the cell beside it; the runner is left as it was."""
    monkeypatch.setattr(CT, "timed", _Clock.timed)
    lm = _RebuildingLM()
    lm.counters.restore((2.0, 3, 0.5))
    assert CT.decode_step_time(lm, reps=2) == pytest.approx(0.010)
    assert lm.length == 0 and lm.counters.saved() == (2.0, 3, 0.5)
    cells = [(lm, n, True) for n in (1, 2)]
    assert CT.interleaved_times(cells, reps=2)[0] == pytest.approx(0.030)
    c = C._measure(SimpleNamespace(draft=None, target=lm), 2, "k")
    assert c.t_verify[0] == pytest.approx(0.010) and c.t_step_cell == pytest.approx(0.030)
    assert C.costs_from_json(json.loads(json.dumps(c.to_dict()))).t_step_cell == c.t_step_cell
    # a context too short for the loop's steps is refused with its reason
    short = _RebuildingLM()
    short.max_length = short.lm.max_length = 6
    with pytest.raises(UserError, match="too short to time a step"):
        CT.decode_step_time(short, reps=2)


class _SlowLoopLM(_RebuildingLM):
    """The runner above, with 4 ms a step spent outside its counted forward (the loop's bookkeeping)."""

    def forward(self, ids, n_logits=1):
        _Clock.now += 0.004
        return super().forward(ids, n_logits)


def test_the_loops_own_time_a_row_is_timed_in_the_decoders_loop(monkeypatch):
    """decode_loop_times reads the loop's own time a step as the clock between steps less the counted forward;
    _measure adds what it has beyond the sampling micro-benchmark to every row of both modes (the time model's
    loop_row). Control: a runner spending nothing outside its forward reads none."""
    monkeypatch.setattr(CT, "timed", _Clock.timed)
    monkeypatch.setattr(CT.time, "perf_counter", lambda: _Clock.now)
    step, own = CT.decode_loop_times(_SlowLoopLM(), reps=2)
    assert step == pytest.approx(0.010) and own == pytest.approx(0.004)
    assert CT.decode_loop_times(_RebuildingLM(), reps=2)[1] == pytest.approx(0.0)
    micro = {"greedy": {"row": 0.0005, "round": 0.001}, "sample": {"row": 0.001, "round": 0.002}}
    monkeypatch.setattr(C, "loop_times", lambda vocab, device: micro)
    c = C._measure(SimpleNamespace(draft=None, target=_SlowLoopLM()), 2, "k")
    assert c.loop_s("sample", "row") == pytest.approx(0.004) and c.loop_s("greedy", "row") == pytest.approx(0.0035)
    assert c.loop_s("sample", "round") == pytest.approx(0.002)
    coef = coef_of(c, "table", "sample")
    assert coef["loop_row"] == pytest.approx(0.004)


def test_cache_hit_miss_and_corrupt_file(pair, cache, monkeypatch, capsys):
    first = C.measure_costs(pair, reps=1)
    calls = []

    def measure(p, reps, key):
        calls.append(key)
        return C.Costs(0.01, 0.1, 0.002, key, "now")

    monkeypatch.setattr(C, "_measure", measure)
    assert C.measure_costs(pair) == first and not calls  # hit: nothing timed
    monkeypatch.setattr(pair, "draft_config", {"draft_quant": "int8", "draft_vocab": "full"}, raising=False)
    other = C.measure_costs(pair)  # another draft configuration: another key, measured
    assert calls == [other.key] and other.key != first.key
    assert sorted(p.name for p in cache.iterdir()) == sorted([f"{first.key}.json", f"{other.key}.json"])
    # the same models on other CPU kernels (e.g. cpu_fp16_rows=0): another key
    monkeypatch.setattr(pair.target.model, "cpu_path", {"linear": "onednn-packed", "fp16_rows": []}, raising=False)
    third = C.measure_costs(pair)
    assert calls == [other.key, third.key] and third.key not in (first.key, other.key)
    monkeypatch.delattr(pair.target.model, "cpu_path", raising=False)
    (cache / f"{other.key}.json").write_text("{not json")
    capsys.readouterr()
    again = C.measure_costs(pair)
    assert "unreadable" in capsys.readouterr().err and calls == [other.key, third.key, other.key]
    assert C.costs_from_json(json.loads((cache / f"{other.key}.json").read_text())) == again


def test_no_cache_writes_nothing_and_the_target_alone_is_priced_without_a_draft(pair, cache):
    C.measure_costs(pair, reps=1, cache=False)
    assert not cache.exists()
    tok = make_tokenizer(32)
    alone = C.measure_costs(SpecPair.from_models(make_model(32, 24, seed=2), tok), reps=1, cache=False)
    # n-gram drafting needs only the target's passes: no draft step (t_draft 0), every length timed
    assert alone.t_draft == 0 and alone.t_target > 0 and len(alone.t_verify) == len(C.VERIFY_LENGTHS)


def test_per_length_times_are_kept_and_an_older_cache_is_measured_again(pair, cache, capsys):
    first = C.measure_costs(pair, reps=1)
    assert len(first.t_verify) == len(C.VERIFY_LENGTHS) and all(t > 0 for t in first.t_verify)
    assert first.verify_s(3) == first.t_verify[2]
    assert first.verify_s(12) == pytest.approx(first.t_verify_long[12])  # a long pass: measured too
    assert first.t_verify[-1] <= first.verify_s(10) <= first.verify_s(12) <= first.verify_s(16)
    assert C.Costs(0.01, 0.1, 0.002, "k", "now").verify_s(4) == pytest.approx(0.106)  # no table: the line
    path = cache / f"{first.key}.json"
    d = json.loads(path.read_text())
    assert C.costs_from_json(d) == first
    del d["t_verify"]  # as an older version wrote it
    path.write_text(json.dumps(d))
    capsys.readouterr()
    again = C.measure_costs(pair, reps=1)
    assert "older version" in capsys.readouterr().err and len(again.t_verify) == len(C.VERIFY_LENGTHS)


def test_a_pin_fixes_one_measurement_across_loads_of_the_same_machine(cache, tmp_path, monkeypatch, capsys):
    """measure_costs(pair, pin=path): the first load measures and writes the pin; a second load (a
    resumed sweep) reads it back even where the kernels picked at load differ (the oneDNN padding
    moves with noise, and is in the cache key), and the pair then returns it to every caller. A pin
    from another CPU or draft configuration, or an unreadable one, is measured again, with a warning."""
    tok = make_tokenizer(32)

    def load():
        return SpecPair.from_models(make_model(32, 24, seed=2), tok, make_model(32, 16, seed=1), tok)

    calls = []

    def measure(p, reps, key):
        calls.append(key)
        return C.Costs(0.01 * len(calls), 0.1, 0.002, key, f"measure {len(calls)}", (0.1,) * len(C.VERIFY_LENGTHS))

    monkeypatch.setattr(C, "_measure", measure)
    pin = tmp_path / "sweep" / "costs.json"
    pin.parent.mkdir()
    first_pair = load()
    first = C.measure_costs(first_pair, pin=pin)
    assert calls and json.loads(pin.read_text())["t_draft"] == first.t_draft
    assert C.measure_costs(first_pair) is first  # the pair keeps its pinned measurement

    second_pair = load()  # a resumed sweep: another load, other kernels picked, another cache key
    monkeypatch.setattr(second_pair.target.model, "cpu_path", {"linear": "onednn-packed", "pad_to": [0, 5]},
                        raising=False)
    assert C.config_key(C.cost_config(second_pair)) != first.key
    n = len(calls)
    assert C.measure_costs(second_pair, pin=pin) == first and len(calls) == n  # nothing timed
    assert C.measure_costs(second_pair) == first

    third_pair = load()  # another draft configuration: the pin does not describe it
    monkeypatch.setattr(third_pair, "draft_config", {"draft_quant": "int8", "draft_vocab": "full"}, raising=False)
    capsys.readouterr()
    third = C.measure_costs(third_pair, pin=pin)
    assert "measured with another draft_quant, draft_vocab" in capsys.readouterr().err
    assert third != first and json.loads(pin.read_text())["t_draft"] == third.t_draft  # re-pinned

    pin.write_text("{not json")
    fourth = C.measure_costs(load(), pin=pin)
    assert "unreadable" in capsys.readouterr().err and C.costs_from_json(json.loads(pin.read_text())) == fourth


def test_the_loop_time_and_prefill_rate_are_measured_and_enter_the_prediction(pair, cache):
    c = C.measure_costs(pair, reps=1)
    assert c.t_prefill > 0 and c.t_prefill_draft > 0
    assert set(c.loop) == set(CT.LOOP_SAMPLING) and all(c.loop_s(m, "row") > 0 for m in CT.LOOP_SAMPLING)
    again = C.costs_from_json(json.loads((cache / f"{c.key}.json").read_text()))
    assert again.loop == c.loop and again.t_prefill == c.t_prefill
    from adaptive_spec.decoding.auto import predict_time
    row = {"n_draft_forwards": 6, "n_target_forwards": 3, "n_drafted": 6, "target_pass_hist": {3: 3}}
    bare, looped = predict_time(row, coef_of(c, "table")), predict_time(row, coef_of(c, "table", "sample"))
    # 6 draft rows + 9 verification rows processed, and 3 verifications' fixed part
    want = 15 * c.loop_s("sample", "row") + 3 * c.loop_s("sample", "round")
    assert looped - bare == pytest.approx(want)


def test_costs_are_measured_on_the_threads_the_decode_runs_on(pair, cache, monkeypatch):
    """Every caller (generate, the sweep, the probe, a benchmark) gets the measurement the decode's auto reads:
    it is timed, and keyed, on the engine's decode_torch_threads, and the caller's threads come back after."""
    seen = []

    def measure(p, reps, key):
        seen.append((torch.get_num_threads(), C.cost_config(p)["threads"]))
        return C.Costs(0.01, 0.1, 0.002, key, "now")

    monkeypatch.setattr(C, "_measure", measure)
    before = torch.get_num_threads()
    decode = 1 if before != 1 else 2
    monkeypatch.setattr(pair, "engine", replace(pair.engine, decode_torch_threads=decode))
    C.measure_costs(pair, cache=False)
    assert seen == [(decode, decode)] and torch.get_num_threads() == before
    monkeypatch.setattr(pair, "engine", replace(pair.engine, decode_torch_threads=None))  # None: as they are
    C.measure_costs(pair, cache=False)
    assert seen[-1] == (before, before)
