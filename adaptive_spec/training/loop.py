"""One training run with Accelerate: the accelerator, the head and its optimizer, the loop, the
evaluations that pick the exported head, and checkpoints that make --resume exact (train)."""
from __future__ import annotations

import json
import math
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..config import config_to_dict
from ..errors import UserError, get_logger
from ..heads.head import AcceptanceHead
from ..runs import check_settings, write_json
from .data import EpochShuffle, PositionSet, dataset_sources, load_split, read_manifest, stats_sampling
from .metrics import plot_reliability, prediction_metrics, weighted_bce
from .runfiles import CKPT_STATE, RunFiles
from .settings import RUNTIME_KEYS, TrainConfig

log = get_logger(__name__)

STOP_EXIT_CODE = 3  # stop_after_steps exits with this, as a killed job would: no cleanup, no results


def wandb_configured(env=os.environ) -> bool:
    """Whether the user set wandb up (mode, key or login); if not we log offline, never prompt."""
    if env.get("WANDB_MODE") or env.get("WANDB_API_KEY"):
        return True
    netrc = Path(env.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text(errors="ignore")
    except OSError:
        return False


def mixed_precision_kwargs(cfg: TrainConfig, env=os.environ) -> dict:
    """The launcher's choice (`accelerate launch --mixed_precision`, or its config file, which
    sets ACCELERATE_MIXED_PRECISION) always wins; only a plain `python train.py` run takes it
    from the config, where auto means bf16 on a GPU and no on CPU."""
    launched = env.get("ACCELERATE_MIXED_PRECISION")
    if launched:
        if cfg.mixed_precision not in ("auto", launched):
            log.warning(f"mixed_precision={cfg.mixed_precision} ignored: the launcher set {launched} "
                        "(pass `accelerate launch --mixed_precision ...` to change it)")
        return {}
    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    return {"mixed_precision": mp}


def make_accelerator(cfg: TrainConfig):
    """One Accelerator per run: its ProjectConfiguration names, rotates and finds the checkpoints."""
    from accelerate import Accelerator  # optional: the [train] extra; loaded when a run starts
    from accelerate.utils import ProjectConfiguration  # as above

    if cfg.report_to == "wandb" and not wandb_configured():
        os.environ["WANDB_MODE"] = "offline"
    project = ProjectConfiguration(project_dir=cfg.output_dir, automatic_checkpoint_naming=True,
                                   total_limit=cfg.keep_checkpoints)
    return Accelerator(gradient_accumulation_steps=cfg.grad_accum, project_config=project,
                       log_with="wandb" if cfg.report_to == "wandb" else None, **mixed_precision_kwargs(cfg))


def lr_lambda(total: int, warmup: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
    return f


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


# ----------------------------------------------------------------------------- the run folder, for heads and drafter

def finished_results(cfg, files: RunFiles, resume: bool, runtime_keys: set) -> dict | None:
    """Refuse, before any work, a new run over an old one or a resume with other settings (but `runtime_keys`);
    a finished run's results, when resuming it."""
    if not resume and (files.has_run() or files.results_path.exists()):
        raise UserError(f"output_dir {files.out} already holds a run; pass --resume to continue it or choose "
                        "another output_dir")
    saved = files.out / "train_config.json"
    if resume and saved.is_file():
        # keys added since the run began (e.g. inputs) count as their defaults, which is what it ran with
        defaults = {k: f.get_default(call_default_factory=True) for k, f in type(cfg).model_fields.items()
                    if not f.is_required()}
        check_settings(files.out, {**defaults, **json.loads(saved.read_text())}, config_to_dict(cfg), kind="run",
                       ignore=runtime_keys, fix="resume with the same config or choose another output_dir")
    if resume and files.results_path.is_file():
        log.info(f"{files.out} already finished; results in {files.results_path}")
        return json.loads(files.results_path.read_text())
    return None


def restore_checkpoint(acc, files: RunFiles, cfg, resume: bool, of: str = "") -> dict:
    """--resume: load the newest complete checkpoint and return its state; otherwise start the run folder
    afresh, writing `cfg` beside it, at step 0. `of`: after the step in the line that says so."""
    if resume:
        files.drop_incomplete()
        acc.wait_for_everyone()
    ckpts = files.checkpoints() if resume else []
    state = {"step": 0, "best_loss": None, "best_step": None}
    if ckpts:
        n, path = ckpts[-1]
        acc.load_state(str(path))
        # load_state does not advance the automatic naming: the next save is checkpoint_{n+1}.
        acc.project_configuration.iteration = n + 1
        state = json.loads((path / CKPT_STATE).read_text())
        files.truncate_log(state["step"])
        acc.print(f"resuming {files.out} from {path} (step {state['step']}{of})")
    elif acc.is_main_process:
        files.out.mkdir(parents=True, exist_ok=True)
        files.log_path.unlink(missing_ok=True)  # --resume without a checkpoint starts over
        write_json(files.out / "train_config.json", config_to_dict(cfg))
    acc.wait_for_everyone()
    return state


def start_trackers(acc, cfg, out: Path):
    """wandb (offline unless configured), resumed under the same run id after a kill."""
    if cfg.report_to != "wandb":
        return
    id_file = out / "wandb_id.txt"
    if acc.is_main_process and not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:12])
    acc.wait_for_everyone()
    acc.init_trackers(cfg.wandb_project, config=config_to_dict(cfg), init_kwargs={"wandb": {
        "name": cfg.run_name or out.name, "dir": str(out), "id": id_file.read_text().strip(), "resume": "allow"}})


def micro_batch(cfg, num_processes: int) -> int:
    per_step = num_processes * cfg.grad_accum
    if cfg.batch_size % per_step:
        raise UserError(f"batch_size {cfg.batch_size} is not divisible by processes x grad_accum = {per_step}")
    return cfg.batch_size // per_step


def make_scheduler(acc, optimizer, loader, cfg) -> tuple[Any, int, int]:
    """(the warm-up + cosine schedule, steps per epoch, total steps) of a prepared loader and optimizer."""
    steps_per_epoch = math.ceil(len(loader) / cfg.grad_accum)  # accelerate syncs at the end of each epoch
    total = steps_per_epoch * cfg.epochs
    # Stepped by us once per optimizer step (not prepared: accelerate would step it once per process).
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer.optimizer, lr_lambda(total, int(cfg.warmup_ratio * total), cfg.min_lr_ratio))
    acc.register_for_checkpointing(scheduler)
    return scheduler, steps_per_epoch, total


def micro_batches(acc, loader, sampler: EpochShuffle, state: dict, steps_per_epoch: int, cfg):
    """The run's remaining micro-batches, epoch by epoch; a resumed epoch skips those done before the checkpoint."""
    for epoch in range(state["step"] // steps_per_epoch, cfg.epochs):
        skip = (state["step"] - epoch * steps_per_epoch) * cfg.grad_accum
        batches = acc.skip_first_batches(loader, skip) if skip > 0 else loader
        batches.set_epoch(epoch)  # accelerate re-sets the sampler's epoch from this when iterating
        sampler.set_epoch(epoch)
        yield from batches


def next_step(scheduler, state: dict, bar) -> tuple[float, int]:
    """After an optimizer step: the lr it used, and the new step count."""
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    state["step"] += 1
    bar.update(1)
    return lr, state["step"]


def save_checkpoint(acc, files: RunFiles, state: dict):
    """accelerate's save_state (it names checkpoint_N and deletes the oldest past total_limit),
    then trainer_state.json, written last: only a checkpoint that has it is resumed from."""
    acc.save_state()
    acc.wait_for_everyone()
    if acc.is_main_process:
        folder = files.ckpt_root / f"checkpoint_{acc.project_configuration.iteration - 1}"
        write_json(folder / CKPT_STATE, state)
        log.info(f"checkpoint saved: {folder} (step {state.get('step')})")
    acc.wait_for_everyone()


def stop_if_asked(cfg, step: int, bar):
    """stop_after_steps: exit abruptly, with no tracker or file cleanup, leaving what a kill leaves behind."""
    if cfg.stop_after_steps and step == cfg.stop_after_steps:
        bar.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(STOP_EXIT_CODE)


def write_results(acc, files: RunFiles, what: str, results: dict) -> dict:
    """results.json, written by the main process (the others pass None in `results`' "best") and read by all."""
    if acc.is_main_process:
        write_json(files.results_path, results)
    acc.wait_for_everyone()
    results = json.loads(files.results_path.read_text())
    acc.print(f"best {what} (step {results['best_step']}) in {files.out / what}: " + json.dumps(results["best"]))
    return results


# ----------------------------------------------------------------------------- the heads' loop

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
            train_step(run, x, y)
            if acc.sync_gradients:
                after_step(run, pbar)


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor):
    """One micro-batch; the optimizer really steps on the last one of each accumulation window."""
    cfg, acc = run.cfg, run.acc
    with acc.accumulate(run.model):
        loss = weighted_bce(run.model(x), y, cfg.w_acc, cfg.w_rej)
        acc.backward(loss)
        if acc.sync_gradients and cfg.max_grad_norm > 0:
            acc.clip_grad_norm_(run.model.parameters(), cfg.max_grad_norm)
        run.optimizer.step()
        run.optimizer.zero_grad()
    run.loss_sum += loss.detach()
    run.n_micro += 1


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
    sel = row.get("dev_loss", row["train_loss"])  # select on dev; on train only without a dev split
    run.files.log({"kind": "eval", **row})
    acc.log({f"eval/{k}": v for k, v in row.items() if k != "step"}, step=step)
    if acc.is_main_process:
        plot_reliability(curves, out / "reliability.png", f"step {step}")
    if run.state["best_loss"] is None or sel < run.state["best_loss"]:
        run.state.update(best_loss=sel, best_step=step)
        extra = {**run.meta, "step": step, "metrics": row}

        def write(tmp: Path):
            head.save_pretrained(tmp, extra=extra)  # config.json, model.safetensors, README.md (model card)
            write_json(tmp / "metrics.json", row)
            plot_reliability(curves, tmp / "reliability.png", f"D={head.depth} w_rej={extra['w_rej']:g} step {step}")
        run.files.export("head", write)
    return row
