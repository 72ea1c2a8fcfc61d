"""GPU micro-benchmark of the static runtime, and a MODEL of end-to-end speculative speed-ups.

Random-initialised models with the real architectures (Qwen2.5 0.5B / 1.5B, optionally 7B):
weights' values do not change a forward's cost, so no download is needed. Batch 1. Measured,
per model and context length (prompt tokens already in the KV cache):

  * ms per draft step (1 token in, 1 logits row), per 2-token step, per step with the
    acceptance head in the same graph;
  * ms per verify pass of n = 1..verify_max tokens (all n logits rows);
  * autoregressive decoding: tokens/s of our Decoder (sampling and its per-token read
    included) and of the step alone, against the memory-bandwidth roofline
    (bytes of weights + KV read per token / the GPU's bandwidth);
  * the same AR tokens/s for transformers' own `generate` (its StaticCache, auto-compiled
    on CUDA), decode only (time(G tokens) - time(1 token));
  * the per-round sampling/verification work and its one host read.

GPU times come from CUDA events around loops with no host sync inside, after warm-up
(compile / CUDA-graph capture excluded). Then, with acceptance statistics measured elsewhere
(e.g. on CPU: an `adaptive-spec sweep` results.jsonl (`make bench`'s), or a JSON of
per-policy tokens-per-target-pass / discard rates), Eq. 5.1 of SpecDec++,

    T = t_draft * N_draft + t_target * N_target,

turns measured per-step times into ESTIMATED speed-ups per policy. That is a model, not a
measurement: it leaves out sampling, the per-round read and policy overheads (a second column
adds the measured per-round sampling work back), and assumes the CPU acceptance statistics
carry over to the GPU run (they do for the same models and dtype up to numerics).

    python eval/bench_gpu.py --device cuda --pairs default,large --stats runs/sweep/results.jsonl
    python eval/bench_gpu.py --device cpu --tiny            # smoke test (numbers meaningless)
    (on a machine without the package installed: PYTHONPATH=. python eval/bench_gpu.py ...)

Writes <out>/bench_gpu.json and <out>/bench_gpu.md (rewritten after every model, so an
interrupted run keeps what it measured).
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    from adaptive_spec.decoding.decoder import Decoder
except ImportError:  # a GPU machine with the checkout but no `pip install -e .`
    sys.exit("error: the adaptive_spec package is not importable; run `pip install -e .` in the checkout, "
             "or run this from its root as `PYTHONPATH=. python eval/bench_gpu.py ...`")
from adaptive_spec.backends import presets
from adaptive_spec.backends.presets import preset
from adaptive_spec.backends.static_runner import DRAFT_SHAPES, StaticCausalLM, verify_shapes
from adaptive_spec.decoding.policies import FixedK
from adaptive_spec.decoding.sampling import SamplingParams, process_logits, sample, verify
# shared with eval/gpu_check.py; load_stats, estimate, interp are read from this module by the tests
from adaptive_spec.evaluation.gpu_bench import (ESTIMATE_BANNER, estimate, fmt, interp, load_stats,  # noqa: F401
                                                lookup_bandwidth, measure_hf_generate, model_bytes, time_loop)

# the architectures are the GPU presets' (backends/presets.py: hub ids, shapes); "large" is the 1.5B/7B pair
_DEFAULT, _LARGE, _TINY = preset("default"), preset("qwen-1.5b-7b"), preset("default", tiny=True)
MODELS = {"qwen2.5-0.5b": _DEFAULT.draft, "qwen2.5-1.5b": _DEFAULT.target, "qwen2.5-7b": _LARGE.target,
          "tiny-draft": _TINY.draft, "tiny-target": _TINY.target}  # --tiny smoke test
PAIRS = {"default": ("qwen2.5-0.5b", "qwen2.5-1.5b"), "large": ("qwen2.5-1.5b", "qwen2.5-7b"),
         "tiny": ("tiny-draft", "tiny-target")}


def build_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    return presets.build_model(MODELS[name], dtype, device, seed)


# ---------------------------------------------------------------------------------------------
# our runtime


def measure_runner(lm: StaticCausalLM, contexts, verify_max: int, iters: int, gen_tokens: int, device) -> list[dict]:
    g = torch.Generator(device="cpu").manual_seed(0)
    V = lm.vocab_size
    prompt = torch.randint(0, V, (max(contexts),), generator=g).to(device)
    one, two = prompt[:1].clone(), prompt[:2].clone()
    chunks = {n: prompt[:n].clone() for n in range(1, verify_max + 2)}
    rows = []
    for c in contexts:
        lm.reset()
        lm.forward(prompt[:c], n_logits=0)  # prefill (eager), not timed

        def step(ids, n_logits, head=False):
            def f():
                lm.rollback(c)
                (lm.forward_with_head if head else lm.forward)(ids, n_logits)
            return f

        row = {"context": c,
               "step_ms": time_loop(step(one, 1), iters, device),
               "step2_ms": time_loop(step(two, 1), iters, device)}
        if lm.head is not None:
            row["step_head_ms"] = time_loop(step(one, 1, True), iters, device)
        row["verify_ms"] = {n: time_loop(step(chunks[n], n), iters, device) for n in range(1, verify_max + 2)}
        # autoregressive decoding through the Decoder: sampling + one read per token included
        dec = Decoder(lm)
        ids = prompt[:c].tolist()
        greedy = SamplingParams(0.0)
        dec.generate(ids, max_new_tokens=min(4, gen_tokens), sampling=greedy)  # warm
        runs = []
        for _ in range(3):
            m = dec.generate(ids, max_new_tokens=gen_tokens, sampling=greedy).metrics
            runs.append(m.n_tokens / max(m.wall_s - m.prefill_s, 1e-9))
        row["ar_decoder_tok_s"] = statistics.median(runs)
        row["ar_step_tok_s"] = 1000.0 / row["verify_ms"][1]
        rows.append(row)
    lm.reset()
    return rows


def measure_round_overhead(V: int, ks, iters: int, device) -> dict:
    """ms of the non-forward work of one round at vocabulary V (sampling at temperature 1):
    K draft-side process_logits + sample, target process_logits over K+1 rows, verify, and
    the round's one host read; and of one AR token (process_logits + sample + read)."""
    g = torch.Generator(device=device).manual_seed(0)
    params = SamplingParams(1.0)
    out = {}
    for K in ks:
        ql = torch.randn(K, V, device=device)
        pl = torch.randn(K + 1, V, device=device)

        def rnd():
            qs, ys = [], []
            for i in range(K):
                q = process_logits(ql[i], params)
                qs.append(q)
                ys.append(sample(q, g))
            y = torch.stack(ys)
            n, tok = verify(y, torch.stack(qs), process_logits(pl, params), g)
            torch.cat([n.view(1), tok.view(1), y]).tolist()

        out[K] = time_loop(rnd, iters, device, host=True)
    lg = torch.randn(1, V, device=device)
    out["ar_token"] = time_loop(lambda: int(sample(process_logits(lg[0], params), g)), iters, device, host=True)
    return out


# ---------------------------------------------------------------------------------------------
# transformers' generate


# ---------------------------------------------------------------------------------------------
# acceptance statistics -> Eq. 5.1


def tiny_stats(draft, target) -> list[dict]:
    """Acceptance counts of the tiny random pair itself (smoke test only: meaningless numbers)."""
    dec = Decoder(target, draft)
    rows = []
    for k in (2, 4):
        for s in range(2):
            m = dec.generate(list(range(1, 9)), max_new_tokens=16, sampling=SamplingParams(1.0), policy=FixedK(k),
                             seed=s).metrics
            rows.append({"config": f"fixed:k={k}", **m.to_dict()})
    return rows


# ---------------------------------------------------------------------------------------------
# report


def markdown(res: dict) -> str:
    env = res["env"]
    out = [f"# GPU runtime benchmark ({env['device_name']})", "",
           f"{env['dtype']}, batch 1, runtime `{env['runtime']}`, bandwidth {fmt(env['bandwidth_tbs'])} TB/s "
           f"({env['bandwidth_source']}); torch {env['torch']}, transformers {env['transformers']}; "
           f"{env['iters']} timed iterations per number, warm-up and compile/capture excluded; random weights "
           f"with the real architectures. Written {env['time']}.", ""]
    if env["device"] == "cpu":
        out += ["**CPU smoke run: these numbers say nothing about GPU speed.**", ""]
    for name, m in res["models"].items():
        if "error" in m:
            out += [f"## {name}", "", f"failed: {m['error']}", ""]
            continue
        if "skipped" in m:
            out += [f"## {name}", "", f"skipped: {m['skipped']}", ""]
            continue
        b = m["bytes"]
        out += [f"## {name}", "",
                f"{b['n_params'] / 1e6:.1f} M params, {b['weight_bytes_read_per_token'] / 1e6:.1f} MB of weights read "
                f"per token, KV {m['kv_bytes_per_slot'] / 1024:.1f} KiB per position; static cache "
                f"{m['max_cache_len']} slots (attention reads all of them, masked); graph warm-up "
                f"{fmt(m['warmup_s'], 1)} s.", ""]
        vn = [n for n in (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 17) if n in m["rows"][0]["verify_ms"]]
        hdr = ["ctx", "step ms", "2-tok step ms", "step+head ms"] + [f"verify {n}" for n in vn] + \
              ["AR tok/s (Decoder)", "AR tok/s (step)", "roofline tok/s", "% roofline", "HF generate tok/s"]
        out += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
        for r in m["rows"]:
            hf = m.get("hf_generate", {}).get(r["context"]) if isinstance(m.get("hf_generate"), dict) else None
            cells = [str(r["context"]), fmt(r["step_ms"], 3), fmt(r["step2_ms"], 3), fmt(r.get("step_head_ms"), 3)] + \
                    [fmt(r["verify_ms"][n], 3) for n in vn] + \
                    [fmt(r["ar_decoder_tok_s"], 1), fmt(r["ar_step_tok_s"], 1), fmt(r.get("roofline_tok_s"), 1),
                     fmt(100 * r["ar_step_tok_s"] / r["roofline_tok_s"], 1) if r.get("roofline_tok_s") else "-",
                     fmt(hf, 1)]
            out.append("| " + " | ".join(cells) + " |")
        if isinstance(m.get("hf_generate"), dict) and m["hf_generate"].get("error"):
            out.append(f"\nHF generate failed: {m['hf_generate']['error']}")
        out.append("")
    if res.get("round_overhead_ms"):
        ov = res["round_overhead_ms"]
        out += ["Per-round sampling + verification + the one host read (t=1, V=%d): " % res["round_overhead_vocab"] +
                ", ".join(f"K={k}: {fmt(v, 3)} ms" for k, v in ov.items() if k != "ar_token") +
                f"; per AR token: {fmt(ov.get('ar_token'), 3)} ms.", ""]
    for pair, est in res.get("estimates", {}).items():
        out += [f"## Estimated speed-ups, pair {pair}", "", f"**{ESTIMATE_BANNER}**", "",
                "L = 1 + K_mean is the mean verify length; t_target is the measured verify time at L; the AR "
                "reference is the target's 1-token step. '+ overhead' adds the measured per-round sampling/"
                "verify/read time (and the per-token one to AR).", "",
                "| ctx | policy | tok/target pass | N_discarded/N | N_draft/N | L | t_draft ms | t_target(L) ms | "
                "est. ms/token | **est. speed-up** | est. speed-up + overhead |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for e in est:
            out.append(f"| {e['context']} | {e['policy']} | {fmt(e['tokens_per_target_forward'])} | "
                       f"{fmt(e['discard_rate'], 3)} | {fmt(e['draft_per_token'], 3)} | {fmt(1 + e['k_mean'])} | "
                       f"{fmt(e['t_draft_ms'], 3)} | {fmt(e['t_target_ms'], 3)} | {fmt(e['est_ms_per_token'], 3)} | "
                       f"**{fmt(e['est_speedup'])}** | {fmt(e.get('est_speedup_with_overhead'))} |")
        out.append("")
    if res.get("notes"):
        out += ["Notes:", ""] + [f"- {n}" for n in res["notes"]] + [""]
    return "\n".join(out)


def write(res: dict, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (out / "bench_gpu.md").write_text(markdown(res) + "\n")


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="small configs, few iterations: a smoke test (CPU is fine)")
    ap.add_argument("--pairs", default=None, help="comma list of: default (0.5B/1.5B), large (1.5B/7B), tiny")
    ap.add_argument("--contexts", default=None, help="prompt lengths in the cache (default 128,256,512,1024)")
    ap.add_argument("--verify-max", type=int, default=None, help="verify lengths 1..N (default 16; K_max = N - 1)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per number (default 50)")
    ap.add_argument("--gen-tokens", type=int, default=None, help="tokens per AR decode run (default 64)")
    ap.add_argument("--dtype", default=None, help="bf16 (default on CUDA) | fp16 | fp32 (default on CPU)")
    ap.add_argument("--runtime", default=None, choices=["eager", "cudagraph", "compile"],
                    help="eager | cudagraph (torch.cuda.CUDAGraph per shape; default on CUDA) | compile "
                         "(torch.compile reduce-overhead per shape; minutes of compile per model)")
    ap.add_argument("--bandwidth-tbs", type=float, default=None, help="memory bandwidth in TB/s (default: by device)")
    ap.add_argument("--stats", action="append", default=[],
                    help="acceptance statistics (a sweep's results.jsonl, or JSON); repeatable")
    ap.add_argument("--head-depth", type=int, default=3, help="acceptance head in the draft step (-1: none)")
    ap.add_argument("--no-hf-generate", action="store_true", help="skip transformers' generate baseline")
    ap.add_argument("--hf-repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads (default: 1 for a --tiny CPU run, whose tensors are too small to share)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench_gpu")
    return ap.parse_args(argv)


def resolve_flags(args) -> bool:
    """Fills in, in place, the flags left unset with the defaults of a --tiny or a full run on the
    device (args.device becomes a torch.device, args.dtype a torch.dtype, args.pairs and
    args.contexts lists) and sets the CPU threads; False, after saying why, when they cannot run."""
    device = args.device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available; use --device cpu --tiny for a smoke test",
              file=sys.stderr)
        return False
    tiny = args.tiny
    threads = args.threads or (1 if tiny and device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    args.pairs = (args.pairs or ("tiny" if tiny else "default")).split(",")
    for p in args.pairs:
        if p not in PAIRS:
            print(f"error: unknown pair {p!r}; choose from {', '.join(PAIRS)}", file=sys.stderr)
            return False
    args.contexts = [int(c) for c in (args.contexts or ("16,32" if tiny else "128,256,512,1024")).split(",")]
    args.verify_max = args.verify_max or (4 if tiny else 16)
    args.iters = args.iters or (3 if tiny else 50)
    args.gen_tokens = args.gen_tokens or (8 if tiny else 64)
    args.hf_repeats = args.hf_repeats or (1 if tiny else 3)
    args.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    args.runtime = args.runtime or ("cudagraph" if device.type == "cuda" else "eager")
    if args.runtime != "eager" and device.type != "cuda":
        print(f"note: runtime {args.runtime} needs CUDA; running eager on {device}", file=sys.stderr)
        args.runtime = "eager"
    return True


def environment(args, bw: float | None, bw_src: str) -> dict:
    import transformers

    device = args.device
    return {"device": device.type, "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or "cpu", "dtype": str(args.dtype).replace("torch.", ""),
            "runtime": args.runtime, "bandwidth_tbs": bw / 1e12 if bw else None, "bandwidth_source": bw_src,
            "torch": torch.__version__, "transformers": transformers.__version__, "iters": args.iters,
            "contexts": args.contexts, "verify_max": args.verify_max, "gen_tokens": args.gen_tokens,
            "threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%d %H:%M")}


def memory_shortfall(name: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why model `name` would not fit in the GPU's free memory (its parameters, 30% headroom), or None
    when it fits."""
    need = MODELS[name].n_params() * torch.finfo(dtype).bits // 8 * 1.3
    free = torch.cuda.mem_get_info(device)[0]
    if need > free:
        return f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return None


def build_runner(name: str, args, is_draft: bool, max_cache: int, entry: dict):
    """The random-weight model and its StaticCausalLM (a draft's with the acceptance head), warmed
    up / captured for every draft and verify shape; records warm-up time and sizes in entry."""
    model = build_model(name, args.dtype, args.device, args.seed)
    head = None
    if is_draft and args.head_depth >= 0:
        from adaptive_spec.heads.head import AcceptanceHead

        head = AcceptanceHead(model.config.hidden_size, depth=args.head_depth).to(args.device).eval()
    lm = StaticCausalLM(model, max_cache_len=max_cache, head=head, compile=args.runtime == "compile",
                        cuda_graphs=args.runtime == "cudagraph")
    shapes = list(dict.fromkeys(DRAFT_SHAPES + verify_shapes(args.verify_max)))
    print(f"[{name}] warm-up / capture of {len(shapes)} shapes ({args.runtime})", file=sys.stderr, flush=True)
    entry["warmup_s"] = lm.warmup(shapes, with_head=False)
    if head is not None:
        entry["warmup_s"] += lm.warmup([(1, 1)], with_head=True)
    entry.update(bytes=model_bytes(model), kv_bytes_per_slot=lm.kv_bytes_per_slot, max_cache_len=max_cache,
                 config={k: v for k, v in MODELS[name].config().items() if k != "rope_parameters"})
    return model, lm


def measure_model(name: str, model, lm: StaticCausalLM, args, bw: float | None, res: dict, entry: dict) -> None:
    """entry's per-context rows (against the roofline) and transformers' generate baseline; the
    first model measured also gives res its per-round overhead."""
    print(f"[{name}] measuring", file=sys.stderr, flush=True)
    rows = measure_runner(lm, args.contexts, args.verify_max, args.iters, args.gen_tokens, args.device)
    for r in rows:
        kv = lm.kv_bytes_per_slot * r["context"]
        r["bytes_per_token"] = entry["bytes"]["weight_bytes_read_per_token"] + kv
        r["roofline_tok_s"] = bw / r["bytes_per_token"] if bw else None
    entry["rows"] = rows
    if not args.no_hf_generate:
        print(f"[{name}] transformers generate", file=sys.stderr, flush=True)
        try:
            entry["hf_generate"] = measure_hf_generate(model, args.contexts, args.gen_tokens, args.hf_repeats,
                                                       args.device)
        except Exception as e:  # a baseline failing must not lose our numbers
            entry["hf_generate"] = {"error": f"{type(e).__name__}: {e}"}
    if "round_overhead_ms" not in res:
        res["round_overhead_vocab"] = lm.vocab_size
        res["round_overhead_ms"] = measure_round_overhead(lm.vocab_size, (1, 2, 4, 8, min(16, args.verify_max)),
                                                          max(args.iters // 2, 3), args.device)


def add_estimates(args, res: dict, tiny_rows, out: Path) -> None:
    """Eq. 5.1 estimates per pair from the --stats acceptance statistics (in a --tiny run without
    them, from the tiny pair's own)."""
    stats = load_stats(args.stats) if args.stats else {}
    if args.tiny and not args.stats and tiny_rows and len(tiny_rows) == 2:
        # smoke test: acceptance counts of the tiny random pair itself, through the static runners
        lms = dict(tiny_rows)
        rows = tiny_stats(lms[PAIRS["tiny"][0]], lms[PAIRS["tiny"][1]])
        path = out / "tiny_stats.jsonl"
        out.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        stats = load_stats([path])
        res["notes"].append(f"acceptance statistics of the tiny random pair ({path}): smoke test only")
    if stats:
        res["stats"] = stats
        for p in args.pairs:
            d, t = (res["models"].get(m, {}) for m in PAIRS[p])
            if "rows" in d and "rows" in t:
                res["estimates"][p] = estimate(stats, d["rows"], t["rows"], res.get("round_overhead_ms"))
        print("\n" + ESTIMATE_BANNER, file=sys.stderr)
    else:
        res["notes"].append("no --stats given: no speed-up estimates")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not resolve_flags(args):
        return 2
    device, tiny = args.device, args.tiny
    bw, bw_src = lookup_bandwidth(device, args.bandwidth_tbs)
    out = Path(args.out)
    res = {"env": environment(args, bw, bw_src), "models": {}, "estimates": {}, "notes": []}
    if device.type == "cpu":
        res["notes"].append("CPU smoke run: numbers say nothing about GPU speed")
    max_cache = max(args.contexts) + max(args.verify_max + 1, args.gen_tokens) + 8
    names = list(dict.fromkeys(m for p in args.pairs for m in PAIRS[p]))
    draft_names = {PAIRS[p][0] for p in args.pairs}
    tiny_rows = None
    for name in names:
        t0 = time.perf_counter()
        print(f"[{name}] building", file=sys.stderr, flush=True)
        entry = res["models"][name] = {}
        model = lm = None
        try:
            if device.type == "cuda" and (why := memory_shortfall(name, args.dtype, device)):
                entry["skipped"] = why
                write(res, out)
                continue
            model, lm = build_runner(name, args, name in draft_names, max_cache, entry)
            measure_model(name, model, lm, args, bw, res, entry)
            if tiny and not args.stats:
                tiny_rows = tiny_rows or []
                tiny_rows.append((name, lm))
        except Exception as e:
            import traceback

            traceback.print_exc()
            entry["error"] = f"{type(e).__name__}: {e}"
        entry["total_s"] = time.perf_counter() - t0
        if not (tiny and not args.stats):
            del lm, model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        write(res, out)

    add_estimates(args, res, tiny_rows, out)
    write(res, out)
    print(markdown(res))
    print(f"\nwrote {out / 'bench_gpu.json'} and {out / 'bench_gpu.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
