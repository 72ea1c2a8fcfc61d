"""The runner contract: what the decoder, the policies and the cost measurement may ask of a model runner.

A runner is one causal LM with its own KV cache, fed in chunks after the cached prefix and rolled back by
position; tests/test_runner_contract.py checks every engine's runners against it.

    forward(ids [n], n_logits=1) -> (logits [n_logits, V] float32, hidden [H])
        feed ids at positions length..length+n-1; the logits of the last n_logits rows, the final
        hidden state of the last row. length += n.
    rollback(length)   forget positions >= length (a no-op when length >= self.length)
    reset()            an empty cache (length 0); the counters are left to their owner
    length             positions cached
    vocab_size         columns of the logits (the pair's shared vocabulary)
    device             where the logits and hidden states live (torch.device)
    max_length         positions the runner can hold (None: unbounded)
    counters           a `Counters`: the runner adds to it, the decoder restarts and reads it

The torch runners also give `forward_hidden(ids, n_logits) -> (logits [n_logits, V], hidden [n, H])` (every
fed row's hidden state, for a feature drafter). An engine with the "tree" capability builds `TreeRunner`s.
Stdlib only, so params, engines and the decoder import it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable


class Counters:
    """A runner's forward passes and the seconds inside them. Only the runner adds (`add_pending`: a time read
    later, so a forward never waits on the device); only the decoder and the cost measurement restart and read."""

    __slots__ = ("_seconds", "_pending", "n_forwards", "prefill_s")

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self._seconds = 0.0
        self._pending: list[Callable[[], float]] = []
        self.n_forwards = 0
        self.prefill_s = 0.0

    def add(self, seconds: float) -> None:
        self._seconds += seconds
        self.n_forwards += 1

    def add_pending(self, seconds: Callable[[], float]) -> None:
        """One forward whose time is known later: `seconds()` is called (once) when `seconds` is read."""
        self._pending.append(seconds)
        self.n_forwards += 1

    @property
    def seconds(self) -> float:
        if self._pending:
            pending, self._pending = self._pending, []
            self._seconds += sum(f() for f in pending)
        return self._seconds

    def end_prefill(self) -> None:
        """The forwards so far were the prompt's prefill: keep their time as prefill_s, count from 0."""
        self.prefill_s = self.seconds
        self.n_forwards = 0

    def saved(self) -> tuple[float, int, float]:
        return self.seconds, self.n_forwards, self.prefill_s

    def restore(self, saved: tuple[float, int, float]) -> None:
        """Back to a `saved()` state (a measurement beside a decode leaves no trace in its metrics)."""
        self.restart()
        self._seconds, self.n_forwards, self.prefill_s = saved


@runtime_checkable
class Runner(Protocol):
    vocab_size: int
    device: Any
    max_length: int | None
    counters: Counters

    @property
    def length(self) -> int: ...

    def forward(self, ids: Any, n_logits: int = 1) -> tuple[Any, Any]: ...

    def rollback(self, length: int) -> None: ...

    def reset(self) -> None: ...


@runtime_checkable
class TreeRunner(Runner, Protocol):
    def tree_forward(self, ids: Any, positions: Any, attend: Any, logit_from: int = 0) -> tuple[Any, Any]:
        """Feed ids [n] into slots length..length+n-1 where row r sees the slots attend[r] (bool [n, length + n])
        at position ids `positions` [n]; (logits of rows logit_from.. [n - logit_from, V], hidden [n, H])."""
        ...

    def compact(self, base: int, extra: list[int]) -> None:
        """Keep slots [0, base) then the slots `extra` in order (the accepted tree path); length = base + len(extra)."""
        ...


@runtime_checkable
class HeadRunner(Runner, Protocol):
    """A runner that evaluates an acceptance head inside its own forward (the static runners: the head's
    kernels are captured in the draft step's graph instead of launched after it)."""

    def attach_head(self, head: Any) -> None:
        """Evaluate `head` in forward_with_head from now on (a head of the attached one's shape is copied into
        it, so graphs captured with it stay valid)."""
        ...

    def forward_with_head(self, ids: Any, n_logits: int = 1) -> tuple[Any, Any, Any]:
        """forward, plus the attached head's acceptance probability of the returned hidden state ([] float32)."""
        ...


@dataclass
class Loaded:
    """What an engine's loader gives (draft None: the target alone); draft_config is what a head's warning
    and the cost cache compare against."""

    target: Any
    draft: Any
    tokenizer: Any
    eos_token_ids: list
    draft_config: dict
    # prepare(k_max, head): graph runtimes capture each shape up front (the draft's with `head`), so nothing
    # compiles inside a timed decode
    prepare: Callable[..., None] | None = None
