"""The llama.cpp backend: the same decoder over GGUF models in llama.cpp, exact like the torch one.

Tiny random Qwen2 models are written to GGUF (tiny.save_gguf) so every check enumerates: the
output distribution of speculative sampling through llama.cpp against the target's exact one,
greedy equality, cache rollback, and the refusals that come before any model loads. The real
pair's greedy check is marked slow. Everything here skips, naming why, only where the binding
(llama-cpp-python, built by `make setup`) is missing; the refusals that come before any model
loads run everywhere.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from adaptive_spec.backends import llamacpp, llamacpp_pair
from adaptive_spec.setup import llama_build
from adaptive_spec.decoding import sampling
from adaptive_spec.decoding.auto import Costs
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.errors import UserError
from adaptive_spec.heads.head import AcceptanceHead
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.decoding.policies import FixedK, LearnedThreshold
from adaptive_spec.decoding.sampling import SamplingParams
import exact
from exact import chi_square_pvalue
from tiny import make_model, save_gguf

MISSING = llamacpp.available()
needs_binding = pytest.mark.skipif(MISSING is not None, reason=f"llama.cpp backend unavailable: {MISSING}")

V, L, N = 5, 3, 3000
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    """{name: (torch model, gguf path)}: a target and a draft far from it (different seeds)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, seed, hidden, vocab in (("target", 3, 16, V), ("draft", 4, 16, V), ("big_target", 2, 24, 32),
                                      ("big_draft", 1, 16, 32)):
        m = make_model(vocab, hidden_size=hidden, layers=1 if vocab == V else 2, seed=seed, logit_scale=3.0)
        out[name] = (m, save_gguf(m, root / f"{name}.gguf"))
    return out


def lm(path, n_ctx=128):
    return llamacpp.LlamaCppLM(path, n_ctx=n_ctx, n_threads=1)


@needs_binding
def test_gguf_logits_match_the_torch_model(tiny_ggufs):
    """The writer and the runner agree with transformers on the same weights, fed in chunks."""
    model, path = tiny_ggufs["big_target"]
    ids = torch.tensor([5, 9, 4, 17, 3, 8, 30, 2])
    ref, _ = CausalLM(model).forward(ids, n_logits=ids.shape[0])
    r = lm(path)
    a, _ = r.forward(ids[:5], n_logits=5)
    b, _ = r.forward(ids[5:], n_logits=3)
    assert r.length == 8 and a.shape == (5, 32) and b.dtype == torch.float32
    torch.testing.assert_close(torch.cat([a, b]), ref, atol=2e-3, rtol=1e-3)


@needs_binding
def test_rollback_then_feed_equals_a_fresh_forward(tiny_ggufs):
    _, path = tiny_ggufs["big_target"]
    r = lm(path)
    r.forward(torch.tensor([5, 9, 4, 17, 3, 8]), n_logits=0)
    r.rollback(3)
    assert r.length == 3
    got, _ = r.forward(torch.tensor([11, 12]), n_logits=2)
    fresh = lm(path)
    want, _ = fresh.forward(torch.tensor([5, 9, 4, 11, 12]), n_logits=2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    r.reset()
    again, _ = r.forward(torch.tensor([5, 9, 4, 11, 12]), n_logits=2)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=0)


@needs_binding
def test_prefill_longer_than_a_batch_is_chunked(tiny_ggufs):
    _, path = tiny_ggufs["big_target"]
    r = llamacpp.LlamaCppLM(path, n_ctx=128, n_threads=1, n_batch=16)
    ids = (torch.arange(40) * 7 + 3) % 32
    chunked, _ = r.forward(ids, n_logits=20)  # the logits rows span two decode calls
    whole, _ = lm(path).forward(ids, n_logits=20)
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=0)


@needs_binding
def test_a_pass_past_the_context_is_refused(tiny_ggufs):
    r = lm(tiny_ggufs["big_target"][1], n_ctx=16)
    with pytest.raises(UserError, match="context of 16"):
        r.forward(torch.arange(17) % 32)


def stats_head(h=16):
    torch.manual_seed(0)
    return AcceptanceHead(h, depth=1, feature="context", inputs="stats")


@needs_binding
@pytest.mark.parametrize("params,policy", [
    (SamplingParams(1.0), lambda: FixedK(2)),
    (SamplingParams(1.0, top_k=3), lambda: FixedK(3)),
    (SamplingParams(1.0), lambda: LearnedThreshold(stats_head(), 0.5, k_max=4)),
    (SamplingParams(0.9, top_k=4), lambda: LearnedThreshold(stats_head(), 0.3, k_max=4)),
], ids=["t1-fixed2", "topk3-fixed3", "t1-learned-stats", "t0.9-topk4-learned-stats"])
def test_distribution_is_exact_on_llama_cpp(tiny_ggufs, params, policy):
    target, draft = lm(tiny_ggufs["target"][1]), lm(tiny_ggufs["draft"][1])
    prompt = [1, 2]
    probs = exact.exact_sequence_probs(target, prompt, params, V, L)
    counts = exact.sample_counts(Decoder(target, draft), prompt, params, policy(), N, L)
    assert chi_square_pvalue(counts, probs, N) > 1e-3


@needs_binding
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_0-pure", "iq4_nl-pure"])
def test_a_requantized_draft_keeps_the_output_exact(tmp_path, monkeypatch, qtype):
    """--draft-quant q4_0 / q8_0 on llama.cpp: the draft's GGUF re-quantized once (cached, a rerun
    reuses the file) changes only the proposals; the output is still exactly the target's."""
    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path / "cache"))
    # 32 wide: the rows fit Q4_0's and Q8_0's 32-value blocks, so the types really change
    src = save_gguf(make_model(V, hidden_size=32, layers=1, seed=4, logit_scale=3.0), tmp_path / "draft.gguf")
    path = llamacpp_pair.requantized_gguf(src, qtype, threads=1)
    assert path.is_file() and qtype in path.name and path.stat().st_size < src.stat().st_size
    mtime = path.stat().st_mtime_ns
    assert llamacpp_pair.requantized_gguf(src, qtype) == path and path.stat().st_mtime_ns == mtime
    target, draft = lm(tiny_ggufs_target(tmp_path)), lm(path)
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact.exact_sequence_probs(target, prompt, params, V, L)
    counts = exact.sample_counts(Decoder(target, draft), prompt, params, FixedK(2), N, L)
    assert chi_square_pvalue(counts, probs, N) > 1e-3


def tiny_ggufs_target(root):
    return save_gguf(make_model(V, hidden_size=16, layers=1, seed=3, logit_scale=3.0), root / "target.gguf")


@needs_binding
@pytest.mark.parametrize("qtype", ["q4_0-pure", "iq4_nl-pure"])
def test_a_requantized_target_is_the_model_the_output_follows(tmp_path, monkeypatch, qtype):
    """--target-quant on llama.cpp: the target re-quantized (every matrix, output included, in one
    type) is another model; speculative output follows that file's distribution exactly, by enumeration."""
    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path / "cache"))
    src = save_gguf(make_model(V, hidden_size=32, layers=1, seed=3, logit_scale=3.0), tmp_path / "target.gguf")
    path = llamacpp_pair.requantized_gguf(src, qtype, threads=1)
    target = lm(path)
    draft = lm(save_gguf(make_model(V, hidden_size=16, layers=1, seed=4, logit_scale=3.0), tmp_path / "d.gguf"))
    params, prompt = SamplingParams(1.0, top_k=4), [1, 2]
    probs = exact.exact_sequence_probs(target, prompt, params, V, L)
    fetched = exact.exact_sequence_probs(lm(src), prompt, params, V, L)
    assert max(abs(probs[c] - fetched[c]) for c in probs) > 1e-4  # the re-quantized target is another model
    counts = exact.sample_counts(Decoder(target, draft), prompt, params, FixedK(2), N, L)
    assert chi_square_pvalue(counts, probs, N) > 1e-3


def reduced(path, keep):
    """A reduced-vocabulary runner of `path` keeping `keep` (--draft-vocab on llama.cpp)."""
    from adaptive_spec.backends.gguf_vocab import reduced_draft_gguf
    out, kept, imap = reduced_draft_gguf(path, keep)
    return out, llamacpp.LlamaCppLM(out, n_ctx=128, n_threads=1, kept_ids=kept, input_map=imap)


@needs_binding
def test_a_reduced_vocabulary_draft_keeps_its_rows(tiny_ggufs, tmp_path, monkeypatch):
    """The draft GGUF cut to the kept rows (embedding and output) gives the full file's logits on every
    kept id and -inf elsewhere; a dropped input id reads the first kept row (no token text to go by);
    the file is made once and reused."""
    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path))
    src = tiny_ggufs["big_draft"][1]
    keep = [0, 2, 3, 5, 8, 9, 13, 17, 20, 21, 30, 31]
    path, r = reduced(src, keep)
    assert r.n_vocab == len(keep) and r.vocab_size == 32 and path.stat().st_size < src.stat().st_size
    full = lm(src)
    ids = torch.tensor([2, 9, 17, 30, 5])
    a, _ = r.forward(ids, n_logits=5)
    b, _ = full.forward(ids, n_logits=5)
    dropped = torch.ones(32, dtype=torch.bool)
    dropped[keep] = False
    assert torch.isinf(a[:, dropped]).all() and (a[:, dropped] < 0).all()
    torch.testing.assert_close(a[:, keep], b[:, keep], atol=1e-4, rtol=1e-4)
    c, _ = r.forward(torch.tensor([7]))  # 7 was dropped: it reads row 0, token 0
    d, _ = full.forward(torch.tensor([0]))
    torch.testing.assert_close(c[0, keep], d[0, keep], atol=1e-4, rtol=1e-4)
    mtime = path.stat().st_mtime_ns
    import gguf

    def no_reading(*a):
        raise AssertionError("the cached file was read again")

    monkeypatch.setattr(gguf, "GGUFReader", no_reading)  # a load that finds the file opens no reader
    assert reduced(src, keep)[0] == path and path.stat().st_mtime_ns == mtime
    assert r.fresh().forward(ids, n_logits=5)[0].allclose(a)


def test_a_dropped_token_reads_its_longest_kept_prefix():
    from adaptive_spec.backends.gguf_vocab import complete_keep, input_map
    tokens = ["a", "ab", "abc", "b", "<|end|>", "xyz"]
    kept = complete_keep([0, 3], tokens, [1, 1, 1, 1, 3, 1], len(tokens))
    assert kept.tolist() == [0, 3, 4]  # the control token is always kept (llama.cpp looks it up at load)
    m = input_map(kept, len(tokens), tokens)
    assert m.tolist() == [0, 0, 0, 1, 2, 0]  # ab, abc -> a; xyz has no kept prefix -> the first kept row


@needs_binding
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(1.0, top_k=3)], ids=["t1", "topk3"])
def test_a_reduced_vocabulary_draft_keeps_the_output_exact(tiny_ggufs, tmp_path, monkeypatch, params):
    """q is zero on the dropped ids (2 of 5 here, a dropped input reading another row): the output is
    still exactly the target's, by enumeration."""
    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path))
    target = lm(tiny_ggufs["target"][1])
    _, draft = reduced(tiny_ggufs["draft"][1], [0, 2, 4])
    prompt = [1, 2]
    probs = exact.exact_sequence_probs(target, prompt, params, V, L)
    counts = exact.sample_counts(Decoder(target, draft), prompt, params, FixedK(2), N, L)
    assert chi_square_pvalue(counts, probs, N) > 1e-3
    assert any(c[0] in (1, 3) for c in counts)  # the dropped tokens are still emitted


@needs_binding
def test_greedy_with_a_reduced_vocabulary_draft_equals_greedy_target(tiny_ggufs, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path))
    target = lm(tiny_ggufs["big_target"][1])
    _, draft = reduced(tiny_ggufs["big_draft"][1], list(range(0, 32, 2)))
    prompt = [5, 9, 4, 17]
    ref = Decoder(target, None).generate(prompt, max_new_tokens=40, sampling=GREEDY).token_ids
    for k in (1, 3):
        g = Decoder(target, draft).generate(prompt, max_new_tokens=40, sampling=GREEDY, policy=FixedK(k))
        assert g.token_ids == ref


def test_an_unknown_gguf_quantization_is_refused():
    with pytest.raises(UserError, match="unknown GGUF quantization 'int8'; use one of q4_0, q8_0, q4_0-pure"):
        llamacpp_pair.requantized_gguf("any.gguf", "int8")


def test_gguf_quantizations_are_the_settings_names():
    """One table of names (backends/quant_names.py): what llama.cpp makes, what its record offers, what the
    settings type."""
    from typing import get_args

    from adaptive_spec import params
    from adaptive_spec.backends import engines, quant_names

    assert llamacpp_pair.GGUF_QUANTS is quant_names.GGUF_QUANTS
    assert engines.get("llama.cpp").target_quants == ("none", *quant_names.GGUF_QUANTS)
    for role in ("draft", "target"):
        assert get_args(params.PairParams.model_fields[f"{role}_quant"].annotation) == engines.quant_names(role)


@needs_binding
def test_the_check_fails_on_a_wrong_residual_through_llama_cpp(tiny_ggufs, monkeypatch):
    target, draft = lm(tiny_ggufs["target"][1]), lm(tiny_ggufs["draft"][1])
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact.exact_sequence_probs(target, prompt, params, V, L)
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    counts = exact.sample_counts(Decoder(target, draft), prompt, params, FixedK(2), N, L)
    assert chi_square_pvalue(counts, probs, N) < 1e-3


@needs_binding
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculative_equals_greedy_target(tiny_ggufs, k):
    target, draft = lm(tiny_ggufs["big_target"][1]), lm(tiny_ggufs["big_draft"][1])
    dec = Decoder(target, draft)
    prompt = [5, 9, 4, 17]
    ref = dec.generate(prompt, max_new_tokens=40, sampling=GREEDY).token_ids
    for policy in (FixedK(k), LearnedThreshold(stats_head(), 0.4, k_max=k + 1)):
        g = dec.generate(prompt, max_new_tokens=40, sampling=GREEDY, policy=policy)
        assert g.token_ids == ref
        assert g.metrics.n_drafted == g.metrics.n_accepted + g.metrics.n_discarded


@needs_binding
def test_same_seed_same_tokens_after_other_work(tiny_ggufs):
    """Caches are rolled back exactly: a generation repeated with its seed after others matches."""
    target, draft = lm(tiny_ggufs["big_target"][1]), lm(tiny_ggufs["big_draft"][1])
    dec = Decoder(target, draft)
    first = dec.generate([5, 9, 4], max_new_tokens=30, sampling=SamplingParams(1.0), policy=FixedK(3), seed=7)
    dec.generate([1, 2, 3, 4, 5, 6], max_new_tokens=50, sampling=SamplingParams(1.0), policy=FixedK(5), seed=1)
    again = dec.generate([5, 9, 4], max_new_tokens=30, sampling=SamplingParams(1.0), policy=FixedK(3), seed=7)
    assert again.token_ids == first.token_ids


@needs_binding
def test_tokenizer_mismatch_is_refused_before_loading(tmp_path):
    a = save_gguf(make_model(8, seed=1), tmp_path / "a.gguf", tokens=[f"t{i}" for i in range(8)])
    b = save_gguf(make_model(8, seed=2), tmp_path / "b.gguf", tokens=[f"t{i}" for i in range(7)] + ["other"])
    c = save_gguf(make_model(8, seed=3), tmp_path / "c.gguf", tokens=[f"t{i}" for i in range(8)])
    llamacpp_pair.check_gguf_pair(a, c)  # same strings: fine
    with pytest.raises(UserError, match="tokenizer .* differs"):
        llamacpp_pair.check_gguf_pair(a, b)


@needs_binding
def test_a_corrupt_gguf_is_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(UserError, match="not a readable GGUF"):
        llamacpp_pair.gguf_tokens_digest(bad)
    with pytest.raises(UserError, match="could not load"):
        llamacpp.LlamaCppLM(bad)


# ------------------------------------------------------------------------------ the CLI's refusals

def cli(argv, capsys):
    from adaptive_spec.cli import main

    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


@pytest.mark.parametrize("extra,needle", [
    (["--policy", "tree"], "does not run on the llama.cpp backend"),
    (["--policy", "spectr", "--k", "2"], "does not run on the llama.cpp backend"),
    (["--policy", "fixed", "--draft-quant", "int8"], "draft_quant='int8' does not run on the llama.cpp backend; it "
     "takes none, q4_0, q8_0"),
    (["--policy", "fixed", "--dtype", "bf16", "--kv-cache", "static"], "dtype='bf16' (--dtype), kv_cache='static' (--kv-cache): the llama.cpp backend (the GGUF files as they are, "
         "through llama-cpp-python; CPU) reads no such settings; drop them or use --backend torch"),
    (["--policy", "learned", "--threshold", "0.3", "--head", "checkpoints/qwen-coder-0.5b-int8-hidden-d3"],
     "it needs the draft's hidden states"),
    (["--policy", "fixed", "--n-ctx", "0"], "--n-ctx must be an integer >= 1"),
    (["--policy", "fixed", "--draft", "none"], "--policy fixed drafts with a draft model, but --draft is none"),
    (["--policy", "ngram", "--target-quant", "int8"], "invalid choice: 'int8' (choose from 'none', 'q4_0'"),
    (["--policy", "ngram", "--ngram-min", "5"], "--ngram-min (5) must not exceed --ngram-max (4)"),
    (["--policy", "ngram", "--threshold", "0.3"], "read by the ngram policy only with --fallback learned"),
])
def test_cli_refuses_before_any_model_loads(capsys, monkeypatch, extra, needle):
    import adaptive_spec.decoding.pipeline as pipeline

    monkeypatch.setattr(pipeline.SpecPair, "load", classmethod(lambda *a, **k: pytest.fail("a model was loaded")))
    rc, err = cli(["generate", "--prompt", "hi", "--backend", "llama.cpp", *extra], capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


def test_cli_names_the_install_command_without_the_binding(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    rc, err = cli(["generate", "--prompt", "hi", "--backend", "llama.cpp", "--policy", "fixed"], capsys)
    assert rc == 2 and len(err) == 1 and "llama_build install" in err[0] and "make setup" in err[0]


def test_target_quant_is_refused_on_torch(capsys):
    rc, err = cli(["generate", "--prompt", "hi", "--target-quant", "q4_0-pure"], capsys)
    assert rc == 2 and "target_quant='q4_0-pure' does not run on the torch backend; it takes none" in err[0]


def test_torch_only_n_ctx_is_refused(capsys):
    rc, err = cli(["generate", "--prompt", "hi", "--n-ctx", "512"], capsys)
    assert rc == 2 and "n_ctx=512 (--n-ctx): the torch backend (Hugging Face weights" in err[0] and "use --backend llama.cpp" in err[0]


# ------------------------------------------------------------------------------ the real pair

@needs_binding
@pytest.mark.slow
@pytest.mark.parametrize("files", [{}, {"target_quant": "iq4_nl-pure", "draft_quant": "q4_0-pure", "draft_vocab": "32768"}],
                         ids=["fetched", "iq4_nl-target-reduced-draft"])
def test_real_pair_greedy_speculative_equals_greedy_target(files):
    """On the default pair's GGUFs (as fetched, and the cheapest files measured: a re-quantized target and a
    re-quantized draft with a reduced vocabulary): greedy speculative output is the greedy target output, or
    differs first where the target's top two logits nearly tie (a K + 1-row pass and a one-row
    step round differently); every such mismatch is counted and must be rare."""
    from adaptive_spec.decoding.pipeline import SpecPair

    torch.set_num_threads(2)
    pair = SpecPair.load(backend="llama.cpp", threads=2, **files)
    # the n-gram policy with a fallback prices its rounds with the measured costs; measuring them (passes of up
    # to 48 rows) took minutes of the suite on an AVX2 CPU, and the output is the target's whatever a round takes
    pair.pinned_costs = LLAMA_CPP_COSTS
    prompts = ["Write a Python function that checks whether a number is prime.",
               "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May?",
               "Add type hints to this function and reply with the whole function:\n\ndef mean(numbers):\n"
               "    total = 0\n    for x in numbers:\n        total += x\n    return total / len(numbers)\n"]
    head = "checkpoints/qwen-coder-0.5b-int8-stats-d3"
    policies = [("fixed", {"k": 3}), ("learned", {"head": head, "threshold": 0.3}),
                ("ngram", {"fallback": "learned", "head": head, "threshold": 0.3})]
    if not files:  # prompt lookup alone runs the target only: once, on the fetched files
        policies.append(("ngram", {"k": 3}))
    mismatches, runs = [], 0
    for text in prompts:
        ids = pair.encode(text, chat=True)
        ref = pair.generate(ids, policy="ar", temperature=0, max_new_tokens=48).token_ids
        for policy, kw in policies:
            out = pair.generate(ids, policy=policy, temperature=0, max_new_tokens=48, **kw).token_ids
            runs += 1
            if out == ref:
                continue
            j = next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)
            fresh = pair.target.fresh()
            logits, _ = fresh.forward(torch.tensor(ids + ref[:j]), n_logits=1)
            top2 = logits[0].topk(2).values
            mismatches.append((policy, j, float(top2[0] - top2[1])))
    print(f"greedy llama.cpp: {len(mismatches)} of {runs} runs differ from the target alone: {mismatches}")
    assert all(gap < 0.1 for _, _, gap in mismatches), mismatches
    assert len(mismatches) <= runs // 2


# a 2-core CPU's llama.cpp costs, fixed: a 4-row pass 2.8 one-row steps, a draft step 0.88 of one
LLAMA_CPP_COSTS = Costs(0.18, 0.2, 0.0, "fixed", "tests", tuple(0.2 * v for v in (1, 1.5, 2.0, 2.8, 3.0, 3.2, 3.4, 3.6,
                                                                                  3.8)),
                        t_verify_long={n: 0.2 * v for n, v in ((12, 5.0), (16, 8.0), (24, 11.0), (32, 14.0), (48, 20.0))})


AVX2_ONLY = frozenset("sse4_2 avx f16c fma avx2 bmi2".split())
AVX512_XEON = AVX2_ONLY | frozenset("avx512f avx512cd avx512vl avx512dq avx512bw avx512_vnni".split())
AMX_XEON = AVX512_XEON | frozenset("avx512vbmi avx512_bf16 amx_tile amx_int8 amx_bf16".split())


def test_build_flags_follow_the_cpu_and_never_turn_amx_on():
    """The three kinds of CPU here get three builds; none is -march=native or uses AMX, and an
    AVX-512 extension is never on without AVX-512 itself."""
    if not llama_build.x86():
        pytest.skip("x86 instruction sets: this machine is not x86-64")
    builds = {name: llama_build.cmake_args(f) for name, f in
              (("avx2", AVX2_ONLY), ("avx512", AVX512_XEON), ("amx", AMX_XEON))}
    for args in builds.values():
        assert "-DGGML_NATIVE=OFF" in args and "-march=native" not in args
        assert all(f"-DGGML_{a}=OFF" in args for a in ("AMX_TILE", "AMX_INT8", "AMX_BF16"))
    assert "-DGGML_AVX2=ON" in builds["avx2"] and "-DGGML_AVX512=OFF" in builds["avx2"]
    assert "-DGGML_AVX512=ON" in builds["avx512"] and "-DGGML_AVX512_VNNI=ON" in builds["avx512"]
    assert "-DGGML_AVX512_BF16=OFF" in builds["avx512"] and "-DGGML_AVX512_BF16=ON" in builds["amx"]
    # VNNI without the AVX-512 foundation (a CPU that reports only some of its subsets) stays off
    assert "-DGGML_AVX512_VNNI=OFF" in llama_build.cmake_args(AVX2_ONLY | {"avx512_vnni"})
    tiers = {llama_build.tier(f) for f in (AVX2_ONLY, AVX512_XEON, AMX_XEON)}
    assert tiers == {"avx2", "avx2-avx512-vnni", "avx2-avx512-vbmi-vnni-bf16"}


def test_a_build_for_missing_instructions_is_named():
    """llama.cpp's system info lists what its library was compiled for; a CPU lacking one is told
    which, so a .venv carried to an AVX2 machine is refused instead of dying with SIGILL."""
    if not llama_build.x86():
        pytest.skip("x86 instruction sets: this machine is not x86-64")
    info = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | " \
           "AVX512_VNNI = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |"
    assert llama_build.missing_instructions(info, AVX512_XEON | {"pni", "ssse3"}) == []
    assert llama_build.missing_instructions(info, AVX2_ONLY | {"pni", "ssse3"}) == ["AVX512", "AVX512_VNNI"]


def test_makefile_installs_through_the_build_module():
    """`make setup` and the install hint in every error go through the same module."""
    make = (Path(__file__).parent.parent / "Makefile").read_text()
    assert "llama_build.py install" in make and f"llama-cpp-python-{llama_build.VERSION}-" in make
    assert "llama_build" in llamacpp.INSTALL_HINT and "CMAKE_ARGS" not in make.split("LLAMA_TIER")[0]


@needs_binding
def test_the_installed_binding_runs_on_this_cpu():
    """The library imported here was built for instructions this CPU has (what _init checks)."""
    ll = llamacpp.import_llama_cpp()
    llamacpp.init_library(ll)
    assert llama_build.missing_instructions(ll.llama_print_system_info().decode()) == []


# ------------------------------------------------------------------------------ a sweep on llama.cpp

def gguf_folder(tiny_ggufs, tmp_path) -> Path:
    """<tmp>/gguf/{target,draft}/: the 32-token models as Hugging Face folders with a tokenizer, and
    their GGUF file beside (llama.cpp pairs read the tokenizer from there)."""
    from tiny import make_tokenizer

    folder = tmp_path / "gguf"
    folder.mkdir()
    for role, name in (("target", "big_target"), ("draft", "big_draft")):
        model, path = tiny_ggufs[name]
        sub = folder / role
        model.save_pretrained(sub)
        make_tokenizer(32).save_pretrained(sub)
        (sub / f"{role}.gguf").write_bytes(path.read_bytes())
    return folder


@needs_binding
def test_torch_runs_on_one_thread_while_llama_cpp_decodes(tiny_ggufs, tmp_path):
    """torch only samples on a llama.cpp pair; its thread pool is kept off llama.cpp's cores during a
    generation (the engine record's decode_torch_threads) and given back after, even when the generation fails."""
    from adaptive_spec.decoding import pipeline

    folder = gguf_folder(tiny_ggufs, tmp_path)
    pair = pipeline.SpecPair.load(backend="llama.cpp", target=str(folder / "target" / "target.gguf"),
                                  draft=str(folder / "draft" / "draft.gguf"), threads=2)
    seen, forward = [], pair.target.forward

    def watched(*a, **k):
        seen.append(torch.get_num_threads())
        return forward(*a, **k)

    pair.target.forward = watched
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pair.generate([1, 2, 3], policy="fixed", k=2, max_new_tokens=6)
        assert seen and set(seen) == {pair.engine.decode_torch_threads} == {1} and torch.get_num_threads() == 2
        with pytest.raises(UserError):
            pair.generate([], policy="ar", max_new_tokens=4)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@needs_binding
def test_sweep_and_report_side_by_side_on_both_engines(tiny_ggufs, tmp_path, capsys):
    """`backend: llama.cpp` in a sweep config runs the same grid on GGUF files (tokenizer from the folder
    beside them), and the report tables it beside the torch sweep (`make run`'s path); a statistics
    head runs there, and the torch-only keys are refused before any model loads."""
    from adaptive_spec.evaluation import report
    from adaptive_spec.evaluation import sweep

    folder = gguf_folder(tiny_ggufs, tmp_path)
    head = tmp_path / "head"
    stats_head(16).save_pretrained(head)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("abc def", "ghi jkl mno", "pqr")))
    outs = {}
    for backend in ("torch", "llama.cpp"):
        t, d = ((folder / "target", folder / "draft") if backend == "torch"
                else (folder / "target" / "target.gguf", folder / "draft" / "draft.gguf"))
        outs[backend] = tmp_path / backend
        argv = [f"pair.backend={backend}", f"pair.target={t}", f"pair.draft={d}", f"datasets=[{prompts}]",
                "n_prompts=2", "max_new_tokens=10", "ks=[2]", f"heads=[{head}]", "thresholds=[0.5]", "confidence_taus=[0.4]",
                "hf_assisted=false", "include_draft_ar=false", f"out_dir={outs[backend]}", "progress=false",
                "pair.threads=1", "pair.dtype=" + ("fp32" if backend == "torch" else "auto")]
        assert sweep.main(argv) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (outs["llama.cpp"] / "results.jsonl").read_text().splitlines()]
    configs = {r["config"] for r in rows}
    learned = {c for c in configs if c.startswith("learned:") and c.endswith(":h=0.5")}
    assert len(learned) == 1 and configs - learned == {"ar", "fixed:k=2", "confidence:tau=0.4"}, configs
    assert all(r["paths"]["target"]["engine"] == "llama.cpp" for r in rows)
    assert report.main(["--sweep-dir", str(outs["torch"]), "--beside", str(outs["llama.cpp"])]) == 0
    md = (outs["torch"] / "report.md").read_text()
    section = md.split("## Engines side by side")[1].split("\n## ")[0]
    assert "| torch | ar |" in section and "| llama.cpp | fixed:k=2 |" in section
    assert sweep.main([*argv[:1], "hf_assisted=true", f"out_dir={tmp_path / 'x'}"]) == 2
    assert "which the llama.cpp backend does not give; set it off for pair.backend llama.cpp" in capsys.readouterr().err
