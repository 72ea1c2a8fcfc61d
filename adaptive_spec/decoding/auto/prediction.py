"""Prediction: every configuration's tok/s on a loaded pair, priced as `auto` prices them (what `adaptive-spec
probe` prints). It measures the pair's costs (or reads them), takes auto's picks, chooses each configuration's
counts (the curve at a workload, or answers replayed) and prices each (`price_*`, each a Priced with its reason
in words); `row_of` makes the row the probe prints."""
from __future__ import annotations

from dataclasses import dataclass, field

from ... import params
from ...heads.curve import curve_path, load_curve
from .acceptance import as_responses, describe
from .costs import measure_costs
from .counts import MIX, Answers, check_workload, combined_counts, copy_counts, workload_point
from .picker import AR, DEFAULT_TIME_MODEL, predicted_wall, resolve_auto
from .timemodel import ONE_STEP, coef_of, effective_model, rate_of, round_costs

# a long verbatim copy: a match this long is CopyAcceptance's top bucket (its prior: 0.97 of copies accepted)
COPY_MATCH = 16


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
    if prompts is not None:  # the answers recorded on the user's prompts, with the p̂ recorded along them
        records = as_responses(prompts["records"])
        answers = Answers(prompts["label"], "your prompts", lambda head=None: records)
    picks, curve_file, book = book_for(pair, head, temperature, costs, prompts, answers)
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
    return {"engine": pair.engine.name, "time_model": book.model, "sampling": book.loop, "temperature": temperature,
            "head": head if picks else None, "workload": list(workload) if workload else MIX,
            "acceptance": {"source": "dev answers" if prompts is None else "prompts", "words": describe(prompts),
                           **({k: v for k, v in prompts.items() if k != "records"} if prompts else {})},
            "prompt_tokens": prompt_tokens, "max_new_tokens": max_new_tokens,
            "costs": costs.to_dict(),
            "configurations": [row_of(book, p, prompt_tokens, max_new_tokens) for p in priced]}


def curve_point(curve: dict, need: str, value, cap=None) -> dict:
    if need == "k":
        return next(p for p in curve["fixed_k"] if p["k"] == value)
    if cap is not None:
        for p in curve.get("capped", []):
            if p["h"] == value and p["k_max"] == cap:
                return p
    return next(p for p in curve["thresholds"] if p["h"] == value)


def copy_round(costs, coef: dict, k_max: int) -> dict:
    """A round of a long verbatim copy under `--policy ngram --k auto`: the K ngram.best_k takes at the rate it
    settles to (Dinkelbach's rule), with its expected tokens and tok/s."""
    from ..ngram import CopyAcceptance, best_k, verify_steps_of

    a = CopyAcceptance().predict(COPY_MATCH, min(k_max, COPY_MATCH))  # at most as many copies as match
    v = verify_steps_of(costs)
    lam, K, expected = 1.0, 0, 1.0
    for _ in range(100):
        K, value = best_k(a, v, lam)
        expected = value + lam * v(K + 1)
        if abs(expected / v(K + 1) - lam) < 1e-12:
            break
        lam = expected / v(K + 1)
    point = {"n_tokens": expected, "n_target_forwards": 1.0, "n_draft_forwards": 0.0, "n_drafted": float(K),
             "n_accepted": expected - 1.0, "target_pass_hist": {str(K + 1): 1.0}}
    return {"k": K, "tokens": expected, "steps": v(K + 1), "accepted": a[0], "tokens_per_s": rate_of(point, coef)}


@dataclass
class Priced:
    """One configuration priced at the measured costs, with its reason in words."""
    name: str
    policy: dict
    rate: float  # decode tok/s at the costs, prefill left out
    drafts: bool
    reason: str
    catch_up: bool = False
    extra: dict = field(default_factory=dict)  # the fields its row carries beside the common ones


@dataclass
class Book:
    """What every configuration is priced with, and whose answers the replayed counts come from (for the reasons)."""
    costs: object
    model: str  # the time model and the sampling mode auto priced with
    loop: str
    coef: dict  # the model's coefficients at the costs
    ar: float  # the target alone's tok/s
    answers: str  # whose answers the replays ran on, in words
    data_name: str  # and where they came from

    def v(self, n: int) -> float:
        return self.costs.verify_s(n) / self.costs.verify_s(1)


def book_for(pair, head, temperature: float, costs, prompts: dict | None, answers: Answers | None):
    """(auto's picks {"h", "k"} where there is a draft and a head, the curve they came from, the Book)."""
    own = (prompts or {}).get("curve_file")  # the prompts' curve, where the draft was recorded
    curve_file = own or curve_path(head)
    picks = {}
    if pair.draft is not None and head is not None:
        for need, p in (("h", params.policy_params("learned", head=head, threshold="auto", curve=own)),
                        ("k", params.policy_params("fixed", k="auto", curve=str(curve_file)))):
            picks[need] = resolve_auto(pair, p, temperature=temperature)[1]
    # the mode and model resolve_auto priced with (picks' "model"); the same without a draft
    loop = "greedy" if temperature == 0 else "sample"
    model = next(iter(picks.values()))["model"] if picks else effective_model(
        costs, getattr(pair.engine, "time_model", DEFAULT_TIME_MODEL))
    coef = coef_of(costs, model, loop)
    words = "dev answers" if prompts is None else "answers to your prompts"
    return picks, curve_file, Book(costs, model, loop, coef, rate_of(ONE_STEP, coef), words,
                                   answers.label if answers is not None else "none")


def price_ar(book: Book) -> Priced:
    loop_ms, step_ms = 1e3 * book.coef.get("loop_row", 0.0), 1e3 / book.ar
    return Priced("target alone", {"policy": "ar"}, book.ar, False,
                  f"one step: {step_ms:.1f} ms (the target's pass {step_ms - loop_ms:.1f} ms, the loop's own "
                  f"{loop_ms:.1f} ms)")


def price_fixed(book: Book, point: dict, K: int) -> Priced:
    rate, r = rate_of(point, book.coef), round_costs(point, book.coef)
    why = (f"a {K + 1}-row pass costs {book.v(K + 1):.2f} steps and a draft step {book.costs.c:.2f}: "
           f"{r['steps']:.2f} steps a round for {r['tokens']:.2f} tokens ({r['accepted']:.2f} of candidates "
           f"accepted): {_verdict(rate / book.ar)}")
    return Priced(f"fixed K={K}", {"policy": "fixed", "k": K}, rate, True, why, extra={"round": r})


def price_auto(book: Book, h_point, choice: dict, ran: dict | None, head) -> Priced:
    """auto's pick (or `ran`'s), with the best h of these counts beside it."""
    # the h (and cap) auto could pick: every h, and the capped points where its model prices them
    capped = (label.split("@") for label in choice.get("predicted_capped") or {})
    cands = [(h, None) for h in choice["predicted"]] + [(float(h), int(cap)) for h, cap in capped]
    h, cap = max(cands, key=lambda c: rate_of(h_point(*c), book.coef)) if ran is None else tuple(ran["best"])
    best_tps = rate_of(h_point(h, cap), book.coef)
    pick, pick_cap = (choice["value"], choice.get("k_max")) if ran is None else tuple(ran["pick"])
    if ran is None and pick_cap is not None and f"{pick:g}@{pick_cap}" not in choice.get("predicted_capped", {}):
        pick_cap = None  # a threshold's pick: its k_max is the limit, not a capped point's cap
    pick_tps = book.ar if pick == AR else rate_of(h_point(pick, pick_cap), book.coef)
    r = round_costs(h_point(h, cap), book.coef)
    best = {"h": h, "k_max": cap, "decode_tokens_per_s": best_tps, "speedup": best_tps / book.ar, "round": r}
    if pick != AR and (pick, pick_cap) != (h, cap):  # auto (or `ran`) picked another h than these counts' best
        r, h, cap = round_costs(h_point(pick, pick_cap), book.coef), pick, pick_cap
    label = f"{h:g}" + (f" with K <= {cap}" if cap is not None else "")
    if pick == AR:
        why = (f"runs the target alone: the best h ({label}) would take {r['steps']:.2f} steps a round for "
               f"{r['tokens']:.2f} tokens ({best['speedup']:.2f}x)")
    else:
        why = (f"h = {label}: {r['drafted']:.2f} drafted a round, {r['tokens']:.2f} tokens for {r['steps']:.2f} "
               f"steps (a draft step {book.costs.c:.2f}, passes mostly {r['rows']} rows at {book.v(r['rows']):.2f}): "
               f"{_verdict(pick_tps / book.ar)}")
    return Priced("SpecDec++ h=auto", {"policy": "learned", "head": head, "threshold": "auto"}, pick_tps, pick != AR,
                  why, extra={"pick": pick, "pick_k_max": pick_cap, "best": best, "round": r})


def price_lookup(book: Book, copies: dict | None, copy: dict) -> Priced:
    """Prompt lookup replayed on the answers (a plain step a token without them), and a long copy's round."""
    rate = book.ar if copies is None else rate_of(copies, book.coef)
    fast = max(copy["tokens_per_s"], book.ar)
    if copies is None:
        why = "a plain step where nothing is copied (1.00x); "
    else:
        rounds = copies["n_target_forwards"]
        copying_rounds = rounds - copies["target_pass_hist"].get("1", 0)
        why = (f"on {copies['n_responses']} {book.answers} ({book.data_name}) {copying_rounds / rounds:.0%} of rounds "
               f"copy, {copies['n_drafted'] / max(copying_rounds, 1e-9):.1f} copies each, "
               f"{copies['n_accepted'] / max(copies['n_drafted'], 1e-9):.2f} of them accepted: {rate / book.ar:.2f}x; ")
    if not copy["k"]:
        why += "no copy pays even in a long verbatim copy"
    else:
        why += (f"in a long verbatim copy {copy['k']} copies a round ({copy['accepted']:.2f} accepted each) verify "
                f"in a {copy['k'] + 1}-row pass of {copy['steps']:.2f} steps for {copy['tokens']:.2f} tokens: "
                f"{fast / book.ar:.2f}x: pays where the answer copies the prompt")
    copying = {"k": copy["k"], "decode_tokens_per_s": fast, "speedup": fast / book.ar}
    return Priced("prompt lookup", {"policy": "ngram"}, rate, False, why,
                  extra={"copying": copying, **({"copies": _no_data(copies)} if copies else {})})


def price_combined(book: Book, auto: Priced, lookup: Priced, joint: dict | None, head) -> Priced:
    """Prompt lookup with SpecDec++ at auto's h where nothing is copied: replayed jointly where it drafts."""
    pick, copying = auto.extra["pick"], lookup.extra["copying"]
    if pick == AR:  # the fallback is the target alone: combined is prompt lookup
        rate, why = lookup.rate, "rounds without a copy run the target alone: prompt lookup's rounds"
    elif joint is None:
        rate, why = auto.rate, (f"rounds without a copy run SpecDec++ h = {pick:g} ({auto.rate / book.ar:.2f}x); "
                                f"copying rounds as prompt lookup ({copying['speedup']:.2f}x in a long copy)")
    else:
        rate = rate_of(joint, book.coef)
        why = (f"replayed on {joint['n_responses']} {book.answers}: SpecDec++ h = {pick:g} where nothing is copied, "
               f"{joint['n_tokens'] / joint['n_target_forwards']:.2f} tokens a round, the draft catching up on what "
               f"copies made ({joint['n_fed_extra'] / max(joint['n_all_accepted'], 1e-9):.1f} tokens beyond two a "
               f"catch-up); the draft reads the prompt in its first round")
    policy = {"policy": "ngram", "fallback": "learned", "head": head, "threshold": "auto"}
    return Priced("combined", policy, rate, pick != AR, why, catch_up=pick != AR,
                  extra={"copying": copying, **({"joint": _no_data(joint)} if joint else {})})


def _no_data(counts: dict) -> dict:
    return {k: v for k, v in counts.items() if k != "data"}


def row_of(book: Book, p: Priced, prompt_tokens: float, max_new_tokens: float) -> dict:
    decode, wall = timed(book.costs.to_dict(), p.rate, p.drafts, p.catch_up, prompt_tokens, max_new_tokens)
    return {"name": p.name, "policy": p.policy, "rate_tokens_per_s": p.rate, "drafts": p.drafts,
            "catch_up": p.catch_up, "decode_tokens_per_s": decode, "wall_tokens_per_s": wall,
            "speedup": decode / book.ar, "reason": p.reason, **p.extra}


def _verdict(x: float) -> str:
    return "drafting pays" if x > 1 else "drafting does not pay"


def timed(costs: dict, rate: float, drafts: bool, catch_up: bool, prompt_tokens: float,
          n_tokens: float) -> tuple[float, float | None]:
    """(decode, wall) tok/s of n_tokens after a prompt of prompt_tokens at `rate` (wall: picker.predicted_wall).
    `catch_up`: the draft reads the prompt in its first round (the n-gram fallback), in decode time."""
    wall = predicted_wall({"costs": costs, "value": 1 if drafts else AR, "tokens_per_s": rate}, prompt_tokens,
                           n_tokens).get("wall_tokens_per_s")
    if not catch_up:
        return rate, wall
    return n_tokens / (n_tokens / rate + costs.get("t_prefill_draft", 0.0) * max(prompt_tokens - 1, 0)), wall
