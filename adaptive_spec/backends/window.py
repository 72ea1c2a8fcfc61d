"""A draft that sees only the end of the prompt: its prefill, and so the time before the first token,
shrinks to `window` tokens whatever the prompt's length.

The draft is only a proposal distribution: rejection sampling against the target keeps the output
exactly the target's whatever context the draft was given, so a shorter one costs acceptance, never
correctness. On long prompts the draft's prefill is most of what speculation adds before the first
token (the target's prefill is paid either way): a 0.5B draft prefills at about a third of a 1.5B
target's cost per token, so a 1,000-token prompt adds a third to the time before decoding starts.

`WindowedDraft` wraps any runner (the `models.CausalLM` interface): the first feed after a reset
keeps only its last `window` tokens, and positions after it are counted from the start of the
prompt as the decoder expects (`length` = the tokens skipped + the inner runner's), so rollback and
the rounds need nothing else. PairParams.draft_context sets it (`--draft-context W`).
"""
from __future__ import annotations


class WindowedDraft:
    _COUNTERS = ("fwd_time", "n_forwards", "prefill_s")

    def __init__(self, inner, window: int):
        if window < 1:
            raise ValueError(f"the draft's window must be >= 1 token, got {window}")
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "window", int(window))
        object.__setattr__(self, "skipped", 0)

    # the runner's own attributes (vocab_size, hidden_size, device, model, max_length, ...) are the inner
    # one's; its counters too, read and written through
    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in self._COUNTERS:
            setattr(self.inner, name, value)
        else:
            object.__setattr__(self, name, value)

    @property
    def length(self) -> int:
        return self.skipped + self.inner.length

    def forward(self, ids, n_logits: int = 1):
        if self.inner.length == 0 and len(ids) > self.window:
            object.__setattr__(self, "skipped", self.skipped + len(ids) - self.window)
            ids = ids[len(ids) - self.window:]
        return self.inner.forward(ids, n_logits)

    def rollback(self, length: int):
        self.inner.rollback(max(0, length - self.skipped))

    def reset(self):
        self.inner.reset()
        object.__setattr__(self, "skipped", 0)

    def fresh(self):
        """A runner on the same weights for work beside the decode (the oracle's hindsight): the whole
        context, not the window (a teacher-forced pass over prompt and answer asks for rows past it)."""
        return self.inner.fresh()

    def numeric_path(self) -> dict:
        return {**self.inner.numeric_path(), "context_window": self.window}
