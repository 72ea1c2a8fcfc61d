"""The GPU check: one call on a GPU machine, within a time budget (--budget-s), writes one report.

Random weights with the real shapes (backends/presets.py), batch 1; on CUDA bf16, except where named:

  1. exactness on the device: the sampled output distribution of speculative decoding through each graph
     runtime (CUDA graphs, the fused runner, torch.compile) against the target's enumerated one (chi-square,
     tiny models, vocabulary 5, 3 tokens: evaluation/exactness.py, the tests' check); fp32 greedy speculative
     == greedy target-alone at the real shapes (a difference is counted where the top two logits nearly tie);
  2. per model and runtime (eager, cudagraph, fused, compile): ms per one-token step and per verify pass of
     1..9 rows, % of the memory-bandwidth roofline, kernels per step, the top kernels of a fused step by device
     time (on CPU: aten ops), and transformers' `generate` (StaticCache, compiled on CUDA);
 2b. the feature drafter of the committed shape for the first pair's target: ms per one-token draft step (its
     runner; eager on a static cache; on CUDA captured as one CUDA graph) and c, that step over the target's
     fastest one-token step (evaluation/drafter_step.py);
  3. replay ("measured, not modelled"): a trace sweep (a sweep with record_trace: real weights on a CPU; --traces)
     replayed per pair and policy through the real decoder on the fastest graph runtime (decoding/replay.py),
     the counts checked against the recorded ones, beside Eq. 5.1's estimate; per policy the host reads a round,
     one generation under torch.profiler (syncs, copies, eager and graph launches per round and per drafted
     token: evaluation/round_profile.py) and the time outside the forwards; where the traces hold several h or
     K, the best replayed ones and auto's pick from the step times measured here. A pair other than the traces'
     replays BORROWED acceptance, and says so;
 3b. the feature drafter's traces (--drafter-traces: the real target and the committed drafter on a CPU) replayed on
     the first pair's target behind a HiddenTap with a drafter of the committed shape: tok/s, the speed-up over the
     target's own AR in the same run, the counts checked, SpecDec++ against the best fixed K
     (evaluation/drafter_replay.py); skipped, and said so, where there are none;
  4. transformers' assisted generation on the same models (random weights: its acceptance is theirs);
  5. the first token: a fresh process's time to its first token (the default target alone), cold and warm;
  6. torch.compile (fused-compile) of what a decode feeds, the replays again on it, compiled generate.

Optional work runs only while the time budget (--budget-s) allows (--skip leaves phases out); each phase
prints a progress line and its elapsed seconds.

    make gpu-check                                   # on the GPU machine: python3, wheels from .whl/
    python eval/gpu_check.py --tiny --device cpu     # the whole check on tiny shapes, on a CPU
    python eval/gpu_check.py --fetch-wheels          # once, online: the wheels an offline GPU machine lacks (pydantic)
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
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

T0 = time.perf_counter()

import torch  # noqa: E402

try:
    from adaptive_spec.backends import presets  # noqa: E402
    from adaptive_spec.backends.runner import CausalLM  # noqa: E402
    from adaptive_spec.backends.static_runner import DRAFT_SHAPES, verify_shapes  # noqa: E402
    from adaptive_spec.backends.toy import make_model  # noqa: E402
    from adaptive_spec.decoding.decoder import Decoder  # noqa: E402
    from adaptive_spec.decoding.policies import FixedK  # noqa: E402
    from adaptive_spec.decoding.replay import covering_trace, replay_generate  # noqa: E402
    from adaptive_spec.decoding.sampling import SamplingParams  # noqa: E402
    from adaptive_spec.evaluation.exactness import chi_square_pvalue, exact_sequence_probs, sample_counts  # noqa: E402
    from adaptive_spec.evaluation.gpu_bench import (acceptance_label, estimate, fmt, inner_policy,  # noqa: E402
                                                    lookup_bandwidth, measure_hf_generate, measured_costs,
                                                    model_bytes, picks_md, replay_picks, stats_of, time_loop)
    from adaptive_spec.timing import sync, timed  # noqa: E402
    from adaptive_spec.evaluation import gpu_bench, round_profile as rp_  # noqa: E402
    from adaptive_spec.evaluation.round_profile import make_runner  # noqa: E402
    from adaptive_spec.evaluation.drafter_step import drafter_md, ratios, time_drafter  # noqa: E402
    from adaptive_spec.evaluation import drafter_replay as dr_  # noqa: E402
    from adaptive_spec.decoding.auto import loop_times  # noqa: E402
except ModuleNotFoundError as e:  # a GPU machine with the checkout, torch and transformers, no pydantic
    sys.exit(f"error: {e.name} is not importable; on a GPU machine install the carried wheels first "
             "(`make gpu-check` does; make them here with `python eval/gpu_check.py --fetch-wheels`), or run from "
             "the checkout's root as `PYTHONPATH=. python eval/gpu_check.py`")
from adaptive_spec.backends import fused  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRACES = "eval/results/sweep_gpu_traces"  # configs/sweep/gpu_traces.yaml: the default pair, on a CPU
JSON, REPORT = "gpu_check.json", "report.md"
VERIFY_ROWS = range(1, 10)  # the table's verify passes: 1..9 rows (K = 0..8)
WHEELS = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions")
NEAR_TIE = 1e-3  # fp32 logits closer than this may order differently in a 1-row and a K+1-row pass
OPTIONAL = ("drafter", "drafter-replay", "profile", "assisted", "first-token", "compile")  # phases --skip leaves out
# seconds a phase's step is expected to take where nothing measured says better (CUDA; a --tiny CPU run is quicker)
PROFILE_S, FIRST_TOKEN_S, DRAFTER_S, DRAFTER_REPLAY_S = 8.0, 60.0, 20.0, 30.0


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
    ap.add_argument("--drafter-traces", default=dr_.TRACES, help="the feature drafter's trace sweep (phase 3b)")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run (default 400; --tiny 120)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per number (default 20; --tiny 2)")
    ap.add_argument("--samples", type=int, default=None, help="generations per chi-square (default 2000; --tiny 400)")
    ap.add_argument("--compile-lengths", default="1,2,4", help="verify lengths torch.compile compiles (and times)")
    ap.add_argument("--host-reads", default="auto", help="the replays' Decoder(host_reads=...): auto (round on "
                    "CUDA, token on a CPU), token, round, or N (the stop read every N drafted tokens)")
    ap.add_argument("--replay-rows", type=int, default=6,
                    help="generations replayed per policy: the same prompts for each, round-robin over the datasets")
    ap.add_argument("--skip", default="", help=f"optional phases to leave out ({', '.join(OPTIONAL)})")
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
    if args.host_reads.isdigit() and int(args.host_reads) >= 1:
        args.host_reads = int(args.host_reads)
    elif args.host_reads not in ("auto", "token", "round"):
        ap.error(f"--host-reads must be auto, token, round or an integer N >= 1, got {args.host_reads!r}")
    args.skip = {p for p in args.skip.split(",") if p}
    if args.skip - set(OPTIONAL):
        ap.error(f"--skip: unknown phase {sorted(args.skip - set(OPTIONAL))[0]!r}; valid: {', '.join(OPTIONAL)}")
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


def load_traces(folder: Path, n_rows: int | None = None) -> dict:
    return gpu_bench.load_traces(folder, ROOT, n_rows)


def in_root(path: str) -> Path:
    """A path as given: relative ones from the checkout's root."""
    return Path(path) if Path(path).is_absolute() else ROOT / path


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
        if "fused" in made and budget.allows(15):  # where a fused step's device time goes
            try:
                entry["top_kernels"] = rp_.top_kernels(made["fused"], steps=3 if args.tiny else 10)
            except Exception as e:
                res["notes"].append(f"{shape.hub_id}: top kernels failed: {type(e).__name__}: {e}")
        # the replays run on the fastest one-token step (eager only where nothing else runs)
        graphs = [rt for rt in made if rt != "eager"] or list(made)
        best = min(graphs, key=lambda rt: entry["rows"][rt]["step_ms"], default=None)
        entry["replay_runtime"] = best
        kept[shape.hub_id] = (model, made.get(best))
        del made
        free()
        write(res, Path(args.out))
    return kept


# ----------------------------------------------------------------------------- 2b. the feature drafter

def drafter_step(args, res, budget, pair, kept, ctx, max_cache) -> None:
    """The feature drafter's one-token step for `pair`'s target (its model from phase 2, reused), per runtime."""
    hub = pair.target.hub_id
    if "drafter" in args.skip or hub not in kept:
        why = "--skip drafter" if "drafter" in args.skip else "its target was not timed"
        res["notes"].append(f"feature drafter step: not timed ({why})")
    elif not budget.allows(DRAFTER_S):
        res["notes"].append("feature drafter step: not timed (time budget)")
    else:
        say("2b drafter", f"a feature drafter for {hub} at context {ctx}")
        try:
            res["drafter"] = {"target": hub, **time_drafter(kept[hub][0], pair.vocab_size, ctx, max_cache,
                                                            args.iters, args.tiny)}
        except Exception as e:  # the drafter's build: the check goes on without it
            res["drafter"] = {"target": hub, "error": f"{type(e).__name__}: {e}", "rows": {}}
        c = ratios(res)
        say("2b drafter", ", ".join(f"{rt} {fmt(r.get('step_ms'), 3)} ms (c {fmt(c.get(rt), 3)})"
                                     for rt, r in res["drafter"]["rows"].items()) or res["drafter"]["error"])
        free()


# ----------------------------------------------------------------------------- 3. replay

def replay_pair(args, res, budget, pair, draft, target, traces, runtime: str | None, configs=None) -> dict:
    """The trace rows of `configs` (default: every config) replayed on the pair's runners of `runtime` (None:
    each model's replay_runtime, phase 2's fastest), one
    Decoder for all (its device rounds' graphs are captured once); per policy tok/s, speed-up, counts check, host
    reads a round, the time outside the forwards and, unless skipped, one generation under the profiler."""
    runtime_shown = runtime or res["models"][pair.target.hub_id].get("replay_runtime")
    out = {"pair": pair.name, "hub_ids": list(pair.hub_ids), "runtime": runtime_shown,
           "label": acceptance_label(pair.name, traces["pair"].get("preset")), "policies": []}
    dec = Decoder(target, draft, eos_token_ids=(), host_reads=args.host_reads)
    for config, rows in traces["by_config"].items():
        if configs is not None and config not in configs:
            continue
        if not budget.allows(15):
            res["notes"].append(f"replay {pair.name} {config} on {runtime_shown}: skipped (time budget)")
            continue
        p, again = replay_config(args, pair, dec, traces, config, rows)
        if "profile" not in args.skip and budget.allows(PROFILE_S + 15):
            m, counts = rp_.profile_calls(again, args.device)
            p["profile"] = rp_.per_round(m, counts)
        out["policies"].append(p)
        say("3 replay", f"{pair.name} {config} ({runtime_shown}): {p['tok_s'] or 0:.1f} tok/s, counts reproduced "
            f"{p['counts_reproduced']}, {p['host_reads_per_round']:.2f} host reads a round")
    ar = next((p["tok_s"] for p in out["policies"] if p["method"] == "ar"), None)
    tables = (res["models"][pair.draft.hub_id], res["models"][pair.target.hub_id])
    d_row, t_row = (tab["rows"].get(runtime or tab.get("replay_runtime"), {}) for tab in tables)
    for p in out["policies"]:
        p["speedup"] = p["tok_s"] / ar if ar and p["tok_s"] else None
        if p["stats"] and "step_ms" in d_row and "verify_ms" in t_row:  # Eq. 5.1 from phase 2's step times
            e = estimate({p["config"]: p["stats"]}, [{"context": 0, "step_ms": d_row["step_ms"]}],
                         [{"context": 0, "verify_ms": t_row["verify_ms"]}], None)[0]
            p.update(est_speedup=e["est_speedup"], k_mean=e["k_mean"])
    fixed = [p for p in out["policies"] if p["method"] == "fixed" and p["tok_s"]]
    out["best_fixed"] = max(fixed, key=lambda p: p["tok_s"])["config"] if fixed else None
    costs = None
    if "step_ms" in d_row and "verify_ms" in t_row:
        if "loop_times" not in res:  # what auto adds per row and round for the decode loop itself, measured once
            res["loop_times"] = loop_times(pair.vocab_size, args.device)
        costs = measured_costs(d_row, t_row, res["loop_times"])
    mode = "greedy" if traces["sampling"].greedy else "sample"
    out["picks"] = replay_picks(out["policies"], traces["curve"], costs, mode, traces["k_max"])
    return out


def replay_config(args, pair, dec, traces, config, rows) -> tuple[dict, object]:
    """One config's rows replayed through `dec` (after an untimed replay of every graph they capture, and of
    the first row); (its entry, a function replaying its first row again, for the profiler)."""
    inner = inner_policy(rows[0], traces, dec.draft, args.device, ROOT)

    def replay(r, trace=None, n_tokens=None):
        g = torch.Generator().manual_seed(r["seed"])
        prompt = torch.randint(0, pair.vocab_size, (r["n_prompt_tokens"],), generator=g).tolist()
        return replay_generate(dec.target, dec.draft, prompt, n_tokens or r["n_tokens"],
                               r["trace"] or None if trace is None else trace, inner, traces["sampling"],
                               seed=r["seed"], decoder=dec).metrics

    room = min(dec.target.max_length, dec.draft.max_length) - 8 - 2 * (traces["max_k"] + 1)
    chunk: list = []
    for rnd in covering_trace([r["trace"] for r in rows]) + [None]:  # in generations that fit the caches
        if chunk and (rnd is None or sum(n + 1 for _, n, _ in chunk) + rnd[1] + 1 > room):
            replay({"seed": 0, "n_prompt_tokens": 8}, chunk, sum(n + 1 for _, n, _ in chunk))
            chunk = []
        if rnd is not None:
            chunk.append(rnd)
    replay(rows[0])  # untimed: allocation and first replays
    mets, reproduced = [], True
    for r in rows:
        m = replay(r)
        mets.append(m)
        got = m.to_dict()
        reproduced &= all(got[k] == r[k] for k in ("n_tokens", "n_drafted", "n_accepted", "accepted_hist"))
    tokens, decode_s = sum(m.n_tokens for m in mets), sum(m.wall_s - m.prefill_s for m in mets)
    method = rows[0]["method"]
    return {"config": config, "method": method, "value": rows[0].get({"learned": "h", "fixed": "k"}.get(method, "-")),
            "rows": len(rows), "tokens": tokens, "decode_s": decode_s, "tok_s": tokens / decode_s if decode_s else None,
            "counts_reproduced": reproduced, "stats": next(iter(stats_of(rows).values()), None),
            "host_reads_per_round": sum(m.host_reads for m in mets) / max(sum(m.n_target_forwards for m in mets), 1),
            "n_past_stop": sum(m.n_past_stop for m in mets), "outside": rp_.outside_forwards(mets)}, \
        lambda: replay(rows[0])


# ----------------------------------------------------------------------------- 3b. the drafter's traces

def drafter_replay(args, res, budget, pair, kept) -> None:
    """The feature drafter's traces replayed on `pair`'s target (its model from phase 2, a runner of its replay
    runtime), through replay_config; the phase's entry says why where it did not run."""
    hub = pair.target.hub_id
    traces, why = (None, "--skip drafter-replay") if "drafter-replay" in args.skip else \
        dr_.load(in_root(args.drafter_traces), ROOT, args.replay_rows)
    if not why and (hub not in kept or kept[hub][1] is None):
        why = "its target was not timed"
    if not why and not budget.allows(DRAFTER_REPLAY_S):
        why = "time budget"
    if why:
        res["drafter_replay"] = {"skipped": why}
        say("3b drafter replay", f"not run: {why}")
        return
    say("3b drafter replay", f"{sum(len(r) for r in traces['by_config'].values())} generations on {hub}")
    try:
        res["drafter_replay"] = dr_.replay(args, kept[hub][0], res["models"][hub]["replay_runtime"], pair, traces,
                                           replay_config, budget.allows, lambda line: say("3b drafter replay", line))
    except Exception as e:  # the drafter's build or the tapped runner: the check goes on without it
        res["drafter_replay"] = {"error": f"{type(e).__name__}: {e}"}
        say("3b drafter replay", f"failed: {res['drafter_replay']['error']}")
    free()


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
        with timed(dev) as t, torch.inference_mode():
            out = model_t.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                   min_new_tokens=n_new, do_sample=False, pad_token_id=0, **kw)
        assert out.shape[1] == ids.shape[1] + n_new
        return t.s

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

def compiled(args, res, budget, kept, traces, vocab, ctx, max_cache, pairs) -> None:
    """While the budget allows, the first pair's models first: torch.compile ("reduce-overhead": inductor kernels
    in CUDA graphs) of what a decode feeds, one shape at a time, each only while the last one's compile time is
    left (a target: its one-token step and the --compile-lengths verify passes; a draft: its one- and two-token
    steps); the traces replayed on a pair once both its models compiled (the policies whose passes all did);
    transformers' compiled generate; the chi-square through it."""
    lengths = [int(n) for n in args.compile_lengths.split(",") if int(n) > 1]
    drafts, targets = {p.draft.hub_id for p in pairs}, {p.target.hub_id for p in pairs}
    per_shape = [45.0]  # seconds one shape is expected to compile, until one is measured
    runners, replayed = {}, set()
    for hub in dict.fromkeys(s.hub_id for p in pairs for s in (p.target, p.draft)):
        if hub not in kept:
            continue
        shapes = [(1, 1)] + ([(2, 1)] if hub in drafts else []) + ([(n, n) for n in lengths] if hub in targets else [])
        runners[hub] = compile_model(args, res, budget, kept[hub][0], hub, shapes, per_shape, vocab, ctx, max_cache)
        for p in pairs:
            if p.name not in replayed and runners.get(p.draft.hub_id) and runners.get(p.target.hub_id):
                replayed.add(p.name)
                replay_compiled(args, res, budget, p, runners, traces)
        if budget.allows(per_shape[0] + 30):
            say("6 compile", f"{hub}: transformers' generate (StaticCache, compiled)")
            try:
                res["models"][hub]["hf_generate"] = measure_hf_generate(kept[hub][0], [ctx], 32, 2, args.device)
            except Exception as e:
                res["models"][hub]["hf_generate"] = {"error": f"{type(e).__name__}: {e}"}
        write(res, Path(args.out))
    del runners
    free()
    if budget.allows(per_shape[0] * 5 + 30):
        check_distribution(args, res, budget, ["fused-compile"])
    else:
        res["notes"].append("chi-square through torch.compile: skipped (time budget)")


def compile_model(args, res, budget, model, hub, shapes, per_shape, vocab, ctx, max_cache):
    """(the fused-compile runner, the shapes compiled) of `model`, its step table in the model's rows; None where
    nothing compiled. `per_shape` [seconds]: the last shape's compile time, updated."""
    entry, lm, done, warm = res["models"][hub], None, [], 0.0
    try:
        for shape in shapes:
            if not budget.allows(per_shape[0] + 30):
                break
            say("6 compile", f"{hub}: torch.compile of the {shape[0]}-token pass ({shape[1]} rows of logits)")
            # the GPU default (--runtime auto --fused auto): the fused decoder, compiled
            lm = lm or make_runner(model, "fused-compile", vocab, max_cache, [])[0]
            t = lm.warmup([shape])
            per_shape[0], warm, done = max(t, 5.0), warm + t, done + [shape]
        if done:
            n_done = [n for n, rows in done if n == rows]
            entry["rows"]["fused-compile"] = {"warmup_s": warm, "compiled": [list(s) for s in done],
                                              **time_runner(lm, ctx, args.iters, args.device, n_done)}
    except Exception as e:
        entry["rows"]["fused-compile"] = {"error": f"{type(e).__name__}: {e}"}
        return None
    return (lm, set(done)) if done else None


def replay_compiled(args, res, budget, pair, runners, traces) -> None:
    """The pair's replays on fused-compile, beside phase 3's: the policies whose every pass compiled."""
    (d, d_done), (t, t_done) = runners[pair.draft.hub_id], runners[pair.target.hub_id]
    ok = []
    for config, rows in traces["by_config"].items():
        lack = sorted({k + 1 for r in rows for k, _, _ in r["trace"]} - {n for n, m in t_done if n == m})
        drafted = any(k for r in rows for k, _, _ in r["trace"])
        if lack or (drafted and not {(1, 1), (2, 1)} <= d_done) or (not drafted and (1, 1) not in t_done):
            res["notes"].append(f"replay {pair.name} {config} on fused-compile: not run (not compiled: target passes "
                                f"of {lack or '-'} rows, or the draft's 1- and 2-token steps)")
        else:
            ok.append(config)
    if ok and budget.allows(20):
        say("6 compile", f"{pair.name}: replaying {len(ok)} policies on fused-compile")
        res.setdefault("replay_compiled", []).append(
            replay_pair(args, res, budget, pair, d, t, traces, "fused-compile", configs=ok))


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
    out += _models_md(res) + drafter_md(res) + _replay_md(res) + dr_.drafter_replay_md(res) + _assisted_md(res)
    out += rp_.first_token_section(res.get("first_token"))
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
        if m.get("top_kernels"):
            out += [""] + rp_.kernels_md(m["top_kernels"])
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
    cuda = res["env"]["device"] == "cuda"
    for rp in res["replay"] + res.get("replay_compiled", []):
        on = f" on `{rp['runtime']}`" if rp.get("runtime") else ""
        out += [f"### {rp['pair']} ({rp['hub_ids'][0]} / {rp['hub_ids'][1]}){on}", "",
                f"**{rp['label']}**.", "",
                "| policy | generations | tokens | counts reproduced | K_mean (N_draft / N_target) | replay tok/s | "
                "**replay speed-up** | Eq. 5.1 est. speed-up |", "|---|---|---|---|---|---|---|---|"]
        for p in rp["policies"]:
            tag = " (best fixed K)" if p["config"] == rp.get("best_fixed") else ""
            same = "yes" if p["counts_reproduced"] else "NO"
            out.append(f"| {p['config']}{tag} | {p['rows']} | {p['tokens']} | {same} | "
                       f"{fmt(p.get('k_mean'))} | {fmt(p['tok_s'], 1)} | **{fmt(p.get('speedup'))}** | "
                       f"{fmt(p.get('est_speedup'))} |")
        out += rp_.host_work_section(rp["policies"], cuda)
        picks = picks_md(rp.get("picks") or {})
        out += ([""] + picks if picks else []) + [""]
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
    if res.get("drafter"):  # c from the step times as they stand (phase 6 may add a faster target step)
        res["drafter"]["c"] = ratios(res)
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
    traces = load_traces(in_root(args.traces), args.replay_rows)
    bw, bw_src = lookup_bandwidth(dev, args.bandwidth_tbs)
    res = {"env": environment(args, bw, bw_src), "elapsed_s": {}, "exactness": {"distribution": [], "greedy": []},
           "models": {}, "replay": [], "replay_compiled": [], "assisted": [], "first_token": [],
           "notes": [traces["curve_note"]] if traces["curve_note"] else []}
    tp = traces["pair"]
    res["traces"] = {"folder": traces["folder"], "preset": tp.get("preset"),
                     "pair_line": f"{tp.get('draft', {}).get('hub_id')} / {tp.get('target', {}).get('hub_id')} "
                                  f"(preset {tp.get('preset')})",
                     "sampling": f"T = {traces['sampling'].temperature:g}, top-k {traces['sampling'].top_k}, "
                                 f"top-p {traces['sampling'].top_p:g}", "datasets": traces["datasets"],
                     "host_reads": args.host_reads}
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
    drafter_step(args, res, budget, pairs[0], kept, ctx, max_cache)
    done("2b drafter")
    ready = [p for p in pairs if all(kept.get(s.hub_id, (0, None))[1] is not None for s in (p.draft, p.target))]
    for p in ready:
        if budget.allows(20):
            say("3 replay", f"{p.name}: {sum(len(r) for r in traces['by_config'].values())} generations")
            d, t = kept[p.draft.hub_id][1], kept[p.target.hub_id][1]
            res["replay"].append(replay_pair(args, res, budget, p, d, t, traces, None))
    done("3 replay")
    drafter_replay(args, res, budget, pairs[0], kept)
    done("3b drafter replay")
    for p in ready:
        if "assisted" not in args.skip and budget.allows(30):
            assisted(args, res, budget, p, kept)
    done("4 assisted")
    if "first-token" not in args.skip:  # a fresh process each: the phase's time is theirs
        rts = ["fused-compile", "fused"] if dev.type == "cuda" else ["eager"]
        say("5 first token", f"{pairs[0].name}'s target alone in a fresh process: {', '.join(rts)}, cold and warm")
        res["first_token"], notes = rp_.first_tokens(rts, dev.type, args.tiny, budget.left,
                                                     FIRST_TOKEN_S if dev.type == "cuda" else 15.0,
                                                     pairs[0].name.split(":")[0])
        res["notes"] += notes
    done("5 first token")
    if dev.type == "cuda" and "compile" not in args.skip:
        compiled(args, res, budget, kept, traces, pairs[0].vocab_size, ctx, max_cache, pairs)
    elif dev.type != "cuda":  # inductor on a CPU compiles for minutes, and says nothing of the GPU's graphs
        res["notes"].append("torch.compile and transformers' compiled generate: CUDA only (skipped on CPU)")
    done("6 compile")
    print(markdown(res))
    say("end", f"wrote {out / REPORT} and {out / JSON}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
