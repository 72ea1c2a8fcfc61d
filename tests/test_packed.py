"""The CPU pre-packed linear layers (models.PackedLinear) change kernels, never results."""
import pytest
import torch

from adaptive_spec.decoding import Decoder
from adaptive_spec.errors import UserError
from adaptive_spec.models import CausalLM, PackedLinear, choose_padding, load_model, pack_cpu_linears
from adaptive_spec.policies import FixedK
from adaptive_spec.sampling import SamplingParams
from exact import chi_square_pvalue, exact_sequence_probs, sample_counts
from tiny import make_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


V, L = 5, 3


def packed_bf16(seed, vocab=16, pad_to=(0, 4, 4, 4, 4), **kw):
    """A tiny bf16 model with packed linears; pad_to forces the row padding on (on tiny layers
    the measured choice is usually none) so that the padded path is what gets tested."""
    m = make_model(vocab, hidden_size=32, layers=2, seed=seed, logit_scale=3.0, **kw).to(torch.bfloat16)
    assert pack_cpu_linears(m) == 2 * 7 + 1  # q,k,v,o,gate,up,down per layer + lm_head
    for x in m.modules():
        if isinstance(x, PackedLinear):
            x.pad_to = pad_to
    return m


@pytest.mark.parametrize("pad_to", [(), (0, 6, 6, 6, 6, 6)], ids=["unpadded", "padded"])
@pytest.mark.parametrize("shape", [(1, 32), (5, 32), (1, 1, 32), (1, 3, 32), (3, 7, 32)])
def test_packed_linear_matches_stock_linear(shape, pad_to):
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(shape, dtype=torch.bfloat16)
    with torch.inference_mode():
        ref, got = lin(x), PackedLinear(lin, pad_to)(x)
    assert got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_pack_skips_fp32_and_grad_uses_stock_path():
    m = make_model(16, hidden_size=32, layers=1, seed=0)
    assert pack_cpu_linears(m) == 0  # fp32: left alone
    lin = PackedLinear(torch.nn.Linear(8, 4).to(torch.bfloat16))
    x = torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True)
    lin(x).float().sum().backward()  # the packed op has no backward; the stock path must run
    assert x.grad is not None and lin.weight.grad is not None


def test_padding_choice(monkeypatch):
    lins = [PackedLinear(torch.nn.Linear(64, 256).to(torch.bfloat16)) for _ in range(3)]
    pad_to = choose_padding(lins, max_rows=4)  # measured: none, or rows r >= M for each M
    assert pad_to == () or (len(pad_to) == 5 and all(r >= m for m, r in enumerate(pad_to)))
    monkeypatch.setenv("ADAPTIVE_SPEC_CPU_PAD_ROWS", "4")
    assert choose_padding(lins) == (0, 4, 4, 4, 4)
    monkeypatch.setenv("ADAPTIVE_SPEC_CPU_PAD_ROWS", "0")
    assert choose_padding(lins) == ()
    monkeypatch.setenv("ADAPTIVE_SPEC_CPU_PAD_ROWS", "six")
    with pytest.raises(UserError, match="must be 'auto' or a row count"):
        choose_padding(lins)


def test_packed_model_logits_match_unpacked():
    ref = make_model(16, hidden_size=32, layers=2, seed=5, logit_scale=3.0).to(torch.bfloat16)
    packed = packed_bf16(5)
    ids = torch.tensor([[1, 4, 7, 2, 9]])
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits.float(), ref(ids).logits.float(), rtol=2e-2, atol=2e-2)


def test_greedy_speculative_equals_greedy_target_with_packed_models():
    target, draft = CausalLM(packed_bf16(6)), CausalLM(packed_bf16(7))
    params = SamplingParams(0.0)
    ar = Decoder(target).generate([1, 2, 3], 24, params).token_ids
    for k in (1, 3):
        assert Decoder(target, draft).generate([1, 2, 3], 24, params, FixedK(k)).token_ids == ar


def test_distribution_is_exact_with_packed_models():
    target, draft = CausalLM(packed_bf16(8, vocab=V)), CausalLM(packed_bf16(9, vocab=V))
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params, V, L)
    counts = sample_counts(Decoder(target, draft), prompt, params, FixedK(2), 1500, L)
    assert chi_square_pvalue(counts, probs, 1500) > 1e-3


def test_load_model_packs_bf16_on_cpu(tiny_pair, monkeypatch):
    _, target = tiny_pair
    m, _ = load_model(str(target), "target", "bf16", "cpu")
    assert any(isinstance(x, PackedLinear) for x in m.modules())
    monkeypatch.setenv("ADAPTIVE_SPEC_CPU_PACK", "0")
    m, _ = load_model(str(target), "target", "bf16", "cpu")
    assert not any(isinstance(x, PackedLinear) for x in m.modules())
