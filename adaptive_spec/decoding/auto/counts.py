"""The counts prediction prices configurations at: the head's curve at a workload's mix of prompt sources
(`--workload`), and prompt lookup and combined replayed along answers (dev answers, or the user's: Answers)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from ... import params
from ...errors import UserError
from .curve_replay import stop_lengths, window_products


@dataclass
class Answers:
    """Answers the replays walk: `read(head)` yields (source, P, p̂ or None, prompt ids, response ids) per answer
    (p̂ by `head`, a loaded head, where given); `label` names them in the reasons, `where` in the counts;
    `hidden_size`: the draft's, which a head reads on them (None: the head's own)."""
    label: str
    where: str
    read: Callable
    hidden_size: int | None = None


# draws per answer of the combined replay's draft rounds (their accepted counts are sampled; copies are not)
COMBINED_SAMPLES = 4

# what a user can say their prompts are (--workload): the prompt sources of the heads' dev answers that stand
# for each kind (the curve's by_source, COPY_DATA's source_ids); "mix" is those answers as they are pooled
WORKLOADS = {"chat": ("sharegpt",), "code": ("sharegpt-code", "mbpp"), "math": ("gsm8k-train",)}
MIX = "mix"


def parse_workload(text) -> tuple[str, ...] | None:
    """--workload: None for MIX; else the kinds named (comma-separated, WORKLOADS' keys; a kind named twice
    weighs twice), mixed in equal parts of tokens."""
    kinds = tuple(k.strip().lower() for k in (text if isinstance(text, (list, tuple)) else str(text).split(","))
                  if k.strip())
    if kinds in ((), (MIX,)):
        return None
    bad = [k for k in kinds if k not in WORKLOADS]
    if bad:
        raise UserError(f"--workload: unknown kind {bad[0]!r}; valid: {MIX} (the default: the heads' dev answers "
                        f"pooled) or a comma-separated list of {', '.join(WORKLOADS)}")
    return kinds


def check_workload(curve: dict, kinds) -> None:
    """The curve counts every source the kinds stand for (a curve of one source has no by_source)."""
    have = curve.get("by_source") or {}
    for kind in kinds or ():
        missing = [src for src in WORKLOADS[kind] if src not in have]
        if missing:
            raise UserError(f"--workload {kind}: the head's curve has no counts for prompt source {missing[0]!r} "
                            f"(it has: {', '.join(have) or 'no per-source counts'}); use --workload {MIX}")


def sum_counts(rows: list[dict]) -> dict:
    """Rows' counts summed, as one row timemodel.predict_time prices (their target passes' histogram summed
    too, where every row has one)."""
    out = {k: sum(float(r.get(k) or 0.0) for r in rows)
           for k in ("n_tokens", "n_target_forwards", "n_draft_forwards", "n_drafted", "n_accepted")}
    for k in ("n_all_accepted", "n_fed_extra"):  # where every row counts them (a replay's, a curve point's)
        if rows and all(k in r for r in rows):
            out[k] = sum(float(r.get(k) or 0.0) for r in rows)
    if rows and all(isinstance(r.get("target_pass_hist"), dict) for r in rows):
        hist = defaultdict(float)
        for r in rows:
            for n, c in r["target_pass_hist"].items():
                hist[str(n)] += float(c)
        out["target_pass_hist"] = dict(hist)
    return out


def mixed(groups) -> dict:
    """Counts of a workload of kinds in equal parts: each group's pooled counts (sum_counts) scaled to one token,
    summed (so n_tokens is the number of kinds; timemodel.predict_time is linear in the counts)."""
    scaled = []
    for c in map(sum_counts, groups):
        f = 1.0 / c["n_tokens"]
        scaled.append({k: {n: x * f for n, x in v.items()} if isinstance(v, dict) else v * f for k, v in c.items()})
    return sum_counts(scaled)


def workload_point(curve: dict, kinds, select) -> dict:
    """select(section) on the pooled curve (kinds None), or those of the kinds' sources mixed (`mixed`)."""
    if kinds is None:
        return select(curve)
    return mixed([[select(curve["by_source"][src]) for src in WORKLOADS[kind]] for kind in kinds])


def _grouped(by_source: dict, kinds, answers: Answers, draws: int = 1) -> dict | None:
    """Replayed answers (source -> their counts, `draws` an answer) as one workload's counts, pooled (kinds None)
    or mixed by kind, with how many answers they hold and where from; None where a kind has none."""
    if kinds is None:
        every = [a for group in by_source.values() for a in group]
        out, used = (sum_counts(every) if every else None), len(every)
    else:
        groups = [[a for src in WORKLOADS[kind] for a in by_source.get(src, [])] for kind in kinds]
        used = sum(len(by_source.get(src, [])) for kind in dict.fromkeys(kinds) for src in WORKLOADS[kind])
        out = mixed(groups) if all(groups) else None
    return None if out is None else {**out, "n_responses": used // draws, "data": answers.where}


def copy_counts(costs, k_max: int, answers: Answers | None, kinds=None) -> dict | None:
    """Prompt lookup's counts (`--policy ngram --k auto` at these costs) over `answers` (ngram.replay_copies),
    pooled or, for `kinds` (parse_workload), mixed by kind; with how many answers. None where there are no
    answers (or a kind has none)."""
    from ..ngram import NgramPolicy, replay_copies, verify_steps_of

    if answers is None:
        return None
    p = params.NgramParams()
    policy = NgramPolicy(p.ngram_min, p.ngram_max, "auto", k_max, verify_steps=verify_steps_of(costs))
    by: dict = {}
    for src, _, _, prompt, response in answers.read():
        by.setdefault(src, []).append(replay_copies(policy, prompt, response))
    return _grouped(by, kinds, answers)


def combined_counts(costs, head, h: float, cap: int, k_max: int, answers: Answers | None, kinds=None) -> dict | None:
    """The combined configuration's counts (`--policy ngram --fallback learned`, SpecDec++ at h with K <= cap
    where nothing is copied) over `answers` (None without), replayed jointly, as the two interact: NgramPolicy's
    rounds with the draft's in between, each K as autotune's replay stops and its accepted count drawn from
    the stored P_i, COMBINED_SAMPLES draws per answer."""
    import numpy as np

    from ..interfaces import StopPolicy
    from ..ngram import NgramPolicy, replay_copies, verify_steps_of
    from ...heads import head as heads

    if answers is None:
        return None
    model = heads.load_head(head, hidden_size=answers.hidden_size, why="the probe's combined replay",
                            inputs=heads.INPUTS)
    lag = 0 if getattr(model, "feature", "token") == "context" else 1
    p = params.NgramParams()
    policy = NgramPolicy(p.ngram_min, p.ngram_max, "auto", k_max, verify_steps=verify_steps_of(costs),
                         fallback=StopPolicy(), draft_steps=costs.c)
    rng = np.random.default_rng(0)
    by: dict = {}
    for src, P, phat, prompt, response in answers.read(model):
        K = stop_lengths(window_products(phat, cap), h, cap, lag)

        def model_round(s, remaining):
            k = int(min(K[s], remaining - 1))
            n = 0
            while n < k and rng.random() < P[s + n]:
                n += 1
            return k, n

        by.setdefault(src, []).extend(replay_copies(policy, prompt, response, model_round)
                                      for _ in range(COMBINED_SAMPLES))
    return _grouped(by, kinds, answers, COMBINED_SAMPLES)


def describe_workload(workload) -> str:
    if workload in (None, MIX):
        return "the heads' dev answers pooled (--workload mix)"
    parts = [f"{k} ({'+'.join(WORKLOADS[k])})" for k in dict.fromkeys(workload)]
    return ("prompts of " + ", ".join(parts) + (" in equal parts" if len(workload) > 1 else "")
            + f" (--workload {','.join(workload)})")
