"""Benchmark: target-only decoding vs speculative decoding with fixed K, side by side.

For each prompt, every configuration (ar, K = 1..8, at each temperature) runs back to back, so
machine noise hits all of them alike and the speed-up ratios are taken within one run.
Results go to <out>/results.jsonl (one line per prompt x config; a rerun skips what is done),
what the report says beside them (CPU flags, read bandwidth, weight bytes, settings) to <out>/run.json
and the report to <out>/table.md.

    python eval/bench_decode.py --prompts 10 --max-new-tokens 128 --ks 1,2,3,4,5,6,7,8 --temperatures 0,1
    python eval/bench_decode.py --report-only --out eval/results/bench_decode_avx2   # no model: table.md again
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
from pathlib import Path

from adaptive_spec.evaluation.forward_costs import draft_label, parse_draft
from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.runs import append_jsonl, read_jsonl
from adaptive_spec.tables import md_table

NO_FP16 = "@no-fp16"  # suffix of the configurations run on the target without fp16 copies
HEADER = ["temp", "config", "tok/s", "speed-up vs ar", "N_target/N", "N_discarded/N", "accept", "tok/target pass",
          "outside forwards", "n prompts"]


def table(rows: list[dict]) -> str:
    # only prompts that ran every configuration at a temperature, so all rows of a
    # temperature average over the same prompts (an interrupted run leaves some half done)
    configs_at = {}
    for r in rows:
        configs_at.setdefault(r["temperature"], set()).add(r["config"])
    have = {}
    for r in rows:
        have.setdefault((r["temperature"], r["prompt_idx"]), set()).add(r["config"])
    rows = [r for r in rows if have[(r["temperature"], r["prompt_idx"])] == configs_at[r["temperature"]]]
    by = {}
    for r in rows:
        by.setdefault((r["temperature"], r["config"]), []).append(r)
    out = []
    for temp in sorted({t for t, _ in by}):
        ar = {r["prompt_idx"]: r for r in by.get((temp, "ar"), [])}
        for (t, cfg), rs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] != "ar", kv[0][1])):
            if t != temp:
                continue
            tok = sum(r["n_tokens"] for r in rs)
            wall = sum(r["wall_s"] for r in rs)
            # speed-up: per-prompt wall-time ratio against ar on the same prompt, then the mean
            ratios = [ar[r["prompt_idx"]]["wall_s"] / r["wall_s"] * r["n_tokens"] / ar[r["prompt_idx"]]["n_tokens"]
                      for r in rs if r["prompt_idx"] in ar]
            other = sum(r["other_s"] for r in rs) / wall
            acc = [r["acceptance_rate"] for r in rs if r["acceptance_rate"] == r["acceptance_rate"]]
            n_target = sum(r["n_target_forwards"] for r in rs)
            out.append([f"{t:g}", cfg, f"{tok / wall:.2f}", f"{statistics.mean(ratios):.3f}", f"{n_target / tok:.3f}",
                        f"{sum(r['n_discarded'] for r in rs) / tok:.3f}",
                        f"{statistics.mean(acc) if acc else float('nan'):.3f}", f"{tok / n_target:.2f}",
                        f"{100 * other:.1f}%", str(len(rs))])
    return md_table(HEADER, out)


def load_pairs(args) -> dict:
    """One target, shared; one SpecPair per draft configuration (each with its own caches), so
    every configuration runs in this process on the same prompts, back to back."""
    from adaptive_spec import SpecPair
    from adaptive_spec.backends.models import load_model

    base = SpecPair.load(target=args.target, draft=None, dtype=args.dtype, device=args.device,
                         threads=args.threads)
    target_model = base.target.model
    pairs = {"ar": base}
    for dt in filter(None, args.ar_dtypes.split(",")):
        pairs[f"ar-{dt}"] = SpecPair.load(target=args.target, draft=None, dtype=dt, device=args.device)
    drafts = {}
    for spec in args.drafts.split(","):
        quant, vocab = parse_draft(spec)
        drafts[spec] = load_model(args.draft, "draft", args.dtype, args.device, quant=quant, draft_vocab=vocab)
        pair = SpecPair.from_models(target_model, base.tokenizer, *drafts[spec])
        pair.draft_config = {"draft_quant": quant, "draft_vocab": vocab or "full"}
        pairs[spec] = pair
    if args.compare_no_fp16:
        # the same target without the FBGEMM fp16 copies (oneDNN fp32 for every input), as
        # target alone and under every draft configuration, in this run on the same prompts
        old = SpecPair.load(target=args.target, draft=None, dtype=args.dtype, device=args.device, cpu_fp16_rows=0)
        pairs[f"ar{NO_FP16}"] = old
        for spec, (draft_model, dtok) in drafts.items():
            pairs[spec + NO_FP16] = SpecPair.from_models(old.target.model, old.tokenizer, draft_model, dtok)
    return pairs


def linear_gb(pairs: dict) -> dict:
    """GB of linear weights each model streams per step: the target under "ar", each draft
    configuration under its name (eval/bench_cpu_kernels.linear_bytes), in the order they ran."""
    from adaptive_spec.evaluation.forward_costs import linear_bytes

    return {"ar": linear_bytes(pairs["ar"].target.model) / 1e9,
            **{spec: linear_bytes(pair.draft.model) / 1e9 for spec, pair in pairs.items() if not spec.startswith("ar")}}


def draft_costs(rows: list[dict], gb: dict, bw_gbps: float | None) -> str:
    """Per draft configuration: mean seconds per decode forward of draft and target (prefill
    excluded), c = t_draft / t_target, the weight GB each streams per step (`gb`, linear_gb's) and
    the GB/s that makes, against the machine's read bandwidth (the ceiling of a bandwidth-bound
    step). A size or bandwidth the run did not record (an older run.json) leaves its cells out."""
    def speed(nbytes: float | None, t: float) -> list[str]:
        if nbytes is None:
            return ["", ""]
        share = f" ({100 * nbytes / t / bw_gbps:.0f}%)" if bw_gbps else ""
        return [f"{nbytes:.3f}", f"{nbytes / t:.1f}{share}"]

    t_target = _per_forward([r for r in rows if r["config"] == "ar"], "target")
    t_fp16 = t_target
    out = [["target (ar step)", "—", f"{t_target * 1e3:.1f}", "1", *speed(gb.get("ar"), t_target), "—"]]
    for spec in gb:
        if spec.startswith("ar"):
            continue
        rs = [r for r in rows if r.get("draft", "none") == spec and r["config"] != "ar"]
        t_draft = _per_forward(rs, "draft")
        if spec.endswith(NO_FP16) and t_target == t_fp16:  # c against its own target's step
            t_target = _per_forward([r for r in rows if r["config"] == "ar" + NO_FP16], "target")
            out.append([f"target{NO_FP16} (ar step)", "—", f"{t_target * 1e3:.1f}", "1", "", "", "—"])
        acc = [r["acceptance_rate"] for r in rs if r["acceptance_rate"] == r["acceptance_rate"]]
        out.append([draft_label(spec), f"{t_draft * 1e3:.1f}", f"{t_target * 1e3:.1f}", f"{t_draft / t_target:.3f}",
                    *speed(gb[spec], t_draft), f"{statistics.mean(acc):.3f}" if acc else "—"])
    return md_table(["model", "t_draft ms", "t_target ms (ar step)", "c = t_draft/t_target", "linear weights GB",
                     "GB/s (% of read bw)", "acceptance rate"], out)


def greedy_check(rows: list[dict]) -> str:
    """Greedy speculative output must be the target's greedy output token for token; on a real
    model a near-tie can still flip where a K+1-token pass rounds differently from a 1-token step."""
    ar = {r["prompt_idx"]: r.get("output_sha") for r in rows if r["config"] == "ar" and r["temperature"] == 0}
    spec = [r for r in rows if r["temperature"] == 0 and not r["config"].startswith("ar")
            and r["prompt_idx"] in ar and r.get("output_sha")]
    if not spec:
        return ""
    same = sum(r["output_sha"] == ar[r["prompt_idx"]] for r in spec)
    return f"Greedy: speculative output equals the target's own greedy output in {same} of {len(spec)} runs."


def _per_forward(rows: list[dict], role: str) -> float:
    # prefill is one forward of the whole prompt per model: keep it out of the per-step cost
    s = sum(r[f"{role}_s"] for r in rows) - sum(r.get(f"{role}_prefill_s", 0.0) for r in rows)
    n = sum(r[f"n_{role}_forwards"] for r in rows)
    return s / max(n, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="default", help="draft model: hub id, local folder or 'default'")
    ap.add_argument("--target", default="default", help="target model: hub id, local folder or 'default'")
    ap.add_argument("--dataset", default="humaneval",
                    help="alpaca | gsm8k | gsm8k-train | humaneval | sharegpt | path.json(l) | hub id")
    ap.add_argument("--field", default=None, help="text field of a local/hub dataset (default: the set's own)")
    ap.add_argument("--prompts", type=int, default=10, help="number of prompts (shuffled with seed 0)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per run")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="comma-separated fixed K values")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated temperatures (0 = greedy)")
    ap.add_argument("--dtype", default="auto", help="auto (default), bf16, fp16 or fp32")
    ap.add_argument("--drafts", default="none",
                    help="comma-separated draft configurations QUANT[:VOCAB], e.g. none,int8,int8:32768 "
                         "(QUANT none|int8; VOCAB as --draft-vocab), all run side by side")
    ap.add_argument("--top-k", type=int, default=0, help="top-k of the sampling (0 = off; the paper: 50)")
    ap.add_argument("--ar-dtypes", default="",
                    help="extra target-alone baselines in other dtypes, e.g. bf16 (on an AVX2 CPU: bf16 stock "
                         "kernels, the fastest one-token step there), loaded beside the main target")
    ap.add_argument("--compare-no-fp16", action="store_true",
                    help="also run the target without its FBGEMM fp16 copies (ar and every draft), side by side")
    ap.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default="runs/bench_decode", help="folder for results.jsonl and table.md")
    ap.add_argument("--table-only", action="store_true", help="print the table of what <out> holds; run nothing")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing, load no model: <out>/table.md again from its results.jsonl and run.json")
    args = ap.parse_args(argv)

    out = Path(args.out)
    if args.report_only:  # from the folder alone: its rows and run.json
        run = run_header(out, report_only=True)
        (out / "table.md").write_text(report(run_rows(out / "results.jsonl", run), run))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.jsonl"
    settings = {k: getattr(args, k) for k in ("draft", "target", "dataset", "max_new_tokens", "dtype", "top_k")}
    done_rows = [r for r in read_jsonl(res_path, repair=True) if r.get("settings") == settings]
    done = {(r["prompt_idx"], r["temperature"], r["config"], r.get("draft", "none")) for r in done_rows}

    if args.table_only:
        n = len({r["prompt_idx"] for r in done_rows})
        label_configs(done_rows)
        print(f"# Decode benchmark (from {res_path}: {len(done_rows)} runs over {n} prompts)\n\n" + table(done_rows))
        return 0
    from adaptive_spec.prompts import load_prompts

    pairs = load_pairs(args)
    prompts = load_prompts(args.dataset, field=args.field, n=args.prompts)
    jobs = [(a, a) for a in pairs if a.startswith("ar")] + [(c, f"k{k}") for c in pairs if not c.startswith("ar")
                                                              for k in args.ks.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    for spec, pair in pairs.items():  # warm-up: the first forwards pay for allocation and kernel selection
        policy = {"policy": "ar"} if spec.startswith("ar") else {"policy": "fixed", "k": 2}
        pair.generate(prompts[0], max_new_tokens=8, temperature=0, chat=True, **policy)
    todo = [(i, t, d, c) for i in range(len(prompts)) for t in temps for d, c in jobs if (i, t, c, d) not in done]
    run_jobs(todo, pairs, prompts, args, settings, res_path)
    run = run_header(out, report_only=False, measure=lambda: measured(pairs, args, settings, len(prompts), temps, jobs))
    md = report(run_rows(res_path, run), run)
    (out / "table.md").write_text(md)
    print(md, end="")
    return 0


def measured(pairs: dict, args, settings: dict, n_prompts: int, temps: list[float], jobs: list) -> dict:
    """What table.md says beside the rows (paired.run_header keeps it in run.json): the machine, the
    run's settings and grid, the models' weight sizes."""
    import torch

    from adaptive_spec.backends.cpu import flags_line
    from adaptive_spec.evaluation.forward_costs import read_bandwidth_gbps

    return {"script": "eval/bench_decode.py", "report": "table.md", "cpu": flags_line(),
            "read_bw_gbps": read_bandwidth_gbps(), "target_path": str(pairs["ar"].runtime_info().get("target_path")),
            "target": args.target, "draft": args.draft, "drafts": args.drafts, "dtype": args.dtype,
            "device": str(pairs["ar"].target.device), "threads": torch.get_num_threads(), "dataset": args.dataset,
            "max_new_tokens": args.max_new_tokens, "top_k": args.top_k, "settings": settings,
            "n_prompts": n_prompts, "temperatures": temps, "jobs": [list(j) for j in jobs], "linear_gb": linear_gb(pairs)}


def run_rows(res_path: Path, run: dict) -> list[dict]:
    """The rows of the run's settings and grid (its prompts x temperatures x jobs), in file order: rows
    of other drafts or K left in <out> by an earlier run would otherwise make every prompt look incomplete."""
    wanted = {(i, t, c, d) for i in range(run["n_prompts"]) for t in run["temperatures"] for d, c in run["jobs"]}
    return [r for r in read_jsonl(res_path) if r.get("settings") == run["settings"]
            and (r["prompt_idx"], r["temperature"], r["config"], r.get("draft", "none")) in wanted]


def run_jobs(todo, pairs, prompts, args, settings, res_path) -> list[dict]:
    from tqdm import tqdm

    rows = []
    bar = tqdm(todo, desc="bench", unit="run", dynamic_ncols=True)
    for i, temp, spec, cfg in bar:
        kw = {"policy": "ar"} if cfg.startswith("ar") else {"policy": "fixed", "k": int(cfg[1:])}
        pair = pairs[spec]
        g = pair.generate(prompts[i], max_new_tokens=args.max_new_tokens, temperature=temp,
                          top_k=args.top_k, seed=i, chat=True, **kw)
        m = g.metrics
        prefill = {"target_prefill_s": pair.target.prefill_s,
                   "draft_prefill_s": pair.draft.prefill_s if pair.draft is not None else 0.0}
        row = {"settings": settings, "prompt_idx": i, "temperature": temp, "config": cfg,
               "draft": spec if not cfg.startswith("ar") else cfg, **m.to_dict(), **prefill,
               "output_sha": hashlib.sha256(str(g.token_ids).encode()).hexdigest()[:16]}
        if cfg == "ar":  # the target's own responses: eval/bench_draft_vocab.py scores drafts on them
            row["token_ids"], row["prompt_ids"] = g.token_ids, pair.encode(prompts[i], chat=True)
        append_jsonl(res_path, row)
        rows.append(row)
        bar.set_postfix_str(f"{draft_label(spec)} {cfg} t={temp:g} {m.tokens_per_s:.2f} tok/s")
    return rows


def label_configs(rows: list[dict]) -> None:
    """One table keyed by draft configuration and K: "k2" of draft int8 becomes "int8 k2"."""
    for r in rows:
        if not r["config"].startswith("ar") and not r["config"].startswith(draft_label(r.get("draft", "none"))):
            r["config"] = f"{draft_label(r.get('draft', 'none'))} {r['config']}"


def report(rows: list[dict], run: dict) -> str:
    """table.md: the rows (run_rows) with what run.json says of the run (paired.run_header). A line whose
    value an older run.json lacks (CPU flags, read bandwidth, target path, weight sizes) is left out;
    its "note", if any, closes the report."""
    rows = [dict(r) for r in rows]
    label_configs(rows)
    lines = ["# Decode benchmark", ""]
    if "cpu" in run:
        lines += [run["cpu"], ""]
    if "read_bw_gbps" in run:
        lines += [f"read bandwidth: {run['read_bw_gbps']:.1f} GB/s (sum over 1 GiB, best of 5)", ""]
    if "target_path" in run:
        lines += [f"target path: {run['target_path']}", ""]
    lines += [f"{run['target']} (target) / {run['draft']} (draft; configurations {run['drafts']}), dtype {run['dtype']}, "
              f"device {run['device']}, {run['threads']} threads, {run['n_prompts']} prompts from {run['dataset']} "
              f"(chat template), {run['max_new_tokens']} new tokens, top-k {run['top_k'] or 'off'}. "
              f"Written {run['written']}.", "", table(rows), ""]
    greedy = greedy_check(rows)
    if greedy:
        lines += [greedy, ""]
    if "linear_gb" in run:
        lines += [draft_costs(rows, run["linear_gb"], run.get("read_bw_gbps")), ""]
    if run.get("note"):
        lines += [run["note"], ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
