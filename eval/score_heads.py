"""Score acceptance predictors: how well does a head, or the draft's own confidence, separate the draft
tokens the target accepts from those it rejects? One subcommand per question:

  probe            How much is there to predict on a datagen split? Every head given, the draft's q(y) and
                   H(q), and cross-validated logistic combinations: KL and AUC (the ceiling of any stop rule).
                     python eval/score_heads.py probe --data runs/datagen/gsm8k --split dev --heads 'checkpoints/*'
  ablate           Which head inputs (hidden state, draft statistics, both; token or context state) over
                   depth D x w_rej? Trains the grid, then dev KL, AUC and ECE, overall and per prompt source.
                     python eval/score_heads.py ablate --data runs/datagen/mix --out runs/heads/ablation
  llama-cpp-drift  Does the statistics head carry over to llama.cpp's GGUF draft? Its metrics on the draft
                   statistics llama.cpp gives, beside those on the stored torch rows it was trained on.
                     python eval/score_heads.py llama-cpp-drift --data data/datagen/mix --sequences 48

Each writes its rows (JSON), a markdown report and run.json into --out: what the report says beside the
rows (evaluation/paired.run_header), naming this script and the subcommand ("script", "report_args"), so
`python eval/score_heads.py <subcommand> --report-only --out DIR` rewrites DIR's report from the folder
alone: no model, no data, no torch. `<subcommand> --help` says more.
"""
from __future__ import annotations

import argparse
import glob
import inspect
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple

from adaptive_spec.errors import UserError, run_main
from adaptive_spec.evaluation.paired import rebuild_report, write_run
from adaptive_spec.runs import atomic_write, write_json
from adaptive_spec.tables import fmt, md_table

# torch, the models, the heads and training are imported inside the measuring paths only: --report-only
# must run on a machine with none of them installed (tests/test_regenerate_reports.py runs it)
if TYPE_CHECKING:
    from adaptive_spec.training.settings import TrainConfig

SCRIPT = "eval/score_heads.py"


class Mode(NamedTuple):
    """A subcommand: what it measures and the run folder it writes (rows, report, run.json). A NamedTuple, not
    a dataclass: the tests load this script from its path, unregistered in sys.modules, which dataclasses need."""
    name: str
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int]  # measures; its docstring is the --help text
    report: Callable[[dict, dict], str]  # (rows, run header) -> the report's text
    rows: str  # the rows file in --out
    report_file: str
    data: str | None  # --data's default (None: required unless --report-only)
    out: str  # --out's default
    options: Callable[[argparse.ArgumentParser], None]  # the subcommand's own options
    indent: int = 1  # of the rows file: each keeps the layout its committed results have
    interrupted: str = "nothing was written; rerun the same command"


def rebuild(mode: Mode, out: Path):
    """--report-only: the report from <out>'s rows and run.json alone."""
    rebuild_report(out, mode.rows, mode.report_file, mode.report)


def finish(mode: Mode, out: Path, doc: dict, measure: Callable[[], dict]) -> str:
    """Writes a measured run (paired.write_run: the rows, run.json, the report read back from the rows, as
    --report-only reads them later) and returns the report."""
    return write_run(out, SCRIPT, mode.name, mode.rows, doc, mode.report_file, mode.report, measure, mode.indent)


# ---------------------------------------------------------------- probe


def probe(args: argparse.Namespace, _: argparse.ArgumentParser) -> int:
    """probe: how well does each predictor of acceptance separate accepted from rejected draft tokens on a
    datagen split? The ceiling on what any stop policy can gain is set here.

    For every draft token Y_i of the split (loss positions, except a response's first, whose
    context state is the prompt's and is not stored) the target is P_i = min(1, p(Y_i)/q(Y_i)).
    Predictors:
      constant        the split's mean P (the no-information baseline)
      q(y), H(q)      the draft's own confidence in Y_i and its entropy at step i (the training-free
                      rules): datagen's stored draft_stats, i.e. q_i itself; for datasets made before
                      datagen stored them, the draft's LM head applied to the stored state e_{i-1}
                      (on mixed-prefix states that is q(.|x, Z_<i), not q_i: a weaker stand-in)
      <head>          each acceptance head on its own input (token: e_i, context: e_{i-1}; with
                      inputs=hidden+stats also the stored draft_stats of Y_i)
      logistic(...)   logistic regressions on combinations, fitted and scored by 2-fold cross
                      validation inside the split (so they are honest about what the split allows)
    On target-prefix states (`datagen-features --prefix target`) every position is scored, a
    context head reading context_features. Scores: KL(P || p_hat) per token (Bernoulli, what training
    minimises), and AUC: the chance that a token with P_i >= 0.99 is ranked above one with P_i < 0.99
    (not P_i = 1 exactly: where p and q nearly coincide, p/q lands a hair below 1 in floating point,
    and such a token is as good as accepted).

        python eval/score_heads.py probe --data runs/datagen/gsm8k --split dev --heads 'checkpoints/*'

    Writes <out>/results.json (one row per predictor), <out>/table.md and <out>/run.json (what the table
    says beside the rows: the split's mean P and share accepted, the sampling)."""
    import torch

    from adaptive_spec.backends.models import load_model
    from adaptive_spec.decoding.sampling import SamplingParams
    from adaptive_spec.evaluation.head_scores import cv_logistic, probe_rows
    from adaptive_spec.heads.head import AcceptanceHead, join_inputs, reads_stats
    from adaptive_spec.runs import read_manifest
    from adaptive_spec.training.metrics import ACCEPTED, auc, binary_kl

    root = Path(args.data)
    manifest = read_manifest(root, hint="point --data at a folder written by `adaptive-spec datagen`")
    c = manifest["config"]
    params = SamplingParams(c["temperature"], c["top_k"], c["top_p"])
    draft, _ = load_model(c["draft"], "draft", c["dtype"], "cpu", pack=False)
    lm_head = draft.get_output_embeddings().weight.detach()
    with torch.inference_mode():
        d = probe_rows(root, manifest, args.split, lm_head, params)
    del draft
    P = d["P"]
    # (name, score, is the score a logit of the acceptance probability, so that KL applies);
    # AUC needs only the order, which a logit keeps
    rows = [("constant (mean P)", torch.full_like(P, torch.logit(P.mean()).item()), True),
            ("draft confidence q(y)", d["log_qy"].exp(), False), ("draft entropy -H(q)", -d["H"], False)]
    logits = {}
    for pat in args.heads:
        for folder in sorted(glob.glob(pat)):
            if not (Path(folder) / "config.json").is_file():
                continue
            head = AcceptanceHead.from_pretrained(folder).float()
            stats = d["stats"] if reads_stats(head.inputs) else None
            if reads_stats(head.inputs) and stats is None:
                print(f"skipping {folder}: it reads draft_stats, which {root} does not store")
                continue
            with torch.inference_mode():
                z = head(join_inputs(d["ctx" if head.feature == "context" else "tok"], stats))
            logits[Path(folder).name] = z
            rows.append((f"head {Path(folder).name} ({head.feature}, {head.inputs})", z, True))
    qf = torch.stack([d["log_qy"], d["H"]], 1)
    rows.append(("logistic(q(y), H)", cv_logistic(qf, P), True))
    for name, z in logits.items():
        rows.append((f"logistic(q(y), H, {name})", cv_logistic(torch.cat([qf, z[:, None]], 1), P), True))
    if len(logits) > 1:
        allz = torch.cat([qf] + [z[:, None] for z in logits.values()], 1)
        rows.append(("logistic(q(y), H, all heads)", cv_logistic(allz, P), True))
    res = [{"predictor": n, "kl": binary_kl(P, z).mean().item() if is_logit else None, "auc": auc(z, P)}
           for n, z, is_logit in rows]
    md = finish(MODES["probe"], Path(args.out), {"data": args.data, "split": args.split, "n": len(P), "rows": res},
                lambda: {"mean_p": P.mean().item(), "accepted_share": (P >= ACCEPTED).float().mean().item(),
                         "accepted": ACCEPTED, "temperature": params.temperature, "top_k": params.top_k,
                         "top_p": params.top_p})
    print(md, end="")
    return 0


def probe_options(p: argparse.ArgumentParser):
    p.add_argument("--split", default="dev")
    p.add_argument("--heads", nargs="*", default=["checkpoints/*"], help="head folders or globs")


def probe_report(results: dict, header: dict) -> str:
    """table.md: results.json's rows, with what run.json says of the split (its mean P and the share of
    tokens accepted, the sampling, the threshold P counts as accepted at). A folder annotated by hand
    (probe_heads_int8) also has a title, a note on how its data was made and the CPU line in run.json."""
    acc = header["accepted"]
    lines = [f"# {header['title']}", ""] if header.get("title") else []
    for key in ("note", "cpu"):
        if header.get(key):
            lines += [header[key], ""]
    lines += [f"{results['data']} {results['split']}: {results['n']} draft tokens, mean P {header['mean_p']:.3f}, "
              f"{header['accepted_share']:.1%} with P >= {acc}; sampling T={header['temperature']} "
              f"top-k {header['top_k']} top-p {header['top_p']}", "",
              f"| predictor | KL(P‖p̂) per token | AUC (P ≥ {acc} vs P < {acc}) |", "|---|---|---|"]
    lines += [f"| {r['predictor']} | {'–' if r['kl'] is None else format(r['kl'], '.4f')} | {r['auc']:.4f} |"
              for r in results["rows"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- ablate

VARIANTS = {"hidden": ("token", "hidden"), "hidden+stats": ("token", "hidden+stats"),
            "context": ("context", "hidden"), "context+stats": ("context", "hidden+stats"),
            "stats": ("context", "stats")}
DEFAULT_VARIANTS = "hidden,hidden+stats,context"


def _list(text: str, cast, what: str, valid: str) -> list:
    try:
        items = [cast(t) for t in text.split(",") if t.strip()]
    except ValueError:
        items = []
    if not items:
        raise UserError(f"{what} takes a comma-separated list of {valid}, got {text!r}")
    return items


def _variant(name: str) -> str:
    if name.strip() not in VARIANTS:
        raise ValueError(name)
    return name.strip()


def run_name(variant: str, depth: int, w_rej: float) -> str:
    return f"{variant.replace('+', '-')}-d{depth}-wrej{w_rej:g}"


def scored_head(run_dir: Path, cfg: TrainConfig, manifest: dict, data: Path | None = None) -> dict:
    """The dev metrics (overall and per source) of the run's head, computed once: on the training data in
    ablation.json, whose per-source metrics also go into the head's model card; on another folder's dev
    split (--eval-data) in eval.json, keyed by that folder and its shards so that a changed folder is rescored."""
    from adaptive_spec.evaluation.head_scores import dev_metrics, split_shards

    cached = run_dir / ("eval.json" if data else "ablation.json")
    key = {"data": str(data), "shards": [e["file"] for e in split_shards(manifest, "dev")]} if data else None
    old = json.loads(cached.read_text()) if cached.is_file() else None
    if old is not None and (data is None or old.get("key") == key):
        return old["by"] if data else old
    import torch

    from adaptive_spec.heads.head import AcceptanceHead

    head = AcceptanceHead.from_pretrained(run_dir / "head", dtype=torch.float32)
    by = dev_metrics(head, cfg, manifest, data)
    if data:
        write_json(cached, {"key": key, "by": by})
        return by
    if len(by) > 1:
        head.extra["dev_by_source"] = {k: v for k, v in by.items() if k != "all"}
        atomic_write(run_dir / "head" / "README.md", str(head.generate_model_card()))
    write_json(cached, by)
    return by


def table_row(variant: str, cfg: TrainConfig, results: dict, by: dict, sources: list[str],
              by_eval: dict | None = None) -> dict:
    best = results.get("best") or {}
    head_cfg = json.loads((Path(cfg.output_dir) / "head" / "config.json").read_text())
    row = {"inputs": variant, "D": cfg.depth, "w_rej": cfg.w_rej, "positions": head_cfg.get("n_train_positions"),
           "best_step": results.get("best_step"), "dev_kl": best.get("dev_kl"), "dev_auc": best.get("dev_auc"),
           "dev_ece": best.get("dev_ece"), "head": str(Path(cfg.output_dir) / "head"),
           "by_source": {s: by.get(s, {}) for s in sources}}
    if by_eval is not None:
        row["eval"] = by_eval.get("all", {})
        row["eval_by_source"] = {s: by_eval.get(s, {}) for s in sources}
    return row


def ablate(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """ablate: head inputs, ablated: train heads on one datagen folder over input set x D x w_rej
    and tabulate dev KL, AUC and ECE, overall and per prompt source.

        python eval/score_heads.py ablate --data runs/datagen/mix [--out runs/heads/ablation]
            [--variants hidden,hidden+stats,context] [--depths 0,3] [--w-rejs 1,6]
            [--eval-data runs/datagen/mix-target]
            [--config configs/train/default.yaml] [key=value ...]      # rerun the same command to resume

    Input sets (a head's `feature` and `inputs`, adaptive_spec/heads/head.py):
      hidden         feature=token, inputs=hidden: the paper's head on the draft's last hidden state
      hidden+stats   feature=token, inputs=hidden+stats: also log q(y), H(q), top-1 - top-2 (features.py)
      context        feature=context, inputs=hidden: the no-lag head on the state that produced q_i
      context+stats  feature=context, inputs=hidden+stats (not in the default grid)
      stats          feature=context, inputs=stats: the draft's statistics alone, no hidden state (not in
                     the default grid): what a hidden-state head must beat to be worth its inputs

    Each head is one `adaptive_spec.training.loop.train` run in <out>/<set>-d<D>-wrej<w>/ (resumed after an
    interruption, skipped once finished); key=value overrides apply to every run (e.g. epochs=2).
    All heads share the config's target (default accept_prob = min(1, p/q)), so their metrics
    compare. Overall dev metrics are those of the exported head (lowest dev loss); per-source ones
    are recomputed from that head on heads.shard_inputs rows (the rows the offline replay of
    `--threshold auto` reads), cached in the run's ablation.json and added to its model card
    (head/README.md). Writes <out>/ablation.md, <out>/ablation.json (the table's rows) and <out>/run.json.

    --eval-data scores every head also on another folder's dev split, typically the same responses
    with states on the target's prefix (`adaptive-spec datagen-features --prefix target`): the
    inputs a head gets when decoding, where the training folder's mixed-prefix dev states are the
    paper's stand-in for them (features.PREFIXES). Its metrics get their own columns, and the
    per-source columns then come from it. Either way the table ends with the reference a head must
    beat: the AUC of the draft's own log q(Y_i) (stored draft_stats), no head."""
    if not args.data:
        p.error("the following arguments are required: --data")

    from accelerate import PartialState

    from adaptive_spec.config import load_config
    from adaptive_spec.evaluation.head_scores import reference_auc
    from adaptive_spec.training.data import dataset_sources, read_manifest
    from adaptive_spec.training.loop import train
    from adaptive_spec.training.settings import TrainConfig

    out = Path(args.out)
    variants = _list(args.variants, _variant, "--variants", ", ".join(VARIANTS))
    depths = _list(args.depths, int, "--depths", "integers in 0..4")
    w_rejs = _list(args.w_rejs, float, "--w-rejs", "positive numbers")
    base = load_config(TrainConfig, args.config, [*args.overrides, f"data={args.data}"])
    manifest = read_manifest(base.data, partial=base.partial_data)
    sources = dataset_sources(manifest)
    eval_dir = Path(args.eval_data) if args.eval_data else None
    eval_man = read_manifest(eval_dir, partial=base.partial_data) if eval_dir else None
    if eval_man is not None and dataset_sources(eval_man) != sources:
        raise UserError(f"--eval-data {eval_dir} has prompt sources {dataset_sources(eval_man)}, --data has {sources}; "
                        "evaluate on a folder derived from the same datagen run")
    grid = [(v, d, w) for v in variants for d in depths for w in w_rejs]
    for v, d, w in grid:  # every run's settings checked before the first one trains
        base.model_copy(update=dict(feature=VARIANTS[v][0], inputs=VARIANTS[v][1], depth=d, w_rej=w)).validate()
    state, rows = PartialState(), []
    for v, d, w in grid:
        name = run_name(v, d, w)
        cfg = base.model_copy(update=dict(feature=VARIANTS[v][0], inputs=VARIANTS[v][1], depth=d, w_rej=w,
                                          output_dir=str(out / name),
                                          feature_cache=base.feature_cache or str(out / "features"),
                                          run_name=f"{base.run_name or out.name}-{name}"))
        state.print(f"[ablation] head {name} ({grid.index((v, d, w)) + 1}/{len(grid)})")
        results = train(cfg, resume=True, end_training=False)
        if state.is_main_process:
            by_eval = scored_head(out / name, cfg, eval_man, eval_dir) if eval_dir else None
            rows.append(table_row(v, cfg, results, scored_head(out / name, cfg, manifest), sources, by_eval))
    if state.is_main_process:
        table = {"data": base.data, "config_hash": manifest.get("config_hash"), "eval_data": args.eval_data,
                 "target": base.target, "sources": sources,
                 "reference_log_q_auc": reference_auc(eval_dir or Path(base.data), eval_man or manifest), "rows": rows}
        finish(MODES["ablate"], out, table, lambda: {"ece_bins": base.ece_bins})
        print(f"ablation table: {out / 'ablation.md'}", file=sys.stderr)
    state.destroy_process_group()
    return 0


def ablate_options(p: argparse.ArgumentParser):
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"input sets: {', '.join(VARIANTS)}")
    p.add_argument("--depths", default="0,3", help="residual blocks D, each in 0..4")
    p.add_argument("--w-rejs", default="1,6", help="rejection weights w_rej")
    p.add_argument("--eval-data", help="also score every head on this folder's dev split (e.g. states on the "
                                       "target prefix: adaptive-spec datagen-features --prefix target)")
    p.add_argument("--config", help="training YAML for every run (configs/train/*.yaml); default: TrainConfig's")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="training config overrides for every run")


def ablate_report(table: dict, header: dict) -> str:
    """ablation.md: ablation.json's rows (`table`, with the data, its config hash, the target, the prompt
    sources and the reference AUC), with what run.json says of the run (the ECE's bins)."""
    rows, sources, eval_data = table["rows"], table["sources"], table["eval_data"]
    trio = ("kl", "auc", "ece")
    per = "eval_by_source" if eval_data else "by_source"
    cols = ["inputs", "D", "w_rej", "training positions", "best step", "dev KL", "dev AUC", "dev ECE",
            *(["eval KL", "eval AUC", "eval ECE"] if eval_data else []),
            *[f"{'eval ' if eval_data else ''}{s}: KL / AUC / ECE" for s in sources]]
    cells = [[r["inputs"], r["D"], f"{r['w_rej']:g}", f"{r['positions']:,}" if r["positions"] else "-", r["best_step"],
              fmt(r["dev_kl"], ".4f"), fmt(r["dev_auc"], ".4f"), fmt(r["dev_ece"], ".4f"),
              *([fmt(r["eval"].get(k), ".4f") for k in trio] if eval_data else []),
              *[" / ".join(fmt(r[per][s].get(k), ".4f") for k in trio) for s in sources]]
             for r in rows]
    reference = table["reference_log_q_auc"]
    where = f"the dev split of {eval_data}" if eval_data else "the dev split"
    ref = (f"Reference, no head: the draft's own log q(Y_i) ranks accepted tokens above rejected ones with AUC "
           f"{fmt(reference.get('all'), '.4f')} on {where}"
           + (" (" + ", ".join(f"{s} {fmt(reference.get(s), '.4f')}" for s in sources) + ")" if sources else "")
           + ". A head is worth its cost where it beats that.")
    text = [f"# Head inputs, ablated: {table['data']} (datagen config hash {table['config_hash']})", "",
            f"Target `{table['target']}`; dev metrics of each exported head (lowest dev loss): KL = unweighted binary "
            f"KL(P || p_hat), AUC = chance a token with P >= 0.99 ranks above one with P < 0.99, ECE over "
            f"{header['ece_bins']} equal-width bins. w_rej > 1 biases predictions down on purpose, which raises KL and "
            "ECE: compare KL and ECE within a w_rej, AUC across all."
            + (f" eval: the same heads on the dev split of {eval_data}." if eval_data else ""), "",
            md_table(cols, cells), "", ref, ""]
    return "\n".join(text)


# ---------------------------------------------------------------- llama-cpp-drift

HEAD = "checkpoints/qwen-coder-0.5b-int8-stats-d3"
TORCH_ROWS = "torch (stored datagen rows)"


def drift(args: argparse.Namespace, _: argparse.ArgumentParser) -> int:
    """llama-cpp-drift: does the statistics head carry over to llama.cpp's draft? Its AUC and calibration
    on the draft statistics llama.cpp's GGUF draft gives, against those on the torch draft it was trained on.

    The head reads only the draft's own distribution (log q(y), H(q), top-1 - top-2), so on llama.cpp
    it runs unchanged, but that draft is another quantization of the same model (GGUF Q4_K_M-era
    weights, not our int8 copy of their bf16 dequantization), and the target too: q, p and so the
    acceptance P = min(1, p(y)/q(y)) shift. Per dev response of a datagen run (teacher-forced on the
    target's response X, the `target` prefix of features.PREFIXES): both llama.cpp models score every
    position in one pass, y ~ q is drawn with the head's datagen sampling (T = 1, top-k 50 for the
    served head), and the head's prediction is scored against P with the metrics training logs
    (training.prediction_metrics: binary KL, AUC at P >= 0.99, ECE over 10 bins). The same positions'
    stored torch rows (draft_stats, accept_prob) are scored beside them.

        python eval/score_heads.py llama-cpp-drift --data data/datagen/mix --sequences 48

    Writes <out>/metrics.json, <out>/report.md (with a reliability plot) and <out>/run.json (the CPU, the
    sampling, the command, when); --report-only leaves the plot as it is."""
    import torch
    from tqdm.auto import tqdm

    from adaptive_spec.backends.cpu.machine import flags_line
    from adaptive_spec.datagen.shards import iter_shards
    from adaptive_spec.decoding.pipeline import SpecPair
    from adaptive_spec.decoding.sampling import process_logits, sample
    from adaptive_spec.heads.features import truncated_stats
    from adaptive_spec.heads.head import AcceptanceHead, join_inputs
    from adaptive_spec.training.metrics import plot_reliability, prediction_metrics

    torch.set_num_threads(args.threads)
    head = AcceptanceHead.from_pretrained(args.head).eval()
    if head.inputs != "stats":
        raise UserError(f"{args.head} reads inputs={head.inputs}; llama.cpp gives no hidden states")
    params = head.stats_params
    pair = SpecPair.load(backend="llama.cpp", threads=args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    rows = {"llama.cpp": ([], []), TORCH_ROWS: ([], [])}  # name: (head logits, targets P) per response
    expected = {"llama.cpp": [], TORCH_ROWS: []}
    zeros = torch.zeros(head.hidden_size)
    done = 0
    bar = tqdm(total=args.sequences, desc="responses", file=sys.stderr)
    with torch.inference_mode():
        for shard in iter_shards(args.data, args.split):
            offs, resp, plen = shard["input_offsets"], shard["resp_offsets"], shard["prompt_lens"]
            for b in range(len(plen)):
                if done >= args.sequences:
                    break
                prompt = shard["input_ids"][offs[b]: offs[b] + plen[b]].long()
                x = shard["x_ids"][resp[b]: resp[b + 1]].long()
                ids = torch.cat([prompt, x[:-1]])
                scored = []
                for lm in (pair.draft, pair.target):
                    lm.reset()
                    logits, _ = lm.forward(ids, n_logits=len(x))
                    scored.append(process_logits(logits, params))
                q, p = scored
                y = sample(q, gen)
                q_y, p_y = q.gather(-1, y[:, None])[:, 0], p.gather(-1, y[:, None])[:, 0]
                stats = torch.stack([truncated_stats(q[i], y[i], params.top_k) for i in range(len(x))])
                for name, st, target in (("llama.cpp", stats, (p_y / q_y).clamp(max=1.0)),
                                         (TORCH_ROWS, shard["draft_stats"][resp[b]: resp[b + 1]],
                                          shard["accept_prob"][resp[b]: resp[b + 1]])):
                    rows[name][0].append(head(join_inputs(zeros.expand(len(x), -1), st)).view(-1).float())
                    rows[name][1].append(target.float())
                expected["llama.cpp"].append(torch.minimum(p, q).sum(-1))
                expected[TORCH_ROWS].append(shard["expected_accept"][resp[b]: resp[b + 1]])
                done += 1
                bar.update(1)
            if done >= args.sequences:
                break
    bar.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics, curves = {}, {}
    for name, (logits, targets) in rows.items():
        m, bins = prediction_metrics(torch.cat(logits), torch.cat(targets))
        m["mean_expected_accept"] = torch.cat(expected[name]).double().mean().item()
        metrics[name], curves[name] = m, bins
    plot_reliability(curves, out / "reliability.png", title="torch vs llama.cpp draft statistics")
    doc = {"head": args.head, "data": args.data, "split": args.split, "sequences": done, "sampling": vars(params),
           "metrics": metrics}
    md = finish(MODES["llama-cpp-drift"], out, doc, lambda: {
        "cpu": flags_line(), "sampling": str(params),
        "command": f"python {SCRIPT} llama-cpp-drift --data {args.data} --sequences {args.sequences}"})
    print(md, end="")
    return 0


def drift_options(p: argparse.ArgumentParser):
    p.add_argument("--split", default="dev")
    p.add_argument("--sequences", type=int, default=48, help="responses to score (in shard order)")
    p.add_argument("--head", default=HEAD)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)


def drift_report(doc: dict, header: dict) -> str:
    """report.md: metrics.json (`doc`), with what run.json says of the run (paired.run_header): the CPU
    line, the sampling, the command and when it ran."""
    table = [[name, str(m["n"]), f"{m['mean_target']:.3f}", f"{m['mean_pred']:.3f}", f"{m['mean_expected_accept']:.3f}",
              f"{m['kl']:.4f}", f"{m['auc']:.3f}", f"{m['ece']:.4f}"] for name, m in doc["metrics"].items()]
    return "\n".join([f"# The statistics head on llama.cpp's draft: {Path(doc['head']).name}", "", header["cpu"], "",
                      f"{doc['sequences']} {doc['split']} responses of {doc['data']}, teacher-forced on the target's "
                      f"response; y ~ q with {header['sampling']}; the same positions' stored torch rows beside.", "",
                      md_table(["draft statistics from", "positions", "mean P", "mean predicted", "mean E[accept]",
                                "KL", "AUC", "ECE"], table), "", "![reliability](reliability.png)", "",
                      f"Written {header['written']} by `{header['command']}`."]) + "\n"


# ---------------------------------------------------------------- the command line

MODES = {m.name: m for m in (
    Mode("probe", probe, probe_report, "results.json", "table.md", data="runs/datagen/gsm8k",
         out="eval/results/probe_heads", options=probe_options),
    # ablation.json keeps indent 2 (runs.write_json's default), as the committed ablation folders have it
    Mode("ablate", ablate, ablate_report, "ablation.json", "ablation.md", data=None, out="runs/heads/ablation",
         options=ablate_options, indent=2,
         interrupted="finished heads and the last checkpoint of the running one are kept; rerun the same command "
                     "to resume"),
    Mode("llama-cpp-drift", drift, drift_report, "metrics.json", "report.md", data="data/datagen/mix",
         out="eval/results/llama_cpp_head_drift", options=drift_options))}


def common(mode: Mode) -> argparse.ArgumentParser:
    """The options every subcommand has. A fresh parent per subcommand: argparse shares a parent's option
    objects among the parsers built from it, so one parent would give every subcommand the last one's defaults."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--data", default=mode.data,
                   help="a datagen folder (manifest.json + shards)" + (f" (default {mode.data})" if mode.data else
                                                                       "; required unless --report-only"))
    p.add_argument("--out", default=mode.out, help=f"the run folder: {mode.rows}, {mode.report_file} and run.json "
                                                   f"(default {mode.out})")
    p.add_argument("--report-only", action="store_true",
                   help=f"measure nothing: {mode.report_file} from what <out> holds ({mode.rows} and run.json); "
                        "no model, no data, no torch")
    return p


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=SCRIPT, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = ap.add_subparsers(dest="mode", required=True, metavar="{" + ",".join(MODES) + "}")
    for mode in MODES.values():
        # no help= line: the module docstring above (this parser's description) maps each subcommand already
        sp = subs.add_parser(mode.name, parents=[common(mode)], description=inspect.cleandoc(mode.run.__doc__),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        mode.options(sp)
        sp.set_defaults(parser=sp)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    mode = MODES[args.mode]

    def body(_):
        if args.report_only:  # from the folder alone: no --data, no model, no torch
            rebuild(mode, Path(args.out))
            return 0
        return mode.run(args, args.parser)

    return run_main(body, interrupted=mode.interrupted)


if __name__ == "__main__":
    sys.exit(main())
