"""Stop rules (interfaces.StopPolicy): who decides the candidate length K of each chain speculation round.
Each registers a factory under its `--policy` name; verification never looks at the rule."""
from __future__ import annotations

import torch

from ..errors import UserError, get_logger
from ..heads.features import step_stats
from ..heads.head import INPUTS, join_inputs, load_head, reads_stats
from ..params import OracleParams
from .decoder import Decoder
from .interfaces import CapOnly, DraftStep, PolicyContext, RoundOwner, RoundState, StopPolicy, register
from .metrics import Extra
from .sampling import SamplingParams, entropy

log = get_logger(__name__)


class FixedK(CapOnly):
    """Classic speculative decoding: always K candidates (fewer only at max length)."""

    name = "fixed"

    def __init__(self, k: int):
        if not isinstance(k, int) or k < 1:
            raise UserError(f"K must be an integer >= 1, got {k!r}")
        self.k = self.k_max = k

    def describe(self) -> dict:
        return {"policy": self.name, "k": self.k}


# ---- SpecDec++ and training-free baselines (SpecDec++ paper, Algorithm 1 and section 5) -------


class LearnedThreshold(StopPolicy):
    """SpecDec++: stop when the predicted probability that some candidate is rejected,
    1 - prod_i sigmoid(f(e_i)), exceeds h; or at the hard cap k_max (20 in the paper).

    A token head scores y_j one step late, so K >= 2; a `context` head scores y_i at step i (docs/design.md,
    "The learned policy's one-step lag"). Either way the head is one small MLP on a vector the draft computed
    anyway. A head with inputs=hidden+stats (or stats) also reads draft_stats of the token it scores, from the
    step's raw logits processed as its datagen run processed q (features.py says why); a token head's stats
    of y_{i-1} are computed at step i - 1 and kept for step i."""

    name = "learned"

    def __init__(self, head, threshold: float, k_max: int = 20):
        self.head = head
        self.h, self.k_max = float(threshold), k_max  # validated once, by params.LearnedParams
        self.feature = getattr(head, "feature", "token")  # duck-typed heads without one read like the paper's
        self.inputs = getattr(head, "inputs", "hidden")
        self.stats_params = ((getattr(head, "stats_params", None) or SamplingParams()) if reads_stats(self.inputs)
                             else None)
        self.p_all = self.prev_stats = None
        # a head of the hidden state alone can run inside the draft's graph (DraftStep.accept), and so can the
        # rule; a head that reads the draft's statistics decides on the host
        self.graph_head = head if self.inputs == "hidden" and isinstance(head, torch.nn.Module) else None
        self.decides_on_device = self.stats_params is None

    def begin_round(self, pos: int) -> int:
        self.p_all = None  # prod of predicted acceptance probabilities of y_1..y_{i-1}
        self.prev_stats = None
        return self.k_max

    def should_stop(self, step: DraftStep) -> bool:
        stats = None if self.stats_params is None else step_stats(step.logits, step.token, self.stats_params,
                                                                 step.probs, step.sampling)
        if self.feature == "token":  # this step's state is y_{i-1}'s: score it with y_{i-1}'s stats
            stats, self.prev_stats = self.prev_stats, stats
            if step.i == 1:
                return False
        if step.accept is not None:  # computed in the draft's graph from the same hidden state
            p_hat = step.accept
        else:
            p_hat = self.head.acceptance_prob(step.hidden if stats is None else join_inputs(step.hidden, stats))
        self.p_all = p_hat if self.p_all is None else self.p_all * p_hat
        return bool(1.0 - self.p_all > self.h)

    def graph_key(self) -> tuple:
        return (self.name, self.feature)

    def graph_state(self, device) -> dict:
        return {"p_all": torch.ones((), device=device), "h": torch.zeros((), device=device)}

    def graph_begin(self, mem: dict) -> None:
        mem["h"].fill_(self.h)

    def graph_stop(self, step: DraftStep, i, mem: dict):
        """should_stop on the device (a hidden-state head): the product restarts at i = 1, and a token head
        scores nothing there (its state is the round's first input's)."""
        p_hat = (step.accept if step.accept is not None else self.head.acceptance_prob(step.hidden)).reshape(())
        first = i == 1
        if self.feature == "token":
            p_hat = torch.where(first, torch.ones_like(p_hat), p_hat)
        p_all = torch.where(first, p_hat, mem["p_all"] * p_hat)
        mem["p_all"].copy_(p_all)
        stop = 1.0 - p_all > mem["h"]
        return stop & ~first if self.feature == "token" else stop

    def describe(self) -> dict:
        return {"policy": self.name, "h": self.h, "k_max": self.k_max, "depth": self.head.depth,
                "feature": self.feature, "inputs": self.inputs}


class _Tau(StopPolicy):
    """A rule that stops after a candidate whose draft-side score crosses `tau` (validated by its params class)."""

    decides_on_device = True

    def __init__(self, threshold: float, k_max: int = 20):
        self.tau, self.k_max = float(threshold), k_max

    def graph_state(self, device) -> dict:
        return {"tau": torch.zeros((), device=device)}

    def graph_begin(self, mem: dict) -> None:
        mem["tau"].fill_(self.tau)

    def describe(self) -> dict:
        return {"policy": self.name, "tau": self.tau, "k_max": self.k_max}


class ConfidenceThreshold(_Tau):
    """Stop after a candidate the draft itself is unsure of: q(y_i) < tau (the draft
    confidence rule of transformers' assisted generation). In greedy mode q is a point mass,
    so the confidence is read from the softmax of the raw logits."""

    name = "confidence"

    def should_stop(self, step: DraftStep) -> bool:
        greedy = bool(step.probs.max() == 1.0)
        conf = (step.logits.float().softmax(-1) if greedy else step.probs)[step.token]
        return bool(conf < self.tau)

    def graph_stop(self, step: DraftStep, i, mem: dict):
        conf = (step.logits.float().softmax(-1) if step.sampling.greedy else step.probs).gather(-1, step.token.view(1))
        return (conf < mem["tau"]).reshape(())


class EntropyThreshold(_Tau):
    """Stop after a candidate drawn from a high-entropy draft distribution (AdaEDL, SVIP):
    H(q_i) > tau nats, H from the draft's temperature-1 distribution."""

    name = "entropy"

    def should_stop(self, step: DraftStep) -> bool:
        return bool(entropy(step.logits) > self.tau)

    def graph_stop(self, step: DraftStep, i, mem: dict):
        return (entropy(step.logits) > mem["tau"]).reshape(())


class HeuristicSchedule(CapOnly):
    """transformers' "heuristic" schedule: K += 2 after a round whose candidates were all
    accepted, K -= 1 (not below 1) otherwise; starts at K = 5 like transformers."""

    name = "heuristic"

    def __init__(self, k_start: int = 5, k_max: int = 20):
        self.k_start, self.k_max = k_start, k_max  # validated by params.HeuristicParams
        self.reset()

    def reset(self) -> None:
        self.k = self.k_start

    def begin_round(self, pos: int) -> int:
        return min(self.k, self.k_max)

    def end_round(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted == 0:
            return
        self.k = self.k + 2 if n_accepted == n_drafted else max(1, self.k - 1)

    def describe(self) -> dict:
        return {"policy": self.name, "k_start": self.k_start}


class HindsightOracle(StopPolicy, RoundOwner):
    """The greedy hindsight oracle of Theorem 4.1: knowing the target's greedy output X (untimed: greedy target
    decoding), stop exactly before the first position where the draft's greedy token Y_i (one teacher-forced
    draft pass over prompt + X) differs from X_i: N_discarded = 0, the best verification rate possible.

    Why it re-derives: a one-row target step (how X is made) and a (K+1)-row verify round can round a near-tie
    differently, so the speculative output can leave X, after which the agreement list describes another
    sequence. So each round checks its new tokens against X and, after a divergence, X and Y are derived again
    on separate caches; that work is left out of wall_s and reported as `hindsight_s` (`Hindsight`)."""

    name = "oracle"

    def __init__(self, agree: list[bool], k_max: int = 10_000, x: list[int] | None = None):
        self.agree0 = list(agree)  # agree[j]: the draft's greedy token at new position j equals X_j
        self.x0 = None if x is None else list(x)  # X; None: no divergence check
        self.k_max = k_max
        self.reset()

    def reset(self) -> None:
        self.agree = list(self.agree0)
        self.x = None if self.x0 is None else list(self.x0)
        self.stale = False
        self.hindsight = Hindsight()

    @staticmethod
    def agreement(target, draft, prefix: list[int], max_new_tokens: int, eos_token_ids=(),
                  x: list[int] | None = None) -> tuple[list[int], list[bool]]:
        """(X, agree) after `prefix`: X the target's greedy continuation (unless given), agree[j] whether the draft's
        teacher-forced greedy token at j equals X_j. Runs on fresh runners, never on the models' own caches."""
        if x is None:
            dec = Decoder(target.fresh(), None, eos_token_ids=eos_token_ids)
            x = dec.generate(prefix, max_new_tokens=max_new_tokens, sampling=SamplingParams(0.0)).token_ids
        lm = draft.fresh()
        logits, _ = lm.forward(torch.tensor(list(prefix) + x, device=lm.device), n_logits=len(x) + 1)
        y = logits.argmax(-1).tolist()  # y[j] = draft's greedy token for new position j
        return x, [y[j] == x[j] for j in range(len(x))]

    @classmethod
    def from_pair(cls, pair, prompt_ids: list[int], max_new_tokens: int, k_max: int = 10_000,
                  target_output: list[int] | None = None):
        """`target_output`: X when the caller already has it (e.g. from a target-alone run): saves a decode."""
        if target_output is not None:
            target_output = list(target_output)
            if not target_output or len(target_output) > max_new_tokens:
                raise UserError(f"target_output has {len(target_output)} tokens; the oracle needs the target's "
                                f"greedy output of 1..max_new_tokens={max_new_tokens} tokens for this prompt")
        x, agree = cls.agreement(pair.target, pair.draft, prompt_ids, max_new_tokens, pair.eos_token_ids,
                                 x=target_output)
        return cls(agree, k_max, x=x)

    def begin_round(self, pos: int) -> int:
        run = self.agree[pos:pos + self.k_max]  # the draft agrees with X up to its first False
        return run.index(False) if False in run else len(run)

    def should_stop(self, step) -> bool:
        """Stop after a drafted token that is not X's: greedy verification rejects it. The running draft's
        one-row steps can round a near-tie unlike Y's teacher-forced pass (kernels differ by row count), so a
        wrong Y costs one discarded token, not the rest of a round of up to k_max."""
        return self.x is not None and step.pos < len(self.x) and int(step.token) != self.x[step.pos]

    def run_round(self, state: RoundState) -> list[int]:
        state.met.attach(self.hindsight)
        if self.stale:
            self._rederive(state)
        new = state.decoder.chain_round(state, self)
        # compared before the decoder's EOS cut: X stops at EOS too, so a longer `new` only
        # marks stale a generation that is ending anyway
        if self.x is not None and new != self.x[state.pos:state.pos + len(new)]:
            self.stale = True
        return new

    def _rederive(self, state: RoundState) -> None:
        """X and Y rebuilt after seq = prompt + the tokens produced so far (untimed: left out of the wall time)."""
        dec, pos = state.decoder, state.pos
        with state.met.untimed() as t:
            x, agree = self.agreement(dec.target, dec.draft, state.seq.tolist(), state.remaining, dec.eos)
        self.x, self.agree = self.x[:pos] + x, self.agree[:pos] + agree
        self.stale = False
        self.hindsight.seconds += t.s


class Hindsight(Extra):
    """The oracle's hindsight work in one generation: its seconds, which the wall time leaves out."""

    def __init__(self):
        self.seconds = 0.0

    def to_dict(self) -> dict:
        return {"hindsight_s": self.seconds}


def load_pair_head(head, pair, feature: str | None = None, why: str = "the learned policy",
                   inputs: tuple[str, ...] = ("hidden",)):
    """`head` (an AcceptanceHead, or a folder to load) checked against the pair's draft; `inputs`:
    the input sets the caller builds rows for (heads.INPUTS)."""
    draft = getattr(pair, "draft", None)
    if draft is None:
        return load_head(head, feature=feature, inputs=inputs, why=why)
    engine = getattr(pair, "engine", None)
    if engine is not None and "hidden" not in engine.capabilities:  # e.g. llama.cpp: the draft's statistics only
        inputs = tuple(i for i in inputs if i == "stats")
        why = f"{why} on the {engine.name} backend (no hidden states)"
        if not inputs:
            raise UserError(f"{why} cannot run: it reads the draft's hidden states; use a statistics head "
                            "(inputs=stats) or --backend torch")
    head = load_head(head, hidden_size=draft.hidden_size, draft_model=getattr(getattr(draft, "model", None), "name_or_path", None),
                     device=draft.device, dtype=torch.float32, feature=feature, inputs=inputs, why=why)
    warn_draft_config(head, getattr(pair, "draft_config", {}))
    return head


def warn_draft_config(head, in_use: dict) -> None:
    """Warn once when the head was trained under another draft quantization or vocabulary (its inputs shift)."""
    trained = {k: (getattr(head, "extra", {}) or {}).get(k, d) for k, d in (("draft_quant", "none"), ("draft_vocab", "full"))}
    in_use = {k: str(in_use.get(k, d)) for k, d in (("draft_quant", "none"), ("draft_vocab", "full"))}
    diff = [f"{k} {trained[k]} (trained) vs {in_use[k]} (in use)" for k in trained if str(trained[k]) != in_use[k]]
    msg = (f"the acceptance head was trained on another draft configuration: {'; '.join(diff)}; "
           "its predictions may be miscalibrated (the output stays exact); retrain it on this configuration")
    if diff and msg not in _WARNED:  # once per process: a sweep or a soak builds the policy per generation
        _WARNED.add(msg)
        log.warning(msg)


_WARNED: set[str] = set()


register("fixed")(lambda p, ctx: FixedK(p.k))
register("learned")(lambda p, ctx: LearnedThreshold(load_pair_head(p.head, ctx.pair, inputs=INPUTS), p.threshold,
                                                     p.k_max))
register("confidence")(lambda p, ctx: ConfidenceThreshold(p.threshold, p.k_max))
register("entropy")(lambda p, ctx: EntropyThreshold(p.threshold, p.k_max))
register("heuristic")(lambda p, ctx: HeuristicSchedule(p.k, p.k_max))


@register("oracle")
def _make_oracle(p: OracleParams, ctx: PolicyContext):
    if ctx.pair is None or ctx.prompt_ids is None:
        raise UserError("the oracle policy needs the model pair and the prompt (use SpecPair.generate)")
    return HindsightOracle.from_pair(ctx.pair, ctx.prompt_ids, ctx.max_new_tokens, p.k_max,
                                     target_output=p.target_output)
