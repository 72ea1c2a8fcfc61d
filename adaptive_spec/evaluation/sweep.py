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
                  measured once (auto.measure_costs, pinned in costs.json as below)

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

import sys
from pathlib import Path

from ..config import config_from_argv
from ..errors import run_main
from .sweep_calibration import calibrate
from .sweep_config import SweepConfig
from .sweep_files import RESULTS, SweepFolder
from .sweep_plan import plan_sweep
from .sweep_run import Runner, hf_schedule_note, load_pairs

# ----------------------------------------------------------------------------- the sweep


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
