"""Soak the llama.cpp backend: many generations back to back in one process, checking that nothing
leaks and every cache rolls back exactly.

Generations cycle through the policies that run on llama.cpp (ar, fixed K, SpecDec++ with the
statistics head, confidence, entropy, heuristic; the oracle where greedy), T = 1 top-k 50 and
greedy, on prompts of 10 to ~1,000 tokens (ShareGPT-free: HumanEval texts repeated to length) in a
context small enough that the longest hit its limit. After each one the process's resident
memory is read; every `--repeat-every`-th generation repeats an earlier one with its seed, and
its tokens must be the same (a cache not rolled back exactly would change them).

    python eval/soak_llama_cpp.py --n 300 --max-new-tokens 24 --n-ctx 1024

Writes <out>/soak.jsonl (one row per generation), <out>/report.md and <out>/run.json (what the report
says beside the rows: the CPU, the settings, the wall time, the command, when; evaluation/paired.run_header);
exits 1 if a check failed. `--report-only --out DIR` rewrites DIR/report.md from those alone (no model):
the checks are recomputed from the rows.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from pathlib import Path

from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.runs import read_jsonl

HEAD = "checkpoints/qwen-coder-0.5b-int8-stats-d3"
POLICIES = [("ar", {}), ("fixed", {"k": 3}), ("learned", {"head": HEAD, "threshold": 0.3}),
            ("confidence", {"threshold": 0.4}), ("entropy", {"threshold": 1.5}), ("heuristic", {}),
            ("oracle", {})]


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat-every", type=int, default=10)
    ap.add_argument("--out", default="eval/results/soak_llama_cpp")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: report.md from what <out> holds (soak.jsonl and run.json)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report_only:  # from the folder alone: no model
        header = run_header(out, report_only=True)
        rows = read_jsonl(out / "soak.jsonl")
        if not rows:
            print(f"{out / 'soak.jsonl'} holds no generations", file=sys.stderr)
            return 1
        (out / "report.md").write_text(report(rows, header))
        return 1 if checks(rows)[3] else 0

    import torch

    from adaptive_spec.backends.cpu.machine import flags_line
    from adaptive_spec.decoding.pipeline import SpecPair
    from adaptive_spec.prompts import load_prompts

    torch.set_num_threads(args.threads)
    pair = SpecPair.load(backend="llama.cpp", threads=args.threads, n_ctx=args.n_ctx)
    pool = [pair.encode(t) for t in load_prompts("humaneval")]
    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "soak.jsonl", "w")
    rows, history = [], []
    t_start = time.perf_counter()
    # Ctrl-C or kill: stop, and report the generations done (the report says how many of --n)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        _soak(args, pair, pool, rng, log, rows, history)
    except KeyboardInterrupt:
        print(f"stopped after {len(rows)} of {args.n} generations", file=sys.stderr)
    if not rows:
        return 1
    wall_s = time.perf_counter() - t_start
    header = run_header(out, report_only=False, measure=lambda: {
        "script": "eval/soak_llama_cpp.py", "cpu": flags_line(), "n": args.n, "n_ctx": args.n_ctx,
        "policies": [p for p, _ in POLICIES], "wall_s": wall_s,
        "command": f"python eval/soak_llama_cpp.py --n {args.n} --max-new-tokens {args.max_new_tokens} "
                   f"--n-ctx {args.n_ctx}"})
    md = report(rows, header)
    (out / "report.md").write_text(md)
    print(md, end="")
    return 1 if checks(rows)[3] else 0


def checks(rows: list[dict]) -> tuple[float, float, float, list[str]]:
    """(resident MiB after 20 generations, the peak after that, its growth, the failures): a repeat that
    gave other tokens, memory that grew 5% or more after the first 20 generations."""
    failures = [f"generation {r['i']} repeated seed {r['seed']} ({r['policy']}) and got other tokens"
                for r in rows if r["repeat"] and not r["same_tokens"]]
    base = rows[min(19, len(rows) - 1)]["rss_mib"]
    peak = max(r["rss_mib"] for r in rows[20:]) if len(rows) > 20 else base
    growth = peak / base - 1
    if growth >= 0.05:
        failures.append(f"resident memory grew {100 * growth:.1f}% after the first 20 generations")
    return base, peak, growth, failures


def report(rows: list[dict], header: dict) -> str:
    """report.md: the checks on soak.jsonl's rows, with what run.json says of the run (paired.run_header):
    the CPU line, --n, n_ctx, the policies, the wall time, the command and when it ran; a note added to
    run.json by hand (what else ran beside it, on which code) follows the command."""
    base, peak, growth, failures = checks(rows)
    repeats = [r for r in rows if r["repeat"]]
    return "\n".join([
        f"# llama.cpp backend soak: {len(rows)} generations in one process"
        + ("" if len(rows) == header["n"] else f" (stopped early: {len(rows)} of --n {header['n']})"), "",
        header["cpu"], "",
        f"- policies: {', '.join(header['policies'])}; T = 1 top-k 50 and greedy; prompts "
        f"{min(r['prompt_tokens'] for r in rows)}..{max(r['prompt_tokens'] for r in rows)} tokens; "
        f"n_ctx {header['n_ctx']}; {sum(r['hit_context'] for r in rows)} generations capped by the context limit",
        f"- resident memory: {rows[0]['rss_mib']:.0f} MiB after the first, {base:.0f} MiB after 20, peak {peak:.0f} MiB "
        f"after that: growth {100 * growth:+.2f}% (goal < 5%)",
        f"- repeats with the same seed: {sum(r['same_tokens'] for r in repeats)} of {len(repeats)} gave the same tokens",
        f"- wall time {header['wall_s']:.0f} s",
        f"- failures: {'; '.join(failures) if failures else 'none'}", "",
        f"Written {header['written']} by `{header['command']}`"
        + (f", {header['note']}" if header.get("note") else "") + "."]) + "\n"


def _soak(args, pair, pool, rng, log, rows, history) -> None:
    """The generations, appended to `rows` (and `log`) as they finish."""
    for i in range(args.n):
        if i and i % args.repeat_every == 0:
            job = dict(rng.choice(history), repeat=True)
        else:
            # log-uniform lengths 10..1000 tokens; one in ten fills the context to its limit
            n_tok = args.n_ctx - 4 if i % 10 == 5 else int(10 * 100 ** rng.random())
            ids = []
            while len(ids) < n_tok:
                ids += rng.choice(pool)
            name, kw = POLICIES[i % len(POLICIES)]
            temp = 0.0 if name == "oracle" or i % 2 else 1.0
            job = {"ids": ids[:n_tok], "policy": name, "kw": kw, "temperature": temp, "seed": i, "repeat": False}
        g = pair.generate(job["ids"], policy=job["policy"], temperature=job["temperature"],
                          top_k=50 if job["temperature"] else 0, max_new_tokens=args.max_new_tokens,
                          seed=job["seed"], **job["kw"])
        row = {"i": i, "prompt_tokens": len(job["ids"]), "policy": job["policy"], "temperature": job["temperature"],
               "seed": job["seed"], "n_tokens": g.metrics.n_tokens, "stopped_by": g.stopped_by,
               "hit_context": len(job["ids"]) + args.max_new_tokens > args.n_ctx, "rss_mib": rss_mib(),
               "tok_s": g.metrics.tokens_per_s, "repeat": job["repeat"]}
        if job["repeat"]:  # a repeat that got other tokens is a failure (checks)
            row["same_tokens"] = g.token_ids == job["tokens"]
        else:
            history.append({**job, "tokens": g.token_ids})
        rows.append(row)
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(f"{i:4d} {job['policy']:10} T={job['temperature']:g} prompt {len(job['ids']):4d} -> {g.metrics.n_tokens:3d} "
              f"tok  rss {row['rss_mib']:.0f} MiB" + ("  repeat " + str(row["same_tokens"]) if job["repeat"] else ""),
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
