"""The counts the probe prices configurations at, where they come from: the head's curve at a workload's mix of
prompt sources (`--workload`), and prompt lookup and combined replayed along answers (COPY_DATA's dev answers,
or the answers recorded on the user's prompts): what a draft would have copied and drafted there."""
from __future__ import annotations

from pathlib import Path

from .. import params
from ..errors import UserError

# the answers prompt lookup is priced on: the committed heads' dev responses (a workload's copying is the
# workload's, not the machine's; this mix stands for a general one, as it does for the head's curve)
COPY_DATA = "data/datagen/mix"


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


def _scaled(counts: dict, f: float) -> dict:
    out = {k: v * f for k, v in counts.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if isinstance(counts.get("target_pass_hist"), dict):
        out["target_pass_hist"] = {n: c * f for n, c in counts["target_pass_hist"].items()}
    return out


def mixed(groups) -> dict:
    """Counts of a workload of kinds in equal parts: each group's pooled counts (sum_counts) scaled to one token,
    summed (so n_tokens is the number of kinds; timemodel.predict_time is linear in the counts)."""
    from .report_data import sum_counts

    parts = [sum_counts(g) for g in groups]
    return sum_counts([_scaled(c, 1.0 / c["n_tokens"]) for c in parts])


def workload_point(curve: dict, kinds, select) -> dict:
    """select(section) on the pooled curve (kinds None), or those of the kinds' sources mixed (`mixed`)."""
    if kinds is None:
        return select(curve)
    return mixed([[select(curve["by_source"][src]) for src in WORKLOADS[kind]] for kind in kinds])


def _grouped(answers_by_source: dict, kinds) -> tuple[dict | None, int]:
    """Replayed answers (source -> their counts) as one workload's counts, pooled (kinds None) or mixed by kind;
    with how many answers they hold (None where a kind has none)."""
    from .report_data import sum_counts

    if kinds is None:
        every = [a for group in answers_by_source.values() for a in group]
        return (sum_counts(every) if every else None), len(every)
    groups = [[a for src in WORKLOADS[kind] for a in answers_by_source.get(src, [])] for kind in kinds]
    used = sum(len(answers_by_source.get(src, [])) for kind in dict.fromkeys(kinds) for src in WORKLOADS[kind])
    return (mixed(groups) if all(groups) else None), used


def _data_path(data_dir) -> Path | None:
    from ..runs import PROJECT_ROOT

    path = Path(data_dir) if data_dir is not None else PROJECT_ROOT / COPY_DATA
    return path if (path / "manifest.json").is_file() else None


def copy_counts(costs, k_max: int, data_dir=None, kinds=None, records=None) -> dict | None:
    """Prompt lookup's counts (`--policy ngram --k auto` at these costs) over the dev responses of a datagen run
    (ngram.replay_copies; default COPY_DATA, the committed heads' data: ShareGPT, code, GSM8K-train and MBPP
    prompts, none of the benchmark sets), pooled or, for `kinds` (parse_workload), mixed by kind; with how many
    answers. None where the data (or a kind's answers) is absent. `records`: replay these answers instead (the
    user's prompts': probe_prompts.as_responses)."""
    from ..decoding.ngram import NgramPolicy, replay_copies, verify_steps_of
    from ..training.autotune import responses

    path = _data_path(data_dir) if records is None else "your prompts"
    if path is None:
        return None
    p = params.NgramParams()
    policy = NgramPolicy(p.ngram_min, p.ngram_max, "auto", k_max, verify_steps=verify_steps_of(costs))
    by: dict = {}
    for src, _, _, prompt, response in (responses(path, "dev") if records is None else records):
        by.setdefault(src, []).append(replay_copies(policy, prompt, response))
    out, used = _grouped(by, kinds)
    return None if out is None else {**out, "n_responses": used, "data": str(path)}


def combined_counts(costs, head, h: float, cap: int, k_max: int, data_dir=None, kinds=None,
                    samples: int = COMBINED_SAMPLES, seed: int = 0, records=None) -> dict | None:
    """The combined configuration's counts (`--policy ngram --fallback learned`, SpecDec++ at h with K <= cap
    where nothing is copied) over the dev responses of a datagen run (default COPY_DATA; pooled, or mixed by
    kind), replayed jointly: NgramPolicy's own rounds (ngram.replay_copies) with the draft's rounds in between,
    each K as autotune's replay stops (stop_lengths over the head's p̂ there) and its accepted count drawn from
    the stored acceptance probabilities (the P_i autotune's replay multiplies), `samples` draws per answer. None
    where the data is absent. Jointly because the two interact: a copy is taken only where it beats the draft's
    rounds so far, and a draft round can run past where a copy would start. `records`: these answers, with their
    p̂, instead (as copy_counts takes them)."""
    import numpy as np

    from ..decoding.interfaces import StopPolicy
    from ..decoding.ngram import NgramPolicy, replay_copies, verify_steps_of
    from ..heads import head as heads
    from ..runs import read_manifest
    from ..training.autotune import responses, stop_lengths, window_products

    path = _data_path(data_dir) if records is None else "your prompts"
    if path is None:
        return None
    man = read_manifest(path) if records is None else {}
    model = heads.load_head(head, hidden_size=(man.get("models", {}).get("draft") or {}).get("hidden_size"),
                            why="the probe's combined replay",
                            **({"inputs": heads.INPUTS} if hasattr(heads, "INPUTS") else {}))
    lag = 0 if getattr(model, "feature", "token") == "context" else 1
    p = params.NgramParams()
    policy = NgramPolicy(p.ngram_min, p.ngram_max, "auto", k_max, verify_steps=verify_steps_of(costs),
                         fallback=StopPolicy(), draft_steps=costs.c)
    rng = np.random.default_rng(seed)
    by: dict = {}
    for src, P, phat, prompt, response in (responses(path, "dev", model) if records is None else records):
        K = stop_lengths(window_products(phat, cap), h, cap, lag)

        def model_round(s, remaining):
            k = int(min(K[s], remaining - 1))
            n = 0
            while n < k and rng.random() < P[s + n]:
                n += 1
            return k, n

        by.setdefault(src, []).extend(replay_copies(policy, prompt, response, model_round) for _ in range(samples))
    out, used = _grouped(by, kinds)
    return None if out is None else {**out, "n_responses": used // samples, "data": str(path)}


def describe_workload(workload) -> str:
    if workload in (None, MIX):
        return "the heads' dev answers pooled (--workload mix)"
    parts = [f"{k} ({'+'.join(WORKLOADS[k])})" for k in dict.fromkeys(workload)]
    return ("prompts of " + ", ".join(parts) + (" in equal parts" if len(workload) > 1 else "")
            + f" (--workload {','.join(workload)})")
