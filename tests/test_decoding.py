"""Exactness of the speculative decoder on tiny random models (small vocabulary, enumerable)."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from adaptive_spec.decoding import sampling
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.heads.head import AcceptanceHead
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.decoding.interfaces import PolicyContext
from adaptive_spec.typed import policy_class
from adaptive_spec.decoding.pipeline import make_policy, policy_names
from adaptive_spec.decoding.policies import FixedK
from adaptive_spec.decoding.sampling import SamplingParams
import exact
from exact import chi_square_pvalue
from tiny import MockLM, make_model

GREEDY = SamplingParams(temperature=0)


def pair(vocab=32, same=False, draft_seed=1, target_seed=2, scale=4.0, layers=2):
    target = CausalLM(make_model(vocab, hidden_size=24, layers=layers, seed=target_seed, logit_scale=scale))
    draft = target if same else CausalLM(make_model(vocab, hidden_size=16, layers=layers, seed=draft_seed,
                                                    logit_scale=scale))
    if same:  # a separate runner (own cache) over the same weights
        draft = CausalLM(target.model)
    return draft, target


@pytest.mark.parametrize("same", [True, False], ids=["draft=target", "random-draft"])
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_equals_target(k, same):
    draft, target = pair(same=same)
    dec = Decoder(target, draft)
    prompt = [5, 9, 4, 17]
    ref = dec.generate(prompt, max_new_tokens=40, sampling=GREEDY, policy=None).token_ids
    spec = dec.generate(prompt, max_new_tokens=40, sampling=GREEDY, policy=FixedK(k))
    assert spec.token_ids == ref
    m = spec.metrics
    assert m.n_tokens == 40
    if same:  # a draft equal to the target is always right: K+1 tokens per target pass
        assert m.n_discarded == 0 and m.acceptance_rate == 1.0
        assert m.n_target_forwards == math.ceil(40 / (k + 1))


def test_metrics_are_consistent():
    draft, target = pair()
    g = Decoder(target, draft).generate([5, 9, 4], max_new_tokens=50, sampling=SamplingParams(1.0), policy=FixedK(3))
    m = g.metrics
    assert m.n_tokens == len(g.token_ids) == 50
    assert m.n_discarded == m.n_drafted - m.n_accepted
    assert sum(m.accepted_hist.values()) == m.n_target_forwards
    # every round yields its accepted tokens plus one (the last round may be cut at the limit)
    assert m.n_accepted + m.n_target_forwards >= m.n_tokens
    assert m.n_draft_forwards == m.n_drafted  # one draft forward per candidate
    assert m.draft_s > 0 and m.target_s > 0 and m.wall_s >= m.draft_s + m.target_s
    assert m.discard_rate == pytest.approx(m.n_discarded / 50)
    assert m.verification_rate == pytest.approx(m.n_target_forwards / 50)
    # every target pass by its length: K + 1 tokens a round (the pending token and K candidates)
    hist = m.target_pass_hist
    assert sum(hist.values()) == m.n_target_forwards and set(hist) <= {1, 2, 3, 4}
    assert sum((n - 1) * c for n, c in hist.items()) == m.n_drafted
    assert json.loads(json.dumps(m.to_dict()))["target_pass_hist"] == {str(n): c for n, c in sorted(hist.items())}
    ar = Decoder(target).generate([5, 9, 4], max_new_tokens=7, sampling=SamplingParams(1.0)).metrics
    assert ar.target_pass_hist == {1: 7}


def assert_books(m, g):
    """Metrics' identities, overall and per draft source (Metrics.book_round / book_cut book them), and the
    breakdown's parts, on one clock, adding up to the wall time."""
    parts = m.breakdown()
    assert sum(parts.values()) == pytest.approx(m.wall_s, rel=1e-9) and min(parts.values()) >= 0, parts
    assert parts.get("target_forward", 0) + parts.get("round", 0) > 0 and "hindsight" not in parts
    rounds = sum(m.accepted_hist.values())
    assert m.n_tokens == len(g.token_ids)
    assert m.n_drafted == m.n_accepted + m.n_discarded
    assert m.n_tokens == m.n_accepted + rounds - m.n_final_cut
    assert m.n_final_cut in ((0, 1) if g.stopped_by == "eos" else (0,))  # only a round ending at EOS
    by = m.by_source
    assert sum(by.n_drafted_by.values()) == m.n_drafted and sum(by.n_accepted_by.values()) == m.n_accepted
    assert sum(by.rounds_by.values()) == rounds
    for source, n in by.n_drafted_by.items():
        assert 0 <= by.n_accepted_by[source] <= n, (source, by.n_accepted_by, by.n_drafted_by)


POLICY_CASES = [(n, {}) for n in policy_names() if n != "ar"] + [("ngram", {"fallback": "learned"})]


@pytest.mark.parametrize("name,extra", POLICY_CASES, ids=[n + ("+" + "+".join(e.values()) if e else "")
                                                          for n, e in POLICY_CASES])
@pytest.mark.parametrize("cut", ["eos", "length"])
def test_cuts_book_cut_candidates_as_discarded(name, extra, cut):
    """When EOS ends the output inside a round, the candidates after it were never emitted and count as
    discarded, in their source's counts too, for every policy; a short length limit likewise. With a
    draft equal to the target most candidates are accepted, so the EOS usually falls among them."""
    _, target = pair()
    draft = CausalLM(target.model)
    prompt = [5, 9, 4, 17, 5, 9, 4]  # a repeat, so prompt lookup copies
    x = Decoder(target).generate(prompt, max_new_tokens=40, sampling=GREEDY).token_ids
    eos = next(t for j, t in enumerate(x) if j >= 6 and t not in x[:j])  # the greedy output hits it at j
    eos_ids = [eos] if cut == "eos" else []
    max_new = 40 if cut == "eos" else 7
    dec = Decoder(target, draft, eos_token_ids=eos_ids)
    sampling = GREEDY if name == "oracle" else SamplingParams(1.0)
    torch.manual_seed(0)
    ctx = PolicyContext(SimpleNamespace(target=target, draft=draft, eos_token_ids=eos_ids), prompt, sampling, max_new)
    fields = policy_class(name).model_fields
    learned = name == "learned" or extra.get("fallback") == "learned"
    kw = {k: v for k, v in dict(head=AcceptanceHead(24, depth=1), threshold=0.5, k=3).items()
          if k in fields and (k != "head" or learned) and (k != "threshold" or name != "ngram" or learned)}
    stops = []
    for seed in range(4):
        g = dec.generate(prompt, max_new_tokens=max_new, sampling=sampling,
                         policy=make_policy(name, ctx, **kw, **extra), seed=seed)
        assert_books(g.metrics, g)
        stops.append(g.stopped_by)
    assert cut in stops


def test_rollback_matches_fresh_forward():
    """Cropping the cache after a rejection leaves it equal to a cache built from scratch."""
    _, target = pair()
    seq = torch.tensor([5, 9, 4, 17, 8, 6, 11, 12, 20])
    lm = target
    lm.reset()
    lm.forward(seq[:4], n_logits=0)
    lm.forward(seq[4:9], n_logits=5)  # a verify pass over 5 candidates
    lm.rollback(6)  # 2 of them accepted
    x = torch.tensor([25, 3])
    got, h_got = lm.forward(x, n_logits=2)
    fresh = CausalLM(target.model)
    ref, h_ref = fresh.forward(torch.cat([seq[:6], x]), n_logits=2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_got, h_ref, rtol=1e-5, atol=1e-5)
    assert lm.length == fresh.length == 8


# ---- exact output distribution ---------------------------------------------------------------

V, L, N_SAMPLES = 5, 3, 3000


def exact_sequence_probs(target, prompt, params):
    return exact.exact_sequence_probs(target, prompt, params, V, L)


def sample_counts(dec, prompt, params, policy, n=N_SAMPLES):
    return exact.sample_counts(dec, prompt, params, policy, n, L)


def exact_pair():
    # trigram mocks from different seeds: q is far from p, so the residual matters
    return MockLM(V, seed=4), MockLM(V, seed=3)


@pytest.mark.parametrize("params,k", [
    (SamplingParams(1.0), 2),
    (SamplingParams(1.0, top_k=3), 3),
    (SamplingParams(0.8, top_p=0.7), 1),
], ids=["t1-k2", "topk3-k3", "topp0.7-t0.8-k1"])
def test_speculative_distribution_is_exact(params, k):
    draft, target = exact_pair()
    prompt = [1, 2]
    probs = exact_sequence_probs(target, prompt, params)
    counts = sample_counts(Decoder(target, draft), prompt, params, FixedK(k))
    assert chi_square_pvalue(counts, probs, N_SAMPLES) > 1e-3


def test_distribution_test_catches_a_wrong_residual(monkeypatch):
    """The same test must fail when the correction after a rejection is drawn from p, not
    from norm(max(p - q, 0)): that biases the output toward the draft's choices."""
    draft, target = exact_pair()
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params)
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    counts = sample_counts(Decoder(target, draft), prompt, params, FixedK(2))
    assert chi_square_pvalue(counts, probs, N_SAMPLES) < 1e-3


def test_distribution_is_exact_on_transformer_models():
    """The same check through real (tiny) Qwen2 models, KV-cache cropping included."""
    target = CausalLM(make_model(V, hidden_size=16, layers=1, seed=3, logit_scale=3.0))
    draft = CausalLM(make_model(V, hidden_size=16, layers=1, seed=4, logit_scale=3.0))
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params)
    counts = sample_counts(Decoder(target, draft), prompt, params, FixedK(2), n=1500)
    assert chi_square_pvalue(counts, probs, 1500) > 1e-3


def test_autoregressive_distribution_is_exact():
    _, target = exact_pair()
    params, prompt = SamplingParams(1.0, top_k=4), [1, 2]
    probs = exact_sequence_probs(target, prompt, params)
    counts = sample_counts(Decoder(target), prompt, params, None, n=2000)
    assert chi_square_pvalue(counts, probs, 2000) > 1e-3


def test_sampler_draws_each_row_from_its_distribution():
    """sampling.sample (inverse CDF): per-row chi-square on a batch whose rows differ, unnormalised
    input, and tokens of probability zero (between, before and after the support) never drawn."""
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0],
                          [0.1, 0.0, 0.0, 0.0, 0.0, 0.9],
                          [0.0, 0.0, 3.0, 1.0, 0.0, 0.0]], dtype=torch.float32)  # row 3: weights, sum 4
    n = 4000
    draws = torch.stack([sampling.sample(probs, g) for _ in range(n)])  # [n, 3]
    for row in range(3):
        p = probs[row] / probs[row].sum()
        counts = torch.bincount(draws[:, row], minlength=6)
        assert not counts[p == 0].any(), f"row {row} drew a token of probability 0"
        cells = {t: p[t].item() for t in range(6)}
        assert chi_square_pvalue({t: int(counts[t]) for t in range(6)}, cells, n) > 1e-3


def test_draw_takes_the_token_sample_would_and_only_skips_the_draw_when_greedy():
    """sampling.draw: under greedy the one-hot's token (sample's own pick, ties to the first maximum)
    without touching the generator; otherwise exactly sample, the same generator state consumed."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: both take the first
    one_hot = sampling.process_logits(logits, GREEDY)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(sampling.draw(one_hot, GREEDY, g1), sampling.sample(one_hot, g2))
    assert sampling.draw(one_hot, GREEDY, g1)[0] == 7
    assert torch.equal(g1.get_state(), torch.Generator().manual_seed(5).get_state())  # greedy drew nothing
    t1 = SamplingParams(1.0, top_k=10)
    probs = sampling.process_logits(logits, t1)
    g1, g2 = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
    for _ in range(20):
        assert torch.equal(sampling.draw(probs, t1, g1), sampling.sample(probs, g2))
