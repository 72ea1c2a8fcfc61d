"""The int8 draft (quant.Int8Linear): a cheaper q, the target's distribution unchanged."""
import typing

import pytest
import torch

from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.errors import UserError
from adaptive_spec.backends.models import load_model
from adaptive_spec.backends.cpu.quant import (Int4Linear, Int8Linear, check_quant, int4_kernel, int8_kernel,
                                          quantize_linears)
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.decoding.policies import FixedK
from adaptive_spec.decoding.sampling import SamplingParams
from exact import chi_square_pvalue, exact_sequence_probs, sample_counts
from tiny import make_model

pytestmark = pytest.mark.skipif(int8_kernel("cpu") is not None, reason=f"no int8 kernel: {int8_kernel('cpu')}")
V, L = 5, 3


def int8_model(seed, vocab=16):
    m = make_model(vocab, hidden_size=32, layers=2, seed=seed, logit_scale=3.0)
    assert quantize_linears(m) == 2 * 7 + 1
    return m


@pytest.mark.parametrize("shape", [(32,), (1, 32), (5, 32), (1, 3, 32)])
def test_int8_linear_is_close_to_the_float_layer(shape):
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 48)
    q = Int8Linear(lin)
    x = torch.randn(shape)
    with torch.inference_mode():
        ref, got = lin(x), q(x)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    # int8 weights (error <= scale/2 per weight) and bf16 activations: a few percent of the scale
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert q.qweight.dtype == torch.int8 and q.weight_bytes < lin.weight.numel() * 4 / 3.5


def test_int8_draft_keeps_the_distribution_exact():
    target = CausalLM(make_model(V, hidden_size=32, layers=2, seed=8, logit_scale=3.0))
    draft = CausalLM(int8_model(9, vocab=V))
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params, V, L)
    counts = sample_counts(Decoder(target, draft), prompt, params, FixedK(2), 1500, L)
    assert chi_square_pvalue(counts, probs, 1500) > 1e-3


def assert_greedy_equals_target(draft_model):
    target = CausalLM(make_model(16, hidden_size=32, layers=2, seed=6, logit_scale=3.0))
    draft = CausalLM(draft_model)
    params = SamplingParams(0.0)
    ar = Decoder(target).generate([1, 2, 3], 24, params).token_ids
    for k in (1, 3):
        assert Decoder(target, draft).generate([1, 2, 3], 24, params, FixedK(k)).token_ids == ar


def test_greedy_with_int8_draft_equals_greedy_target():
    assert_greedy_equals_target(int8_model(7))


def test_load_model_quantizes_and_records_it(tiny_pair):
    draft, _ = tiny_pair
    m, _ = load_model(str(draft), "draft", "fp32", "cpu", quant="int8")
    assert any(isinstance(x, Int8Linear) for x in m.modules())
    assert not any(type(x) is torch.nn.Linear for x in m.modules())
    assert m.cpu_path["quant"] == "int8"


def test_bad_quant_is_refused_before_loading():
    with pytest.raises(UserError, match="unknown draft quantization 'int3'; use one of none, int8, int4"):
        load_model("/nonexistent/model", "draft", quant="int3")
    assert check_quant(None) == "none" and check_quant("int8", "cpu") == "int8"
    from adaptive_spec.backends import engines
    from adaptive_spec.backends.cpu.quant import QUANTS
    from adaptive_spec.params import PairParams

    assert engines.get("torch").draft_quants == QUANTS  # the engine record spells the list out: it imports no torch
    assert typing.get_args(PairParams.model_fields["draft_quant"].annotation) == tuple(
        dict.fromkeys(engines.get("torch").draft_quants + engines.get("llama.cpp").draft_quants))
    with pytest.raises(ValueError, match="does not run on the torch backend; it takes none, int8, int4"):
        PairParams(draft_quant="q4_0")
    with pytest.raises(ValueError, match="does not run on the llama.cpp backend; it takes none, q4_0, q8_0"):
        PairParams(backend="llama.cpp", draft_quant="int8")


def test_int8_linear_dense_path_for_many_rows_matches_the_kernel():
    """From dense_rows input rows on, the layer dequantizes and runs a dense GEMM (faster for
    batched passes); both paths compute with the same int8 weights, so they agree to rounding."""
    torch.manual_seed(0)
    q = Int8Linear(torch.nn.Linear(32, 48))
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        kernel = q(x)
        q.dense_rows = 10  # 2 x 5 rows: now the dense path
        dense = q(x)
    assert dense.shape == kernel.shape and dense.dtype == kernel.dtype
    # the kernel rounds activations to bf16; the dense path keeps them in x's dtype
    assert (dense - kernel).abs().max() < 0.02 * kernel.abs().max()
    assert not torch.equal(dense, kernel)  # it really took the other path


def test_densified_int8_model_computes_with_the_int8_weights_and_keeps_its_identity(tiny_pair):
    """datagen's draft: densify_quantized keeps a dense copy of each dequantized weight and computes
    every input with it. Outputs equal a float model holding the dequantized weights; the
    checkpoint (state_dict) and the manifest fingerprint stay those of the int8 draft."""
    from adaptive_spec.backends.runner import model_fingerprint
    from adaptive_spec.backends.cpu.quant import densify_quantized

    draft, _ = tiny_pair
    m, _ = load_model(str(draft), "draft", "fp32", "cpu", quant="int8")
    ref, _ = load_model(str(draft), "draft", "fp32", "cpu", pack=False)
    with torch.no_grad():  # the float reference holds exactly the int8 grid's values
        for name, mod in m.named_modules():
            if isinstance(mod, Int8Linear):
                ref.get_submodule(name).weight.copy_(mod.weight)
    before_sd = {k: v.clone() for k, v in m.state_dict().items()}
    before_fp = model_fingerprint(m)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        kernel = m(ids).logits
        assert densify_quantized(m) == 2 * 7 + 1 and "dense" in m.cpu_path["linear"]
        dense, want = m(ids).logits, ref(ids).logits
    torch.testing.assert_close(dense, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(dense, kernel)  # the kernel's bf16 activations are gone
    assert model_fingerprint(m) == before_fp
    assert m.state_dict().keys() == before_sd.keys()
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before_sd.items())


# ----------------------------------------------------------------------------- int4 (CPU kernel)

needs_int4 = pytest.mark.skipif(int4_kernel("cpu") is not None, reason=f"no int4 kernel: {int4_kernel('cpu')}")


def int4_model(seed, vocab=16):
    # hidden 64: the kernel takes input sizes in groups of 64 and output sizes in blocks of 16
    m = make_model(vocab, hidden_size=64, layers=2, seed=seed, logit_scale=3.0)
    assert quantize_linears(m, "int4") == 2 * 7 + 1 and m.cpu_path["quant"] == "int4"
    return m


@needs_int4
def test_int4_linear_dequantizes_exactly_and_is_close_to_the_float_layer():
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 48)
    q = Int4Linear(lin)
    # the dequantized weight is (q - 8) * scale + zero: every group of 64 takes at most 16 values,
    # its extremes exactly (up to the bf16 scale) and within half a step elsewhere
    w = q.dequantized()
    assert w.shape == (48, 128)
    for g in w.reshape(48, 2, 64).flatten(0, 1):
        assert len(torch.unique(g)) <= 16
    step = (lin.weight.reshape(48, 2, 64).amax(-1) - lin.weight.reshape(48, 2, 64).amin(-1)) / 15
    assert ((w - lin.weight).abs().reshape(48, 2, 64) <= 0.51 * step[..., None] + 1e-2 * step[..., None]).all()
    x = torch.randn(5, 128)
    with torch.inference_mode():
        got = q(x)
    want = torch.nn.functional.linear(x.bfloat16().float(), w) + lin.bias
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0)
    assert q.weight_bytes < lin.weight.numel() * 4 / 7  # about half a byte a weight


@needs_int4
def test_int4_draft_keeps_the_distribution_exact():
    target = CausalLM(make_model(16, hidden_size=32, layers=2, seed=8, logit_scale=3.0))
    draft = CausalLM(int4_model(9))
    params, prompt = SamplingParams(1.0, top_k=6), [1, 2]
    probs = exact_sequence_probs(target, prompt, params, 16, 2)
    counts = sample_counts(Decoder(target, draft), prompt, params, FixedK(2), 1500, 2)
    assert chi_square_pvalue(counts, probs, 1500) > 1e-3


@needs_int4
def test_greedy_with_int4_draft_equals_greedy_target():
    assert_greedy_equals_target(int4_model(7))


@needs_int4
def test_int4_refuses_layers_the_kernel_cannot_take():
    with pytest.raises(UserError, match="multiple of 64.*use --draft-quant int8"):
        Int4Linear(torch.nn.Linear(32, 48))
