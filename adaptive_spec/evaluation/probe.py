"""`adaptive-spec probe`: what pays on this machine, for one pair, engine, set of files and head: its
costs measured once (cached) and each configuration's tok/s predicted from them, with the reason.

    adaptive-spec probe --backend llama.cpp                          # the default pair's GGUF files
    adaptive-spec probe --draft-quant int8                           # torch, with the served CPU draft
    adaptive-spec probe --backend llama.cpp --target-quant q8_0 --json
    adaptive-spec probe --backend llama.cpp --workload code          # priced for code prompts
    adaptive-spec probe --backend llama.cpp --prompts my.jsonl       # priced at the acceptance on your prompts

It loads the pair as `generate` does (the same pair flags) and takes the forward costs through the calls
`--threshold auto` and `--k auto` make (decoding/auto.resolve_auto over decoding/costs.measure_costs, on
the torch threads the decode has, cached per machine and pair: after a probe, `generate` with auto
measures nothing, nor does a second probe): a one-row step, v(N) for passes of 1..9 rows and the
longer ones copies verify in, the draft's step, both prefill rates, the loop's own time per row and per
round. Each configuration is priced with auto's time model (the engine's: timemodel.predict_time) from
the head's offline curve (counts per h and per K: the head and the data, not the machine):

    target alone        one step a token
    fixed K             the curve's best K (at the workload's counts; by default `--k auto`'s pick)
    SpecDec++ h=auto    auto's pick: an h, or the target alone where no h pays (then the best h is named)
    prompt lookup       the policy itself replayed along the dev answers of COPY_DATA (the heads' data: what
                        it copies there, at this machine's v(n); ngram.replay_copies), or a plain step a token
                        without that data; beside it, the K copies a round of a long verbatim copy that
                        ngram.best_k takes at the copy rate of a long match (CopyAcceptance's prior)
    combined            both replayed jointly along those answers (combined_counts): the policy's copying rounds,
                        and SpecDec++ at auto's h where it copies nothing (K as autotune's replay stops, the
                        accepted count drawn from the stored acceptance probabilities), with the draft's catch-up
                        on what the copies made; the target alone's steps instead where auto runs no draft

`--workload` (chat, code, math, or a comma-separated mix of them, in equal parts) prices every configuration
at the counts of the dev answers of those kinds' prompt sources (WORKLOADS) instead of all of them pooled:
how often a draft is accepted and how much an answer copies are the workload's, and they differ by kind
(fixed K = 3 makes 2.7 tokens a round on the ShareGPT answers, 3.4 on GSM8K's). `--threshold auto` still
picks h from the pooled curve, as a generation does; the probe prices that pick at the workload's counts.

`--prompts FILE|SET` (a .jsonl file with a `prompt` field a line, or a prompt set's name) prices every
configuration at the acceptance on those prompts instead: the pair answers a few of them first, within
`--prompts-budget-s` (probe_prompts.py records what datagen records, and autotune's replay makes their curve);
h and K are then picked from that curve, as `generate --auto-prompts` picks them, and prompt lookup and combined
are replayed along those answers. The text says whose acceptance priced the rows, and names the curve's file.

Decode tok/s leave prefill out; wall tok/s add it for --prompt-tokens at the measured prefill rates.
eval/bench_probe.py checks the predictions against measured runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .. import params
from ..cli_args import Parser, add_fields, flag, set_fields
from ..errors import UserError, run_main
from .pricing import (book_for, copy_round, curve_point, price_ar, price_auto, price_combined, price_fixed,
                      price_lookup, rate_of, row_of)

DEFAULT_HEAD = "checkpoints/qwen-coder-0.5b-int8-stats-d3"
# the answers prompt lookup is priced on: the committed heads' dev responses (a workload's copying is the
# workload's, not the machine's; this mix stands for a general one, as it does for the head's curve)
COPY_DATA = "data/datagen/mix"
# draws per answer of the combined replay's draft rounds (their accepted counts are sampled; copies are not)
COMBINED_SAMPLES = 4
# what a user can say their prompts are (--workload): the prompt sources of the heads' dev answers that stand
# for each kind (the curve's by_source, COPY_DATA's source_ids); "mix" is those answers as they are pooled
WORKLOADS = {"chat": ("sharegpt",), "code": ("sharegpt-code", "mbpp"), "math": ("gsm8k-train",)}
MIX = "mix"
INTERRUPTED = "nothing was written (forward times measured in full are cached); run the same command again"


# ----------------------------------------------------------------------------- pricing (no model needed)

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




def by_name(result: dict) -> dict:
    """A probe result's configurations by name, fixed K's as "fixed" (its name carries the K)."""
    return {r["name"].split(" K=")[0]: r for r in result["configurations"]}


def picks_of(result: dict) -> dict | None:
    """What a probe's result chose ({"k": K, "pick": (h or AR, cap), "best": (h, cap)}), for pricing the same
    configurations at other costs (`predict(ran=...)`); None where it priced no drafting."""
    by = by_name(result)
    if "fixed" not in by:
        return None
    auto = by["SpecDec++ h=auto"]
    return {"k": by["fixed"]["policy"]["k"], "pick": (auto["pick"], auto.get("pick_k_max")),
            "best": (auto["best"]["h"], auto["best"]["k_max"])}


def predict(pair, head: str | None, temperature: float, prompt_tokens: int, max_new_tokens: int,
            k_max: int = params.NgramParams().k_max, ran: dict | None = None, copy_data=None,
            workload=None, prompts: dict | None = None) -> dict:
    """Every configuration's predicted tok/s on `pair` (loaded; or anything resolve_auto and measure_costs
    take, e.g. a pair with pinned_costs), priced as `auto` prices them; the draft's configurations only
    with a draft and a head. `ran` (picks_of another result): price the K and h that one chose instead of
    choosing again, so that a second measurement prices the configurations that ran (eval/bench_probe.py).
    `copy_data`: the datagen run whose dev answers prompt lookup and combined are replayed on (default
    COPY_DATA; absent: prompt lookup is priced as the plain steps it falls back to where nothing is copied,
    combined as SpecDec++). `workload` (parse_workload's kinds; None: the dev answers pooled): whose counts
    price every configuration. SpecDec++ h=auto is what `--threshold auto` picks (from the pooled curve, as a
    generation picks it), priced at the workload's counts; fixed K is the workload's best K. `prompts`
    (probe_prompts.measure: answers recorded on the user's prompts, and their curve): every configuration is
    priced at those answers' counts instead of the dev answers', h and K picked from their curve as
    `--auto-prompts` (`--curve` of that file) picks them."""
    from .probe_prompts import as_responses, describe
    from ..decoding.auto import AR, load_curve
    from ..decoding.costs import measure_costs

    costs = measure_costs(pair)
    if prompts is not None and workload is not None:
        raise UserError("--prompts and --workload both say whose acceptance prices the configurations; pass one")
    records = None if prompts is None else as_responses(prompts["records"])
    own = (prompts or {}).get("curve_file")  # the prompts' curve, where the draft was recorded
    curve_file = own or _curve_file(head)
    picks, loop, model, book = book_for(pair, head, temperature, costs, own, curve_file)
    book.answers = "dev answers" if prompts is None else "answers to your prompts"
    book.data_name = (COPY_DATA if copy_data is None else copy_data) if prompts is None else prompts["label"]
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
    lookup = price_lookup(book, copy_counts(costs, k_max, copy_data, workload, records), copy_round(costs, book.coef,
                                                                                                  k_max))
    priced.append(lookup)
    if auto is not None:
        pick = auto.extra["pick"]
        joint = None if pick == AR else combined_counts(
            costs, head, pick, auto.extra["pick_k_max"] or curve["k_max"], k_max, copy_data, workload, records=records)
        priced.append(price_combined(book, auto, lookup, joint, head))
    return {"engine": pair.engine.name, "time_model": model, "sampling": loop, "temperature": temperature,
            "head": head if picks else None, "workload": list(workload) if workload else MIX,
            "acceptance": {"source": "dev answers" if prompts is None else "prompts", "words": describe(prompts),
                           **({k: v for k, v in prompts.items() if k != "records"} if prompts else {})},
            "prompt_tokens": prompt_tokens, "max_new_tokens": max_new_tokens,
            "costs": costs.to_dict(), "configurations": [row_of(book, p, prompt_tokens, max_new_tokens) for p in priced]}


# ----------------------------------------------------------------------------- pricing, one configuration each



















# ----------------------------------------------------------------------------- the reasons, in words

















def _curve_file(head):
    from ..heads.curve import curve_path

    return curve_path(head)


# ----------------------------------------------------------------------------- measuring

def run(pair_params, head: str | None = DEFAULT_HEAD, temperature: float = 1.0, prompt_tokens: int = 128,
        max_new_tokens: int = 128, reps: int | None = None, cache: bool = True, ran: dict | None = None,
        workload=None, prompts=None, prompts_budget_s: float | None = None, prompts_cache: bool | None = None) -> dict:
    """Load the pair, measure its costs (or read them from the cache) and predict (see `predict`); with the
    machine, how long loading and measuring took, and where the costs are cached. cache=False: measure
    afresh, reading and writing no cache (a second measurement of the same machine); `ran`: see predict.
    `prompts` (probe_prompts.load_texts' (texts, label)): record answers to them first, for `budget_s` at most
    (probe_prompts.measure, cached as the costs are, or as `prompts_cache` says: a second measurement of the
    machine prices at the answers the first one recorded), and price at their acceptance."""
    from .probe_prompts import BUDGET_S, measure
    from transformers.utils import logging as hf_logging

    from ..backends.cpu import describe
    from ..decoding.costs import config_key, cost_config, costs_dir, measure_costs
    from ..decoding.pipeline import SpecPair, torch_threads

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    pair = SpecPair.load(pair_params)
    loaded = time.perf_counter()
    # on the torch threads the decode has: the cost cache's key holds them, so auto finds this measurement
    with torch_threads(pair.engine.decode_torch_threads):
        path = costs_dir() / f"{config_key(cost_config(pair))}.json"
        cached = cache and path.is_file()
        if not cache:  # pinned on the pair: `predict` (and auto within it) reads this measurement
            pair.pinned_costs = measure_costs(pair, **({"reps": reps} if reps else {}), cache=False)
        elif reps is not None and not cached:
            measure_costs(pair, reps=reps)  # cached, so that `predict` (and auto after it) reads this one
        measure_costs(pair)
        measured = time.perf_counter()
        own = None if prompts is None else measure(pair, None, head, temperature, prompts_budget_s or BUDGET_S,
                                                   cache if prompts_cache is None else prompts_cache, texts=prompts)
        recorded = time.perf_counter()
        out = predict(pair, head if pair.draft is not None else None, temperature, prompt_tokens, max_new_tokens,
                      ran=ran, workload=workload, prompts=own)
    return {"machine": describe(), "pair": pair_params.model_dump(exclude_defaults=True), **out,
            "cache": str(path) if cache else None, "cached": cached, "load_s": loaded - t0,
            "measure_s": measured - loaded, "prompts_s": recorded - measured}


# ----------------------------------------------------------------------------- output

def render(result: dict) -> str:
    """The probe's text: the costs, one line per configuration (predicted tok/s, speed-up, why), the fastest."""
    c = result["costs"]
    t1 = c["t_verify"][0] if c.get("t_verify") else c["t_target"]
    v = " ".join(f"{t / t1:.2f}" for t in c.get("t_verify") or ())
    longs = ", ".join(f"v({n}) = {t / t1:.2f}" for n, t in sorted((int(n), t) for n, t in
                                                                  (c.get("t_verify_long") or {}).items()))
    m = result.get("machine") or {}
    how = ("read from the cache" if result.get("cached") else f"measured in {result['measure_s']:.0f} s") \
        if "measure_s" in result else "given"
    lines = [f"{m.get('cpu', 'this machine')} ({m.get('isa', '?')}, {m.get('threads', '?')} threads), engine "
             f"{result['engine']}" + (f", pair {json.dumps(result['pair'])}" if result.get("pair") else "")
             + (f", head {result['head']}" if result.get("head") else ""),
             f"costs ({how}{'; ' + result['cache'] if result.get('cache') else ''}): a step {1e3 * t1:.1f} ms"
             + (f" (in the target-alone loop; a one-row pass between passes of other lengths: "
                f"{1e3 * c['t_step_cell']:.1f} ms)" if c.get("t_step_cell") else "") + "; "
             f"a pass of 1..{len(c.get('t_verify') or ())} rows costs v = {v or '-'} steps"
             + (f", {longs}" if longs else "") + f"; a draft step {c['t_draft'] / c['t_target']:.2f} steps"
             + (f" (of two tokens, after a round all accepted: {c['t_draft_two'] / c['t_target']:.2f})"
                if c.get("t_draft_two") else "") + "; prefill "
             f"{1e3 * c.get('t_prefill', 0.0):.2f} ms a prompt token (draft {1e3 * c.get('t_prefill_draft', 0.0):.2f})",
             f"predicted with the {result['time_model']} time model ({result['sampling']} sampling) for "
             f"{_priced_for(result)}; wall: a {result['prompt_tokens']}-token prompt and "
             f"{result['max_new_tokens']} new tokens", _acceptance_line(result.get("acceptance")), ""]
    rows = result["configurations"]
    width = max(len(r["name"]) for r in rows)
    lines.append(f"{'configuration':{width}}  decode tok/s  wall tok/s  speed-up  why")
    for r in rows:
        wall = f"{r['wall_tokens_per_s']:10.2f}" if r.get("wall_tokens_per_s") else f"{'-':>10}"
        lines.append(f"{r['name']:{width}}  {r['decode_tokens_per_s']:12.2f}  {wall}  {r['speedup']:7.2f}x  "
                     f"{r['reason']}")
    best = max(rows, key=lambda r: r["decode_tokens_per_s"])
    lines += ["", f"fastest here: {best['name']}, {best['decode_tokens_per_s']:.2f} tok/s decoding "
              f"({best['speedup']:.2f}x the target alone)" + ("; prompt lookup also pays where the answer copies "
                                                             "the prompt" if any((r.get('copying') or {}).get('k')
                                                                                 for r in rows) else "")]
    return "\n".join(lines)


def _acceptance_line(acceptance: dict | None) -> str:
    """Whose acceptance priced the configurations: the user's prompts (with the curve file auto can read) or the
    dev answers."""
    if not acceptance or acceptance.get("source") != "prompts":
        return "acceptance: the dev answers (the head's threshold curve; --prompts FILE|SET measures your own)"
    curve = acceptance.get("curve_file")
    return (f"acceptance: {acceptance['words']}" + (f"; its curve, for --threshold auto / --k auto: --curve {curve}"
                                                     if curve else ""))


def _priced_for(result: dict) -> str:
    if (result.get("acceptance") or {}).get("source") == "prompts":
        return "your prompts (--prompts)"
    return describe_workload(result.get("workload", MIX))


def describe_workload(workload) -> str:
    if workload in (None, MIX):
        return "the heads' dev answers pooled (--workload mix)"
    parts = [f"{k} ({'+'.join(WORKLOADS[k])})" for k in dict.fromkeys(workload)]
    return ("prompts of " + ", ".join(parts) + (" in equal parts" if len(workload) > 1 else "")
            + f" (--workload {','.join(workload)})")


def _main(argv) -> int:
    ap = Parser(prog="adaptive-spec probe", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_fields(ap, params.PairParams.model_fields, lambda key: "")
    ap.add_argument("--head", default=DEFAULT_HEAD,
                    help=f"acceptance head with its threshold_curve.json (default {DEFAULT_HEAD}; none: no draft "
                         "configurations)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature the decode will use (0: greedy)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length the wall tok/s assume (128)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated, for the wall tok/s (128)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timing rounds where nothing is cached (default: auto's own count)")
    ap.add_argument("--workload", default=MIX,
                    help=f"what the prompts are: {MIX} (default: the heads' dev answers pooled) or a comma-separated "
                         f"list of {', '.join(WORKLOADS)} (equal parts): whose acceptance and copying price the "
                         "configurations")
    ap.add_argument("--prompts", default=None, metavar="FILE|SET",
                    help="price at the acceptance on your own prompts: a .jsonl file with a 'prompt' field a line, or a "
                         "prompt set's name; a few short answers are generated on them first (their curve is cached, "
                         "and --threshold auto reads it with --curve)")
    ap.add_argument("--prompts-budget-s", type=float, default=None,
                    help="seconds the answers to --prompts may take (default 40: the probe answers in about two "
                         "minutes on two cores)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # --help, or a bad argument (already reported on one line)
        return e.code if isinstance(e.code, int) else 2
    for name in ("prompt_tokens", "max_new_tokens", "reps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    workload = parse_workload(args.workload)
    if args.prompts_budget_s is not None and (args.prompts is None or args.prompts_budget_s <= 0):
        raise UserError(f"--prompts-budget-s {args.prompts_budget_s:g}: seconds (> 0) for --prompts; pass "
                        "--prompts FILE|SET with it, or drop it")
    if args.prompts is not None and workload is not None:
        raise UserError("--prompts and --workload both say whose acceptance prices the configurations; pass one")
    from .probe_prompts import load_texts

    prompts = None if args.prompts is None else load_texts(args.prompts)  # refused before any model loads
    pair = params.pair_params(spell=flag, **set_fields(args, params.PairParams.model_fields))
    pair.engine.check_available(pair.device)
    head = None if str(args.head).lower() == "none" else args.head
    if head is not None and pair.draft is not None:
        # the head's curve must exist unless the prompts make one
        learned = params.policy_params("learned", spell=flag, head=head, threshold="auto" if prompts is None else 0.5)
        params.check_runs_on(learned, pair.engine)
        from ..decoding.auto import load_curve

        if prompts is None:
            check_workload(load_curve(_curve_file(head), "h", head), workload)  # before any model loads
    result = run(pair, head, args.temperature, args.prompt_tokens, args.max_new_tokens, args.reps,
                 workload=workload, prompts=prompts, prompts_budget_s=args.prompts_budget_s)
    print(json.dumps(result, default=str) if args.json else render(result))
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
