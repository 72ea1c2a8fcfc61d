"""Benchmark: datagen throughput (response tokens/s) across compute dtype, batch size and threads.

Every cell runs datagen's own shard path (datagen.generate_shard: length-sorted batches, lockstep
target + draft steps, draft_stats, the features pass) over the same prompts, the first --prompts
of the config's train split, and counts response tokens (cut at EOS) per wall second: the number
datagen's progress line shows (19.7 tok/s before the batched datagen). The draft configuration, sampling
settings and max_new_tokens come from the datagen config. Each dtype loads the pair once; "auto"
is resolved first and shares its row with the dtype it names. Rows go to <out>/results.jsonl (a
rerun skips the cells done), what the report says beside them (CPU flags, the config's settings,
the grid) to <out>/run.json, the table, fastest first, to <out>/table.md.

    python eval/bench_datagen.py --config configs/datagen/mix.yaml --dtypes auto,fp32,bf16 --batch-sizes 4,8,16,32 --threads 1,2
    python eval/bench_datagen.py --report-only --out eval/results/bench_datagen_avx2   # no model: table.md again
"""
from __future__ import annotations

import argparse
import gc
import time

from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.runs import append_jsonl, project_path, read_jsonl
from adaptive_spec.tables import md_table

BEFORE_TOK_S = 19.7  # datagen before batching, on an AVX-512 CPU in bf16 (GSM8K, 64 new tokens, batch 32, 2 threads)


def dtype_names(names: list[str]) -> dict[str, str]:
    """Concrete dtype name -> the label its row gets ("fp32 (= auto)" when auto resolves to it)."""
    import torch

    from adaptive_spec.backends.models import resolve_dtype

    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    out: dict[str, str] = {}
    for n in names:
        concrete = short[resolve_dtype(n, "cpu")]
        out.setdefault(concrete, concrete)
        if n == "auto":
            out[concrete] = f"{concrete} (= auto)"
    return out


def run_cell(pair, cfg, prompts: list[list[int]], batch_size: int, threads: int) -> dict:
    import torch

    from adaptive_spec.datagen import generate as datagen

    draft, target, tok, vocab = pair
    eos_ids, pad_id = datagen.eos_and_pad(tok, target)
    cell = cfg.model_copy(update={"batch_size": batch_size})
    torch.set_num_threads(threads)
    # warm-up at this thread count and batch shape: first calls pay for allocation and kernel choice
    warm = cell.model_copy(update={"max_new_tokens": 2})
    datagen.generate_shard(draft, target, prompts[:batch_size], warm, vocab, eos_ids, pad_id,
                           datagen.shard_generator(cfg.seed, "warm-up", 0, "cpu"), lambda b: None)
    lengths: list[int] = []
    t0 = time.perf_counter()
    datagen.generate_shard(draft, target, prompts, cell, vocab, eos_ids, pad_id,
                           datagen.shard_generator(cfg.seed, "bench", 0, "cpu"),
                           lambda batch: lengths.extend(len(q["z"]) for q in batch))
    wall = time.perf_counter() - t0
    return {"n_prompts": len(prompts), "tokens": sum(lengths), "wall_s": wall, "tok_s": sum(lengths) / wall}


def table(rows: list[dict]) -> str:
    rows = sorted(rows, key=lambda r: -r["tok_s"])
    return md_table(["dtype", "batch size", "threads", "tok/s", f"vs {BEFORE_TOK_S} tok/s", "tokens", "wall s"],
                    [[r["label"], r["batch_size"], r["threads"], f"{r['tok_s']:.2f}",
                      f"{r['tok_s'] / BEFORE_TOK_S:.2f}x", r["tokens"], f"{r['wall_s']:.0f}"] for r in rows])


def report(rows: list[dict], run: dict) -> str:
    """table.md: the rows of the run's grid with what run.json says of the run (paired.run_header);
    its "note", if any, closes the report."""
    md = (f"# Datagen throughput\n\n{run['cpu']}\n\n"
          f"Config {run['config']} (draft_quant {run['draft_quant']}, draft_vocab {run['draft_vocab'] or 'full'}, "
          f"max_new_tokens {run['max_new_tokens']}, features {run['features']}); {run['prompts']} train prompts per "
          f"cell (at least one batch). Written {run['written']}.\n\n" + table(rows) + "\n")
    return md + (f"\n{run['note']}\n" if run.get("note") else "")


def run_rows(results, run: dict) -> list[dict]:
    """The rows of the run's grid (dtype, batch size, threads) and settings (config hash, prompts asked)."""
    grid = {tuple(g) for g in run["grid"]}
    return [r for r in read_jsonl(results) if (r["dtype"], r["batch_size"], r["threads"]) in grid
            and all(r.get(k) == v for k, v in run["setting"].items())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/datagen/mix.yaml", help="datagen config: prompts, draft, sampling")
    ap.add_argument("--dtypes", default="auto,fp32,bf16", help="compute dtypes of both models")
    ap.add_argument("--batch-sizes", default="4,8,16,32")
    ap.add_argument("--threads", default="1,2", help="torch CPU threads")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per cell (at least one batch)")
    ap.add_argument("--out", default="runs/bench_datagen", help="folder for results.jsonl and table.md")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing, load no model: <out>/table.md again from its results.jsonl and run.json")
    args = ap.parse_args(argv)
    out = project_path(args.out)
    results = out / "results.jsonl"
    if args.report_only:  # from the folder alone: its rows and run.json
        run = run_header(out, report_only=True)
        (out / "table.md").write_text(report(run_rows(results, run), run))
        return 0
    import torch

    from adaptive_spec.backends.cpu.machine import flags_line
    from adaptive_spec.config import load_config
    from adaptive_spec.datagen import generate as datagen
    from adaptive_spec.datagen.config import DatagenConfig, config_hash

    cfg = load_config(DatagenConfig, project_path(args.config))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    out.mkdir(parents=True, exist_ok=True)
    # a row is only reused for the same prompts and settings: a changed config gives new rows
    setting = {"config_hash": config_hash(cfg), "n_prompts_asked": args.prompts}
    grid = []
    for concrete, label in dtype_names(args.dtypes.split(",")).items():
        done = {(r["batch_size"], r["threads"]) for r in read_jsonl(results, repair=True)
                if r["dtype"] == concrete and all(r.get(k) == v for k, v in setting.items())}
        todo = [(b, t) for b in batch_sizes for t in threads if (b, t) not in done]
        grid += [(concrete, b, t) for b in batch_sizes for t in threads]
        if not todo:
            continue
        as_dtype = cfg.model_copy(update={"pair": cfg.pair.model_copy(update={"dtype": concrete})})
        pair = datagen.load_models(as_dtype, torch.device("cpu"))
        train = [e for _, e in datagen.plan_splits(cfg, pair[2])["train"]]
        for b, t in todo:
            prompts = train[:max(args.prompts, b)]
            row = {"dtype": concrete, "label": label, "batch_size": b, "threads": t, **setting,
                   **run_cell(pair, cfg, prompts, b, t)}
            append_jsonl(results, row)
            print(f"{label} batch {b} threads {t}: {row['tok_s']:.2f} tok/s ({row['tokens']} tokens)", flush=True)
        del pair
        gc.collect()
    run = run_header(out, report_only=False, measure=lambda: {
        "script": "eval/bench_datagen.py", "report": "table.md", "cpu": flags_line(), "config": args.config,
        "draft_quant": cfg.pair.draft_quant, "draft_vocab": cfg.pair.draft_vocab, "max_new_tokens": cfg.max_new_tokens,
        "features": cfg.store_features, "prompts": args.prompts, "setting": setting, "grid": [list(g) for g in grid]})
    md = report(run_rows(results, run), run)
    (out / "table.md").write_text(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
