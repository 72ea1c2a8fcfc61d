"""Prompt-lookup (n-gram) drafting: the lookup, the cost-aware stop, and exactness.

A copied token is a proposal with a one-hot q, verified by the same rejection sampler as a model
draft; these tests enumerate the target's exact distribution on tiny models (MockLM tables and tiny
GGUFs through llama.cpp) and compare the n-gram policy's samples with it, alone and with the draft
model in the rounds nothing is copied, with a broken residual as the control that must fail.
"""
import pytest
import torch

import exact
from adaptive_spec.backends import llamacpp
from adaptive_spec.decoding import sampling
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.decoding.ngram import CopyAcceptance, NgramIndex, NgramPolicy, best_k
from adaptive_spec.decoding.pipeline import make_policy
from adaptive_spec.decoding.policies import FixedK
from adaptive_spec.decoding.sampling import SamplingParams
from adaptive_spec.errors import UserError
from adaptive_spec.params import policy_params
from exact import chi_square_pvalue
from tiny import MockLM, make_model, save_gguf

V, L, N = 5, 3, 3000
# a prompt whose suffixes recur, so most rounds copy (n-grams of 1 and 2 tokens)
PROMPT = [1, 2, 3, 1, 2]
FLAT = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731  (a pass of n rows: 1 + 0.1 (n - 1) steps: copying pays)


def test_lookup_takes_the_longest_suffix_at_its_latest_occurrence():
    idx = NgramIndex(1, 3)
    tokens = [7, 1, 2, 9, 5, 1, 2, 4, 8, 1, 2]
    idx.update(tokens)
    span, n = idx.lookup(tokens, 3)
    assert (span, n) == ([4, 8, 1], 2)  # "1 2" last seen before the end at 5..6, followed by 4 8 1
    tokens.append(4)
    idx.update(tokens)
    assert idx.lookup(tokens, 2) == ([8, 1], 3)  # now "1 2 4" matches, 3 tokens long (5 before it differs)


def test_lookup_without_a_match_and_a_copy_that_repeats_itself():
    idx = NgramIndex(2, 4)
    tokens = [1, 2, 3, 4]
    idx.update(tokens)
    assert idx.lookup(tokens, 5) == ([], 0)
    rep = [5, 6, 5, 6]
    idx.update(rep)  # a new list: a new context
    span, n = idx.lookup(rep, 5)
    assert n == 2 and span == [5, 6, 5, 6, 5]  # the copy runs past the context's end into itself


def test_ngram_min_above_max_is_refused():
    with pytest.raises(UserError, match="ngram_min must be in 1..ngram_max"):
        NgramIndex(3, 2)
    with pytest.raises(UserError, match="--ngram-min \\(3\\) must not exceed --ngram-max \\(2\\)"):
        policy_params("ngram", ngram_min=3, ngram_max=2)


def test_best_k_pays_only_for_rows_worth_their_cost():
    a = [0.9] * 6
    # every row a full step: no copy ever beats a plain step at one token a step
    assert best_k(a, lambda n: float(n), 1.0)[0] == 0
    # rows nearly free: copy them all
    assert best_k(a, FLAT, 1.0)[0] == 6
    # a step function like a CPU's (4 rows cheap, 5 dear): stop at 3 copies
    steps = {1: 1.0, 2: 1.5, 3: 1.9, 4: 1.6, 5: 2.6, 6: 3.0, 7: 3.4}
    assert best_k(a, steps.__getitem__, 1.0)[0] == 3
    # a higher rate already reached (lambda) asks more of a copy
    assert best_k([0.6] * 6, FLAT, 1.0)[0] > best_k([0.6] * 6, FLAT, 3.0)[0]


def test_copy_acceptance_trusts_long_matches_and_learns_from_the_targets_probabilities():
    acc = CopyAcceptance()
    short, long_ = acc.predict(1, 3), acc.predict(20, 3)
    assert long_[0] > 0.9 > 0.5 > short[0]  # a long match is trusted, a one-token one is not
    assert short[1] > short[0]  # copy j is priced like a match j - 1 tokens longer
    for _ in range(40):
        acc.observe(2, [0.0])  # this generation's two-token matches fail
    assert acc.predict(2, 1)[0] < 0.1 < acc.predict(4, 1)[0]
    for _ in range(40):
        acc.observe(1, [1.0, 1.0, 1.0])  # its one-token matches succeed
    assert acc.predict(1, 1)[0] > 0.9


def test_lookup_measures_how_far_the_match_goes_back():
    idx = NgramIndex(2, 3)
    tokens = [9, 8, 7, 6, 5, 4, 1, 2, 9, 8, 7, 6, 5]
    idx.update(tokens)
    span, match = idx.lookup(tokens, 2)
    assert span == [4, 1] and match == 5  # "9 8 7 6 5" repeats: 5 tokens, though ngram_max is 3


def mock_pair(seed_t=0, seed_d=1):
    return MockLM(V, seed=seed_t), MockLM(V, seed=seed_d)


@pytest.mark.parametrize("params,policy", [
    (SamplingParams(1.0), lambda d: NgramPolicy(1, 2, k=2)),
    (SamplingParams(1.0, top_k=3), lambda d: NgramPolicy(1, 2, k="auto", verify_steps=FLAT)),
    (SamplingParams(0.8, top_p=0.9), lambda d: NgramPolicy(1, 3, k=3)),
    (SamplingParams(1.0), lambda d: NgramPolicy(2, 2, k="auto", verify_steps=FLAT, fallback=FixedK(2),
                                                draft_steps=0.3)),
    (SamplingParams(1.0, top_k=4), lambda d: NgramPolicy(2, 3, k=1, fallback=FixedK(1))),
], ids=["t1-k2", "topk3-auto", "t0.8-topp-k3", "t1-auto-with-model", "topk4-k1-with-model"])
def test_distribution_is_exact_with_copied_drafts(params, policy):
    target, draft = mock_pair()
    probs = exact.exact_sequence_probs(target, PROMPT, params, V, L)
    pol = policy(draft)
    dec = Decoder(target, draft if pol.needs.draft_model else None)
    counts = exact.sample_counts(dec, PROMPT, params, pol, N, L)
    assert chi_square_pvalue(counts, probs, N) > 1e-3


def test_copies_and_model_rounds_both_run_in_the_combined_policy():
    target, draft = mock_pair()
    pol = NgramPolicy(2, 2, k=2, fallback=FixedK(2))
    g = Decoder(target, draft).generate([1, 2, 3, 4, 1, 2, 0], max_new_tokens=30, sampling=SamplingParams(1.0),
                                        policy=pol, seed=3)
    m = g.metrics
    assert m.by_source.rounds_by.get("ngram", 0) > 0 and m.by_source.rounds_by.get("model", 0) > 0
    assert m.n_drafted == sum(m.by_source.n_drafted_by.values()) == m.n_accepted + m.n_discarded


def test_the_check_fails_on_a_wrong_residual_with_copied_drafts(monkeypatch):
    target, _ = mock_pair()
    params = SamplingParams(1.0)
    probs = exact.exact_sequence_probs(target, PROMPT, params, V, L)
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    counts = exact.sample_counts(Decoder(target), PROMPT, params, NgramPolicy(1, 2, k=2), N, L)
    assert chi_square_pvalue(counts, probs, N) < 1e-3


class Banned(MockLM):
    """A target that never emits `banned` (its logit is -inf in every context)."""

    banned = 3

    def forward(self, ids, n_logits: int = 1):
        logits, hidden = super().forward(ids, n_logits)
        logits[:, self.banned] = float("-inf")
        return logits, hidden


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(1.0, top_k=2), SamplingParams(0.0)],
                         ids=["t1", "topk2", "greedy"])
def test_a_copied_token_of_probability_zero_is_never_emitted(params):
    target = Banned(V, seed=0)
    prompt = [1, 3, 1, 3, 1]  # every lookup copies the banned token next
    dec = Decoder(target)
    drafted = 0
    for s in range(200):
        g = dec.generate(prompt, max_new_tokens=6, sampling=params, policy=NgramPolicy(1, 2, k=3), seed=s)
        assert Banned.banned not in g.token_ids
        drafted += g.metrics.by_source.n_drafted_by.get("ngram", 0)
    assert drafted > 0  # the banned token was proposed, and always rejected


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_with_copies_equals_greedy_target(k):
    target, draft = mock_pair(2, 5)
    dec = Decoder(target, draft)
    prompt = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2]
    ref = dec.generate(prompt, max_new_tokens=40, sampling=SamplingParams(0.0)).token_ids
    for pol in (NgramPolicy(1, 3, k=k, verify_steps=FLAT), NgramPolicy(2, 3, k=k, verify_steps=FLAT,
                                                                       fallback=FixedK(2), draft_steps=0.3)):
        g = dec.generate(prompt, max_new_tokens=40, sampling=SamplingParams(0.0), policy=pol)
        assert g.token_ids == ref
        assert g.metrics.by_source.n_drafted_by.get("ngram", 0) > 0


def test_a_policy_without_a_draft_model_runs_without_one_and_one_that_needs_it_is_refused():
    target, _ = mock_pair()
    g = Decoder(target).generate(PROMPT, max_new_tokens=8, sampling=SamplingParams(1.0),
                                 policy=NgramPolicy(1, 2, k=2))
    assert len(g.token_ids) == 8 and g.metrics.n_draft_forwards == 0
    with pytest.raises(UserError, match="drafts with a draft model; load one"):
        Decoder(target).generate(PROMPT, max_new_tokens=8, policy=NgramPolicy(1, 2, fallback=FixedK(2)))


def test_the_draft_catches_up_on_the_prompt_only_when_a_model_round_comes():
    target, draft = mock_pair()
    pol = NgramPolicy(1, 2, k=2, fallback=FixedK(2))
    g = Decoder(target, draft).generate(PROMPT, max_new_tokens=10, sampling=SamplingParams(1.0), policy=pol)
    assert g.metrics.draft_prefill_s == 0.0  # not prefilled up front
    if g.metrics.by_source.rounds_by.get("model"):
        assert draft.length >= len(PROMPT)


def test_ngram_settings_are_checked_before_anything_loads():
    p = policy_params("ngram")
    assert p.k == "auto" and not p.needs.draft_model and not p.needs.prefilled_draft
    with pytest.raises(UserError, match="--head, --threshold and --curve are read by the ngram policy only with"):
        policy_params("ngram", threshold=0.3)
    with pytest.raises(UserError, match="--fallback learned"):
        policy_params("ngram", fallback="learned")  # no head
    assert policy_params("ngram", fallback="learned", head="checkpoints/qwen-coder-0.5b-int8-stats-d3",
                         threshold=0.3).needs.draft_model
    assert make_policy("ngram", k=3).k == 3  # no pair: costs are not measured for a fixed k


MISSING = llamacpp.available()


@pytest.mark.skipif(MISSING is not None, reason=f"llama.cpp backend unavailable: {MISSING}")
@pytest.mark.parametrize("params,with_draft", [(SamplingParams(1.0), False), (SamplingParams(1.0, top_k=3), True)],
                         ids=["t1-ngram", "topk3-with-model"])
def test_distribution_is_exact_with_copied_drafts_on_llama_cpp(tmp_path, params, with_draft):
    t = save_gguf(make_model(V, hidden_size=16, layers=1, seed=3, logit_scale=3.0), tmp_path / "t.gguf")
    d = save_gguf(make_model(V, hidden_size=16, layers=1, seed=4, logit_scale=3.0), tmp_path / "d.gguf")
    target = llamacpp.LlamaCppLM(t, n_ctx=64, n_threads=1)
    draft = llamacpp.LlamaCppLM(d, n_ctx=64, n_threads=1) if with_draft else None
    probs = exact.exact_sequence_probs(target, PROMPT, params, V, L)
    pol = NgramPolicy(1, 2, k=2, fallback=FixedK(2) if with_draft else None)
    counts = exact.sample_counts(Decoder(target, draft), PROMPT, params, pol, N, L)
    assert chi_square_pvalue(counts, probs, N) > 1e-3


class CountingLM(MockLM):
    """Records how many tokens each forward was fed."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.fed = []

    def forward(self, ids, n_logits: int = 1):
        self.fed.append(len(ids))
        return super().forward(ids, n_logits)


def test_a_windowed_draft_prefills_only_its_window_and_keeps_the_output_exact():
    """--draft-context W: the draft sees the prompt's last W tokens; rejection sampling keeps the output
    the target's (chi-square by enumeration; greedy equality), only acceptance may change."""
    from adaptive_spec.backends.window import WindowedDraft

    target, inner = MockLM(V, seed=0), CountingLM(V, seed=1)
    draft = WindowedDraft(inner, 2)
    prompt = [1, 2, 3, 4, 0, 1, 2]
    params = SamplingParams(1.0, top_k=4)
    probs = exact.exact_sequence_probs(target, prompt, params, V, L)
    counts = exact.sample_counts(Decoder(target, draft), prompt, params, FixedK(2), N, L)
    assert chi_square_pvalue(counts, probs, N) > 1e-3
    inner.fed.clear()
    g = Decoder(target, draft).generate(prompt, max_new_tokens=12, sampling=SamplingParams(0.0), policy=FixedK(2))
    assert inner.fed[0] == 2 and max(inner.fed) <= 2  # the prefill fed the window only; steps feed 1-2 tokens
    assert draft.length == draft.skipped + inner.length and draft.skipped == len(prompt) - 1 - 2
    assert g.token_ids == Decoder(target).generate(prompt, max_new_tokens=12, sampling=SamplingParams(0.0)).token_ids
    assert draft.counters is inner.counters  # one set of counters: the decoder reads the runner that counts
