"""One head's training run (train): its data, the head and its optimizer, the loop, and the evaluations that
pick the exported head; runfiles.py has what the drafter's trainer shares (accelerator, checkpoints, resume)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import UserError
from ..heads.head import AcceptanceHead
from ..runs import write_json
from .data import EpochShuffle, PositionSet, dataset_sources, load_split, read_manifest, stats_sampling
from .metrics import plot_reliability, prediction_metrics, weighted_bce
from .runfiles import (RunFiles, finished_results, log_eval, make_accelerator, make_scheduler, micro_batch,
                       micro_batches, next_step, optimizer_step, restore_checkpoint, save_checkpoint, start_trackers,
                       stop_if_asked, write_results)
from .settings import RUNTIME_KEYS, TrainConfig


@torch.no_grad()
def evaluate(head, loader, cfg: TrainConfig, accelerator) -> tuple[dict, torch.Tensor]:
    """(metrics, calibration bins) over a prepared (sharded) loader: each process scores its shard,
    gather_for_metrics brings every position (padding dropped) to every process, so all
    processes compute the same numbers."""
    head.eval()
    zs, ys = [], []  # AUC ranks all positions together: keep them (8 + 4 bytes a position)
    for x, y in loader:
        with accelerator.autocast():
            z = head(x).float()
        z, y = accelerator.gather_for_metrics((z, y))
        zs.append(z.cpu())
        ys.append(y.cpu())
    head.train()
    return prediction_metrics(torch.cat(zs), torch.cat(ys), cfg.w_acc, cfg.w_rej, cfg.ece_bins)


@dataclass
class Run:
    """Everything one training run holds; the functions below each do one part of it."""
    cfg: TrainConfig
    acc: Any
    files: RunFiles
    model: Any
    optimizer: Any
    scheduler: Any
    loader: Any
    sampler: EpochShuffle
    eval_loaders: dict            # "train" (a fixed subset) and, when the dataset has one, "dev"
    steps_per_epoch: int
    total: int
    meta: dict                    # training metadata stored with the exported head
    state: dict = field(default_factory=dict)  # step, best_loss, best_step: restore_checkpoint's
    loss_sum: Any = 0.0           # train loss summed since the last log row
    n_micro: int = 0


def train(cfg: TrainConfig, resume: bool = False, end_training: bool = True) -> dict:
    """Train one head; returns results (also in <output_dir>/results.json).

    end_training=False leaves the process group up for the next head of a sweep."""
    files = RunFiles(Path(cfg.output_dir), False)
    done = finished_results(cfg, files, resume, RUNTIME_KEYS)  # reused only under the same settings
    if done is not None:
        return done
    manifest = read_manifest(cfg.data, partial=cfg.partial_data)
    acc = make_accelerator(cfg)
    run = setup_run(cfg, manifest, acc)
    run.state = restore_checkpoint(acc, run.files, cfg, resume, f"/{run.total}")
    start_trackers(acc, cfg, run.files.out)
    train_loop(run)
    best = json.loads((run.files.out / "head" / "metrics.json").read_text()) if acc.is_main_process else None
    results = write_results(acc, run.files, "head", {"depth": cfg.depth, "w_rej": cfg.w_rej, "best_step": run.state[
        "best_step"], "total_steps": run.total, "best": best, "head": str(run.files.out / "head")})
    acc.free_memory()
    if end_training:
        acc.end_training()  # stops the trackers and the process group
    else:
        for tracker in acc.trackers:
            tracker.finish()
    return results


def load_data(cfg: TrainConfig, manifest: dict, acc) -> tuple[PositionSet, PositionSet, PositionSet | None]:
    """(train positions, the fixed train subset evaluated, dev positions or None)."""
    train_set = load_split(cfg, manifest, "train", acc)
    if train_set is None:
        raise UserError(f"dataset {cfg.data} has no training positions (split 'train' with loss_mask == 1)")
    train_set = train_set.subset(cfg.max_train_positions, cfg.seed)
    dev_set = load_split(cfg, manifest, "dev", acc)
    dev_set = dev_set.subset(cfg.max_dev_positions, cfg.seed + 1) if dev_set is not None else None
    return train_set, train_set.subset(cfg.eval_train_positions, cfg.seed + 2), dev_set


def new_head(cfg: TrainConfig, manifest: dict, train_set: PositionSet) -> AcceptanceHead:
    draft = manifest["models"]["draft"]
    stats = train_set.stats
    head = AcceptanceHead(train_set.hidden_size, cfg.depth, draft_model=draft.get("name"),
                          draft_fingerprint=draft.get("fingerprint"), feature=cfg.feature, inputs=cfg.inputs,
                          stats_sampling=stats_sampling(manifest) if stats is not None else None)
    if stats is not None:
        # log q ranges over tens of nats, the margin over [0, 1]: standardized, no stat swamps the others
        with torch.no_grad():
            head.stats_mean.copy_(stats.double().mean(0).float())
            head.stats_std.copy_(stats.double().std(0, correction=0).clamp_min(1e-6).float())
    if cfg.init_bias:
        # Most targets are near 1; the constant minimising the weighted BCE is
        # w_acc P / (w_acc P + w_rej (1 - P)). Starting there skips learning the base rate.
        pbar = train_set.target.double().mean().item()
        p0 = min(max(cfg.w_acc * pbar / (cfg.w_acc * pbar + cfg.w_rej * (1 - pbar)), 1e-4), 1 - 1e-4)
        # The output weights start at zero too, so step 0 IS that constant: random output weights
        # on a 896-dim hidden state add logit noise that a small lr takes most of a run to undo.
        with torch.no_grad():
            head.out.bias.fill_(math.log(p0 / (1 - p0)))
            head.out.weight.zero_()
    return head


def _batch_as_is(batch):
    return batch  # __getitems__ already returns the collated (x, y)


def setup_run(cfg: TrainConfig, manifest: dict, acc) -> Run:
    """Data, head, optimizer, loaders and schedule, prepared by accelerate."""
    from accelerate.utils import set_seed  # optional: as in make_accelerator

    train_set, train_eval, dev_set = load_data(cfg, manifest, acc)
    micro = micro_batch(cfg, acc.num_processes)
    set_seed(cfg.seed)
    head = new_head(cfg, manifest, train_set)
    optimizer = torch.optim.Adam(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sampler = EpochShuffle(len(train_set), cfg.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=micro, sampler=sampler, collate_fn=_batch_as_is)
    evals = {name: torch.utils.data.DataLoader(ds, batch_size=cfg.eval_batch_size, collate_fn=_batch_as_is)
             for name, ds in (("train", train_eval), ("dev", dev_set)) if ds is not None}
    model, optimizer, loader, *eval_loaders = acc.prepare(head, optimizer, loader, *evals.values())
    scheduler, steps_per_epoch, total = make_scheduler(acc, optimizer, loader, cfg)
    meta = {"w_rej": cfg.w_rej, "w_acc": cfg.w_acc, "target": cfg.target, "dataset": str(cfg.data),
            "dataset_config_hash": manifest.get("config_hash"), "n_train_positions": len(train_set),
            "epochs": cfg.epochs, "lr": cfg.lr, "batch_size": cfg.batch_size,
            # the draft configuration the features came from: a head follows its draft (policies.load_pair_head)
            "draft_quant": manifest.get("config", {}).get("draft_quant", "none"),
            "draft_vocab": manifest.get("config", {}).get("draft_vocab") or "full",
            "ece_bins": cfg.ece_bins, "sources": dataset_sources(manifest) or None,
            # which prefix the states were computed on (features.PREFIXES); datagen's own are mixed
            "prefix": (manifest.get("features") or {}).get("prefix", "mixed"),
            "partial_data": not manifest.get("complete")}
    return Run(cfg, acc, RunFiles(Path(cfg.output_dir), acc.is_main_process), model, optimizer, scheduler, loader,
               sampler, dict(zip(evals, eval_loaders)), steps_per_epoch, total, meta)


def train_loop(run: Run):
    cfg, acc = run.cfg, run.acc
    if run.state["step"] == 0:
        eval_and_export(run, 0)
    run.loss_sum = torch.zeros((), device=acc.device)
    run.model.train()
    # A context manager: on Ctrl-C the bar is closed before the "interrupted" line, not after it.
    with tqdm(total=run.total, initial=run.state["step"], disable=not acc.is_main_process,
              desc=f"head D={cfg.depth} w_rej={cfg.w_rej:g}") as pbar:
        for x, y in micro_batches(acc, run.loader, run.sampler, run.state, run.steps_per_epoch, cfg):
            with acc.accumulate(run.model):
                loss = weighted_bce(run.model(x), y, cfg.w_acc, cfg.w_rej)
                optimizer_step(acc, run.model, run.optimizer, loss, cfg)
            run.loss_sum += loss.detach()
            run.n_micro += 1
            if acc.sync_gradients:
                after_step(run, pbar)


def after_step(run: Run, pbar):
    """After an optimizer step: schedule, then log / evaluate / checkpoint when due."""
    cfg = run.cfg
    lr, step = next_step(run.scheduler, run.state, pbar)
    last = step == run.total
    # The last step is saved too: its model.safetensors is the run's final weights.
    saving = cfg.save_every and (step % cfg.save_every == 0 or last)
    # Flush the loss window at checkpoints too, so a resumed run logs the same rows.
    if step % cfg.log_every == 0 or saving or last:
        pbar.set_postfix(loss=f"{log_train_loss(run, step, lr):.4f}")
    if step % cfg.eval_every == 0 or last:
        ev = eval_and_export(run, step)
        pbar.set_postfix(loss=f"{ev['train_loss']:.4f}", dev_kl=f"{ev.get('dev_kl', float('nan')):.4f}")
    if saving:
        save_checkpoint(run.acc, run.files, run.state)
    stop_if_asked(cfg, step, pbar)


def log_train_loss(run: Run, step: int, lr: float) -> float:
    mean = run.acc.reduce(run.loss_sum / run.n_micro, "mean").item()
    run.loss_sum.zero_()
    run.n_micro = 0
    row = {"step": step, "epoch": round(step / run.steps_per_epoch, 6), "lr": lr, "loss": mean}
    run.files.log({"kind": "train", **row})
    run.acc.log({"train/loss": mean, "train/lr": lr, "train/epoch": row["epoch"]}, step=step)
    return mean


def eval_and_export(run: Run, step: int) -> dict:
    """Evaluate on train (subset) and dev, log, plot; export the head if its selection loss is the best."""
    acc, out = run.acc, run.files.out
    head = acc.unwrap_model(run.model)
    row, curves = {"step": step}, {}
    for name, loader in run.eval_loaders.items():
        metrics, curves[name] = evaluate(head, loader, run.cfg, acc)
        row.update({f"{name}_{k}": v for k, v in metrics.items()})
    if acc.is_main_process:
        plot_reliability(curves, out / "reliability.png", f"step {step}")
    # select on dev; on train only without a dev split
    if log_eval(acc, run.files, run.state, row, row.get("dev_loss", row["train_loss"])):
        extra = {**run.meta, "step": step, "metrics": row}

        def write(tmp: Path):
            head.save_pretrained(tmp, extra=extra)  # config.json, model.safetensors, README.md (model card)
            write_json(tmp / "metrics.json", row)
            plot_reliability(curves, tmp / "reliability.png", f"D={head.depth} w_rej={extra['w_rej']:g} step {step}")
        run.files.export("head", write)
    return row
