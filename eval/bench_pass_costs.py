"""What a verification pass costs on llama.cpp, per weight type: v(N) for N = 1..9 with the logits of
every row, for the fetched target and its re-quantizations (--target-quant), the draft's step for
each draft file, and what each re-quantized target costs in quality.

A pass of N rows is timed after a PREFIX-token context (costs.py's), all configurations interleaved
round by round (a slow spell of the machine hits them alike), medians over --reps rounds:
- `all rows`: logits for every row (what verification asks for);
- `last row`: logits for the last row only (what `llama-bench -p N` asks for): the difference is the
  output matrix's extra rows (151,936 x 1,536 for the target: its largest matrix, Q6_K in Q4_K_M).
Quality (--quality): the fetched target's greedy continuations of held prompts, teacher-forced through
each re-quantized target: mean KL(fetched || re-quantized) of the next-token distributions per token,
and how often their argmaxes agree.

    python eval/bench_pass_costs.py --out eval/results/bench_pass_costs_avx512_epyc [--quality]

The times, sizes and quality go to <out>/pass_costs.json, what the report says beside them (the CPU's flags
line, the ggml build, the command) to <out>/run.json (evaluation/paired.run_header), the report to
<out>/report.md; `--report-only --out <out>` measures nothing and loads no model: it rewrites report.md
from those two files alone, on any machine.

Why each type costs what it does (ggml-cpu as vendored in llama-cpp-python 0.3.36): Q4_0, Q4_K and
IQ4_NL matrices are repacked and their GEMM decodes a block once per group of 4 rows (repack.cpp,
`nrows > 3`); Q6_K (in Q4_K_M: the output matrix, half of attn_v / ffn_down) and Q5_0 have no x86
multi-row path below 8 rows (tiled/tiled.cpp starts at 8), so each row of a pass decodes them again.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.runs import write_json
from adaptive_spec.tables import md_table

if TYPE_CHECKING:  # llama.cpp, torch and the models are imported where a measuring run needs them
    from adaptive_spec.backends.llamacpp import LlamaCppLM

TARGET_QUANTS = ("none", "q4_0-pure", "q4_k-pure", "iq4_nl-pure")
DRAFT_QUANTS = ("none", "q4_0", "q4_0-pure")
LENGTHS = tuple(range(1, 10))


def _file(role: str, quant: str) -> Path:
    from adaptive_spec.backends.fetch import default_gguf
    from adaptive_spec.backends.llamacpp import requantized_gguf

    src = default_gguf(role)
    return src if quant == "none" else requantized_gguf(src, quant)


def draft_runner(spec: str, threads: int, n_ctx: int = 1024) -> LlamaCppLM:
    """A draft named QUANT or QUANT:N (N: --draft-vocab, the draft's GGUF cut to the N most frequent tokens)."""
    from adaptive_spec.backends.llamacpp import GGUFModel, LlamaCppLM, gguf_tokens_digest, reduced_vocab_draft
    from adaptive_spec.evaluation.forward_costs import parse_draft

    quant, vocab = parse_draft(spec)
    path, maps = _file("draft", quant), {}
    if vocab:
        path, maps = reduced_vocab_draft(path, vocab, _tokenizer(), gguf_tokens_digest(path)[0])
    return LlamaCppLM(GGUFModel(path), n_ctx=n_ctx, n_threads=threads, **maps)


@functools.cache
def _tokenizer():
    """The default pair's tokenizer (the list of kept tokens is counted with it)."""
    from transformers import AutoTokenizer

    from adaptive_spec.backends.paths import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("default", "target"))


def held_sequences(n_prompts: int, n_tokens: int):
    """(the fetched target's pair, [(prompt ids, its greedy continuation)], the target's log-probabilities
    along each): held prompts (HumanEval and, where present, GSM8K / AlpacaEval), teacher-forced."""
    from adaptive_spec.decoding.pipeline import SpecPair
    from adaptive_spec.prompts import load_prompts

    base = SpecPair.load(backend="llama.cpp", draft=None)
    prompts = []
    for ds in ("humaneval", "gsm8k", "alpaca"):
        try:
            prompts += load_prompts(ds, n=n_prompts, seed=5)
        except Exception:  # noqa: BLE001  (the shared sets may be absent on a clone)
            continue
    seqs = []
    for p in prompts:
        ids = base.encode(p, chat=True)
        g = base.generate(ids, policy="ar", temperature=0, max_new_tokens=n_tokens)
        seqs.append((ids, g.token_ids))
    return base, seqs, [logprobs(base.target, ids, new) for ids, new in seqs]


def logprobs(lm, ids, new):
    import torch

    lm.reset()
    logits, _ = lm.forward(torch.tensor(ids + new[:-1]), n_logits=len(new))
    return logits.float().log_softmax(-1)


def against_fetched(lm, held, per_token) -> tuple[float, float, int]:
    """(per_token(reference log-probs, lm's) summed over the held tokens / tokens, argmax agreement, tokens):
    `lm` teacher-forced along the fetched target's greedy continuations (held_sequences)."""
    _, seqs, ref = held
    total, agree, n = 0.0, 0, 0
    for (ids, new), lp_ref in zip(seqs, ref):
        lp = logprobs(lm, ids, new)
        total += float(per_token(lp_ref, lp))
        agree += int((lp.argmax(-1) == lp_ref.argmax(-1)).sum())
        n += len(new)
    return total / n, agree / n, n


def quality(quants: list[str], held) -> dict:
    """{quant: (mean KL(fetched || re-quantized) nats, top-1 agreement, tokens)} of each re-quantized target."""
    from adaptive_spec.backends.llamacpp import GGUFModel, LlamaCppLM

    base = held[0]
    kl = lambda ref, lp: (ref.exp() * (ref - lp)).sum()  # noqa: E731
    return {q: against_fetched(LlamaCppLM(GGUFModel(_file("target", q)), n_ctx=base.target.max_length,
                                          n_threads=base.target.n_threads), held, kl) for q in quants}


def acceptance(drafts: list[str], held, threads: int) -> dict:
    """{draft: (expected acceptance at T = 1, greedy agreement, tokens)}: along the fetched target's greedy
    continuations, E[alpha] = sum_x min(p(x), q(x)) per position (the chance a T = 1 draft token is
    accepted) and how often the draft's argmax is the target's; a reduced vocabulary's q is 0 on the
    dropped tokens, so what it loses in acceptance shows here beside what it saves in the step above."""
    base = held[0]
    alpha = lambda ref, lq: ref.exp().minimum(lq.exp()).sum()  # noqa: E731
    return {spec: against_fetched(draft_runner(spec, threads, n_ctx=base.target.max_length), held, alpha)
            for spec in drafts}


def report(result: dict, run: dict) -> str:
    """report.md of pass_costs.json (`result`: threads, prefix, reps, times, sizes, quality) with what
    run.json (`run`) says of the run: the CPU's flags line, the ggml build, the command and when it was
    written; the same text whether just measured or rebuilt by --report-only."""
    t = {}
    for key, v in result["times"].items():
        name, n, rows = key.split("|")
        t[(name, int(n), rows == "all")] = v
    sizes = result["sizes_mib"]
    targets = [name.removeprefix("target ") for name in sizes if name.startswith("target ")]
    drafts = [name.removeprefix("draft ") for name in sizes if name.startswith("draft ")]
    rows = []
    for q in targets:
        name = f"target {q}"
        step = t[(name, 1, True)]
        v_all = [t[(name, n, True)] / step for n in LENGTHS]
        v_last = [t[(name, n, False)] / step if n > 1 else 1.0 for n in LENGTHS]
        rows.append([q, f"{sizes[name]:.0f}", f"{1e3 * step:.1f}", " ".join(f"{v:.2f}" for v in v_all),
                     " ".join(f"{v:.2f}" for v in v_last), f"{v_all[3]:.2f}", f"{1e3 * t[(name, 4, True)]:.1f}"])
    drows = [[q, f"{sizes[f'draft {q}']:.0f}", f"{1e3 * t[(f'draft {q}', 1, True)]:.1f}",
              " / ".join(f"{t[(f'draft {q}', 1, True)] / t[(f'target {tq}', 1, True)]:.2f}" for tq in targets)]
             for q in drafts]
    md = [f"# Verification pass costs on llama.cpp ({result['threads']} threads)", "", run["cpu"], "",
          run["build"], "",
          f"A pass of N rows after a {result['prefix']}-token context, median of {result['reps']} interleaved rounds, "
          "in one-row steps of the same file. `all rows`: logits of every row (verification); `last row`: of the "
          "last only (llama-bench -p N); their gap is the output matrix's extra rows.", "",
          "## Targets", "",
          md_table(["target quant", "MiB", "one-row step ms", "v(1..9), all rows", "v(1..9), last row", "v(4)",
                    "4-row pass ms"], rows), "",
          "## Drafts", "", f"c = draft step / target step, for each target ({', '.join(targets)}).", "",
          md_table(["draft quant[:vocab]", "MiB", "step ms", "c"], drows), ""]
    if "quality" in result:
        md += ["## Quality of the re-quantized targets", "",
               "Teacher-forced on the fetched target's greedy continuations of held prompts: mean per-token "
               "KL(fetched || re-quantized) of the next-token distributions, and argmax agreement.", "",
               md_table(["target quant", "mean KL (nats)", "top-1 agreement", "tokens"],
                        [[q, f"{kl:.4f}", f"{ag:.3f}", str(n)] for q, (kl, ag, n) in result["quality"].items()]), ""]
    if "acceptance" in result:
        md += ["## What each draft costs in acceptance", "",
               "Teacher-forced on the fetched target's greedy continuations of the same held prompts: the expected "
               "acceptance of a T = 1 draft token, E[alpha] = sum_x min(p(x), q(x)), and how often the draft's "
               "argmax is the target's (greedy acceptance), against the fetched target.", "",
               md_table(["draft quant[:vocab]", "E[alpha], T = 1", "greedy agreement", "tokens"],
                        [[q, f"{a:.3f}", f"{ag:.3f}", str(n)] for q, (a, ag, n) in result["acceptance"].items()]),
               ""]
    md += [f"Written {run['written']} by `{run['command']}`."]
    return "\n".join(md) + "\n"


def _main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default=",".join(TARGET_QUANTS), help="target re-quantizations (none: fetched)")
    ap.add_argument("--drafts", default=",".join(DRAFT_QUANTS), help="draft re-quantizations (none: fetched), each "
                    "QUANT or QUANT:N (N: a reduced draft vocabulary, --draft-vocab N)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quality", action="store_true", help="also the re-quantized targets' KL from the fetched one")
    ap.add_argument("--acceptance", action="store_true", help="also each draft's expected acceptance against the "
                    "fetched target (what a cheaper draft file costs)")
    ap.add_argument("--quality-prompts", type=int, default=4, help="per prompt set (--quality and --acceptance)")
    ap.add_argument("--quality-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing: rewrite <out>/report.md from its pass_costs.json and run.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        (out / "report.md").write_text(report(json.loads((out / "pass_costs.json").read_text()),
                                              run_header(out, report_only=True)))
        return 0
    import torch

    from adaptive_spec.backends.cpu import flags_line
    from adaptive_spec.backends.llama_build import VERSION, X86_SETS, cmake_args
    from adaptive_spec.backends.llamacpp import GGUFModel, LlamaCppLM
    from adaptive_spec.decoding.costs import PREFIX
    from adaptive_spec.evaluation.forward_costs import pass_times

    out.mkdir(parents=True, exist_ok=True)
    threads = args.threads or torch.get_num_threads()
    cpu = flags_line()
    torch.set_num_threads(1)  # torch only copies logits here; llama.cpp computes on `threads`
    targets, drafts = args.targets.split(","), args.drafts.split(",")
    runners = {f"target {q}": LlamaCppLM(GGUFModel(_file("target", q)), n_ctx=1024, n_threads=threads) for q in targets}
    runners.update({f"draft {q}": draft_runner(q, threads) for q in drafts})
    # a draft runs steps of 1 row (2 in a round's first), so only those are timed for it
    lengths = {name: (1, 2) if name.startswith("draft") else LENGTHS for name in runners}
    t = pass_times(runners, lengths, args.reps, all_rows=(True, False))
    t = {(name, n, a): v for (name, n, a), v in t.items() if a or not name.startswith("draft")}
    sizes = {name: lm.model.n_bytes / 2**20 for name, lm in runners.items()}
    result = {"threads": threads, "prefix": PREFIX, "reps": args.reps, "cpu": cpu,
              "times": {f"{name}|{n}|{'all' if a else 'last'}": v for (name, n, a), v in t.items()},
              "sizes_mib": sizes}
    if args.quality or args.acceptance:
        del runners  # the timed files' memory, before the teacher-forced passes load theirs
        held = held_sequences(args.quality_prompts, args.quality_tokens)
        if args.quality:
            result["quality"] = quality([q for q in targets if q != "none"], held)
        if args.acceptance:
            result["acceptance"] = acceptance(drafts, held, threads)
    write_json(out / "pass_costs.json", result)
    header = run_header(out, report_only=False, measure=lambda: {
        "script": f"eval/{Path(__file__).name}", "cpu": cpu,
        "build": f"ggml build flags on: {', '.join(n for n, _ in X86_SETS if f'-D{n}=ON' in cmake_args())} "
                 f"(GGML_NATIVE and AMX off); llama-cpp-python {VERSION}",
        "command": f"python eval/bench_pass_costs.py {' '.join(argv)}"})
    md = report(json.loads((out / "pass_costs.json").read_text()), header)  # as --report-only reads it back
    (out / "report.md").write_text(md)
    print(md, end="")
    return 0


def main(argv=None) -> int:
    from adaptive_spec.errors import run_main

    return run_main(_main, sys.argv[1:] if argv is None else argv, "rerun the same command")


if __name__ == "__main__":
    sys.exit(main())
