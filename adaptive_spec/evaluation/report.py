"""Tables and Pareto plots from a sweep (SpecDec++ Figure 3, Tables 1-3), and the peer comparison.

    adaptive-spec report --sweep-dir runs/sweep/paper [--out report.md] [--aggregate pooled|mean]

Writes <sweep-dir>/report.md with its plots beside it (docs/evaluation.md lists what it holds). Speed-ups
are paired per prompt, over the prompts every configuration finished, so an interrupted sweep compares
like with like."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ..decoding.auto import coef_of, comparison_table, costs_from_json, round_costs, sum_counts
from ..errors import UserError, run_main
from ..runs import read_json
from ..tables import fmt
from .report_data import DatasetResult, analyse, fastest, head_order, load_sweep, usable
from .report_plots import accepted_vs_drafted_plot, pareto_plot
from .report_tables import (AUTO_OF, all_configs_table, auto_table, breakdown_table, cpu_lines, decomposition,
                            engines_section, ersd_fig3_table, family_table, peer_table, table1, table2, table3,
                            tree_comparisons)
from .sweep_files import COSTS
from .tree_calibration import TREE_POLICIES


def tree_sections(results: list[DatasetResult], calibration: dict, folder: Path, how: str) -> list[str]:
    """The family table, the accepted-vs-drafted plots and the ERSD Fig. 3 comparison; `calibration`:
    the sweep's tree_calibration.json ({} when missing)."""
    md = ["", "### Best configuration per family", "",
          "Every family's fastest configuration (tokens/s end to end; speed-up paired per prompt, geometric mean).",
          "", family_table(results), "", tree_comparisons(results), "",
          "## Accepted tokens per target pass vs drafted tokens per round", "",
          "Every family; hollow markers: what a tree policy predicted (its sum of R per round); dotted: the "
          "Tunstall bound (ERSD Lemma 4.2) of the calibrated GSD rates, at x = the budget.", "",
          *_plots(results, folder, "accepted_vs_drafted", accepted_vs_drafted_plot, calibration, how)]
    rates = "; ".join(f"{m}: c = {[round(c, 3) for c in calibration[m]['cond_rates'][:6]]}" for m in ("gsd", "ersd")
                      if m in calibration)
    md += ["", "## ERSD Fig. 3: predicted vs measured accepted tokens per pass", "",
           "Per-sibling acceptance rates measured once on " + (f"{len(calibration['settings']['prompts'])} calibration "
           f"prompts ({rates})" if calibration.get("settings") else "no calibration (tree_calibration.json missing)") +
           "; 0-th order = sum of R of the configuration's shape under those rates; Tunstall bound on accepted "
           "tokens per pass for its budget.", ""]
    for d in results:
        md += [f"### {d.label}", "", ersd_fig3_table(d, calibration), ""]
    return md


def build_report(sweep_dir: Path, out: Path | None = None, how: str = "pooled", beside: list[Path] = ()) -> Path:
    """The report of one sweep; `beside`: sweeps of the same prompts on other engines, tabled with it."""
    sweep_dir = Path(sweep_dir)
    if how not in ("pooled", "mean"):
        raise UserError(f"--aggregate must be pooled or mean, got {how!r}")
    rows, heads_info, cfg_info = load_sweep(sweep_dir)
    out = Path(out) if out else sweep_dir / "report.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    results = analyse(rows, how)
    md = _intro(sweep_dir.name, cfg_info, how, results, cpu_lines(rows))
    sweeps = [_engine_sweep(sweep_dir, cfg_info, results)]
    for other in beside:
        o_rows, _, o_cfg = load_sweep(Path(other))
        sweeps.append(_engine_sweep(Path(other), o_cfg, analyse(o_rows, how)))
    md[2:2] = in_short(sweeps)  # in words, under the title
    if beside:
        md += engines_section([s[:2] for s in sweeps])
    md += ["", "## Figure 3: verification rate vs discard rate", "",
           *_plots(results, out.parent, "pareto", pareto_plot, head_order(heads_info, results), how)]
    trees = []
    if any(r["method"] in TREE_POLICIES for r in rows):
        calibration = read_json(sweep_dir / "tree_calibration.json", required=False, hint="rerun the sweep") or {}
        trees = tree_sections(results, calibration, out.parent, how)
    md += _tables(results, heads_info, trees)
    out.write_text("\n".join(md) + "\n")
    return out


def _engine_sweep(sweep_dir: Path, cfg_info: dict, results: list[DatasetResult]) -> tuple:
    """(its engine, its analysis, the forward times it pinned for its auto picks or None, the engine's time model)."""
    from ..backends.engines import get

    engine = (cfg_info.get("config") or {}).get("pair", {}).get("backend", "torch")
    saved = read_json(sweep_dir / COSTS, required=False, hint="rerun the sweep to rewrite it")
    return engine, results, costs_from_json(saved) if saved else None, get(engine).time_model


def _intro(name: str, cfg_info: dict, how: str, results: list[DatasetResult], cpu: list[str]) -> list[str]:
    """Title, CPU, the sweep's settings, the aggregation, notes, and what each dataset holds."""
    cfg = cfg_info.get("config", {})
    pair = cfg.get("pair", {})
    md = [f"# SpecDec++ sweep report: {name}", "", *cpu]
    if cfg:
        md.append(f"Target `{pair.get('target')}`, draft `{pair.get('draft')}`, {pair.get('dtype')}, device "
                  f"{cfg_info.get('device', '?')} ({cfg_info.get('threads', '?')} threads); temperature "
                  f"{cfg.get('temperature')}, top-k {cfg.get('top_k')}, top-p {cfg.get('top_p')}, "
                  f"{cfg.get('max_new_tokens')} new tokens, chat template {'on' if cfg.get('chat') else 'off'}, "
                  f"seed {cfg.get('seed')}.")
    md.append("Aggregation over prompts: " + ("**ratio of sums** (sum over prompts of the numerator / of the "
              "denominator; every token weighs the same)" if how == "pooled" else "**mean of per-prompt values**")
              + ". Speed-ups are paired per prompt (geometric mean). tokens/s are end to end (wall time); "
              "the forward-time fits use decode time (wall − prefill).")
    md += [f"\n> note: {note}" for note in cfg_info.get("notes", [])] + [""]
    return md + [f"- {d.label}: {d.n_prompts} prompts, {len(d.aggs)} configurations"
                 + (f"; {d.dropped_prompts} incomplete prompt(s) left out" if d.dropped_prompts else "") for d in results]


def _plots(results: list[DatasetResult], folder: Path, name: str, plot, *args) -> list[str]:
    """One plot per dataset, `plot(d, png, *args)` writing folder/NAME_LABEL.png beside the report; their links."""
    for d in results:
        plot(d, folder / f"{name}_{d.label}.png", *args)
    return [f"![{d.label}]({name}_{d.label}.png)" for d in results]


def _tables(results: list[DatasetResult], heads_info: dict, trees: list[str]) -> list[str]:
    """Tables 1-3 (the tree sections after Table 1), Eq. 3.2, auto, the peer and every configuration."""
    t2, terr = table2(results)
    md = ["", "## Table 1: throughput (tokens/s)", "", table1(results)] + trees + ["",
          "## Table 2: forward times (Eq. 3.1 least squares, no intercept)", "",
          "Stand-alone: target alone T = t_target·N_target (ar) and draft alone T = t_draft·N_draft (draft_ar); "
          "R² and runs given as draft & target. Speculative: T = t_draft·N_draft + t_target·N_target.", "", t2, "",
          "### Eq. 5.1 throughput vs measured decode throughput (per run)", "", terr, "",
          "### Time models: Eq. 3.1 against the extended model (t_cand per candidate)", "",
          "Decode time T = wall − prefill. Both models fitted on all rows (stand-alone rows identify t_draft "
          "apart from t_cand) and scored on the speculative rows; `python eval/fit_time_model.py SWEEP_DIR "
          "--costs FILE` adds the costs measured at load.", "",
          comparison_table([r for d in results for r in d.rows]), "",
          "## Eq. 3.2: where the time goes (ms per token)", "",
          "T/N = t_draft (oracle) + t_draft·N_discarded/N + (t_target − t_draft)·N_target/N, with the "
          "speculative fit's times.", "", decomposition(results), "",
          "## Table 3: acceptance heads", "",
          "Best tokens/s over h per dataset (bold: within 99% of the best head on that dataset); KL = binary KL "
          "between true and predicted acceptance probability, from the head's training metrics.", "",
          table3(results, heads_info), "",
          "## auto: the h and K picked for this machine", "",
          "Picked once per machine from the curve `adaptive-spec autotune` saved and the t_draft, t_target, t_cand "
          "measured once per sweep (pinned in costs.json; picked lists every value where rows were picked from "
          "different measurements); predicted tokens/s is decoding only (no prefill), measured tokens/s is wall-clock. "
          "Goal: within 3% of the best swept value, never below the best fixed K.", "",
          auto_table(results), "",
          "## Peer: transformers assisted generation", "",
          "Wall-clock tokens/s of `target.generate(..., assistant_model=draft)` with transformers' default "
          "candidate schedule, run back to back with ours on the same prompts; ratios pooled (paired per-prompt "
          "geometric mean in parentheses).", "", peer_table(results), "",
          "## All configurations", ""]
    for d in results:
        md += [f"### {d.label}", "", all_configs_table(d), ""]
    tables = [(d.label, breakdown_table(d)) for d in results]
    if any(t for _, t in tables):
        md += ["## Where the time goes", "",
               "Per generated token: prefill (both models), the draft's and the target's decode forwards, drafting "
               "outside the draft forward (sampling q, the stop rule, an n-gram lookup), verification outside the "
               "target pass (processing p, rejection sampling, the round's one host read), cache rollback, and the "
               "rest (the round loop, Python); the last column is the time outside both models' forwards as a share "
               "of decode time.", ""]
        for label, t in tables:
            if t:
                md += [f"### {label}", "", t, ""]
    return md


# where no cost is known, a round's tokens and drafts only (its steps are then left unsaid)
ONE_STEP_COEF = {"t_target": 1.0}
# no configuration a user runs: the draft alone, and the hindsight oracle (it knows the output beforehand)
NOT_A_CHOICE = ("draft_ar", "oracle")


def in_short(sweeps: list[tuple[str, list[DatasetResult], object, str]]) -> list[str]:
    """The report's first lines: per dataset, the fastest configuration, by how much against the target alone (the
    first sweep's engine), and why (_why). `sweeps`: (engine, its analysis, its Costs or None, its time model)."""
    labels = list(dict.fromkeys(d.label for _, results, _, _ in sweeps for d in results))
    lines = []
    for label in labels:
        found = [(engine, d, costs, model) for engine, results, costs, model in sweeps
                 for d in results if d.label == label]
        cands = [(engine, d, a) for engine, d, _, _ in found for a in _choices(d)]
        if cands:
            lines.append(_verdict(label, found, cands))
    return ["**In short** (tokens/s end to end; ratios pooled over prompts):", ""] + \
        [f"- {line}" for line in lines] + [""] if lines else []


def _choices(d: DatasetResult) -> list:
    """What a user runs: the target alone and every configuration that drafted (an auto pick of the target alone
    is the target alone again, its edge over it noise)."""
    return [a for a in d.aggs.values() if not math.isnan(a.tokens_per_s) and a.method not in NOT_A_CHOICE
            and (a.method == "ar" or a.speculated)]


def _verdict(label: str, found: list, cands: list) -> str:
    """One dataset's line of in_short."""
    base_engine, base_d = found[0][0], found[0][1]
    base = base_d.get("ar")
    several = len(found) > 1
    on = lambda e: f" on {e}" if several else ""  # noqa: E731
    x = lambda a: f"{a.tokens_per_s / base.tokens_per_s:.2f}x" if base else "—"  # noqa: E731
    spec = [c for c in cands if c[2].speculated]
    engine, d, top = max(cands, key=lambda c: c[2].tokens_per_s)
    text = f"**{label} ({d.n_prompts} prompts)**: "
    chose_ar = [f"{a.name()}{on(e)}" for e, dd, _, _ in found for a in dd.aggs.values()
                if a.method in AUTO_OF and a.chose_target_alone]
    if chose_ar:
        text += f"`auto` chose the target alone ({', '.join(chose_ar)}), drafting nothing; "
    if top.method == "ar":
        text += f"the fastest here was the target alone{on(engine)}, {fmt(top.tokens_per_s)} tok/s"
        if spec:
            e2, _, a2 = max(spec, key=lambda c: c[2].tokens_per_s)
            text += f"; the fastest configuration that speculated, {a2.name()}{on(e2)}, ran at {x(a2)} of " + \
                ("it" if engine == base_engine else f"the target alone on {base_engine}")
    else:
        text += (f"the fastest here was {top.name()}{on(engine)}, {fmt(top.tokens_per_s)} tok/s, "
                 f"{x(top)} the target alone{on(base_engine)}")
    for e, od, _, _ in found[1:]:  # each other engine's best, against the same baseline
        best = fastest(_choices(od))
        if best is not None and od is not d:
            text += f"; {e}'s fastest, {best.name()}, {x(best)}"
    why = _why(found, spec)
    return text + "." + (f" Why: {why}." if why else "")


def _why(found, spec) -> str | None:
    """The best speculative configuration's round in target steps, at its engine's measured costs (costs.json)
    or the times fitted to its rows."""
    if not spec:
        return None
    engine, d, a = max(spec, key=lambda c: c[2].tokens_per_s)
    _, _, costs, model = next(f for f in found if f[1] is d)
    counts = sum_counts([r for r in d.rows if r["config"] == a.config])  # pooled over its rows
    if not counts["n_target_forwards"] or a.derived:
        return None
    fit = d.fits["speculative"]
    if costs is not None:
        coef, source, c = coef_of(costs, model), "the costs measured for auto, costs.json", costs.c
    elif usable(fit) and fit.t_draft > 0 and fit.t_target > 0:  # a fit over few rows can come out negative
        coef, source = {"t_draft": fit.t_draft, "t_target": fit.t_target}, "the forward times fitted to these rows"
        c = fit.t_draft / fit.t_target
    else:
        r = round_costs(counts, ONE_STEP_COEF)
        return (f"its rounds made {r['tokens']:.2f} tokens a target pass for {r['drafted']:.2f} drafted (no costs "
                "measured here, and none fitted to these rows)")
    r = round_costs(counts, coef)
    parts = [f"a draft step {c:.2f} target steps"] if r["draft_steps"] else []
    if r["rows"] and "verify_s" in coef:
        parts.append(f"a {r['rows']}-row pass {coef['verify_s'](r['rows']) / coef['verify_s'](1):.2f}")
    text = (f"its rounds made {r['tokens']:.2f} tokens for {r['drafted']:.2f} drafted and took {r['steps']:.2f} "
            f"one-row target steps each ({source}" + (f": {', '.join(parts)})" if parts else ")"))
    if math.isnan(a.speedup):
        return text
    return text + f": speculation {'pays' if a.speedup > 1 else 'does not pay'} here ({a.speedup:.2f}x its engine's " \
        "target alone, paired per prompt)"


def _main(argv) -> int:
    parser = argparse.ArgumentParser(prog="adaptive-spec report", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep-dir", required=True, help="a sweep's out_dir (holds results.jsonl)")
    parser.add_argument("--out", default=None, help="markdown file to write (default <sweep-dir>/report.md)")
    parser.add_argument("--aggregate", default="pooled", choices=("pooled", "mean"),
                        help="pooled: ratio of sums over prompts (default); mean: mean of per-prompt values")
    parser.add_argument("--beside", action="append", default=[], metavar="SWEEP_DIR",
                        help="a sweep of the same prompts on another engine, tabled beside this one (repeatable)")
    args = parser.parse_args(argv)
    out = build_report(Path(args.sweep_dir), Path(args.out) if args.out else None, args.aggregate,
                       [Path(b) for b in args.beside])
    print("\n".join(line for line in out.read_text().split("\n\n## ")[0].splitlines() if line.startswith("- **")))
    print(f"report written to {out}")
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, "no report was written; run the same command again")


if __name__ == "__main__":
    sys.exit(main())
