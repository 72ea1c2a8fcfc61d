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
from typing import NamedTuple

from ..config import config_from_argv, config_to_dict
from ..errors import UserError, run_main
from ..prompts import load_prompts
from .sweep_config import SweepConfig
from .sweep_files import RESULTS, config_record, open_out_dir, row_context, settings_hash, start_run
from .sweep_grid import Baseline, Configuration, Source, build_grid
from .sweep_heads import load_heads
from .sweep_run import Runner, hf_schedule_note, verification

# ----------------------------------------------------------------------------- the sweep


def run(cfg: SweepConfig) -> Path:
    """Run (or resume) the sweep; returns the out_dir."""
    # everything that can be checked without the models, first
    cfg.pair.engine.check_available(cfg.pair.device, "pair.device")
    draft_pairs = cfg.draft_pairs()
    texts = {ds: load_prompts(ds, cfg.fields.get(ds), None, cfg.seed, cfg.hf_configs.get(ds), cfg.hf_splits.get(ds))
             for ds in cfg.datasets}
    notes = []
    note = _noter(notes)
    grid, heads, listed = plan(cfg, note)
    config = config_to_dict(cfg)  # config.json's, as given
    out, settings, lock = open_out_dir(cfg)  # noqa: F841 (the lock is held until this process exits)

    runner = Runner(cfg, draft_pairs, heads, note)
    pair = runner.first_pair()
    if any(c.policy is Baseline.HF_ASSISTED for c in grid):
        note(hf_schedule_note(pair.draft.model))
    picker = PromptPicker(cfg.max_prompt_tokens, cfg.max_new_tokens, cfg.chat, cfg.n_prompts)
    selected = {ds: picker.dataset(pair, ds, texts[ds], note) for ds in cfg.datasets}
    calibrating = any(verification(c) is not None for c in grid)
    cal_prompts = picker.calibration(pair, texts, selected, cfg.tree_calibration_prompts) if calibrating else []
    costs = runner.pin_costs(grid, out)
    runner.calibrate(grid, cal_prompts, out, settings_hash(settings), costs)
    runtime = {d: p.runtime_info() for d, (p, _) in runner.pairs.items()}
    context = row_context(settings, pair, runtime)
    record = config_record(config, cfg, grid, notes, runtime, pair)
    todo, n_jobs = start_run(out, settings, listed, selected, record, grid)
    runner.run_all(grid, todo, n_jobs, out, context)
    return out


def plan(cfg: SweepConfig, note) -> tuple[list[Configuration], dict, dict]:
    """The sweep before any model loads: its grid (what was left out goes to `note`), every head it runs
    (loaded on the CPU and checked), and the heads of `heads` alone (heads.json's)."""
    grid, listed, notes = build_grid(cfg)
    named = {c.head: c.policy.head for c in grid if c.source is Source.TREES and c.head}
    heads, listed = load_heads(cfg.pair.draft, listed, named)
    note(*notes)
    return grid, heads, listed


def _noter(notes: list[str]):
    """note(*lines): each printed as it comes, and kept in `notes` (config.json's)."""
    def note(*lines: str) -> None:
        for line in lines:
            print(f"note: {line}", file=sys.stderr)
        notes.extend(lines)
    return note


class PromptPicker(NamedTuple):
    """Which prompts of a dataset a sweep takes: those that fit in max_prompt_tokens and, with max_new_tokens,
    in both models' context, as the pair encodes them."""

    max_prompt_tokens: int
    max_new_tokens: int
    chat: bool
    n_prompts: int

    def pick(self, pair, texts: list[str], n: int, order=None) -> tuple[list[tuple[int, str, list[int]]], int]:
        """The first n of the shuffled texts that fit, taken in `order` (indices; default: the shuffled
        order): (index in the shuffled set, text, ids), and how many were skipped."""
        ctx = [m.max_length for m in (pair.target, pair.draft) if m is not None and m.max_length]
        limit = min([self.max_prompt_tokens] + [c - self.max_new_tokens for c in ctx])
        chosen, skipped = [], 0
        for i in range(len(texts)) if order is None else order:
            if len(chosen) == n:
                break
            ids = pair.encode(texts[i], self.chat)
            if len(ids) > limit:
                skipped += 1
                continue
            chosen.append((i, texts[i], ids))
        return chosen, skipped

    def dataset(self, pair, ds: str, texts: list[str], note) -> list:
        """The n_prompts prompts of one dataset that fit; what was skipped goes to `note`."""
        chosen, skipped = self.pick(pair, texts, self.n_prompts)
        if not chosen:
            raise UserError(f"no prompt of dataset {ds!r} fits in {self.max_prompt_tokens} tokens (and the context "
                            "with max_new_tokens); raise max_prompt_tokens or lower max_new_tokens")
        if skipped:
            note(f"{ds}: {skipped} prompt(s) longer than the token limit were skipped")
        if len(chosen) < self.n_prompts:
            note(f"{ds}: only {len(chosen)} prompts (n_prompts = {self.n_prompts})")
        return chosen

    def calibration(self, pair, texts: dict, selected: dict, n: int) -> list:
        """The tree policies' calibration prompts, none evaluated: per dataset, n from the END of the shuffled
        set, so they stay the same when n_prompts grows."""
        prompts = []
        for ds, chosen in selected.items():
            used = {i for i, _, _ in chosen}
            order = [i for i in reversed(range(len(texts[ds]))) if i not in used]
            prompts += self.pick(pair, texts[ds], n, order)[0]
        return prompts


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
