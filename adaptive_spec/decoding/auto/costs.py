"""What a forward pass costs on the running machine, the hardware side of Eq. 5.1: t_draft (one draft step),
t_target (a one-token target pass) and t_cand (the extra target time per candidate of a K + 1-token pass),
with the per-length passes kept (monotone) as t_verify for the `table` time model.

`measure_costs(pair)` times the pair's own runners (cost_timing.py) and caches the result as JSON in
<cache>/costs/<key>.json, the key hashing everything that moves these times (cost_config)."""
from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ...backends.cpu.machine import describe
from ...errors import UserError, get_logger
from ...runs import write_json
from ...timing import torch_threads
from .cost_timing import PREFIX, decode_loop_times, interleaved_times, loop_times, monotone, with_loop_own

log = get_logger(__name__)

VERIFY_LENGTHS = tuple(range(1, 10))  # K + 1 for K = 0..8
# longer passes, timed too (fewer rounds) for drafts that copy long spans (ngram.py): their cost per row is
# not the short passes' (kernels change with the row count), so the line through 1..9 does not price them
LONG_LENGTHS = (12, 16, 24, 32, 48)
# how the times are taken, in the cache key: times taken another way are measured again
METHOD = "interleaved-monotone-v7"


@dataclass
class Costs:
    t_draft: float
    t_target: float
    t_cand: float
    key: str
    measured: str  # when (UTC) and where the times were taken
    t_verify: tuple = ()  # seconds of a target pass of n = 1, 2, ... tokens (VERIFY_LENGTHS), as measured
    t_prefill: float = 0.0  # seconds per prompt token of the target's prefill (a PREFIX-token prompt)
    t_prefill_draft: float = 0.0  # the same for the draft (0: no draft)
    # the decode loop's own time, per sampling mode (LOOP_SAMPLING): "row", processing one row of logits
    # and drawing from it (a draft step, a target step); "round", a verification's fixed part (rejection
    # sampling, the host read, the rollback) beyond its rows
    loop: dict = None
    t_verify_long: dict = None  # {n: seconds} of the LONG_LENGTHS passes (monotone with t_verify)
    # a draft pass of two tokens, a round's first after one whose candidates were all accepted (y_K and the
    # bonus token; decoder.py's cache invariant) (0: not measured)
    t_draft_two: float = 0.0
    # the target's one-row pass timed as an interleaved cell, beside t_verify[0] timed in the decode's own
    # loop: how far the two ways differ (0: not measured)
    t_step_cell: float = 0.0

    def loop_s(self, mode: str, part: str) -> float:
        return float(((self.loop or {}).get(mode) or {}).get(part, 0.0))

    def verify_s(self, n: int) -> float:
        """A target pass of n tokens: the measured time, past the measured lengths the last one
        plus t_cand per extra token, without a table the line t_target + t_cand (n - 1)."""
        if not self.t_verify:
            return self.t_target + self.t_cand * (n - 1)
        m = len(self.t_verify)
        if n <= m:
            return self.t_verify[n - 1]
        points = [(m, self.t_verify[-1])] + sorted((int(k), float(v)) for k, v in (self.t_verify_long or {}).items())
        for (a, ta), (b, tb) in zip(points, points[1:]):  # between measured lengths: the line through them
            if n <= b:
                return ta + (tb - ta) * (n - a) / (b - a)
        last, t_last = points[-1]
        slope = (t_last - points[-2][1]) / (last - points[-2][0]) if len(points) > 1 else self.t_cand
        return t_last + slope * (n - last)

    @property
    def t_catch_up(self) -> float:
        """What a two-token draft step costs beyond a one-token one (0 where not measured)."""
        return max(0.0, self.t_draft_two - self.t_draft) if self.t_draft_two else 0.0

    @property
    def c(self) -> float:
        """t_draft / t_target, the paper's cost ratio."""
        return self.t_draft / self.t_target

    @property
    def node_cost(self) -> float:
        """One more drafted token (its draft step and its share of the verification), in target steps."""
        return (self.t_draft + self.t_cand) / self.t_target

    def to_dict(self) -> dict:
        return asdict(self)


def costs_dir() -> Path:
    from ...setup.llama_build import cache_dir  # stdlib only: the project's one cache root

    return cache_dir() / "costs"


def cost_config(pair) -> dict:
    """What the forward times depend on (hashed into the cache key)."""
    machine = describe()
    device = pair.target.device
    config = {"cpu": machine["cpu"], "cpu_flags": machine["cpu_flags"], "isa": machine["isa"], "context": PREFIX,
              "method": METHOD,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "device": str(device),
              "backend": type(pair.target).__name__, **getattr(pair, "draft_config", {})}
    if device.type == "cuda":
        config["gpu"] = torch.cuda.get_device_name(device)
    for role, lm in (("target", pair.target), ("draft", pair.draft)):  # no draft: the target alone's passes only
        config[f"{role}_fingerprint"] = None if lm is None else lm.fingerprint()
        if lm is not None:  # the runner's numeric path (dtype and kernels chosen at load; llama.cpp's GGUF and threads)
            config[f"{role}_path"] = lm.numeric_path()
    return config


def config_key(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def measure_costs(pair, reps: int = 5, cache: bool = True, pin: str | Path | None = None) -> Costs:
    """This machine's Costs for `pair` (anything with runner .target and .draft), from the cache when this
    configuration was measured before. `pin` (a JSON path) fixes the measurement for a long job: the first
    call writes it, later ones (a resumed job) read it back while machine and models are the same, and the
    pair remembers it. Without one each load may land on another cache entry, as the CPU kernels picked at
    load are in the key, and a resumed job's auto picks would move.

    It measures on the torch threads the pair's decode runs on (its engine's decode_torch_threads): the
    loop's own host work is among the costs, and the threads are in the cache key, so every caller (generate,
    the sweep, the probe, a benchmark) lands on the one measurement the decode's auto reads."""
    pinned = getattr(pair, "pinned_costs", None)
    if pinned is not None:
        return pinned
    with torch_threads(getattr(getattr(pair, "engine", None), "decode_torch_threads", None)):
        return _measure_costs(pair, reps, cache, pin)


def _measure_costs(pair, reps: int, cache: bool, pin: str | Path | None) -> Costs:
    config = cost_config(pair)
    key = config_key(config)
    costs = None if pin is None else _read_costs_file(Path(pin), "pinned", config=config)
    if costs is not None:
        pair.pinned_costs = costs
        return costs
    path = costs_dir() / f"{key}.json"
    costs = _read_costs_file(path, "cached", key) if cache else None
    if costs is None:
        if cache:
            log.info(f"measuring forward times on this machine (once per configuration; cached in {path})")
        costs = _measure(pair, reps, key)
        if cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, {**costs.to_dict(), "config": config})
    if pin is not None:
        write_json(pin, {**costs.to_dict(), "config": config})
        pair.pinned_costs = costs
    return costs


def costs_from_json(d: dict) -> Costs:
    """Costs from a cache file's JSON (KeyError / TypeError / ValueError where it is not one)."""
    return Costs(float(d["t_draft"]), float(d["t_target"]), float(d["t_cand"]), str(d["key"]), str(d["measured"]),
                 tuple(float(t) for t in d.get("t_verify") or ()), float(d.get("t_prefill", 0.0)),
                 float(d.get("t_prefill_draft", 0.0)), d.get("loop"),
                 {int(k): float(v) for k, v in (d.get("t_verify_long") or {}).items()} or None,
                 float(d.get("t_draft_two", 0.0)), float(d.get("t_step_cell", 0.0)))


def _read_costs_file(path: Path, what: str, key: str | None = None, config: dict | None = None) -> Costs | None:
    """The Costs of a cache or pin file, or None where it is absent, or (with a warning) unreadable, of another
    `key`, without positive per-length times, or (a pin) measured with another `config`: all are measured again."""
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        costs = costs_from_json(saved)
        if (key is not None and costs.key != key) or not (costs.t_draft >= 0 and costs.t_target > 0
                                                          and costs.t_cand >= 0):
            raise ValueError(f"key {costs.key}, times {costs.t_draft}, {costs.t_target}, {costs.t_cand}")
        if len(costs.t_verify) != len(VERIFY_LENGTHS) or not all(t > 0 for t in costs.t_verify):
            raise ValueError("no per-length verification times (written by an older version)")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        log.warning(f"{what} forward times {path} are unreadable ({type(e).__name__}: {e}); measuring again")
        return None
    if config is None:
        return costs
    # leaving out the kernels picked at load (<role>_path): the oneDNN padding is measured each time, moving with noise
    was = saved.get("config") or {}
    differ = sorted(k for k in {*was, *config} if not k.endswith("_path") and was.get(k) != config.get(k))
    if differ:
        log.warning(f"pinned forward times {path} were measured with another {', '.join(differ)}; "
                    "measuring again on this machine (rows before this carry the old auto picks)")
        return None
    return costs


def _measure(pair, reps: int, key: str) -> Costs:
    if reps < 1:
        raise UserError(f"reps must be >= 1, got {reps}")
    prefill: dict = {}
    times = interleaved_times(measured_cells(pair), reps, prefill)
    # a two-token step never costs less than a one-token one (timing noise where they are alike)
    t_draft, t_draft_two = (times[0], max(times[0], times[1])) if pair.draft is not None else (0.0, 0.0)
    # the one-row pass is the target alone's step: timed as its loop runs it, the interleaved cell kept beside
    cell = times[-len(VERIFY_LENGTHS)]
    step, own = decode_loop_times(pair.target, reps)
    measured = [step] + list(times[-len(VERIFY_LENGTHS) + 1:])
    limit = getattr(pair.target, "max_length", None)
    longs = [n for n in LONG_LENGTHS if not limit or n <= limit // 2]  # after a context of at least as many
    long_times = interleaved_times([(pair.target, n, True) for n in longs], max(1, (reps + 1) // 2)) if longs else []
    k = np.asarray(VERIFY_LENGTHS, dtype=float) - 1
    slope, intercept = np.polyfit(k, measured, 1)
    if slope < 0:  # timing noise on a pass that does not grow with K: no per-candidate cost
        slope, intercept = 0.0, statistics.mean(measured)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    table = monotone(list(measured) + list(long_times))
    return Costs(float(t_draft), float(intercept), float(slope), key, stamp,
                 tuple(float(t) for t in table[:len(VERIFY_LENGTHS)]), prefill.get(id(pair.target), 0.0),
                 prefill.get(id(pair.draft), 0.0) if pair.draft is not None else 0.0,
                 with_loop_own(loop_times(pair.target.vocab_size, pair.target.device), own),
                 {n: float(t) for n, t in zip(longs, table[len(VERIFY_LENGTHS):])} or None, float(t_draft_two),
                 float(cell))


def measured_cells(pair) -> list[tuple]:
    """The interleaved cells (runner, tokens, all rows' logits) of one timing round: the draft's one- and
    two-token steps (with a draft), then the target's passes of every VERIFY_LENGTHS length."""
    return ([(pair.draft, 1, False), (pair.draft, 2, False)] if pair.draft is not None else []) + [
        (pair.target, n, True) for n in VERIFY_LENGTHS]
