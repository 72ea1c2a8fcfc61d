"""Evaluation sweeps (SpecDec++ section 5, appendix D): every decoding configuration on every prompt.

    adaptive-spec sweep --config configs/sweep/paper.yaml [key=value ...]

For each dataset and each prompt, all configurations run back to back, so machine noise hits them
alike and per-prompt ratios compare like with like. With a `drafts` list (draft configurations
QUANT[:VOCAB], e.g. [none, int8, int8:32768]; `make bench`), every configuration that drafts runs once
per entry (key KEY@ENTRY, rows carry `draft`) against one loaded target, and the report gives each
dataset and entry its own column:

    ar            target alone (autoregressive; stand-alone t_target)
    draft_ar      draft alone (stand-alone t_draft; its forwards are counted as N_draft)
    fixed k=K     SpecDec with a fixed candidate length, for each K in `ks`
    learned       SpecDec++: each acceptance head in `heads` x each threshold h in `thresholds`
    auto          `auto` in `ks` / `thresholds`: the K / h of best predicted throughput on this
                  machine (adaptive_spec.decoding.auto: the head's threshold_curve.json, `curve` for ks, and
                  t_draft / t_target measured at load), as methods fixed_auto / learned_auto; rows
                  add auto_value (the pick) and auto_predicted_tokens_per_s (decoding only)
    confidence    stop when q(y_i) < tau, for each tau in `confidence_taus`
    entropy       stop when H(q_i) > tau nats, for each tau in `entropy_taus`
    heuristic     transformers' +2/-1 schedule (when `heuristic`)
    oracle        the greedy hindsight oracle of Theorem 4.1 (when `oracle`; temperature 0 only)
    hf_assisted   the peer: transformers' own `target.generate(..., assistant_model=draft)` with its
                  default schedule (when `hf_assisted`); counts from forward hooks, N_discarded
                  derived as N_draft + N_target - N
    hf_prompt_lookup  the n-gram peer: transformers' `target.generate(..., prompt_lookup_num_tokens=10)`
                  (its documented setting; max_matching_ngram_size at its default), no draft model
    trees         tree and multi-draft baselines, one configuration per entry of `trees`, each the
                  settings `generate` takes for its policy (params.py: TreeParams, ErsdParams, SpecTrParams,
                  BatchSDParams; the same names and defaults), e.g.
                    {policy: tree | ersd, drafting: tree | sequence | batch | specinfer, tree_budget: N,
                     tree_estimator: positional | head, head: LABEL-or-DIR (a label of `heads` or a head
                     folder), tree_learned: true (then tree_budget caps it), tree_node_cost: C (unset:
                     measured), adapt_rates: true | false}
                    {policy: spectr | batch-sd, num_drafts: N, k: K}
                  e.g. trees: [{tree_budget: 4}, {tree_estimator: head, head: d3-wrej6, tree_budget: 8},
                               {policy: ersd, tree_budget: 8}, {policy: spectr, num_drafts: 2, k: 3}].
                  The sweep's old names (budget, max_budget, node_cost, estimator, adapt) are refused, each
                  naming its new one; written with adapt_rates: false (their default) they keep their keys.
                  Their rows add tokens_per_target_forward, drafted_per_round, tree_depth (mean
                  depth of a round's drafted tree) and predicted_accepted (sum of R per round).
                  tree/ersd shapes use per-sibling acceptance rates measured ONCE per sweep on
                  calibration prompts (tree_calibration_prompts per dataset, from the end of each
                  shuffled set, never evaluated ones): the start of every run, from which the rates adapt
                  to that run's rounds (reset per run, so no run depends on another), or with
                  `adapt_rates: false` frozen for every run; a learned budget's unset tree_node_cost is
                  measured once (costs.measure_costs, pinned in costs.json as below)

Output in out_dir (default runs/sweep/<config name>, relative to the project root):
    results.jsonl   one line per (dataset, prompt, config): all Metrics fields plus the config's
                    parameters; appended and fsynced, so a rerun of the same command skips what is
                    done (resume after a kill or Ctrl-C); with `record_trace: true` each row adds `trace`,
                    its verified rounds [[K, n accepted, source], ...], and config.json `trace_pair`, the
                    models that made them (decoding/replay.py replays them, eval/gpu_check.py on a GPU)
    settings.json   the settings the results depend on (models, dtype, device, threads, sampling,
                    lengths, seed); a rerun with other settings is refused (use another out_dir,
                    or overwrite=true to discard the old results)
    config.json     the full config, the grid and notes (e.g. "oracle skipped at temperature 1")
    heads.json      per head: path, depth, w_rej, train/dev metrics (for the report's Table 3)
    prompts.json    the prompts used, per dataset
    tree_calibration.json   the tree policies' acceptance rates and how they were measured (reused on
                    a rerun while its settings hold; refused, once tree rows used it, if they change)
    costs.json      t_draft, t_target, t_cand as measured once for every auto pick (K, h, a tree's
                    node cost); a rerun on the same machine and models reuses them, so a resumed
                    sweep picks what it picked before (measured afresh, with a warning, elsewhere)
Then `adaptive-spec report --sweep-dir DIR` writes the tables and Pareto plots.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm
from transformers.utils import logging as hf_logging

from ..backends.runner import resolve_device
from ..config import config_from_argv
from ..decoding.auto import measure_costs
from ..decoding.decoder import Decoder
from ..decoding.pipeline import SpecPair, torch_threads
from ..decoding.sampling import SamplingParams
from ..errors import UserError, run_main
from ..params import ARParams, OracleParams
from ..prompts import load_prompts
from ..runs import append_jsonl, lock_dir, read_jsonl
from .sweep_config import SweepConfig
from .sweep_files import (COSTS, RESULTS, TREE_CALIBRATION, check_calibration, check_out_dir, cpu_pad_to,
                          prompt_sha, settings_hash, settings_of, write_run_files)
from .sweep_grid import Baseline, Configuration, Source, build_grid
from .sweep_heads import draft_hidden_size, load_heads, load_tree_heads
from .sweep_run import Sweep, auto_node_cost, check_auto_curves, hf_schedule_note, reads_costs, run_one, verification
from .tree_calibration import load_or_calibrate, measure_rates

# ----------------------------------------------------------------------------- the sweep

def _select_prompts(pair, texts: list[str], cfg: SweepConfig, n: int | None = None,
                    order=None) -> tuple[list[tuple[int, str, list[int]]], int]:
    """The first n (default n_prompts) of the shuffled texts that fit, taken in `order` (indices;
    default: the shuffled order): (index in the shuffled set, text, ids), and how many were skipped."""
    ctx = [m.max_length for m in (pair.target, pair.draft) if m is not None and m.max_length]
    limit = min([cfg.max_prompt_tokens] + [c - cfg.max_new_tokens for c in ctx])
    chosen, skipped = [], 0
    for i in range(len(texts)) if order is None else order:
        if len(chosen) == (cfg.n_prompts if n is None else n):
            break
        ids = pair.encode(texts[i], cfg.chat)
        if len(ids) > limit:
            skipped += 1
            continue
        chosen.append((i, texts[i], ids))
    return chosen, skipped


def run(cfg: SweepConfig) -> Path:
    """Run (or resume) the sweep; returns the out_dir."""
    # everything that can be checked without the models, first
    cfg.pair.engine.check_available(cfg.pair.device, "pair.device")
    texts = {ds: load_prompts(ds, cfg.fields.get(ds), None, cfg.seed, cfg.hf_configs.get(ds), cfg.hf_splits.get(ds))
             for ds in cfg.datasets}
    sweep, heads = _prepare(cfg)
    sweep.out.mkdir(parents=True, exist_ok=True)
    lock = lock_dir(sweep.out, "sweep")  # noqa: F841 (held until this process exits)
    check_out_dir(sweep.out, sweep.settings, cfg.overwrite)

    sweep.pairs = _load_pairs(cfg, sweep.heads)
    pair = sweep.first_pair()
    for p, _ in sweep.pairs.values():
        p.decoder.record_trace = cfg.record_trace  # Metrics.trace, which the rows keep (Metrics.to_dict)
    if any(c.policy is Baseline.HF_ASSISTED for c in sweep.grid):
        sweep.notes += _note([hf_schedule_note(pair.draft.model)])
    selected = {ds: _select_dataset(pair, ds, texts[ds], cfg, sweep.notes) for ds in cfg.datasets}
    costs = [_pinned_costs(sweep, p, d, i == 0) for i, (d, (p, _)) in enumerate(sweep.pairs.items())][0]
    sweep.tree_ctx = _tree_context(sweep, texts, selected, costs)
    runtime = {d: p.runtime_info() for d, (p, _) in sweep.pairs.items()}
    write_run_files(sweep, heads, selected, runtime)
    context = _row_context(sweep, runtime)
    todo, n_jobs = _todo(sweep, selected)
    if todo and cfg.warmup:
        _warmup(sweep, todo[0].ids)
    _run_jobs(sweep, todo, n_jobs, context)
    return sweep.out


def _prepare(cfg: SweepConfig) -> tuple[Sweep, dict]:
    """The sweep before any model loads: its heads (loaded on the CPU and checked), grid, notes and settings;
    and the heads of `heads` alone (heads.json's)."""
    hidden = draft_hidden_size(cfg.pair.draft)
    heads = load_heads(cfg, hidden)
    grid, notes = build_grid(cfg, list(heads))
    check_auto_curves(cfg, heads, grid)
    all_heads = load_tree_heads(cfg, heads, [c.head for c in grid if c.source is Source.TREES and c.head], hidden)
    sweep = Sweep(cfg, grid, _note(notes), all_heads)
    sweep.settings = settings_of(cfg, _device_name(cfg.pair.device))
    sweep.out = cfg.resolved_out_dir()
    return sweep, heads


def _row_context(sweep: Sweep, runtime: dict) -> dict:
    """drafts entry -> what every row of its pair carries: the machine and the numeric paths it ran on ("auto"
    resolves per CPU)."""
    pad_to = cpu_pad_to(sweep.first_pair())
    return {d: {"settings_hash": settings_hash(sweep.settings), "cpu_pad_to": pad_to, "isa": r["machine"]["isa"],
                "cpu_flags": r["machine"]["cpu_flags"], "paths": {m: r.get(f"{m}_path") for m in ("target", "draft")}}
            for d, r in runtime.items()}


def _note(notes: list[str]) -> list[str]:
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return notes


def _device_name(device: str | None) -> str:
    return str(resolve_device(device))


def _load_pairs(cfg: SweepConfig, heads: dict) -> dict:
    """drafts entry ("" without a drafts axis) -> (its pair, a decoder running its draft alone: the
    draft_ar baseline), every head checked against the draft and moved to its device. The pairs share the
    first one's target, so the target alone and every draft configuration run on the same weights and
    kernels; another entry's own target load is dropped at once."""
    hf_logging.disable_progress_bar()
    pairs, first = {}, None
    for d, params in cfg.draft_pairs().items():
        pair = SpecPair.load(params)
        if first is None:
            first = pair
        else:
            pair = SpecPair(first.target, pair.draft, first.tokenizer, first.eos_token_ids, pair.engine, params,
                            pair.draft_config)
        for label, (head, info) in heads.items():
            if head.hidden_size != pair.draft.hidden_size:
                raise UserError(f"head {label} at {info['path']} was trained for a draft of hidden size "
                                f"{head.hidden_size} but the draft in use has hidden size {pair.draft.hidden_size}; "
                                "pass the draft it was trained for or train a head for this draft")
            head.to(pair.draft.device)
        pairs[d] = pair, (Decoder(pair.draft, None, eos_token_ids=pair.eos_token_ids) if pair.draft else None)
    return pairs


def _select_dataset(pair, ds: str, texts: list[str], cfg: SweepConfig, notes: list[str]) -> list:
    """The prompts of one dataset that fit (see _select_prompts); what was skipped goes to `notes`."""
    chosen, skipped = _select_prompts(pair, texts, cfg)
    if not chosen:
        raise UserError(f"no prompt of dataset {ds!r} fits in {cfg.max_prompt_tokens} tokens (and the context "
                        "with max_new_tokens); raise max_prompt_tokens or lower max_new_tokens")
    if skipped:
        notes += _note([f"{ds}: {skipped} prompt(s) longer than the token limit were skipped"])
    if len(chosen) < cfg.n_prompts:
        notes += _note([f"{ds}: only {len(chosen)} prompts (n_prompts = {cfg.n_prompts})"])
    return chosen


def _pinned_costs(sweep: Sweep, pair, draft: str = "", first: bool = True):
    """The one measurement of t_draft, t_target and t_cand that every auto pick of the sweep reads
    (ks / thresholds auto, a learned tree budget's node_cost auto), pinned in out_dir/costs.json:
    a resumed sweep reuses it, so its auto rows mean the same before and after an interruption; a
    `drafts` entry other than the first pins its own (costs@ENTRY.json). None where no configuration needs it."""
    if not any(reads_costs(c) for c in sweep.grid):
        return None

    name = COSTS if first else f"costs@{draft.replace(':', '-')}.json"
    # on the threads the decode has (the engine's decode_torch_threads), as generate's auto measures: one
    # measurement, one cache key, per machine
    with torch_threads(pair.engine.decode_torch_threads):
        costs = measure_costs(pair, pin=sweep.out / name)
    table = getattr(costs, "t_verify", ())
    v = f", v(1..{len(table)}) = {' '.join(f'{t / table[0]:.2f}' for t in table)} target steps" if table else ""
    sweep.notes += _note([f"auto picks{f' with draft {draft}' if draft else ''} read the forward times pinned in "
                          f"{name}: t_draft/t_target = {costs.c:.4g}{v} (measured {costs.measured})"])
    return costs


def _tree_context(sweep: Sweep, texts: dict, selected: dict, costs=None) -> dict:
    """What every tree run shares: {"rates": {gsd|ersd: c_i}, "calibration": its hash, "node_cost"}.
    The rates are measured once (tree_calibration.measure_rates) on prompts no configuration is
    evaluated on: per dataset, tree_calibration_prompts from the END of the shuffled set, so they
    stay the same when n_prompts grows. A learned budget's node_cost auto comes from `costs` (the
    sweep's pinned forward times, _pinned_costs)."""
    cfg, pair = sweep.cfg, sweep.first_pair()
    methods = sorted({verification(c) for c in sweep.grid if verification(c) is not None})
    ctx = {"rates": {}, "calibration": None, "node_cost": None}
    if methods:
        prompts = []
        for ds in cfg.datasets:
            used = {i for i, _, _ in selected[ds]}
            order = [i for i in reversed(range(len(texts[ds]))) if i not in used]
            prompts += _select_prompts(pair, texts[ds], cfg, cfg.tree_calibration_prompts, order)[0]
        if not prompts:
            raise UserError("no prompt is left to calibrate the tree policies on: every prompt that fits is "
                            "evaluated; lower n_prompts or add a dataset with more prompts")
        cal_settings = {"sweep": settings_hash(sweep.settings), "width": cfg.tree_calibration_width,
                        "prompts": [prompt_sha(t) for _, t, _ in prompts], "vocab_size": pair.target.vocab_size}
        check_calibration(sweep.out, cal_settings)
        sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
        cal = load_or_calibrate(sweep.out / TREE_CALIBRATION, cal_settings, methods, lambda m: measure_rates(
            pair, [ids for _, _, ids in prompts], sampling, cfg.max_new_tokens, m, cfg.tree_calibration_width,
            progress=cfg.progress))
        ctx.update(rates={m: cal[m]["cond_rates"] for m in methods}, calibration=settings_hash(cal_settings))
        sweep.notes += _note([f"tree acceptance rates c_i ({m}, {len(prompts)} calibration prompts): "
                              f"{[round(c, 3) for c in cal[m]['cond_rates'][:6]]}" for m in methods])
    if any(auto_node_cost(c) for c in sweep.grid):
        ctx["node_cost"] = costs.node_cost
        sweep.notes += _note([f"tree node_cost auto = (t_draft + t_cand) / t_target = {costs.node_cost:.4g} "
                              f"(t_draft/t_target = {costs.c:.4g}; {costs.measured})"])
    return ctx


class Job(NamedTuple):
    dataset: str
    prompt_idx: int  # in the shuffled set
    text: str
    ids: list[int]
    conf: Configuration


def _todo(sweep: Sweep, selected: dict) -> tuple[list[Job], int]:
    """The runs not yet in results.jsonl, and the number of runs in all. Prompt-major and round-robin over
    datasets: a sweep stopped early (or still running) has every config on the same prompts and every dataset
    about equally far along, so its partial results already compare side by side."""
    done = {(r.get("dataset"), r.get("prompt_idx"), r.get("prompt_sha"), r.get("config"))
            for r in read_jsonl(sweep.out / RESULTS, repair=True)}
    jobs = [Job(ds, *selected[ds][rank], c) for rank in range(max(len(v) for v in selected.values()))
            for ds in sweep.cfg.datasets if rank < len(selected[ds]) for c in sweep.grid]
    return [j for j in jobs if (j.dataset, j.prompt_idx, prompt_sha(j.text), j.conf.key) not in done], len(jobs)


def _run_jobs(sweep: Sweep, todo: list[Job], n_jobs: int, context: dict):
    """Run each job on its draft configuration's pair and append its row to results.jsonl as soon as it is
    done; `context`: drafts entry -> the fields every row of its pair carries (_row_context)."""
    cfg, first = sweep.cfg, next(iter(sweep.pairs))
    bar = tqdm(total=n_jobs, initial=n_jobs - len(todo), desc="sweep", unit="run", dynamic_ncols=True,
               disable=not cfg.progress, file=sys.stderr)
    keep_x = any(isinstance(j.conf.policy, OracleParams) for j in todo)  # build_grid adds the oracle only when greedy
    try:
        for ds, i, text, ids, conf in todo:
            seed = cfg.seed * 100_003 + i
            m, stopped, new, extra = run_one(sweep, conf, ids, seed)
            if isinstance(conf.policy, ARParams):
                if keep_x:  # the oracle's X (Theorem 4.1), for its run on this prompt
                    sweep.greedy[tuple(ids)] = new
                # the target's own response, for scoring other drafts on it (eval/bench_draft_vocab.py)
                extra = {**extra, "prompt_ids": list(ids), "token_ids": list(new)}
            peer = conf.policy in (Baseline.HF_ASSISTED, Baseline.HF_PROMPT_LOOKUP)
            append_jsonl(sweep.out / RESULTS, {
                "dataset": ds, "prompt_idx": i, "prompt_sha": prompt_sha(text), "n_prompt_tokens": len(ids),
                **conf.row_fields(), "seed": seed, "stopped_by": stopped, "output_sha": prompt_sha(json.dumps(new)),
                **m.to_dict(), **extra, "counts_derived": peer, **context[first if conf.draft is None else conf.draft],
                "time": time.time()})
            bar.update(1)
            bar.set_postfix_str(f"{Path(ds).stem} #{i} {conf.key} {m.tokens_per_s:.1f} tok/s", refresh=False)
    finally:
        bar.close()


def _warmup(sweep: Sweep, ids):
    """Untimed short generations, one per kind (a row's method) and draft configuration: the first forwards pay
    for allocation and kernel selection."""
    n, seen = min(8, sweep.cfg.max_new_tokens), set()
    for conf in sweep.grid:
        kind = (conf.row["method"], conf.draft)
        if kind in seen or isinstance(conf.policy, OracleParams):
            continue
        seen.add(kind)
        run_one(sweep, conf, ids, 0, max_new_tokens=n)


INTERRUPTED = "finished runs are kept in results.jsonl; rerun the same command to resume"


def _main(argv) -> int:
    cfg = config_from_argv(SweepConfig, argv, "adaptive-spec sweep", __doc__.split("\n\n")[0], "sweep")
    out = run(cfg)
    print(f"sweep results in {out / RESULTS}; tables and plots: adaptive-spec report --sweep-dir {out}")
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
