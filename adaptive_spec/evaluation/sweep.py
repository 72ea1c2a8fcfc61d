"""Evaluation sweeps (SpecDec++ section 5, appendix D): every decoding configuration on every prompt.

    adaptive-spec sweep --config configs/sweep/paper.yaml [key=value ...]

For each dataset and each prompt, all configurations run back to back, so machine noise hits them
alike and per-prompt ratios compare like with like (docs/evaluation.md). With a `drafts` list (draft
configurations QUANT[:VOCAB]), every configuration that drafts runs once per entry (key KEY@ENTRY, rows
carry `draft`) against one loaded target. The configurations:

    ar, draft_ar  the target alone, the draft alone (stand-alone t_target, t_draft)
    fixed k=K     for each K in `ks`; learned: each head in `heads` x each h in `thresholds`
    auto          `auto` in `ks` / `thresholds`: the K / h of best predicted throughput on this machine
                  (decoding/auto), as fixed_auto / learned_auto; rows add auto_value and
                  auto_predicted_tokens_per_s
    confidence, entropy   for each tau in `confidence_taus`, `entropy_taus`
    heuristic, oracle     transformers' +2/-1 schedule; the greedy hindsight oracle (temperature 0 only)
    hf_assisted, hf_prompt_lookup   the peers: transformers' assisted generation (counts from forward
                  hooks) and its prompt lookup (prompt_lookup_num_tokens=10), no draft model
    trees         one configuration per entry of `trees`, each the settings `generate` takes for its policy
                  (params.py: TreeParams, ErsdParams, SpecTrParams, BatchSDParams), e.g.
                  [{tree_budget: 4}, {tree_estimator: head, head: d3-wrej6, tree_budget: 8},
                   {policy: ersd, tree_budget: 8}, {policy: spectr, num_drafts: 2, k: 3}];
                  tree/ersd shapes start from per-sibling acceptance rates measured once per sweep on
                  calibration prompts never evaluated (adapting per run unless `adapt_rates: false`)

Output in out_dir (default runs/sweep/<config name>, relative to the project root):
    results.jsonl   one line per (dataset, prompt, config), appended and fsynced: a rerun resumes; with
                    `record_trace: true` each row adds `trace` (decoding/replay.py replays it)
    settings.json   the settings the results depend on: a rerun with others is refused (overwrite=true)
    config.json     the full config, the grid and notes; heads.json: per head, its path and metrics
    prompts.json    the prompts used, per dataset
    tree_calibration.json   the tree policies' acceptance rates (reused on a rerun while its settings hold)
    costs.json      t_draft, t_target, t_cand measured once for every auto pick, so a resumed sweep on the
                    same machine and models picks what it picked before
Then `adaptive-spec report --sweep-dir DIR` writes the tables and Pareto plots."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..backends.paths import FeatureDraft, split_draft_config
from ..backends.runner import resolve_device
from ..config import config_from_argv
from ..decoding.sampling import SamplingParams
from ..errors import run_main
from ..params import PairParams
from ..prompts import load_prompts
from ..typed import build
from .sweep_calibration import Measures, PromptPicker, auto_node_cost, calibrate, reads_costs, verification
from .sweep_config import SweepConfig
from .sweep_files import RESULTS, FolderPlan, SweepFolder
from .sweep_grid import Baseline, Configuration, Source, build_grid, load_heads
from .sweep_run import Runner, RunSettings, hf_schedule_note, load_pairs

# config keys that change the numbers in results.jsonl; a resume must keep them (with the pair's, settings_of)
RESULT_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "chat", "seed", "k_max", "max_prompt_tokens")
# the pair's settings in settings.json, which keeps them flat and spells unset ones as it always has
PAIR_RESULT_KEYS = ("backend", "n_ctx", "draft", "target", "dtype", "draft_quant", "draft_vocab", "threads")
UNSET = {"n_ctx": 0, "draft_vocab": "", "threads": 0}
# torch settings a sweep may set: recorded only when set, so an existing sweep's settings hash holds
PAIR_IF_SET = ("kv_cache", "runtime", "max_cache_len", "target_quant", "draft_context")


def run(cfg: SweepConfig) -> Path:
    """Run (or resume) the sweep; returns the out_dir."""
    plan = plan_sweep(cfg)  # everything that can be checked without the models, first
    notes = []
    note = _noter(notes)
    note(*plan.notes)
    folder = SweepFolder.open(plan.folder)
    pairs = load_pairs(plan.pairs, plan.heads)
    first = next(iter(pairs.values()))  # every pair shares its target
    if plan.hf_assisted:
        note(hf_schedule_note(first.draft.model))
    selected, cal_prompts = plan.prompts.choose(first, note)
    calibrated = calibrate(pairs, plan.measures, cal_prompts, folder, note)
    todo, n_jobs = folder.start(plan.grid, selected, notes, pairs)
    Runner(pairs, plan.run, plan.heads, calibrated).run_all(plan.grid, todo, n_jobs, folder)
    return folder.path


@dataclass(frozen=True)
class SweepPlan:
    grid: list[Configuration]  # run on every prompt, in run order
    pairs: dict[str, PairParams]  # drafts entry ("" without a drafts axis) -> the pair to load
    heads: dict  # label (or a trees entry's folder as written) -> (AcceptanceHead on the CPU, info)
    prompts: PromptPicker
    run: RunSettings
    folder: FolderPlan
    measures: Measures
    notes: tuple[str, ...]  # what the grid left out (config.json's notes)

    @property
    def hf_assisted(self) -> bool:
        return any(c.policy is Baseline.HF_ASSISTED for c in self.grid)


def plan_sweep(cfg: SweepConfig) -> SweepPlan:
    """The sweep's plan, with everything that can be checked without the models checked (the heads load here, on
    the CPU, and are checked against the draft); prompts are read, the out_dir is neither made nor read yet."""
    cfg.pair.engine.check_available(cfg.pair.device, "pair.device")
    settings = settings_of(cfg)
    pairs = draft_pairs(cfg)
    grid, listed, notes = build_grid(cfg)
    named = {c.head: c.policy.head for c in grid if c.source is Source.TREES and c.head}
    heads = load_heads(cfg.pair.draft, listed, named)
    settings["device"] = str(resolve_device(cfg.pair.device))  # the one the pair runs on
    folder = FolderPlan(cfg.out_dir or f"runs/sweep/{cfg.name or 'sweep'}", settings, cfg.overwrite,
                        cfg.model_dump(), {k: heads[k][1] for k in listed}, cfg.pair if cfg.record_trace else None,
                        bool(cfg.drafts))
    sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    need = Measures(any(map(reads_costs, grid)), tuple(sorted(set(map(verification, grid)) - {None})),
                    any(map(auto_node_cost, grid)), cfg.tree_calibration_width, sampling, cfg.max_new_tokens,
                    cfg.progress)
    run = RunSettings(sampling, cfg.max_new_tokens, cfg.k_max, cfg.seed, cfg.auto_prompts, cfg.curve, cfg.warmup,
                      cfg.progress, cfg.record_trace)
    texts = {ds: load_prompts(ds, cfg.fields.get(ds), None, cfg.seed, cfg.hf_configs.get(ds), cfg.hf_splits.get(ds))
             for ds in cfg.datasets}
    picker = PromptPicker(texts, cfg.max_prompt_tokens, cfg.max_new_tokens, cfg.chat, cfg.n_prompts,
                          cfg.tree_calibration_prompts if need.methods else 0)
    return SweepPlan(grid, pairs, heads, picker, run, folder, need, tuple(notes))


def draft_pairs(cfg: SweepConfig) -> dict[str, PairParams]:
    """`drafts` entry -> the pair's settings with that draft configuration, each checked as generate's flags are
    ({"": pair} without a drafts axis): the sweep loads one pair per entry and shares its target."""
    if not cfg.drafts:
        return {"": cfg.pair}
    base = cfg.pair.model_dump(exclude_unset=True)
    out = {}
    for i, d in enumerate(cfg.drafts):
        quant, vocab = split_draft_config(d)
        out[d] = build(PairParams, {**base, "draft_quant": quant, "draft_vocab": vocab}, f"drafts[{i}] ({d})",
                       lambda k: f"pair.{k}")
    return out


def settings_of(cfg: SweepConfig) -> dict:
    """settings.json's settings from the config; the plan adds the device the pair runs on, last."""
    p = cfg.pair
    raw = {k: str(v) if isinstance(v := getattr(p, k), FeatureDraft) else v  # a feature drafter as written
           for k in PAIR_RESULT_KEYS}
    d = {k: UNSET[k] if k in UNSET and v is None else v for k, v in raw.items()}
    d.update(p.model_dump(include=set(PAIR_IF_SET), exclude_defaults=True))
    d.update({k: getattr(cfg, k) for k in RESULT_KEYS})
    if cfg.drafts:  # recorded only when set, so an existing sweep's settings hash holds
        d["drafts"] = list(cfg.drafts)
    if cfg.record_trace:  # likewise; and a resume must not mix rows with and without traces
        d["record_trace"] = True
    if cfg.auto_prompts:  # likewise: auto's picks come from those prompts' curve
        d["auto_prompts"] = cfg.auto_prompts
    return d


def _noter(notes: list[str]):
    """note(*lines): each printed as it comes, and kept in `notes` (config.json's)."""
    def note(*lines: str) -> None:
        for line in lines:
            print(f"note: {line}", file=sys.stderr)
        notes.extend(lines)
    return note


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
