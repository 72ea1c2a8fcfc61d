"""The tables of the decode benchmark runs committed before the decode benchmark became the sweep.

Target alone against fixed K per draft configuration is now a sweep with a `drafts` axis: one harness,
one resume, one report (`make bench`, i.e. `adaptive-spec sweep --config configs/sweep/bench.yaml`, then
`adaptive-spec report --sweep-dir runs/sweep/bench`). What stays here rebuilds the tables of the runs this
script's former measuring path wrote (eval/results/bench_decode_*), from their folders alone:

    python eval/bench_decode.py --report-only --out eval/results/bench_decode_avx2   # no model: table.md again

A former run's command maps onto a sweep config: --drafts none,int8 -> drafts: [none, int8]; --ks 1,2 ->
ks: [1, 2]; one sweep per temperature; --ar-dtypes and --compare-no-fp16 -> one sweep per target setting
(pair.dtype, pair.cpu_fp16_rows), compared with `adaptive-spec report --beside`.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from adaptive_spec.evaluation.forward_costs import draft_label
from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.runs import read_jsonl
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
    ap.add_argument("--out", required=True, help="a committed run's folder (results.jsonl and run.json)")
    ap.add_argument("--report-only", action="store_true",
                    help="load no model: <out>/table.md again from its results.jsonl and run.json")
    args = ap.parse_args(argv)
    if not args.report_only:
        raise SystemExit("error: the decode benchmark is the sweep now: `make bench` (adaptive-spec sweep --config "
                         "configs/sweep/bench.yaml; a `drafts` list runs each draft configuration against one "
                         "target); this script only rebuilds a former run's table: add --report-only")
    out = Path(args.out)
    run = run_header(out, report_only=True)
    (out / "table.md").write_text(report(run_rows(out / "results.jsonl", run), run))
    return 0


def run_rows(res_path: Path, run: dict) -> list[dict]:
    """The rows of the run's settings and grid (its prompts x temperatures x jobs), in file order: rows
    of other drafts or K left in <out> by an earlier run would otherwise make every prompt look incomplete."""
    wanted = {(i, t, c, d) for i in range(run["n_prompts"]) for t in run["temperatures"] for d, c in run["jobs"]}
    return [r for r in read_jsonl(res_path) if r.get("settings") == run["settings"]
            and (r["prompt_idx"], r["temperature"], r["config"], r.get("draft", "none")) in wanted]


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
