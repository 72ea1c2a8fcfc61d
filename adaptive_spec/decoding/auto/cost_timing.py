"""How a forward's time is taken on this machine (costs.py keeps the results): passes of each length timed
round-robin after a PREFIX-token context (interleaved_times), the one-row step in the decoder's own loop
(decode_loop_times), the loop's own time per row and per round (loop_times, with_loop_own), and the
monotone fit that treats a dearer shorter pass as noise."""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ...errors import UserError
from ...timing import timed, timed_runs
from ..sampling import SamplingParams, draw, process_logits, verify, verify_greedy

# The cached context the passes are timed after: a typical decode's, as c = t_draft / t_target grows with
# context and timed after a short one, `auto` would draft too much.
PREFIX = 256
# The decode's one-row step (decode_step_time): untimed steps first (the first steps after a prefill pay
# for allocation and a graph of another shape), then DECODE_STEPS_PER_REP timed ones per timing round.
DECODE_WARMUP = 4
DECODE_STEPS_PER_REP = 6
# the sampling modes the loop's own time is measured for (by name: "greedy" at temperature 0, "sample" else)
LOOP_SAMPLING = {"greedy": dict(temperature=0.0), "sample": dict(temperature=1.0, top_k=50)}


def decode_step_time(lm, reps: int, steps: int | None = None, context: int | None = None) -> float:
    """The one-row step's median seconds (decode_loop_times' first)."""
    return decode_loop_times(lm, reps, steps, context)[0]


def decode_loop_times(lm, reps: int, steps: int | None = None, context: int | None = None) -> tuple[float, float]:
    """(the step, the loop's own time a step): median seconds of `lm`'s one-row step in the decoder's own
    target-alone loop (T = 1 top-k 50), centred on `context` tokens (default PREFIX), and of the clock between
    steps beyond it (with_loop_own). Not an interleaved cell: a runner may do per call what a run of
    same-shaped calls skips (llama.cpp rebuilds its graph when the batch shape changes). `steps` timed steps
    (default DECODE_STEPS_PER_REP a rep); the runner is left reset, its counters as they were."""
    from ..decoder import Decoder  # the decoder imports the sampling this module does: only where timed

    warmup = DECODE_WARMUP
    steps = max(1, DECODE_STEPS_PER_REP * reps if steps is None else steps)
    n = warmup + steps
    limit = getattr(lm, "max_length", None)
    centre = PREFIX if context is None else int(context)
    prompt = max(1, (min(centre, limit - n) if limit else centre) - warmup - steps // 2)
    ids = ((torch.arange(prompt) * 7 + 5) % lm.vocab_size).tolist()
    saved = lm.counters.saved()
    marks = []  # (the prompt's prefill seconds, the counters' seconds, the clock) after each step
    try:
        Decoder(lm, None).generate(ids, max_new_tokens=n, sampling=SamplingParams(**LOOP_SAMPLING["sample"]),
                                   seed=0, on_tokens=lambda _: marks.append((lm.counters.prefill_s,
                                                                             lm.counters.seconds,
                                                                             time.perf_counter())))
    finally:
        lm.reset()
        lm.counters.restore(saved)
    if len(marks) < n:
        raise UserError(f"the target-alone loop stopped after {len(marks)} of {n} steps; its context "
                        f"({getattr(lm, 'max_length', None)} positions) is too short to time a step")
    seconds = np.diff([marks[0][0]] + [s for _, s, _ in marks])[warmup:]
    clock = np.diff([t for _, _, t in marks])[max(warmup - 1, 0):]  # no mark before the first step
    if not seconds.any():
        return float(statistics.median(clock)), 0.0
    m = min(len(seconds), len(clock))
    own = clock[-m:] - seconds[-m:]
    return float(statistics.median(seconds)), max(0.0, float(statistics.median(own)))


def with_loop_own(loop: dict, own: float) -> dict:
    """Costs.loop with the loop's bookkeeping added to every row: `own` (decode_loop_times) less the sampled row's
    micro-benchmark, paid by both modes."""
    extra = max(0.0, own - loop["sample"]["row"]) if "sample" in loop else 0.0
    return {mode: {**parts, "row": parts["row"] + extra, "bookkeeping": extra} for mode, parts in loop.items()}


def loop_times(vocab_size: int, device, reps: int = 20) -> dict:
    """The decode loop's own seconds per sampling mode (Costs.loop): "row", processing a row of logits and
    drawing from it; "round", a verification's part beyond its rows. Timed on random logits."""
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(4, vocab_size, generator=g, device=device) * 3
    y = torch.randint(0, vocab_size, (3,), generator=g, device=device)
    out = {}
    for mode, kw in LOOP_SAMPLING.items():
        sp = SamplingParams(**kw)

        def round_():
            if sp.greedy:
                n, tok, _ = verify_greedy(y, logits)
            else:
                p = process_logits(logits, sp)
                n, tok = verify(y, p[:3], p, g)
            return torch.cat([n.view(1), tok.view(1), y]).tolist()

        t_row, t_rows4, t_round = (statistics.median(timed_runs(fn, reps, 1, device=device)[0]) for fn in (
            lambda: draw(process_logits(logits[0], sp), sp, g), lambda: process_logits(logits, sp), round_))
        # a round's time beyond processing its 4 rows
        out[mode] = {"row": t_row, "round": max(0.0, t_round - t_rows4)}
    return out


def monotone(values) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators): a longer
    pass never costs less once the kernels are picked (packed.choose_padding), so a dip is timing noise."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2]
    return [m for m, c in blocks for _ in range(int(c))]


def interleaved_times(cells, reps: int, prefill: dict | None = None) -> list[float]:
    """Median seconds per cell (lm, n tokens, all_logits) of feeding n tokens after a PREFIX-token context.
    Each round times every cell once, so a slow spell of the machine slows every cell alike; round 0 is a
    warm-up. Each runner is left reset, its counters as they were."""
    ctx = prefilled(cells, prefill)
    samples: list[list[float]] = [[] for _ in cells]
    try:
        for r in range(reps + 1):
            for i, t in enumerate(interleaved_round(cells, ctx)):
                if r:
                    samples[i].append(t)
    finally:
        release(ctx)
    return [statistics.median(s) for s in samples]


def prefilled(cells, prefill: dict | None = None) -> dict:
    """Per runner of `cells` (by id): (runner, its context length, the ids of the context and its longest pass,
    its counters as they were), its cache holding the context. `prefill` gets each runner's seconds per prompt
    token (of the second prefill: the first pays for allocation)."""
    ctx = {}
    for lm, _, _ in cells:
        if id(lm) not in ctx:
            longest = max(n for m, n, _ in cells if m is lm)
            limit = getattr(lm, "max_length", None)  # less than PREFIX where the context cannot hold it and a pass
            prefix = PREFIX if not limit else max(1, min(PREFIX, limit - longest))
            ctx[id(lm)] = (lm, prefix, (torch.arange(prefix + longest, device=lm.device) * 7 + 5) % lm.vocab_size,
                           lm.counters.saved())
    for lm, prefix, ids, _ in ctx.values():
        for _ in range(2):
            lm.reset()
            with timed(lm.device) as t:
                lm.forward(ids[:prefix], n_logits=0)
        if prefill is not None:
            prefill[id(lm)] = t.s / prefix
    return ctx


def interleaved_round(cells, ctx: dict) -> list[float]:
    """Seconds of each cell once, in order: its runner rolled back to its context, then n tokens fed."""
    out = []
    for lm, n, all_logits in cells:
        _, prefix, ids, _ = ctx[id(lm)]
        lm.rollback(prefix)
        with timed(lm.device) as t:
            lm.forward(ids[prefix:prefix + n], n_logits=n if all_logits else 1)
        out.append(t.s)
    return out


def release(ctx: dict) -> None:
    """Every runner of a `prefilled` context reset, its counters as they were."""
    for lm, _, _, saved in ctx.values():
        lm.reset()
        lm.counters.restore(saved)
