"""Is the probe's one-row llama.cpp step the decode's? The target's one-row step timed every way that matters, side
by side in one process and round-robin (each round times every row once, so the machine's drift hits them alike):

    probe cell (v5)        the cost measurement before v6: a one-row pass rolled back to a PREFIX-token context,
                           between the draft's steps and the target's passes of 2..9 rows (cost_timing.interleaved_round)
    probe step (v6)        the measurement now: the decoder's own target-alone loop around that context
                           (cost_timing.decode_step_time)
    decoder, target alone  the decoder's target-alone runs on real prompts, as a sweep's `ar` rows run them
                           (chat-encoded, T = 1 top-k 50, --max-new-tokens): the target's forward time a step,
                           and beside it the loop's whole time a token (what a sweep's tok/s measures)

and, to show which difference makes the gap, the one-row cell with one thing changed at a time: alone (the same
cell back to back), after a 9-row pass (another batch shape: llama.cpp builds its compute graph again), after the
draft's step (the other model in between), steps in a row without sampling (no rollback, advancing positions),
the decode's loop at the runs' own context (the prompt plus half the answer) and with llama.cpp's graph reuse off
(LLAMA_GRAPH_REUSE_DISABLE, read when a context is made); and a 4-row pass back to back (fixed K = 3's shape)
beside its interleaved cell. Nothing here is a model of the gap: each row is measured.

    python eval/bench_llama_step.py --out eval/results/bench_llama_step_<cpu>     # on quiet cores, a few minutes
    python eval/bench_llama_step.py --tiny --target T.gguf --draft D.gguf --out /tmp/s   # smoke test
    python eval/bench_llama_step.py --report-only --out DIR                       # the report from DIR alone

Writes <out>/steps.json (every sample), run.json (the CPU's flags, the llama.cpp build, threads, files) and
report.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from adaptive_spec.errors import UserError, run_main
from adaptive_spec.evaluation.paired import rebuild_report, run_header
from adaptive_spec.runs import write_json
from adaptive_spec.tables import md_table

DATA = "steps.json"
REUSE_OFF = "LLAMA_GRAPH_REUSE_DISABLE"
# (row, what it changes against the row it is compared with, that row)
ROWS = (
    ("probe cell (v5)", "", None),
    ("cell alone", "no other pass between cells", "probe cell (v5)"),
    ("cell after a 9-row pass", "a pass of another batch shape before each cell", "cell alone"),
    ("cell after the draft's step", "the draft model's step before each cell", "cell alone"),
    ("steps in a row, no sampling", "no rollback: one position after another", "cell alone"),
    ("probe step (v6)", "the decoder's loop: sampling between steps", "steps in a row, no sampling"),
    ("decode step at the runs' context", "the runs' context instead of PREFIX", "probe step (v6)"),
    ("decode step, graph reuse off", f"{REUSE_OFF}=1: the graph built every step", "probe step (v6)"),
    ("decoder, target alone: forward", "real prompts and answers", "probe step (v6)"),
)
FOUR = ("4-row cell (interleaved)", "4-row pass back to back")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="default", help="the target's GGUF (default: the fetched one)")
    ap.add_argument("--draft", default="default", help="the draft's GGUF, whose steps the probe's cells run between")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds (default 6; --tiny 2)")
    ap.add_argument("--cells", type=int, default=None, help="one-row samples a cause row takes a round (8; tiny 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps of a decode-loop row a round (32; tiny 4)")
    ap.add_argument("--datasets", default="humaneval,gsm8k,alpaca", help="the decoder rows' prompts, one a round")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="tokens a decoder run (128; tiny 8)")
    ap.add_argument("--tiny", action="store_true", help="few and short rounds, raw-encoded prompts (smoke test)")
    ap.add_argument("--out", default="eval/results/bench_llama_step")
    ap.add_argument("--report-only", action="store_true", help="run nothing: the report of what <out> holds")
    args = ap.parse_args(argv)
    for key, full, tiny in (("rounds", 6, 2), ("cells", 8, 2), ("steps", 32, 4), ("max_new_tokens", 128, 8)):
        value = getattr(args, key)
        value = (tiny if args.tiny else full) if value is None else value
        if value < 1:
            raise UserError(f"--{key.replace('_', '-')} must be >= 1, got {value}")
        setattr(args, key, value)
    return args


# ----------------------------------------------------------------------------- measuring

def _one_row_rows(pair, ctx: dict, cells: list, m: int) -> dict:
    """One round of the cell rows: the probe's round (its one-row and 4-row cells) and each cell variant, m
    samples each (the first of a back-to-back run is dropped: it follows whatever ran before)."""
    from adaptive_spec.decoding.auto import interleaved_round
    from adaptive_spec.timing import timed

    target, draft = pair.target, pair.draft
    _, prefix, ids, _ = ctx[id(target)]
    times = interleaved_round(cells, ctx)
    one = cells.index((target, 1, True))
    out = {"probe cell (v5)": [times[one]], FOUR[0]: [times[cells.index((target, 4, True))]]}

    def cell(n=1, before=None):
        if before is not None:
            before()
        target.rollback(prefix)
        with timed(target.device) as t:
            target.forward(ids[prefix:prefix + n], n_logits=n)
        return t.s

    def nine():
        target.rollback(prefix)
        target.forward(ids[prefix:prefix + 9], n_logits=9)

    def draft_step():
        d_prefix = ctx[id(draft)][1]
        draft.rollback(d_prefix)
        draft.forward(ctx[id(draft)][2][d_prefix:d_prefix + 1], n_logits=1)

    out["cell alone"] = [cell() for _ in range(m + 1)][1:]
    out["cell after a 9-row pass"] = [cell(before=nine) for _ in range(m)]
    if draft is not None:
        out["cell after the draft's step"] = [cell(before=draft_step) for _ in range(m)]
    out[FOUR[1]] = [cell(4) for _ in range(m + 1)][1:]
    target.rollback(prefix - m - 1)
    in_row = []
    for j in range(prefix - m - 1, prefix):
        with timed(target.device) as t:
            target.forward(ids[j:j + 1], n_logits=1)
        in_row.append(t.s)
    out["steps in a row, no sampling"] = in_row[1:]
    return out


def _decode_rows(loop_lm, reuse_off, args, context: int) -> dict:
    """One round of the decode-loop rows (cost_timing.decode_step_time): at PREFIX, at the runs' context, and on a
    context made with the graph reuse off (None where it could not be made)."""
    from adaptive_spec.decoding.auto import decode_step_time

    out = {"probe step (v6)": [decode_step_time(loop_lm, 1, steps=args.steps)],
           "decode step at the runs' context": [decode_step_time(loop_lm, 1, steps=args.steps, context=context)]}
    if reuse_off is not None:
        out["decode step, graph reuse off"] = [decode_step_time(reuse_off, 1, steps=args.steps)]
    return out


def _decoder_run(pair, loop_lm, ids: list[int], args, seed: int) -> dict:
    """The decoder's target-alone run on one prompt, as a sweep's `ar` row runs it: its forward seconds a
    step and its loop's seconds a token (prefill left out)."""
    from adaptive_spec.decoding.decoder import Decoder
    from adaptive_spec.decoding.sampling import SamplingParams

    g = Decoder(loop_lm, None, eos_token_ids=pair.eos_token_ids).generate(
        ids, max_new_tokens=args.max_new_tokens, sampling=SamplingParams(1.0, 50, 1.0), seed=seed)
    m = g.metrics
    return {"prompt_tokens": len(ids), "n_tokens": m.n_tokens,
            "forward_s": (m.target_s - m.target_prefill_s) / max(m.n_target_forwards, 1),
            "loop_s": (m.wall_s - m.prefill_s) / max(m.n_tokens, 1)}


def _prompts(pair, args) -> list[list[int]]:
    """Enough prompts for one a round, the sets taking turns (chat-encoded; --tiny: raw, the last 16 tokens)."""
    from adaptive_spec.prompts import load_prompts

    sets = args.datasets.split(",")
    per_set = [load_prompts(ds, n=-(-args.rounds // len(sets))) for ds in sets]
    texts = [group[i] for i in range(max(map(len, per_set))) for group in per_set if i < len(group)]
    return [pair.encode(t, chat=False)[-16:] if args.tiny else pair.encode(t, chat=True) for t in texts]


def measure(args) -> dict:
    """Load the pair, prefill the probe's contexts and run every row round-robin."""
    import torch

    from adaptive_spec.decoding.auto import PREFIX, interleaved_round, measured_cells, prefilled, release
    from adaptive_spec.decoding.pipeline import SpecPair
    from adaptive_spec.timing import torch_threads
    from adaptive_spec.params import pair_params

    torch.set_num_threads(args.threads)
    pair = SpecPair.load(pair_params(backend="llama.cpp", threads=args.threads, target=args.target,
                                     draft=None if args.draft == "none" else args.draft))
    loop_lm = pair.target.fresh()  # the decode rows' own context: they reset it, the cells keep theirs
    os.environ[REUSE_OFF] = "1"
    try:
        reuse_off = pair.target.fresh()
    finally:
        del os.environ[REUSE_OFF]
    prompts = _prompts(pair, args)
    context = round(statistics.mean(len(p) for p in prompts) + args.max_new_tokens / 2)
    cells = measured_cells(pair)
    rows, runs = {}, []
    with torch_threads(pair.engine.decode_torch_threads), torch.inference_mode():
        ctx = prefilled(cells)
        interleaved_round(cells, ctx)  # the probe's warm-up round
        for r in range(args.rounds):
            for part in (_one_row_rows(pair, ctx, cells, args.cells), _decode_rows(loop_lm, reuse_off, args, context)):
                for key, samples in part.items():
                    rows.setdefault(key, []).append(samples)
            runs.append(_decoder_run(pair, loop_lm, prompts[r % len(prompts)], args, seed=r))
        release(ctx)
    return {"rows": rows, "runs": runs, "context": context, "prefix": PREFIX,
            "numeric_path": pair.target.numeric_path()}


# ----------------------------------------------------------------------------- the report

def medians(data: dict) -> dict:
    """Each row's median seconds over every sample of every round; the decoder's rows from its runs."""
    out = {key: statistics.median(s for rnd in rounds for s in rnd) for key, rounds in data["rows"].items()}
    runs = data["runs"]
    if runs:
        out["decoder, target alone: forward"] = statistics.median(r["forward_s"] for r in runs)
        out["decoder, target alone: loop"] = statistics.median(r["loop_s"] for r in runs)
    return out


def report(data: dict, run: dict) -> str:
    med = medians(data)
    ref = med.get("decoder, target alone: forward")
    pct = lambda a, b: "—" if a is None or not b else f"{100 * (a / b - 1):+.1f}%"  # noqa: E731
    ms = lambda x: "—" if x is None else f"{1e3 * x:.2f}"  # noqa: E731
    table = []
    for name, change, base in ROWS:
        if name not in med:
            continue
        n = sum(len(rnd) for rnd in data["rows"].get(name, [])) or len(data["runs"])
        table.append([name, str(n), ms(med[name]), pct(med[name], ref), change or "—",
                      base or "—", pct(med[name], med.get(base)) if base else "—"])
    loop = med.get("decoder, target alone: loop")
    lines = [f"# The probe's one-row llama.cpp step against the decode's: {run['target']}, {run['threads']} threads",
             "", run["cpu"], "", f"llama.cpp: {run['system']}", "", _amx_line(run), "",
             f"{run['rounds']} rounds, each timing every row once (so the machine's drift hits them alike); the "
             f"probe's context {data['prefix']} tokens, the runs' {data['context']} (prompt plus half the answer). "
             "Median milliseconds of one target forward of one token; each row against the decoder's own steps "
             "and against the row it changes one thing of:", "",
             md_table(["row", "samples", "ms", "vs the decoder's steps", "what it changes", "against", "difference"],
                      table), "",
             f"The decoder's loop a token, sampling included (what a sweep's tok/s measures): {ms(loop)} ms "
             f"({1 / loop:.2f} tok/s)." if loop else "", ""]
    if all(k in med for k in FOUR):
        lines += [f"A 4-row pass (fixed K = 3's verification): {ms(med[FOUR[0]])} ms as an interleaved cell, "
                  f"{ms(med[FOUR[1]])} ms back to back ({pct(med[FOUR[1]], med[FOUR[0]])}).", ""]
    lines.append(f"Written {run['written']} by `python eval/bench_llama_step.py`.")
    return "\n".join(lines) + "\n"


def _amx_line(run: dict) -> str:
    """Whether an AMX kernel can be what differs: only where the CPU has AMX and the library was built with it."""
    built = "AMX_INT8 = 1" in (run.get("system") or "")
    has = ", ".join(run.get("amx") or []) or "no AMX"
    return (f"AMX: the CPU has {has}; the library was built {'with' if built else 'without'} AMX kernels"
            + ("" if built else " (llama_build.py turns them off), so no kernel is picked by batch size for AMX") + ".")


def _header(args, data: dict) -> dict:
    from adaptive_spec.backends.cpu.machine import flags_line

    path = data["numeric_path"]
    env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "GGML_", "LLAMA_", "KMP_"))}
    return {"script": "eval/bench_llama_step.py", "target": path.get("gguf"), "desc": path.get("desc"),
            "threads": args.threads, "rounds": args.rounds, "cells": args.cells, "steps": args.steps,
            "max_new_tokens": args.max_new_tokens, "tiny": args.tiny, "cpu": flags_line(),
            "amx": sorted({f for f in _cpu_flags() if f.startswith("amx")}), "system": path.get("system"),
            "llama_cpp_python": path.get("llama_cpp_python"), "env": env}


def _cpu_flags() -> frozenset:
    from adaptive_spec.setup.llama_build import cpu_flags

    return cpu_flags()


def _main(argv) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        print(rebuild_report(out, DATA, "report.md", report))
        return 0
    data = measure(args)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / DATA, data, indent=1, default=str)
    header = run_header(out, report_only=False, measure=lambda: _header(args, data))
    print(rebuild_report(out, DATA, "report.md", report, header))
    return 0


def main(argv=None) -> int:
    return run_main(_main, sys.argv[1:] if argv is None else argv, "nothing was written; run the same command again")


if __name__ == "__main__":
    sys.exit(main())
