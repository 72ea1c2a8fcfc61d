"""Benchmark: target-only decoding vs speculative decoding with fixed K, side by side.

For each prompt, every configuration (ar, K = 1..8, at each temperature) runs back to back, so
machine noise hits all of them alike and the speed-up ratios are taken within one run.
Results go to <out>/results.jsonl (one line per prompt x config; a rerun skips what is done)
and a markdown table to <out>/table.md.

    python eval/bench_decode.py --prompts 10 --max-new-tokens 128 --ks 1,2,3,4,5,6,7,8 --temperatures 0,1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from adaptive_spec import SpecPair
from adaptive_spec.prompts import load_prompts


def append_jsonl(path: Path, row: dict):
    # one line per write, flushed and fsynced: an interrupted run loses at most the line in flight
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


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
    out = ["| temp | config | tok/s | speed-up vs ar | N_target/N | N_discarded/N | accept | tok/target pass | "
           "outside forwards | n prompts |", "|---|---|---|---|---|---|---|---|---|---|"]
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
            out.append(
                f"| {t:g} | {cfg} | {tok / wall:.2f} | {statistics.mean(ratios):.3f} | "
                f"{sum(r['n_target_forwards'] for r in rs) / tok:.3f} | {sum(r['n_discarded'] for r in rs) / tok:.3f} | "
                f"{statistics.mean(acc) if acc else float('nan'):.3f} | "
                f"{tok / sum(r['n_target_forwards'] for r in rs):.2f} | {100 * other:.1f}% | {len(rs)} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--target", default="default")
    ap.add_argument("--dataset", default="alpaca",
                    help="alpaca | gsm8k | gsm8k-train | humaneval | sharegpt | path.json(l) | hub id")
    ap.add_argument("--field", default=None)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="runs/bench_decode")
    ap.add_argument("--table-only", action="store_true", help="print the table of what <out> holds; run nothing")
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.jsonl"
    settings = {k: getattr(args, k) for k in ("draft", "target", "dataset", "max_new_tokens", "dtype")}
    done_rows = [json.loads(line) for line in res_path.read_text().splitlines()] if res_path.exists() else []
    done_rows = [r for r in done_rows if r.get("settings") == settings]
    done = {(r["prompt_idx"], r["temperature"], r["config"]) for r in done_rows}

    if args.table_only:
        n = len({r["prompt_idx"] for r in done_rows})
        print(f"# Decode benchmark (from {res_path}: {len(done_rows)} runs over {n} prompts)\n\n" + table(done_rows))
        return
    pair = SpecPair.load(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device,
                         num_threads=args.threads)
    prompts = load_prompts(args.dataset, field=args.field, n=args.prompts)
    configs = ["ar"] + [f"k{k}" for k in args.ks.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    # warm-up: the first forwards pay for allocation and kernel selection
    pair.generate(prompts[0], policy="fixed", k=2, max_new_tokens=8, temperature=0, chat=True)
    pair.generate(prompts[0], policy="ar", max_new_tokens=8, temperature=0, chat=True)

    todo = [(i, t, c) for i in range(len(prompts)) for t in temps for c in configs if (i, t, c) not in done]
    bar = tqdm(todo, desc="bench", unit="run", dynamic_ncols=True)
    rows = list(done_rows)
    for i, temp, cfg in bar:
        kw = {"policy": "ar"} if cfg == "ar" else {"policy": "fixed", "k": int(cfg[1:])}
        g = pair.generate(prompts[i], max_new_tokens=args.max_new_tokens, temperature=temp,
                          top_k=0, seed=i, chat=True, **kw)
        m = g.metrics
        row = {"settings": settings, "prompt_idx": i, "temperature": temp, "config": cfg, **m.to_dict()}
        append_jsonl(res_path, row)
        rows.append(row)
        bar.set_postfix_str(f"{cfg} t={temp:g} {m.tokens_per_s:.2f} tok/s")
    md = table(rows)
    hdr = (f"# Decode benchmark\n\n{args.target} (target) / {args.draft} (draft), {args.dtype}, "
           f"device {pair.target.device}, {torch.get_num_threads()} threads, {len(prompts)} prompts from "
           f"{args.dataset} (chat template), {args.max_new_tokens} new tokens, top-k off. "
           f"Written {time.strftime('%Y-%m-%d %H:%M')}.\n\n")
    (out / "table.md").write_text(hdr + md + "\n")
    print(hdr + md)


if __name__ == "__main__":
    main()
