"""The sampling fast paths give what the plain computation gives.

process_logits builds a top-k distribution from the k + TIE_SLACK largest logits (found block-wise by
`top_k`) instead of masking and exponentiating the whole vocabulary, and verification at temperature 0
reads argmaxes instead of one-hot rows; these compare each with the plain computation, ties included,
on a vocabulary as large as the real one.
"""
import pytest
import torch

from adaptive_spec.backends import logits as logits_mod
from adaptive_spec.decoding import sampling
from adaptive_spec.backends.logits import top_k
from adaptive_spec.decoding.sampling import SamplingParams, process_logits, verify, verify_greedy

V = 151_936


def dense(logits, params):
    """process_logits' dense path (the one a GPU takes): mask below the k-th, softmax, stable top-p."""
    x = logits.float()
    if params.top_k:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    x = x / params.temperature
    if params.top_p < 1:
        s, order = torch.sort(x, dim=-1, descending=True, stable=True)
        x = torch.full_like(x, float("-inf")).scatter_(-1, order, logits_mod._drop_top_p(s, params.top_p))
    return x.softmax(-1)


@pytest.mark.parametrize("vocab,k", [(V, 1), (V, 50), (32_000, 20), (5_000, 8), (40, 5)])
def test_top_k_gives_torch_topk_values_and_indices(vocab, k):
    x = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab + k)) * 3
    vals, idx = top_k(x, k)
    want = torch.topk(x, k, dim=-1)
    assert torch.equal(vals, want.values) and torch.equal(idx, want.indices)


def tied(k, extra):
    """Logits with `extra` tokens tied at the k-th largest value (bf16 logits do this)."""
    x = torch.randn(V, generator=torch.Generator().manual_seed(k + extra)) * 3
    order = x.topk(k + extra).indices
    x[order[k - 1:]] = float(x[order[k - 1]])
    return x


@pytest.mark.parametrize("params", [SamplingParams(1.0, 50), SamplingParams(0.7, 50, 0.9), SamplingParams(1.3, 8, 0.5),
                                    SamplingParams(1.0, 0, 0.9)])
@pytest.mark.parametrize("case", ["random", "ties-within-slack", "ties-past-slack"])
def test_process_logits_equals_the_dense_computation(params, case):
    x = {"random": torch.randn(2, V) * 3, "ties-within-slack": torch.stack([tied(max(params.top_k, 1), 3)] * 2),
         "ties-past-slack": torch.stack([tied(max(params.top_k, 1), 40)] * 2)}[case]
    got, want = process_logits(x, params), dense(x, params)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    if params.top_k and case != "random" and params.top_p == 1:
        assert int((got[0] > 0).sum()) > params.top_k  # every tie at the k-th value kept


def test_greedy_verification_equals_verify_on_one_hot_rows():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        K = int(torch.randint(1, 6, (1,), generator=g))
        logits = torch.randn(K + 1, 50, generator=g)
        amax = logits.argmax(-1)
        # candidates that agree with the argmax for a random prefix, then not
        y = amax[:K].clone()
        cut = int(torch.randint(0, K + 1, (1,), generator=g))
        if cut < K:
            y[cut] = (y[cut] + 1) % 50
        p = process_logits(logits, SamplingParams(0.0))
        q = torch.zeros(K, 50).scatter_(1, y.view(-1, 1), 1.0)
        n, tok = verify(y, q, p, torch.Generator().manual_seed(1))
        n2, tok2, p_y = verify_greedy(y, logits)
        assert (int(n), int(tok)) == (int(n2), int(tok2)) == (cut, int(amax[cut]))
        assert p_y.tolist() == p[torch.arange(K), y].tolist()


@pytest.mark.parametrize("vocab", [V, 5_003])
def test_two_level_sampling_draws_the_distribution_and_never_a_zero(vocab):
    """sample's block-wise inverse CDF on a large vocabulary: frequencies match the probabilities
    (chi-square over the support) and no token of probability 0 is drawn, zero blocks included."""
    g = torch.Generator().manual_seed(vocab)
    p = torch.zeros(vocab)
    support = torch.randperm(vocab, generator=g)[:12]
    p[support] = torch.rand(12, generator=g) + 0.05
    p[support[0]] = 1e-7  # a tiny mass next to exact zeros
    n = 3_000
    draws = torch.cat([sampling.sample(p.expand(500, vocab), g) for _ in range(n // 500)])
    assert bool((p[draws] > 0).all())
    counts = torch.bincount(draws, minlength=vocab)[support[1:]].double()
    want = p[support[1:]].double() / p.sum() * n
    stat = float(((counts - want) ** 2 / want).sum())
    assert stat < 40.0  # chi-square, 11 cells: p < 1e-4 above 35.6
    # the control: draws from another distribution over the same support fail the same check
    other = torch.zeros(vocab)
    other[support] = torch.rand(12, generator=g) + 0.05
    wrong = torch.cat([sampling.sample(other.expand(500, vocab), g) for _ in range(n // 500)])
    counts = torch.bincount(wrong, minlength=vocab)[support[1:]].double()
    assert float(((counts - want) ** 2 / want).sum()) > 40.0
