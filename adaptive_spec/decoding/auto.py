"""`--threshold auto` and `--k auto`: SpecDec++'s h, or a fixed K, picked for the running machine
without a sweep (Theorem 4.3 put to work).

The counts a policy produces per token, N_target/N and N_discarded/N, depend on the head and the
data, not on the machine; the machine enters only through the forward times (Eq. 5.1). So:

At generate time `threshold="auto"` (`k="auto"`) loads the curve, measures or loads this
machine's forward times (costs.py) and takes the h (K) of best predicted decode throughput under a
time model (timemodel.py; `resolve_auto(model=)`, default "extended": Eq. 3.1 plus t_cand per
drafted token; "table" prices each verification pass at the measured time of its length, which on
CPUs is a step function of K, not a line, and lets the h pick cap K where longer passes cost a
step more; `eval/fit_time_model.py SWEEP_DIR --costs FILE` says which predicts a sweep better).
`k="auto"` reads the per-K part of any curve: `curve=PATH` (`--curve`), else the one beside `head`
(every head's curve carries it: fixed-K rounds do not depend on the head).

The curve is made offline, from datagen data, by training/autotune.py (`adaptive-spec autotune`).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import UserError, get_logger
from ..runs import read_json
from .costs import measure_costs
from .timemodel import coef_of, effective_model, predict_time

log = get_logger(__name__)

FORMAT = "adaptive_spec.threshold_curve.v1"
CURVE_NAME = "threshold_curve.json"
# the time model of the picks: eval/fit_time_model.py compares the models on a sweep's measured rows
DEFAULT_TIME_MODEL = "extended"


def weights_hash(head_dir) -> str | None:
    f = Path(str(head_dir)).expanduser() / "model.safetensors"
    return hashlib.sha256(f.read_bytes()).hexdigest()[:16] if f.is_file() else None

def autotune_command(head, data, split: str = "dev", k_max: int = 20, out=None) -> str:
    cmd = "adaptive-spec autotune" + (f" --head {head}" if head else "") + f" --data {data}"
    cmd += "" if split == "dev" else f" --split {split}"
    cmd += "" if k_max == 20 else f" --k-max {k_max}"
    return cmd + (f" --out {out}" if out else "")

def curve_path(source) -> Path:
    p = Path(str(source)).expanduser()
    return p if p.suffix == ".json" else p / CURVE_NAME


def _data_hint(head) -> str:
    """The datagen run a head was trained on (its config.json records it), for the fix's command."""
    try:
        return json.loads((Path(str(head)) / "config.json").read_text()).get("dataset") or "DATAGEN_DIR"
    except (OSError, ValueError, TypeError):
        return "DATAGEN_DIR"


def _fix(source) -> str:
    """How to make the curve `source` names."""
    p = Path(str(source)).expanduser()
    if p.suffix == ".json":
        return f"make it with `{autotune_command('HEAD_DIR', 'DATAGEN_DIR', out=p)}` (--head optional for --k auto)"
    return f"make it with `{autotune_command(source, _data_hint(source))}`"


def load_curve(source, need: str, head=None) -> dict:
    """The curve at `source` (a curve file, or a folder holding one) with the part `need` ("h" or
    "k"); a missing, foreign or stale one is a UserError naming the command that makes one.
    `head` (the head in use, if a folder): its weights must be those the curve was made for."""
    flag = "--threshold auto" if need == "h" else "--k auto"
    if source is None:
        raise UserError(f"{flag} needs a predicted curve: pass --curve FILE (curve=FILE from Python) or --head DIR "
                        f"with a {CURVE_NAME} beside it; {_fix('HEAD_DIR')}")
    path = curve_path(source)
    if not path.is_file():
        raise UserError(f"{flag} needs the predicted curve {path}, which does not exist; {_fix(source)}")
    curve = read_json(path, hint=_fix(source))
    if curve.get("format") != FORMAT:
        raise UserError(f"{path} is not a threshold curve (format {curve.get('format')!r}); {_fix(source)}")
    if need == "h" and not curve.get("thresholds"):
        raise UserError(f"{path} was made without a head and has no thresholds; {_fix(head if isinstance(head, (str, Path)) else 'HEAD_DIR')}")
    recorded = (curve.get("head") or {}).get("weights")
    current = weights_hash(head) if need == "h" and isinstance(head, (str, Path)) else None
    if recorded and current and recorded != current:
        raise UserError(f"{path} was made for other weights than those of the head in {head} (retrained since?); "
                        f"rerun `{curve.get('command') or autotune_command(head, _data_hint(head))}`")
    return curve


AR = "ar"  # an auto pick of no drafting at all


def pick(curve: dict, need: str, costs, model: str = DEFAULT_TIME_MODEL, k_max: int | None = None,
         loop: str | None = None) -> dict:
    """The h (need "h") or K (need "k") of the curve with the best predicted decode throughput
    N / T under `model` with the measured `costs`; with every candidate's prediction. For h under
    the table model (with per-length verification times measured), the curve's capped rounds
    (`capped`, K <= cap < k_max) compete too, and the pick says its cap as "k_max". `loop`: the
    sampling mode whose measured loop time is added (costs.LOOP_SAMPLING; None: forwards only)."""
    coef = coef_of(costs, model, loop)
    model = effective_model(costs, model)
    points = curve["thresholds"] if need == "h" else curve["fixed_k"]
    table = [(p[need], p["n_tokens"] / predict_time(p, coef)) for p in points]
    value, tps = max(table, key=lambda vt: vt[1])
    out = {"kind": need, "value": value, "tokens_per_s": tps, "model": model, "costs": costs.to_dict(),
           "predicted": dict(table)}
    limit = curve.get("k_max", 20) if k_max is None else k_max
    if need == "h" and model == "table":
        out["k_max"] = limit
        capped = [((p["h"], p["k_max"]), p["n_tokens"] / predict_time(p, coef))
                  for p in curve.get("capped", []) if p["k_max"] <= limit]
        out["predicted_capped"] = {f"{h:g}@{cap}": v for (h, cap), v in capped}
        best = max(capped, key=lambda vt: vt[1], default=None)
        if best is not None and best[1] > tps:
            (out["value"], out["k_max"]), out["tokens_per_s"] = best
    # the target alone competes too: where a draft step costs too much against a target pass (llama.cpp
    # on some CPUs), no h or K pays, and auto decodes without drafting
    out["ar_tokens_per_s"] = 1.0 / ((coef["verify_s"](1) if "verify_s" in coef else coef["t_target"])
                                    + coef.get("loop_row", 0.0))
    if out["ar_tokens_per_s"] > out["tokens_per_s"]:
        out.update(value=AR, tokens_per_s=out["ar_tokens_per_s"])
        out.pop("k_max", None)
    return out


def resolve_auto(pair, params, model: str | None = None, temperature: float | None = None):
    """(params, pick): a fixed or learned PolicyParams with k / threshold "auto" replaced by the
    pick for this machine (the params unchanged and None when nothing is automatic; None for the
    params when the pick is the target alone). Picks are remembered on the pair and printed once, with a
    warning where the decode is greedy and the curve replays sampled acceptance (or the other way
    round). PolicyParams checked the curve exists and that auto belongs to the policy."""
    need = ("h" if getattr(params, "threshold", None) == "auto" and params.name == "learned"
            else "k" if getattr(params, "k", None) == "auto" and params.name == "fixed" else None)
    if need is None:
        return params, None
    # the engine's own time model (on llama.cpp the per-length table: its pass time is a step function of K)
    model = model or getattr(getattr(pair, "engine", None), "time_model", DEFAULT_TIME_MODEL)
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


def sampling_mismatch(curve: dict, temperature: float | None) -> str | None:
    """Why the curve may not describe this decode: its acceptance was replayed at a temperature on
    the other side of 0. Greedy accepts a drafted token only where it is the target's argmax,
    sampling with probability min(1, p/q): the two acceptance rates differ, and so do the best h
    and K. None where they agree or either temperature is unknown."""
    recorded = ((curve.get("data") or {}).get("sampling") or {}).get("temperature")
    if temperature is None or recorded is None or (recorded == 0) == (temperature == 0):
        return None
    mode = "greedy (temperature 0)" if temperature == 0 else f"sampled (temperature {temperature})"
    return (f"the curve replays acceptance at temperature {recorded}, but this decode is {mode}: its "
            "acceptance differs, so the pick may not be its best; pass a number, or autotune on data "
            "generated at this temperature")


def describe_pick(choice: dict) -> str:
    c = choice["costs"]
    name = "h" if choice["kind"] == "h" else "K"
    cap = f" with K <= {choice['k_max']}" if choice.get("k_max") is not None else ""
    value = "none (the target alone: drafting does not pay here)" if choice["value"] == AR else f"{choice['value']:g}"
    return (f"auto: {name} = {value}{cap}, predicted {choice['tokens_per_s']:.2f} tok/s decoding "
            f"({choice['model']} time model; t_draft {1e3 * c['t_draft']:.1f} ms, t_target {1e3 * c['t_target']:.1f} ms, "
            f"t_cand {1e3 * c['t_cand']:.1f} ms; curve {choice['curve']})")
