"""A draft that sees only the end of the prompt (`--draft-context W`): its prefill, most of what speculation
adds before the first token, shrinks to W tokens, at a cost in acceptance only. `length` counts the skipped
tokens too, so rollback and the rounds need nothing else."""
from __future__ import annotations


class WindowedDraft:
    """A runner (contract.py) over `inner` whose first feed after a reset keeps only its last `window` tokens."""

    def __init__(self, inner, window: int):
        if window < 1:
            raise ValueError(f"the draft's window must be >= 1 token, got {window}")
        self.inner, self.window, self.skipped = inner, int(window), 0
        # the contract's attributes are the inner runner's, counters included (one set)
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
        """A runner on the same weights with the whole context (a teacher-forced pass asks for rows past the window)."""
        return self.inner.fresh()

    def fingerprint(self) -> str:
        return self.inner.fingerprint()

    def numeric_path(self) -> dict:
        return {**self.inner.numeric_path(), "context_window": self.window}
