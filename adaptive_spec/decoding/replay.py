"""Recording a trace and replaying it: the real decode loop, runners and kernels, with the acceptance a run
of the real weights measured ("measured, not modelled").

A trace (`TraceRecorder`, an extra of `Decoder.generate`; a sweep's rows with `record_trace: true`) lists
every verified chain round as [K, n accepted, source]. Replayed on models of the same shapes (random
weights on a GPU, say), every round drafts exactly the recorded K (`TraceStop`, whose inner policy's
`should_stop` still runs, for its cost) and keeps the recorded n whatever its verification found, so the
replay does the recorded work, reproduces the recorded counts, and its wall time is what that work costs
here. EOS is off and the length is the recorded n_tokens.

Why a RoundOwner and not a stop rule: the recorded n is kept between the round's two halves
(Decoder.verified_chain, then Decoder.keep), and the decoder caps K at the tokens left minus one, which
would cap a recorded round cut at an EOS. `TraceReplay` drafts up to the recorded K, and the decoder's
own cut at the length limit removes what the EOS cut: the counts come out the same, n_final_cut
included. Chain traces only: a tree round's K counts nodes (`chain_trace` refuses them)."""
from __future__ import annotations

from ..errors import UserError
from .decoder import Decoder
from .metrics import Extra, Generation
from .interfaces import CapOnly, DraftStep, RoundOwner, RoundState, StopPolicy
from .ngram import SpanSource
from ..registry import Needs
from .sampling import SamplingParams

SOURCES = ("model", "ngram", "none")  # what drafted a chain round (Metrics.book_round)


class TraceRecorder(Extra):
    """Records a generation's trace: per verified round [K, n accepted (after a final cut), source]; its rows
    add it as `trace`. One recorder per generation."""

    def __init__(self):
        self.rounds: list = []

    def book_round(self, n_drafted: int, n_accepted: int, source: str) -> None:
        self.rounds.append([n_drafted, n_accepted, source])

    def book_cut(self, n: int, kept: int) -> None:
        if self.rounds:
            self.rounds[-1][1] = kept

    def to_dict(self) -> dict:
        return {"trace": [list(r) for r in self.rounds]}


class TraceStop(StopPolicy):
    """Stops at the round's recorded K; asks `inner` too (its cost is real), deciding by the trace."""

    name = "trace"
    stops_mid_chain = False

    def __init__(self, inner: StopPolicy | None = None):
        self.inner = inner or CapOnly()  # no recorded rule: one that asks and reads nothing
        self.decides_on_device = self.inner.decides_on_device
        self.k = 0

    def reset(self) -> None:
        self.inner.reset()

    def begin_round(self, pos: int) -> int:
        self.inner.begin_round(pos)
        return self.k

    @property
    def reads_steps(self) -> bool:  # the recorded rule is asked at every step, for its cost: its reads too
        return self.inner.reads_steps

    def should_stop(self, step: DraftStep) -> bool:
        if step.source == "model":
            self.inner.should_stop(step)
        return step.i >= self.k

    def graph_key(self) -> tuple:
        return ("trace",) + self.inner.graph_key()

    def graph_state(self, device) -> dict:
        return self.inner.graph_state(device)

    def graph_begin(self, mem: dict) -> None:
        self.inner.graph_begin(mem)

    def graph_stop(self, step: DraftStep, i, mem: dict):
        """The round drafts its recorded K (the cap); the inner rule decides on the device too, for its cost."""
        self.inner.graph_stop(step, i, mem)
        return False

    def end_round(self, n_drafted: int, n_accepted: int) -> None:
        self.inner.end_round(n_drafted, n_accepted)


class TraceReplay(RoundOwner):
    """Runs the rounds of `trace` (check_trace'd), one chain round each, keeping the recorded n of its candidates."""

    name = "replay"

    def __init__(self, trace: list, inner: StopPolicy | None = None, needs: Needs | None = None):
        """`needs`: what the recorded policy declared (default: the inner rule's; a trace of copies alone
        needs no draft model): a lazily prefilled draft (prompt lookup's) replays lazily."""
        self.trace = [(int(k), int(n), str(s)) for k, n, s in trace]
        self.rule = TraceStop(inner)
        self.needs = needs or (inner.needs if inner is not None else
                               Needs(draft_model=any(s == "model" for _, _, s in self.trace)))
        self.reset()

    def reset(self) -> None:
        self.i = 0
        self.rule.reset()

    def run_round(self, state: RoundState) -> list[int]:
        if self.i >= len(self.trace):
            raise UserError(f"the trace has {len(self.trace)} rounds but the replay needs more; replay it with the "
                            "n_tokens it was recorded with")
        k, n, source = self.trace[self.i]
        self.i += 1
        self.rule.k = k
        dec = state.decoder
        if source == "ngram":  # a copy costs no model forward: copy the last token, as a span would be copied
            drafter = SpanSource([state.tokens[-1]] * k, dec.target.vocab_size, state.seq.device)
        else:
            drafter = dec.model_source(self.rule)
        # the recorded K, not capped at the tokens left (module doc); the decoder's cut does the rest
        K, _, ys, tok = dec.verified_chain(state, self.rule, self.rule.begin_round(state.pos), drafter)
        return dec.keep(state, self.rule, drafter.name, K, min(n, K), ys, tok)

    def describe(self) -> dict:
        return {"policy": self.name, "rounds": len(self.trace)}


def check_trace(trace: list, n_tokens: int) -> list:
    """`trace` as a chain trace of a generation of n_tokens tokens, or a UserError saying what is wrong."""
    if not isinstance(trace, list) or not all(isinstance(r, (list, tuple)) and len(r) == 3 for r in trace):
        raise UserError("a trace is a list of [K, n_accepted, source] rounds; record one with a TraceRecorder "
                        "(Decoder.generate(extras=[TraceRecorder()])) or a sweep with record_trace: true")
    for i, (k, n, s) in enumerate(trace):
        if s not in SOURCES or not 0 <= n <= k or (s == "none") != (k == 0):
            raise UserError(f"trace round {i} is {[k, n, s]}: not a chain round (K >= n >= 0, source one of "
                            f"{', '.join(SOURCES)}); tree and multi-draft traces do not replay as chains")
    cut = sum(n + 1 for _, n, _ in trace) - n_tokens
    if cut not in (0, 1):
        raise UserError(f"the trace's rounds emit {n_tokens + cut} tokens but the row has n_tokens {n_tokens}: "
                        "not the trace of that generation")
    return trace


def covering_trace(traces: list) -> list:
    """One trace that drafts every K the `traces` draft, each once all rejected and once all accepted (so the next
    round's first draft step feeds two tokens): replayed once, untimed, it makes every graph that replaying those
    traces captures on first use (a device round's epilogue per K), so none is captured inside a timed replay."""
    ks = sorted({int(k) for t in traces for k, _, s in t if s == "model" and k > 0})
    return [[k, n, "model"] for k in ks for n in (0, k)]


def replay_generate(target, draft, prompt_ids: list[int], n_tokens: int, trace: list | None = None,
                    inner: StopPolicy | None = None, sampling: SamplingParams = SamplingParams(1.0),
                    seed: int = 0, decoder: Decoder | None = None) -> Generation:
    """Replay one recorded generation on the runners `target` and `draft` (any weights of the recorded
    shapes): no trace (None, or an ar row's empty one) is the target alone for n_tokens; else its rounds,
    with `inner` (the recorded policy's stop rule, built for these runners) asked at every drafted step.
    `decoder`: a Decoder(target, draft, eos_token_ids=()) to reuse across replays: a device round's epilogues
    belong to its decoder, and the graphs a runner captures for them are made once per decoder, so a fresh one
    per replay would capture them inside every replay."""
    dec = decoder or Decoder(target, draft if trace else None, eos_token_ids=())
    policy = TraceReplay(check_trace(trace, n_tokens), inner) if trace else None
    return dec.generate(prompt_ids, max_new_tokens=n_tokens, sampling=sampling, policy=policy, seed=seed)
