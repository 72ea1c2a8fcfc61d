"""Multi-draft baselines (adaptive_spec.decoding.multidraft): SpecTr K-SEQ and batch SD."""
import pytest
import torch

from adaptive_spec.decoding import multidraft as MD
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.errors import UserError
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.decoding.pipeline import make_policy
from adaptive_spec.decoding.sampling import SamplingParams
from tiny import make_model
from exact import chi_square_pvalue, exact_sequence_probs, sample_counts
from tree_mocks import TreeMockLM

GREEDY = SamplingParams(temperature=0)



def dists(V, seed, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g) * sharp).softmax(-1)


# ---- K-SEQ (SpecTr Algorithm 2) -------------------------------------------------------------

@pytest.mark.parametrize("K", [1, 2, 4])
def test_kseq_gamma_star(K):
    p, q = dists(8, 1), dists(8, 2)
    n = torch.tensor([K])
    g = MD.kseq_gamma(p.view(1, -1), q.view(1, -1), n)[0]
    f = lambda gam: 1 - (1 - torch.minimum(q, p / gam).sum()) ** K - gam * torch.minimum(q, p / gam).sum()  # noqa: E731
    assert 1.0 <= g <= K
    assert f(g) <= 1e-7  # the valid side: 1 - (1 - beta)^K <= gamma beta
    assert g == 1.0 or f(g - 1e-4) > 0  # and the smallest such gamma: the root of Eq. (6)
    if K == 1:
        assert g == pytest.approx(1.0)  # one draft: plain speculative sampling
    # identical distributions: gamma* = 1 and every draft is accepted
    assert MD.kseq_gamma(p.view(1, -1), p.view(1, -1), n)[0] == pytest.approx(1.0, abs=1e-3)


def kseq_histogram(p, q, K, B, gen):
    xs = torch.multinomial(q.expand(B, -1), K, replacement=True, generator=gen)
    y = MD.kseq(p.expand(B, -1).contiguous(), q.expand(B, -1).contiguous(), xs, torch.full((B,), K), gen)
    return torch.bincount(y, minlength=p.shape[0])


def test_kseq_output_is_exact_and_wrong_gamma_is_caught(monkeypatch):
    p, q = dists(6, 3), dists(6, 4)
    B, K = 40000, 3
    gen = torch.Generator().manual_seed(0)
    probs = {(i,): p[i].item() for i in range(6)}
    h = kseq_histogram(p, q, K, B, gen)
    assert chi_square_pvalue({(i,): int(h[i]) for i in range(6)}, probs, B) > 1e-3
    # with gamma = 1 < gamma* the K-SEQ plan is not a valid coupling: the output is biased
    monkeypatch.setattr(MD, "kseq_gamma", lambda p, q, n, iters=40: torch.ones(p.shape[0]))
    h = kseq_histogram(p, q, K, B, gen)
    assert chi_square_pvalue({(i,): int(h[i]) for i in range(6)}, probs, B) < 1e-3


# ---- greedy: identical to target-only decoding ---------------------------------------------

@pytest.mark.parametrize("method", MD.METHODS)
def test_greedy_equals_target(method):
    target = CausalLM(make_model(32, hidden_size=24, layers=2, seed=2, logit_scale=4.0))
    draft = CausalLM(make_model(32, hidden_size=16, layers=2, seed=1, logit_scale=4.0))
    dec = Decoder(target, draft)
    prompt = [5, 9, 4, 17]
    ref = dec.generate(prompt, max_new_tokens=30, sampling=GREEDY).token_ids
    pol = MD.MultiDraftPolicy(method, num_drafts=3, k=4)
    g = dec.generate(prompt, max_new_tokens=30, sampling=GREEDY, policy=pol)
    assert g.token_ids == ref
    m = g.metrics
    assert m.n_discarded == m.n_drafted - m.n_accepted and sum(m.accepted_hist.values()) == m.n_target_forwards
    # greedy drafts are identical, so the trie is one chain of k tokens
    assert m.n_drafted <= 4 * m.n_target_forwards
    same = Decoder(target, CausalLM(target.model)).generate(prompt, max_new_tokens=30, sampling=GREEDY, policy=pol)
    assert same.token_ids == ref and same.metrics.n_discarded == 0


def test_factories_and_errors():
    assert make_policy("spectr", num_drafts=2, k=3).describe() == {"policy": "spectr", "num_drafts": 2, "k": 3}
    assert make_policy("batch-sd").describe() == {"policy": "batch-sd", "num_drafts": 4, "k": 4}
    with pytest.raises(UserError, match="num_drafts must be an integer >= 1 for policy spectr, got 0"):
        make_policy("spectr", num_drafts=0)
    with pytest.raises(UserError, match="tree_budget: not a setting of policy spectr .*its settings: num_drafts, k"):
        make_policy("spectr", tree_budget=3)


# ---- exact output distribution --------------------------------------------------------------

V, L, N = 5, 3, 2000


@pytest.mark.parametrize("method,params", [
    ("spectr", SamplingParams(1.0)),
    ("batch-sd", SamplingParams(1.0)),
    ("spectr", SamplingParams(0.8, top_k=3)),
], ids=["spectr", "batch-sd", "spectr-topk"])
def test_multidraft_distribution_is_exact(method, params):
    draft, target = TreeMockLM(V, seed=4), TreeMockLM(V, seed=3)
    prompt = [1, 2]
    probs = exact_sequence_probs(target, prompt, params, V, L)
    counts = sample_counts(Decoder(target, draft), prompt, params, MD.MultiDraftPolicy(method, 3, 2), N, L)
    assert chi_square_pvalue(counts, probs, N) > 1e-3


def test_batch_sd_without_residual_update_is_caught(monkeypatch):
    """Batch SD that tries every draft's first token against the ORIGINAL target distribution
    (no residual update between drafts) is biased; the same check must fail."""
    draft, target = TreeMockLM(V, seed=4), TreeMockLM(V, seed=3)
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params, V, L)
    monkeypatch.setattr(MD, "residual", lambda p, q: p)
    counts = sample_counts(Decoder(target, draft), prompt, params, MD.MultiDraftPolicy("batch-sd", 3, 2), N, L)
    assert chi_square_pvalue(counts, probs, N) < 1e-3


def test_spectr_distribution_is_exact_on_transformer_models():
    target = CausalLM(make_model(V, hidden_size=16, layers=1, seed=3, logit_scale=3.0))
    draft = CausalLM(make_model(V, hidden_size=16, layers=1, seed=4, logit_scale=3.0))
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params, V, L)
    counts = sample_counts(Decoder(target, draft), prompt, params, MD.MultiDraftPolicy("spectr", 3, 2), 1000, L)
    assert chi_square_pvalue(counts, probs, 1000) > 1e-3


@pytest.mark.parametrize("policy,kw", [
    ("tree", dict(tree_budget=6, tree_estimator="positional")),
    ("ersd", dict(drafting="batch", num_drafts=3)),
    ("spectr", dict(num_drafts=2, k=3)),
    ("batch-sd", dict(num_drafts=2, k=3)),
])
def test_registered_policies_through_the_pipeline(tiny_pair, policy, kw):
    """The names and keyword arguments the CLI forwards, through SpecPair.generate."""
    from adaptive_spec import SpecPair

    draft_dir, target_dir = tiny_pair
    pair = SpecPair.load(target=str(target_dir), draft=str(draft_dir), dtype="fp32", device="cpu")
    ref = pair.generate("abc de", policy="ar", temperature=0, max_new_tokens=12)
    g = pair.generate("abc de", policy=policy, temperature=0, max_new_tokens=12, **kw)
    assert g.token_ids == ref.token_ids and g.metrics.n_target_forwards <= 12
    with pytest.raises(UserError, match=f"threshold: not a setting of policy {policy}"):
        pair.generate("abc de", policy=policy, temperature=0, max_new_tokens=12, threshold=0.5, **kw)
