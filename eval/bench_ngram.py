"""Prompt-lookup (n-gram) drafting against its peers, on both engines, in one run on the same prompts,
paired per prompt (every configuration of a prompt runs back to back).

Rows, per prompt and temperature (T = 1 top-k 50, and greedy):
- llama.cpp (the fetched GGUFs): the target alone (ar); ours: ngram k=auto (cost-aware), ngram at fixed
  copy lengths (the peers' rule: transformers' prompt_lookup_num_tokens, vLLM's num_speculative_tokens),
  SpecDec++ h=auto with the draft model, and the combination (ngram, the draft model under SpecDec++
  auto in rounds nothing is copied); with --target-quant, the target alone and ngram k=auto on that file;
- llama.cpp's own prompt lookup (`llama-speculative-simple --spec-type ngram-simple`, greedy only: its
  acceptance is greedy matching), built from the binding's sdist with the binding's flags;
- torch (bf16 target) on --torch-datasets: ar, ngram k=auto, and transformers' prompt lookup
  (`generate(prompt_lookup_num_tokens=10)`, its documented setting).
Prompt sets: `edit` (HumanEval's solutions with an edit request: prompts.py), second turns
(eval/make_followups.py: a request, the target's own answer, a request to revise it) and HumanEval,
GSM8K, AlpacaEval. Speeds are decode tokens/s (prefill out), pooled over prompts; wall tokens/s and
the time to the first token are in the rows.

    python eval/make_followups.py                  # the second turns, once
    python eval/bench_ngram.py --prompts 10 --out eval/results/bench_ngram_avx512_epyc

Resumable: rows go to <out>/results.jsonl as they finish; a rerun skips the rows it has.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

from adaptive_spec.backends.cpu.machine import flags_line
from adaptive_spec.setup.wheels import default_gguf
from adaptive_spec.setup.llama_build import VERSION
from adaptive_spec.decoding.auto import measure_costs
from adaptive_spec.decoding.ngram import NgramIndex
from adaptive_spec.decoding.pipeline import SpecPair
from adaptive_spec.errors import UserError, run_main
from adaptive_spec.setup.llama_tools import build, build_flags, spec_example
from adaptive_spec.evaluation.paired import pooled_tok_s, record, run_header, start
from adaptive_spec.evaluation.sweep_run import hf_generate
from adaptive_spec.prompts import load_prompts
from adaptive_spec.runs import project_path, read_jsonl
from adaptive_spec.tables import md_table

HEAD = "checkpoints/qwen-coder-0.5b-int8-stats-d3"
FOLLOWUPS = "runs/prompts/followups.jsonl"
FIXED = (3, 8)


# --rules: which part of a copy rule pays, in our loop: llama.cpp's ngram-simple rule (a 12-token match,
# then 48 copies), our cost-aware K on 12-token matches only, and on 4..8-token ones
RULES = [("ngram k=48 n=12 (ngram-simple's rule)", "ngram", {"k": 48, "ngram_min": 12, "ngram_max": 12}),
         ("ngram k=auto n=12", "ngram", {"ngram_min": 12, "ngram_max": 12}),
         ("ngram k=auto n=4..8", "ngram", {"ngram_min": 4, "ngram_max": 8})]


def configs(engine: str, rules: bool = False) -> list[tuple[str, str, dict]]:
    """(label, policy, settings) per engine ("llama.cpp", "llama.cpp <target quant>", "torch"); rules: the
    copy-rule comparison instead of the model-draft rows (llama.cpp only)."""
    if rules:
        return [("ar", "ar", {}), ("ngram k=auto", "ngram", {})] + (RULES if engine == "llama.cpp" else [])
    if engine == "torch":
        return [("ar", "ar", {}), ("ngram k=auto", "ngram", {}), ("hf prompt lookup", "hf_prompt_lookup", {})]
    if engine != "llama.cpp":
        return [("ar", "ar", {}), ("ngram k=auto", "ngram", {})]
    return ([("ar", "ar", {}), ("ngram k=auto", "ngram", {})]
            + [(f"ngram k={k}", "ngram", {"k": k}) for k in FIXED]
            + [("specdec++ h=auto", "learned", {"head": HEAD, "threshold": "auto"}),
               ("combined auto", "ngram", {"fallback": "learned", "head": HEAD, "threshold": "auto"})])


def row_of(pair, ids, policy: str, kw: dict, temperature: float, n: int) -> dict:
    sampling = dict(temperature=temperature, top_k=50 if temperature else 0, top_p=1.0)
    if policy == "hf_prompt_lookup":
        m, _, new = hf_generate(pair, ids, SimpleNamespace(**sampling), 0, n, lookup=True)
        auto = None
    else:
        g = pair.generate(ids, policy=policy, max_new_tokens=n, seed=0, **sampling, **kw)
        m, new, auto = g.metrics, g.token_ids, getattr(g, "auto", None)
    decode_s = m.wall_s - m.prefill_s
    return {"n_tokens": m.n_tokens, "wall_s": m.wall_s, "prefill_s": m.prefill_s, "decode_s": decode_s,
            "decode_tok_s": m.n_tokens / decode_s, "tok_s": m.tokens_per_s, "n_target_forwards": m.n_target_forwards,
            "n_drafted": m.n_drafted, "n_accepted": m.n_accepted, "rounds_by": m.by_source.rounds_by,
            "n_drafted_by": m.by_source.n_drafted_by, "n_accepted_by": m.by_source.n_accepted_by,
            "breakdown": m.breakdown(),
            "target_pass_hist": m.target_pass_hist, "token_ids": new,
            "auto": None if auto is None else auto["value"],
            "auto_predicted_decode_tok_s": None if auto is None else auto["tokens_per_s"],
            "auto_predicted_wall_tok_s": None if auto is None else auto.get("wall_tokens_per_s")}


def lookup_cost(n_context: int = 4000, rounds: int = 200) -> tuple[float, float]:
    """(ms to index a context of n_context tokens once, ms per round after it: the index's update
    for one round's new tokens and a lookup), on a context of random tokens with repeats."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2000, (n_context,), generator=g).tolist()
    idx = NgramIndex(2, 4)
    t0 = time.perf_counter()
    idx.update(tokens)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for r in range(rounds):
        tokens.extend(tokens[r * 3:r * 3 + 3])  # three new tokens a round
        idx.update(tokens)
        idx.lookup(tokens, 16)
    return 1e3 * first, 1e3 * (time.perf_counter() - t0) / rounds


def _main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default=f"edit,{FOLLOWUPS},humaneval,gsm8k,alpaca")
    ap.add_argument("--torch-datasets", default=f"edit,{FOLLOWUPS}", help="the torch rows' sets ('' = none)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperatures", default="1,0")
    ap.add_argument("--target-quant", default="", help="also the target re-quantized so (e.g. q4_0-pure)")
    ap.add_argument("--out", default="eval/results/bench_ngram")
    ap.add_argument("--rules", action="store_true", help="compare copy rules (RULES) instead of the model-draft rows")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    out, results, done = start(args.out, args.threads)
    if args.report_only:  # from the folder alone: its rows and run.json
        md = report(list(read_jsonl(results)), run_header(out, report_only=True))
        (out / "report.md").write_text(md)
        print(md)
        return 0
    datasets = args.datasets.split(",")
    torch_sets = [d for d in args.torch_datasets.split(",") if d]
    if FOLLOWUPS in datasets and not project_path(FOLLOWUPS).is_file():
        raise UserError(f"{FOLLOWUPS} does not exist; make the second turns first: python eval/make_followups.py")
    prompts = {ds: load_prompts(str(project_path(ds)) if ds.endswith(".jsonl") else ds,
                                field="messages" if ds.endswith(".jsonl") else None, n=args.prompts)
               for ds in datasets}
    bins = build(args.threads)
    pairs = {"llama.cpp": SpecPair.load(backend="llama.cpp", threads=args.threads)}
    if args.target_quant:
        pairs[f"llama.cpp {args.target_quant}"] = SpecPair.load(backend="llama.cpp", draft=None,
                                                                target_quant=args.target_quant, threads=args.threads)
    for name, pair in pairs.items():  # pinned: a resumed run prices its auto rows the same way
        measure_costs(pair, pin=out / f"costs-{name.replace(' ', '-')}.json")
    if torch_sets:
        pairs["torch"] = SpecPair.load(draft=None, threads=args.threads)
        measure_costs(pairs["torch"], pin=out / "costs-torch.json")
    temps = [float(t) for t in args.temperatures.split(",")]
    order = [(ds, i, texts[i]) for i in range(max(map(len, prompts.values())))
             for ds, texts in prompts.items() if i < len(texts)]
    for ds, i, text in order:
        ids = pairs["llama.cpp"].encode(text, chat=True)
        chat_text = pairs["llama.cpp"].tokenizer.decode(ids)
        for temp in temps:
            for name, pair in pairs.items():
                if name == "torch" and ds not in torch_sets:
                    continue
                pair.generate(ids, policy="ar", temperature=temp, max_new_tokens=16)  # untimed warm-up
                for label, policy, kw in configs(name, args.rules):
                    record(results, done, {"dataset": ds, "prompt_idx": i, "temperature": temp, "engine": name,
                                           "config": label, "prompt_tokens": len(ids)},
                           lambda: row_of(pair, ids, policy, kw, temp, args.max_new_tokens))
            if temp == 0:
                record(results, done, {"dataset": ds, "prompt_idx": i, "temperature": temp,
                                       "engine": "llama.cpp example", "config": "ngram-simple (its defaults)",
                                       "prompt_tokens": len(ids)},
                       lambda: spec_example(bins, default_gguf("target"), None, chat_text, args.max_new_tokens, None,
                                            args.threads, spec_type="ngram-simple"))
    header = run_header(out, report_only=False, measure=lambda: {
        "script": f"eval/{Path(__file__).name}", "max_new_tokens": args.max_new_tokens, "threads": args.threads,
        "cpu": flags_line(),
        "build": build_flags(bins) + f"; llama-cpp-python {VERSION}", "lookup_ms": lookup_cost()})
    md = report(list(read_jsonl(results)), header)
    (out / "report.md").write_text(md)
    print(md)
    return 0


def report(rows: list[dict], run: dict) -> str:
    """The report of the rows, with what run.json says of the run (paired.run_header)."""
    lookup = run["lookup_ms"]
    by = defaultdict(list)
    for r in rows:
        by[(r["dataset"], r["temperature"], r["engine"], r["config"])].append(r)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    names = {ds: Path(ds).stem for ds in datasets}
    n_prompts = {ds: len({r["prompt_idx"] for r in rows if r["dataset"] == ds}) for ds in datasets}
    lines = [f"# Prompt lookup (n-gram drafting): {', '.join(f'{names[d]} ({n})' for d, n in n_prompts.items())} "
             f"prompts x {run['max_new_tokens']} tokens, {run['threads']} threads", "", run["cpu"], "",
             run["build"], "",
             "Decode tokens/s (prefill left out), pooled over prompts, every configuration of a prompt back to back; "
             "(x) is the ratio to the same engine's target alone in the same rows; `acc` the acceptance of copied "
             "tokens; `copy` the share of rounds that copied.", ""]
    goals = []
    for temp in dict.fromkeys(r["temperature"] for r in rows):
        table = []
        for engine, config in dict.fromkeys((r["engine"], r["config"]) for r in rows if r["temperature"] == temp):
            cells = [engine, config]
            base_engine = "llama.cpp" if engine == "llama.cpp example" else engine
            for ds in datasets:
                rs, base = by[(ds, temp, engine, config)], by[(ds, temp, base_engine, "ar")]
                if not rs:
                    cells.append("—")
                    continue
                cell = f"{pooled_tok_s(rs):.2f}" + (f" ({pooled_tok_s(rs) / pooled_tok_s(base):.2f}x)" if base else "")
                drafted = sum((r.get("n_drafted_by") or {}).get("ngram", 0) for r in rs)
                if drafted:
                    acc = sum((r.get("n_accepted_by") or {}).get("ngram", 0) for r in rs) / drafted
                    rounds = sum(sum((r.get("rounds_by") or {}).values()) for r in rs) or 1
                    copied = sum((r.get("rounds_by") or {}).get("ngram", 0) for r in rs)
                    cell += f", acc {acc:.2f}, copy {copied / rounds:.2f}"
                picks = sorted({str(r["auto"]) for r in rs if r.get("auto") is not None})
                cell += f", picked {'/'.join(picks)}" if picks else ""
                cells.append(cell)
            table.append(cells)
        mode = "greedy" if temp == 0 else f"T = {temp:g}, top-k 50"
        lines += [f"## {mode}", "", md_table(["engine", "configuration", *[names[d] for d in datasets]], table), ""]
        goals += _goals(by, datasets, names, temp)
    lines += ["## Goals (ratios from the rows above)", "", md_table(["goal", "set", "ratio", "met"], goals), ""]
    ttft = []
    for ds in datasets:
        for config in ("ar", "ngram k=auto", "specdec++ h=auto", "combined auto"):
            rs = [r for r in rows if r["dataset"] == ds and r["engine"] == "llama.cpp" and r["config"] == config]
            if rs:
                ttft.append([names[ds], config, f"{statistics.mean(r['prompt_tokens'] for r in rs):.0f}",
                             f"{1e3 * statistics.mean(r['prefill_s'] for r in rs):.0f}"])
    pred = []
    for (ds, temp, engine, config), rs in by.items():
        rs = [r for r in rs if r.get("auto_predicted_decode_tok_s")]
        if not rs:
            continue
        n = sum(r["n_tokens"] for r in rs)
        p_dec = n / sum(r["n_tokens"] / r["auto_predicted_decode_tok_s"] for r in rs)
        walls = [r for r in rs if r.get("auto_predicted_wall_tok_s")]
        p_wall = (sum(r["n_tokens"] for r in walls) / sum(r["n_tokens"] / r["auto_predicted_wall_tok_s"] for r in walls)
                  if walls else float("nan"))
        pred.append([names[ds], "greedy" if temp == 0 else f"T={temp:g}", engine, config,
                     "/".join(sorted({str(r["auto"]) for r in rs})), f"{p_dec:.2f}", f"{pooled_tok_s(rs):.2f}",
                     f"{p_dec / pooled_tok_s(rs) - 1:+.1%}", f"{p_wall:.2f}", f"{pooled_tok_s(walls, 'wall_s'):.2f}" if walls else "—",
                     f"{p_wall / pooled_tok_s(walls, 'wall_s') - 1:+.1%}" if walls else "—"])
    if pred:
        lines += ["## auto: predicted against measured", "",
                  "The pick's predicted tokens/s (the measured forward costs, the loop's own time per row and round, "
                  "and for wall time the prompt's prefill at the measured rate) against what its rows measured, "
                  "pooled.", "",
                  md_table(["set", "sampling", "engine", "configuration", "picked", "predicted decode", "measured decode",
                            "error", "predicted wall", "measured wall", "error"], pred), ""]
    lines += ["## Time before decoding (prefill), llama.cpp", "",
              "Mean prefill per prompt: copying needs no draft model, so n-gram rows prefill the target alone; "
              "`combined auto` prefills its draft only in its first round that drafts with it.", "",
              md_table(["set", "configuration", "prompt tokens", "prefill ms"], ttft), "",
              f"The lookup's own cost (decoding/ngram.py NgramIndex, ngram 2..4): indexing a 4,000-token context "
              f"once {lookup[0]:.2f} ms, then {lookup[1]:.3f} ms a round (its new tokens indexed, one lookup).", "",
              f"Written {run['written']} by `python eval/bench_ngram.py`."]
    return "\n".join(lines) + "\n"


def _goals(by, datasets, names, temp) -> list[list[str]]:
    out = []
    mode = "greedy" if temp == 0 else "T=1"

    def add(goal, ds, ratio, target):
        if ratio == ratio:
            out.append([f"{mode}: {goal}", names[ds], f"{ratio:.2f}x", "yes" if ratio >= target else "**no**"])

    def sp(ds, engine, config):
        rs = by.get((ds, temp, engine, config))
        return pooled_tok_s(rs) if rs else float("nan")

    for ds in datasets:
        ar = sp(ds, "llama.cpp", "ar")
        name = names[ds]
        if name == "edit":
            add("combined auto / llama.cpp alone, llama.cpp (>= 2)", ds, sp(ds, "llama.cpp", "combined auto") / ar, 2.0)
            add("ngram k=auto / transformers' prompt lookup, torch (>= 1.3)", ds,
                sp(ds, "torch", "ngram k=auto") / sp(ds, "torch", "hf prompt lookup"), 1.3)
        elif name == "followups":
            add("ngram k=auto / llama.cpp alone (>= 1.5)", ds, sp(ds, "llama.cpp", "ngram k=auto") / ar, 1.5)
            best_fixed = max(sp(ds, "llama.cpp", f"ngram k={k}") for k in FIXED)
            add("ngram k=auto / the best fixed copy length (>= 1.15)", ds, sp(ds, "llama.cpp", "ngram k=auto") / best_fixed,
                1.15)
        else:
            better = max(ar, sp(ds, "llama.cpp", "specdec++ h=auto"))
            add("combined auto / the better of (ar, SpecDec++ auto) (>= 0.97)", ds,
                sp(ds, "llama.cpp", "combined auto") / better, 0.97)
    return out


def main(argv=None) -> int:
    return run_main(_main, sys.argv[1:] if argv is None else argv,
                    "finished rows are kept in results.jsonl; rerun the same command to resume")


if __name__ == "__main__":
    sys.exit(main())
