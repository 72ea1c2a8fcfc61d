"""The CPU peer benchmark: llama.cpp alone, llama.cpp's own speculative decoding, and ours on both
engines, in one run on the same prompts, paired per prompt (every configuration of a prompt runs
back to back, so a slow spell of the machine hits them alike).

Rows, per prompt and temperature (T = 1 top-k 50, and greedy):
- ours on llama.cpp (`--backend llama.cpp`, the GGUF files as fetch-models keeps them): the target
  alone (ar), fixed K, SpecDec++ with the statistics head over an h grid and h = auto, confidence;
  and with the draft re-quantized to Q4_0 (`--draft-quant q4_0`): fixed K, SpecDec++ h and auto;
- ours on torch (the served configuration: bf16 target, int8 draft): ar and SpecDec++ h = auto;
- llama.cpp's own speculative example (`llama-speculative-simple`, greedy only: its acceptance
  rule is greedy matching) at its default draft-max and over a grid, and with the Q4_0 draft;
and once per run `llama-bench` tg of the target (at an empty context and at the prompts' mean
length), so the binding's overhead shows against llama.cpp's own loop.

Speeds are decode tokens/s (wall time minus prompt prefill: llama-bench tg and the example's
"decoded ... t/s" leave prefill out too); wall tokens/s (prefill included) is in every row.
llama.cpp's tools are built from the same source as the binding (the llama-cpp-python sdist,
fetched with pip by name and version) with the same flags (llama_build.cmake_args(): this CPU's
instruction sets, AMX off).

    python eval/bench_llama_cpp.py --datasets humaneval,gsm8k,alpaca --prompts 10 --max-new-tokens 128

Resumable: rows go to <out>/results.jsonl as they finish, and a rerun skips the rows it has.
<out>/report.md holds the tables, the goals as ratios, the CPU and build flags, and each llama.cpp
pair's forward costs (pinned in <out>/costs-*.json, so a resumed run picks auto the same way) with
the acceptance a fixed K needs to beat the target alone under them (Eq. 3.2's terms).
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

from adaptive_spec.backends.cpu.machine import flags_line
from adaptive_spec.setup.wheels import default_gguf
from adaptive_spec.setup.llama_build import VERSION
from adaptive_spec.backends.llamacpp_pair import requantized_gguf
from adaptive_spec.decoding.auto import measure_costs
from adaptive_spec.setup.llama_tools import bench_tg, build, build_flags, spec_example
from adaptive_spec.backends.paths import split_draft_config
from adaptive_spec.evaluation.paired import pooled_tok_s, record, run_header, start
from adaptive_spec.runs import read_jsonl
from adaptive_spec.tables import md_table


HEAD = "checkpoints/qwen-coder-0.5b-int8-stats-d3"
H_GRID = (0.2, 0.3)
K_GRID = (3,)
DRAFT_MAX = (2, 3, 4)  # llama.cpp's default draft-max is 3 in this version
QUANT = "q4_0"  # the re-quantized draft's rows (llamacpp_pair.requantized_gguf says why)
QUANT_K, QUANT_H = (2, 3), (0.3,)
TEMPERATURES = (1.0, 0.0)


# ----------------------------------------------------------------------------- ours

def our_configs(pair_name: str) -> list[tuple[str, str, dict]]:
    """(config label, policy, kwargs) per loaded pair ("torch", "llama.cpp", "llama.cpp q4_0")."""
    if pair_name == "torch":
        return [("ar", "ar", {}), ("specdec++ h=auto", "learned", {"head": HEAD, "threshold": "auto"})]
    if pair_name == "llama.cpp fetched-target":  # the baseline's baseline: the fetched file, alone
        return [("ar (fetched target)", "ar", {})]
    if pair_name != "llama.cpp":  # another draft file: its own rows, labelled with its file type
        tag = f" (draft {pair_name.split()[1]})"
        return ([(f"fixed K={k}{tag}", "fixed", {"k": k}) for k in QUANT_K]
                + [(f"specdec++ h={h:g}{tag}", "learned", {"head": HEAD, "threshold": h}) for h in QUANT_H]
                + [(f"specdec++ h=auto{tag}", "learned", {"head": HEAD, "threshold": "auto"})])
    return ([("ar", "ar", {})] + [(f"fixed K={k}", "fixed", {"k": k}) for k in K_GRID]
            + [(f"specdec++ h={h:g}", "learned", {"head": HEAD, "threshold": h}) for h in H_GRID]
            + [("specdec++ h=auto", "learned", {"head": HEAD, "threshold": "auto"}),
               ("confidence tau=0.4", "confidence", {"threshold": 0.4})])


def our_row(pair, ids: list[int], policy: str, kw: dict, temperature: float, n: int) -> dict:
    g = pair.generate(ids, policy=policy, temperature=temperature, top_k=50 if temperature else 0,
                      max_new_tokens=n, seed=0, **kw)
    m = g.metrics
    decode_s = m.wall_s - m.prefill_s
    auto = getattr(g, "auto", None)
    return {"n_tokens": m.n_tokens, "wall_s": m.wall_s, "prefill_s": m.prefill_s, "decode_s": decode_s,
            "tok_s": m.tokens_per_s, "decode_tok_s": m.n_tokens / decode_s,
            "acceptance": None if m.n_drafted == 0 else m.acceptance_rate, "n_target_forwards": m.n_target_forwards,
            "n_discarded": m.n_discarded, "token_ids": g.token_ids,
            "auto": None if auto is None else auto["value"]}


# ----------------------------------------------------------------------------- the run

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default="humaneval,gsm8k,alpaca")
    ap.add_argument("--prompts", type=int, default=10, help="prompts per dataset (shuffled with seed 0, as sweeps)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperatures", default="1,0", help="1 = T 1 top-k 50; 0 = greedy")
    ap.add_argument("--torch-temperatures", default="1", help="temperatures of the torch rows ('' = none): the "
                    "torch engine is several times slower on a CPU, and the engine ratio is what they are for")
    ap.add_argument("--out", default="eval/results/bench_llama_cpp_peer")
    ap.add_argument("--drafts", default=f"none,{QUANT}",
                    help="llama.cpp draft files, each QUANT or QUANT:N (--draft-quant, and --draft-vocab N): the first "
                    "gets every row (ar, fixed K, SpecDec++ h and auto, confidence), the others fixed K, h and auto")
    ap.add_argument("--target-quant", default="none", help="the llama.cpp target re-quantized so (e.g. iq4_nl-pure); "
                    "then every ratio is to llama.cpp alone on that file, and one more row runs the fetched file alone")
    ap.add_argument("--no-examples", action="store_true", help="skip llama.cpp's own speculative example")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: the report from what <out> holds (its rows, run.json, costs-*.json)")
    args = ap.parse_args(argv)
    out, results, done = start(args.out, args.threads)
    if args.report_only:  # from the folder alone: no model, no build, no prompt set
        write_report(out, run_header(out, report_only=True))
        return 0

    from adaptive_spec.decoding.pipeline import SpecPair
    from adaptive_spec.prompts import load_prompts

    bins = build(args.threads)
    target_gguf, draft_gguf = default_gguf("target"), default_gguf("draft")
    drafts = args.drafts.split(",")
    quant_gguf = requantized_gguf(draft_gguf, QUANT, args.threads)
    pairs = {}
    for i, spec in enumerate(drafts):
        quant, vocab = split_draft_config(spec)
        pairs["llama.cpp" if i == 0 else f"llama.cpp {spec}"] = SpecPair.load(
            backend="llama.cpp", threads=args.threads, draft_quant=quant, draft_vocab=vocab,
            target_quant=args.target_quant)
    for name, pair in pairs.items():  # pinned: a resumed run prices (and so picks auto) the same way
        measure_costs(pair, pin=out / f"costs-{name.replace(' ', '-').replace(':', '-v')}.json")
    if args.target_quant != "none":
        pairs["llama.cpp fetched-target"] = SpecPair.load(backend="llama.cpp", draft=None, threads=args.threads)
    torch_temps = [float(t) for t in args.torch_temperatures.split(",") if t.strip()]
    if torch_temps:
        pairs["torch"] = SpecPair.load(draft_quant="int8", threads=args.threads)
    tok = pairs["llama.cpp"].tokenizer
    prompts = {ds: load_prompts(ds, n=args.prompts) for ds in args.datasets.split(",")}
    lengths = []
    temps = [float(t) for t in args.temperatures.split(",")]
    # prompt-major, round-robin over the datasets: a run stopped early still covers every dataset alike
    order = [(ds, i, texts[i]) for i in range(max(map(len, prompts.values())))
             for ds, texts in prompts.items() if i < len(texts)]
    for ds, i, text in order:
        ids = pairs["llama.cpp"].encode(text, chat=True)
        lengths.append(len(ids))
        chat_text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                            add_generation_prompt=True)
        for temp in temps:
            for name, pair in pairs.items():
                engine = name.split()[0]
                if engine == "torch" and temp not in torch_temps:
                    continue
                # warm-up before each pair's rows (untimed, not recorded): the first generation after another
                # engine or llama.cpp's example had run was slower than the same decode repeated right after
                pair.generate(ids, policy="ar", temperature=temp, max_new_tokens=16)
                for label, policy, kw in our_configs(name):
                    record(results, done, {"dataset": ds, "prompt_idx": i, "temperature": temp, "engine": engine,
                                           "config": label, "prompt_tokens": len(ids)},
                           lambda: our_row(pair, ids, policy, kw, temp, args.max_new_tokens))
            if temp != 0 or args.no_examples:
                continue
            examples = [(f"draft-max {k}" + (" (default)" if k == 3 else ""), draft_gguf, k) for k in DRAFT_MAX]
            examples.append((f"draft-max 3 (draft {QUANT})", quant_gguf, 3))
            for label, draft_file, k in examples:
                record(results, done, {"dataset": ds, "prompt_idx": i, "temperature": temp,
                                       "engine": "llama.cpp example", "config": label, "prompt_tokens": len(ids)},
                       lambda: spec_example(bins, target_gguf, draft_file, chat_text, args.max_new_tokens, k,
                                            args.threads))
    # the prompts' mean length sets the context llama-bench's tg is also measured at
    per_prompt = {(r["dataset"], r["prompt_idx"]): r["prompt_tokens"] for r in read_jsonl(results)}
    lengths = lengths or list(per_prompt.values())
    tg_file = target_gguf if args.target_quant == "none" else requantized_gguf(target_gguf, args.target_quant)
    tg = {"empty context": bench_tg(bins, tg_file, args.max_new_tokens, 0, args.threads),
          f"{int(statistics.mean(lengths))}-token context": bench_tg(bins, tg_file, args.max_new_tokens,
                                                                     int(statistics.mean(lengths)), args.threads)}
    (out / "llama_bench.json").write_text(json.dumps(tg, indent=1) + "\n")
    header = run_header(out, report_only=False, measure=lambda: {
        "script": "eval/bench_llama_cpp.py", "cpu": flags_line(), "build": build_flags(bins) + f"; llama-cpp-python {VERSION}",
        "llama_bench": tg, "max_new_tokens": args.max_new_tokens, "threads": args.threads, "drafts": args.drafts,
        "target_quant": args.target_quant, "llama_bench_file": f"target {_file_label(args.target_quant)}"})
    print(write_report(out, header))
    return 0


def write_report(out, header: dict) -> str:
    """<out>/report.md from the rows, the pinned costs and run.json (paired.run_header)."""
    costs = {p.stem[len("costs-"):]: json.loads(p.read_text()) for p in sorted(out.glob("costs-*.json"))}
    md = report(list(read_jsonl(out / "results.jsonl")), header, costs)
    (out / "report.md").write_text(md)
    return md


# ----------------------------------------------------------------------------- the report

def _speed(rows: list[dict], field: str = "decode_tok_s") -> float:
    """Tokens over time, pooled over prompts (a long prompt weighs by its tokens, as in sweeps)."""
    return pooled_tok_s(rows, "decode_s" if field == "decode_tok_s" else "wall_s")


def break_even(costs: dict, k: int) -> tuple[float, float, float | None]:
    """(drafting K c, verification's excess v(K + 1) - 1, the per-candidate acceptance alpha a fixed K
    needs to beat the target alone), in one-token target passes (the measured v(1), not the fitted
    line's intercept): a round of fixed K yields (1 - alpha^(K+1)) / (1 - alpha) tokens on average
    (independent acceptances) for K c + v(K + 1) steps (Eq. 3.2 with the measured per-length
    verification). None where even alpha = 1 (K + 1 tokens a round) falls short."""
    draft, verify = round_cost(costs, k)
    cost = draft + verify
    if cost >= k + 1:
        return draft, verify - 1, None
    lo, hi = 0.0, 1.0
    for _ in range(60):  # tokens per round grows with alpha: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** j for j in range(k + 1)) < cost else (lo, mid)
    return draft, verify - 1, hi


def round_cost(costs: dict, k: int) -> tuple[float, float]:
    """(drafting K c, verification v(K + 1)) of a fixed-K round, in one-token target passes."""
    step = costs["t_verify"][0]
    return k * costs["t_draft"] / step, costs["t_verify"][k] / step


def cost_section(costs: dict) -> list[str]:
    lines = ["## Forward costs and what speculation needs (Eq. 3.2)", "",
             "Measured through the binding after a 256-token context (costs.py), pinned for the run; a pass of N "
             "tokens returns the logits of all N (a verification needs them), which llama-bench's pp N does not. "
             "A round of fixed K costs K c target steps of drafting plus one verification pass of K + 1 tokens, v(K + 1) "
             "steps; it pays only if the tokens it yields exceed that. `alpha needed` is the per-candidate "
             "acceptance at which fixed K breaks even with the target alone (none: not even at alpha = 1). "
             "`ceiling` is the speed-up over the target alone if every candidate were accepted, (K + 1) / "
             "(K c + v(K + 1)): no stop rule, learned or not, can beat the largest of them with this pair on "
             "this CPU.", ""]
    table = []
    for name, c in costs.items():
        step = c["t_verify"][0]
        verify = " / ".join(f"{v / step:.2f}" for v in c["t_verify"][:6])
        for k in (1, 2, 3, 4):
            draft, excess, alpha = break_even(c, k)
            table.append([name, f"{1e3 * step:.1f}", f"{c['t_draft'] / step:.2f}", verify if k == 1 else "", str(k),
                          f"{draft:.2f}", f"{excess:.2f}", "none" if alpha is None else f"{alpha:.2f}",
                          f"{ceiling(c, k):.2f}x"])
    lines += [md_table(["pair", "target step ms", "c = t_draft / step", "v(1..6) in steps", "K", "drafting K c",
                        "verification excess v(K+1) - 1", "alpha needed", "ceiling (alpha = 1)"], table), ""]
    best = {name: max((ceiling(c, k), k) for k in range(1, len(c["t_verify"]))) for name, c in costs.items()}
    lines += ["Best ceiling over every K the costs price: " + "; ".join(
        f"{name} {x:.2f}x at K = {k}" for name, (x, k) in best.items()) + ".", ""]
    return lines


def ceiling(costs: dict, k: int) -> float:
    """Speed-up over the target alone of fixed K with a draft that is always accepted: K + 1 tokens a
    round for K c + v(K + 1) target steps (Eq. 3.2 at alpha = 1), the bound on any stop rule's gain."""
    return (k + 1) / sum(round_cost(costs, k))


def report(rows: list[dict], header: dict, costs: dict | None = None) -> str:
    """The report of the rows, with what run.json says of the run (paired.run_header): the CPU and build
    lines, llama-bench's tg, the settings in the title, when it was written."""
    tg = header["llama_bench"]
    by = defaultdict(list)
    for r in rows:
        by[(r["dataset"], r["temperature"], r["engine"], r["config"])].append(r)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    temps = list(dict.fromkeys(r["temperature"] for r in rows))
    n_prompts = {ds: len({r["prompt_idx"] for r in rows if r["dataset"] == ds}) for ds in datasets}
    lines = [f"# llama.cpp peer benchmark: {', '.join(f'{ds} ({n})' for ds, n in n_prompts.items())} prompts x "
             f"{header['max_new_tokens']} tokens, {header['threads']} threads", "",
             header["cpu"], "", header["build"], "",
             "Decode tokens/s (prefill left out, as llama-bench tg and the example's 'decoded' line do), pooled over "
             "prompts; every configuration of a prompt ran back to back. `x alone` is the ratio to our target alone "
             "on llama.cpp in the same rows.", "",
             f"llama.cpp files: target {_file_label(header['target_quant'])}; drafts "
             + ", ".join(_file_label(d) for d in header["drafts"].split(","))
             + " (the first: every row; the others: `(draft ...)` rows)", "",
             f"llama-bench tg ({header.get('llama_bench_file', 'the same target file')} alone, llama.cpp's own loop): "
             + ", ".join(f"{v:.2f} tok/s at {k}" for k, v in tg.items()), ""]
    goals = []
    for temp in temps:
        mode = "greedy" if temp == 0 else f"T = {temp:g}, top-k 50"
        table = []
        configs = list(dict.fromkeys((r["engine"], r["config"]) for r in rows if r["temperature"] == temp))
        for engine, config in configs:
            cells = [engine, config]
            for ds in datasets:
                rs, base = by[(ds, temp, engine, config)], by[(ds, temp, "llama.cpp", "ar")]
                if not rs:
                    cells.append("—")
                    continue
                acc = [r["acceptance"] for r in rs if r.get("acceptance") is not None]
                picks = sorted({str(r["auto"]) for r in rs if r.get("auto") is not None})
                cell = f"{_speed(rs):.2f}" + (f" ({_speed(rs) / _speed(base):.2f}x)" if base else "")
                cell += f", acc {statistics.mean(acc):.2f}" if acc else ""
                cell += f", picked {'/'.join(picks)}" if picks else ""
                cells.append(cell)
            table.append(cells)
        lines += [f"## {mode}", "", md_table(["engine", "configuration", *datasets], table), ""]
        # llama-bench's tg compares with our target alone only where it ran the same file
        same_file = header.get("llama_bench_file", "target fetched") == f"target {_file_label(header['target_quant'])}"
        goals += _goals(by, datasets, temp, tg if same_file else None)
    lines += ["## Goals (ratios from the rows above)", "", md_table(["goal", "dataset", "ratio", "met"], goals), ""]
    lines += cost_section(costs) if costs else []
    lines += [f"Written {header['written']} by `python eval/bench_llama_cpp.py`."]
    return "\n".join(lines) + "\n"


def _file_label(spec: str) -> str:
    quant, vocab = split_draft_config(spec)
    return ("fetched" if quant == "none" else quant) + (f" with a {vocab}-token vocabulary" if vocab else "")


# the goal the report checks: SpecDec++ auto's speed-up over llama.cpp alone on the same target file (decode and wall)
AUTO_BAR = {"humaneval": 1.2, "gsm8k": 1.2, "alpaca": 1.05}


def _goals(by, datasets, temp, tg) -> list[list[str]]:
    out = []
    mode = "greedy" if temp == 0 else "T=1"

    def best(ds, engine, prefix):
        cands = [(k[3], v) for k, v in by.items() if k[:3] == (ds, temp, engine) and k[3].startswith(prefix)]
        return max(cands, key=lambda kv: _speed(kv[1]), default=(None, None))

    def add(goal, ds, ratio, target):
        out.append([goal, ds, f"{ratio:.2f}x", "yes" if ratio >= target else "**no**"])

    for ds in datasets:
        ar = by[(ds, temp, "llama.cpp", "ar")]
        if not ar:
            continue
        if temp == 0 and tg:
            depth = next(k for k in tg if k != "empty context")
            add(f"ours target alone on llama.cpp / llama-bench tg at {depth} (>= 0.95)", ds, _speed(ar) / tg[depth], 0.95)
        label, spec = best(ds, "llama.cpp", "specdec++ h=0")
        torch_spec = by[(ds, temp, "torch", "specdec++ h=auto")]
        if spec and torch_spec:
            add(f"{mode}: SpecDec++ on llama.cpp ({label}) / on torch (auto), wall tok/s (>= 2)", ds,
                _speed(spec, "tok_s") / _speed(torch_spec, "tok_s"), 2.0)
        auto = by.get((ds, temp, "llama.cpp", "specdec++ h=auto"))  # get: an empty entry would become a goal row below
        if auto and torch_spec:  # what a user running `--threshold auto` on each engine gets
            add(f"{mode}: SpecDec++ h=auto on llama.cpp / on torch, wall tok/s (>= 2)", ds,
                _speed(auto, "tok_s") / _speed(torch_spec, "tok_s"), 2.0)
        if temp == 0 and spec:
            ex_label, ex = best(ds, "llama.cpp example", "draft-max")
            if ex:
                add(f"greedy: SpecDec++ ({label}) / llama.cpp's speculative at its best ({ex_label}) (>= 1.25)", ds,
                    _speed(spec) / _speed(ex), 1.25)
            if ds in ("humaneval", "gsm8k"):
                add(f"greedy: SpecDec++ ({label}) / llama.cpp alone (>= 1.15)", ds, _speed(spec) / _speed(ar), 1.15)
        fetched = by.get((ds, temp, "llama.cpp", "ar (fetched target)"))
        for label in sorted({k[3] for k in by if k[:3] == (ds, temp, "llama.cpp") and k[3].startswith("specdec++ h=auto")}):
            rs, bar = by[(ds, temp, "llama.cpp", label)], AUTO_BAR.get(ds, 0.97)
            for field, what in (("decode_tok_s", "decode"), ("tok_s", "wall")):
                add(f"{mode}: SpecDec++ {label[len('specdec++ '):]} on llama.cpp / llama.cpp alone, {what} (>= {bar:g})",
                    ds, _speed(rs, field) / _speed(ar, field), bar)
            if fetched:
                add(f"{mode}: SpecDec++ {label[len('specdec++ '):]} / llama.cpp alone on the fetched target, decode "
                    "(>= 1)", ds, _speed(rs) / _speed(fetched), 1.0)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
