"""Is a change slower on this CPU? The same decodes under two revisions of the package, interleaved.

Each measurement is a fresh process whose `adaptive_spec` is one revision's (a `git worktree` of --base, or
this checkout), run in turn base, this, base, this, ... so the machine's drift falls on both alike; each
process loads the pair once and decodes every prompt under every configuration (the public API only:
`SpecPair.load`, `SpecPair.generate`, which both revisions share). The report gives decode tok/s per
configuration and revision, pooled over prompts and rounds, and this checkout's ratio to the base.

    python eval/bench_revisions.py --base 62d9fb4 --out eval/results/bench_revisions_<cpu>
    python eval/bench_revisions.py --report-only --out eval/results/bench_revisions_<cpu>
    python eval/bench_revisions.py --tiny --base HEAD --out /tmp/rev   # smoke run on tiny models
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from adaptive_spec.backends.cpu.machine import flags_line
from adaptive_spec.evaluation.paired import rebuild_report, run_header
from adaptive_spec.runs import append_jsonl, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
DATA, REPORT = "results.jsonl", "report.md"
# configuration -> (engine, policy, settings): the CPU paths a user runs by default
CONFIGS = {
    "torch target alone": ("torch", "ar", {}),
    "torch fixed K=3": ("torch", "fixed", {"k": 3}),
    "torch SpecDec++ h=0.3": ("torch", "learned", {"head": "checkpoints/qwen-coder-0.5b-d3-wrej6", "threshold": 0.3}),
    "llama.cpp target alone": ("llama.cpp", "ar", {}),
}

CHILD = r"""
import json, sys, time
from adaptive_spec import SpecPair
from adaptive_spec.params import PairParams
a = json.loads(sys.argv[1])
by_engine = {}
for name in a["configs"]:
    by_engine.setdefault(a["table"][name][0], []).append(name)
for engine, names in by_engine.items():
    pair = SpecPair.load(PairParams(**a["pair"], backend=engine))
    for name in names:
        _, policy, settings = a["table"][name]
        pair.generate(a["prompts"][0], policy, max_new_tokens=8, temperature=0.0, **settings)  # warm
        for i, prompt in enumerate(a["prompts"]):
            g = pair.generate(prompt, policy, max_new_tokens=a["max_new_tokens"], temperature=1.0, top_k=50,
                              seed=i, chat=True, **settings)
            m = g.metrics
            print(json.dumps({"config": name, "prompt_idx": i, "n_tokens": m.n_tokens,
                              "decode_s": m.wall_s - m.prefill_s}), flush=True)
"""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the revision to compare this checkout with (default HEAD)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per revision, interleaved")
    ap.add_argument("--prompts", type=int, default=2, help="HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of: {', '.join(CONFIGS)}")
    ap.add_argument("--tiny", action="store_true", help="tiny random models (a smoke run of the harness)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--report-only", action="store_true")
    return ap.parse_args(argv)


def worktree(rev: str) -> Path:
    """A checkout of `rev` beside this one (runs/revisions/<sha>), made once."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    path = ROOT / "runs" / "revisions" / sha
    if not path.is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return path


def measure_once(tree: Path, spec: dict) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], cwd=tree, env=env, capture_output=True,
                         text=True)
    if out.returncode:
        raise SystemExit(f"error: the decode under {tree} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def report(rows: list[dict], header: dict) -> str:
    pooled: dict = {}
    for r in rows:
        p = pooled.setdefault((r["config"], r["revision"]), [0, 0.0])
        p[0] += r["n_tokens"]
        p[1] += r["decode_s"]
    lines = [f"# This checkout against {header['base']} on this CPU, interleaved", "",
             header["flags"], "",
             f"{header['rounds']} processes per revision (alternating), {header['prompts']} {header['prompt_set']} prompts x "
             f"{header['max_new_tokens']} tokens, T = 1 / top-k 50; decode tok/s pooled over prompts and processes.",
             "", "| configuration | base tok/s | this checkout tok/s | this / base |", "|---|---|---|---|"]
    for config in dict.fromkeys(r["config"] for r in rows):
        b, t = pooled.get((config, "base")), pooled.get((config, "this"))
        rate = lambda p: p[0] / p[1] if p and p[1] else float("nan")  # noqa: E731
        lines.append(f"| {config} | {rate(b):.2f} | {rate(t):.2f} | {rate(t) / rate(b):.3f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        rebuild_report(out, DATA, REPORT, lambda rows, h: report(rows, h), data=read_jsonl(out / DATA))
        print((out / REPORT).read_text())
        return 0
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        print(f"error: unknown configuration(s) {bad}; valid: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        from adaptive_spec.backends.toy import save_model

        tiny = out / "tiny"
        pair = {"draft": str(save_model(tiny / "draft", vocab_size=32, hidden_size=16, seed=1)),
                "target": str(save_model(tiny / "target", vocab_size=32, hidden_size=24, seed=2)), "dtype": "fp32"}
        names = [n for n in names if CONFIGS[n][0] == "torch" and CONFIGS[n][1] != "learned"]
        prompts = ["abc", "abd"][:args.prompts]
    else:
        from adaptive_spec.prompts import load_prompts

        pair, prompts = {}, load_prompts("humaneval", n=args.prompts)
    base = ROOT if args.base == "HEAD" and args.tiny else worktree(args.base)
    header = run_header(out, False, lambda: {"script": "eval/bench_revisions.py", "report": REPORT,
                                             "base": args.base, "rounds": args.rounds, "prompts": len(prompts),
                                             "prompt_set": "tiny" if args.tiny else "HumanEval",
                                             "max_new_tokens": args.max_new_tokens, "flags": flags_line()})
    spec = {"configs": names, "table": {n: CONFIGS[n] for n in names}, "pair": pair, "prompts": prompts,
            "max_new_tokens": args.max_new_tokens}
    (out / DATA).unlink(missing_ok=True)
    print(header["flags"], flush=True)
    for rnd in range(args.rounds):
        for rev, tree in (("base", base), ("this", ROOT)):
            for row in measure_once(tree, spec):
                append_jsonl(out / DATA, {**row, "revision": rev, "round": rnd})
            print(f"round {rnd + 1}/{args.rounds}: {rev} done", flush=True)
    print(rebuild_report(out, DATA, REPORT, lambda rows, h: report(rows, h), header, read_jsonl(out / DATA)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
