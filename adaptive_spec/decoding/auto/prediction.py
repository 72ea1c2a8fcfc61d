"""Prediction: every configuration's tok/s on a loaded pair, priced as `auto` prices them (what `adaptive-spec
probe` prints). It measures the pair's costs (or reads them), takes auto's picks, chooses each configuration's
counts (the curve at a workload, or answers replayed) and prices each with pricing.py's price_* functions."""
from __future__ import annotations

from ... import params
from ...errors import UserError
from ...heads.curve import curve_path, load_curve
from .acceptance import as_responses, describe
from .costs import measure_costs
from .counts import MIX, Answers, check_workload, combined_counts, copy_counts, workload_point
from .picker import AR
from .pricing import (book_for, copy_round, curve_point, price_ar, price_auto, price_combined, price_fixed,
                      price_lookup, row_of)
from .timemodel import rate_of


def by_name(result: dict) -> dict:
    """A prediction's configurations by name, fixed K's as "fixed" (its name carries the K)."""
    return {r["name"].split(" K=")[0]: r for r in result["configurations"]}


def picks_of(result: dict) -> dict | None:
    """What a prediction chose ({"k": K, "pick": (h or AR, cap), "best": (h, cap)}), for pricing the same
    configurations at other costs (`predict(ran=...)`); None where it priced no drafting."""
    by = by_name(result)
    if "fixed" not in by:
        return None
    auto = by["SpecDec++ h=auto"]
    return {"k": by["fixed"]["policy"]["k"], "pick": (auto["pick"], auto.get("pick_k_max")),
            "best": (auto["best"]["h"], auto["best"]["k_max"])}


def predict(pair, head: str | None, temperature: float, prompt_tokens: int, max_new_tokens: int,
            k_max: int = params.NgramParams().k_max, ran: dict | None = None, answers: Answers | None = None,
            workload=None, prompts: dict | None = None) -> dict:
    """Every configuration's predicted tok/s on `pair` (loaded, or anything resolve_auto and measure_costs take),
    priced as `auto` prices them; the draft's configurations only with a draft and a head.
    `ran` (picks_of another result): price the K and h that one chose instead of choosing again
    (eval/bench_probe.py). `answers`: the dev answers prompt lookup and combined are replayed on (None: prompt
    lookup priced as plain steps, combined as SpecDec++). `workload` (parse_workload's kinds; None: pooled):
    whose counts price every configuration; h=auto is still picked from the pooled curve, as a generation
    picks it, fixed K is the workload's best. `prompts` (acceptance.measure's result): price at those answers'
    counts instead, h and K picked from their curve as `--auto-prompts` picks them."""
    costs = measure_costs(pair)
    if prompts is not None and workload is not None:
        raise UserError("--prompts and --workload both say whose acceptance prices the configurations; pass one")
    if prompts is not None:  # the answers recorded on the user's prompts, with the p̂ recorded along them
        records = as_responses(prompts["records"])
        answers = Answers(prompts["label"], "your prompts", lambda head=None: records)
    own = (prompts or {}).get("curve_file")  # the prompts' curve, where the draft was recorded
    curve_file = own or curve_path(head)
    words = "dev answers" if prompts is None else "answers to your prompts"
    picks, loop, model, book = book_for(pair, head, temperature, costs, own, curve_file, words,
                                        answers.label if answers is not None else "none")
    priced, auto = [price_ar(book)], None
    if picks:
        curve = load_curve(curve_file, "h", head)
        check_workload(curve, workload)
        # each configuration's counts at the workload and their tok/s at these costs
        k_point = lambda k: workload_point(curve, workload, lambda c: curve_point(c, "k", k))  # noqa: E731
        h_point = lambda h, cap: workload_point(curve, workload, lambda c: curve_point(c, "h", h, cap))  # noqa: E731
        K = max(picks["k"]["predicted"], key=lambda k: rate_of(k_point(k), book.coef)) if ran is None else ran["k"]
        auto = price_auto(book, h_point, picks["h"], ran, head)
        priced += [price_fixed(book, k_point(K), K), auto]
    lookup = price_lookup(book, copy_counts(costs, k_max, answers, workload), copy_round(costs, book.coef, k_max))
    priced.append(lookup)
    if auto is not None:
        pick = auto.extra["pick"]
        joint = None if pick == AR else combined_counts(
            costs, head, pick, auto.extra["pick_k_max"] or curve["k_max"], k_max, answers, workload)
        priced.append(price_combined(book, auto, lookup, joint, head))
    return {"engine": pair.engine.name, "time_model": model, "sampling": loop, "temperature": temperature,
            "head": head if picks else None, "workload": list(workload) if workload else MIX,
            "acceptance": {"source": "dev answers" if prompts is None else "prompts", "words": describe(prompts),
                           **({k: v for k, v in prompts.items() if k != "records"} if prompts else {})},
            "prompt_tokens": prompt_tokens, "max_new_tokens": max_new_tokens,
            "costs": costs.to_dict(),
            "configurations": [row_of(book, p, prompt_tokens, max_new_tokens) for p in priced]}
