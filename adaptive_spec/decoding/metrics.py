"""What one generation counts and times (`Metrics`, names as in the SpecDec++ paper) and what it returns
(`Generation`): the decoder books into them, the sweep and the reports read them."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..timing import PartClock


@dataclass
class Metrics:
    """Counts and times of one generation (names follow the SpecDec++ paper).

    Every speculative round emits its accepted candidates, then one token the target drew (the
    residual draw after a rejection, or the bonus), and a cut at EOS or at the length limit
    books the candidates it removes as discarded. So, for any policy:
        n_drafted == n_accepted + n_discarded
        n_tokens == n_accepted + rounds - n_final_cut,  rounds = sum(accepted_hist.values())
    n_final_cut counts the rounds whose target-drawn token was cut: 1 when the output ends on an
    EOS among a round's accepted candidates, else 0 (rounds never draft past the length limit).
    Per draft source s (n_drafted_by, n_accepted_by, rounds_by; "none" for a round of no candidates),
    the sums over s are n_drafted, n_accepted and rounds. Rounds are counted in one place:
    `book_round`, and a cut at the end in `book_cut`.
    """

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
    wall_s: float = 0.0
    draft_s: float = 0.0  # inside draft forward passes
    target_s: float = 0.0  # inside target forward passes
    prefill_s: float = 0.0  # prompt forward passes (both models), part of draft_s/target_s
    hindsight_s: float = 0.0  # the oracle's untimed hindsight work (re-deriving X), kept out of wall_s
    draft_prefill_s: float = 0.0  # the parts of prefill_s per model
    target_prefill_s: float = 0.0
    first_token_s: float = 0.0  # from the call to the first round's tokens: prefill and that round (TTFT)
    # where the wall time went, per part, on one clock (timing.PartClock: `lap`; `breakdown` reports them)
    parts: dict = field(default_factory=dict)
    host_reads: int = 0  # times the decode loop read the device back (one per round, or one per drafted token too)
    n_past_stop: int = 0  # drafted past the stop by rounds that decided it on the device (never verified)
    # drafted candidates by source ("model": the draft model, "ngram": copied from the context)
    n_drafted_by: dict = field(default_factory=dict)
    n_accepted_by: dict = field(default_factory=dict)
    # rounds by what drafted them ("model", "ngram", "none": a plain target step)
    rounds_by: dict = field(default_factory=dict)
    last_source: str = field(default="", repr=False)  # the last round's source (a cut rebooks it), not reported
    clock: PartClock | None = field(default=None, repr=False)  # the generation's clock, not reported
    # with Decoder(record_trace=True): per verified round [K, n accepted (after a final cut), source]; None: off
    trace: list | None = None

    def book_round(self, n_drafted: int, n_accepted: int, source: str = "model") -> None:
        """Count one verified round of K = n_drafted candidates, n of them accepted, drafted by `source`."""
        self.n_drafted += n_drafted
        self.n_accepted += n_accepted
        self.n_discarded += n_drafted - n_accepted
        self.accepted_hist[n_accepted] = self.accepted_hist.get(n_accepted, 0) + 1
        source = source if n_drafted else "none"
        self.rounds_by[source] = self.rounds_by.get(source, 0) + 1
        self.n_drafted_by[source] = self.n_drafted_by.get(source, 0) + n_drafted
        self.n_accepted_by[source] = self.n_accepted_by.get(source, 0) + n_accepted
        self.last_source = source
        if self.trace is not None:
            self.trace.append([n_drafted, n_accepted, source])

    def book_cut(self, n: int, keep: int) -> None:
        """The last round booked n accepted candidates and returned them + its own token; only `keep`
        tokens of those are emitted (an EOS or the length limit): the rest move from accepted to
        discarded, in that round's source too."""
        kept = min(keep, n)
        self.n_accepted -= n - kept
        self.n_discarded += n - kept
        self.n_accepted_by[self.last_source] -= n - kept
        self.n_final_cut += 1  # keep <= n: the round's own token is always among those cut
        self.accepted_hist[n] -= 1
        if not self.accepted_hist[n]:
            del self.accepted_hist[n]
        self.accepted_hist[kept] = self.accepted_hist.get(kept, 0) + 1
        if self.trace:
            self.trace[-1][1] = kept

    def count_pass(self, n: int) -> None:
        """One decode-time target pass of n tokens (target_pass_hist)."""
        self.target_pass_hist[n] = self.target_pass_hist.get(n, 0) + 1

    def read(self, t) -> list[int]:
        """The decode loop's read of the device: `t` as host ints, counted in host_reads."""
        self.host_reads += 1
        return t.tolist()

    def lap(self, part: str) -> None:
        """Book the time since the last lap to `part` (PartClock; nothing without a clock)."""
        if self.clock is not None:
            self.clock.lap(part)

    def close_clock(self) -> None:
        """Read the clock's parts (one device sync on CUDA) into `parts`."""
        if self.clock is not None:
            self.parts = {k: v for k, v in self.clock.totals().items() if k != "hindsight"}
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
        d = asdict(self)  # after generate: the clock is read and gone (close_clock)
        del d["last_source"], d["clock"], d["parts"]  # the parts are `breakdown` below
        if self.trace is None:
            del d["trace"]
        d["accepted_hist"] = {str(k): v for k, v in sorted(self.accepted_hist.items())}
        d["target_pass_hist"] = {str(k): v for k, v in sorted(self.target_pass_hist.items())}
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
