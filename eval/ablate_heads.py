"""Head inputs, ablated: train heads on one datagen folder over input set x D x w_rej
and tabulate dev KL, AUC and ECE, overall and per prompt source.

    python eval/ablate_heads.py --data runs/datagen/mix [--out runs/heads/ablation]
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
(head/README.md). Writes <out>/ablation.md, <out>/ablation.json (the table's rows) and <out>/run.json
(what the table says beside them, evaluation/paired.run_header); `--report-only --out DIR` rewrites
DIR/ablation.md from those two alone (no --data, no training, no torch).

--eval-data scores every head also on another folder's dev split, typically the same responses
with states on the target's prefix (`adaptive-spec datagen-features --prefix target`): the
inputs a head gets when decoding, where the training folder's mixed-prefix dev states are the
paper's stand-in for them (features.PREFIXES). Its metrics get their own columns, and the
per-source columns then come from it. Either way the table ends with the reference a head must
beat: the AUC of the draft's own log q(Y_i) (stored draft_stats), no head.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from adaptive_spec.errors import UserError, run_main
from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.runs import atomic_write, write_json
from adaptive_spec.tables import fmt, md_table

if TYPE_CHECKING:  # torch, the heads and training load where a head is trained or scored: --report-only needs none
    import torch

    from adaptive_spec.heads.head import AcceptanceHead
    from adaptive_spec.training.settings import TrainConfig

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


def source_of_positions(shard: dict) -> torch.Tensor:
    """[T] source index of each response position (datagen stores one per sequence)."""
    import torch

    return torch.repeat_interleave(shard["source_ids"].long(), shard["resp_offsets"].long().diff())


def dev_metrics(head: AcceptanceHead, cfg: TrainConfig, manifest: dict, data: Path | None = None) -> dict:
    """{"all": metrics, source: metrics, ...} of `head` on every dev shard of `data` (default: the
    training data), from shard_inputs rows at the positions training uses (shard_positions)."""
    import torch
    from safetensors.torch import load_file

    from adaptive_spec.heads.head import shard_inputs, shard_positions
    from adaptive_spec.training.data import dataset_sources
    from adaptive_spec.training.metrics import prediction_metrics

    names = dataset_sources(manifest)
    zs, ys, srcs = [], [], []
    for entry in ((manifest.get("splits") or {}).get("dev") or {}).get("shards") or []:
        shard = load_file(str(Path(data or cfg.data) / entry["file"]))
        used = shard_positions(head, shard)
        with torch.no_grad():
            zs.append(head(shard_inputs(head, shard)[used]).float())
        ys.append(shard[cfg.target].float()[used].clamp(0, 1))
        if names:
            srcs.append(source_of_positions(shard)[used])
    if not zs:
        return {}
    z, y = torch.cat(zs), torch.cat(ys)
    out = {"all": prediction_metrics(z, y, cfg.w_acc, cfg.w_rej, cfg.ece_bins)[0]}
    s = torch.cat(srcs) if srcs else None
    for k, name in enumerate(names):
        out[name] = prediction_metrics(z[s == k], y[s == k], cfg.w_acc, cfg.w_rej, cfg.ece_bins)[0]
    return out


def evaluate_head(run_dir: Path, cfg: TrainConfig, manifest: dict) -> dict:
    """The run's ablation.json (computed once): its head's dev metrics overall and per source; the
    per-source ones also go into the head's model card."""
    import torch

    from adaptive_spec.heads.head import AcceptanceHead

    cached = run_dir / "ablation.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    head = AcceptanceHead.from_pretrained(run_dir / "head", dtype=torch.float32)
    by = dev_metrics(head, cfg, manifest)
    if len(by) > 1:
        head.extra["dev_by_source"] = {k: v for k, v in by.items() if k != "all"}
        atomic_write(run_dir / "head" / "README.md", str(head.generate_model_card()))
    write_json(cached, by)
    return by


def evaluate_on(run_dir: Path, cfg: TrainConfig, data: Path, manifest: dict) -> dict:
    """The run's head scored on another folder's dev split (--eval-data), cached in eval.json
    for that folder and its dev shards."""
    key = {"data": str(data), "shards": [e["file"] for e in manifest["splits"].get("dev", {}).get("shards", [])]}
    cached = run_dir / "eval.json"
    old = json.loads(cached.read_text()) if cached.is_file() else {}
    if old.get("key") == key:
        return old["by"]
    import torch

    from adaptive_spec.heads.head import AcceptanceHead

    head = AcceptanceHead.from_pretrained(run_dir / "head", dtype=torch.float32)
    by = dev_metrics(head, cfg, manifest, data)
    write_json(cached, {"key": key, "by": by})
    return by


def reference_auc(data: Path, manifest: dict) -> dict:
    """{"all": AUC, source: AUC} of the draft's own log q(Y_i) (draft_stats), no head, on the dev
    split at the positions a token head is scored on."""
    import torch
    from safetensors.torch import load_file

    from adaptive_spec.heads.features import CONTEXT_KEY, position_map
    from adaptive_spec.training.data import dataset_sources
    from adaptive_spec.training.metrics import auc

    names = dataset_sources(manifest)
    lq, ps, srcs = [], [], []
    for entry in manifest["splits"].get("dev", {}).get("shards", []):
        sh = load_file(str(data / entry["file"]))
        used = position_map("token", sh["loss_mask"], sh["resp_offsets"], CONTEXT_KEY in sh)[0]
        lq.append(sh["draft_stats"][used, 0])
        ps.append(sh["accept_prob"][used])
        if names:
            srcs.append(source_of_positions(sh)[used])
    if not lq:
        return {}
    lq, ps = torch.cat(lq), torch.cat(ps)
    out = {"all": auc(lq, ps)}
    if srcs:
        s = torch.cat(srcs)
        out.update({name: auc(lq[s == k], ps[s == k]) for k, name in enumerate(names)})
    return out


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


def write_tables(rows: list[dict], out: Path, cfg: TrainConfig, manifest: dict, sources: list[str],
                 reference: dict, eval_data: str | None = None):
    table = {"data": cfg.data, "config_hash": manifest.get("config_hash"), "eval_data": eval_data,
             "target": cfg.target, "sources": sources, "reference_log_q_auc": reference, "rows": rows}
    write_json(out / "ablation.json", table)
    header = run_header(out, report_only=False, measure=lambda: {
        "script": "eval/ablate_heads.py", "report": "ablation.md", "ece_bins": cfg.ece_bins})
    atomic_write(out / "ablation.md", report(table, header))
    print(f"ablation table: {out / 'ablation.md'}", file=sys.stderr)


def report(table: dict, header: dict) -> str:
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eval/ablate_heads.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="datagen output folder (manifest.json + shards); required unless --report-only")
    p.add_argument("--out", default="runs/heads/ablation", help="one run folder per head, plus ablation.md")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: ablation.md from what <out> holds (ablation.json and run.json)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"input sets: {', '.join(VARIANTS)}")
    p.add_argument("--depths", default="0,3", help="residual blocks D, each in 0..4")
    p.add_argument("--w-rejs", default="1,6", help="rejection weights w_rej")
    p.add_argument("--eval-data", help="also score every head on this folder's dev split (e.g. states on the "
                                       "target prefix: adaptive-spec datagen-features --prefix target)")
    p.add_argument("--config", help="training YAML for every run (configs/train/*.yaml); default: TrainConfig's")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="training config overrides for every run")
    return p


def _main(argv) -> int:
    p = parser()
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.report_only:  # from the folder alone: its table's rows and run.json
        table = json.loads((out / "ablation.json").read_text())
        atomic_write(out / "ablation.md", report(table, run_header(out, report_only=True)))
        return 0
    if not args.data:
        p.error("the following arguments are required: --data")

    from accelerate import PartialState

    from adaptive_spec.config import load_config
    from adaptive_spec.training.data import dataset_sources, read_manifest
    from adaptive_spec.training.loop import train
    from adaptive_spec.training.settings import TrainConfig

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
        dataclasses.replace(base, feature=VARIANTS[v][0], inputs=VARIANTS[v][1], depth=d, w_rej=w).validate()
    state, rows = PartialState(), []
    for v, d, w in grid:
        name = run_name(v, d, w)
        cfg = dataclasses.replace(base, feature=VARIANTS[v][0], inputs=VARIANTS[v][1], depth=d, w_rej=w,
                                  output_dir=str(out / name), feature_cache=base.feature_cache or str(out / "features"),
                                  run_name=f"{base.run_name or out.name}-{name}")
        state.print(f"[ablation] head {name} ({grid.index((v, d, w)) + 1}/{len(grid)})")
        results = train(cfg, resume=True, end_training=False)
        if state.is_main_process:
            by_eval = evaluate_on(out / name, cfg, eval_dir, eval_man) if eval_dir else None
            rows.append(table_row(v, cfg, results, evaluate_head(out / name, cfg, manifest), sources, by_eval))
    if state.is_main_process:
        reference = reference_auc(eval_dir or Path(base.data), eval_man or manifest)
        write_tables(rows, out, base, manifest, sources, reference, args.eval_data)
    state.destroy_process_group()
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, interrupted="finished heads and the last checkpoint of the running one are kept; "
                                             "rerun the same command to resume")


if __name__ == "__main__":
    sys.exit(main())
