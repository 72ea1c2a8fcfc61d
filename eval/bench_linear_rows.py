"""Benchmark: what the target's linear layers cost per input row count, per CPU kernel.

A verification of K candidates feeds K + 1 rows through every linear layer that a decode step
feeds one row through. Where the weights stream from memory, the ideal kernel costs the same
for 1 and for K + 1 rows; this measures how close each available kernel gets, on random weights
of the model's own shapes (no checkpoint is read: only its config), so the floor that the
kernels set under `eval/bench_cpu_kernels.py`'s whole-forward ratio is visible:

- oneDNN packed (the runtime's path: models.PackedLinear), in fp32 and, where the CPU has bf16
  kernels, bf16;
- MKL packed sgemm (`torch.ops.mkl._mkl_linear`), fp32;
- FBGEMM fp16 weights with fp32 activations (`torch.fbgemm_linear_fp16_weight_fp32_activation`;
  deprecated in torch, measured while it exists): half the bytes of fp32, fp32 arithmetic;
- stock `F.linear`, fp32 and bf16.

"whole model" weights each shape by how often the model has it (LM head included), i.e. the
ratio a verification forward would have if nothing but linear layers ran. Kernels and row
counts alternate --rounds times so machine drift hits all alike; the CPU flags head the table.

    python eval/bench_linear_rows.py [--model target] [--rows 1,2,3,5,9] [--threads 2]

The rows go to <out>/results.json, what the table says beside them (the CPU's flags line, the model,
its layer shapes, each kernel's bytes per weight, the settings) to <out>/run.json (evaluation/paired.run_header),
the table to <out>/table.md; `--report-only --out <out>` measures nothing: it rewrites table.md from
those two files alone, on any machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.tables import md_table

STREAM_BYTES = 256 << 20  # copies of a small layer up to this size, so weights come from memory, not cache


def layer_shapes(model: str) -> dict[str, tuple[int, int, int]]:
    """name -> (in_features, out_features, count in the model) for a Llama/Qwen-style decoder."""
    from transformers import AutoConfig

    from adaptive_spec.backends.models import resolve_model_path

    role = model if model in ("target", "draft") else "target"
    c = AutoConfig.from_pretrained(resolve_model_path(None if model == role else model, role))
    h, n = c.hidden_size, c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    return {"q, o": (h, c.num_attention_heads * head_dim, 2 * n), "k, v": (h, kv, 2 * n),
            "gate, up": (h, c.intermediate_size, 2 * n), "down": (c.intermediate_size, h, n),
            "lm_head": (h, c.vocab_size, 1)}


def kernels() -> dict:
    """name -> (bytes per weight, prepare(weight fp32) -> state, call(x, state)); only those this
    CPU can run."""
    import torch

    from adaptive_spec.backends.cpu import fbgemm_fp16, onednn_packed

    out = {}
    for dt in (torch.float32, torch.bfloat16):
        tag = "fp32" if dt == torch.float32 else "bf16"
        if not onednn_packed(dt):
            out[f"oneDNN packed {tag}"] = (
                dt.itemsize, lambda w, dt=dt: torch.ops.mkldnn._reorder_linear_weight(w.to(dt)),
                lambda x, s: torch.ops.mkldnn._linear_pointwise(x.to(s.dtype), s, None, "none", [], ""))
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        out["MKL packed fp32"] = (4, lambda w: (torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w),
                                  lambda x, s: torch.ops.mkl._mkl_linear(x, s[0], s[1], None, x.shape[0]))
    if fbgemm_fp16() is None:  # the runtime's own check; models silences the ops' deprecation warning
        out["FBGEMM fp16 weights"] = (
            2, lambda w: (torch.fbgemm_pack_gemm_matrix_fp16(w), torch.zeros(w.shape[0])),
            lambda x, s: torch.fbgemm_linear_fp16_weight_fp32_activation(x, s[0], s[1]))
    out["stock fp32"] = (4, lambda w: w, lambda x, s: torch.nn.functional.linear(x, s))
    out["stock bf16"] = (2, lambda w: w.bfloat16(), lambda x, s: torch.nn.functional.linear(x.bfloat16(), s))
    return out


def report(results: list[dict], run: dict) -> str:
    """table.md of results.json's rows with what run.json (`run`) says of the run: the CPU's flags line, the
    model, its layer shapes, each kernel's bytes per weight, the settings; the same text whether just
    measured or rebuilt by --report-only."""
    rows = sorted(int(m) for m in results[0]["ms"])  # row counts: JSON keys are strings
    table = []
    for r in results:
        t = {int(m): v for m, v in r["ms"].items()}
        if r["layer"] == "whole model":
            label, gbps = r["layer"], ""
        else:
            i, o, count = run["shapes"][r["layer"]]
            label, gbps = f"{r['layer']} {i}->{o} (x{count})", f"{i * o * run['weight_bytes'][r['kernel']] / t[1] / 1e6:.1f}"
        table.append([r["kernel"], label, f"{t[1]:.2f}", gbps] + [f"{t[m] / t[1]:.2f}" for m in rows[1:]])
    return "\n".join([run["cpu"], f"{run['model']}: random weights of its linear layers' shapes, {run['threads']} threads, "
                      f"median of {run['rounds']} rounds x {run['reps']} reps", "",
                      md_table(["kernel", "layer", "ms at 1 row", "weight GB/s at 1 row"]
                               + [f"x at {m} rows" for m in rows[1:]], table)]) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="target", help="'target' / 'draft' of the default pair, a folder or a hub id")
    ap.add_argument("--rows", default="1,2,3,5,9", help="input rows: 1 = a decode step, K + 1 = a verification")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="output folder (default eval/results/bench_linear_rows_<isa>)")
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing: rewrite <out>/table.md from its results.json and run.json")
    args = ap.parse_args(argv)
    if args.report_only:
        if not args.out:
            ap.error("--report-only rewrites the table of a run folder: name it with --out")
        out = Path(args.out)
        (out / "table.md").write_text(report(json.loads((out / "results.json").read_text())["rows"],
                                             run_header(out, report_only=True)))
        return 0
    import torch

    from adaptive_spec.backends.cpu import describe, flags_line

    torch.set_num_threads(args.threads)
    rows = sorted({1, *(int(r) for r in args.rows.split(","))})
    shapes = layer_shapes(args.model)
    ks = kernels()
    gen = torch.Generator().manual_seed(0)
    ms = {}  # (kernel, shape, rows) -> [seconds per layer]
    with torch.inference_mode():
        for name, (i, o, _) in shapes.items():
            copies = max(1, STREAM_BYTES // (i * o * 4))
            ws = [torch.randn(o, i, generator=gen) * 0.02 for _ in range(copies)]
            states = {k: [prep(w) for w in ws] for k, (_, prep, _) in ks.items()}
            xs = {m: torch.randn(m, i, generator=gen) for m in rows}
            for _ in range(args.rounds):
                for k, (_, _, call) in ks.items():
                    for m in rows:
                        for s in states[k]:  # warm-up pass
                            call(xs[m], s)
                        for _ in range(args.reps):
                            t0 = time.perf_counter()
                            for s in states[k]:
                                call(xs[m], s)
                            ms.setdefault((k, name, m), []).append((time.perf_counter() - t0) / copies)
            del ws, states
    med = {key: statistics.median(v) * 1e3 for key, v in ms.items()}
    results = []
    for k in ks:
        for name in [*shapes, "whole model"]:
            if name == "whole model":
                t = {m: sum(c * med[(k, s, m)] for s, (_, _, c) in shapes.items()) for m in rows}
            else:
                t = {m: med[(k, name, m)] for m in rows}
            results.append({"kernel": k, "layer": name, "ms": t, "vs_1_row": {m: t[m] / t[1] for m in rows}})
    out = Path(args.out or f"eval/results/bench_linear_rows_{describe()['isa'].lower()}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"machine": describe(), "rows": results}, indent=1) + "\n")
    header = run_header(out, report_only=False, measure=lambda: {
        "script": f"eval/{Path(__file__).name}", "report": "table.md", "cpu": flags_line(), "model": args.model,
        "threads": args.threads, "rounds": args.rounds, "reps": args.reps,
        "shapes": {name: list(v) for name, v in shapes.items()}, "weight_bytes": {k: v[0] for k, v in ks.items()}})
    text = report(json.loads((out / "results.json").read_text())["rows"], header)  # as --report-only reads it back
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
