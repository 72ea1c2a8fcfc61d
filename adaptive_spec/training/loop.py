"""One head's training run (train): its data, the head and its optimizer, the loop, and the evaluations that
pick the exported head; runfiles.py has the loop and the rest the drafter's trainer shares (checkpoints, resume)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..heads.head import AcceptanceHead
from ..runs import write_json
from .data import EpochShuffle, PositionSet, dataset_sources, load_split, read_manifest, stats_sampling
from .metrics import plot_reliability, prediction_metrics, weighted_bce
from .runfiles import (Run, RunFiles, finished_results, log_eval, make_accelerator, make_scheduler, micro_batch,
                       optimizer_step, train_loop)
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
class HeadRun(Run):
    """A head's run: its weighted BCE, the mean loss a log row reports, its evaluations on train and dev."""
    eval_loaders: dict            # "train" (a fixed subset) and, when the dataset has one, "dev"
    loss_sum: Any                 # train loss summed since the last log row
    n_micro: int = 0
    what = "head"
    # Flush the loss window at checkpoints too, so a resumed run logs the same rows.
    flush_at_checkpoints = True

    def micro_step(self, batch):
        x, y = batch
        loss = weighted_bce(self.model(x), y, self.cfg.w_acc, self.cfg.w_rej)
        optimizer_step(self.acc, self.model, self.optimizer, loss, self.cfg)
        self.loss_sum += loss.detach()
        self.n_micro += 1

    def train_row(self, step: int, lr: float) -> tuple[dict, dict]:
        mean = self.acc.reduce(self.loss_sum / self.n_micro, "mean").item()
        self.loss_sum.zero_()
        self.n_micro = 0
        row = {"step": step, "epoch": round(step / self.steps_per_epoch, 6), "lr": lr, "loss": mean}
        return row, {"loss": f"{mean:.4f}"}

    def eval_and_export(self, step: int, bar=None) -> dict:
        """Evaluate on train (subset) and dev, log, plot; export the head if its selection loss is the best."""
        acc, out = self.acc, self.files.out
        head = acc.unwrap_model(self.model)
        row, curves = {"step": step}, {}
        for name, loader in self.eval_loaders.items():
            metrics, curves[name] = evaluate(head, loader, self.cfg, acc)
            row.update({f"{name}_{k}": v for k, v in metrics.items()})
        if acc.is_main_process:
            plot_reliability(curves, out / "reliability.png", f"step {step}")
        # select on dev; on train only without a dev split
        if log_eval(acc, self.files, self.state, row, row.get("dev_loss", row["train_loss"])):
            extra = {**self.meta, "step": step, "metrics": row}

            def write(tmp: Path):
                head.save_pretrained(tmp, extra=extra)  # config.json, model.safetensors, README.md (model card)
                write_json(tmp / "metrics.json", row)
                plot_reliability(curves, tmp / "reliability.png", f"D={head.depth} w_rej={extra['w_rej']:g} step {step}")
            self.files.export("head", write)
        if bar is not None:
            bar.set_postfix(loss=f"{row['train_loss']:.4f}", dev_kl=f"{row.get('dev_kl', float('nan')):.4f}")
        return row


def train(cfg: TrainConfig, resume: bool = False, end_training: bool = True) -> dict:
    """Train one head; returns results (also in <output_dir>/results.json).

    end_training=False leaves the process group up for the next head of a sweep."""
    done = finished_results(cfg, resume, RUNTIME_KEYS)  # reused only under the same settings
    if done is not None:
        return done
    manifest = read_manifest(cfg.data, partial=cfg.partial_data)
    run = setup_run(cfg, manifest, make_accelerator(cfg))
    return train_loop(run, resume, f"/{run.total}", {"depth": cfg.depth, "w_rej": cfg.w_rej}, end_training)


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


def setup_run(cfg: TrainConfig, manifest: dict, acc) -> HeadRun:
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
    return HeadRun(cfg, acc, RunFiles(Path(cfg.output_dir), acc.is_main_process), model, optimizer, scheduler, loader,
                   sampler, steps_per_epoch, total, f"head D={cfg.depth} w_rej={cfg.w_rej:g}", meta,
                   dict(zip(evals, eval_loaders)), loss_sum=torch.zeros((), device=acc.device))
