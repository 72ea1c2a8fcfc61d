"""Timers for forward passes: `sync` waits for a device's queued work, `timed` measures a block
(per-phase wall time of a generation, as Metrics records it). The models those times feed (Eq. 3.1
and the extended and table models) are in decoding/timemodel.py.
"""
from __future__ import annotations

import time

import torch

# ----------------------------------------------------------------------------- measuring forwards

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
