"""Benchmark: what a target pass costs per number of tokens, at a short and a realistic context,
and what a stats head's per-step statistics cost (the extended time model).

The `table` time model (adaptive_spec/decoding/timemodel.py) prices each verification pass of K + 1 tokens
at its measured time. This prints that time per length n (and the draft's one-token step) after
a --short (costs.py's PREFIX) and a --long cached context, so one can see (a) the step shape of
t_verify(n) on this CPU and (b) how far times at load, taken after a short prefix, are from the
contexts a sweep decodes at. Also the draft's pass over n rows (--draft-lengths): a tree drafts a
wave of sibling nodes in one draft pass, so this is what a tree's width costs. Then
the per-draft-step cost of a stats head's inputs on the real vocabulary: the full pass
(process_logits + draft_stats) against the decoder's path (its own q reused, a top-k q read
through one partial sort: features.truncated_stats).

    python eval/bench_verify_lengths.py [--draft-quant int8] [--lengths 1-12] [--short 32 --long 256]

The times go to <out>/results.json (with the CPU's flags line, the models' kernels and the arguments),
the vocabulary size the stats line names to <out>/run.json (evaluation/paired.run_header), the table to
<out>/table.md; `--report-only --out <out>` measures nothing and loads no model: it rewrites table.md from
those two files alone, on any machine.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.runs import write_json
from adaptive_spec.tables import md_table


def lengths(spec: str) -> list[int]:
    a, _, b = spec.partition("-")
    return list(range(int(a), int(b or a) + 1))


def per_step_ms(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - t0) / reps


def report(results: dict, run: dict) -> str:
    """table.md of results.json (`results`: the times, the CPU's flags line, the kernels, the draft's
    configuration) with what run.json (`run`) says of the run (the vocabulary size); the same text whether just
    measured or rebuilt by --report-only."""
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-quant", default="int8", help="the draft's weights: none, int8, int4")
    ap.add_argument("--lengths", default="1-12", help="target pass lengths n, e.g. 1-12")
    ap.add_argument("--draft-lengths", default="1-8", help="draft pass widths (rows in one wave), e.g. 1-8")
    ap.add_argument("--short", type=int, default=32, help="short cached context (costs.py's PREFIX)")
    ap.add_argument("--long", type=int, default=256, help="realistic cached context (prompt + half a response)")
    ap.add_argument("--reps", type=int, default=5, help="timed passes per cell (median; 3 warm-ups first)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="eval/results/bench_verify_lengths")
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing: rewrite <out>/table.md from its results.json and run.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        (out / "table.md").write_text(report(json.loads((out / "results.json").read_text()),
                                             run_header(out, report_only=True)))
        return 0
    import torch
    from adaptive_spec.evaluation.forward_costs import time_forward

    from adaptive_spec.backends.cpu import flags_line
    from adaptive_spec.decoding.pipeline import SpecPair
    from adaptive_spec.decoding.sampling import SamplingParams, process_logits, sample
    from adaptive_spec.heads.features import draft_stats, step_stats

    pair = SpecPair.load(threads=args.threads, draft_quant=args.draft_quant)
    ns, widths = lengths(args.lengths), lengths(args.draft_lengths)
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
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", {"cpu": flags_line(), "paths": paths, "draft_config": pair.draft_config,
                                      "draft_s": {str(c): t for c, t in draft.items()},
                                      "draft_rows_s": {str(c): {str(n): t for n, t in v.items()} for c, v in wide.items()},
                                      "target_s": {str(c): {str(n): t for n, t in v.items()} for c, v in target.items()},
                                      "stats_ms": {"full": old, "decoder": new}, "args": vars(args)})
    header = run_header(out, report_only=False, measure=lambda: {
        "script": f"eval/{Path(__file__).name}", "report": "table.md", "vocab": logits.shape[-1]})
    md = report(json.loads((out / "results.json").read_text()), header)  # as --report-only reads it back
    print(md)
    (out / "table.md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
