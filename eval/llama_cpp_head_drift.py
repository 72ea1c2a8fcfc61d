"""Does the statistics head carry over to llama.cpp's draft? Its AUC and calibration on the draft
statistics llama.cpp's GGUF draft gives, against those on the torch draft it was trained on.

The head reads only the draft's own distribution (log q(y), H(q), top-1 - top-2), so on llama.cpp
it runs unchanged, but that draft is another quantization of the same model (GGUF Q4_K_M-era
weights, not our int8 copy of their bf16 dequantization), and the target too: q, p and so the
acceptance P = min(1, p(y)/q(y)) shift. Per dev response of a datagen run (teacher-forced on the
target's response X, the `target` prefix of features.PREFIXES): both llama.cpp models score every
position in one pass, y ~ q is drawn with the head's datagen sampling (T = 1, top-k 50 for the
served head), and the head's prediction is scored against P with the metrics training logs
(training.prediction_metrics: binary KL, AUC at P >= 0.99, ECE over 10 bins). The same positions'
stored torch rows (draft_stats, accept_prob) are scored beside them.

    python eval/llama_cpp_head_drift.py --data data/datagen/mix --sequences 48

Writes <out>/metrics.json, <out>/report.md (with a reliability plot) and <out>/run.json (what the report
says beside the metrics: the CPU, the sampling, the command, when; evaluation/paired.run_header).
`--report-only --out DIR` rewrites DIR/report.md from metrics.json and run.json alone (no model, no
data, no torch; the plot is left as it is).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.tables import md_table

HEAD = "checkpoints/qwen-coder-0.5b-int8-stats-d3"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/datagen/mix", help="a datagen folder (its dev split is read)")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--sequences", type=int, default=48, help="responses to score (in shard order)")
    ap.add_argument("--head", default=HEAD)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="eval/results/llama_cpp_head_drift")
    ap.add_argument("--report-only", action="store_true",
                    help="score nothing: report.md from what <out> holds (metrics.json and run.json)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report_only:  # from the folder alone: no model, no data
        doc = json.loads((out / "metrics.json").read_text())
        (out / "report.md").write_text(report(doc, run_header(out, report_only=True)))
        return 0

    import torch
    from tqdm.auto import tqdm

    from adaptive_spec.backends.cpu import flags_line

    from adaptive_spec.datagen.generate import iter_shards
    from adaptive_spec.heads.features import truncated_stats
    from adaptive_spec.heads.head import AcceptanceHead, join_inputs
    from adaptive_spec.decoding.pipeline import SpecPair
    from adaptive_spec.decoding.sampling import process_logits, sample
    from adaptive_spec.training.metrics import plot_reliability, prediction_metrics

    torch.set_num_threads(args.threads)
    head = AcceptanceHead.from_pretrained(args.head).eval()
    if head.inputs != "stats":
        raise SystemExit(f"{args.head} reads inputs={head.inputs}; llama.cpp gives no hidden states")
    params = head.stats_params
    pair = SpecPair.load(backend="llama.cpp", threads=args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    rows = {"llama.cpp": ([], []), "torch (stored datagen rows)": ([], [])}
    expected = {"llama.cpp": [], "torch (stored datagen rows)": []}
    zeros = torch.zeros(head.hidden_size)
    done = 0
    bar = tqdm(total=args.sequences, desc="responses", file=sys.stderr)
    with torch.inference_mode():
        for shard in iter_shards(args.data, args.split):
            offs, resp, plen = shard["input_offsets"], shard["resp_offsets"], shard["prompt_lens"]
            for b in range(len(plen)):
                if done >= args.sequences:
                    break
                prompt = shard["input_ids"][offs[b]: offs[b] + plen[b]].long()
                x = shard["x_ids"][resp[b]: resp[b + 1]].long()
                ids = torch.cat([prompt, x[:-1]])
                scored = []
                for lm in (pair.draft, pair.target):
                    lm.reset()
                    logits, _ = lm.forward(ids, n_logits=len(x))
                    scored.append(process_logits(logits, params))
                q, p = scored
                y = sample(q, gen)
                q_y, p_y = q.gather(-1, y[:, None])[:, 0], p.gather(-1, y[:, None])[:, 0]
                stats = torch.stack([truncated_stats(q[i], y[i], params.top_k) for i in range(len(x))])
                for name, st, target in (("llama.cpp", stats, (p_y / q_y).clamp(max=1.0)),
                                         ("torch (stored datagen rows)", shard["draft_stats"][resp[b]: resp[b + 1]],
                                          shard["accept_prob"][resp[b]: resp[b + 1]])):
                    rows[name][0].append(head(join_inputs(zeros.expand(len(x), -1), st)).view(-1).float())
                    rows[name][1].append(target.float())
                expected["llama.cpp"].append(torch.minimum(p, q).sum(-1))
                expected["torch (stored datagen rows)"].append(shard["expected_accept"][resp[b]: resp[b + 1]])
                done += 1
                bar.update(1)
            if done >= args.sequences:
                break
    bar.close()
    out.mkdir(parents=True, exist_ok=True)
    metrics, curves = {}, {}
    for name, (logits, targets) in rows.items():
        m, bins = prediction_metrics(torch.cat(logits), torch.cat(targets))
        m["mean_expected_accept"] = torch.cat(expected[name]).double().mean().item()
        metrics[name], curves[name] = m, bins
    plot_reliability(curves, out / "reliability.png", title="torch vs llama.cpp draft statistics")
    doc = {"head": args.head, "data": args.data, "split": args.split, "sequences": done, "sampling": vars(params),
           "metrics": metrics}
    (out / "metrics.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    header = run_header(out, report_only=False, measure=lambda: {
        "script": "eval/llama_cpp_head_drift.py", "cpu": flags_line(), "sampling": str(params),
        "command": f"python eval/llama_cpp_head_drift.py --data {args.data} --sequences {args.sequences}"})
    md = report(json.loads((out / "metrics.json").read_text()), header)
    (out / "report.md").write_text(md)
    print(md, end="")
    return 0


def report(doc: dict, header: dict) -> str:
    """report.md: metrics.json (`doc`), with what run.json says of the run (paired.run_header): the CPU
    line, the sampling, the command and when it ran."""
    table = [[name, str(m["n"]), f"{m['mean_target']:.3f}", f"{m['mean_pred']:.3f}", f"{m['mean_expected_accept']:.3f}",
              f"{m['kl']:.4f}", f"{m['auc']:.3f}", f"{m['ece']:.4f}"] for name, m in doc["metrics"].items()]
    return "\n".join([f"# The statistics head on llama.cpp's draft: {Path(doc['head']).name}", "", header["cpu"], "",
                      f"{doc['sequences']} {doc['split']} responses of {doc['data']}, teacher-forced on the target's "
                      f"response; y ~ q with {header['sampling']}; the same positions' stored torch rows beside.", "",
                      md_table(["draft statistics from", "positions", "mean P", "mean predicted", "mean E[accept]",
                                "KL", "AUC", "ECE"], table), "", "![reliability](reliability.png)", "",
                      f"Written {header['written']} by `{header['command']}`."]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
