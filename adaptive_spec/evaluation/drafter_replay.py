"""The feature drafter's traces replayed in the GPU check (eval/gpu_check.py, phase 3b): the acceptance a CPU run of
the real target and the committed drafter recorded (configs/sweep/gpu_traces_drafter.yaml: the target alone, fixed
K and SpecDec++ with the drafter's own head), replayed through the real decoder on the target's random-weight model
of the real shape behind a HiddenTap, with a random-weight drafter of the committed shape (drafter_step.py) as the
draft runner. Per policy: tok/s, the speed-up over the target's own AR in the same run (the target alone on its
replay runtime, no tap), the counts checked against the recorded ones; then the best fixed K and SpecDec++ against
its bars. The tapped target's verify passes (forward_hidden: every fed row's state) run from graphs of their own,
and the drafter as decoding runs it (StaticFeatureRunner: its step in one graph of the same runtime)."""
from __future__ import annotations

from pathlib import Path

from ..backends.static_runner import verify_shapes
from ..decoding.decoder import Decoder
from ..drafter.source import HiddenTap
from ..drafter.static import StaticFeatureRunner
from .drafter_step import build_drafter
from .gpu_bench import fmt, load_traces
from .round_profile import make_runner

TRACES = "eval/results/sweep_gpu_traces_drafter"  # configs/sweep/gpu_traces_drafter.yaml's out_dir
RECORD = "adaptive-spec sweep --config configs/sweep/gpu_traces_drafter.yaml"
BAR_AR, BAR_FIXED = 2.0, 1.05  # SpecDec++ with the drafter: >= 2x the target's own AR, >= 1.05x the best fixed K


def drafter_runner(drafter, readout, tap: HiddenTap, max_cache: int, runtime: str):
    """The drafter as decoding runs it beside a target of `runtime`: its one-token step (and a head) in one graph."""
    cuda = drafter.device.type == "cuda"
    own = ("compile" if runtime.endswith("compile") else
           "cudagraph" if cuda and runtime in ("cudagraph", "fused") else "eager")  # round_profile's runtime names
    runner = StaticFeatureRunner(drafter, readout, tap, max_cache, own)
    runner.warmup()
    return runner


def load(folder: Path, root: Path, n_rows: int | None) -> tuple[dict | None, str | None]:
    """(the drafter's trace sweep as gpu_bench.load_traces reads it, None), or (None, why there is none)."""
    shown = folder.relative_to(root) if folder.is_relative_to(root) else folder
    if not (folder / "results.jsonl").is_file() or not (folder / "config.json").is_file():
        return None, f"no drafter traces at `{shown}`; record them on a CPU with `{RECORD}` (or pass --drafter-traces)"
    try:
        traces = load_traces(folder, root, n_rows)
    except SystemExit as e:  # a folder of rows without traces
        return None, str(e).removeprefix("error: ")
    if traces["pair"].get("draft", {}).get("drafter") != "feature":
        return None, (f"the traces at `{shown}` were not drafted by a feature drafter (config.json's trace_pair names "
                      f"{traces['pair'].get('draft', {}).get('name')}); record them with `{RECORD}`")
    return traces, None


def replay(args, target_model, runtime: str, pair, traces: dict, replay_config, allows, log) -> dict:
    """Every config of `traces` replayed: the target alone on a runner of `runtime` (its own AR), the drafted ones on
    the same runner behind a HiddenTap with the drafter's runner; `replay_config` is the check's (one config's rows
    through a Decoder), `allows(seconds)` the time budget's test, `log(line)` its progress. The phase's entry of the
    check's results."""
    vocab = pair.vocab_size
    max_cache = -(-(traces["max_len"] + traces["max_k"] + 2) // 64) * 64
    runner, warm = make_runner(target_model, runtime, vocab, max_cache, [(1, 1)])
    if runtime != "eager":  # the tapped verify passes: every row's state, from graphs of their own
        warm += runner.warmup(verify_shapes(traces["max_k"]), rows=True)
    drafter, readout = build_drafter(target_model, vocab, args.tiny)
    tap = HiddenTap(runner)
    draft = drafter_runner(drafter, readout, tap, max_cache, runtime)
    alone = Decoder(runner, draft, eos_token_ids=(), host_reads=args.host_reads)  # no policy: the draft idles
    drafted = Decoder(tap, draft, eos_token_ids=(), host_reads=args.host_reads)
    tp, hub = traces["pair"], pair.target.hub_id
    recorded = tp.get("target", {}).get("hub_id") or tp.get("target", {}).get("name")
    out = {"folder": traces["folder"], "target": hub, "runtime": runtime, "warmup_s": warm,
           "label": acceptance(recorded, hub), "drafter_runner": type(draft).__name__,
           "recorded_with": f"{tp['draft']['name']} / {recorded}",
           "sampling": f"T = {traces['sampling'].temperature:g}, top-k {traces['sampling'].top_k}",
           "shape": {"intermediate": drafter.config_obj.intermediate_size, "kept_ids": len(readout.kept_ids)},
           "policies": [], "skipped": []}
    for config, rows in traces["by_config"].items():
        if not allows(15):
            out["skipped"].append(f"{config} (time budget)")
            continue
        try:
            p, _ = replay_config(args, pair, alone if rows[0]["method"] == "ar" else drafted, traces, config, rows)
        except Exception as e:  # a policy that fails is a finding: keep it and go on
            p = {"config": config, "method": rows[0]["method"], "error": f"{type(e).__name__}: {e}"}
        out["policies"].append(p)
        log(f"{config}: {p['error']}" if "error" in p else
            f"{config}: {p['tok_s'] or 0:.1f} tok/s, counts reproduced {p['counts_reproduced']}")
    return {**out, **verdict(out["policies"])}


def acceptance(recorded: str | None, hub: str) -> str:
    """What a replay on the target `hub` measures, given the target the traces were recorded with."""
    base = hub.removeprefix("tiny:")
    if recorded == base:
        return "measured acceptance: the traces' own target" + (" (on tiny shapes of it)" if hub != base else "")
    return f"BORROWED acceptance: traces recorded on {recorded} replayed on {hub}'s shapes"


def verdict(policies: list[dict]) -> dict:
    """Each policy's speed-up over the target alone (set in place); the best fixed K; per SpecDec++ config its
    ratios to the target alone and to the best fixed K against the bars."""
    ran = [p for p in policies if p.get("tok_s")]
    ar = next((p["tok_s"] for p in ran if p["method"] == "ar"), None)
    for p in ran:
        p["speedup"] = p["tok_s"] / ar if ar else None
    fixed = [p for p in ran if p["method"] == "fixed"]
    best = max(fixed, key=lambda p: p["tok_s"]) if fixed else None
    specdec = []
    for p in ran:
        if p["method"] == "learned":
            vs_fixed = p["tok_s"] / best["tok_s"] if best else None
            specdec.append({"config": p["config"], "vs_ar": p["speedup"], "vs_best_fixed": vs_fixed,
                            "meets_ar_bar": p["speedup"] is not None and p["speedup"] >= BAR_AR,
                            "meets_fixed_bar": vs_fixed is not None and vs_fixed >= BAR_FIXED})
    return {"best_fixed": best["config"] if best else None, "specdec": specdec,
            "counts_reproduced": bool(policies) and all(p.get("counts_reproduced") for p in policies)}


def drafter_replay_md(res: dict) -> list[str]:
    """The report's section of phase 3b."""
    d = res.get("drafter_replay")
    if not d:
        return []
    out = ["## 3b. The feature drafter's traces replayed", ""]
    if "policies" not in d:
        return out + [f"Not run: {d.get('skipped') or d.get('error')}.", ""]
    s = d["shape"]
    out += [f"Traces: `{d['folder']}`, recorded with {d['recorded_with']}; {d['sampling']}. Replayed on {d['target']} "
            f"(random weights) on `{d['runtime']}`, with a random-weight drafter of the committed shape (MLP width "
            f"{s['intermediate']}, readout over {s['kept_ids']} kept rows) as `{d['drafter_runner']}`. The target "
            "alone (ar) steps on that runtime; behind the HiddenTap its verify passes return every row's state "
            "(forward_hidden), from that runtime's graphs of every verify shape. Speed-ups are over that target alone, in this run.", "",
            f"**{d['label']}**.", "",
            "| policy | generations | tokens | counts reproduced | replay tok/s | **speed-up over own AR** |",
            "|---|---|---|---|---|---|"] + [_row(p, d["best_fixed"]) for p in d["policies"]]
    out += ["", f"- counts as recorded in every replayed policy: {'yes' if d['counts_reproduced'] else 'NO'}"]
    for e in d["specdec"]:
        out.append(f"- SpecDec++ `{e['config']}`: {fmt(e['vs_ar'])}x the target's own AR (bar >= {BAR_AR}: "
                   f"{'met' if e['meets_ar_bar'] else 'NOT met'}), {fmt(e['vs_best_fixed'])}x the best fixed K "
                   f"`{d['best_fixed']}` (bar >= {BAR_FIXED}: {'met' if e['meets_fixed_bar'] else 'NOT met'})")
    out += [f"- not replayed: {', '.join(d['skipped'])}"] if d["skipped"] else []
    return out + [""]


def _row(p: dict, best_fixed: str | None) -> str:
    """One policy's line of the section's table."""
    if "error" in p:
        return f"| {p['config']} | failed: {p['error']} |"
    tag = " (best fixed K)" if p["config"] == best_fixed else ""
    return (f"| {p['config']}{tag} | {p['rows']} | {p['tokens']} | {'yes' if p['counts_reproduced'] else 'NO'} | "
            f"{fmt(p['tok_s'], 1)} | **{fmt(p.get('speedup'))}** |")
