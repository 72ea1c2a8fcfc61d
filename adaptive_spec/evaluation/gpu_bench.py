"""What the GPU benchmarks share (eval/bench_gpu.py, eval/gpu_check.py): the bandwidth roofline, timing loops
with no host sync inside, transformers' compiled `generate` as a baseline, Eq. 5.1's ESTIMATED speed-ups (a
model, not a measurement), and for the trace replays the trace sweep and auto's picks beside the best replayed."""
from __future__ import annotations

import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from ..backends.runner import kv
from ..tables import fixed as fmt
from ..timing import sync, timed

# HBM bandwidth in TB/s by device name (vendor datasheets); --bandwidth-tbs overrides
BANDWIDTH_TBS = [("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35), ("GH200", 4.0),
                 ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935), ("A100", 1.555), ("L40S", 0.864),
                 ("L40", 0.864), ("L4", 0.3), ("A10G", 0.6), ("A10", 0.6), ("RTX 4090", 1.008),
                 ("RTX 3090", 0.936), ("V100", 0.9), ("T4", 0.32)]

ESTIMATE_BANNER = ("ESTIMATE - a model, not a measurement: Eq. 5.1 of SpecDec++, T = t_draft*N_draft + "
                   "t_target*N_target, with the GPU step times measured here and acceptance statistics "
                   "measured elsewhere (--stats).")


def lookup_bandwidth(device: torch.device, flag: float | None) -> tuple[float | None, str]:
    if flag:
        return flag * 1e12, "--bandwidth-tbs"
    if device.type != "cuda":
        return None, "unknown (pass --bandwidth-tbs)"
    name = torch.cuda.get_device_name(device)
    for key, tbs in BANDWIDTH_TBS:
        if key.lower() in name.lower():
            return tbs * 1e12, f"datasheet value for '{key}' ({name})"
    return None, f"unknown for '{name}' (pass --bandwidth-tbs)"


def model_bytes(model) -> dict:
    """Bytes a decode step reads: every weight once except the input embedding matrix, of which
    one row is read (when tied, the LM head reads the matrix anyway and it is counted once)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    tied = emb.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    read = params if tied else params - emb.numel() * emb.element_size() + emb.shape[1] * emb.element_size()
    return {"param_bytes": params, "weight_bytes_read_per_token": read,
            "n_params": sum(p.numel() for p in model.parameters())}


def time_loop(fn, iters: int, device: torch.device, warm: int = 2, host: bool = False) -> float:
    """ms per call of fn(), from CUDA events around the whole loop (no sync inside) on CUDA, perf_counter on
    CPU or with `host` (for code that reads back to the host itself); warm-up calls excluded."""
    for _ in range(warm):
        fn()
    sync(device)
    if device.type == "cuda" and not host:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / iters
    with timed(device) as t:
        for _ in range(iters):
            fn()
    return t.s * 1000 / iters


def measure_hf_generate(model, contexts, gen_tokens: int, repeats: int, device) -> dict:
    """Decode tokens/s of model.generate (greedy) with a StaticCache (auto-compiled on CUDA),
    as (t(G) - t(1)) / (G - 1); the first calls (compile) are excluded."""
    from transformers import StaticCache

    V = model.config.vocab_size
    cache = StaticCache(config=model.config, max_cache_len=max(contexts) + gen_tokens + 8)
    g = torch.Generator(device="cpu").manual_seed(1)
    out = {"compiled": None}

    def run(ids, n):
        cache.reset()
        sync(device)
        with timed(device) as t:
            res = model.generate(ids, attention_mask=torch.ones_like(ids), **kv(type(model).forward, cache),
                                 max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            assert res.shape[1] == ids.shape[1] + n
        return t.s

    for c in contexts:
        ids = torch.randint(0, V, (1, c), generator=g).to(device)
        for _ in range(2):  # compile + capture
            run(ids, gen_tokens)
        t_full = statistics.median(run(ids, gen_tokens) for _ in range(repeats))
        t_one = statistics.median(run(ids, 1) for _ in range(repeats))
        out[c] = (gen_tokens - 1) / max(t_full - t_one, 1e-9)
    try:
        out["compiled"] = bool(model._valid_auto_compile_criteria({"past_key_values": cache}, model.generation_config))
    except Exception:  # private API; informational only
        pass
    return out


def _policy_key(row: dict) -> str:
    name = str(row.get("config") or row.get("policy") or row.get("name") or "?")
    if "temperature" in row and row["temperature"] is not None:
        name += f"@t={float(row['temperature']):g}"
    return name


def load_stats(paths) -> dict:
    """Per-policy acceptance statistics {name: {"target_per_token", "draft_per_token", "discard_rate",
    "tokens_per_target_forward"}} from a sweep's results.jsonl (counts summed per config and temperature), a JSON
    list of such rows, or a JSON object {name: counts or rates} (optionally under "policies")."""
    rows, named = [], {}
    for p in paths:
        text = Path(p).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        if isinstance(data, dict):
            data = data.get("policies", data)
            named.update({str(k): v for k, v in data.items() if isinstance(v, dict)})
        else:
            rows += [r for r in data if isinstance(r, dict)]
    return stats_of(rows, named)


def stats_of(rows: list[dict], named: dict | None = None) -> dict:
    """load_stats on rows already read (and `named` rates or counts by policy name)."""
    named = dict(named or {})
    sums: dict = {}
    for r in rows:
        if not all(k in r for k in ("n_tokens", "n_target_forwards", "n_discarded")):
            continue
        s = sums.setdefault(_policy_key(r), {"n_tokens": 0, "n_target_forwards": 0, "n_discarded": 0,
                                             "n_draft_forwards": 0, "has_draft": True})
        for k in ("n_tokens", "n_target_forwards", "n_discarded"):
            s[k] += r[k]
        if r.get("n_draft_forwards") is None:
            s["has_draft"] = False
        else:
            s["n_draft_forwards"] += r["n_draft_forwards"]
    named.update(sums)
    out = {}
    for name, s in named.items():
        if "n_tokens" in s:
            N = max(s["n_tokens"], 1)
            tgt, disc = s["n_target_forwards"] / N, s["n_discarded"] / N
            drf = s["n_draft_forwards"] / N if s.get("has_draft", "n_draft_forwards" in s) else None
        elif "tokens_per_target_forward" in s:
            tgt, disc = 1.0 / s["tokens_per_target_forward"], s.get("discard_rate", 0.0)
            drf = s.get("draft_forwards_per_token")
        else:
            continue
        if drf is None:  # Lemma 3.1: N_draft + N_target = N + N_discarded
            drf = 1.0 + disc - tgt
        if drf <= 0 and tgt >= 1.0 - 1e-9:  # target-only decoding (ar): no speculation to model
            continue
        out[name] = {"target_per_token": tgt, "draft_per_token": drf, "discard_rate": disc,
                     "tokens_per_target_forward": 1.0 / tgt if tgt else float("inf")}
    return out


def interp(table: dict, x: float) -> float:
    """Piecewise-linear interpolation of {int n: ms} at x; past the ends, the least-squares slope over all points
    (floored at zero: one noisy neighbour must not make a longer pass cheaper)."""
    ks = sorted(int(k) for k in table)
    t = {int(k): float(v) for k, v in table.items()}
    if len(ks) == 1:
        return t[ks[0]]
    if ks[0] <= x <= ks[-1]:
        lo = min(max(k for k in ks if k <= x), ks[-2])
        hi = ks[ks.index(lo) + 1]
        return t[lo] + (t[hi] - t[lo]) * (x - lo) / (hi - lo)
    mx, my = sum(ks) / len(ks), sum(t.values()) / len(ks)
    slope = max(0.0, sum((k - mx) * (t[k] - my) for k in ks) / sum((k - mx) ** 2 for k in ks))
    end = ks[-1] if x > ks[-1] else ks[0]
    return max(0.0, t[end] + slope * (x - end))


def estimate(stats: dict, draft_rows: list, target_rows: list, overhead: dict | None) -> list[dict]:
    """Eq. 5.1 per policy and context: T/N = t_draft*N_draft/N + t_target(L)*N_target/N, with
    t_target(L) the measured verify time at the policy's mean verify length L = 1 + K_mean.
    The AR reference is the target's own 1-token step (same runtime)."""
    out = []
    by_ctx = {r["context"]: r for r in draft_rows}
    for tr in target_rows:
        dr = by_ctx.get(tr["context"])
        if dr is None:
            continue
        t_ar = tr["verify_ms"][1]
        for name, s in stats.items():
            k_mean = s["draft_per_token"] / s["target_per_token"] if s["target_per_token"] else 0.0
            t_draft = dr.get("step_head_ms", dr["step_ms"]) if "learned" in name else dr["step_ms"]
            t_target = interp(tr["verify_ms"], 1.0 + k_mean)
            per_tok = t_draft * s["draft_per_token"] + t_target * s["target_per_token"]
            row = {"context": tr["context"], "policy": name, **s, "k_mean": k_mean, "t_draft_ms": t_draft,
                   "t_target_ms": t_target, "est_ms_per_token": per_tok, "est_speedup": t_ar / per_tok}
            if overhead:
                ks = sorted(k for k in overhead if isinstance(k, int))
                ov = interp({k: overhead[k] for k in ks}, k_mean) if ks else 0.0
                ar = t_ar + overhead.get("ar_token", 0.0)
                per_tok_ov = per_tok + ov * s["target_per_token"]
                row.update(est_ms_per_token_with_overhead=per_tok_ov, est_speedup_with_overhead=ar / per_tok_ov)
            out.append(row)
    return out


# ----------------------------------------------------------------------------- replayed picks of h and K

def load_traces(folder: Path, root: Path, n_rows: int | None = None) -> dict:
    """The trace sweep: its rows by config (in grid order; n_rows of each, on the same prompts: select_rows),
    sampling, head folders (relative to `root`, as the sweep names them), the head's threshold curve (None where it
    has none) and the pair that made it."""
    from ..decoding.sampling import SamplingParams
    from ..errors import UserError
    from ..heads.curve import load_curve

    cfg = json.loads((folder / "config.json").read_text())
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "trace" in r]
    if not rows:
        raise SystemExit(f"error: {folder} holds no traces; record them with a sweep with record_trace: true "
                         "(configs/sweep/gpu_traces.yaml)")
    by_config: dict = {}
    for r in rows:
        by_config.setdefault(r["config"], []).append(r)
    by_config = select_rows(by_config, n_rows)
    rows = [r for rs in by_config.values() for r in rs]
    c = cfg["config"]
    shown = folder.relative_to(root) if folder.is_relative_to(root) else folder  # the report reads the same anywhere
    curve, curve_note = None, None
    if c.get("heads"):  # what auto reads: the curve beside the (first) head
        try:
            curve = load_curve(root / c["heads"][0], "k")
        except UserError as e:
            curve_note = f"auto's picks: no threshold curve ({e})"
    return {"folder": str(shown), "pair": cfg.get("trace_pair", {}), "by_config": by_config,
            "sampling": SamplingParams(c["temperature"], c["top_k"], c["top_p"]), "heads": c.get("heads", []),
            "k_max": c.get("k_max", 20), "max_k": max((k for r in rows for k, _, _ in r["trace"]), default=1),
            "max_len": max(r["n_prompt_tokens"] + r["n_tokens"] for r in rows), "curve": curve,
            "curve_note": curve_note, "datasets": sorted({str(r.get("dataset")) for r in rows}),
            "context": int(statistics.median(r["n_prompt_tokens"] + r["n_tokens"] // 2 for r in rows))}


def acceptance_label(pair: str, source: str | None) -> str:
    """What a replay on preset `pair` measures, given the preset that recorded the traces (`source`)."""
    base, tiny = pair.split(":")[0], pair.endswith(":tiny")
    shapes = " (on tiny shapes of it)" if tiny else ""
    if base == source:
        return f"measured acceptance: the traces' own pair{shapes}"
    return f"BORROWED acceptance: traces of {source or 'a pair of no preset'} replayed on {pair}'s shapes"


def inner_policy(row: dict, traces: dict, draft_lm, device, root: Path):
    """The recorded policy's stop rule for these runners (asked at every drafted step, for its cost): the
    trace's own head where the draft has its hidden size, else a random head of the same depth, feature and inputs
    (a head of the draft's statistics computes them at every step: that is its cost; head folders relative to
    `root`)."""
    from ..decoding.policies import FixedK, LearnedThreshold
    from ..heads.head import AcceptanceHead, load_head

    if row["method"] == "fixed":
        return FixedK(int(row["k"]))
    if row["method"] != "learned":
        return None
    path = next((h for h in traces["heads"] if Path(h).name == row["head"] or row["head"] in h), None)
    info = json.loads((root / path / "config.json").read_text()) if path else {}
    if info.get("hidden_size") == draft_lm.hidden_size:
        head = load_head(str(root / path), hidden_size=draft_lm.hidden_size, device=device)
    else:
        head = AcceptanceHead(draft_lm.hidden_size, depth=info.get("depth", 3), feature=info.get("feature", "token"),
                              inputs=info.get("inputs", "hidden"), stats_sampling=info.get("stats_sampling"))
        head = head.to(device).eval()
    return LearnedThreshold(head, row["h"], traces["k_max"])


def select_rows(by_config: dict, n: int | None) -> dict:
    """Each config's rows on the same n prompts (None: all), taken round-robin over the datasets in the order the
    sweep ran them, so every config replays the same prompts and a dataset is not left out."""
    if not n:
        return by_config
    keys: dict = {}
    for rows in by_config.values():
        for r in rows:
            keys.setdefault(r.get("dataset"), {}).setdefault((r.get("dataset"), r.get("prompt_idx")), None)
    keep = set([k for ks in itertools.zip_longest(*keys.values()) for k in ks if k is not None][:n])
    return {c: [r for r in rows if (r.get("dataset"), r.get("prompt_idx")) in keep] for c, rows in by_config.items()}


def measured_costs(draft_row: dict, target_row: dict, loop: dict | None):
    """costs.Costs from a check's step table (ms per one-token step, per verify pass of n rows) and loop times:
    what `--threshold auto` measures at load, measured here on the check's runners."""
    from ..decoding.auto import Costs, monotone

    v = {int(k): float(x) / 1000 for k, x in target_row["verify_ms"].items()}
    ns = list(range(1, max(v) + 1))  # Costs.t_verify holds every length from 1: the unmeasured ones interpolated
    table = monotone([interp(v, n) for n in ns])
    mx, my = sum(ns) / len(ns), sum(table) / len(ns)
    slope = max(0.0, sum((n - mx) * (t - my) for n, t in zip(ns, table)) / (sum((n - mx) ** 2 for n in ns) or 1))
    two = {int(k): x for k, x in draft_row.get("verify_ms", {}).items()}.get(2)
    return Costs(draft_row["step_ms"] / 1000, table[0], slope, "gpu_check", time.strftime("%Y-%m-%d %H:%M"),
                 tuple(table), loop=loop, t_draft_two=max(draft_row["step_ms"], two or 0.0) / 1000)


def replay_picks(policies: list[dict], curve: dict | None, costs, loop: str, k_max: int) -> dict:
    """Per kind ("h": SpecDec++, "k": fixed K) with two or more values replayed: the best replayed value, and
    auto's pick at these costs from the curve's points at the replayed values (`unrestricted`: at all of them),
    with its replayed tok/s over the best's."""
    from ..decoding.auto import AR, DEFAULT_TIME_MODEL, pick

    kinds, by = {"learned": "h", "fixed": "k"}, {"h": {}, "k": {}}
    for p in policies:
        kind = kinds.get(p["method"])
        if kind and p.get("tok_s") and p.get("value") is not None:
            by[kind][p["value"]] = p["tok_s"]
    ar = next((p["tok_s"] for p in policies if p["method"] == "ar" and p.get("tok_s")), None)
    out = {}
    for kind, seen in by.items():
        if len(seen) < 2:
            continue
        best = max(seen, key=seen.get)
        entry = out[kind] = {"replayed": {str(v): t for v, t in sorted(seen.items())}, "best": best,
                             "best_tok_s": seen[best]}
        if curve is None or costs is None:
            entry["auto"] = None
            continue
        field = "thresholds" if kind == "h" else "fixed_k"
        sub = {**curve, field: [pt for pt in curve.get(field, []) if any(abs(pt[kind] - v) < 1e-9 for v in seen)]}
        if not sub[field]:
            entry["auto"] = None
            entry["note"] = f"the curve has no points at the replayed {kind} values"
            continue
        got = pick(sub, kind, costs, DEFAULT_TIME_MODEL, k_max, loop)
        value = got["value"]
        tok = ar if value == AR else next((t for v, t in seen.items() if abs(v - value) < 1e-9), None)
        top = max(seen[best], ar or 0.0)
        entry.update(auto=value, auto_tok_s=tok, auto_ratio=tok / top if tok else None,
                     within_3pct=bool(tok and tok >= 0.97 * top), predicted=got["predicted"],
                     unrestricted=pick(curve, kind, costs, DEFAULT_TIME_MODEL, k_max, loop)["value"])
    return out


def picks_md(picks: dict) -> list[str]:
    """The report's lines for replay_picks."""
    out = []
    for kind, e in picks.items():
        name = "h" if kind == "h" else "K"
        line = (f"- best replayed {name}: **{e['best']:g}** ({fmt(e['best_tok_s'], 1)} tok/s; replayed: "
                + ", ".join(f"{v} {fmt(t, 1)}" for v, t in e["replayed"].items()) + ")")
        if e.get("auto") is None:
            line += f"; auto's pick: - ({e.get('note', 'no curve or costs')})"
        else:
            auto = e["auto"] if isinstance(e["auto"], str) else f"{e['auto']:g}"
            line += (f"; auto's pick from these costs: **{auto}** ({fmt(e['auto_tok_s'], 1)} tok/s, "
                     f"{fmt(100 * e['auto_ratio'] if e['auto_ratio'] else None, 1)}% of the best: "
                     f"{'within 3%' if e['within_3pct'] else 'NOT within 3%'}; "
                     f"from the whole curve: {e['unrestricted']})")
        out.append(line)
    return out
