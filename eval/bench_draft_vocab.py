"""Benchmark: what a cheaper draft costs in acceptance and saves in time, per draft configuration.

Acceptance is measured exactly, without decoding: over the target's own responses (the `ar`
rows of a bench_decode run, which store prompt and output ids), one teacher-forced forward of
the target and of each draft give p_i and q_i at every response position, and the expected
acceptance of a drafted token there is 1 - TV(p_i, q_i) (sum of min(p, q)), under the same
sampling settings (temperature, top-k) as the decode benchmark. Time is one draft decode step
(1 token after a 64-token cache, median of --reps), so the table reads: acceptance lost
against step time saved, for the unquantized draft, int8, and int8 with V' kept tokens.

    python eval/bench_draft_vocab.py --from runs/bench_decode/results.jsonl --drafts none,int8,int8:8192,int8:16384,int8:32768,int8:65536
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from adaptive_spec.backends.cpu import flags_line
from adaptive_spec.backends.models import CausalLM, load_model
from adaptive_spec.runs import read_jsonl
from adaptive_spec.decoding.sampling import SamplingParams, process_logits
from adaptive_spec.tables import md_table
from bench_cpu_kernels import linear_bytes, time_forward
from bench_decode import draft_label, parse_draft


def processed(lm: CausalLM, ids: list[int], n_resp: int, params: SamplingParams) -> torch.Tensor:
    """The processed next-token distributions at the n_resp response positions [n_resp, V]."""
    lm.reset()
    logits, _ = lm.forward(torch.tensor(ids[:-1]), n_logits=n_resp)
    return process_logits(logits, params)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", required=True, help="bench_decode results.jsonl with ar rows (token_ids)")
    ap.add_argument("--drafts", default="none,int8,int8:8192,int8:16384,int8:32768,int8:65536",
                    help="draft configurations QUANT[:VOCAB]")
    ap.add_argument("--dtype", default="auto", help="dtype of both models (auto: fp32 on AVX2-only CPUs)")
    ap.add_argument("--reps", type=int, default=9, help="timed draft steps per configuration")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--out", default="eval/results/bench_draft_vocab", help="folder for results.json and table.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = [r for r in read_jsonl(Path(args.src)) if r.get("config") == "ar" and r.get("token_ids")]
    if not runs:
        raise SystemExit(f"{args.src} has no ar rows with token_ids; run eval/bench_decode.py first")
    target = CausalLM(load_model(None, "target", args.dtype, "cpu")[0])
    seqs = [(r["prompt_ids"] + r["token_ids"], len(r["token_ids"]),
             SamplingParams(r["temperature"], r["settings"].get("top_k", 0))) for r in runs]
    with torch.inference_mode():
        ps = [processed(target, ids, n, sp) for ids, n, sp in seqs]
    del target
    rows = []
    for spec in args.drafts.split(","):
        quant, vocab = parse_draft(spec)
        draft = CausalLM(load_model(None, "draft", args.dtype, "cpu", quant=quant, draft_vocab=vocab)[0])
        with torch.inference_mode():
            alpha = torch.cat([torch.minimum(p, processed(draft, ids, n, sp)).sum(-1)
                               for p, (ids, n, sp) in zip(ps, seqs)])
            step, _ = time_forward(draft, torch.arange(200, 264) % draft.vocab_size, 1, args.reps)
        rows.append({"draft": spec, "alpha": alpha.mean().item(), "n_positions": alpha.numel(),
                     "step_ms": step * 1e3, "linear_GB": linear_bytes(draft.model) / 1e9})
        print(rows[-1], flush=True)
    base = rows[0]
    table = [[draft_label(r["draft"]), f"{r['alpha']:.4f}", f"{100 * (r['alpha'] - base['alpha']):+.2f}",
              f"{r['step_ms']:.1f}", f"{r['step_ms'] / base['step_ms']:.2f}x", f"{r['linear_GB']:.3f}"] for r in rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    md = (f"# Draft configurations: expected acceptance vs draft step time\n\n{flags_line()}\n\n"
          f"{len(runs)} target responses from {args.src} ({sum(n for _, n, _ in seqs)} positions), "
          f"sampling as there (T {runs[0]['temperature']:g}, top-k {runs[0]['settings'].get('top_k', 0)}), "
          f"dtype {args.dtype}. Written {time.strftime('%Y-%m-%d %H:%M')}.\n\n"
          + md_table(["draft", "E[accept] = 1 - TV(p, q)", "vs first row, points", "draft step ms",
                      "step vs first row", "draft linear GB"], table))
    (out / "table.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
