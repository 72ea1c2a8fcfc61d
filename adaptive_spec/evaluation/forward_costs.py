"""What the benchmark scripts in eval/ share to time forwards, in one place (no script imports another).
Imports no torch itself (a script's --report-only path reads its labels from here).

- `pass_times`: a pass of N tokens after a context, for any runner (torch's CausalLM, llama.cpp's
  LlamaCppLM), every configuration interleaved round by round: the measurement `auto` prices rounds
  with (decoding/costs.py, whose `interleaved_times` this is) and the one eval/bench_pass_costs.py
  reports, so a benchmark's v(N) and auto's are the same numbers taken the same way;
- `time_forward`: one runner's pass of n tokens after a given prompt, with the logits (the torch kernel
  benchmarks compare numeric paths by them);
- `read_bandwidth_gbps`, `linear_bytes`: the ceiling a bandwidth-bound step can reach, and the bytes a
  step streams;
- `parse_draft`, `draft_label`: the torch benchmarks' draft configurations ("int8:32768" is
  draft_quant int8 with draft_vocab 32768).
"""
from __future__ import annotations

import statistics
import time


def pass_times(runners: dict, lengths, reps: int, all_rows=(True,)) -> dict:
    """{(name, n, all_rows): median seconds} of a pass of n tokens after a costs.PREFIX-token context (less where
    a runner's context cannot hold it), for every runner and length, with the logits of every row (True)
    or of the last only (False), interleaved (decoding/costs.interleaved_times)."""
    from ..decoding.costs import interleaved_times  # torch: only where something is timed

    cells = [(name, n, a) for name in runners for n in (lengths[name] if isinstance(lengths, dict) else lengths)
             for a in all_rows if a or n > 1]
    times = interleaved_times([(runners[name], n, a) for name, n, a in cells], reps)
    return dict(zip(cells, times))


def time_forward(lm, prompt, n: int, reps: int):
    """(median seconds of feeding n tokens after `prompt`, rolled back each time, after 3 warm-ups; the logits)."""
    import torch

    lm.reset()
    lm.forward(prompt, n_logits=0)
    base = lm.length
    ids = torch.arange(100, 100 + n) % lm.vocab_size
    times = []
    for r in range(reps + 3):
        lm.rollback(base)
        t0 = time.perf_counter()
        logits, _ = lm.forward(ids, n_logits=n)
        if r >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), logits


def read_bandwidth_gbps(gib: float = 1.0, reps: int = 5) -> float:
    """Best-of-reps GB/s of summing a buffer far larger than the caches: the ceiling a
    bandwidth-bound decode step can reach on this machine with torch's threads."""
    import torch

    x = torch.ones(int(gib * (1 << 30) // 4), dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def linear_bytes(model) -> int:
    """Bytes of linear-layer weights a one-row step streams (a packed or quantized layer's own count)."""
    import torch

    from ..backends.packed import PackedLinear
    from ..backends.quant import QuantLinear

    seen, n = set(), 0
    for m in model.modules():
        if isinstance(m, (PackedLinear, QuantLinear)):  # their own byte count: the weight may be released
            n += getattr(m, "step_bytes", m.weight_bytes) if id(m) not in seen else 0
            seen.add(id(m))
        elif isinstance(m, torch.nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            n += m.weight.numel() * m.weight.element_size()
    return n


def draft_label(spec: str) -> str:
    base, at, rest = spec.partition("@")
    return ("unquantized" if base == "none" else base) + at + rest


def parse_draft(spec: str) -> tuple[str, str | None]:
    """"none" | "int8" | "int8:32768" | "none:32768" -> (draft_quant, draft_vocab)."""
    quant, _, vocab = spec.partition(":")
    return quant or "none", vocab or None


__all__ = ["pass_times", "time_forward", "read_bandwidth_gbps", "linear_bytes", "draft_label",
           "parse_draft"]
