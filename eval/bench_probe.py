"""Does `adaptive-spec probe` predict what runs measure? Per engine: the probe (costs measured once, tok/s
predicted per configuration), then a sweep of exactly the configurations it priced on the same machine, and
each prediction beside the measured decode and wall tok/s (goal: within 10%).

    python eval/bench_probe.py --prompts 5 --out eval/results/bench_probe_<cpu>
    python eval/bench_probe.py --engines llama.cpp --datasets humaneval --prompts 1 --max-new-tokens 16 --out /tmp/p

Per engine: the probe's JSON (<out>/probe_<engine>.json) and a sweep (<out>/sweep_<engine>/, resumable: rerun the
same command) of the target alone, the probe's best fixed K, SpecDec++ h=auto, SpecDec++ at the best h where auto
runs the target alone (its prediction is then the drafting one), prompt lookup (k auto) and the two combined, at
T = 1 top-k 50 (the sampling the head's curve was replayed at). Measured: pooled over every prompt of every set,
decode = tokens / (wall - prefill), wall = tokens / wall; the predicted wall adds the prefill of the rows' mean
prompt at the probe's measured rates. After the runs the costs are measured once more, uncached
(<out>/probe_<engine>_after.json), pricing the same configurations: these machines' speed drifts by 10% over
minutes (a one-row step measured 83 ms before a run and 76 ms in it), so a prediction is judged on the mean of
the two measurements, the one before shown beside it. A second table splits the error: the runs' tokens a
round against the curve's (the workload: the head's dev answers are not these sets), and the runs priced from
their own counts at the same costs (the time model alone). The probe is told what the sets are (--workload: each
set's kind, KIND, in equal parts), as a user would tell it of their prompts. GSM8K and
AlpacaEval come from ../shared/data or ADAPTIVE_SPEC_DATA. `--report-only` rebuilds the report from the folder.

`--prompts FILE|SET` (instead of a number a set) prices at the acceptance on those prompts (probe --prompts: the
pair answers a few of them first) and runs the sweep on the same prompts (<out>/prompts.jsonl, all of them), so
the report sets predictions from held-out prompts beside runs on them, e.g. AlpacaEval's second half:

    python eval/bench_probe.py --prompts alpaca:402: --out eval/results/bench_probe_heldout_<cpu>
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

from adaptive_spec.errors import UserError, run_main
from adaptive_spec.decoding.auto import by_name, describe_workload, parse_workload, picks_of, timed
from adaptive_spec.evaluation import probe
from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.runs import read_jsonl, write_json
from adaptive_spec.tables import md_table

GOAL = 0.10  # |predicted / measured - 1|
# the kind of prompts each set is (probe --workload): the probe prices the sets' mix, in equal parts as they run
KIND = {"humaneval": "code", "mbpp": "code", "gsm8k": "math", "alpaca": "chat", "sharegpt": "chat"}
BEST_H = "specdec++ best h"  # the drafting h, where auto runs the target alone


def sweep_config(result: dict, engine: str, args) -> dict:
    """The sweep of the configurations the probe priced (sweep.py's keys)."""
    rows = by_name(result)
    head = result["head"]
    pair = {"backend": engine, "threads": args.threads}
    if engine == "torch":
        pair["draft_quant"] = args.torch_draft_quant
    cfg = {"pair": pair, "datasets": args.datasets.split(","), "n_prompts": args.prompts,
           "max_new_tokens": args.max_new_tokens, "temperature": 1.0, "top_k": 50, "chat": True, "seed": 0,
           "ks": [], "heads": [], "thresholds": [], "confidence_taus": [], "entropy_taus": [], "heuristic": False,
           "include_ar": True, "include_draft_ar": False, "hf_assisted": False,
           "policies": [{"policy": "ngram", "label": "prompt lookup"}]}
    if head is not None:
        auto = rows["SpecDec++ h=auto"]
        cfg.update(ks=[rows["fixed"]["policy"]["k"]], heads=[head], thresholds=["auto"])
        cfg["policies"].append({**rows["combined"]["policy"], "label": "combined"})
        if auto["pick"] == "ar":
            best = auto["best"]
            cfg["policies"].append({"policy": "learned", "head": head, "threshold": best["h"], "label": BEST_H,
                                    **({"k_max": best["k_max"]} if best["k_max"] is not None else {})})
    return cfg


def pairs_of(result: dict, rows: list[dict]) -> list[tuple[str, dict | None, list[dict]]]:
    """(configuration, its prediction, its measured rows) for each configuration the probe priced."""
    by = by_name(result)
    pick = lambda f: [r for r in rows if f(r)]  # noqa: E731
    out = [("target alone", by["target alone"], pick(lambda r: r["config"] == "ar"))]
    if "fixed" in by:
        k = by["fixed"]["policy"]["k"]
        out.append((f"fixed K={k}", by["fixed"], pick(lambda r: r["config"] == f"fixed:k={k}")))
        auto = by["SpecDec++ h=auto"]
        out.append(("SpecDec++ h=auto", auto, pick(lambda r: r["method"] == "learned_auto")))
        if auto["pick"] == "ar":
            best = auto["best"]
            label = f"SpecDec++ h={best['h']:g}" + (f" with K <= {best['k_max']}" if best["k_max"] is not None else "")
            out.append((label, {"rate_tokens_per_s": best["decode_tokens_per_s"], "drafts": True, "catch_up": False},
                        pick(lambda r: r["config"] == BEST_H)))
    out.append(("prompt lookup", by["prompt lookup"], pick(lambda r: r["config"] == "prompt lookup")))
    if "combined" in by:
        out.append(("combined", by["combined"], pick(lambda r: r["config"] == "combined")))
    return out


def compare(result: dict, rows: list[dict], after: dict | None = None) -> list[dict]:
    """Per configuration: predicted and measured decode and wall tok/s, pooled over the rows. With `after` (the
    same configurations priced at costs measured again after the runs): its predictions too, and the window's,
    the two measurements' mean time per token (the machine's mean speed over the runs, as far as two samples
    of it tell)."""
    out = []
    later = {name: pred for name, pred, _ in pairs_of(after, rows)} if after is not None else {}
    for name, pred, rs in pairs_of(result, rows):
        if not rs:
            continue
        n = sum(r["n_tokens"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        decode = sum(r["wall_s"] - r["prefill_s"] for r in rs)
        prompt = sum(r["n_prompt_tokens"] for r in rs) / len(rs)
        predicted = lambda res, pr: timed(res["costs"], pr["rate_tokens_per_s"], pr["drafts"],  # noqa: E731
                                                pr["catch_up"], prompt, n / len(rs))
        p_decode, p_wall = predicted(result, pred)
        c = {"name": name, "runs": len(rs), "prompt_tokens": prompt, "predicted_decode": p_decode,
             "decode": n / decode, "predicted_wall": p_wall, "wall": n / wall,
             "counts_decode": counts_rate(result, rs, after, pred.get("catch_up", False)),
             "tokens_per_round": n / sum(r["n_target_forwards"] for r in rs)}
        curve = (pred.get("round") or (pred.get("best") or {}).get("round") or {}) if pred.get("drafts") else {}
        replayed = pred.get("joint") or pred.get("copies")  # combined, prompt lookup: replayed on the dev answers
        c["predicted_tokens_per_round"] = (replayed["n_tokens"] / replayed["n_target_forwards"] if replayed
                                           else curve.get("tokens"))
        if name in later:
            a_decode, a_wall = predicted(after, later[name])
            c.update(after_decode=a_decode, after_wall=a_wall, window_decode=2 / (1 / p_decode + 1 / a_decode),
                     window_wall=None if None in (p_wall, a_wall) else 2 / (1 / p_wall + 1 / a_wall))
        out.append(c)
    # against the target alone, measured side by side in the same runs and predicted at the same costs: the
    # machine's speed (which moved 5-20% between the measurements here) cancels in both ratios
    ar = next((c for c in out if c["name"] == "target alone"), None)
    for c in out if ar is not None else []:
        c["speedup"] = c["decode"] / ar["decode"]
        c["predicted_speedup"] = c["predicted_decode"] / ar["predicted_decode"]
        if "after_decode" in c and "after_decode" in ar:
            c["after_speedup"] = c["after_decode"] / ar["after_decode"]
    return out


def counts_rate(result: dict, rows: list[dict], after: dict | None = None, catch_up: bool = False) -> float:
    """Decode tok/s of `rows` priced from their own counts (passes, draft steps; for fixed K the rounds that
    accepted all K) at the probe's costs, the mean of both measurements where there are two: the time model
    alone, without the curve's counts (the workload's side: how often these prompts' tokens are accepted).
    `catch_up`: the draft reads each prompt in its first round (combined), at its measured prefill rate. A row
    does not count the draft's steps that feed what copies made (the replay does), so combined's is a floor."""
    from adaptive_spec.decoding.auto import coef_of, costs_from_json, predict_time

    n = sum(r["n_tokens"] for r in rows)
    rates = []
    for res in [result] + ([after] if after is not None else []):
        coef = coef_of(costs_from_json(res["costs"]), res["time_model"], res["sampling"])
        t = sum(predict_time({**r, "n_all_accepted": (r.get("accepted_hist") or {}).get(str(r["k"]), 0)
                              if r.get("method") == "fixed" and r.get("k") else 0}, coef) for r in rows)
        if catch_up:
            t += res["costs"]["t_prefill_draft"] * sum(max(r["n_prompt_tokens"] - 1, 0) for r in rows)
        rates.append(n / t)
    return len(rates) / sum(1 / x for x in rates)


def _step_ms(result: dict) -> float:
    c = result["costs"]
    return 1e3 * c["t_verify"][0]


def report(results: dict, sweeps: dict, run: dict, afters: dict | None = None) -> str:
    """results: engine -> the probe's JSON; sweeps: engine -> its sweep rows; afters: engine -> the costs
    measured again after its runs, pricing the same configurations (where the benchmark took them)."""
    err = lambda p, m: "—" if p is None else f"{100 * (p / m - 1):+.1f}%"  # noqa: E731
    ok = lambda *e: "yes" if all(x is not None and abs(x) <= GOAL for x in e) else "**no**"  # noqa: E731
    lines = [f"# Probe predictions against measured runs: {run['datasets']} x {run['prompts']} prompts x "
             f"{run['max_new_tokens']} tokens, T = 1 top-k 50, {run['threads']} threads", "", run["cpu"], "",
             "Each engine: what `adaptive-spec probe` printed (costs measured once, then cached), then the sweep of "
             "the configurations it priced, run after it on the same machine. Measured tok/s pool every prompt of "
             f"every set; decode leaves prefill out. Goal: every prediction within {100 * GOAL:.0f}% of the "
             "measured decode and wall tok/s.", ""]
    num = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
    for engine, result in results.items():
        after = (afters or {}).get(engine)
        table, worst, worst_before, split, ratios = [], 0.0, 0.0, [], []
        for c in compare(result, sweeps.get(engine, []), after):
            # judged on the window's prediction where the costs were measured again after the runs
            d, w = (c["window_decode"], c["window_wall"]) if "window_decode" in c else (c["predicted_decode"],
                                                                                        c["predicted_wall"])
            ed, ew = d / c["decode"] - 1, None if w is None else w / c["wall"] - 1
            worst = max(worst, abs(ed), abs(ew or 0.0))
            worst_before = max(worst_before, abs(c["predicted_decode"] / c["decode"] - 1),
                               abs(c["predicted_wall"] / c["wall"] - 1) if c["predicted_wall"] else 0.0)
            if after is None:
                table.append([c["name"], str(c["runs"]), num(d), f"{c['decode']:.2f}", err(d, c["decode"]), num(w),
                              f"{c['wall']:.2f}", err(w, c["wall"]), ok(ed, ew)])
            else:
                a = c.get("after_decode")
                table.append([c["name"], str(c["runs"]), f"{c['decode']:.2f}",
                              f"{c['predicted_decode']:.2f} ({err(c['predicted_decode'], c['decode'])})",
                              "—" if a is None else f"{a:.2f} ({err(a, c['decode'])})", num(d), err(d, c["decode"]),
                              f"{c['wall']:.2f}", num(w), err(w, c["wall"]), ok(ed, ew)])
            if "speedup" in c and c["name"] != "target alone":
                ratios.append([c["name"], f"{c['speedup']:.2f}x", f"{c['predicted_speedup']:.2f}x",
                               err(c["predicted_speedup"], c["speedup"]),
                               f"{c['after_speedup']:.2f}x" if "after_speedup" in c else "—",
                               err(c.get("after_speedup"), c["speedup"])])
            split.append([c["name"], f"{c['tokens_per_round']:.2f}", num(c["predicted_tokens_per_round"]),
                          err(c["predicted_tokens_per_round"], c["tokens_per_round"]), f"{c['counts_decode']:.2f}",
                          err(c["counts_decode"], c["decode"])])
        lines += [f"## {engine}", "", "```", probe.render(result), "```", ""]
        if after is None:
            lines += [md_table(["configuration", "runs", "predicted decode tok/s", "measured", "error",
                                "predicted wall tok/s", "measured", "error", f"within {100 * GOAL:.0f}%"], table), "",
                      f"Largest error: {100 * worst:.1f}%.", ""]
            continue
        before_ms, after_ms = _step_ms(result), _step_ms(after)
        source, short = _counts_source(result)
        lines += [f"The costs measured again after the runs (uncached, the same configurations priced): a step "
                  f"{after_ms:.1f} ms against {before_ms:.1f} ms before them ({100 * (after_ms / before_ms - 1):+.1f}%"
                  f"), a draft step {after['costs']['t_draft'] / after['costs']['t_target']:.2f} steps against "
                  f"{result['costs']['t_draft'] / result['costs']['t_target']:.2f}. How far the two differ is how "
                  "far this machine's own speed moved in the meantime, which no prediction made beforehand can "
                  "know; the mean of the two (per token) stands for the machine across the runs.", "",
                  md_table(["configuration", "runs", "measured decode tok/s", "predicted before (error)",
                            "after (error)", "mean of both", "error", "measured wall tok/s", "predicted wall (mean)",
                            "error", f"within {100 * GOAL:.0f}%"], table), "",
                  f"Largest error of the mean of both: {100 * worst:.1f}% (of the probe before the runs alone: "
                  f"{100 * worst_before:.1f}%).", "",
                  f"Where the error comes from: a prediction is the machine's costs times the counts of {source}. "
                  f"Tokens a round as the runs had them and as the {short} have them (the curve; prompt lookup and "
                  "combined replayed on them), and the runs priced from their own counts at the same costs (the time "
                  "model alone; the mean of both measurements):", "",
                  md_table(["configuration", "tokens a round: runs", short, "error", "decode tok/s from the "
                            "runs' counts", "error"], split), "",
                  "Speed-ups over the target alone, measured side by side in the same runs and predicted at the "
                  "same costs (the machine's speed cancels in both):", "",
                  md_table(["configuration", "measured", "predicted before", "error", "after", "error"], ratios), ""]
    lines.append(f"Written {run['written']} by `python eval/bench_probe.py`.")
    return "\n".join(lines) + "\n"


def _counts_source(result: dict) -> tuple[str, str]:
    """(whose counts the predictions took, in words; the split table's column for them): the head's dev answers
    (the workload's kinds) or the answers the probe recorded on the runs' own prompts (--prompts FILE|SET)."""
    acceptance = result["acceptance"]
    if acceptance["source"] == "prompts":
        return (f"the answers the probe recorded on these prompts ({acceptance['words']}"
                "; the runs answer them afresh, to full length)", "probe's answers")
    return (f"the head's dev answers (not these sets; {describe_workload(result['workload'])})",
            "dev answers")


def prompts_arg(value: str) -> tuple[int | None, str | None]:
    """--prompts: (a number of prompts a set, None) or (None, FILE|SET: the probe's and the runs' prompts)."""
    text = str(value).strip()
    if text.isdigit():
        if int(text) < 1:
            raise UserError(f"--prompts {text}: a number of prompts a set must be >= 1")
        return int(text), None
    return None, text


def own_prompts(spec: str, out: Path) -> tuple[list, str]:
    """The probe's prompts of --prompts FILE|SET (adaptive_spec.decoding.auto's load_texts), kept in <out>/prompts.jsonl, from
    which the sweep runs them and a rerun reads them back (the same prompts, whatever a set's shuffle does)."""
    from adaptive_spec.decoding.auto import FIELD, load_texts

    path = out / "prompts.jsonl"
    if path.is_file():
        return [json.loads(line)[FIELD] for line in path.read_text().splitlines() if line.strip()], spec
    texts, label = load_texts(spec)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({FIELD: t}) + "\n" for t in texts))
    return texts, label


def _load(out: Path, engines: list[str]) -> tuple[dict, dict, dict]:
    results, sweeps, afters = {}, {}, {}
    for engine in engines:
        path = out / f"probe_{engine}.json"
        if not path.is_file():
            raise UserError(f"{path} does not exist: run the benchmark without --report-only first")
        results[engine] = json.loads(path.read_text())
        rows = out / f"sweep_{engine}" / "results.jsonl"
        sweeps[engine] = list(read_jsonl(rows)) if rows.is_file() else []
        if (out / f"probe_{engine}_after.json").is_file():
            afters[engine] = json.loads((out / f"probe_{engine}_after.json").read_text())
    return results, sweeps, afters


def _main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="llama.cpp,torch")
    ap.add_argument("--datasets", default="humaneval,gsm8k,alpaca")
    ap.add_argument("--prompts", default="5", metavar="N|FILE|SET",
                    help="prompts a set (5), or FILE|SET: the probe prices at the acceptance on these prompts and the "
                         "runs run on them (a .jsonl with a 'prompt' field, a set's name, or SET:START:STOP)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head", default=probe.DEFAULT_HEAD)
    ap.add_argument("--torch-draft-quant", default="int8", help="the torch draft's weights (the head's draft)")
    ap.add_argument("--reps", type=int, default=None, help="the probe's timing rounds where nothing is cached")
    ap.add_argument("--out", default="eval/results/bench_probe")
    ap.add_argument("--report-only", action="store_true", help="run nothing: the report of what <out> holds")
    args = ap.parse_args(argv)
    out = Path(args.out)
    args.prompts, own = prompts_arg(args.prompts)
    unknown = [d for d in args.datasets.split(",") if d not in KIND]
    if unknown and not args.report_only and own is None:
        raise UserError(f"no workload kind for set {unknown[0]!r}: the probe prices one of {', '.join(KIND)}")
    workload = parse_workload([KIND[d] for d in args.datasets.split(",") if d in KIND]) if own is None else None
    texts = None
    if own is not None and not args.report_only:  # refused before any model loads
        texts = own_prompts(own, out)
        args.datasets, args.prompts = str(out / "prompts.jsonl"), len(texts[0])
    if args.report_only:
        run = run_header(out, report_only=True)
        results, sweeps, afters = _load(out, run["engines"])
        (out / "report.md").write_text(report(results, sweeps, run, afters))
        return 0
    import torch

    from adaptive_spec.backends.cpu.machine import flags_line
    from adaptive_spec.evaluation import sweep
    from adaptive_spec.params import pair_params

    torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    engines = args.engines.split(",")
    for engine in engines:
        path = out / f"probe_{engine}.json"
        pair = pair_params(backend=engine, threads=args.threads,
                           **({"draft_quant": args.torch_draft_quant} if engine == "torch" else {}))
        if not path.is_file():  # a rerun keeps the first probe: its predictions are what the rows are checked against
            write_json(path, probe.run(pair, args.head, 1.0, 128, args.max_new_tokens, args.reps,
                                       workload=workload, prompts=texts), indent=1, default=str)
            gc.collect()  # the probe's pair, before the sweep loads its own
        result = json.loads(path.read_text())
        config = out / f"sweep_{engine}.yaml"
        config.write_text(json.dumps(sweep_config(result, engine, args), indent=1))  # JSON is YAML
        if sweep.main(["--config", str(config), f"out_dir={out / f'sweep_{engine}'}"]) != 0:
            return 2
        gc.collect()
        after = out / f"probe_{engine}_after.json"
        if not after.is_file():  # the machine's speed after the runs: the same configurations, measured afresh
            write_json(after, probe.run(pair, args.head, 1.0, 128, args.max_new_tokens, args.reps, cache=False,
                                        ran=picks_of(result), prompts=texts, prompts_cache=True,
                                        workload=None if texts else parse_workload(result["workload"])),
                       indent=1, default=str)
            gc.collect()
    header = run_header(out, report_only=False, measure=lambda: {
        "script": f"eval/{Path(__file__).name}", "engines": engines, "datasets": own or args.datasets,
        "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "threads": args.threads, "cpu": flags_line(),
        **({"acceptance": own} if own else {})})
    results, sweeps, afters = _load(out, engines)
    md = report(results, sweeps, header, afters)
    (out / "report.md").write_text(md)
    print(md)
    return 0


def main(argv=None) -> int:
    return run_main(_main, sys.argv[1:] if argv is None else argv,
                    "the probes and the finished sweep rows are kept in <out>; rerun the same command to resume")


if __name__ == "__main__":
    sys.exit(main())
