"""Prompt lookup (n-gram) drafting: candidates copied from the context, verified like any draft.

A round's candidates are the tokens that followed the most recent earlier occurrence of the context's
last n tokens (n from ngram_max down to ngram_min) in the prompt plus the text so far (as transformers'
prompt lookup, vLLM's ngram method, llama.cpp's ngram-simple). Copying costs no forward, so even a target
alone gets speculation. A copied token's q is its one-hot: the one rejection sampler accepts it with
probability min(1, p(y)) and otherwise draws p without y, renormalised: exact.

How many copies to verify: a fixed `k` (as the peers), or `k auto`: with a_j the predicted probability that
copy j is accepted once 1..j-1 were (CopyAcceptance), K copies yield E(K) = 1 + sum_i prod_{j<=i} a_j tokens
for a pass of K + 1 rows costing v(K + 1) one-row steps (auto/costs.py). The round takes the K maximising
E(K) - lambda v(K + 1), lambda the tokens per step this generation reaches so far (Dinkelbach's rule for the
best long-run ratio), and at most l copies, l the match's length (a repeat is about as likely to end in its
next l tokens as it was to have lasted l). K = 0 when nothing pays: the round is the fallback's (the draft
model under its own stop rule) or a plain target step."""
from __future__ import annotations

import bisect

import torch

from ..errors import UserError
from ..params import NgramParams
from .. import registry
from .interfaces import (CapOnly, DraftSource, DraftStep, Needs, PolicyContext, RoundOwner, RoundState, StopPolicy,
                         register)


MATCH_CAP = 64  # how far back a match's length is counted (it caps a copy's length too: NgramPolicy._choose)


class NgramIndex:
    """For n in n_min..n_max, the latest end e of each n-gram tokens[e - n:e] that has a next token
    (e < len(tokens)), kept up to date as the context grows: a lookup is n_max - n_min + 1 dict reads,
    whatever the context's length, and each new token costs as many inserts."""

    def __init__(self, n_min: int, n_max: int):
        if not 1 <= n_min <= n_max:
            raise UserError(f"ngram_min must be in 1..ngram_max, got ngram_min {n_min}, ngram_max {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.reset()

    def reset(self) -> None:
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in range(self.n_min, self.n_max + 1)}
        self.upto = 0  # ends e < upto are indexed
        self.context: list[int] | None = None

    def update(self, tokens: list[int]) -> None:
        if self.context is not tokens or len(tokens) < self.upto:
            self.reset()  # another generation's context
            self.context = tokens
        for e in range(max(self.upto, self.n_min), len(tokens)):
            for n in range(self.n_min, min(self.n_max, e) + 1):
                self.ends[n][tuple(tokens[e - n:e])] = e
        self.upto = max(self.upto, len(tokens))

    def lookup(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the latest earlier occurrence of the longest matching suffix,
        the match's length); ([], 0) without a match. The length counts past ngram_max as far as the two
        texts agree backwards (up to MATCH_CAP): how far the context's end already repeats the text the
        copy comes from. A copy that runs into the context's end continues with its own tokens (a
        repeated pattern repeats)."""
        L = len(tokens)
        for n in range(min(self.n_max, L), self.n_min - 1, -1):
            e = self.ends[n].get(tuple(tokens[L - n:]))
            if e is None:
                continue
            span: list[int] = []
            for j in range(k):
                at = e + j
                span.append(tokens[at] if at < L else span[at - L])
            match = n
            while match < MATCH_CAP and e - match - 1 >= 0 and tokens[e - match - 1] == tokens[L - match - 1]:
                match += 1
            return span, match
        return [], 0


class SpanSource(DraftSource):
    """A copied span as a draft source: y_i the span's i-th token, q_i its one-hot."""

    name = "ngram"

    def __init__(self, span: list[int], vocab_size: int, device):
        self.tokens = torch.tensor(span, dtype=torch.long, device=device)
        self.q = torch.zeros(len(span), vocab_size, device=device).scatter_(1, self.tokens.view(-1, 1), 1.0)

    def step(self, state: RoundState, i: int, ys: list) -> DraftStep | None:
        if i > self.tokens.shape[0]:
            return None
        return DraftStep(i, self.tokens[i - 1], self.q[i - 1], None, None, state.pos + i - 1, state.sampling,
                         source=self.name)


class _Exactly(CapOnly):
    name = "exactly"

    def __init__(self, k: int):
        self.k_max = k


class CopyAcceptance:
    """Predicted acceptance of copied tokens: a function of the match length, learned within a generation.

    The signal is l, how far the context's end already repeats the text the copy comes from (the match extended
    backwards, up to MATCH_CAP). Copy j of a round is accepted (given 1..j-1 were) about as often as a copy whose
    match is l + j - 1 long, so one rate per length bucket predicts every position: once an answer reproduces a
    span it goes on reproducing it. PRIORS come from dev data (none of the benchmark sets), PRIOR_WEIGHT
    pseudo-rounds each; then each bucket's running mean of the target's p(y) at the positions verification
    reached (the acceptance probability of a one-hot q) moves them."""

    BUCKETS = (1, 2, 3, 4, 8, 16)  # a bucket holds the lengths from its value to the next one's
    PRIORS = (0.3, 0.6, 0.6, 0.65, 0.85, 0.97)
    PRIOR_WEIGHT = 4.0

    def __init__(self):
        self.sums = [0.0] * len(self.BUCKETS)
        self.counts = [0.0] * len(self.BUCKETS)

    @classmethod
    def bucket(cls, length: int) -> int:
        return max(0, bisect.bisect_right(cls.BUCKETS, length) - 1)

    def rate(self, length: int) -> float:
        b = self.bucket(length)
        return (self.sums[b] + self.PRIOR_WEIGHT * self.PRIORS[b]) / (self.counts[b] + self.PRIOR_WEIGHT)

    def predict(self, match: int, k: int) -> list[float]:
        """a_1..a_k for a copy whose match is `match` tokens long."""
        return [self.rate(match + j) for j in range(k)]

    def observe(self, match: int, p_y: list[float]) -> None:
        """p_y: the target's probability of copies 1..m, m the positions verification reached."""
        for j, p in enumerate(p_y):
            b = self.bucket(match + j)
            self.sums[b] += float(p)
            self.counts[b] += 1.0


def best_k(a: list[float], v, lam: float) -> tuple[int, float]:
    """(K, E(K) - lam v(K + 1)) maximising it over K = 1..len(a) (module docstring); v(n) a pass of n
    rows in one-row steps. K = 0 (value 1 - lam v(1), a plain step) where no copy pays more."""
    best, value = 0, 1.0 - lam * v(1)
    expected, run = 1.0, 1.0
    for k, a_k in enumerate(a, start=1):
        run *= a_k
        expected += run
        val = expected - lam * v(k + 1)
        if val > value + 1e-12:
            best, value = k, val
    return best, value


class NgramPolicy(RoundOwner):
    """Prompt-lookup drafting, alone or with the draft model in the rounds nothing is copied."""

    name = "ngram"

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4, k: int | str = "auto", k_max: int = 48,
                 verify_steps=None, fallback: StopPolicy | None = None, draft_steps: float | None = None):
        """verify_steps(n): a target pass of n rows in one-row steps (k auto; default: every row a step,
        i.e. no copy ever pays); fallback: the stop rule of the draft model's rounds (None: a plain
        target step); draft_steps: a draft step in target steps (for pricing the fallback's rounds)."""
        if k != "auto" and (not isinstance(k, int) or k < 1):
            raise UserError(f"the ngram policy's k must be an integer >= 1 or auto, got {k!r}")
        self.index = NgramIndex(ngram_min, ngram_max)
        self.k, self.k_max = k, k_max
        self.v = verify_steps or (lambda n: float(n))
        self.fallback = fallback
        self.graph_head = None if fallback is None else fallback.graph_head
        self.draft_steps = draft_steps
        # the draft catches up on the prompt in its first model round: copying rounds never need it
        self.needs = Needs(draft_model=fallback is not None, prefilled_draft=False)
        self.reset()

    def reset(self) -> None:
        self.index.reset()
        self.acceptance = CopyAcceptance()
        # lambda: tokens per one-row step so far, from a prior of the target alone (one token a step)
        self.tokens_done, self.steps_done = 4.0, 4.0
        self.model_rounds, self.model_tokens, self.model_steps = 0, 0.0, 0.0  # the fallback's rounds so far
        if self.fallback is not None:
            self.fallback.reset()

    @property
    def lam(self) -> float:
        return self.tokens_done / self.steps_done

    def propose(self, tokens: list[int], remaining: int) -> tuple[list[int], int, int]:
        """(the copy found for `tokens`, its match's length, K: how many of it to verify; 0 where none pays)
        with `remaining` tokens left to generate."""
        cap = min(self.k_max if self.k == "auto" else self.k, remaining - 1)
        span, n_match = ([], 0)
        if cap > 0:
            self.index.update(tokens)
            span, n_match = self.index.lookup(tokens, cap)
        return span, n_match, self._choose(span, n_match)

    def learn(self, n_match: int, K: int, p_y: list[float], n_tokens: int) -> None:
        """After a round of K copies (a match of n_match tokens) made n_tokens: p_y, the target's probability
        of the copies verification reached, moves the copy rates; the round's tokens and steps, lambda."""
        self.acceptance.observe(n_match, p_y)
        self._account(n_tokens, self.v(K + 1))

    def learn_model(self, n_tokens: int, k_drafted: int) -> None:
        """After a round of the draft model (the fallback) drafted k_drafted and made n_tokens: its value so far
        (what a copy must beat, _choose) and lambda."""
        cost = (self.draft_steps or 0.0) * k_drafted + self.v(k_drafted + 1)
        self.model_rounds += 1
        self.model_tokens += n_tokens
        self.model_steps += cost
        self._account(n_tokens, cost)

    def run_round(self, state: RoundState) -> list[int]:
        span, n_match, K = self.propose(state.tokens, state.remaining)
        source = SpanSource(span[:K], state.target.vocab_size, state.seq.device) if K else None
        state.met.lap("draft_other")
        if K:
            new = state.decoder.chain_round(state, _Exactly(K), source=source)
            m = min(len(new), K)  # the copies verification reached
            self.learn(n_match, K, state.p_y[:m].tolist(), len(new))
            return new
        if self.fallback is not None:
            before = state.met.n_drafted
            new = state.decoder.chain_round(state, self.fallback)
            self.learn_model(len(new), state.met.n_drafted - before)
            return new
        self.learn(0, 0, [], 1)
        state.book(0, 0)  # a round of no candidates: the target's token alone
        return state.decoder.target_step(state)

    def _choose(self, span: list[int], n_match: int) -> int:
        if not span:
            return 0
        if self.k != "auto":
            return len(span)
        # at most as many copies as already match (the module docstring says why)
        span = span[:max(1, n_match)]
        K, value = best_k(self.acceptance.predict(n_match, len(span)), self.v, self.lam)
        if K and self.fallback is not None and self.model_rounds:
            # a copy must also beat a round of the draft model, valued as those rounds went so far
            model_value = (self.model_tokens - self.lam * self.model_steps) / self.model_rounds
            if model_value > value:
                return 0
        return K

    def _account(self, tokens: int, steps: float) -> None:
        self.tokens_done += tokens
        self.steps_done += steps

    def describe(self) -> dict:
        d = {"policy": self.name, "k": self.k, "ngram_min": self.index.n_min, "ngram_max": self.index.n_max,
             "k_max": self.k_max}
        if self.fallback is not None:
            d["fallback"] = self.fallback.describe()
        return d


def replay_copies(policy: NgramPolicy, prompt: list[int], response: list[int], model_round=None) -> dict:
    """Prompt lookup run offline along a target response X (no model): the counts its rounds would have, named as
    a sweep row's (timemodel.predict_time prices them). Each round copies what `policy` copies and accepts the
    copies X repeats: a copy is a function of the context, so that indicator is an unbiased sample of the
    probability that verification accepts them, and stands in for p(y) where the policy learns its rates.

    model_round(s, remaining) -> (drafted, accepted): the rounds nothing is copied in run the draft model (a
    fallback), as that callback samples them at position s. The draft's first step of a model round then feeds
    every token it has not seen: counted as n_all_accepted (one such step each) and n_fed_extra (beyond two)."""
    policy.reset()
    tokens = list(prompt)
    T, s = len(response), 0
    rounds = drafted = accepted = draft_forwards = wide = extra = 0
    unseen = 1  # tokens the draft has not fed: the last one (its prompt is priced as its prefill)
    hist: dict[str, int] = {}
    while s < T:
        span, n_match, K = policy.propose(tokens, T - s)
        if K or model_round is None:
            a = next((j for j in range(K) if span[j] != response[s + j]), K)  # the copies X repeats
            policy.learn(n_match, K, [1.0] * a + [0.0] * (a < K), a + 1)
            unseen += a + 1
        else:
            K, a = model_round(s, T - s)
            policy.learn_model(a + 1, K)
            if K:
                draft_forwards += K
                wide += unseen >= 2
                extra += max(unseen - 2, 0)
                unseen = 2 if a == K else 1
            else:
                unseen += 1
        rounds, drafted, accepted = rounds + 1, drafted + K, accepted + a
        hist[str(K + 1)] = hist.get(str(K + 1), 0) + 1
        tokens.extend(response[s:s + a + 1])
        s += a + 1
    out = {"n_tokens": T, "n_target_forwards": rounds, "n_draft_forwards": draft_forwards, "n_drafted": drafted,
           "n_accepted": accepted, "target_pass_hist": hist}
    return out if model_round is None else {**out, "n_all_accepted": wide, "n_fed_extra": extra}


def verify_steps_of(costs):
    """v(n) in one-row steps from measured Costs (auto/costs.py): the per-length table where measured."""
    base = costs.verify_s(1)
    return lambda n: costs.verify_s(n) / base


@register("ngram")
def _make_ngram(p: NgramParams, ctx: PolicyContext):
    pair, fallback, costs = ctx.pair, None, None
    if p.fallback == "learned":
        if pair is None or getattr(pair, "draft", None) is None:
            raise UserError("--fallback learned drafts with the draft model in the rounds nothing is copied; load "
                            "a draft (--draft default) or use --fallback none")
        lp, _ = ctx.resolve_auto(pair, p.fallback_params(), temperature=getattr(ctx.sampling, "temperature", None))
        if lp is not None:  # None: auto found that the draft model does not pay on this machine
            fallback = registry.factory("learned")(lp, ctx)
    if pair is not None and (p.k == "auto" or fallback is not None):
        costs = ctx.measure_costs(pair)
    return NgramPolicy(p.ngram_min, p.ngram_max, p.k, p.k_max,
                       verify_steps=verify_steps_of(costs) if costs is not None else None, fallback=fallback,
                       draft_steps=costs.c if costs is not None and costs.t_draft > 0 else None)
