"""Where a decode round's time and host work go (eval/gpu_check.py): the runners the check builds, one replayed
generation under torch.profiler counted per round and per drafted token (host syncs, copies, launches: SYNCS;
the top-level aten ops the host dispatches), the time outside the two models' forwards, a step's top kernels,
and a fresh process's time to its first token.

`python -m adaptive_spec.evaluation.round_profile --first-token ...` is the child that `first_token` starts.
Its imports stay inside functions, so they are timed too."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..tables import fixed, md_table

ROOT = Path(__file__).resolve().parents[2]
SYNCS = {"stream_syncs": ("cudaStreamSynchronize",), "event_syncs": ("cudaEventSynchronize",),
         "device_syncs": ("cudaDeviceSynchronize",), "memcpy_async": ("cudaMemcpyAsync",),
         "graph_launches": ("cudaGraphLaunch",),
         "eager_launches": ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")}
FORWARDS = ("prefill", "draft_forward", "target_forward")  # Metrics.breakdown() parts that are model forwards
MARK = "FIRST_TOKEN "  # the child's result line on stdout


def make_runner(model, runtime: str, vocab: int, max_cache: int, shapes) -> tuple:
    """(runner, warm-up seconds) of `model` on `runtime` (eager, cudagraph, compile, fused, fused-compile: "fused"
    is the fused decoder, captured with CUDA graphs on CUDA), every shape in `shapes` captured or compiled."""
    from ..backends.static_runner import FusedCausalLM, StaticCausalLM

    cuda = next(model.parameters()).device.type == "cuda"
    kw = dict(max_cache_len=max_cache, cuda_graphs=cuda and runtime in ("cudagraph", "fused"),
              compile=runtime.endswith("compile"))
    lm = (FusedCausalLM if runtime.startswith("fused") else StaticCausalLM)(model, vocab, **kw)
    return lm, lm.warmup(shapes)


def _activities(device):
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def profile_calls(fn, device) -> tuple:
    """(fn(), counts): the host calls of SYNCS, the DtoH copies and the top-level aten ops while fn runs. Counted
    on the profiler's raw events: building its FunctionEvents costs seconds per ten thousand events."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=_activities(device)) as prof:
        out = fn()
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.profiler.kineto_results.events()
    names: dict = {}
    aten: dict = {}  # thread -> [(start, end)] of its aten ops
    for e in events:
        name = e.name()
        names[name] = names.get(name, 0) + 1
        if name.startswith("aten::"):
            aten.setdefault(e.start_thread_id(), []).append((e.start_ns(), e.end_ns()))
    counts = {k: sum(names.get(n, 0) for n in keys) for k, keys in SYNCS.items()} if cuda else {}
    if cuda:
        counts["d2h_copies"] = sum(v for n, v in names.items() if n.startswith("Memcpy DtoH"))
    counts["aten_ops"] = sum(_outermost(spans) for spans in aten.values())
    return out, counts


def _outermost(spans: list) -> int:
    """How many of the [start, end] spans lie inside no other (an op another op calls runs inside its span)."""
    n, end = 0, -1
    for start, stop in sorted(spans, key=lambda s: (s[0], -s[1])):
        if start >= end:
            n, end = n + 1, stop
    return n


def per_round(metrics, counts: dict) -> dict:
    """A profiled generation's counts per round (a target pass) and per drafted token (None without drafts)."""
    rounds, drafted = max(metrics.n_target_forwards, 1), metrics.n_drafted
    return {"rounds": metrics.n_target_forwards, "drafted": drafted, "host_reads": metrics.host_reads,
            "per_round": {k: v / rounds for k, v in counts.items()},
            "per_drafted": {k: v / drafted for k, v in counts.items()} if drafted else None}


def outside_forwards(metrics_list) -> dict:
    """Over generations: decode time (wall - prefill) outside the draft's and target's forwards, from
    Metrics.breakdown() (one clock), as a share of decode, in ms per drafted token and per round, with its parts."""
    parts: dict = {}
    wall = drafted = rounds = 0
    for m in metrics_list:
        for k, v in m.breakdown().items():
            parts[k] = parts.get(k, 0.0) + v
        wall, drafted, rounds = wall + m.wall_s, drafted + m.n_drafted, rounds + m.n_target_forwards
    decode = wall - parts.get("prefill", 0.0)
    outside = max(0.0, decode - sum(parts.get(k, 0.0) for k in FORWARDS[1:]))
    return {"decode_s": decode, "outside_s": outside, "share": outside / decode if decode > 0 else None,
            "ms_per_drafted": 1000 * outside / drafted if drafted else None,
            "ms_per_round": 1000 * outside / rounds if rounds else None,
            "parts_s": {k: v for k, v in parts.items() if k not in FORWARDS}}


def top_kernels(lm, steps: int = 10, top: int = 12, ctx: int = 64) -> dict:
    """One-token steps of `lm` (as it runs them: graph replay once warmed) under the profiler after ctx cached
    positions: the device kernels by device time per step on CUDA, the ops by self CPU time elsewhere."""
    import torch
    from torch.autograd import DeviceType

    dev = torch.device(lm.device)
    cuda = dev.type == "cuda"
    lm.reset()
    lm.forward(torch.zeros(ctx, dtype=torch.long, device=dev), n_logits=0)
    one = torch.zeros(1, dtype=torch.long, device=dev)
    for _ in range(3):
        lm.rollback(ctx)
        lm.forward(one, 1)
    try:
        with torch.profiler.profile(activities=_activities(dev)) as prof:
            for _ in range(steps):
                lm.rollback(ctx)
                lm.forward(one, 1)
            if cuda:
                torch.cuda.synchronize(dev)
    finally:
        lm.reset()
        lm.counters.restart()
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    per: dict = {}
    for e in prof.events():
        if e.device_type != kind or (not cuda and e.cpu_parent is not None):
            continue
        t = e.time_range.elapsed_us() if cuda else e.cpu_time_total
        n, us = per.get(e.name, (0, 0.0))
        per[e.name] = (n + 1, us + t)
    total = sum(us for _, us in per.values()) or 1.0
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    return {"clock": "device" if cuda else "host: top-level ops, CPU time with what they call",
            "us_per_step": total / steps,
            "kernels_per_step": sum(n for n, _ in per.values()) / steps,
            "top": [{"name": name, "calls_per_step": n / steps, "us_per_step": us / steps, "share": us / total}
                    for name, (n, us) in rows]}


CUDA_COLUMNS = ("stream_syncs", "event_syncs", "device_syncs", "d2h_copies", "memcpy_async", "eager_launches",
                "graph_launches", "aten_ops")


def host_work_section(policies: list[dict], cuda: bool) -> list[str]:
    """Per policy: host reads a round (Metrics), the profiled generation's counts per round (per drafted token
    after the slash), and the time outside the forwards; nothing for replays without them."""
    if not policies or "host_reads_per_round" not in policies[0]:
        return []
    slash = any((p.get("profile") or {}).get("per_drafted") for p in policies)
    out = ["", "Host work per round (a target pass)" + (", per drafted token after the slash" if slash else "")
           + (": syncs, copies and launches from one generation under torch.profiler" if cuda else
              ": aten ops from one generation under torch.profiler (a CPU has no launches)")
           + "; host reads from Metrics; the time outside the forwards from Metrics.breakdown() (decode minus the "
           "draft's and the target's forwards) over the timed replays:", ""]
    cols = CUDA_COLUMNS if cuda else ("aten_ops",)
    rows = []
    for p in policies:
        prof, o = p.get("profile") or {}, p.get("outside") or {}
        pr, pd = prof.get("per_round") or {}, prof.get("per_drafted") or {}
        rows.append([p["config"], fixed(p.get("host_reads_per_round")),
                     *(f"{fixed(pr.get(c), 1)} / {fixed(pd.get(c), 1)}" if pd else fixed(pr.get(c), 1) for c in cols),
                     fixed(100 * o["share"] if o.get("share") is not None else None, 1),
                     fixed(o.get("ms_per_drafted"), 3), fixed(o.get("ms_per_round"), 3)])
    return out + [md_table(["policy", "host reads / round", *(c.replace("_", " ") for c in cols),
                            "outside forwards, % of decode", "outside, ms / drafted token", "ms / round"], rows)]


def kernels_md(k: dict, n: int = 8) -> list[str]:
    rows = [[f"`{t['name'][:90]}`", fixed(t["calls_per_step"], 1), fixed(t["us_per_step"], 1),
             f"{fixed(100 * t['share'], 1)}%"] for t in k["top"][:n]]
    return [f"Top of one fused one-token step ({k['clock']}): {fixed(k['us_per_step'], 1)} µs, "
            f"{fixed(k['kernels_per_step'], 0)} per step.", "",
            md_table(["kernel", "calls / step", "µs / step", "share"], rows)]


def first_token_section(rows: list[dict] | None) -> list[str]:
    """The report's section on the first token (none where it did not run)."""
    if not rows:
        return []
    cells = [[r["runtime"], r["cache"], f"failed: {r['error']}"] if "error" in r else
             [r["runtime"], r["cache"], f"**{fixed(r['first_token_s'])}**", fixed(r["start_s"] + r["import_s"]),
              fixed(r["build_s"]), fixed(r["prepare_s"]), fixed(r["generate_s"])] for r in rows]
    return ["## 5. The first token", "", "A fresh Python process: imports, the default preset's target alone with "
            "random weights (its real shapes), its runtime's one-token step prepared, a 128-token prompt's prefill and "
            "the first step. Cold: an empty inductor cache folder; warm: the same folder again.", "",
            md_table(["runtime", "inductor cache", "first token, s from the process's start", "imports s", "build s",
                      "prepare s (capture / compile)", "prefill + first step s"], cells), ""]


def first_token(runtime: str, device: str, cache_dir: Path, tiny: bool, timeout_s: float, preset: str) -> dict:
    """A fresh Python process's time from its start to its first generated token (the preset's target alone,
    random weights, `runtime`'s one-token step prepared first), with torch.compile's caches in `cache_dir`
    (empty: cold; again: warm). Its phases as the child timed them; {"error": ...} where it failed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}  # Triton's kernels follow inductor's
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "adaptive_spec.evaluation.round_profile", "--first-token", "--runtime", runtime,
           "--device", device, "--preset", preset] + (["--tiny"] if tiny else [])
    t0 = time.time()
    try:
        done = subprocess.run(cmd + ["--t0", repr(t0)], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        return {"error": f"no first token within {timeout_s:.0f} s"}
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith(MARK)), None)
    if done.returncode or line is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {done.returncode}: {tail[0][:300]}"}
    return {**json.loads(line[len(MARK):]), "process_s": time.time() - t0}


def first_tokens(runtimes, device: str, tiny: bool, budget_left, need_s: float, preset: str) -> tuple[list, list]:
    """Per runtime a cold then a warm first_token (one fresh inductor cache folder each runtime, removed after),
    each only while budget_left() exceeds need_s; (rows, notes of what was skipped)."""
    rows, notes = [], []
    for rt in runtimes:
        folder = Path(tempfile.mkdtemp(prefix="adaptive_spec_inductor_"))
        try:
            for cache in ("cold", "warm"):
                if budget_left() <= need_s:
                    notes.append(f"first token, {rt} {cache}: skipped (time budget)")
                    continue
                rows.append({"runtime": rt, "cache": cache,
                             **first_token(rt, device, folder, tiny, budget_left() - 10, preset)})
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return rows, notes


def _child(argv) -> int:
    """The first-token child: one JSON line after MARK on stdout, its phases in seconds since --t0."""
    t_start = time.time()
    ap = argparse.ArgumentParser()
    ap.add_argument("--first-token", action="store_true")
    for name in ("--runtime", "--device", "--preset"):
        ap.add_argument(name, required=True)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--t0", type=float, required=True)
    args = ap.parse_args(argv)
    import torch

    from ..backends import presets
    from ..decoding.decoder import Decoder
    from ..decoding.sampling import SamplingParams

    t_import = time.time()
    dev = torch.device(args.device)
    pair = presets.preset(args.preset, tiny=args.tiny)
    model = presets.build_model(pair.target, torch.bfloat16 if dev.type == "cuda" else torch.float32, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t_build = time.time()
    lm, _ = make_runner(model, args.runtime, pair.vocab_size, args.prompt_tokens + 64, [(1, 1)])
    t_ready = time.time()
    prompt = torch.randint(0, pair.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    out = Decoder(lm).generate(prompt.tolist(), max_new_tokens=1, sampling=SamplingParams(1.0, 50))
    t_first = time.time()
    print(MARK + json.dumps({"first_token_s": t_first - args.t0, "start_s": t_start - args.t0,
                             "import_s": t_import - t_start, "build_s": t_build - t_import,
                             "prepare_s": t_ready - t_build, "generate_s": t_first - t_ready,
                             "tokens": len(out.token_ids), "prompt_tokens": args.prompt_tokens}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
