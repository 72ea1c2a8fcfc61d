"""Autoregressive and speculative decoding over a KV-cached draft/target pair.

One speculation round (Algorithm 2 of SpecDec++; Leviathan et al. 2023; Chen et al. 2023):
  1. the draft proposes y_1..y_K, y_i ~ q_i, K chosen by a StopPolicy;
  2. the target scores all K in one forward pass, giving p_1..p_{K+1};
  3. `sampling.verify` accepts a prefix of n tokens and draws one more token (the residual
     after a rejection, the bonus token when all K are accepted);
  4. both KV caches are cropped to the accepted prefix: nothing accepted is recomputed.

Cache invariant for both models: the cache covers seq[:m.length] and seq[m.length:] (at least
one token) is fed by the next forward. The target therefore always feeds the last accepted
token plus the K candidates, and the draft feeds whatever the last round left pending (one
token, or two when all candidates were accepted: y_K, never fed to the draft, and the bonus).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .errors import UserError
from .models import CausalLM
from .policies import DraftStep, StopPolicy
from .sampling import SamplingParams, process_logits, sample, verify


@dataclass
class Metrics:
    """Counts and times of one generation (names follow the SpecDec++ paper)."""

    n_tokens: int = 0  # N: new tokens
    n_draft_forwards: int = 0  # N_draft
    n_target_forwards: int = 0  # N_target
    n_drafted: int = 0  # candidate tokens sent to verification
    n_accepted: int = 0
    n_discarded: int = 0  # N_discarded: drafted and rejected (or after a rejection)
    accepted_hist: dict = field(default_factory=dict)  # n accepted in a round -> rounds
    wall_s: float = 0.0
    draft_s: float = 0.0  # inside draft forward passes
    target_s: float = 0.0  # inside target forward passes
    policy_s: float = 0.0  # inside the stop policy (e.g. the acceptance head)
    prefill_s: float = 0.0  # prompt forward passes (both models), part of draft_s/target_s
    hindsight_s: float = 0.0  # the oracle's untimed hindsight work (re-deriving X), kept out of wall_s

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.draft_s - self.target_s)

    @property
    def discard_rate(self) -> float:
        return self.n_discarded / max(self.n_tokens, 1)

    @property
    def verification_rate(self) -> float:
        return self.n_target_forwards / max(self.n_tokens, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else float("nan")

    @property
    def tokens_per_target_forward(self) -> float:
        return self.n_tokens / max(self.n_target_forwards, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.wall_s if self.wall_s else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accepted_hist"] = {str(k): v for k, v in sorted(self.accepted_hist.items())}
        for k in ("discard_rate", "verification_rate", "acceptance_rate", "tokens_per_target_forward",
                  "tokens_per_s", "other_s"):
            d[k] = getattr(self, k)
        return d

    def summary(self) -> str:
        s = (f"N={self.n_tokens} tok  {self.tokens_per_s:.2f} tok/s  wall {self.wall_s:.2f}s "
             f"(draft {self.draft_s:.2f}s, target {self.target_s:.2f}s, other {self.other_s:.2f}s)  "
             f"N_target/N={self.verification_rate:.3f}")
        if self.n_drafted:
            s += (f"  N_discarded/N={self.discard_rate:.3f}  accept={self.acceptance_rate:.3f}  "
                  f"tok/target-pass={self.tokens_per_target_forward:.2f}")
        return s


@dataclass
class Generation:
    token_ids: list[int]
    metrics: Metrics
    text: str | None = None
    stopped_by: str = "length"  # "eos" or "length"


class Decoder:
    """Generates from `target`, optionally drafting with `draft` under a StopPolicy.

    `generate(prompt_ids, policy=None)` is plain autoregressive decoding of the target;
    with a policy it is speculative decoding, whose output distribution is exactly the
    target's (for the same SamplingParams).
    """

    def __init__(self, target: CausalLM, draft: CausalLM | None = None, eos_token_ids=()):
        self.target = target
        self.draft = draft
        self.eos = set(int(e) for e in eos_token_ids)
        self.device = target.device
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise UserError(f"draft and target must score the same vocabulary ({draft.vocab_size} vs "
                            f"{target.vocab_size}); load them with SpecPair, which checks the vocabularies")

    def _check_prompt(self, prompt_ids: list[int], max_new_tokens: int):
        if len(prompt_ids) == 0:
            raise UserError("the prompt is empty; pass at least one token of prompt text")
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        for m, role in ((self.target, "target"), (self.draft, "draft")):
            if m is not None and m.max_length and len(prompt_ids) >= m.max_length:
                raise UserError(f"the prompt has {len(prompt_ids)} tokens but the {role} model's context is "
                                f"{m.max_length}; shorten the prompt")
        limits = [m.max_length for m in (self.target, self.draft) if m is not None and m.max_length]
        if limits:
            # rounds never draft past max_new_tokens, so this keeps every position in context
            max_new_tokens = min(max_new_tokens, min(limits) - len(prompt_ids))
        return max_new_tokens

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        policy: StopPolicy | None = None,
        seed: int | None = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> Generation:
        if policy is not None and self.draft is None:
            raise UserError("speculative decoding needs a draft model; pass one or use the 'ar' policy")
        max_new_tokens = self._check_prompt(prompt_ids, max_new_tokens)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed if seed is not None else torch.seed())
        met = Metrics()
        models = [self.target] + ([self.draft] if policy is not None else [])
        for m in models:
            m.reset()
        if policy is not None:
            policy.reset()
        t_start = time.perf_counter()
        seq = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        n_prompt = len(prompt_ids)
        # prefill everything but the last prompt token, which the first step feeds
        for m in models:
            m.fwd_time, m.n_forwards = 0.0, 0
            if n_prompt > 1:
                m.forward(seq[:-1], n_logits=0)
        met.prefill_s = sum(m.fwd_time for m in models)
        for m in models:  # count decoding forwards only; prefill time stays in the forward time
            m.n_forwards = 0
        out: list[int] = []
        stopped_by = "length"
        hist: Counter = Counter()
        while len(out) < max_new_tokens:
            remaining = max_new_tokens - len(out)
            if policy is None:
                logits, _ = self.target.forward(seq[self.target.length:], n_logits=1)
                new = [int(sample(process_logits(logits[0], sampling), gen))]
            else:
                # policies that draft something other than one sequence (trees, several drafts)
                # bring their own round; they share the caches, metrics and stopping rules here
                if hasattr(policy, "run_round"):
                    new = policy.run_round(self, seq, len(out), remaining, sampling, gen, met, hist)
                else:
                    new = self._round(seq, len(out), remaining, sampling, policy, gen, met, hist)
            # cut at EOS and at the length limit; the caches may hold tokens past the cut,
            # which is harmless because generation stops here
            for j, t in enumerate(new):
                if t in self.eos:
                    new = new[: j + 1]
                    stopped_by = "eos"
                    break
            new = new[:remaining]
            out.extend(new)
            seq = torch.cat([seq, torch.tensor(new, dtype=torch.long, device=self.device)])
            if on_tokens is not None:
                on_tokens(new)
            if stopped_by == "eos":
                break
        met.wall_s = time.perf_counter() - t_start - met.hindsight_s
        met.n_tokens = len(out)
        met.target_s = self.target.fwd_time
        met.n_target_forwards = self.target.n_forwards
        if policy is not None:
            met.draft_s = self.draft.fwd_time
            met.n_draft_forwards = self.draft.n_forwards
        met.accepted_hist = dict(hist)
        return Generation(token_ids=out, metrics=met, stopped_by=stopped_by)

    def _round(self, seq, pos, remaining, sampling, policy, gen, met, hist) -> list[int]:
        """One speculation round; returns the new tokens (accepted candidates + one).

        A `run_round(decoder, seq, pos, remaining, sampling, gen, met, hist)` on the policy
        replaces this; it must leave both caches covering exactly the accepted prefix
        (seq + new tokens but the last), count its forwards in the models' counters, and add
        to met.n_drafted / n_accepted / n_discarded and hist as this does."""
        draft, target = self.draft, self.target
        L = seq.shape[0]
        # the round adds at most K + 1 tokens: never draft past the length limit
        k_cap = max(0, min(policy.begin_round(pos), remaining - 1))
        ys, qs = [], []
        inp = seq[draft.length:]
        for i in range(1, k_cap + 1):
            logits, hidden = draft.forward(inp, n_logits=1)
            q_i = process_logits(logits[0], sampling)
            y_i = sample(q_i, gen)
            ys.append(y_i)
            qs.append(q_i)
            t0 = time.perf_counter()
            stop = policy.should_stop(DraftStep(i, y_i, q_i, logits[0], hidden, pos + i - 1))
            met.policy_s += time.perf_counter() - t0
            if stop:
                break
            inp = y_i.view(1)
        K = len(ys)
        y = torch.stack(ys) if K else seq.new_empty(0)
        # the target scores the pending token(s) and all K candidates in one pass
        logits_p, _ = target.forward(torch.cat([seq[target.length:], y]), n_logits=K + 1)
        p = process_logits(logits_p, sampling)
        q = torch.stack(qs) if K else p.new_empty(0, p.shape[-1])
        n_t, tok_t = verify(y, q, p, gen)
        # the round's one host sync: read n, the new token and the candidates together
        vals = torch.cat([n_t.view(1), tok_t.view(1), y]).tolist()
        n, tok = vals[0], vals[1]
        # keep the accepted prefix in both caches; the new token is fed next round
        target.rollback(L + n)
        draft.rollback(min(draft.length, L + n))
        met.n_drafted += K
        met.n_accepted += n
        met.n_discarded += K - n
        hist[n] += 1
        policy.end_round(K, n)
        return vals[2:2 + n] + [tok]
