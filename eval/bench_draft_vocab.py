"""Benchmark: what a cheaper draft costs in acceptance and saves in time, per draft configuration.

Acceptance is measured exactly, without decoding: over the target's own responses (the `ar`
rows of a sweep, which store prompt and output ids: `make bench` writes runs/sweep/bench), one teacher-forced forward of
the target and of each draft give p_i and q_i at every response position, and the expected
acceptance of a drafted token there is 1 - TV(p_i, q_i) (sum of min(p, q)), under the same
sampling settings (temperature, top-k) as the decode benchmark. Time is one draft decode step
(1 token after a 64-token cache, median of --reps), so the table reads: acceptance lost
against step time saved, for the unquantized draft, int8, and int8 with V' kept tokens.
Rows go to <out>/results.json, what the report says beside them (CPU flags, the responses' source
and sampling) to <out>/run.json, the table to <out>/table.md.

    python eval/bench_draft_vocab.py --from runs/sweep/bench/results.jsonl --drafts none,int8,int8:8192,int8:16384,int8:32768,int8:65536
    python eval/bench_draft_vocab.py --report-only --out eval/results/bench_draft_vocab_avx2   # no model: table.md again
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from adaptive_spec.backends.paths import split_draft_config
from adaptive_spec.evaluation.forward_costs import draft_label
from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.runs import read_jsonl
from adaptive_spec.tables import md_table


def processed(lm, ids: list[int], n_resp: int, params):
    """The processed next-token distributions at the n_resp response positions [n_resp, V]."""
    import torch

    from adaptive_spec.decoding.sampling import process_logits

    lm.reset()
    logits, _ = lm.forward(torch.tensor(ids[:-1]), n_logits=n_resp)
    return process_logits(logits, params)


def measure(args) -> tuple[list[dict], dict]:
    """(one row per draft configuration, what the report says beside them)."""
    import torch

    from adaptive_spec.backends.cpu.machine import flags_line
    from adaptive_spec.backends.models import load_model
    from adaptive_spec.backends.runner import CausalLM
    from adaptive_spec.decoding.sampling import SamplingParams
    from adaptive_spec.evaluation.forward_costs import linear_bytes, time_forward

    torch.set_num_threads(args.threads)
    runs = [{**r, **sampling_of(r, Path(args.src))} for r in read_jsonl(Path(args.src))
            if r.get("config") == "ar" and r.get("token_ids")]
    if not runs:
        raise SystemExit(f"error: {args.src} has no ar rows with token_ids; run a sweep with include_ar first "
                         "(`make bench` writes runs/sweep/bench/results.jsonl)")
    target = CausalLM(load_model(None, "target", args.dtype, "cpu")[0])
    seqs = [(r["prompt_ids"] + r["token_ids"], len(r["token_ids"]), SamplingParams(r["temperature"], r["top_k"]))
            for r in runs]
    with torch.inference_mode():
        ps = [processed(target, ids, n, sp) for ids, n, sp in seqs]
    del target
    rows = []
    for spec in args.drafts.split(","):
        quant, vocab = split_draft_config(spec)
        draft = CausalLM(load_model(None, "draft", args.dtype, "cpu", quant=quant, draft_vocab=vocab)[0])
        with torch.inference_mode():
            alpha = torch.cat([torch.minimum(p, processed(draft, ids, n, sp)).sum(-1)
                               for p, (ids, n, sp) in zip(ps, seqs)])
            step, _ = time_forward(draft, torch.arange(200, 264) % draft.vocab_size, 1, args.reps)
        rows.append({"draft": spec, "alpha": alpha.mean().item(), "n_positions": alpha.numel(),
                     "step_ms": step * 1e3, "linear_GB": linear_bytes(draft.model) / 1e9})
        print(rows[-1], flush=True)
    return rows, {"script": "eval/bench_draft_vocab.py", "report": "table.md", "cpu": flags_line(), "from": args.src,
                  "n_responses": len(runs), "n_positions": sum(n for _, n, _ in seqs),
                  "temperature": runs[0]["temperature"], "top_k": runs[0]["top_k"],
                  "dtype": args.dtype}


def sampling_of(row: dict, src: Path) -> dict:
    """The sampling a response was drawn with: a sweep's settings.json beside its rows, or (a run of the
    former bench_decode harness) the row's own temperature and settings."""
    if "settings" in row:
        return {"temperature": row["temperature"], "top_k": row["settings"].get("top_k", 0)}
    s = json.loads((src.parent / "settings.json").read_text())["settings"]
    return {"temperature": s["temperature"], "top_k": s["top_k"]}


def report(rows: list[dict], run: dict) -> str:
    """table.md: the rows (results.json) with what run.json says of the run (paired.run_header)."""
    label = draft_label
    base = rows[0]
    table = [[label(r["draft"]), f"{r['alpha']:.4f}", f"{100 * (r['alpha'] - base['alpha']):+.2f}",
              f"{r['step_ms']:.1f}", f"{r['step_ms'] / base['step_ms']:.2f}x", f"{r['linear_GB']:.3f}"] for r in rows]
    return (f"# Draft configurations: expected acceptance vs draft step time\n\n{run['cpu']}\n\n"
            f"{run['n_responses']} target responses from {run['from']} ({run['n_positions']} positions), "
            f"sampling as there (T {run['temperature']:g}, top-k {run['top_k']}), "
            f"dtype {run['dtype']}. Written {run['written']}.\n\n"
            + md_table(["draft", "E[accept] = 1 - TV(p, q)", "vs first row, points", "draft step ms",
                        "step vs first row", "draft linear GB"], table) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", help="a sweep's results.jsonl with ar rows (token_ids); required "
                                               "unless --report-only")
    ap.add_argument("--drafts", default="none,int8,int8:8192,int8:16384,int8:32768,int8:65536",
                    help="draft configurations QUANT[:VOCAB]")
    ap.add_argument("--dtype", default="auto", help="dtype of both models (auto: fp32 on AVX2-only CPUs)")
    ap.add_argument("--reps", type=int, default=9, help="timed draft steps per configuration")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--out", default="eval/results/bench_draft_vocab", help="folder for results.json and table.md")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing, load no model: <out>/table.md again from its results.json and run.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report_only:  # from the folder alone: its rows and run.json
        run = run_header(out, report_only=True)
        (out / "table.md").write_text(report(json.loads((out / "results.json").read_text()), run))
        return 0
    if not args.src:
        ap.error("--from is required (unless --report-only)")
    rows, header = measure(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    md = report(rows, run_header(out, report_only=False, measure=lambda: header))
    (out / "table.md").write_text(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
