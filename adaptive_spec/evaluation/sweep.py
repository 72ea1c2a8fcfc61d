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
from pathlib import Path

from ..config import config_from_argv
from ..errors import run_main
from .sweep_calibration import calibrate
from .sweep_config import SweepConfig
from .sweep_files import RESULTS, SweepFolder
from .sweep_plan import plan_sweep
from .sweep_run import Runner, hf_schedule_note, load_pairs

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
