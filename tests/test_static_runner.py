"""The static-cache runner (adaptive_spec.backends.static_runner) on tiny random models, CPU, eager.

Same numbers as the dynamic-cache CausalLM, stale slots masked after a rollback that copies
nothing, exact speculative decoding through it, no host read inside a forward, and the GPU
benchmark script's CPU smoke run. The compiled path (dynamo tracing, one graph per shape, no
recompile as K varies) is checked by an opt-in test: ADAPTIVE_SPEC_COMPILE_TESTS=1; forward_hidden's compiled
rows step (a few shapes only) always.
"""
import importlib.util
import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from transformers.integrations import sdpa_attention

from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.errors import UserError
from adaptive_spec.heads.head import AcceptanceHead
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.decoding.policies import FixedK
from adaptive_spec.decoding.sampling import SamplingParams
from adaptive_spec.backends.static_runner import DRAFT_SHAPES, FusedCausalLM, StaticCausalLM, make_runner, verify_shapes
from test_fused import (assert_no_host_read_inside_a_step, assert_sampling_matches_dynamic_runner,
                        compiled_decoding_matches, greedy_speculative_against_target)
from test_decoding import L, V, chi_square_pvalue, exact_sequence_probs, sample_counts
from tiny import make_model

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only adds synchronisation
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models():
    return (make_model(32, hidden_size=16, layers=2, seed=1, logit_scale=4.0),
            make_model(32, hidden_size=24, layers=2, seed=2, logit_scale=4.0))


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_same_numbers_as_causal_lm(models):
    model = models[1]
    dyn, st = CausalLM(model), StaticCausalLM(model, max_cache_len=40)
    seq = torch.tensor([5, 9, 4, 17, 8, 6, 11, 12, 20, 3])
    for lm in (dyn, st):
        lm.reset()
        assert lm.forward(seq[:4], n_logits=0)[0].shape == (0, 32)  # prefill: no LM head
    for chunk, n_logits in ((seq[4:9], 5), (seq[9:10], 1)):  # a verify pass, then a draft step
        (a, ha), (b, hb) = dyn.forward(chunk, n_logits), st.forward(chunk, n_logits)
        assert b.dtype == torch.float32 and b.shape == (n_logits, 32)
        close(a, b)
        close(ha, hb)
    assert st.length == dyn.length == 10 and st.counters.n_forwards == 3 and st.counters.seconds > 0
    assert st.max_length == 40


def test_rollback_is_free_and_stale_slots_are_masked(models):
    model = models[1]
    lm = StaticCausalLM(model, max_cache_len=32)
    seq = torch.tensor([5, 9, 4, 17, 8, 6, 11, 12, 20, 7, 7, 7])
    lm.forward(seq[:4], n_logits=0)
    lm.forward(seq[4:12], n_logits=8)  # 8 candidates scored...
    keys = lm.cache.layers[0].keys
    ptr, stale = keys.data_ptr(), keys[..., 6:12, :].clone()
    lm.rollback(6)  # ...2 accepted
    assert lm.length == 6 and int(lm._pos) == 6
    # nothing was copied or cleared: the rejected entries are still in their slots
    assert keys.data_ptr() == ptr and torch.equal(keys[..., 6:12, :], stale)
    x = torch.tensor([25, 3])
    got, h_got = lm.forward(x, n_logits=2)  # overwrites slots 6, 7; slots 8..11 stay stale
    ref, h_ref = CausalLM(model).forward(torch.cat([seq[:6], x]), n_logits=2)
    close(got, ref)
    close(h_got, h_ref)
    lm.rollback(3)  # back past the prompt, then a 1-token step
    got, _ = lm.forward(torch.tensor([30]), n_logits=1)
    ref, _ = CausalLM(model).forward(torch.tensor([5, 9, 4, 30]), n_logits=1)
    close(got, ref)
    lm.reset()  # a new generation reuses the buffers without clearing them
    got, _ = lm.forward(torch.tensor([1, 2]), n_logits=2)
    close(got, CausalLM(model).forward(torch.tensor([1, 2]), n_logits=2)[0])


def test_cache_overflow_is_a_user_error(models):
    lm = StaticCausalLM(models[0], max_cache_len=8)
    lm.forward(torch.arange(6), n_logits=0)
    with pytest.raises(UserError, match="max_cache_len"):
        lm.forward(torch.arange(3), n_logits=1)
    with pytest.raises(UserError):
        StaticCausalLM(models[0], max_cache_len=10_000)  # past max_position_embeddings (128)


def test_make_runner_selects_the_kv_cache(models):
    assert type(make_runner(models[0])) is CausalLM
    lm = make_runner(models[0], kv_cache="static", max_cache_len=16, warmup_shapes=DRAFT_SHAPES)
    assert isinstance(lm, StaticCausalLM) and lm.runtime == "eager" and lm.length == 0 and lm.counters.n_forwards == 0
    with pytest.raises(UserError, match="unknown kv_cache 'vllm'; use one of dynamic, static"):
        make_runner(models[0], kv_cache="vllm")
    with pytest.raises(UserError, match="--kv-cache static"):
        make_runner(models[0], runtime="cudagraph")
    with pytest.raises(UserError, match="CUDA"):
        make_runner(models[0], kv_cache="static", runtime="cudagraph")  # CPU here


def test_forward_reads_nothing_back_to_the_host(models):
    """The step must be capturable as a CUDA graph: no .item() / bool(tensor) inside."""
    assert_no_host_read_inside_a_step(StaticCausalLM, models[0], 16)


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_equals_greedy_target(models, k):
    g, ref = greedy_speculative_against_target(StaticCausalLM, *models, k)
    assert g.token_ids == ref
    assert g.metrics.n_draft_forwards == g.metrics.n_drafted


def test_sampling_matches_dynamic_runner_seed_for_seed(models):
    assert_sampling_matches_dynamic_runner(StaticCausalLM, *models)


def test_the_learned_heads_stop_rule_runs_inside_the_draft_step(models):
    """SpecDec++'s head rides in the draft's forward (forward_with_head, one graph on a GPU): the same tokens
    and the same stop decisions as the head run after the step on the dynamic runner, seed for seed; a head
    loaded again (same shape) is copied into the attached one, so captured graphs keep their addresses."""
    from adaptive_spec.decoding.policies import LearnedThreshold

    draft, target = models
    torch.manual_seed(0)
    head, again = AcceptanceHead(16, depth=1), AcceptanceHead(16, depth=1)
    st_d = StaticCausalLM(draft, max_cache_len=64)
    calls = []
    inner = st_d.forward_with_head
    st_d.forward_with_head = lambda *a, **k: calls.append(1) or inner(*a, **k)
    st, dyn = Decoder(StaticCausalLM(target, max_cache_len=64), st_d), Decoder(CausalLM(target), CausalLM(draft))
    for seed in range(3):
        a = st.generate([5, 9, 4], 25, SamplingParams(1.0), LearnedThreshold(head, 0.4), seed=seed)
        b = dyn.generate([5, 9, 4], 25, SamplingParams(1.0), LearnedThreshold(head, 0.4), seed=seed)
        assert a.token_ids == b.token_ids and a.metrics.accepted_hist == b.metrics.accepted_hist
        assert a.metrics.n_drafted == b.metrics.n_drafted == len(calls) and calls
        calls.clear()
    st.generate([5, 9, 4], 5, GREEDY, LearnedThreshold(again, 0.4))
    assert st_d.head is head and st_d._attached is again  # copied in, not swapped
    close(head.out.weight, again.out.weight)


def test_distribution_is_exact_through_static_runners():
    target = StaticCausalLM(make_model(V, hidden_size=16, layers=1, seed=3, logit_scale=3.0), max_cache_len=16)
    draft = StaticCausalLM(make_model(V, hidden_size=16, layers=1, seed=4, logit_scale=3.0), max_cache_len=16)
    params, prompt, n = SamplingParams(1.0), [1, 2], 1500
    probs = exact_sequence_probs(target, prompt, params)
    assert len(probs) == V ** L
    counts = sample_counts(Decoder(target, draft), prompt, params, FixedK(2), n=n)
    assert chi_square_pvalue(counts, probs, n) > 1e-3


def _load_bench():
    path = Path(__file__).resolve().parents[1] / "eval" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_gpu_cpu_smoke(tmp_path, capsys):
    bench = _load_bench()
    out = tmp_path / "bench"
    rc = bench.main(["--device", "cpu", "--tiny", "--contexts", "8", "--verify-max", "2", "--iters", "1",
                     "--gen-tokens", "4", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "bench_gpu.json").read_text())
    for name in ("tiny-draft", "tiny-target"):
        m = res["models"][name]
        assert "error" not in m, m.get("error")
        row = m["rows"][0]
        assert row["context"] == 8 and row["step_ms"] > 0 and set(row["verify_ms"]) == {"1", "2", "3"}
        assert row["ar_decoder_tok_s"] > 0 and m["hf_generate"]["8"] > 0
    assert "step_head_ms" in res["models"]["tiny-draft"]["rows"][0]
    est = res["estimates"]["tiny"]
    assert {e["policy"] for e in est} == {"fixed:k=2", "fixed:k=4"} and all(e["est_speedup"] > 0 for e in est)
    md = (out / "bench_gpu.md").read_text()
    assert "not a measurement" in md and "CPU smoke run" in md


def test_bench_stats_and_eq_5_1():
    bench = _load_bench()
    import tempfile

    rows = [{"config": "k4", "temperature": 0.0, "n_tokens": 100, "n_target_forwards": 25, "n_discarded": 10,
             "n_draft_forwards": 85},
            {"config": "k4", "temperature": 0.0, "n_tokens": 100, "n_target_forwards": 25, "n_discarded": 10,
             "n_draft_forwards": 85},
            {"config": "ar", "temperature": 0.0, "n_tokens": 100, "n_target_forwards": 100, "n_discarded": 0,
             "n_draft_forwards": 0}]
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "results.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        q = Path(d) / "rates.json"
        q.write_text(json.dumps({"policies": {"learned": {"tokens_per_target_forward": 5.0, "discard_rate": 0.1}}}))
        stats = bench.load_stats([p, q])
    assert set(stats) == {"k4@t=0", "learned"}  # ar is target-only: nothing to model
    s = stats["k4@t=0"]
    assert s["target_per_token"] == 0.25 and s["draft_per_token"] == 0.85 and s["discard_rate"] == 0.1
    assert stats["learned"]["draft_per_token"] == pytest.approx(1 + 0.1 - 0.2)  # Lemma 3.1
    draft = [{"context": 8, "step_ms": 1.0, "step_head_ms": 1.5, "verify_ms": {1: 1.0}}]
    target = [{"context": 8, "step_ms": 4.0, "verify_ms": {1: 4.0, 2: 4.0, 3: 5.0, 4: 6.0, 5: 7.0}}]
    est = {e["policy"]: e for e in bench.estimate(stats, draft, target, None)}
    e = est["k4@t=0"]  # K_mean = 0.85 / 0.25 = 3.4 -> t_target(4.4) = 6.4
    assert e["t_target_ms"] == pytest.approx(6.4)
    assert e["est_ms_per_token"] == pytest.approx(1.0 * 0.85 + 6.4 * 0.25)
    assert e["est_speedup"] == pytest.approx(4.0 / e["est_ms_per_token"])
    assert est["learned"]["t_draft_ms"] == 1.5  # the head rides in the draft step


@pytest.mark.skipif(os.environ.get("ADAPTIVE_SPEC_COMPILE_TESTS") != "1",
                    reason="dynamo tracing takes ~20 s on CPU; set ADAPTIVE_SPEC_COMPILE_TESTS=1")
def test_compiled_path_traces_fullgraph_without_recompiles(models):
    """torch.compile(fullgraph=True, dynamic=False) with the 'eager' backend: traces the step
    without graph breaks, one graph per warmed shape, and K varying 1..4 recompiles nothing."""
    draft, target = models
    compiled_decoding_matches(StaticCausalLM, draft, target)


def count_compiled_calls(lm) -> list:
    """The (n_logits, with_head, epilogue, rows) of every call through `lm`'s compiled step, from now on."""
    calls, inner = [], lm._compiled
    lm._compiled = lambda buf, *args: calls.append(args) or inner(buf, *args)
    return calls


@pytest.mark.parametrize("cls", [StaticCausalLM, FusedCausalLM])
def test_forward_hidden_runs_the_compiled_rows_step_on_warmed_shapes(models, cls):
    """forward_hidden (every fed row's state, for a feature drafter) goes through the compiled step's rows variant
    for the shapes warmed with rows=True, eagerly for any other, and gives the eager runner's numbers exactly,
    with the same length, position and counters. Control: warmed for forward alone, it never reaches the
    compiled step, so the count is what tells a graphed forward_hidden from an eager one."""
    model = models[1]
    plain = cls(model, max_cache_len=32, compile=True, compiler="eager")
    plain.warmup(verify_shapes(2))
    control = count_compiled_calls(plain)
    plain.forward_hidden(torch.tensor([3, 4, 5]), 3)
    assert control == []
    lm, ref = cls(model, max_cache_len=32, compile=True, compiler="eager"), cls(model, max_cache_len=32)
    lm.warmup(verify_shapes(2), rows=True)
    calls = count_compiled_calls(lm)
    feeds = [(torch.arange(5), 0), (torch.tensor([3, 4, 5]), 3), (torch.tensor([7]), 1), (torch.tensor([1, 2]), 2)]
    # transformers' sdpa attention folds a one-row query's grouped heads into the query outside dynamo and repeats
    # the key/value heads inside it: two layouts whose last bits differ on some CPUs' attention kernels. The eager
    # side takes the traced layout, so what is compared is the graph against the same computation run eagerly.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for ids, n_logits in feeds:
            a, rows_a = lm.forward_hidden(ids, n_logits)
            with mock.patch.object(sdpa_attention, "is_torchdynamo_compiling", lambda: True):
                b, rows_b = ref.forward_hidden(ids, n_logits)
            assert torch.equal(a, b) and torch.equal(rows_a, rows_b)
            assert rows_a.shape == (len(ids), model.config.hidden_size)
            assert lm.length == ref.length and int(lm._pos) == int(ref._pos) == lm.length
    assert calls == [(3, False, None, True), (1, False, None, True), (2, False, None, True)]  # the prefill: eager
    assert lm.counters.n_forwards == ref.counters.n_forwards == len(feeds)
    with pytest.raises(UserError, match="max_cache_len"):
        lm.forward_hidden(torch.arange(30), 0)


def test_bench_gpu_interp_never_negative():
    # A noisy middle point (as a 1-iteration CPU smoke run measures) once tipped the linear
    # extrapolation past the table below zero, and the estimate with it.
    interp = _load_bench().interp
    table = {1: 1.7, 2: 12.5, 3: 2.7}
    assert interp(table, 2.0) == 12.5 and abs(interp(table, 1.5) - 7.1) < 1e-9
    assert interp(table, 4.3) >= 2.7 and interp(table, 0.5) >= 0.0
    assert abs(interp({1: 1.0, 2: 2.0}, 4.0) - 4.0) < 1e-9  # a clean line extends as a line
    assert interp({1: 3.0, 2: 2.0}, 5.0) == 2.0  # a falling table does not extrapolate downwards
