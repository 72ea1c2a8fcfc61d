"""What one generation counts and times (`Metrics`, names as in the SpecDec++ paper) and what it returns
(`Generation`): the decoder books into them; `to_dict` is the flat row the sweep and the reports read.
Metrics is `Counts` (tokens, forwards, rounds), `Timing` (where the wall time went) and extras told of every
round and cut (`Extra`): the counts per draft source, always kept, and those a caller or a policy attaches."""
from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

from ..timing import PartClock, timed

UNTIMED = "untimed"  # the clock's part for work beside the decode (Timing.untimed), left out of every figure


def _values(obj, cls) -> dict:
    """`cls`'s reported fields of `obj` (those shown in its repr), copied."""
    return {f.name: copy.deepcopy(getattr(obj, f.name)) for f in fields(cls) if f.repr}


@dataclass
class Counts:
    """What every generation books. Every speculative round emits its accepted candidates, then one token the
    target drew (the residual draw after a rejection, or the bonus), and a cut at EOS or at the length limit
    books the candidates it removes as discarded. So, for any policy:
        n_drafted == n_accepted + n_discarded
        n_tokens == n_accepted + rounds - n_final_cut,  rounds = sum(accepted_hist.values())
    n_final_cut counts the rounds whose target-drawn token was cut: 1 when the output ends on an
    EOS among a round's accepted candidates, else 0 (rounds never draft past the length limit).
    Rounds are counted in one place: `book_round`, and a cut at the end in `book_cut`."""

    n_tokens: int = 0  # N: new tokens
    n_draft_forwards: int = 0  # N_draft
    n_target_forwards: int = 0  # N_target
    n_drafted: int = 0  # candidate tokens sent to verification
    n_accepted: int = 0  # candidates accepted and emitted
    n_discarded: int = 0  # N_discarded: drafted and not emitted (rejected, after a rejection, or cut)
    n_final_cut: int = 0  # rounds whose target-drawn token was cut (see above)
    accepted_hist: dict = field(default_factory=dict)  # n accepted in a round -> rounds
    # tokens in a decode-time target pass -> passes (chain rounds and plain steps; the table time
    # model prices each length as measured). Policies that run their own rounds leave it empty.
    target_pass_hist: dict = field(default_factory=dict)
    host_reads: int = 0  # times the decode loop read the device back (one per round, or one per drafted token too)
    n_past_stop: int = 0  # drafted past the stop by rounds that decided it on the device (never verified)

    def count_pass(self, n: int) -> None:
        self.target_pass_hist[n] = self.target_pass_hist.get(n, 0) + 1

    def read(self, t) -> list[int]:
        """The decode loop's read of the device: `t` as host ints, counted in host_reads."""
        self.host_reads += 1
        return t.tolist()

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

    def counts_dict(self) -> dict:
        d = _values(self, Counts)
        d["accepted_hist"] = {str(k): v for k, v in sorted(self.accepted_hist.items())}
        d["target_pass_hist"] = {str(k): v for k, v in sorted(self.target_pass_hist.items())}
        return d


class GenerationClock(PartClock):
    """A generation's PartClock, with its start on the host's clock and the seconds of its untimed work."""

    def __init__(self, device):
        super().__init__(device)
        self.t0, self.untimed_s = time.perf_counter(), 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0 - self.untimed_s


@dataclass
class Timing:
    """Where one generation's wall time went, on one clock (timing.PartClock: `lap`; `breakdown` reports it)."""

    wall_s: float = 0.0
    draft_s: float = 0.0  # inside draft forward passes
    target_s: float = 0.0  # inside target forward passes
    prefill_s: float = 0.0  # prompt forward passes (both models), part of draft_s/target_s
    draft_prefill_s: float = 0.0  # the parts of prefill_s per model
    target_prefill_s: float = 0.0
    first_token_s: float = 0.0  # from the call to the first round's tokens: prefill and that round (TTFT)
    parts: dict = field(default_factory=dict)  # seconds per part of the clock, read at the end (`breakdown`)
    clock: GenerationClock | None = field(default=None, repr=False)  # the running generation's clock

    def start_clock(self, device) -> None:
        self.clock = GenerationClock(device)

    def elapsed(self) -> float:
        return self.clock.elapsed()

    def lap(self, part: str) -> None:
        """Book the time since the last lap to `part` (PartClock; nothing without a clock)."""
        if self.clock is not None:
            self.clock.lap(part)

    @contextmanager
    def untimed(self):
        """A block of work beside the decode (the oracle's hindsight): its time is left out of wall_s,
        first_token_s and the breakdown. Yields a timing.timed: its `s`, the block's seconds, once it ends."""
        self.lap("rest")
        with timed() as block:
            yield block
        if self.clock is not None:
            self.clock.untimed_s += block.s
        self.lap(UNTIMED)

    def stop_clock(self) -> None:
        """wall_s, and the clock's parts read (one device sync on CUDA) into `parts`."""
        self.wall_s = self.elapsed()
        self.parts = {k: v for k, v in self.clock.totals().items() if k != UNTIMED}
        if not self.clock.cuda:  # one clock: the parts add up to the wall time exactly
            self.wall_s = sum(self.parts.values())
        self.clock = None

    def breakdown(self) -> dict:
        """Seconds of the generation by where they went, all on one clock (timing.PartClock): prefill
        (both models), the draft's and the target's decode forwards, drafting outside the draft forward
        (sampling q, copying), the stop rule, verification outside the target pass (processing p, rejection
        sampling, the read), cache rollback, the rounds of a policy that runs its own (trees, several
        drafts: `round`), and the rest (the round loop, streaming, Python). Adds up to wall_s."""
        parts = {k: v for k, v in self.parts.items() if k != "rest"}
        parts["rest"] = max(0.0, self.wall_s - sum(parts.values()))
        return parts

    @property
    def outside_forwards_s(self) -> float:
        """Decode time outside both models' forwards (the loop's own cost)."""
        return max(0.0, self.wall_s - self.draft_s - self.target_s)


class Extra:
    """Bookkeeping beside the counts: told of every round and of the final cut, it adds its own keys to the row."""

    def book_round(self, n_drafted: int, n_accepted: int, source: str) -> None:
        pass

    def book_cut(self, n: int, kept: int) -> None:
        pass

    def to_dict(self) -> dict:
        return {}


@dataclass
class SourceCounts(Extra):
    """Drafted candidates, accepted ones and rounds by what drafted them ("model": the draft model, "ngram":
    copied from the context, "none": a round of no candidates); their sums are n_drafted, n_accepted, rounds."""

    n_drafted_by: dict = field(default_factory=dict)
    n_accepted_by: dict = field(default_factory=dict)
    rounds_by: dict = field(default_factory=dict)
    last_source: str = field(default="", repr=False)  # the last round's source: a cut rebooks it

    def book_round(self, n_drafted: int, n_accepted: int, source: str) -> None:
        self.rounds_by[source] = self.rounds_by.get(source, 0) + 1
        self.n_drafted_by[source] = self.n_drafted_by.get(source, 0) + n_drafted
        self.n_accepted_by[source] = self.n_accepted_by.get(source, 0) + n_accepted
        self.last_source = source

    def book_cut(self, n: int, kept: int) -> None:
        self.n_accepted_by[self.last_source] -= n - kept

    def to_dict(self) -> dict:
        return _values(self, SourceCounts)


@dataclass
class Metrics(Timing, Counts):
    """Counts and times of one generation (names follow the SpecDec++ paper), with the counts per
    source and the extras attached (`attach`)."""

    by_source: SourceCounts = field(default_factory=SourceCounts)
    extras: list = field(default_factory=list)  # Extra's: the trace (replay.TraceRecorder), the oracle's

    def attach(self, extra: Extra) -> None:
        """Tell `extra` of every round from now on (once, however often attached)."""
        if not any(x is extra for x in self.extras):
            self.extras.append(extra)

    def _all_extras(self) -> list:
        return [self.by_source, *self.extras]

    def book_round(self, n_drafted: int, n_accepted: int, source: str = "model") -> None:
        """Count one verified round of K = n_drafted candidates, n of them accepted, drafted by `source`."""
        self.n_drafted += n_drafted
        self.n_accepted += n_accepted
        self.n_discarded += n_drafted - n_accepted
        self.accepted_hist[n_accepted] = self.accepted_hist.get(n_accepted, 0) + 1
        for x in self._all_extras():
            x.book_round(n_drafted, n_accepted, source if n_drafted else "none")

    def book_cut(self, n: int, keep: int) -> None:
        """The last round booked n accepted candidates and returned them + its own token; only `keep`
        tokens of those are emitted (an EOS or the length limit): the rest move from accepted to
        discarded, in that round's source too."""
        kept = min(keep, n)
        self.n_accepted -= n - kept
        self.n_discarded += n - kept
        self.n_final_cut += 1  # keep <= n: the round's own token is always among those cut
        self.accepted_hist[n] -= 1
        if not self.accepted_hist[n]:
            del self.accepted_hist[n]
        self.accepted_hist[kept] = self.accepted_hist.get(kept, 0) + 1
        for x in self._all_extras():
            x.book_cut(n, kept)

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.wall_s if self.wall_s else float("nan")

    def to_dict(self) -> dict:
        d = {**self.counts_dict(), **_values(self, Timing)}  # after generate: the clock is read and gone
        del d["parts"]  # reported as `breakdown` below
        for x in self._all_extras():
            d.update(x.to_dict())
        for k in ("discard_rate", "verification_rate", "acceptance_rate", "tokens_per_target_forward",
                  "tokens_per_s", "outside_forwards_s"):
            d[k] = getattr(self, k)
        d["breakdown"] = self.breakdown()
        return d

    def summary(self) -> str:
        s = (f"N={self.n_tokens} tok  {self.tokens_per_s:.2f} tok/s  wall {self.wall_s:.2f}s "
             f"(draft {self.draft_s:.2f}s, target {self.target_s:.2f}s, other {self.outside_forwards_s:.2f}s)  "
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
    # the policy that made it (None: the target alone), holding its per-generation statistics (a tree's rounds
    # and depths, sweep_run.tree_stats), which a caller of SpecPair.generate cannot reach otherwise
    policy: object = field(default=None, repr=False)
