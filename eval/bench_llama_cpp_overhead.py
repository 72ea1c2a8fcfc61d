"""What our decode loop costs on top of llama.cpp's own: the target alone (ar) through the binding
against `llama-bench` tg at the same context, split into llama.cpp's forward time and everything
else (sampling, the loop), with torch on one thread while llama.cpp decodes (as shipped:
the llama.cpp engine's decode_torch_threads) and with torch on the process's threads, paired per prompt.

    python eval/bench_llama_cpp_overhead.py --prompts 3 --max-new-tokens 96

Every variant of a prompt runs back to back after an untimed warm-up, and so does llama-bench tg at
that prompt's length (this box's speed drifts by 10% between spells, so only paired figures
compare); the order of the two torch settings alternates from prompt to prompt. Resumable:
rows go to <out>/results.jsonl as they finish; <out>/report.md holds the table, <out>/run.json what it
says beside the rows (the CPU, the build, the settings, when: evaluation/paired.run_header).
`--report-only --out DIR` rewrites DIR/report.md from those alone (no model, no build, no prompt set).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.runs import append_jsonl, read_jsonl
from adaptive_spec.tables import md_table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default="humaneval,gsm8k,alpaca")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="eval/results/bench_llama_cpp_overhead")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: report.md from what <out> holds (results.jsonl and run.json)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    results = out / "results.jsonl"
    if args.report_only:  # from the folder alone: no model, no build, no prompt set
        (out / "report.md").write_text(report(list(read_jsonl(results)), run_header(out, report_only=True)))
        return 0

    import torch

    from adaptive_spec.backends.cpu.machine import flags_line
    from adaptive_spec.setup.wheels import default_gguf
    from adaptive_spec.setup.llama_tools import bench_tg, build, build_flags
    from adaptive_spec.decoding import pipeline
    from adaptive_spec.prompts import load_prompts

    torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    done = {_key(r) for r in read_jsonl(results)} if results.is_file() else set()
    bins = build(args.threads)
    pair = pipeline.SpecPair.load(backend="llama.cpp", draft=None, threads=args.threads)
    variants = tuple(dict.fromkeys((1, args.threads)))  # one variant when --threads 1
    n = 0
    for ds in args.datasets.split(","):
        for i, text in enumerate(load_prompts(ds, n=args.prompts)):
            ids = pair.encode(text, chat=True)
            row = {"dataset": ds, "prompt_idx": i, "temperature": None, "torch_threads": None, "prompt_tokens": len(ids)}
            if _key(row) not in done:  # llama.cpp's own loop at this prompt's context, beside our rows
                row["tg_tok_s"] = bench_tg(bins, default_gguf("target"), args.max_new_tokens, len(ids),
                                           args.threads, reps=1)
                append_jsonl(results, row)
            for temp in (1.0, 0.0):
                order = variants if n % 2 == 0 else variants[::-1]
                n += 1
                for threads in order:
                    if (ds, i, temp, threads) in done:
                        continue
                    pair.engine = dataclasses.replace(pair.engine, decode_torch_threads=threads)
                    kw = dict(policy="ar", temperature=temp, top_k=50 if temp else 0)
                    pair.generate(ids, max_new_tokens=8, **kw)  # warm-up, untimed
                    g = pair.generate(ids, max_new_tokens=args.max_new_tokens, seed=0, **kw)
                    m = g.metrics
                    row = {"dataset": ds, "prompt_idx": i, "temperature": temp, "torch_threads": threads,
                           "prompt_tokens": len(ids), "n_tokens": m.n_tokens, "decode_s": m.wall_s - m.prefill_s,
                           "forward_s": m.target_s - m.prefill_s}
                    append_jsonl(results, row)
                    print(f"{ds} {i} T={temp:g} torch threads {threads}: {m.n_tokens / row['decode_s']:.2f} tok/s",
                          file=sys.stderr, flush=True)
    header = run_header(out, report_only=False, measure=lambda: {
        "script": "eval/bench_llama_cpp_overhead.py", "cpu": flags_line(), "build": build_flags(bins),
        "max_new_tokens": args.max_new_tokens})
    md = report(list(read_jsonl(results)), header)
    (out / "report.md").write_text(md)
    print(md)
    return 0


def _key(row: dict) -> tuple:
    return row["dataset"], row["prompt_idx"], row["temperature"], row["torch_threads"]


def report(rows: list[dict], header: dict) -> str:
    """One line per sampling mode and torch setting; `x llama-bench tg` pools llama-bench's time over
    the same prompts (each measured beside them) as our rows' time. The CPU and build lines, the tokens
    a prompt and when it was written come from run.json (paired.run_header)."""
    tg = {(r["dataset"], r["prompt_idx"]): r["tg_tok_s"] for r in rows if r["temperature"] is None}
    by = defaultdict(list)
    for r in rows:
        if r["temperature"] is not None and (r["dataset"], r["prompt_idx"]) in tg:
            by[(r["temperature"], r["torch_threads"])].append(r)
    table = []
    for (temp, threads), rs in sorted(by.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        n = sum(r["n_tokens"] for r in rs)
        dec, fwd = sum(r["decode_s"] for r in rs), sum(r["forward_s"] for r in rs)
        tg_s = sum(r["n_tokens"] / tg[(r["dataset"], r["prompt_idx"])] for r in rs)
        table.append(["greedy" if temp == 0 else "T = 1, top-k 50", str(threads), str(len(rs)), f"{n / dec:.2f}",
                      f"{n / tg_s:.2f}", f"{tg_s / dec:.3f}", f"{1e3 * fwd / n:.2f}", f"{1e3 * (dec - fwd) / n:.2f}"])
    return "\n".join([
        f"# Our decode loop on llama.cpp against llama-bench: target alone, {header['max_new_tokens']} tokens a prompt",
        "", header["cpu"], "", header["build"], "",
        "llama-bench tg ran once per prompt, generating as many tokens after as many tokens of context as the "
        "prompt has, beside that prompt's rows. `forward` is llama.cpp's decode call with the logits copied out; "
        "`other` is the rest of the decode loop (sampling, bookkeeping). Prefill is left out, as tg does.", "",
        md_table(["sampling", "torch threads while decoding", "prompts", "decode tok/s", "llama-bench tg tok/s",
                  "x llama-bench tg", "forward ms/token", "other ms/token"], table), "",
        f"Written {header['written']} by `python eval/bench_llama_cpp_overhead.py`.", ""])


if __name__ == "__main__":
    raise SystemExit(main())
