"""Autoregressive and speculative decoding over a KV-cached draft/target pair (the round: docs/design.md,
"The decoding round"). A RoundOwner policy (trees, several drafts) replaces the chain round with its own;
the decoder keeps the caches, the cut at EOS and the metrics common to all.

Cache invariant for both models: the cache covers seq[:m.length] and seq[m.length:] (at least one token)
is fed by the next forward. The target therefore always feeds the last accepted token plus the K
candidates, and the draft whatever the last round left pending (one token, or two when all candidates
were accepted: y_K, never fed to the draft, and the bonus)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..backends.contract import HeadRunner, Runner
from ..errors import UserError
from .graph_round import GraphRound, run_epilogue
from .interfaces import DraftSource, DraftStep, Policy, RoundOwner, RoundState, StopPolicy
from .metrics import Extra, Generation, Metrics
from .sampling import SamplingParams, draw, process_logits, verify, verify_greedy

HOST_READS = ("auto", "token", "round")  # or an integer N: a device round that reads its stop every N tokens


class Decoder:
    """Generates from `target`, optionally drafting with `draft` under a policy.

    `generate(prompt_ids, policy=None)` is plain autoregressive decoding of the target; with a
    StopPolicy it is chain speculative decoding, with a RoundOwner whatever round that policy
    runs. Either way the output distribution is exactly the target's (for the same SamplingParams)."""

    def __init__(self, target: Runner, draft: Runner | None = None, eos_token_ids=(), host_reads: str | int = "auto"):
        """`host_reads`: "round" decides a model-drafted chain's stop on the device and reads the device once a
        round (graph_round.py); "token" asks the stop rule on the host after each drafted token (its
        decision is read then); "auto": "round" on CUDA, where a read stalls the device's queue, "token"
        elsewhere, where there is no queue to stall and the CPU's sparse top-k (one read) is the faster one.
        An integer N: a device round that reads whether the rule has stopped after every N drafted tokens (no
        cap to learn, at most N - 1 steps drafted past the stop, a read per N tokens)."""
        if not (host_reads in HOST_READS or (type(host_reads) is int and host_reads >= 1)):
            raise UserError(f"host_reads must be one of {', '.join(HOST_READS)} or an integer N >= 1 (read the "
                            f"stop every N drafted tokens), got {host_reads!r}")
        self.target = target
        self.draft = draft
        self.eos = set(int(e) for e in eos_token_ids)
        self.host_reads = host_reads if host_reads != "auto" else (
            "round" if getattr(target.device, "type", "cpu") == "cuda" else "token")
        self.graph_round = GraphRound()
        # once, not per round: a Protocol isinstance reads every member
        self.draft_runs_heads = isinstance(draft, HeadRunner)
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
            if m is not None and m.max_length:
                if len(prompt_ids) >= m.max_length:
                    raise UserError(f"the prompt has {len(prompt_ids)} tokens but the {role} model's context is "
                                    f"{m.max_length}; shorten the prompt")
                # rounds never draft past max_new_tokens, so this keeps every position in context
                max_new_tokens = min(max_new_tokens, m.max_length - len(prompt_ids))
        return max_new_tokens

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        policy: Policy | None = None,
        seed: int | None = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
        extras: Sequence[Extra] = (),
    ) -> Generation:
        """`extras`: bookkeeping to attach to the generation's Metrics (metrics.Extra: replay.TraceRecorder)."""
        needs = policy.needs if policy is not None else None
        uses_draft = needs is not None and needs.draft_model
        if uses_draft and self.draft is None:
            raise UserError(f"the {getattr(policy, 'name', 'speculative')} policy drafts with a draft model; load one, "
                            "or use a policy that needs none (ngram, ar)")
        max_new_tokens = self._check_prompt(prompt_ids, max_new_tokens)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed if seed is not None else torch.seed())
        models = [self.target] + ([self.draft] if self.draft is not None and policy is not None else [])
        for m in models:
            m.reset()
        if policy is not None:
            policy.reset()
        self.graph_round.reset()
        met = Metrics(extras=list(extras))
        met.start_clock(self.device)
        seq = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        # a policy may draft with the model in some rounds only (ngram with a model fallback): its draft
        # catches up on the prompt in its first model round, so a generation that never needs it never pays
        eager = [self.target] + ([self.draft] if uses_draft and needs.prefilled_draft else [])
        self._prefill(eager, seq, met)
        met.lap("prefill")
        out: list[int] = []
        tokens = list(prompt_ids)  # seq as a host list, for sources that read the context (n-gram lookup)
        stopped_by = "length"
        while len(out) < max_new_tokens and stopped_by != "eos":
            state = RoundState(decoder=self, seq=seq, pos=len(out), remaining=max_new_tokens - len(out),
                               sampling=sampling, gen=gen, met=met, tokens=tokens)
            new, eos = self._cut(self._round(state, policy), state)
            stopped_by = "eos" if eos else stopped_by
            out.extend(new)
            tokens.extend(new)
            met.first_token_s = met.first_token_s or met.elapsed()
            seq = torch.cat([seq, torch.tensor(new, dtype=torch.long, device=self.device)])
            if on_tokens is not None:
                on_tokens(new)
            met.lap("rest")
        met.stop_clock()
        self._count(met, out, policy is not None)
        return Generation(token_ids=out, metrics=met, stopped_by=stopped_by, policy=policy)

    def _prefill(self, models, seq: torch.Tensor, met: Metrics) -> None:
        """Feed everything but the last prompt token (the first round feeds it); `met` books the time it
        took, per model. Counters then restart, so they count decoding forwards."""
        for m in (self.target, self.draft):
            if m is not None:
                m.counters.restart()
        for m in models:
            if seq.shape[0] > 1:
                m.forward(seq[:-1], n_logits=0)
        for m in models:  # prefill time stays in the forward time (and is kept per model)
            m.counters.end_prefill()
        t_prefill = self.target.counters.prefill_s
        d_prefill = self.draft.counters.prefill_s if self.draft is not None and self.draft in models else 0.0
        met.prefill_s, met.target_prefill_s, met.draft_prefill_s = t_prefill + d_prefill, t_prefill, d_prefill

    def _round(self, state: RoundState, policy: Policy | None) -> list[int]:
        if policy is None:
            return self.target_step(state)
        if isinstance(policy, RoundOwner):
            state.met.lap("rest")
            new = policy.run_round(state)
            state.met.lap("round")  # what the owner's chain rounds did not lap themselves
            return new
        return self.chain_round(state, policy)

    def _cut(self, new: list[int], state: RoundState) -> tuple[list[int], bool]:
        """`new` cut after its first EOS and at the length limit, and whether an EOS ended it.

        The caches may hold tokens past the cut, which is harmless because generation stops
        here. Candidates cut away were never emitted: they move from accepted to discarded."""
        eos_at = next((j for j, t in enumerate(new) if t in self.eos), None)
        keep = min(len(new) if eos_at is None else eos_at + 1, state.remaining)
        if keep < len(new):
            state.met.book_cut(len(new) - 1, keep)
        return new[:keep], eos_at is not None and eos_at < keep

    def _count(self, met: Metrics, out: list[int], speculative: bool) -> None:
        met.n_tokens = len(out)
        met.target_s = self.target.counters.seconds
        met.n_target_forwards = self.target.counters.n_forwards
        if speculative and self.draft is not None:
            met.draft_s = self.draft.counters.seconds
            met.n_draft_forwards = self.draft.counters.n_forwards

    def target_step(self, state: RoundState) -> list[int]:
        """One plain target step: the next token, no drafting."""
        ids = state.seq[self.target.length:]
        state.met.lap("rest")
        logits, _ = self.target.forward(ids, n_logits=1)
        state.met.lap("target_forward")
        state.met.count_pass(ids.shape[0])
        sp = state.sampling
        # greedy: the argmax, without building the one-hot `process_logits` would give
        tok = (logits[0].argmax() if sp.greedy
               else draw(process_logits(logits[0], sp, sync_free=self.host_reads != "token"), sp, state.gen))
        state.met.host_reads += 1
        state.met.lap("verify_other")
        return [int(tok)]

    def chain_round(self, state: RoundState, rule: StopPolicy, source: DraftSource | None = None) -> list[int]:
        """One speculation round of a chain drafted by `source` (default: the draft model) under the
        stop rule; returns the new tokens (accepted candidates + one). Leaves both caches covering
        exactly the accepted prefix. Its two halves, `verified_chain` and `keep`, are the round's parts a
        replay (replay.py) runs with the recorded outcome in between."""
        source = source or self.model_source(rule)
        # the round adds at most K + 1 tokens: never draft past the length limit
        k_cap = max(0, min(rule.begin_round(state.pos), state.remaining - 1))
        K, n, ys, tok = self.verified_chain(state, rule, k_cap, source)
        return self.keep(state, rule, source.name, K, n, ys, tok)

    def model_source(self, rule: StopPolicy) -> "ModelSource":
        """The draft model as the round's source, its rule's head inside the draft's forward where it can run one."""
        return ModelSource(self.draft, rule.graph_head if self.draft_runs_heads else None)

    def verified_chain(self, state: RoundState, rule: StopPolicy, k_cap: int, source: DraftSource):
        """A chain of at most k_cap candidates drafted by `source` under the rule and verified, nothing kept yet:
        (K drafted, n accepted, the candidates as host ints, the token the target drew after the n)."""
        if k_cap and self.host_reads != "token" and isinstance(source, ModelSource) and rule.decides_on_device:
            every = self.host_reads if isinstance(self.host_reads, int) else None
            return self.graph_round.round(self, state, rule, k_cap, source, every)
        y, q = self._draft_chain(state, rule, k_cap, source)
        n, ys, tok = self._verify_chain(state, y, q)
        return y.shape[0], n, ys, tok

    def keep(self, state: RoundState, rule: StopPolicy, source: str, K: int, n: int, ys: list[int], tok: int):
        """Keep a verified chain's first n candidates and the token after them: both caches cropped to them, the
        round booked and told to the rule; returns the round's new tokens."""
        self._rollback(state, state.seq.shape[0] + n)
        state.book(K, n, source)
        rule.end_round(K, n)
        return ys[:n] + [tok]

    def _draft_chain(self, state: RoundState, rule: StopPolicy, k_cap: int, source: DraftSource):
        """y_1..y_K drafted by `source` from the round's context on, asking `rule` after each; (y [K], q [K, V])."""
        ys, qs = [], []
        met = state.met
        met.lap("rest")
        for i in range(1, k_cap + 1):
            step = source.step(state, i, ys)
            if step is None:  # the source has nothing more to propose this round
                break
            ys.append(step.token)
            qs.append(step.probs)
            met.lap("draft_other")
            stop = rule.should_stop(step)
            # a rule that looks at the step reads its decision back; a cap (fixed K) or a copied span does not
            met.host_reads += step.source == "model" and rule.reads_steps
            met.lap("policy")
            if stop:
                break
        met.lap("draft_other")
        if not ys:
            return state.seq.new_empty(0), None
        return torch.stack(ys), torch.stack(qs)

    def _verify_chain(self, state: RoundState, y: torch.Tensor, q: torch.Tensor | None):
        """The target scores the pending token(s) and all K candidates in one pass; returns
        (n accepted, the K candidates as host ints, the token drawn after the n)."""
        target, K = self.target, y.shape[0]
        ids = torch.cat([state.seq[target.length:], y])
        state.met.lap("verify_other")
        logits_p, _ = target.forward(ids, n_logits=K + 1)
        state.met.lap("target_forward")
        state.met.count_pass(ids.shape[0])
        if state.sampling.greedy:
            n_t, tok_t, state.p_y = verify_greedy(y, logits_p)
        else:
            p = process_logits(logits_p, state.sampling, sync_free=self.host_reads != "token")
            if q is None:
                q = p.new_empty(0, p.shape[-1])
            n_t, tok_t = verify(y, q, p, state.gen)
            state.p_y = p[torch.arange(K, device=p.device), y]
        # the round's one host sync: read n, the new token and the candidates together
        vals = state.met.read(torch.cat([n_t.view(1), tok_t.view(1), y]))
        return vals[0], vals[2:], vals[1]

    def _rollback(self, state: RoundState, length: int) -> None:
        """Keep the accepted prefix in both caches (the round's new token is fed next round)."""
        state.met.lap("verify_other")
        self.target.rollback(length)
        if self.draft is not None:
            self.draft.rollback(min(self.draft.length, length))
        state.met.lap("rollback")


class ModelSource(DraftSource):
    """The draft model as a draft source: y_i ~ q_i, its processed next-token distribution.

    Its cache covers (seq + y_1..y_{i-1})[:draft.length], and each step feeds what is pending after it:
    the round's first step the token(s) the last round left (or, when the draft has not seen the prompt
    yet, all of it: a policy that drafts with the model only in some rounds prefills it lazily), later
    steps the previous candidate."""

    name = "model"

    def __init__(self, draft, head=None):
        """head: the stop rule's graph_head, evaluated inside the draft's forward (the draft must be a
        contract.HeadRunner; None: the rule runs its head after the step)."""
        self.draft = draft
        self.head = head
        if head is not None:
            draft.attach_head(self.head)

    def _input(self, state: RoundState, ys) -> torch.Tensor:
        """What the step feeds: the pending token(s) and the candidates the draft has not seen. ys: the round's
        candidates so far, a list of 0-d tensors or one tensor [i - 1]."""
        draft, L = self.draft, state.seq.shape[0]
        if draft.length == L + len(ys) - 1 and len(ys):
            return ys[-1].view(1)
        tail = (torch.stack(ys) if isinstance(ys, list) else ys) if len(ys) else None
        if draft.length < L:
            inp = state.seq[draft.length:]
            return inp if tail is None else torch.cat([inp, tail])
        return tail[draft.length - L:]

    def step_epilogue(self, state: RoundState, i: int, chain) -> None:
        """Step i of a device round (graph_round.py): the forward and the chain's epilogue, in the draft's graph
        where it has one; y_i lands in chain.y[i - 1]."""
        state.met.lap("draft_other")
        run_epilogue(self.draft, self._input(state, chain.y[:i - 1]), 1, chain, with_head=self.head is not None)
        state.met.lap("draft_forward")

    def step(self, state: RoundState, i: int, ys: list) -> DraftStep:
        draft = self.draft
        inp = self._input(state, ys)
        accept = None
        state.met.lap("draft_other")
        if self.head is not None:
            logits, hidden, accept = draft.forward_with_head(inp, n_logits=1)
        else:
            logits, hidden = draft.forward(inp, n_logits=1)
        state.met.lap("draft_forward")
        q_i = process_logits(logits[0], state.sampling)
        y_i = draw(q_i, state.sampling, state.gen)
        return DraftStep(i, y_i, q_i, logits[0], hidden, state.pos + i - 1, state.sampling, accept=accept)
