"""What a forward of N rows costs against one of 1 row, v(N) / v(1), on this CPU: one tool, a subcommand per question.

Speculation pays only where verifying K candidates, a pass of K + 1 rows, costs about one decode step.
- `kernels`: what does one torch forward of each model cost per numeric path (bf16 / fp32, stock or
  oneDNN-packed, fp16 copies), at 1 and K + 1 tokens, and how close is it to the read bandwidth?
- `linear-rows`: what do the target's linear layers alone cost per input row count, per CPU kernel
  (the floor under `kernels`' whole-forward ratio)?
- `lengths`: what does a torch target pass cost per length after a short and a realistic context, a
  draft pass per width (a tree's wave), and a stats head's inputs per step?
- `llama-cpp`: what does a verification pass cost on llama.cpp per weight type, and what does a
  re-quantized target (--quality) or a cheaper draft file (--acceptance) cost?

    python eval/bench_forward_costs.py kernels [--models draft,target] [--lens 1,2,3,5,9] [--prefill 235] [--threads 2]
    python eval/bench_forward_costs.py linear-rows [--model target] [--rows 1,2,3,5,9] [--threads 2]
    python eval/bench_forward_costs.py lengths [--draft-quant int8] [--lengths 1-12] [--short 32 --long 256]
    python eval/bench_forward_costs.py llama-cpp --out eval/results/bench_pass_costs_avx512_epyc [--quality]

Each writes its measurements to <out>/results.json (llama-cpp: pass_costs.json), what the report says
beside them (the CPU's flags line, the settings, the command) to <out>/run.json (evaluation/paired.run_header)
and the report to <out>/table.md (llama-cpp: report.md). `SUBCOMMAND --report-only --out <out>` measures
nothing, loads no model and imports no torch: it rewrites the report from those two files alone, on any
machine (tests/test_regenerate_reports.py checks every committed folder so). `SUBCOMMAND --help` says how
each measures. The timing loops are evaluation/forward_costs.py's, shared with the other benchmarks.
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple

from adaptive_spec.evaluation.paired import rebuild_report, write_run
from adaptive_spec.tables import md_table

if TYPE_CHECKING:  # torch, llama.cpp and the models are imported where a measuring run needs them
    from adaptive_spec.backends.runner import CausalLM

SCRIPT = f"eval/{Path(__file__).name}"


# ----------------------------------------------------------------------------- kernels

# path name -> (dtype, packed, fp16 copies for short inputs)
PATHS = {"bf16 stock": ("bf16", False, False), "fp32 stock": ("fp32", False, False),
         "fp32 packed": ("fp32", True, False), "fp32 packed + fp16": ("fp32", True, True),
         "bf16 packed": ("bf16", True, False)}


def kernels_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", default="draft,target", help="roles of the default pair, or model paths / hub ids")
    ap.add_argument("--lens", default="1,2,3,5,9", help="tokens per forward: 1 = a decode step, K + 1 = a verify")
    ap.add_argument("--prefill", type=int, default=235, help="prompt tokens for the prefill timing (0 = skip)")
    ap.add_argument("--rounds", type=int, default=3, help="times the paths alternate")
    ap.add_argument("--paths", default=None, help="comma-separated subset of: " + ", ".join(PATHS)
                    + " (default: all this CPU runs; logits are compared with fp32 stock, else the first)")


def load_path(name: str, role: str, dtype: str, packed: bool, fp16: bool) -> CausalLM:
    from adaptive_spec.backends.models import load_model
    from adaptive_spec.backends.runner import CausalLM

    model, _ = load_model(name, role, dtype, "cpu", pack=packed, fp16=fp16)
    return CausalLM(model)


def bench_model(name: str, args, lens: list[int]) -> list[dict]:
    import torch

    from adaptive_spec.backends.cpu.machine import fbgemm_fp16, onednn_packed
    from adaptive_spec.backends.models import resolve_dtype
    from adaptive_spec.evaluation.forward_costs import linear_bytes, time_forward, time_prefill

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
    for _ in range(args.rounds):  # paths alternate so drifts in the machine's speed hit all alike
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


def measure_kernels(args) -> tuple[dict, dict]:
    """What one forward of each model costs on this CPU, per numeric path.

    For each model of the default pair and each path (bf16 stock kernels, what a bf16 model runs
    unpacked on any CPU; fp32 stock; fp32 oneDNN-packed; fp32 oneDNN-packed with FBGEMM fp16 copies for
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
    Rows and the read bandwidth go to results.json, the flags line and the prefill length to run.json.
    """
    import torch

    from adaptive_spec.backends.cpu.machine import describe, flags_line
    from adaptive_spec.evaluation.forward_costs import read_bandwidth_gbps

    torch.set_num_threads(args.threads)
    lens = sorted({1, *(int(x) for x in args.lens.split(","))})
    bw = read_bandwidth_gbps()
    rows = [r for name in args.models.split(",") for r in bench_model(name, args, lens)]
    return {"machine": describe(), "read_GBps": bw, "rows": rows}, {"cpu": flags_line(), "prefill": args.prefill}


def kernels_report(results, run: dict) -> str:
    """table.md of results.json (`results`) with what run.json (`run`) says of the run: its CPU's flags line
    and the prefill length."""
    if isinstance(results, list):  # the first runs (a list of rows): stock vs packed layouts of one dtype
        return layouts_table(results)
    return kernels_table(results["rows"], results["read_GBps"], run["prefill"], run["cpu"])


def kernels_table(rows: list[dict], bw: float, prefill: int, cpu: str) -> str:
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


# ----------------------------------------------------------------------------- linear-rows

def linear_rows_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="target", help="'target' / 'draft' of the default pair, a folder or a hub id")
    ap.add_argument("--rows", default="1,2,3,5,9", help="input rows: 1 = a decode step, K + 1 = a verification")
    ap.add_argument("--rounds", type=int, default=3, help="times the kernels and row counts alternate")


def measure_linear_rows(args) -> tuple[dict, dict]:
    """What the target's linear layers cost per input row count, per CPU kernel.

    A verification of K candidates feeds K + 1 rows through every linear layer that a decode step
    feeds one row through. Where the weights stream from memory, the ideal kernel costs the same
    for 1 and for K + 1 rows; this measures how close each available kernel gets, on random weights
    of the model's own shapes (no checkpoint is read: only its config), so the floor that the
    kernels set under the `kernels` subcommand's whole-forward ratio is visible:
    - oneDNN packed (the runtime's path: packed.PackedLinear), in fp32 and, where the CPU has bf16
      kernels, bf16;
    - MKL packed sgemm (`torch.ops.mkl._mkl_linear`), fp32;
    - FBGEMM fp16 weights with fp32 activations (`torch.fbgemm_linear_fp16_weight_fp32_activation`;
      deprecated in torch, measured while it exists): half the bytes of fp32, fp32 arithmetic;
    - stock `F.linear`, fp32 and bf16.
    "whole model" weights each shape by how often the model has it (LM head included), i.e. the
    ratio a verification forward would have if nothing but linear layers ran. Kernels and row
    counts alternate --rounds times so machine drift hits all alike; the CPU flags head the table.
    The rows go to results.json; the flags line, the model, its layer shapes, each kernel's bytes per
    weight and the settings to run.json.
    """
    import torch

    from adaptive_spec.backends.cpu.machine import describe, flags_line
    from adaptive_spec.evaluation.forward_costs import layer_shapes, linear_kernels, linear_row_times

    torch.set_num_threads(args.threads)
    rows = sorted({1, *(int(r) for r in args.rows.split(","))})
    shapes = layer_shapes(args.model)
    ks = linear_kernels()
    med = linear_row_times(shapes, ks, rows, args.rounds, args.reps)
    results = []
    for k in ks:
        for name in [*shapes, "whole model"]:
            if name == "whole model":
                t = {m: sum(c * med[(k, s, m)] for s, (_, _, c) in shapes.items()) for m in rows}
            else:
                t = {m: med[(k, name, m)] for m in rows}
            results.append({"kernel": k, "layer": name, "ms": t, "vs_1_row": {m: t[m] / t[1] for m in rows}})
    return {"machine": describe(), "rows": results}, {
        "cpu": flags_line(), "model": args.model, "threads": args.threads, "rounds": args.rounds, "reps": args.reps,
        "shapes": {name: list(v) for name, v in shapes.items()}, "weight_bytes": {k: v[0] for k, v in ks.items()}}


def linear_rows_report(results: dict, run: dict) -> str:
    """table.md of results.json's rows with what run.json (`run`) says of the run: the CPU's flags line, the
    model, its layer shapes, each kernel's bytes per weight, the settings."""
    results = results["rows"]
    rows = sorted(int(m) for m in results[0]["ms"])  # row counts: JSON keys are strings
    table = []
    for r in results:
        t = {int(m): v for m, v in r["ms"].items()}
        if r["layer"] == "whole model":
            label, gbps = r["layer"], ""
        else:
            i, o, count = run["shapes"][r["layer"]]
            label, gbps = f"{r['layer']} {i}->{o} (x{count})", f"{i * o * run['weight_bytes'][r['kernel']] / t[1] / 1e6:.1f}"
        table.append([r["kernel"], label, f"{t[1]:.2f}", gbps] + [f"{t[m] / t[1]:.2f}" for m in rows[1:]])
    return "\n".join([run["cpu"], f"{run['model']}: random weights of its linear layers' shapes, {run['threads']} threads, "
                      f"median of {run['rounds']} rounds x {run['reps']} reps", "",
                      md_table(["kernel", "layer", "ms at 1 row", "weight GB/s at 1 row"]
                               + [f"x at {m} rows" for m in rows[1:]], table)]) + "\n"


# ----------------------------------------------------------------------------- lengths

def lengths_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--draft-quant", default="int8", help="the draft's weights: none, int8, int4")
    ap.add_argument("--lengths", default="1-12", help="target pass lengths n, e.g. 1-12")
    ap.add_argument("--draft-lengths", default="1-8", help="draft pass widths (rows in one wave), e.g. 1-8")
    ap.add_argument("--short", type=int, default=32, help="short cached context (cost_timing.py's PREFIX)")
    ap.add_argument("--long", type=int, default=256, help="realistic cached context (prompt + half a response)")


def span(spec: str) -> list[int]:
    """"1-12" -> [1, ..., 12]; "4" -> [4]."""
    a, _, b = spec.partition("-")
    return list(range(int(a), int(b or a) + 1))


def measure_lengths(args) -> tuple[dict, dict]:
    """What a target pass costs per number of tokens, at a short and a realistic context, and what a
    stats head's per-step statistics cost (the extended time model).

    The `table` time model (adaptive_spec/decoding/auto/timemodel.py) prices each verification pass of K + 1 tokens
    at its measured time. This times that pass per length n (and the draft's one-token step) after
    a --short (cost_timing.py's PREFIX) and a --long cached context, so one can see (a) the step shape of
    t_verify(n) on this CPU and (b) how far times at load, taken after a short prefix, are from the
    contexts a sweep decodes at. Also the draft's pass over n rows (--draft-lengths): a tree drafts a
    wave of sibling nodes in one draft pass, so this is what a tree's width costs. Then the per-draft-step
    cost of a stats head's inputs on the real vocabulary: the full pass (process_logits + draft_stats)
    against the decoder's path (its own q reused, a top-k q read through one partial sort:
    features.truncated_stats). The times, the CPU's flags line, the models' kernels and the arguments go
    to results.json, the vocabulary size the stats line names to run.json.
    """
    import torch

    from adaptive_spec.backends.cpu.machine import flags_line
    from adaptive_spec.decoding.pipeline import SpecPair
    from adaptive_spec.decoding.sampling import SamplingParams, process_logits, sample
    from adaptive_spec.evaluation.forward_costs import per_step_ms, time_forward
    from adaptive_spec.heads.features import draft_stats, step_stats

    pair = SpecPair.load(threads=args.threads, draft_quant=args.draft_quant)
    ns, widths = span(args.lengths), span(args.draft_lengths)
    ctx = {c: (torch.arange(c) * 7 + 5) % pair.target.vocab_size for c in (args.short, args.long)}
    with torch.inference_mode():
        wide = {c: {n: time_forward(pair.draft, ids, n, args.reps)[0] for n in widths}
                for c, ids in ctx.items()}
        draft = {c: wide[c].get(1) or time_forward(pair.draft, ids, 1, args.reps)[0] for c, ids in ctx.items()}
        target = {c: {n: time_forward(pair.target, ids, n, args.reps)[0] for n in ns} for c, ids in ctx.items()}
        logits, _ = pair.draft.forward(ctx[args.short][:8], n_logits=1)
        sp = SamplingParams(1.0, 50, 1.0)
        q = process_logits(logits[0], sp)
        y = sample(q)
        old = per_step_ms(lambda: draft_stats(process_logits(logits[0], sp), y), 200)
        new = per_step_ms(lambda: step_stats(logits[0], y, sp, q, sp), 200)
    paths = {role: getattr(lm.model, "cpu_path", None) for role, lm in (("target", pair.target), ("draft", pair.draft))}
    return {"cpu": flags_line(), "paths": paths, "draft_config": pair.draft_config,
            "draft_s": {str(c): t for c, t in draft.items()},
            "draft_rows_s": {str(c): {str(n): t for n, t in v.items()} for c, v in wide.items()},
            "target_s": {str(c): {str(n): t for n, t in v.items()} for c, v in target.items()},
            "stats_ms": {"full": old, "decoder": new},
            "args": {k: v for k, v in vars(args).items() if k != "command"}}, {"vocab": logits.shape[-1]}


def lengths_report(results: dict, run: dict) -> str:
    """table.md of results.json (`results`: the times, the CPU's flags line, the kernels, the draft's
    configuration) with what run.json (`run`) says of the run (the vocabulary size)."""
    def by_n(times: dict) -> dict:  # JSON keys are strings
        return {int(n): t for n, t in times.items()}

    target = {int(c): by_n(v) for c, v in results["target_s"].items()}
    draft = {int(c): t for c, t in results["draft_s"].items()}
    ctx, ns = list(target), list(next(iter(target.values())))
    rows = [[n] + [f"{1e3 * target[c][n]:.1f}" for c in ctx] + [f"{target[c][n] / target[c][1]:.2f}" for c in ctx]
            for n in ns]
    head = ["tokens n"] + [f"t_verify ms (ctx {c})" for c in ctx] + [f"/ 1 token (ctx {c})" for c in ctx]
    lines = [f"# Target pass time per length, {results['draft_config']}", "", results["cpu"], "",
             "kernels: " + "; ".join(f"{role} {json.dumps(p)}" for role, p in results["paths"].items()), "",
             md_table(head, rows), "",
             "draft step (1 token): " + ", ".join(f"{1e3 * t:.1f} ms at ctx {c}" for c, t in draft.items()),
             "c = t_draft / t_target(1): " + ", ".join(f"{draft[c] / target[c][1]:.3f} at ctx {c}" for c in ctx)]
    if "draft_rows_s" in results:  # runs before --draft-lengths timed no draft pass over several rows
        wide = {int(c): by_n(v) for c, v in results["draft_rows_s"].items()}
        widths = list(next(iter(wide.values())))
        lines += ["", "Draft pass over n rows (a tree wave of width n): ms, / 1 row, and the extra rows' cost in "
                  "target steps, (t_draft(n) - t_draft(1)) / t_target(1).", "",
                  md_table(["rows n"] + [f"t_draft ms (ctx {c})" for c in ctx] + [f"/ 1 row (ctx {c})" for c in ctx]
                           + [f"extra / t_target (ctx {c})" for c in ctx],
                           [[n] + [f"{1e3 * wide[c][n]:.1f}" for c in ctx] + [f"{wide[c][n] / draft[c]:.2f}" for c in ctx]
                            + [f"{(wide[c][n] - draft[c]) / target[c][1]:.3f}" for c in ctx]
                            for n in widths])]
    old, new = results["stats_ms"]["full"], results["stats_ms"]["decoder"]
    lines += ["", f"stats head inputs per draft step (V = {run['vocab']}, top-k 50): full pass {old:.3f} ms, "
              f"decoder path {new:.3f} ms", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- llama-cpp

TARGET_QUANTS = ("none", "q4_0-pure", "q4_k-pure", "iq4_nl-pure")
DRAFT_QUANTS = ("none", "q4_0", "q4_0-pure")
LENGTHS = tuple(range(1, 10))


def llama_cpp_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--targets", default=",".join(TARGET_QUANTS), help="target re-quantizations (none: fetched)")
    ap.add_argument("--drafts", default=",".join(DRAFT_QUANTS), help="draft re-quantizations (none: fetched), each "
                    "QUANT or QUANT:N (N: a reduced draft vocabulary, --draft-vocab N)")
    ap.add_argument("--quality", action="store_true", help="also the re-quantized targets' KL from the fetched one")
    ap.add_argument("--acceptance", action="store_true", help="also each draft's expected acceptance against the "
                    "fetched target (what a cheaper draft file costs)")
    ap.add_argument("--quality-prompts", type=int, default=4, help="per prompt set (--quality and --acceptance)")
    ap.add_argument("--quality-tokens", type=int, default=64)


def measure_llama_cpp(args) -> tuple[dict, dict]:
    """What a verification pass costs on llama.cpp, per weight type: v(N) for N = 1..9 with the logits of
    every row, for the fetched target and its re-quantizations (--targets), the draft's step for each draft
    file, and what each re-quantized target costs in quality.

    A pass of N rows is timed after a PREFIX-token context (cost_timing.py's), all configurations interleaved
    round by round (a slow spell of the machine hits them alike), medians over --reps rounds:
    - `all rows`: logits for every row (what verification asks for);
    - `last row`: logits for the last row only (what `llama-bench -p N` asks for): the difference is the
      output matrix's extra rows (151,936 x 1,536 for the target: its largest matrix, Q6_K in Q4_K_M).
    Quality (--quality): the fetched target's greedy continuations of held prompts, teacher-forced through
    each re-quantized target: mean KL(fetched || re-quantized) of the next-token distributions per token,
    and how often their argmaxes agree. The times, sizes and quality go to pass_costs.json; the CPU's flags
    line, the ggml build and the command to run.json.

    Why each type costs what it does (ggml-cpu as vendored in llama-cpp-python 0.3.36): Q4_0, Q4_K and
    IQ4_NL matrices are repacked and their GEMM decodes a block once per group of 4 rows (repack.cpp,
    `nrows > 3`); Q6_K (in Q4_K_M: the output matrix, half of attn_v / ffn_down) and Q5_0 have no x86
    multi-row path below 8 rows (tiled/tiled.cpp starts at 8), so each row of a pass decodes them again.
    """
    import torch

    from adaptive_spec.backends.cpu.machine import flags_line
    from adaptive_spec.setup.llama_build import VERSION, X86_SETS, cmake_args
    from adaptive_spec.backends.llamacpp import GGUFModel, LlamaCppLM
    from adaptive_spec.decoding.auto import PREFIX
    from adaptive_spec.evaluation.forward_costs import (draft_acceptance, draft_runner, gguf_file, held_sequences,
                                                         pass_times, target_quality)

    threads = args.threads or torch.get_num_threads()
    cpu = flags_line()
    torch.set_num_threads(1)  # torch only copies logits here; llama.cpp computes on `threads`
    targets, drafts = args.targets.split(","), args.drafts.split(",")
    runners = {f"target {q}": LlamaCppLM(GGUFModel(gguf_file("target", q)), n_ctx=1024, n_threads=threads)
               for q in targets}
    runners.update({f"draft {q}": draft_runner(q, threads) for q in drafts})
    # a draft runs steps of 1 row (2 in a round's first), so only those are timed for it
    lengths = {name: (1, 2) if name.startswith("draft") else LENGTHS for name in runners}
    t = pass_times(runners, lengths, args.reps, all_rows=(True, False))
    t = {(name, n, a): v for (name, n, a), v in t.items() if a or not name.startswith("draft")}
    sizes = {name: lm.model.n_bytes / 2**20 for name, lm in runners.items()}
    result = {"threads": threads, "prefix": PREFIX, "reps": args.reps, "cpu": cpu,
              "times": {f"{name}|{n}|{'all' if a else 'last'}": v for (name, n, a), v in t.items()},
              "sizes_mib": sizes}
    if args.quality or args.acceptance:
        del runners  # the timed files' memory, before the teacher-forced passes load theirs
        held = held_sequences(args.quality_prompts, args.quality_tokens)
        if args.quality:
            result["quality"] = target_quality([q for q in targets if q != "none"], held)
        if args.acceptance:
            result["acceptance"] = draft_acceptance(drafts, held, threads)
    return result, {"cpu": cpu, "build": f"ggml build flags on: "
                    f"{', '.join(n for n, _ in X86_SETS if f'-D{n}=ON' in cmake_args())} "
                    f"(GGML_NATIVE and AMX off); llama-cpp-python {VERSION}"}


def llama_cpp_report(result: dict, run: dict) -> str:
    """report.md of pass_costs.json (`result`: threads, prefix, reps, times, sizes, quality) with what
    run.json (`run`) says of the run: the CPU's flags line, the ggml build, the command and when it was
    written."""
    t = {}
    for key, v in result["times"].items():
        name, n, rows = key.split("|")
        t[(name, int(n), rows == "all")] = v
    sizes = result["sizes_mib"]
    targets = [name.removeprefix("target ") for name in sizes if name.startswith("target ")]
    drafts = [name.removeprefix("draft ") for name in sizes if name.startswith("draft ")]
    rows = []
    for q in targets:
        name = f"target {q}"
        step = t[(name, 1, True)]
        v_all = [t[(name, n, True)] / step for n in LENGTHS]
        v_last = [t[(name, n, False)] / step if n > 1 else 1.0 for n in LENGTHS]
        rows.append([q, f"{sizes[name]:.0f}", f"{1e3 * step:.1f}", " ".join(f"{v:.2f}" for v in v_all),
                     " ".join(f"{v:.2f}" for v in v_last), f"{v_all[3]:.2f}", f"{1e3 * t[(name, 4, True)]:.1f}"])
    drows = [[q, f"{sizes[f'draft {q}']:.0f}", f"{1e3 * t[(f'draft {q}', 1, True)]:.1f}",
              " / ".join(f"{t[(f'draft {q}', 1, True)] / t[(f'target {tq}', 1, True)]:.2f}" for tq in targets)]
             for q in drafts]
    md = [f"# Verification pass costs on llama.cpp ({result['threads']} threads)", "", run["cpu"], "",
          run["build"], "",
          f"A pass of N rows after a {result['prefix']}-token context, median of {result['reps']} interleaved rounds, "
          "in one-row steps of the same file. `all rows`: logits of every row (verification); `last row`: of the "
          "last only (llama-bench -p N); their gap is the output matrix's extra rows.", "",
          "## Targets", "",
          md_table(["target quant", "MiB", "one-row step ms", "v(1..9), all rows", "v(1..9), last row", "v(4)",
                    "4-row pass ms"], rows), "",
          "## Drafts", "", f"c = draft step / target step, for each target ({', '.join(targets)}).", "",
          md_table(["draft quant[:vocab]", "MiB", "step ms", "c"], drows), ""]
    if "quality" in result:
        md += ["## Quality of the re-quantized targets", "",
               "Teacher-forced on the fetched target's greedy continuations of held prompts: mean per-token "
               "KL(fetched || re-quantized) of the next-token distributions, and argmax agreement.", "",
               md_table(["target quant", "mean KL (nats)", "top-1 agreement", "tokens"],
                        [[q, f"{kl:.4f}", f"{ag:.3f}", str(n)] for q, (kl, ag, n) in result["quality"].items()]), ""]
    if "acceptance" in result:
        md += ["## What each draft costs in acceptance", "",
               "Teacher-forced on the fetched target's greedy continuations of the same held prompts: the expected "
               "acceptance of a T = 1 draft token, E[alpha] = sum_x min(p(x), q(x)), and how often the draft's "
               "argmax is the target's (greedy acceptance), against the fetched target.", "",
               md_table(["draft quant[:vocab]", "E[alpha], T = 1", "greedy agreement", "tokens"],
                        [[q, f"{a:.3f}", f"{ag:.3f}", str(n)] for q, (a, ag, n) in result["acceptance"].items()]),
               ""]
    md += [f"Written {run['written']} by `{run['command']}`."]
    return "\n".join(md) + "\n"


# ----------------------------------------------------------------------------- the tool

class Mode(NamedTuple):
    """A subcommand: its options, its measurement (args -> (the data file's content, run.json's fields)),
    its report (data, run.json -> text), and the defaults the subcommands differ in."""
    help: str
    args: Callable[[argparse.ArgumentParser], None]
    measure: Callable[[argparse.Namespace], tuple[dict, dict]]
    report: Callable[[dict, dict], str]
    out: str | None  # default output folder ({isa}: the CPU's, lower-case); None: --out is required
    reps: int
    reps_help: str | None = None
    threads: int | None = 2  # None: torch's default
    data: str = "results.json"
    report_file: str = "table.md"
    indent: int = 1  # of the data file, as each former script wrote it (a rerun diffs only in its numbers)


MODES = {
    "kernels": Mode("what one torch forward costs per numeric path (was eval/bench_cpu_kernels.py)",
                    kernels_args, measure_kernels, kernels_report, "eval/results/bench_cpu_kernels_{isa}", 7,
                    "timed forwards per (path, length) per round"),
    "linear-rows": Mode("what the target's linear layers cost per row count, per kernel (was "
                        "eval/bench_linear_rows.py)", linear_rows_args, measure_linear_rows, linear_rows_report,
                        "eval/results/bench_linear_rows_{isa}", 5, "timed passes over a layer's copies per round"),
    "lengths": Mode("what a torch target pass costs per length, a draft pass per width, a stats head per step "
                    "(was eval/bench_verify_lengths.py)", lengths_args, measure_lengths, lengths_report,
                    "eval/results/bench_verify_lengths", 5, "timed passes per cell (median; 3 warm-ups first)",
                    indent=2),
    "llama-cpp": Mode("what a verification pass costs on llama.cpp per weight type (was eval/bench_pass_costs.py)",
                      llama_cpp_args, measure_llama_cpp, llama_cpp_report, None, 5, "interleaved rounds (median)",
                      threads=None, data="pass_costs.json", report_file="report.md", indent=2),
}


def common(m: Mode) -> argparse.ArgumentParser:
    """The options every subcommand has, defined once; a parent parser per subcommand because argparse
    shares a parent's option objects between subparsers, so one set_defaults would reach them all."""
    ap = argparse.ArgumentParser(add_help=False)
    if m.out is None:
        ap.add_argument("--out", required=True, help="output folder")
    else:  # a default naming the CPU's ISA is resolved when measuring (it needs torch)
        ap.add_argument("--out", default=None if "{isa}" in m.out else m.out,
                        help=f"output folder (default {m.out.replace('{isa}', '<isa>')})")
    ap.add_argument("--report-only", action="store_true", help=f"measure nothing: rewrite <out>/{m.report_file} "
                    f"from its {m.data} and run.json")
    ap.add_argument("--threads", type=int, default=m.threads,
                    help=f"threads (default {m.threads})" if m.threads else "threads (default: torch's own)")
    ap.add_argument("--reps", type=int, default=m.reps, help=m.reps_help)
    return ap


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=SCRIPT, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the metavar lists the subcommands in a missing or unknown one's error too
    sub = ap.add_subparsers(dest="command", required=True, metavar="{" + ",".join(MODES) + "}")
    for name, m in MODES.items():
        m.args(sub.add_parser(name, parents=[common(m)], help=m.help, description=inspect.getdoc(m.measure),
                              formatter_class=argparse.RawDescriptionHelpFormatter))
    return ap


def _main(argv: list[str]) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    m = MODES[args.command]
    if args.report_only:
        if not args.out:
            ap.error(f"{args.command} --report-only rewrites the report of a run folder: name it with --out")
        rebuild_report(Path(args.out), m.data, m.report_file, m.report)
        return 0
    results, fields = m.measure(args)
    if args.out is None:
        from adaptive_spec.backends.cpu.machine import describe

        args.out = m.out.format(isa=describe()["isa"].lower())
    print(write_run(Path(args.out), SCRIPT, args.command, m.data, results, m.report_file, m.report,
                    lambda: {"command": f"python {SCRIPT} {' '.join(argv)}", **fields}, m.indent), end="")
    return 0


def main(argv=None) -> int:
    from adaptive_spec.errors import run_main

    return run_main(_main, sys.argv[1:] if argv is None else list(argv), "rerun the same command")


if __name__ == "__main__":
    sys.exit(main())
