"""A draft that sees only the end of the prompt: its prefill, and so the time before the first token,
shrinks to `window` tokens whatever the prompt's length (`--draft-context W`).

Rejection sampling keeps the output exactly the target's whatever context the draft was given, so a
shorter one costs acceptance, never correctness; on long prompts the draft's prefill is most of what
speculation adds before the first token. `WindowedDraft` wraps any runner: the first feed after a reset
keeps only its last `window` tokens, and `length` counts the skipped tokens too, so rollback and the
rounds need nothing else."""
from __future__ import annotations


class WindowedDraft:
    """A runner (contract.py) over `inner` whose first feed after a reset keeps only its last `window` tokens."""

    def __init__(self, inner, window: int):
        if window < 1:
            raise ValueError(f"the draft's window must be >= 1 token, got {window}")
        self.inner, self.window, self.skipped = inner, int(window), 0
        # the contract's attributes are the inner runner's, and so are its counters: one set, which the
        # decoder restarts and reads, and the inner runner adds to
        self.vocab_size, self.device, self.max_length = inner.vocab_size, inner.device, inner.max_length
        self.counters = inner.counters
        # what a head and the cost cache read of a draft
        self.hidden_size = getattr(inner, "hidden_size", None)
        self.model, self.config = getattr(inner, "model", None), getattr(inner, "config", None)

    @property
    def length(self) -> int:
        return self.skipped + self.inner.length

    def forward(self, ids, n_logits: int = 1):
        if self.inner.length == 0 and len(ids) > self.window:
            self.skipped += len(ids) - self.window
            ids = ids[len(ids) - self.window:]
        return self.inner.forward(ids, n_logits)

    def rollback(self, length: int):
        self.inner.rollback(max(0, length - self.skipped))

    def reset(self):
        self.inner.reset()
        self.skipped = 0

    def fresh(self):
        """A runner on the same weights for work beside the decode (the oracle's hindsight): the whole
        context, not the window (a teacher-forced pass over prompt and answer asks for rows past it)."""
        return self.inner.fresh()

    def fingerprint(self) -> str:
        return self.inner.fingerprint()

    def numeric_path(self) -> dict:
        return {**self.inner.numeric_path(), "context_window": self.window}
