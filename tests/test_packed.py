"""The CPU pre-packed linear layers (packed.PackedLinear) change kernels, never results.

Every test runs in fp32 (oneDNN packs fp32 on any x86 CPU: the AVX2 path) and in bf16, which
skips where oneDNN has no packed bf16 kernel, naming the missing CPU feature.
"""
import pytest
import torch

from adaptive_spec.backends.cpu.machine import auto_dtype, describe, fbgemm_fp16, onednn_packed
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.errors import UserError
from adaptive_spec.backends.models import load_model
from adaptive_spec.backends.cpu.packed import PackedLinear, choose_padding, pack_cpu_linears
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.decoding.policies import FixedK
from adaptive_spec.decoding.sampling import SamplingParams
from exact import chi_square_pvalue, exact_sequence_probs, sample_counts
from tiny import make_model


def _param(dtype):
    why = onednn_packed(dtype)
    return pytest.param(dtype, id=str(dtype).removeprefix("torch."),
                        marks=pytest.mark.skipif(why is not None, reason=f"oneDNN packed {dtype} unavailable "
                                                 f"on this CPU: {why}"))


DTYPES = [_param(torch.float32), _param(torch.bfloat16)]
V, L = 5, 3


def packed_model(seed, dtype, vocab=16, pad_to=(0, 4, 4, 4, 4), **kw):
    """A tiny model with packed linears; pad_to forces the row padding on (on tiny layers the
    measured choice is usually none) so that the padded path is what gets tested."""
    m = make_model(vocab, hidden_size=32, layers=2, seed=seed, logit_scale=3.0, **kw).to(dtype)
    assert pack_cpu_linears(m) == 2 * 7 + 1  # q,k,v,o,gate,up,down per layer + lm_head
    for x in m.modules():
        if isinstance(x, PackedLinear):
            x.pad_to = pad_to
    return m


def _tol(dtype):
    return dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("release", [False, True], ids=["kept", "released"])
@pytest.mark.parametrize("pad_to", [(), (0, 6, 6, 6, 6, 6)], ids=["unpadded", "padded"])
@pytest.mark.parametrize("shape", [(32,), (1, 32), (5, 32), (1, 1, 32), (1, 3, 32), (3, 7, 32)])
def test_packed_linear_matches_stock_linear(shape, pad_to, release, dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 48, bias=True).to(dtype)
    x = torch.randn(shape, dtype=dtype)
    with torch.inference_mode():
        ref = lin(x)
        got = PackedLinear(lin, pad_to, release=release)(x)
    assert got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_uses_stock_path(dtype):
    lin = PackedLinear(torch.nn.Linear(8, 4).to(dtype))
    x = torch.randn(2, 8, dtype=dtype, requires_grad=True)
    lin(x).float().sum().backward()  # the packed op has no backward; the stock path must run
    assert x.grad is not None and lin.weight.grad is not None


def test_release_keeps_tied_weights_and_frees_the_rest():
    m = make_model(16, hidden_size=32, layers=1, seed=0)
    emb = m.get_input_embeddings().weight
    m.get_output_embeddings().weight = emb  # tied, as in Qwen2.5-Coder 0.5B and 1.5B
    assert pack_cpu_linears(m, release=True) == 7 + 1
    head = m.get_output_embeddings()
    assert head.weight is emb and not head.released  # the embedding still reads its table
    released = [x for x in m.modules() if isinstance(x, PackedLinear) and x.released]
    assert len(released) == 7 and all(x.weight.numel() == 0 for x in released)


def test_stock_path_recorded_when_packing_is_off(monkeypatch):
    m = make_model(16, hidden_size=32, layers=1, seed=0)
    assert pack_cpu_linears(m, pack=False) == 0
    assert m.cpu_path == {"dtype": "float32", "linear": "stock", "pad_to": (), "why_stock": "cpu_stock=True"}


def test_padding_choice(monkeypatch):
    lins = [PackedLinear(torch.nn.Linear(64, 256)) for _ in range(3)]
    pad_to = choose_padding(lins, max_rows=4)  # measured: none, or rows r >= M for each M
    assert pad_to == () or (len(pad_to) == 5 and all(r >= m for m, r in enumerate(pad_to)))
    assert choose_padding(lins, rows=4) == (0, 4, 4, 4, 4)  # PairParams.cpu_pad_rows
    assert choose_padding(lins, rows=0) == ()


@pytest.mark.parametrize("key", ["cpu_pad_rows", "cpu_fp16_rows"])
def test_kernel_settings_are_typed_and_checked_before_loading(key):
    """The kernel switches are pair settings (once environment variables): refused when malformed, before
    torch or any weights, and handed to load_model as pack_cpu_linears' keywords."""
    from adaptive_spec.params import pair_params
    assert pair_params(**{key: "4"}).cpu_kernels()[key.removeprefix("cpu_")] == 4
    assert pair_params().cpu_kernels() == {"pack": True, "pad_rows": None, "fp16_rows": None}
    assert pair_params(cpu_stock=True).cpu_kernels()["pack"] is False
    for bad in ("six", -1):
        with pytest.raises(UserError, match=key):
            pair_params(**{key: bad})
    with pytest.raises(UserError, match=f"{key}.*llama.cpp backend"):
        pair_params(backend="llama.cpp", **{key: 4})


def test_kernel_choices_are_timed_once_per_cpu_and_shape(monkeypatch, tmp_path):
    """A sweep's rows run the same kernels: the second load reads the first one's choice from the cache
    instead of timing again (which gave one report six different pad_to values); other shapes time anew."""
    import adaptive_spec.backends.cpu.packed as packed

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path))
    lins = [PackedLinear(torch.nn.Linear(64, 256)) for _ in range(3)]
    first = choose_padding(lins, max_rows=4)
    assert len(list((tmp_path / "kernels").glob("pad_to-*.json"))) == 1

    def no_timing(*a):
        raise AssertionError("timed again")

    monkeypatch.setattr(packed, "_time_padding", no_timing)
    assert choose_padding(lins, max_rows=4) == first
    with pytest.raises(AssertionError, match="timed again"):  # another shape is another key
        choose_padding([PackedLinear(torch.nn.Linear(32, 128))], max_rows=4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_model_logits_match_unpacked(dtype):
    ref = make_model(16, hidden_size=32, layers=2, seed=5, logit_scale=3.0).to(dtype)
    packed = packed_model(5, dtype)
    ids = torch.tensor([[1, 4, 7, 2, 9]])
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits.float(), ref(ids).logits.float(),
                                   **(_tol(dtype) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)))


def path_model(seed, path, monkeypatch, vocab=16):
    """A tiny packed model on one of the CPU paths: a dtype (oneDNN), or "fp16" (oneDNN fp32 with
    the FBGEMM fp16 copies forced on for every verification-sized input)."""
    return fp16_model(seed, monkeypatch, vocab=vocab) if path == "fp16" else packed_model(seed, path, vocab=vocab)


NEEDS_FP16 = pytest.mark.skipif(fbgemm_fp16() is not None, reason=f"FBGEMM fp16 linear unavailable: {fbgemm_fp16()}")
PATHS = DTYPES + [pytest.param("fp16", id="fp32+fp16", marks=NEEDS_FP16)]


@pytest.mark.parametrize("path", PATHS)
def test_greedy_speculative_equals_greedy_target_with_packed_models(path, monkeypatch):
    target, draft = CausalLM(path_model(6, path, monkeypatch)), CausalLM(path_model(7, path, monkeypatch))
    params = SamplingParams(0.0)
    ar = Decoder(target).generate([1, 2, 3], 24, params).token_ids
    for k in (1, 3):
        assert Decoder(target, draft).generate([1, 2, 3], 24, params, FixedK(k)).token_ids == ar


@pytest.mark.parametrize("path", PATHS)
def test_distribution_is_exact_with_packed_models(path, monkeypatch):
    target, draft = CausalLM(path_model(8, path, monkeypatch, V)), CausalLM(path_model(9, path, monkeypatch, V))
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params, V, L)
    counts = sample_counts(Decoder(target, draft), prompt, params, FixedK(2), 1500, L)
    assert chi_square_pvalue(counts, probs, 1500) > 1e-3


def test_auto_dtype_follows_the_cpu(tiny_pair):
    """dtype "auto" loads bf16 where bf16 kernels exist and fp32 where they do not (AVX2), and the
    model is packed either way; the chosen path is recorded."""
    _, target = tiny_pair
    m, _ = load_model(str(target), "target", "auto", "cpu")
    want = auto_dtype("cpu")
    assert want == (torch.bfloat16 if onednn_packed(torch.bfloat16) is None else torch.float32)
    assert next(m.parameters()).dtype == want
    assert m.cpu_path["linear"] == "onednn-packed" and m.cpu_path["dtype"] == str(want).removeprefix("torch.")
    assert set(describe()) >= {"cpu", "isa", "cpu_flags", "bf16_kernels"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_load_model_packs_on_cpu(tiny_pair, monkeypatch, dtype):
    _, target = tiny_pair
    m, _ = load_model(str(target), "target", dtype, "cpu")
    assert any(isinstance(x, PackedLinear) for x in m.modules())
    m, _ = load_model(str(target), "target", dtype, "cpu", pack=False)
    assert not any(isinstance(x, PackedLinear) for x in m.modules())


def test_forced_stock_bf16_path_still_exact_on_any_cpu(monkeypatch):
    """The fallback a user gets with --dtype bf16 on an AVX2 CPU (stock kernels, no packing)
    keeps greedy speculative output equal to greedy target output."""
    models = [make_model(16, hidden_size=32, layers=2, seed=s, logit_scale=3.0).to(torch.bfloat16) for s in (6, 7)]
    assert all(pack_cpu_linears(m, pack=False) == 0 for m in models)
    target, draft = CausalLM(models[0]), CausalLM(models[1])
    params = SamplingParams(0.0)
    ar = Decoder(target).generate([1, 2, 3], 24, params).token_ids
    assert Decoder(target, draft).generate([1, 2, 3], 24, params, FixedK(3)).token_ids == ar


# --- the FBGEMM fp16 copy for short inputs (fp32 models on CPUs without bf16 kernels) ---

def fp16_model(seed, monkeypatch, rows=16, vocab=16):
    """A tiny fp32 model whose weights fp16 holds exactly (as it holds the default pair's bf16
    ones; a tiny random model's weights go below fp16's normal range, so round them), packed with the fp16 copy forced on for inputs of up to `rows` rows."""
    m = make_model(vocab, hidden_size=32, layers=2, seed=seed, logit_scale=3.0).half().float()
    assert pack_cpu_linears(m, release=True, fp16_rows=rows) == 2 * 7 + 1
    return m


@NEEDS_FP16
@pytest.mark.parametrize("shape", [(32,), (1, 32), (5, 32), (3, 7, 32)])
def test_fp16_copy_matches_stock_linear(shape, monkeypatch):
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.half().float())
    x = torch.randn(shape)
    with torch.inference_mode():
        ref = lin(x)
        pl = PackedLinear(lin, release=True)
        pl.add_fp16(lin.weight)
        pl.fp16_rows = frozenset(range(1, 22))
        got = pl(x)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@NEEDS_FP16
def test_fp16_path_chosen_recorded_and_refused_for_inexact_weights(monkeypatch):
    m = fp16_model(0, monkeypatch, rows=4)
    assert m.cpu_path["linear"] == "onednn-packed + fbgemm-fp16" and m.cpu_path["fp16_rows"] == [1, 2, 3, 4]
    lins = [x for x in m.modules() if isinstance(x, PackedLinear)]
    assert all(x.fp16 is not None and x.fp16_rows == frozenset({1, 2, 3, 4}) for x in lins)
    assert all(x.step_bytes == x.weight_bytes // 2 for x in lins)
    # random fp32 weights are not all fp16 values: the model keeps oneDNN alone, and says why
    m = make_model(16, hidden_size=32, layers=1, seed=0)
    pack_cpu_linears(m)
    assert m.cpu_path["linear"] == "onednn-packed" and "not exactly representable" in m.cpu_path["why_no_fp16"]
    assert all(x.fp16 is None for x in m.modules() if isinstance(x, PackedLinear))
    # nor for batched work (datagen), nor when switched off
    m = make_model(16, hidden_size=32, layers=1, seed=0).half().float()
    pack_cpu_linears(m, fp16=False)
    assert m.cpu_path["why_no_fp16"] == "off (fp16=False: batched work)"
    m = make_model(16, hidden_size=32, layers=1, seed=0).half().float()
    pack_cpu_linears(m, fp16_rows=0)
    assert m.cpu_path["why_no_fp16"] == "cpu_fp16_rows=0"


@NEEDS_FP16
def test_fp16_rows_measured_choice_is_a_set_of_row_counts(monkeypatch):
    m = make_model(16, hidden_size=32, layers=1, seed=0).half().float()
    pack_cpu_linears(m)
    rows = m.cpu_path["fp16_rows"]
    assert set(rows) <= set(range(1, 17))
    lins = [x for x in m.modules() if isinstance(x, PackedLinear)]
    assert all(x.fp16_rows == frozenset(rows) and (x.fp16 is None) == (not rows) for x in lins)


def test_fp16_exact_reads_every_value():
    """One value fp16 cannot hold, anywhere in any weight (here in the last chunk the check reads), keeps a model
    off the fp16 copies; the same weights without it take them."""
    from adaptive_spec.backends.cpu.packed import fp16_exact

    weights = [torch.randn(64, 32).half().float(), torch.randn(3, 1 << 18).half().float()]
    assert fp16_exact(weights)
    weights[1][-1, -1] = 1 + 2 ** -20  # between two fp16 values
    assert not fp16_exact(weights)


@NEEDS_FP16
@pytest.mark.parametrize("chosen", [[], [1, 2]])
def test_fp16_copies_past_the_timed_layers_only_where_a_row_count_pays(monkeypatch, chosen):
    """The choices are made on the timed layers as soon as they are packed: where no row count pays, the layers
    after them get no copy made at all (a load's time and memory); where one does, every layer has its copy."""
    import adaptive_spec.backends.cpu.packed as P

    monkeypatch.setattr(P, "_TIMED_BYTES", 1)  # the first layer alone is timed
    monkeypatch.setattr(P, "choose_fp16_rows", lambda layers, rows=None: (timed.append(len(layers)),
                                                                           frozenset(chosen))[1])
    copies, timed = [], []
    add = P.PackedLinear.add_fp16
    monkeypatch.setattr(P.PackedLinear, "add_fp16", lambda self, w=None: (copies.append(self), add(self, w))[1])
    m = make_model(16, hidden_size=32, layers=2, seed=0).half().float()
    n = pack_cpu_linears(m, release=True)
    lins = [x for x in m.modules() if isinstance(x, PackedLinear)]
    assert timed == [1] and m.cpu_path["fp16_rows"] == chosen
    assert len(copies) == (1 if not chosen else n)  # the control: a paying row count copies every layer
    assert all((x.fp16 is None) == (not chosen) and x.fp16_rows == frozenset(chosen) for x in lins)


@NEEDS_FP16
def test_fp16_model_logits_match_unpacked(monkeypatch):
    ref = make_model(16, hidden_size=32, layers=2, seed=5, logit_scale=3.0).half().float()
    m = fp16_model(5, monkeypatch)
    for ids in ([[1, 4, 7, 2, 9]], [[3]]):  # a verification-sized input and a decode step
        with torch.inference_mode():
            torch.testing.assert_close(m(torch.tensor(ids)).logits, ref(torch.tensor(ids)).logits, rtol=1e-4, atol=1e-4)
