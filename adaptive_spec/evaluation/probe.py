"""`adaptive-spec probe`: what pays on this machine, for one pair, engine, set of files and head: its
costs measured once (cached) and each configuration's tok/s predicted from them, with the reason.

    adaptive-spec probe --backend llama.cpp                          # the default pair's GGUF files
    adaptive-spec probe --draft-quant int8                           # torch, with the served CPU draft
    adaptive-spec probe --backend llama.cpp --workload code          # priced for code prompts
    adaptive-spec probe --backend llama.cpp --prompts my.jsonl       # priced at the acceptance on your prompts

It loads the pair as `generate` does and measures the costs `--threshold auto` and `--k auto` read (cached,
so `generate` with auto then measures nothing). Each configuration is priced with auto's time model:

    target alone        one step a token
    fixed K             the curve's best K at the workload's counts (by default `--k auto`'s pick)
    SpecDec++ h=auto    auto's pick: an h, or the target alone where no h pays (the best h then named)
    prompt lookup       the policy replayed along the dev answers of COPY_DATA (ngram.replay_copies), or a
                        plain step a token without that data; beside it, the K ngram.best_k takes for a
                        long verbatim copy
    combined            both replayed jointly along those answers (combined_counts)

`--workload` prices at those kinds' dev answers (h still picked from the pooled curve, as a generation does);
`--prompts` at answers recorded on the user's prompts, h and K picked from their curve as
`generate --auto-prompts` picks them. Decode tok/s leave prefill out; wall tok/s add it."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .. import params
from ..decoding.auto import (BUDGET_S, MIX, WORKLOADS, Answers, check_workload, config_key, cost_config, costs_dir,
                    describe_workload, load_texts, measure_costs, measure_prompts, parse_workload, predict)
from ..cli_args import Parser, add_fields, flag, set_fields
from ..errors import UserError, run_main
from ..heads.curve import curve_path, load_curve

DEFAULT_HEAD = "checkpoints/qwen-coder-0.5b-int8-stats-d3"
INTERRUPTED = "nothing was written (forward times measured in full are cached); run the same command again"
# the answers prompt lookup is priced on: the committed heads' dev responses (a workload's copying is the
# workload's, not the machine's; this mix stands for a general one, as it does for the head's curve)
COPY_DATA = "data/datagen/mix"


def dev_answers(data_dir=None) -> Answers | None:
    """The dev answers of a datagen run (default COPY_DATA) as auto's replays read them; None where absent."""
    from ..runs import PROJECT_ROOT, read_manifest
    from ..training.autotune import responses

    path = Path(data_dir) if data_dir is not None else PROJECT_ROOT / COPY_DATA
    if not (path / "manifest.json").is_file():
        return None
    hidden = (read_manifest(path).get("models", {}).get("draft") or {}).get("hidden_size")
    return Answers(COPY_DATA if data_dir is None else str(data_dir), str(path),
                   lambda head=None: responses(path, "dev", head), hidden)


def run(pair_params, head: str | None = DEFAULT_HEAD, temperature: float = 1.0, prompt_tokens: int = 128,
        max_new_tokens: int = 128, reps: int | None = None, cache: bool = True, ran: dict | None = None,
        workload=None, prompts=None, prompts_budget_s: float | None = None, prompts_cache: bool | None = None) -> dict:
    """Load the pair, measure its costs (cache=False: afresh, no cache read or written) and `predict`, with the
    machine and the times taken. `prompts` (auto.load_texts' result): record answers to them first, cached as
    the costs are unless `prompts_cache` says otherwise, and price at their acceptance."""
    from transformers.utils import logging as hf_logging

    from ..backends.cpu.machine import describe
    from ..decoding.pipeline import SpecPair
    from ..timing import torch_threads

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    pair = SpecPair.load(pair_params)
    loaded = time.perf_counter()
    # on the torch threads the decode has: the cost cache's key holds them, so auto finds this measurement
    with torch_threads(pair.engine.decode_torch_threads):
        path = costs_dir() / f"{config_key(cost_config(pair))}.json"
        cached = cache and path.is_file()
        costs = measure_costs(pair, **({"reps": reps} if reps else {}), cache=cache)
        if not cache:  # pinned on the pair: `predict` (and auto within it) reads this measurement
            pair.pinned_costs = costs
        measured = time.perf_counter()
        own = None if prompts is None else measure_prompts(pair, prompts, head, temperature,
                                                           prompts_budget_s or BUDGET_S,
                                                           cache if prompts_cache is None else prompts_cache)
        recorded = time.perf_counter()
        out = predict(pair, head if pair.draft is not None else None, temperature, prompt_tokens, max_new_tokens,
                      ran=ran, answers=dev_answers(), workload=workload, prompts=own)
    return {"machine": describe(), "pair": pair_params.model_dump(exclude_defaults=True), **out,
            "cache": str(path) if cache else None, "cached": cached, "load_s": loaded - t0,
            "measure_s": measured - loaded, "prompts_s": recorded - measured}


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
    priced_for, acceptance = _acceptance(result)
    lines = [f"{m.get('cpu', 'this machine')} ({m.get('isa', '?')}, {m.get('threads', '?')} threads), engine "
             f"{result['engine']}" + (f", pair {json.dumps(result['pair'])}" if result.get("pair") else "")
             + (f", head {result['head']}" if result.get("head") else ""),
             f"costs ({how}{'; ' + result['cache'] if result.get('cache') else ''}): a step {1e3 * t1:.1f} ms"
             + (f" (in the target-alone loop; a one-row pass between passes of other lengths: "
                f"{1e3 * c['t_step_cell']:.1f} ms)" if c["t_step_cell"] else "") + "; "
             f"a pass of 1..{len(c.get('t_verify') or ())} rows costs v = {v or '-'} steps"
             + (f", {longs}" if longs else "") + f"; a draft step {c['t_draft'] / c['t_target']:.2f} steps"
             + (f" (of two tokens, after a round all accepted: {c['t_draft_two'] / c['t_target']:.2f})"
                if c.get("t_draft_two") else "") + "; prefill "
             f"{1e3 * c.get('t_prefill', 0.0):.2f} ms a prompt token (draft {1e3 * c.get('t_prefill_draft', 0.0):.2f})",
             f"predicted with the {result['time_model']} time model ({result['sampling']} sampling) for "
             f"{priced_for}; wall: a {result['prompt_tokens']}-token prompt and "
             f"{result['max_new_tokens']} new tokens", acceptance, ""]
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


def _acceptance(result: dict) -> tuple[str, str]:
    """Whose acceptance priced the configurations: (whose prompts, in words; the acceptance line)."""
    acceptance = result["acceptance"]
    if acceptance["source"] != "prompts":
        return (describe_workload(result["workload"]),
                "acceptance: the dev answers (the head's threshold curve; --prompts FILE|SET measures your own)")
    curve = acceptance.get("curve_file")
    return "your prompts (--prompts)", f"acceptance: {acceptance['words']}" + (
        f"; its curve, for --threshold auto / --k auto: --curve {curve}" if curve else "")


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
    prompts = None if args.prompts is None else load_texts(args.prompts)  # refused before any model loads
    pair = params.pair_params(spell=flag, **set_fields(args, params.PairParams.model_fields))
    pair.engine.check_available(pair.device)
    head = None if str(args.head).lower() == "none" else args.head
    if head is not None and pair.draft is not None:
        # the head's curve must exist unless the prompts make one
        learned = params.policy_params("learned", spell=flag, head=head, threshold="auto" if prompts is None else 0.5)
        params.check_runs_on(learned, pair.engine)
        if prompts is None:
            check_workload(load_curve(curve_path(head), "h", head), workload)  # before any model loads
    result = run(pair, head, args.temperature, args.prompt_tokens, args.max_new_tokens, args.reps,
                 workload=workload, prompts=prompts, prompts_budget_s=args.prompts_budget_s)
    print(json.dumps(result, default=str) if args.json else render(result))
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
