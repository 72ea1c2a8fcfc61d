"""Benchmark: one decode step and one K+1-token verify step of each model, stock nn.Linear vs
the oneDNN pre-packed PackedLinear (adaptive_spec.models) without and with its row padding,
side by side in one process (the three layouts alternate, --rounds times, so drifts in the
machine's speed hit all three alike).

Reports ms per forward and the weight bandwidth achieved (bytes of the model's linear weights
read per forward / time), the number that bounds batch-1 decoding; and the largest logit
difference against the stock layout. Timing: 3 untimed warm-up forwards, then the median of
--reps, per round; the table gives the median over rounds.

    python eval/bench_cpu_kernels.py [--models draft,target] [--lens 1,2,4,9] [--reps 10] [--rounds 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from adaptive_spec.models import CausalLM, PackedLinear, load_model


def linear_bytes(model) -> int:
    seen, n = set(), 0
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, PackedLinear)) and m.weight.data_ptr() not in seen:
            seen.add(m.weight.data_ptr())
            n += m.weight.numel() * m.weight.element_size()
    return n


def time_step(lm: CausalLM, prompt: torch.Tensor, n: int, reps: int) -> tuple[float, torch.Tensor]:
    """Median seconds of feeding n tokens after the prompt (rolled back each time), and the logits."""
    lm.reset()
    lm.forward(prompt, n_logits=0)
    base = lm.length
    ids = torch.arange(100, 100 + n) % lm.vocab_size
    times = []
    for r in range(reps + 3):
        lm.rollback(base)
        t0 = time.perf_counter()
        logits, _ = lm.forward(ids, n_logits=n)
        if r >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), logits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="draft,target", help="roles of the default pair, or model paths / hub ids")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--lens", default="1,2,4,9", help="tokens per forward: 1 = a decode step, K + 1 = a verify")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="eval/results/bench_cpu_kernels")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lens = [int(x) for x in args.lens.split(",")]
    rows = []
    for name in args.models.split(","):
        role = name if name in ("draft", "target") else "target"
        path = None if name in ("draft", "target") else name
        stock, _ = load_model(path, role, args.dtype, "cpu", pack=False)
        packed, _ = load_model(path, role, args.dtype, "cpu")
        layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
        if not layers:
            print(f"{name}: nothing packed (no oneDNN, not bf16/fp16, or ADAPTIVE_SPEC_CPU_PACK=0)")
            continue
        pad_to = layers[0].pad_to
        print(f"{name}: padding chosen on this machine: {pad_to or 'none'} (pad_to[M] for M input rows)")
        nbytes = linear_bytes(stock)
        runners = {"stock": CausalLM(stock), "packed": CausalLM(packed), "packed+pad": CausalLM(packed)}
        prompt = torch.arange(200, 264) % stock.config.vocab_size  # 64 tokens: a realistic cache; content irrelevant
        times, logits = {}, {}
        for _ in range(args.rounds):
            for layout, lm in runners.items():
                for m in layers:  # the two packed layouts share one model: set its padding per layout
                    m.pad_to = pad_to if layout == "packed+pad" else ()
                for n in lens:
                    dt, lg = time_step(lm, prompt, n, args.reps)
                    times.setdefault((layout, n), []).append(dt)
                    logits[(layout, n)] = lg
        for layout in runners:
            for n in lens:
                dt = statistics.median(times[(layout, n)])
                diff = (logits[(layout, n)] - logits[("stock", n)]).abs().max().item()
                rows.append({"model": name, "layout": layout, "tokens": n, "ms": dt * 1e3,
                             "weight_GBps": nbytes / dt / 1e9, "linear_weight_GB": nbytes / 1e9,
                             "max_abs_logit_diff": diff, "pad_to": list(pad_to), "threads": args.threads,
                             "dtype": args.dtype, "rounds": args.rounds, "reps": args.reps})
        del stock, packed, runners
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| model | layout | tokens | ms/forward | GB/s of weights | speed-up vs stock | max abs logit diff |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        stock = next(s for s in rows if s["model"] == r["model"] and s["tokens"] == r["tokens"] and s["layout"] == "stock")
        lines.append(f"| {r['model']} | {r['layout']} | {r['tokens']} | {r['ms']:.1f} | {r['weight_GBps']:.1f} | "
                     f"{stock['ms'] / r['ms']:.2f}x | {r['max_abs_logit_diff']:.3g} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
