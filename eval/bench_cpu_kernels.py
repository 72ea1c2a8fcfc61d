"""Benchmark: what one forward of each model costs on this CPU, per numeric path.

For each model of the default pair and each path (bf16 stock kernels, the pre-AVX2-fix default
on every CPU; fp32 stock; fp32 oneDNN-packed; fp32 oneDNN-packed with FBGEMM fp16 copies for
short inputs, the `auto` path on AVX2-only CPUs; bf16 oneDNN-packed, the `auto` path where bf16
kernels exist), side by side in one process:
- ms per forward of 1 token (a decode step) and of K + 1 tokens (a verification of K candidates),
  and their ratio: speculation pays only where verifying K + 1 costs about one decode step;
- the prefill of a --prefill-token prompt;
- GB/s of linear weights streamed, against the machine's own read bandwidth (measured first);
- the largest logit difference against fp32 stock (the reference).
The paths alternate --rounds times so drifts in the machine's speed hit all alike; timing is
3 untimed warm-up forwards, then the median of --reps per round, median over rounds. The CPU's
flags head every table: a number from another CPU kind says nothing about this one.

    python eval/bench_cpu_kernels.py [--models draft,target] [--lens 1,2,3,5,9] [--prefill 235] [--threads 2]

The rows and the read bandwidth go to <out>/results.json, the CPU's flags line and the prefill length
the table names to <out>/run.json (evaluation/paired.run_header), the table to <out>/table.md;
`--report-only --out <out>` measures nothing and loads no model: it rewrites table.md from those two
files alone, on any machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from adaptive_spec.evaluation.paired import run_header

if TYPE_CHECKING:  # torch and the models are imported where a measuring run needs them: --report-only needs neither
    import torch

    from adaptive_spec.backends.models import CausalLM

# path name -> (dtype, packed, fp16 copies for short inputs)
PATHS = {"bf16 stock": ("bf16", False, False), "fp32 stock": ("fp32", False, False),
         "fp32 packed": ("fp32", True, False), "fp32 packed + fp16": ("fp32", True, True),
         "bf16 packed": ("bf16", True, False)}


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def time_prefill(lm: CausalLM, n: int, reps: int) -> float:
    import torch

    ids = torch.arange(300, 300 + n) % lm.vocab_size
    times = []
    for _ in range(reps + 1):
        lm.reset()
        times.append(_timed(lambda: lm.forward(ids, n_logits=0)))
    return statistics.median(times[1:])


def load_path(name: str, role: str, dtype: str, packed: bool, fp16: bool) -> CausalLM:
    from adaptive_spec.backends.models import CausalLM, load_model

    model, _ = load_model(name, role, dtype, "cpu", pack=packed, fp16=fp16)
    return CausalLM(model)


def bench_model(name: str, args, lens: list[int]) -> list[dict]:
    import torch

    from adaptive_spec.backends.cpu import fbgemm_fp16, onednn_packed
    from adaptive_spec.backends.models import resolve_dtype
    from adaptive_spec.evaluation.forward_costs import linear_bytes, time_forward

    role = name if name in ("draft", "target") else "target"
    path = None if name in ("draft", "target") else name
    # a packed path this CPU has no kernel for is left out (the table's first line says why)
    paths = {p: v for p, v in PATHS.items() if not (v[1] and onednn_packed(resolve_dtype(v[0])))
             and not (v[2] and fbgemm_fp16())}
    if args.paths:
        paths = {p: v for p, v in paths.items() if p in args.paths.split(",")}
    runners = {p: load_path(path, role, *v) for p, v in paths.items()}
    ref = "fp32 stock" if "fp32 stock" in runners else next(iter(runners))  # logits compared against it
    prompt = torch.arange(200, 264) % runners[ref].vocab_size  # 64 tokens of cache; content irrelevant
    times, logits, prefill = {}, {}, {}
    for _ in range(args.rounds):
        for p, lm in runners.items():
            for n in lens:
                dt, lg = time_forward(lm, prompt, n, args.reps)
                times.setdefault((p, n), []).append(dt)
                logits[(p, n)] = lg.float()
            if args.prefill:
                prefill.setdefault(p, []).append(time_prefill(lm, args.prefill, 1))
    rows = []
    for p, lm in runners.items():
        nbytes = linear_bytes(lm.model)
        step = statistics.median(times[(p, 1)])
        for n in lens:
            dt = statistics.median(times[(p, n)])
            rows.append({"model": name, "path": p, "tokens": n, "ms": dt * 1e3, "vs_step": dt / step,
                         "weight_GBps": nbytes / dt / 1e9, "linear_weight_GB": nbytes / 1e9,
                         "max_abs_logit_diff": (logits[(p, n)] - logits[(ref, n)]).abs().max().item(), "reference": ref,
                         "prefill_ms": statistics.median(prefill[p]) * 1e3 if prefill else None,
                         "pad_to": list(getattr(lm.model, "cpu_pad_to", ())), "threads": args.threads,
                         "cpu_path": getattr(lm.model, "cpu_path", {})})
    return rows


def report(results, run: dict) -> str:
    """table.md of results.json (`results`) with what run.json (`run`) says of the run: its CPU's flags line
    and the prefill length; the same text whether just measured or rebuilt by --report-only."""
    if isinstance(results, list):  # the first runs (a list of rows): stock vs packed layouts of one dtype
        return layouts_table(results)
    return table(results["rows"], results["read_GBps"], run["prefill"], run["cpu"])


def table(rows: list[dict], bw: float, prefill: int, cpu: str) -> str:
    # rows without a reference are from runs that compared every path with fp32 stock and kept no cpu_path
    legacy = any("reference" not in r for r in rows)
    lines = [cpu, f"read bandwidth (sum over 1 GiB, best of 5): {bw:.1f} GB/s", "",
             "| model | path | tokens | ms/forward | x decode step | GB/s of weights | % of read bw | "
             f"prefill {prefill} tok, s | prefill speed-up vs bf16 stock | "
             f"max abs logit diff vs {'fp32' if legacy else 'reference'} |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = next((s for s in rows if s["model"] == r["model"] and s["path"] == "bf16 stock"), None)
        pf = r["prefill_ms"]
        sp = f"{ref['prefill_ms'] / pf:.2f}x" if pf and ref else "—"
        lines.append(f"| {r['model']} | {r['path']} | {r['tokens']} | {r['ms']:.1f} | {r['vs_step']:.2f} | "
                     f"{r['weight_GBps']:.1f} | {100 * r['weight_GBps'] / bw:.0f}% | "
                     f"{pf / 1e3:.2f} | {sp} | {r['max_abs_logit_diff']:.3g} |" if pf else
                     f"| {r['model']} | {r['path']} | {r['tokens']} | {r['ms']:.1f} | {r['vs_step']:.2f} | "
                     f"{r['weight_GBps']:.1f} | {100 * r['weight_GBps'] / bw:.0f}% | — | — | {r['max_abs_logit_diff']:.3g} |")
    if not legacy:
        lines.append("")
        for r in rows:
            if r["tokens"] == rows[0]["tokens"]:
                # the model's record keeps pad_to as a tuple; results.json, as a list
                path = {k: tuple(v) if k == "pad_to" else v for k, v in r["cpu_path"].items()}
                lines.append(f"- {r['model']}, {r['path']}: logits against {r['reference']}; path {path}")
    return "\n".join(lines) + "\n"


def layouts_table(rows: list[dict]) -> str:
    """The first runs' table: each model's layouts (stock, packed, packed with row padding) in one dtype."""
    lines = ["| model | layout | tokens | ms/forward | GB/s of weights | speed-up vs stock | max abs logit diff |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        stock = next(s for s in rows if s["model"] == r["model"] and s["tokens"] == r["tokens"] and s["layout"] == "stock")
        lines.append(f"| {r['model']} | {r['layout']} | {r['tokens']} | {r['ms']:.1f} | {r['weight_GBps']:.1f} | "
                     f"{stock['ms'] / r['ms']:.2f}x | {r['max_abs_logit_diff']:.3g} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="draft,target", help="roles of the default pair, or model paths / hub ids")
    ap.add_argument("--lens", default="1,2,3,5,9", help="tokens per forward: 1 = a decode step, K + 1 = a verify")
    ap.add_argument("--prefill", type=int, default=235, help="prompt tokens for the prefill timing (0 = skip)")
    ap.add_argument("--reps", type=int, default=7, help="timed forwards per (path, length) per round")
    ap.add_argument("--rounds", type=int, default=3, help="times the paths alternate")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--paths", default=None, help="comma-separated subset of: " + ", ".join(PATHS)
                    + " (default: all this CPU runs; logits are compared with fp32 stock, else the first)")
    ap.add_argument("--out", default=None, help="output folder (default eval/results/bench_cpu_kernels_<isa>)")
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing: rewrite <out>/table.md from its results.json and run.json")
    args = ap.parse_args(argv)
    if args.report_only:
        if not args.out:
            ap.error("--report-only rewrites the table of a run folder: name it with --out")
        out = Path(args.out)
        (out / "table.md").write_text(report(json.loads((out / "results.json").read_text()),
                                             run_header(out, report_only=True)))
        return 0
    import torch

    from adaptive_spec.backends.cpu import describe, flags_line
    from adaptive_spec.evaluation.forward_costs import read_bandwidth_gbps

    torch.set_num_threads(args.threads)
    lens = sorted({1, *(int(x) for x in args.lens.split(","))})
    bw = read_bandwidth_gbps()
    rows = [r for name in args.models.split(",") for r in bench_model(name, args, lens)]
    out = Path(args.out or f"eval/results/bench_cpu_kernels_{describe()['isa'].lower()}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"machine": describe(), "read_GBps": bw, "rows": rows}, indent=1) + "\n")
    header = run_header(out, report_only=False, measure=lambda: {
        "script": f"eval/{Path(__file__).name}", "report": "table.md", "cpu": flags_line(), "prefill": args.prefill})
    text = report(json.loads((out / "results.json").read_text()), header)  # as --report-only reads it back
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
