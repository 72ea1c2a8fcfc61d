"""The one prepared GPU check (issue 47): ONE call of at most 8 minutes on a lent GPU writes ONE report.

Random weights with the real shapes (backends/presets.py), batch 1; on CUDA bf16, except where named:

  1. exactness on the device: the sampled output distribution of speculative decoding through each graph
     runtime (CUDA graphs, the fused runner, torch.compile) against the target's enumerated one (chi-square,
     tiny models, vocabulary 5, 3 tokens: evaluation/exactness.py, the tests' check); fp32 greedy speculative
     == greedy target-alone at the real shapes (a difference is counted where the top two logits nearly tie);
  2. per model and runtime (eager, cudagraph, fused, compile): ms per one-token step and per verify pass of
     1..9 rows, % of the memory-bandwidth roofline, kernels per step (fused.step_launches: the profiler's
     CUDA kernels; on CPU the aten ops), and transformers' `generate` (StaticCache, compiled on CUDA);
  3. replay ("measured, not modelled"): the committed traces (a sweep with record_trace: real weights on a
     CPU) replayed per pair and policy (the target alone, each fixed K, SpecDec++) through the real decoder on
     the fastest graph runtime (decoding/replay.py: the recorded K per round, the recorded acceptance), the
     counts checked against the recorded ones; beside each, Eq. 5.1's estimate from the step times of 2. A
     pair other than the traces' replays BORROWED acceptance, and says so;
  4. transformers' assisted generation on the same models (random weights: its acceptance is theirs).

Everything optional (torch.compile, transformers' compiled generate) runs last and only while the time
budget (--budget-s) allows; each phase prints a progress line and its elapsed seconds.

    make gpu-check                                   # on the GPU machine: python3, wheels from .whl/
    python eval/gpu_check.py --tiny --device cpu     # the whole check on tiny shapes: under a minute on 2 cores
    python eval/gpu_check.py --fetch-wheels          # here, once: the wheels a GPU machine lacks (pydantic)
    python eval/gpu_check.py --report-only --out DIR # report.md again from DIR/gpu_check.json

Writes <out>/report.md, <out>/gpu_check.json and <out>/run.json (out: --out, else $OUT, else
runs/gpu_check); the report is rewritten after every phase, so a run stopped early keeps what it measured.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

T0 = time.perf_counter()

import torch  # noqa: E402

try:
    from adaptive_spec.backends import presets  # noqa: E402
    from adaptive_spec.backends.models import CausalLM  # noqa: E402
    from adaptive_spec.backends import static_runner  # noqa: E402
    from adaptive_spec.backends.static_runner import DRAFT_SHAPES, StaticCausalLM, verify_shapes  # noqa: E402
    from adaptive_spec.backends.toy import make_model  # noqa: E402
    from adaptive_spec.decoding.decoder import Decoder  # noqa: E402
    from adaptive_spec.decoding.policies import FixedK, LearnedThreshold  # noqa: E402
    from adaptive_spec.decoding.replay import replay_generate  # noqa: E402
    from adaptive_spec.decoding.sampling import SamplingParams  # noqa: E402
    from adaptive_spec.evaluation.exactness import chi_square_pvalue, exact_sequence_probs, sample_counts  # noqa: E402
    from adaptive_spec.evaluation.gpu_bench import (estimate, fmt, lookup_bandwidth, measure_hf_generate,  # noqa: E402
                                                    model_bytes, stats_of, sync, time_loop)
    from adaptive_spec.heads.head import AcceptanceHead, load_head  # noqa: E402
except ModuleNotFoundError as e:  # a lent GPU machine: the checkout, torch and transformers, no pydantic
    sys.exit(f"error: {e.name} is not importable; on a GPU machine install the carried wheels first "
             "(`make gpu-check` does; make them here with `python eval/gpu_check.py --fetch-wheels`), or run from "
             "the checkout's root as `PYTHONPATH=. python eval/gpu_check.py`")
from adaptive_spec.backends import fused  # noqa: E402
from adaptive_spec.backends.static_runner import FusedCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRACES = "eval/results/sweep_gpu_traces"  # configs/sweep/gpu_traces.yaml: the default pair, on a CPU
JSON, REPORT = "gpu_check.json", "report.md"
VERIFY_ROWS = range(1, 10)  # the table's verify passes: 1..9 rows (K = 0..8)
WHEELS = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions")
NEAR_TIE = 1e-3  # fp32 logits closer than this may order differently in a 1-row and a K+1-row pass


def say(phase: str, msg: str) -> None:
    print(f"[gpu-check {time.perf_counter() - T0:6.1f}s] {phase}: {msg}", file=sys.stderr, flush=True)


class Budget:
    """The run's time budget: optional work runs only while what it is expected to take is left."""

    def __init__(self, seconds: float):
        self.end = T0 + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def allows(self, need_s: float) -> bool:
        return self.left() > need_s


# ----------------------------------------------------------------------------- set-up

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes of the same pairs (a CPU smoke run)")
    ap.add_argument("--pairs", default="default,coder-0.5b-7b,coder-1.5b-7b",
                    help=f"presets to time and replay on ({', '.join(presets.PRESETS)})")
    ap.add_argument("--traces", default=TRACES, help="a sweep folder recorded with record_trace: true")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run (default 400; --tiny 120)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per number (default 20; --tiny 2)")
    ap.add_argument("--samples", type=int, default=None, help="generations per chi-square (default 2000; --tiny 400)")
    ap.add_argument("--compile-lengths", default="1,2,4", help="verify lengths torch.compile compiles (and times)")
    ap.add_argument("--bandwidth-tbs", type=float, default=None, help="memory bandwidth in TB/s (default: by device)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check")
    ap.add_argument("--report-only", action="store_true", help="rewrite report.md from the folder's gpu_check.json")
    ap.add_argument("--fetch-wheels", action="store_true", help="download the wheels a GPU machine lacks into .whl/")
    args = ap.parse_args(argv)
    args.device = torch.device(args.device)
    args.budget_s = args.budget_s or (120.0 if args.tiny else 400.0)
    args.iters = args.iters or (2 if args.tiny else 20)
    args.samples = args.samples or (400 if args.tiny else 2000)
    if args.samples < 300:  # fewer, and every cell's expected count is under 5: all pooled, no test left
        ap.error(f"--samples must be >= 300 for the chi-square test, got {args.samples}")
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    return args


def fetch_wheels(dest: Path) -> int:
    """The wheels of what the GPU image lacks (pydantic and its needs), at this checkout's versions, for
    CPython 3.12 on x86-64 Linux (the GPU machine's), into `dest` (git ignores /.whl/)."""
    from importlib.metadata import version

    plats = [a for n in (28, 27, 17) for a in ("--platform", f"manylinux_2_{n}_x86_64")] + \
        ["--platform", "manylinux2014_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *plats, "-d", str(dest), *(f"{n}=={version(n)}" for n in WHEELS)]
    return subprocess.run(cmd).returncode


def environment(args, bw, bw_src) -> dict:
    import transformers

    cuda = args.device.type == "cuda"
    return {"device": args.device.type, "device_name": torch.cuda.get_device_name(args.device) if cuda
            else platform.processor() or "cpu", "dtype": "bfloat16" if cuda else "float32", "tiny": args.tiny,
            "bandwidth_tbs": bw / 1e12 if bw else None, "bandwidth_source": bw_src, "torch": torch.__version__,
            "transformers": transformers.__version__, "iters": args.iters, "budget_s": args.budget_s,
            "time": time.strftime("%Y-%m-%d %H:%M")}


def load_traces(folder: Path) -> dict:
    """The trace sweep: its rows by config (in grid order), sampling, head folders and the pair that made it."""
    cfg = json.loads((folder / "config.json").read_text())
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "trace" in r]
    if not rows:
        raise SystemExit(f"error: {folder} holds no traces; record them with a sweep with record_trace: true "
                         "(configs/sweep/gpu_traces.yaml)")
    by_config: dict = {}
    for r in rows:
        by_config.setdefault(r["config"], []).append(r)
    c = cfg["config"]
    shown = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder  # the report reads the same anywhere
    return {"folder": str(shown), "pair": cfg.get("trace_pair", {}), "by_config": by_config,
            "sampling": SamplingParams(c["temperature"], c["top_k"], c["top_p"]), "heads": c.get("heads", []),
            "k_max": c.get("k_max", 20), "max_k": max((k for r in rows for k, _, _ in r["trace"]), default=1),
            "max_len": max(r["n_prompt_tokens"] + r["n_tokens"] for r in rows),
            "context": int(statistics.median(r["n_prompt_tokens"] + r["n_tokens"] // 2 for r in rows))}


def free() -> None:
    """Give back what the caller dropped (the GPU's cached blocks too)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- runners

def runtimes(device: torch.device) -> list[str]:
    """The runtimes this device runs without compiling ("fused": FusedCausalLM, captured with CUDA graphs on
    CUDA); torch.compile is timed apart (phase 5)."""
    return ["eager"] + (["cudagraph"] if device.type == "cuda" else []) + ["fused"]


def make_runner(model, runtime: str, vocab: int, max_cache: int, shapes) -> tuple:
    """(runner, warm-up seconds) of `model` on `runtime`, every shape in `shapes` captured or compiled."""
    cuda = next(model.parameters()).device.type == "cuda"
    kw = dict(max_cache_len=max_cache, cuda_graphs=cuda and runtime in ("cudagraph", "fused"),
              compile=runtime.endswith("compile"))
    lm = (FusedCausalLM if runtime.startswith("fused") else StaticCausalLM)(model, vocab, **kw)
    return lm, lm.warmup(shapes)


def time_runner(lm, ctx: int, iters: int, device, lengths=VERIFY_ROWS) -> dict:
    """ms of a one-token step and of verify passes of n rows (all n scored) after ctx cached positions."""
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, lm.vocab_size, (ctx + max(lengths),), generator=g).to(device)
    lm.reset()
    lm.forward(ids[:ctx], n_logits=0)

    def step(n, n_logits):
        chunk = ids[ctx:ctx + n].clone()

        def f():
            lm.rollback(ctx)
            lm.forward(chunk, n_logits)
        return f

    out = {"step_ms": time_loop(step(1, 1), iters, device),
           "verify_ms": {n: time_loop(step(n, n), iters, device) for n in lengths}}
    lm.reset()
    lm.counters.restart()
    return out


def launches(lm, res) -> int | None:
    """Kernels one step launches (the profiler's, CUDA) or aten ops it dispatches (CPU); None without the
    fused module's counter, or where counting fails (noted: the step times stand without it)."""
    try:
        lm.reset()
        lm.forward(torch.zeros(4, dtype=torch.long, device=lm.device), n_logits=0)
        got = fused.step_launches(lm, 1, 1)
        return got["cuda_kernels"] if got.get("cuda_kernels") is not None else got["compute_ops"]
    except Exception as e:
        res["notes"].append(f"kernel count of a {type(lm).__name__} step failed: {type(e).__name__}: {e}")
        return None
    finally:
        lm.reset()
        lm.counters.restart()


# ----------------------------------------------------------------------------- 1. exactness

def check_distribution(args, res, budget, runtime_names) -> None:
    """Chi-square of speculative sampling (fixed K = 2, T = 1) through each runtime against the target's
    enumerated distribution of 3-token continuations over a 5-token vocabulary."""
    V, L, K, prompt = 5, 3, 2, [1, 2]
    dev = args.device
    target = make_model(V, hidden_size=16, layers=1, seed=3, logit_scale=3.0).to(dev)
    draft = make_model(V, hidden_size=16, layers=1, seed=4, logit_scale=3.0).to(dev)
    params = SamplingParams(1.0)
    probs = exact_sequence_probs(CausalLM(target), prompt, params, V, L)
    rows = res["exactness"]["distribution"]
    for rt in runtime_names:
        t0 = time.perf_counter()
        try:
            t, _ = make_runner(target, rt, V, 16, verify_shapes(K))
            d, _ = make_runner(draft, rt, V, 16, DRAFT_SHAPES)
            counts = sample_counts(Decoder(t, d), prompt, params, FixedK(K), args.samples, L)
            p = chi_square_pvalue(counts, probs, args.samples)
            rows.append({"runtime": rt, "policy": f"fixed K={K}", "samples": args.samples, "p_value": p,
                         "pass": p > 1e-3, "s": time.perf_counter() - t0})
        except Exception as e:  # a runtime that fails is a finding: keep it and go on
            rows.append({"runtime": rt, "error": f"{type(e).__name__}: {e}", "pass": False})
        say("1 exactness", f"chi-square through {rt}: {rows[-1].get('p_value', rows[-1].get('error'))}")
        if not budget.allows(30):
            break


def check_greedy(args, res, pair, runtime_names) -> None:
    """fp32 greedy speculative decoding (fixed K = 4) against greedy target-alone at the pair's shapes, through
    each runtime: equal, or first different where the target's top two logits nearly tie (the K+1-row pass
    and the one-row step run different kernels)."""
    dev, n_new = args.device, 24 if args.tiny else 48
    torch.backends.cuda.matmul.allow_tf32 = False
    draft_m, target_m = presets.build_pair(pair, torch.float32, dev, seed=5)
    V = pair.vocab_size
    prompt = torch.randint(0, V, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    greedy = SamplingParams(0.0)
    for rt in runtime_names:
        entry = {"pair": pair.name, "dtype": "float32", "runtime": rt, "tokens": n_new, "K": 4}
        res["exactness"]["greedy"].append(entry)
        try:
            t, _ = make_runner(target_m, rt, V, 128, list(dict.fromkeys(DRAFT_SHAPES + verify_shapes(4))))
            d, _ = make_runner(draft_m, rt, V, 128, DRAFT_SHAPES)
            ar = Decoder(t).generate(prompt, n_new, greedy).token_ids
            spec = Decoder(t, d).generate(prompt, n_new, greedy, FixedK(4)).token_ids
            j = next((i for i, (a, b) in enumerate(zip(ar, spec)) if a != b), None)
            entry.update(equal=ar == spec, first_difference=j)
            if j is not None:  # the target's own margin there, from a plain eager pass
                logits, _ = CausalLM(target_m, V).forward(torch.tensor(prompt + ar[:j], device=dev), 1)
                top = logits[0].topk(2).values
                entry.update(margin=float(top[0] - top[1]), near_tie=float(top[0] - top[1]) < NEAR_TIE)
            entry["pass"] = entry["equal"] or entry.get("near_tie", False)
            del t, d
        except Exception as e:
            entry.update(error=f"{type(e).__name__}: {e}", equal=False, first_difference=None)
            entry["pass"] = False
        say("1 exactness", f"fp32 greedy speculative == target alone ({pair.name}, {rt}): "
            f"{entry.get('error') or entry['equal']}")
    del draft_m, target_m
    free()


# ----------------------------------------------------------------------------- 2. runtimes

def time_models(args, res, budget, pairs, bw, ctx, max_cache, shapes) -> dict:
    """Per model of the pairs: each non-compiling runtime's table; returns {hub id: (model, fastest runner)}."""
    kept = {}
    shapes_list = list(dict.fromkeys(DRAFT_SHAPES + shapes))
    vocab = {p.vocab_size for p in pairs}
    if len(vocab) != 1:
        raise SystemExit(f"error: the pairs {', '.join(p.name for p in pairs)} have different vocabularies; "
                         "check them in separate runs")
    vocab = vocab.pop()
    for shape in dict.fromkeys(s for p in pairs for s in (p.draft, p.target)):
        if not budget.allows(20):
            res["notes"].append(f"{shape.hub_id}: not timed (time budget)")
            continue
        say("2 runtimes", f"{shape.hub_id}: building ({shape.n_params() / 1e6:.0f} M parameters)")
        model = presets.build_model(shape, args.dtype, args.device)
        b = model_bytes(model)
        entry = res["models"][shape.hub_id] = {"bytes": b, "context": ctx, "max_cache_len": max_cache,
                                              "rows": {}}
        made = {}
        for rt in runtimes(args.device):
            try:
                lm, warm = make_runner(model, rt, vocab, max_cache, [(1, 1)] if rt == "eager" else shapes_list)
                row = {"warmup_s": warm, **time_runner(lm, ctx, args.iters, args.device), "kernels": launches(lm, res)}
                kv = lm.kv_bytes_per_slot * ctx
                row["roofline_ms"] = (b["weight_bytes_read_per_token"] + kv) / bw * 1000 if bw else None
                entry["rows"][rt], made[rt] = row, lm
                say("2 runtimes", f"{shape.hub_id} {rt}: step {row['step_ms']:.3f} ms, verify 9 rows "
                    f"{row['verify_ms'][9]:.3f} ms, kernels {row['kernels']}")
            except Exception as e:
                entry["rows"][rt] = {"error": f"{type(e).__name__}: {e}"}
                say("2 runtimes", f"{shape.hub_id} {rt}: failed: {e}")
        # the replays run on the fastest one-token step (eager only where nothing else runs)
        graphs = [rt for rt in made if rt != "eager"] or list(made)
        best = min(graphs, key=lambda rt: entry["rows"][rt]["step_ms"], default=None)
        entry["replay_runtime"] = best
        kept[shape.hub_id] = (model, made.get(best))
        del made
        free()
        write(res, Path(args.out))
    return kept


# ----------------------------------------------------------------------------- 3. replay

def inner_policy(row: dict, traces: dict, draft_lm, device):
    """The recorded policy's stop rule for these runners (asked at every drafted step, for its cost): the
    trace's own head where the draft has its hidden size, else a random head of the same depth."""
    if row["method"] == "fixed":
        return FixedK(int(row["k"]))
    if row["method"] != "learned":
        return None
    path = next((h for h in traces["heads"] if Path(h).name == row["head"] or row["head"] in h), None)
    info = json.loads((ROOT / path / "config.json").read_text()) if path else {}
    if info.get("hidden_size") == draft_lm.hidden_size:
        head = load_head(str(ROOT / path), hidden_size=draft_lm.hidden_size, device=device)
    else:
        head = AcceptanceHead(draft_lm.hidden_size, depth=info.get("depth", 3)).to(device).eval()
    return LearnedThreshold(head, row["h"], traces["k_max"])


def acceptance_label(pair: str, source: str | None) -> str:
    """What a replay on preset `pair` measures, given the preset that recorded the traces (`source`)."""
    base, tiny = pair.split(":")[0], pair.endswith(":tiny")
    shapes = " (on tiny shapes of it)" if tiny else ""
    if base == source:
        return f"measured acceptance: the traces' own pair{shapes}"
    return f"BORROWED acceptance: traces of {source or 'a pair of no preset'} replayed on {pair}'s shapes"


def replay_pair(args, res, budget, pair, kept, traces) -> None:
    """Every trace row replayed on the pair's fastest runners; per policy tok/s, speed-up, counts check."""
    draft, target = kept[pair.draft.hub_id][1], kept[pair.target.hub_id][1]
    label = acceptance_label(pair.name, traces["pair"].get("preset"))
    out = {"pair": pair.name, "hub_ids": list(pair.hub_ids), "label": label, "policies": []}
    res["replay"].append(out)
    for config, rows in traces["by_config"].items():
        if not budget.allows(15):
            res["notes"].append(f"replay {pair.name} {config}: skipped (time budget)")
            continue
        inner = inner_policy(rows[0], traces, draft, args.device)
        sampling = traces["sampling"]
        tokens, decode_s, reproduced = 0, 0.0, True
        for i, r in enumerate([rows[0]] + rows):  # the first, once untimed: allocation and first replays
            g = torch.Generator().manual_seed(r["seed"])
            prompt = torch.randint(0, pair.vocab_size, (r["n_prompt_tokens"],), generator=g).tolist()
            m = replay_generate(target, draft, prompt, r["n_tokens"], r["trace"] or None, inner, sampling,
                                seed=r["seed"]).metrics
            if i == 0:
                continue
            tokens += m.n_tokens
            decode_s += m.wall_s - m.prefill_s
            got = m.to_dict()
            reproduced &= all(got[k] == r[k] for k in ("n_tokens", "n_drafted", "n_accepted", "accepted_hist"))
        stats = next(iter(stats_of(rows).values()), None)  # None for the target alone: nothing to model
        out["policies"].append({"config": config, "method": rows[0]["method"], "rows": len(rows), "tokens": tokens,
                                "decode_s": decode_s, "tok_s": tokens / decode_s if decode_s else None,
                                "counts_reproduced": reproduced, "stats": stats})
        say("3 replay", f"{pair.name} {config}: {tokens / max(decode_s, 1e-9):.1f} tok/s, counts reproduced "
            f"{reproduced}")
    ar = next((p["tok_s"] for p in out["policies"] if p["method"] == "ar"), None)
    tables = (res["models"][pair.draft.hub_id], res["models"][pair.target.hub_id])
    d_row, t_row = (tab["rows"].get(tab.get("replay_runtime"), {}) for tab in tables)
    for p in out["policies"]:
        p["speedup"] = p["tok_s"] / ar if ar and p["tok_s"] else None
        if p["stats"] and "step_ms" in d_row and "verify_ms" in t_row:  # Eq. 5.1 from phase 2's step times
            e = estimate({p["config"]: p["stats"]}, [{"context": 0, "step_ms": d_row["step_ms"]}],
                         [{"context": 0, "verify_ms": t_row["verify_ms"]}], None)[0]
            p.update(est_speedup=e["est_speedup"], k_mean=e["k_mean"])
    fixed = [p for p in out["policies"] if p["method"] == "fixed" and p["tok_s"]]
    out["best_fixed"] = max(fixed, key=lambda p: p["tok_s"])["config"] if fixed else None


# ----------------------------------------------------------------------------- 4. assisted generation

def assisted(args, res, budget, pair, kept) -> None:
    """transformers' assisted generation (greedy, its default schedule) against its target alone."""
    model_d, model_t = kept[pair.draft.hub_id][0], kept[pair.target.hub_id][0]
    n_new, dev = (16 if args.tiny else 64), args.device
    entry = {"pair": pair.name}
    res["assisted"].append(entry)
    if pair.draft.vocab_rows != pair.target.vocab_rows:
        # transformers refuses output layers of different sizes without both tokenizers (universal assisted
        # decoding); a user pads the draft's: a draft of the padded shape (its own random weights)
        model_d = presets.build_model(replace(pair.draft, vocab_rows=pair.target.vocab_rows), args.dtype, dev)
        entry["note"] = f"draft output layer padded to the target's {pair.target.vocab_rows} rows"
    ids = torch.randint(0, pair.vocab_size, (1, 128), generator=torch.Generator().manual_seed(3)).to(dev)
    passes = [0]
    hook = model_t.register_forward_pre_hook(lambda m, a: passes.__setitem__(0, passes[0] + 1))

    def run(**kw) -> float:
        sync(dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model_t.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                   min_new_tokens=n_new, do_sample=False, pad_token_id=0, **kw)
        sync(dev)
        assert out.shape[1] == ids.shape[1] + n_new
        return time.perf_counter() - t0

    try:
        for name, kw in (("target_alone", {}), ("assisted", {"assistant_model": model_d})):
            run(**kw)  # warm-up
            passes[0] = 0
            entry[f"{name}_tok_s"] = n_new / run(**kw)
            entry[f"{name}_target_passes"] = passes[0]
        entry["ratio"] = entry["assisted_tok_s"] / entry["target_alone_tok_s"]
    except Exception as e:
        entry["error"] = f"{type(e).__name__}: {e}"
    finally:
        hook.remove()
    del model_d
    free()
    say("4 assisted", f"{pair.name}: {entry.get('ratio', entry.get('error'))}")


# ----------------------------------------------------------------------------- 5. compile (optional)

def compiled(args, res, budget, kept, vocab, ctx, max_cache, pairs) -> None:
    """While the budget allows, targets first: torch.compile ("reduce-overhead": inductor kernels in CUDA
    graphs) of the one-token step and the --compile-lengths verify passes, one shape at a time, each only when
    the last one's compile time is still left; transformers' compiled generate; the chi-square through it."""
    lengths = [1] + [int(n) for n in args.compile_lengths.split(",") if int(n) > 1]
    per_shape = 45.0  # seconds one shape is expected to compile, until one is measured
    for hub in dict.fromkeys([p.target.hub_id for p in pairs] + [p.draft.hub_id for p in pairs]):
        if hub not in kept:
            continue
        model, entry = kept[hub][0], res["models"][hub]
        lm, done_n, warm = None, [], 0.0
        try:
            for n in lengths:
                if not budget.allows(per_shape + 30):
                    break
                say("5 compile", f"{hub}: torch.compile of the {n}-token pass")
                # the GPU default (--runtime auto --fused auto): the fused decoder, compiled
                lm = lm or make_runner(model, "fused-compile", vocab, max_cache, [])[0]
                t = lm.warmup([(1, 1)] if n == 1 else [(n, n)])
                per_shape, warm, done_n = max(t, 5.0), warm + t, done_n + [n]
            if done_n:
                entry["rows"]["fused-compile"] = {"warmup_s": warm,
                                                  **time_runner(lm, ctx, args.iters, args.device, done_n)}
        except Exception as e:
            entry["rows"]["fused-compile"] = {"error": f"{type(e).__name__}: {e}"}
        del lm
        free()
        if budget.allows(per_shape + 30):
            say("5 compile", f"{hub}: transformers' generate (StaticCache, compiled)")
            try:
                entry["hf_generate"] = measure_hf_generate(model, [ctx], 32, 2, args.device)
            except Exception as e:
                entry["hf_generate"] = {"error": f"{type(e).__name__}: {e}"}
        write(res, Path(args.out))
    if budget.allows(per_shape * 5 + 30):
        check_distribution(args, res, budget, ["fused-compile"])
    else:
        res["notes"].append("chi-square through torch.compile: skipped (time budget)")


# ----------------------------------------------------------------------------- report

def markdown(res: dict) -> str:
    env = res["env"]
    out = [f"# GPU check ({env['device_name']})", "",
           f"{env['dtype']}{' (phase 1 greedy check: float32)' if env['dtype'] != 'float32' else ''}, batch 1, "
           "random weights with the real shapes"
           f"{' (--tiny: tiny shapes of the same structure)' if env['tiny'] else ''}; torch {env['torch']}, "
           f"transformers {env['transformers']}; bandwidth {fmt(env['bandwidth_tbs'])} TB/s "
           f"({env['bandwidth_source']}); {env['iters']} timed iterations per number, warm-up excluded. Written "
           f"{env['time']}.", ""]
    if env["device"] == "cpu":
        out += ["**CPU smoke run: the numbers say nothing about GPU speed.**", ""]
    out += ["Elapsed per phase: " + ", ".join(f"{k} {v:.1f} s" for k, v in res["elapsed_s"].items()) + "", ""]
    ex = res["exactness"]
    out += ["## 1. Exactness", "", "Speculative sampling (T = 1) against the target's enumerated distribution of "
            "3-token continuations (vocabulary 5), chi-square, pass at p > 0.001:", "",
            "| runtime | policy | samples | p-value | result |", "|---|---|---|---|---|"]
    for r in ex["distribution"]:
        out.append(f"| {r['runtime']} | {r.get('policy', '-')} | {r.get('samples', '-')} | "
                   f"{fmt(r.get('p_value'), 4)} | {'pass' if r['pass'] else 'FAIL: ' + r.get('error', 'p <= 0.001')} |")
    if ex["greedy"]:
        g0 = ex["greedy"][0]
        out += ["", f"float32 greedy speculative decoding (fixed K = {g0['K']}) against greedy target alone, "
                f"{g0['tokens']} tokens, pair {g0['pair']} (random weights, its real shapes):", "",
                "| runtime | result |", "|---|---|"]
        for g in ex["greedy"]:
            verdict = (f"FAIL: {g['error']}" if "error" in g else "equal" if g["equal"] else
                       f"first difference at token {g['first_difference']}, top-2 margin {fmt(g.get('margin'), 6)} "
                       f"({'a near tie' if g.get('near_tie') else 'FAIL: not a near tie'})")
            out.append(f"| {g['runtime']} | {verdict} |")
    out.append("")
    out += _models_md(res) + _replay_md(res) + _assisted_md(res)
    if res["notes"]:
        out += ["## Notes", ""] + [f"- {n}" for n in res["notes"]] + [""]
    return "\n".join(out)


def _models_md(res: dict) -> list[str]:
    out = ["## 2. Step times per model and runtime", ""]
    for hub, m in res["models"].items():
        b = m["bytes"]
        out += [f"### {hub}", "", f"{b['n_params'] / 1e6:.1f} M parameters, "
                f"{b['weight_bytes_read_per_token'] / 1e6:.1f} MB of weights read per token; {m['context']} positions "
                f"cached, static cache of {m['max_cache_len']} slots; the replays run on "
                f"`{m.get('replay_runtime')}`.", "",
                "| runtime | warm-up s | step ms | " + " | ".join(f"verify {n}" for n in VERIFY_ROWS) +
                " | roofline ms | % roofline (step) | kernels/step |", "|---" * (6 + len(VERIFY_ROWS)) + "|"]
        for rt, r in m["rows"].items():
            if "error" in r:
                out.append(f"| {rt} | failed: {r['error']} |")
                continue
            v = {int(k): x for k, x in r["verify_ms"].items()}
            roof = r.get("roofline_ms")
            out.append(f"| {rt} | {fmt(r['warmup_s'], 1)} | {fmt(r['step_ms'], 3)} | " +
                       " | ".join(fmt(v.get(n), 3) for n in VERIFY_ROWS) +
                       f" | {fmt(roof, 3)} | {fmt(100 * roof / r['step_ms'], 1) if roof else '-'} | "
                       f"{r.get('kernels') if r.get('kernels') is not None else '-'} |")
        hf = m.get("hf_generate")
        if isinstance(hf, dict):
            tok = next((v for k, v in hf.items() if k not in ("compiled", "error")), None)
            got = f"{fmt(1000 / tok, 3)} ms per token ({fmt(tok, 1)} tok/s)" if tok else f"failed: {hf.get('error')}"
            out += ["", f"transformers' generate (StaticCache{', compiled' if hf.get('compiled') else ''}): {got}"]
        out.append("")
    return out


def _replay_md(res: dict) -> list[str]:
    tr = res.get("traces")
    if not tr:
        return []
    out = ["## 3. Replayed traces (measured) beside Eq. 5.1 (modelled)", "",
           f"Traces: `{tr['folder']}`, recorded with {tr['pair_line']}; {tr['sampling']}. Each row replays a "
           "recorded generation through the decoder (the recorded K per round and acceptance, the policy's own stop "
           "rule asked at every step for its cost, EOS off, the recorded length): speed-ups are measured against "
           "the replayed target alone. Eq. 5.1 (SpecDec++: T = t_draft N_draft + t_target(L) N_target) prices the "
           "same counts with phase 2's step times: a model, not a measurement.", ""]
    for rp in res["replay"]:
        out += [f"### {rp['pair']} ({rp['hub_ids'][0]} / {rp['hub_ids'][1]})", "", f"**{rp['label']}**.", "",
                "| policy | generations | tokens | counts reproduced | K_mean (N_draft / N_target) | replay tok/s | "
                "**replay speed-up** | Eq. 5.1 est. speed-up |", "|---|---|---|---|---|---|---|---|"]
        for p in rp["policies"]:
            tag = " (best fixed K)" if p["config"] == rp.get("best_fixed") else ""
            same = "yes" if p["counts_reproduced"] else "NO"
            out.append(f"| {p['config']}{tag} | {p['rows']} | {p['tokens']} | {same} | "
                       f"{fmt(p.get('k_mean'))} | {fmt(p['tok_s'], 1)} | **{fmt(p.get('speedup'))}** | "
                       f"{fmt(p.get('est_speedup'))} |")
        out.append("")
    return out


def _assisted_md(res: dict) -> list[str]:
    if not res["assisted"]:
        return []
    out = ["## 4. transformers' assisted generation", "", "Greedy, its default candidate schedule, the same random "
           "models: its acceptance is the random pair's (not the real one's), so compare its loop, not its speed-up, "
           "with the replays above.", "",
           "| pair | target alone tok/s | assisted tok/s | assisted / alone | target passes (alone, assisted) | note |",
           "|---|---|---|---|---|---|"]
    for a in res["assisted"]:
        if "error" in a:
            out.append(f"| {a['pair']} | failed: {a['error']} |")
            continue
        out.append(f"| {a['pair']} | {fmt(a['target_alone_tok_s'], 1)} | {fmt(a['assisted_tok_s'], 1)} | "
                   f"{fmt(a['ratio'])} | {a['target_alone_target_passes']}, {a['assisted_target_passes']} | "
                   f"{a.get('note', '')} |")
    return out + [""]


def write(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON).write_text(json.dumps(res, indent=1, default=str) + "\n")
    (out / REPORT).write_text(markdown(res) + "\n")
    (out / "run.json").write_text(json.dumps({"script": "eval/gpu_check.py", "report": REPORT}, indent=1) + "\n")


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.fetch_wheels:
        return fetch_wheels(ROOT / ".whl")
    if args.report_only:
        (out / REPORT).write_text(markdown(json.loads((out / JSON).read_text())) + "\n")
        return 0
    dev, budget = args.device, Budget(args.budget_s)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available; use --device cpu --tiny for a smoke run",
              file=sys.stderr)
        return 2
    if dev.type == "cpu":
        torch.set_num_threads(1 if args.tiny else torch.get_num_threads())  # tiny tensors: threads only hand off
    try:
        pairs = [presets.preset(n, tiny=args.tiny) for n in args.pairs.split(",")]
    except Exception as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    traces = load_traces(ROOT / args.traces if not Path(args.traces).is_absolute() else Path(args.traces))
    bw, bw_src = lookup_bandwidth(dev, args.bandwidth_tbs)
    res = {"env": environment(args, bw, bw_src), "elapsed_s": {}, "exactness": {"distribution": [], "greedy": []},
           "models": {}, "replay": [], "assisted": [], "notes": []}
    tp = traces["pair"]
    res["traces"] = {"folder": traces["folder"], "preset": tp.get("preset"),
                     "pair_line": f"{tp.get('draft', {}).get('hub_id')} / {tp.get('target', {}).get('hub_id')} "
                                  f"(preset {tp.get('preset')})",
                     "sampling": f"T = {traces['sampling'].temperature:g}, top-k {traces['sampling'].top_k}, "
                                 f"top-p {traces['sampling'].top_p:g}"}
    quant = tp.get("draft", {}).get("draft_quant")
    if quant not in (None, "none"):
        res["notes"].append(f"the traces were recorded with a {quant} draft; these runs use an unquantized one")
    ctx, max_k = traces["context"], traces["max_k"]
    max_cache = -(-(traces["max_len"] + max_k + 2) // 64) * 64
    shapes = verify_shapes(max(max_k, max(VERIFY_ROWS) - 1))
    phase_t = time.perf_counter()

    def done(name):
        nonlocal phase_t
        res["elapsed_s"][name] = time.perf_counter() - phase_t
        phase_t = time.perf_counter()
        say(name, f"done in {res['elapsed_s'][name]:.1f} s ({budget.left():.0f} s of the budget left)")
        write(res, out)

    res["elapsed_s"]["start-up"] = phase_t - T0
    say("1 exactness", f"chi-square through {', '.join(runtimes(dev))}; fp32 greedy on {pairs[0].name}")
    graph_rts = [r for r in runtimes(dev) if r != "eager" or dev.type == "cpu"]  # CPU: eager is the path
    check_distribution(args, res, budget, graph_rts)
    check_greedy(args, res, pairs[0], graph_rts)
    done("1 exactness")
    say("2 runtimes", f"{len({s for p in pairs for s in (p.draft, p.target)})} models at context {ctx}")
    kept = time_models(args, res, budget, pairs, bw, ctx, max_cache, shapes)
    done("2 runtimes")
    ready = [p for p in pairs if all(kept.get(s.hub_id, (0, None))[1] is not None for s in (p.draft, p.target))]
    for p in ready:
        if budget.allows(20):
            say("3 replay", f"{p.name}: {sum(len(r) for r in traces['by_config'].values())} generations")
            replay_pair(args, res, budget, p, kept, traces)
    done("3 replay")
    for p in ready:
        if budget.allows(30):
            assisted(args, res, budget, p, kept)
    done("4 assisted")
    if dev.type == "cuda":
        compiled(args, res, budget, kept, pairs[0].vocab_size, ctx, max_cache, pairs)
    else:  # inductor on a CPU compiles for minutes, and says nothing of the GPU's graphs
        res["notes"].append("torch.compile and transformers' compiled generate: CUDA only (skipped on CPU)")
    done("5 compile")
    print(markdown(res))
    say("end", f"wrote {out / REPORT} and {out / JSON}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
