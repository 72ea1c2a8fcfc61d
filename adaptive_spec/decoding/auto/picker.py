"""`--threshold auto` and `--k auto`: the counts per token depend on the head and the data, the machine only
through the forward times (Eq. 5.1), so the h (K) of best predicted decode throughput is picked from the
curve (made offline by `adaptive-spec autotune`) at this machine's measured costs, under a time model."""
from __future__ import annotations

from pathlib import Path

from ...errors import UserError, get_logger
from ...heads.curve import curve_path, load_curve, sampling_mismatch
from .costs import measure_costs
from .timemodel import ONE_STEP, coef_of, effective_model, rate_of

log = get_logger(__name__)

# the time model of the picks: eval/fit_time_model.py compares the models on a sweep's measured rows
DEFAULT_TIME_MODEL = "extended"
AR = "ar"  # an auto pick of no drafting at all


def pick(curve: dict, need: str, costs, model: str = DEFAULT_TIME_MODEL, k_max: int | None = None,
         loop: str | None = None) -> dict:
    """The h (need "h") or K (need "k") of the curve with the best predicted decode throughput under `model`
    at `costs`, with every candidate's prediction; under the table model the capped points compete too (the
    pick's cap as "k_max"), and the target alone always. `loop`: the sampling mode whose loop time is added."""
    coef = coef_of(costs, model, loop)
    model = effective_model(costs, model)
    table = [(p[need], rate_of(p, coef)) for p in curve["thresholds" if need == "h" else "fixed_k"]]
    value, tps = max(table, key=lambda vt: vt[1])
    out = {"kind": need, "value": value, "tokens_per_s": tps, "model": model, "costs": costs.to_dict(),
           "predicted": dict(table)}
    if need == "h" and model == "table":
        out["k_max"] = limit = curve.get("k_max", 20) if k_max is None else k_max
        capped = [((p["h"], p["k_max"]), rate_of(p, coef)) for p in curve.get("capped", []) if p["k_max"] <= limit]
        out["predicted_capped"] = {f"{h:g}@{cap}": v for (h, cap), v in capped}
        best = max(capped, key=lambda vt: vt[1], default=None)
        if best is not None and best[1] > tps:
            (out["value"], out["k_max"]), out["tokens_per_s"] = best
    # the target alone competes too: where a draft step costs too much against a target pass (llama.cpp
    # on some CPUs), no h or K pays, and auto decodes without drafting
    out["ar_tokens_per_s"] = rate_of(ONE_STEP, coef)
    if out["ar_tokens_per_s"] > out["tokens_per_s"]:
        out.update(value=AR, tokens_per_s=out["ar_tokens_per_s"])
        out.pop("k_max", None)
    return out


def resolve_auto(pair, params, temperature: float | None = None):
    """(params, pick): PolicyParams with k / threshold "auto" replaced by this machine's pick (unchanged and None
    when nothing is automatic; None for the params when the pick is the target alone). Picks are remembered
    on the pair and printed once, warned where the curve's sampling is not the decode's."""
    need = ("h" if getattr(params, "threshold", None) == "auto" and params.name == "learned"
            else "k" if getattr(params, "k", None) == "auto" and params.name == "fixed" else None)
    if need is None:
        return params, None
    # the engine's own time model (on llama.cpp the per-length table: its pass time is a step function of K)
    model = getattr(getattr(pair, "engine", None), "time_model", DEFAULT_TIME_MODEL)
    head = getattr(params, "head", None)
    source = params.curve or (head if isinstance(head, (str, Path)) else None)
    curve = load_curve(source, need, head)
    k_max = getattr(params, "k_max", None)
    if need == "h" and "k_max" not in params.model_fields_set:
        k_max = curve["k_max"]
    if need == "h" and k_max != curve["k_max"]:
        raise UserError(f"the curve was made with k_max {curve['k_max']}, not {k_max}; drop --k-max or rerun "
                        f"autotune with --k-max {k_max}")
    memo = pair.auto_picks
    loop = None if temperature is None else "greedy" if temperature == 0 else "sample"
    key = (str(curve_path(source)), need, model, k_max, loop)
    if key not in memo:
        memo[key] = pick(curve, need, measure_costs(pair), model, k_max, loop)
        memo[key]["curve"] = key[0]
        log.info(describe_pick(memo[key]))
        warning = sampling_mismatch(curve, temperature)
        if warning:
            log.warning(warning)
    choice = memo[key]
    if choice["value"] == AR:  # no drafting pays on this machine: None, the target alone
        return None, choice
    update = {"threshold" if need == "h" else "k": choice["value"], "curve": None}
    if need == "h":
        update["k_max"] = choice.get("k_max", k_max)
    return params.model_copy(update=update), choice


def describe_pick(choice: dict) -> str:
    c = choice["costs"]
    name = "h" if choice["kind"] == "h" else "K"
    cap = f" with K <= {choice['k_max']}" if choice.get("k_max") is not None else ""
    value = "none (the target alone: drafting does not pay here)" if choice["value"] == AR else f"{choice['value']:g}"
    return (f"auto: {name} = {value}{cap}, predicted {choice['tokens_per_s']:.2f} tok/s decoding "
            f"({choice['model']} time model; t_draft {1e3 * c['t_draft']:.1f} ms, t_target {1e3 * c['t_target']:.1f} ms, "
            f"t_cand {1e3 * c['t_cand']:.1f} ms; curve {choice['curve']})")


def predicted_wall(auto: dict, n_prompt: int, n_tokens: int) -> dict:
    """auto's predicted wall tokens/s of this generation: its decode rate plus the prompt's prefill at
    the measured prefill rates (the draft's too where the pick drafts)."""
    c = auto.get("costs") or {}
    per_token = c.get("t_prefill", 0.0) + (c.get("t_prefill_draft", 0.0) if auto.get("value") != "ar" else 0.0)
    if not per_token or not n_tokens:
        return {}
    decode = n_tokens / auto["tokens_per_s"]
    return {"wall_tokens_per_s": n_tokens / (decode + per_token * max(n_prompt - 1, 0))}
