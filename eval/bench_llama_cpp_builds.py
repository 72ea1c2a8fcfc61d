"""Which instruction sets the llama.cpp build should use: llama-bench of the same GGUF files under
each build this CPU can run, interleaved round by round (a slow spell of the machine hits them alike).

Builds: this CPU's own set (what `make setup` compiles: llama_build.cmake_args(), AMX off) and the
portable AVX2 set, when the CPU has more than AVX2. Per build and model: a one-token step (tg, after
a `--depth`-token context) and the pass over N tokens (pp N at the same depth) in one-token steps,
the ratio that decides whether speculation pays (a verification of K + 1 tokens must cost about one
step). The draft rows include the draft re-quantized to Q4_0 (`--draft-quant q4_0`).

    python eval/bench_llama_cpp_builds.py --rounds 3 --out eval/results/bench_llama_cpp_builds_<cpu>

Writes <out>/results.json (every llama-bench measurement, per build and model), <out>/report.md and
<out>/run.json (what the report says beside the measurements: the CPU, the binding's version, this
CPU's build, the settings, when; evaluation/paired.run_header). `--report-only --out DIR` rewrites
DIR/report.md from those alone (no build, no model, no llama-bench).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from adaptive_spec.setup.llama_build import cpu_flags, tier
from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.runs import write_json
from adaptive_spec.tables import md_table

AVX2 = frozenset("sse4_2 avx f16c fma avx2 bmi2".split())
LENGTHS = (2, 3, 4, 5, 6, 8)


def builds() -> dict[str, frozenset | None]:
    """{tier name: CPU flags to build for (None: this CPU's own)}."""
    out = {tier(): None}
    if AVX2 <= cpu_flags() and tier(AVX2) != tier():
        out[tier(AVX2)] = AVX2
    return out


def bench(bins: Path, gguf: Path, depth: int, threads: int, reps: int) -> dict:
    from adaptive_spec.setup.llama_tools import run

    out = run([str(bins / "llama-bench"), "-m", str(gguf), "-p", ",".join(map(str, LENGTHS)), "-n", "32",
               "-d", str(depth), "-t", str(threads), "-r", str(reps), "-o", "json"])
    rows = json.loads(out[out.index("["): out.rindex("]") + 1])
    step = next(1.0 / r["avg_ts"] for r in rows if r["n_gen"] > 0)
    return {"step_s": step, **{f"pp{r['n_prompt']}_s": r["n_prompt"] / r["avg_ts"] for r in rows if r["n_prompt"] > 0}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="llama-bench repetitions per measurement")
    ap.add_argument("--depth", type=int, default=150, help="context tokens before the timed passes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="eval/results/bench_llama_cpp_builds")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: report.md from what <out> holds (results.json and run.json)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report_only:  # from the folder alone: no build, no model
        got = json.loads((out / "results.json").read_text())
        (out / "report.md").write_text(report(got, run_header(out, report_only=True)))
        return 0

    from adaptive_spec.backends.cpu.machine import flags_line
    from adaptive_spec.setup.wheels import default_gguf
    from adaptive_spec.setup.llama_build import VERSION, cmake_args, enabled_sets
    from adaptive_spec.setup.llama_tools import build
    from adaptive_spec.backends.llamacpp_pair import requantized_gguf

    out.mkdir(parents=True, exist_ok=True)
    bins = {name: build(args.threads, flags, tools=("llama-bench",)) for name, flags in builds().items()}
    draft = default_gguf("draft")
    models = {"target": default_gguf("target"), "draft": draft,
              "draft q4_0": requantized_gguf(draft, "q4_0", args.threads)}
    got = defaultdict(list)
    for r in range(args.rounds):
        for name, b in bins.items():
            for role, gguf in models.items():
                got[(name, role)].append(bench(b, gguf, args.depth, args.threads, args.reps))
                step = got[(name, role)][-1]["step_s"]
                print(f"round {r + 1} {name:28} {role:10} step {1e3 * step:6.1f} ms", file=sys.stderr, flush=True)
    write_json(out / "results.json", {f"{k[0]}|{k[1]}": v for k, v in got.items()})
    header = run_header(out, report_only=False, measure=lambda: {
        "script": "eval/bench_llama_cpp_builds.py", "rounds": args.rounds, "reps": args.reps,
        "threads": args.threads, "depth": args.depth, "cpu": flags_line(), "llama_cpp_python": VERSION,
        "cmake_args": cmake_args(), "tier": tier(), "sets": enabled_sets(cpu_flags())})
    md = report(json.loads((out / "results.json").read_text()), header)
    (out / "report.md").write_text(md)
    print(md, end="")
    return 0


def report(got: dict[str, list[dict]], header: dict) -> str:
    """report.md from results.json ({"build|model": [one llama-bench measurement a round]}), with what
    run.json says of the run (paired.run_header): the settings in the title, the CPU line, the binding's
    version, this CPU's build (its tier, cmake arguments and instruction sets), when it was written."""
    runs_of = {tuple(k.split("|", 1)): v for k, v in got.items()}
    names, roles = list(dict.fromkeys(n for n, _ in runs_of)), list(dict.fromkeys(r for _, r in runs_of))
    lengths = sorted({int(k[2:-2]) for runs in runs_of.values() for x in runs for k in x if k.startswith("pp")})
    own = header["tier"]
    table = []
    for (name, role), runs in runs_of.items():
        step = statistics.median(x["step_s"] for x in runs)
        cells = [name, role, f"{1 / step:.2f}", f"{1e3 * step:.1f}"]
        cells += [f"{statistics.median(x[f'pp{n}_s'] / x['step_s'] for x in runs):.2f}" for n in lengths]
        table.append(cells)
    base = {role: statistics.median(x["step_s"] for x in runs_of[(own, role)]) for role in roles}
    ratios = []
    for name in names:
        if name == own:
            continue
        for role in roles:
            other = statistics.median(x["step_s"] for x in runs_of[(name, role)])
            ratios.append([role, f"{other / base[role]:.2f}x"])
    md = [f"# llama.cpp builds on this CPU: llama-bench, {header['rounds']} interleaved rounds x "
          f"{header['reps']} reps, {header['threads']} threads, {header['depth']}-token context", "", header["cpu"], "",
          f"llama-cpp-python {header['llama_cpp_python']}'s llama.cpp; this CPU's build (`make setup`): "
          f"`{header['cmake_args']}`", "",
          "Medians over rounds. `pp N / step`: a pass over N tokens in one-token steps (what a verification of "
          "K + 1 = N tokens costs against plain decoding).", "",
          md_table(["build", "model", "tok/s", "ms a step", *[f"pp {n} / step" for n in lengths]], table), ""]
    if ratios:
        md += [f"Step time of the other builds against this CPU's own ({own}; above 1x: this CPU's build is "
               "faster):", "", md_table(["model", "ratio"], ratios), ""]
    md += [f"Instruction sets of this CPU's build: {', '.join(header['sets'])}.", "",
           f"Written {header['written']} by `python eval/bench_llama_cpp_builds.py`."]
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
