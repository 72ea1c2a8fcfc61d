"""The feature drafter's one-token draft step at its real shape, for the GPU check (eval/gpu_check.py):
random weights of the committed drafter's shape for the check's target, timed per runtime at the context
the models' table uses, and its cost ratio c to the target's fastest one-token step.

Runtimes: `runner`, FeatureRunner as decoding runs it (a DynamicCache, the tokens read to the host, logits
spread over the whole vocabulary); `eager`, the step on static buffers (drafter/step.py's DrafterStep, the
step the static drafter runner replays in decoding: a static KV cache written at a device position, the fed
token and state in fixed tensors, the next ones written back), uncaptured; `cudagraph`,
that step captured as one CUDA graph (fc, the decoder layer, the final norm, the kept rows of the LM head,
softmax and argmax) and replayed."""
from __future__ import annotations

import time

import torch

from ..backends.presets import QWEN_ROWS
from ..drafter.model import FeatureDrafter, Readout
from ..drafter.source import FeatureRunner
from ..drafter.step import DrafterStep
from ..tables import md_table
from .gpu_bench import fmt, time_loop

DRAFTER_HIDDEN, DRAFTER_MLP = 1536, 2048  # the committed drafter (checkpoints/drafter-qwen-coder-1.5b-cpu)
DRAFTER_KEPT = 32_000  # its readout's kept ids (training's ce_vocab)
C_BAR = 0.12  # the step cost ratio the drafter is built to stay under


def drafter_dims(target_model, tiny: bool) -> tuple[int, int]:
    """(MLP width, kept ids) of the committed drafter; on tiny shapes the same ratios to the tiny target's
    hidden size and vocabulary."""
    if not tiny:
        return DRAFTER_MLP, DRAFTER_KEPT
    h, rows = target_model.config.hidden_size, target_model.config.vocab_size
    return max(8, round(h * DRAFTER_MLP / DRAFTER_HIDDEN / 8) * 8), max(2, round(rows * DRAFTER_KEPT / QWEN_ROWS))


class TargetStates:
    """Stands in for the target's HiddenTap: random final hidden states of the first `n` positions."""

    def __init__(self, n: int, hidden: int, dtype, device):
        g = torch.Generator(device="cpu").manual_seed(2)
        self.length = n
        self.rows = torch.randn(n, hidden, generator=g).to(device=device, dtype=dtype)

    def features(self, start: int, end: int) -> torch.Tensor:
        return self.rows[start:end]


def _runner_ms(drafter, readout, states, ids, ctx: int, iters: int, device) -> float:
    """ms of FeatureRunner's one-token step after ctx positions (the tap's states for all of them)."""
    runner = FeatureRunner(drafter, readout, states)
    runner.forward(ids[:ctx], n_logits=0)
    tok = ids[ctx:ctx + 1].clone()

    def f():
        runner.rollback(ctx)
        runner.forward(tok, 1)
    return time_loop(f, iters, device, host=True)  # it reads the tokens back to the host itself


def build_drafter(target_model, vocab_size: int, tiny: bool) -> tuple[FeatureDrafter, Readout]:
    """A random-weight drafter of the committed shape for `target_model`, and its readout over the first ids (of
    the trained list's cost: the same number of LM head rows)."""
    mlp, n_kept = drafter_dims(target_model, tiny)
    drafter = FeatureDrafter.for_target(target_model, init_from_target=False, name="random",
                                        intermediate_size=mlp).eval()
    return drafter, Readout(target_model, vocab_size, torch.arange(n_kept))


def time_drafter(target_model, vocab_size: int, ctx: int, max_cache: int, iters: int, tiny: bool) -> dict:
    """The drafter of the committed shape for `target_model` (random weights), its step timed per runtime:
    {"shape": ..., "context": ctx, "rows": {runtime: {"warmup_s", "step_ms"} or {"error"}}, "skipped": {...}}."""
    drafter, readout = build_drafter(target_model, vocab_size, tiny)
    dev, h = drafter.device, drafter.hidden_size
    mlp, n_kept = drafter.config_obj.intermediate_size, len(readout.kept_ids)
    n_params = sum(p.numel() for p in drafter.parameters())
    out = {"shape": {"hidden": h, "intermediate": mlp, "kept_ids": n_kept, "kept_ids_source": "the first ids",
                     "n_params": n_params}, "context": ctx, "rows": {}, "skipped": {}}
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, n_kept, (ctx + 1,), generator=g).to(dev)
    states = TargetStates(ctx, h, drafter.dtype, dev)
    runs = {"runner": lambda: (None, _runner_ms(drafter, readout, states, ids, ctx, iters, dev)),
            "eager": lambda: _static_ms(drafter, readout, states, ids, ctx, max_cache, iters, False),
            "cudagraph": lambda: _static_ms(drafter, readout, states, ids, ctx, max_cache, iters, True)}
    if dev.type != "cuda":
        del runs["cudagraph"]
        out["skipped"]["cudagraph"] = "CUDA only (a CPU has no CUDA graphs)"
    for rt, run in runs.items():
        try:
            warm, ms = run()
            out["rows"][rt] = {"warmup_s": warm, "step_ms": ms}
        except Exception as e:
            out["rows"][rt] = {"error": f"{type(e).__name__}: {e}"}
    return out


def static_step(drafter, readout, states, ids, ctx: int, max_cache: int) -> DrafterStep:
    """A DrafterStep at FeatureRunner's timed step: slots 0..ctx-2 cached, slot ctx-1 (f_{ctx-1}, x_ctx) fed."""
    step = DrafterStep(drafter, readout, max_cache)
    step.prefill(states.features(0, ctx - 1), ids[1:ctx])
    step.tok.copy_(ids[ctx].view(1, 1))
    step.feat.copy_(states.features(ctx - 1, ctx).view_as(step.feat))
    return step


def _static_ms(drafter, readout, states, ids, ctx, max_cache, iters, graph: bool) -> tuple[float, float]:
    """(set-up and capture seconds, ms per step) of static_step, captured with `graph`."""
    t0 = time.perf_counter()
    step = static_step(drafter, readout, states, ids, ctx, max_cache)
    if graph:
        step.capture()
    warm = time.perf_counter() - t0

    @torch.inference_mode()
    def f():
        step.pos.fill_(ctx - 1)  # the same context each step, as the target's table rolls back
        step.graph.replay() if graph else step.step()
    return warm, time_loop(f, iters, drafter.device)


# ----------------------------------------------------------------------------- ratios and report

def target_best(res: dict, hub: str) -> tuple[str, float] | None:
    """(runtime, ms) of the target's fastest one-token step in the models' table; None where none ran."""
    rows = {rt: r["step_ms"] for rt, r in res["models"].get(hub, {}).get("rows", {}).items() if "step_ms" in r}
    return min(rows.items(), key=lambda item: item[1]) if rows else None


def ratios(res: dict) -> dict:
    """c per drafter runtime: its step over the target's fastest one-token step, from the numbers in `res`."""
    d = res.get("drafter") or {}
    best = target_best(res, d.get("target", ""))
    if not best:
        return {}
    return {rt: r["step_ms"] / best[1] for rt, r in d.get("rows", {}).items() if "step_ms" in r}


def drafter_md(res: dict) -> list[str]:
    d = res.get("drafter")
    if not d:
        return []
    if "error" in d:
        return ["## 2b. Feature drafter step", "", f"Failed for {d['target']}: {d['error']}", ""]
    s, best, c = d["shape"], target_best(res, d["target"]), ratios(res)
    against = (f"the target's fastest one-token step in this run ({best[0]}: {fmt(best[1], 3)} ms)" if best
               else "the target's fastest one-token step (not timed in this run: no c)")
    out = ["## 2b. Feature drafter step", "",
           f"A feature drafter of the committed one's shape for {d['target']}, random weights: fc {2 * s['hidden']}"
           f" -> {s['hidden']}, one decoder layer of the target's architecture with MLP width {s['intermediate']} "
           f"({s['n_params'] / 1e6:.1f} M parameters), read out through the target's final norm and {s['kept_ids']} "
           f"rows of its LM head ({s['kept_ids_source']}: a stand-in for the trained list, of the same cost). One "
           f"token drafted after {d['context']} cached positions. c = the drafter's step / {against}.", "",
           "`runner`: FeatureRunner, as decoding runs it (DynamicCache, the token read to the host, logits over the "
           "whole vocabulary); `eager`: the step on static buffers and a static KV cache; `cudagraph`: that step "
           "(fc, layer, norm, kept rows, softmax, argmax) captured as one CUDA graph.", ""]
    rows = [[rt, f"failed: {r['error']}"] if "error" in r else
            [rt, fmt(r["warmup_s"], 1), fmt(r["step_ms"], 3), fmt(c.get(rt), 3),
             "-" if rt not in c else "yes" if c[rt] <= C_BAR else "no"] for rt, r in d["rows"].items()]
    rows += [[rt, f"skipped: {why}"] for rt, why in d.get("skipped", {}).items()]
    return out + [md_table(["runtime", "warm-up s", "step ms", "c", f"c <= {C_BAR}"], rows), ""]
