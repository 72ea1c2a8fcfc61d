"""Prompt lookup (n-gram) drafting: candidates copied from the context, verified like any draft.

A round's candidates are the tokens that followed the most recent earlier occurrence of the
context's last n tokens (n from ngram_max down to ngram_min) in the prompt plus the text so far
(transformers' prompt lookup, vLLM's ngram method, llama.cpp's ngram-simple). Copying costs no model
forward and no prefill: with no draft model loaded at all (`--draft none --policy ngram`) a user with
one GGUF file still gets speculation.

Exactness: a copied token is a proposal whose q is the one-hot of that token, so the one rejection
sampler (sampling.verify) accepts it with probability min(1, p(y)) and, after a rejection, draws the
residual: p without y, renormalised. A token the target gives probability 0 is never emitted.

How many copied tokens to verify. The peers verify a fixed number after every match (`k`: their
behaviour, for comparison). `k auto` weighs each one instead: with a_j the predicted probability that
copy j is accepted once copies 1..j-1 were, a round of K copies yields E(K) = 1 + sum_i prod_{j<=i} a_j
tokens for one target pass of K + 1 rows, which costs v(K + 1) one-row steps (measured on this
machine: costs.py; on CPUs v is a step function of K, not a line, so a 4-row pass can cost less than a
3-row one). The round takes the K that maximises E(K) - lambda v(K + 1), lambda being the throughput
this generation reaches so far in tokens per step (Dinkelbach's rule for the best long-run ratio of
tokens to time): a copy is worth verifying only while its expected tokens pay for its rows at the rate
the decode already gets. K = 0 when nothing pays: the round is the fallback's (the draft model under
its own stop rule, when one is loaded and its `auto` says it pays) or a plain target step.

a_j is learned within the generation, cheaply: the first copy's rate per match length and the later
copies' rate per position, each a running mean of p(y_j), the target's probability of copy y_j at the
positions verification reached (exactly its acceptance probability; 0 or 1 when greedy), shrunk to a
prior over the first few rounds.
"""
from __future__ import annotations

import time

import torch

from ..errors import UserError
from ..params import LearnedParams, NgramParams
from .auto import resolve_auto
from .costs import measure_costs
from .interfaces import DraftSource, DraftStep, PolicyContext, RoundOwner, RoundState, StopPolicy, lookup, register


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
        its length n); ([], 0) without a match. A copy that runs into the context's end continues with
        its own tokens (a repeated pattern repeats)."""
        L = len(tokens)
        for n in range(min(self.n_max, L), self.n_min - 1, -1):
            e = self.ends[n].get(tuple(tokens[L - n:]))
            if e is None:
                continue
            span: list[int] = []
            for j in range(k):
                at = e + j
                span.append(tokens[at] if at < L else span[at - L])
            return span, n
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


class _Exactly(StopPolicy):
    name = "exactly"

    def __init__(self, k: int):
        self.k_max = k


class CopyAcceptance:
    """Predicted acceptance of copied tokens, learned within a generation (see the module docstring).

    A copy's first token is predicted per (match length, streak), streak 1 when the last round was a
    copy accepted whole (the output is reproducing a span: the next copy usually goes on right), its
    later tokens per position (past LATER pooled). Each estimate is a running mean of the target's
    p(y) at the positions verification reached, shrunk to a prior with PRIOR_WEIGHT pseudo-rounds,
    plus an exploration bonus BONUS / sqrt(1 + count): a kind of copy not yet tried, or not tried for a
    while (every count decays by DECAY a round), is tried again, so copying that failed in a
    generation's preamble resumes where the answer starts reproducing the prompt."""

    PRIOR_WEIGHT = 1.0
    PRIOR_LATER = 0.85
    BONUS = 0.25
    DECAY = 0.95
    LATER = 4

    def __init__(self, n_max: int = 4):
        self.n_max = n_max
        self.first: dict[tuple, list[float]] = {}
        self.later: dict[int, list[float]] = {}

    def prior_first(self, n_match: int, streak: bool) -> float:
        # a longer match, or a copy continuing one that went right, is likelier to go on right
        return 0.85 if streak else 0.45 + 0.4 * n_match / self.n_max

    @classmethod
    def _estimate(cls, entry, prior: float) -> float:
        s, c = entry if entry is not None else (0.0, 0.0)
        return min(1.0, (s + cls.PRIOR_WEIGHT * prior) / (c + cls.PRIOR_WEIGHT) + cls.BONUS / (1.0 + c) ** 0.5)

    def predict(self, n_match: int, k: int, streak: bool = False) -> list[float]:
        a = [self._estimate(self.first.get((n_match, streak)), self.prior_first(n_match, streak))]
        for j in range(2, k + 1):
            a.append(self._estimate(self.later.get(min(j, self.LATER)), self.PRIOR_LATER))
        return a

    def observe(self, n_match: int, p_y: list[float], streak: bool = False) -> None:
        """p_y: the target's probability of copies 1..m, m the positions verification reached."""
        for j, p in enumerate(p_y, start=1):
            table, key = (self.first, (n_match, streak)) if j == 1 else (self.later, min(j, self.LATER))
            s, c = table.get(key, (0.0, 0.0))
            table[key] = [s + float(p), c + 1.0]

    def tick(self) -> None:
        """One round passed: older evidence weighs less."""
        for table in (self.first, self.later):
            for entry in table.values():
                entry[0] *= self.DECAY
                entry[1] *= self.DECAY


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

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4, k: int | str = "auto", k_max: int = 16,
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
        self.draft_steps = draft_steps
        self.needs_draft = fallback is not None
        self.prefill_draft = False  # the draft catches up in its first round: copying rounds never need it
        self.reset()

    def reset(self) -> None:
        self.index.reset()
        self.acceptance = CopyAcceptance(self.index.n_max)
        self.streak = False  # the last round was a copy accepted whole
        # lambda: tokens per one-row step so far, from a prior of the target alone (one token a step)
        self.tokens_done, self.steps_done = 4.0, 4.0
        self.model_rounds, self.model_tokens, self.model_steps = 0, 0.0, 0.0  # the fallback's rounds so far
        if self.fallback is not None:
            self.fallback.reset()

    @property
    def lam(self) -> float:
        return self.tokens_done / self.steps_done

    def run_round(self, state: RoundState) -> list[int]:
        t0 = time.perf_counter()
        cap = min(self.k_max if self.k == "auto" else self.k, state.remaining - 1)
        span, n_match = ([], 0)
        if cap > 0:
            self.index.update(state.tokens)
            span, n_match = self.index.lookup(state.tokens, cap)
        self.acceptance.tick()
        K = self._choose(span, n_match)
        if K:
            source = SpanSource(span[:K], state.target.vocab_size, state.seq.device)
        state.met.draft_other_s += time.perf_counter() - t0
        if K:
            new = state.decoder.chain_round(state, _Exactly(K), source=source)
            n = len(new) - 1
            m = min(n + 1, K)  # the copies verification reached
            p_y = state.p_y[:m].tolist()
            self.acceptance.observe(n_match, p_y, self.streak)
            self.streak = n == K
            self._account(len(new), self.v(K + 1))
            return new
        self.streak = False
        if self.fallback is not None:
            before = state.met.n_drafted
            new = state.decoder.chain_round(state, self.fallback)
            k_drafted = state.met.n_drafted - before
            cost = (self.draft_steps or 0.0) * k_drafted + self.v(k_drafted + 1)
            self.model_rounds += 1
            self.model_tokens += len(new)
            self.model_steps += cost
            self._account(len(new), cost)
            return new
        self._account(1, self.v(1))
        state.book(0, 0)  # a round of no candidates: the target's token alone
        return state.decoder.target_step(state)

    def _choose(self, span: list[int], n_match: int) -> int:
        if not span:
            return 0
        if self.k != "auto":
            return len(span)
        K, value = best_k(self.acceptance.predict(n_match, len(span), self.streak), self.v, self.lam)
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


def verify_steps_of(costs):
    """v(n) in one-row steps from measured Costs (costs.py): the per-length table where measured."""
    base = costs.verify_s(1)
    return lambda n: costs.verify_s(n) / base


@register("ngram")
def _make_ngram(p: NgramParams, ctx: PolicyContext):
    pair = ctx.pair
    fallback = None
    costs = None
    if p.fallback == "learned":
        if pair is None or getattr(pair, "draft", None) is None:
            raise UserError("--fallback learned drafts with the draft model in the rounds nothing is copied; load "
                            "a draft (--draft default) or use --fallback none")
        lp, _ = resolve_auto(pair, p.fallback_params(), temperature=getattr(ctx.sampling, "temperature", None))
        if lp is not None:  # None: auto found that the draft model does not pay on this machine
            fallback = lookup("learned")(lp, ctx)
    if pair is not None and (p.k == "auto" or fallback is not None):
        costs = measure_costs(pair)
    return NgramPolicy(p.ngram_min, p.ngram_max, p.k, p.k_max,
                       verify_steps=verify_steps_of(costs) if costs is not None else None, fallback=fallback,
                       draft_steps=costs.c if costs is not None and costs.t_draft > 0 else None)
