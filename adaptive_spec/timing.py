"""Timers for forward passes: `sync` waits for a device's queued work, `timed` measures a block
(per-phase wall time of a generation, as Metrics records it), `timed_runs` each of repeated calls;
`torch_threads` sets the torch threads a block runs on. The models those times feed (Eq. 3.1 and the
extended and table models) are in auto/timemodel.py."""
from __future__ import annotations

import contextlib
import time

import torch


clock = time.perf_counter  # the clock `timed` reads (a module attribute, so a test can script it)

def sync(device) -> None:
    """Wait for the device to finish its queued work (CUDA runs asynchronously; CPU is a no-op)."""
    if getattr(device, "type", str(device).split(":")[0]) == "cuda":
        torch.cuda.synchronize(device)


class timed:
    """Wall time of a block of device work: `with timed(device) as t: ...; t.s` seconds.

    The clock stops only after the device is idle, because a CUDA forward returns before its
    kernels ran and timing the call alone would measure the launch, not the work."""

    def __init__(self, device="cpu"):
        self.device, self.s = device, 0.0

    def __enter__(self) -> "timed":
        self.t0 = clock()
        return self

    def __exit__(self, *exc) -> bool:
        sync(self.device)
        self.s = clock() - self.t0
        return False


def timed_runs(fn, reps: int, warmup: int = 0, before=None, device=None) -> tuple[list[float], object]:
    """(seconds of each of `reps` calls of fn() after `warmup` untimed ones, `before()` run untimed ahead of
    every call; what the last call returned). With a `device`, a timed call's clock stops after the device
    is idle, as `timed`'s; a warm-up is not waited for. Without one, host work: no sync inside the clock."""
    times, value = [], None
    for r in range(warmup + reps):
        if before is not None:
            before()
        t0 = clock()
        value = fn()
        if r >= warmup:
            if device is not None:
                sync(device)
            times.append(clock() - t0)
    return times, value


class PartClock:
    """Where a generation's time goes, on one clock: `lap(part)` books the time since the previous lap
    (or the start) to `part`, so the parts add up to the time from the start to the last lap.

    On CUDA a lap is an event recorded on the stream, and every interval is read once, at `totals()`:
    the parts are spans of the device's timeline. A forward's span is then its device time, and the span
    of the host work between two forwards is the time the device waited for it, which is what that work
    costs a decode. Timing forwards with events and the host work around them with the host's clock
    counted a forward's time twice (the host waits for it inside the work that reads its result). On the
    CPU the device is the host, and a lap reads perf_counter."""

    def __init__(self, device="cpu"):
        self.cuda = getattr(device, "type", str(device).split(":")[0]) == "cuda"
        self._laps: list[tuple[str, object]] = []
        self._start = self._now()

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return clock()

    def lap(self, part: str) -> None:
        self._laps.append((part, self._now()))

    def totals(self) -> dict[str, float]:
        """Seconds per part (parts in the order first booked)."""
        out: dict[str, float] = {}
        prev = self._start
        if self.cuda and self._laps:
            self._laps[-1][1].synchronize()
        for part, t in self._laps:
            s = prev.elapsed_time(t) / 1000.0 if self.cuda else t - prev
            out[part] = out.get(part, 0.0) + s
            prev = t
        return out


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch on n threads inside the block (None: as it is)."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
