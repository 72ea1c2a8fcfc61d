"""What every trainer (the heads' loop.py, the drafter's drafter.py) does the same way with Accelerate: the
accelerator, the schedule and the epochs' micro-batches, the loop (train_loop: a trainer's Run subclass supplies
its loss, log row and evaluation), and the run folder, whose log.jsonl, checkpoints/ (trainer_state.json with
each), exported head/ or drafter/ and results.json make --resume continue a run."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import UserError, get_logger
from ..runs import append_jsonl, atomic_write, check_settings, read_jsonl, write_json

log = get_logger(__name__)

CKPT_STATE = "trainer_state.json"  # written last into a checkpoint: a folder without it is incomplete
STOP_EXIT_CODE = 3  # stop_after_steps exits with this, as a killed job would: no cleanup, no results


class RunFiles:
    """log.jsonl, checkpoints/checkpoint_N, head/ and results.json of one run (written by the main process).

    Checkpoints are accelerate's (ProjectConfiguration automatic naming: checkpoint_0, _1, ...,
    the oldest deleted past keep_checkpoints); each holds trainer_state.json with its step."""

    def __init__(self, out: Path, main: bool):
        self.out, self.main = out, main
        self.log_path, self.ckpt_root = out / "log.jsonl", out / "checkpoints"
        self.results_path = out / "results.json"

    def has_run(self) -> bool:
        return self.log_path.exists() or (self.ckpt_root.exists() and any(self.ckpt_root.iterdir()))

    def log(self, row: dict):
        if self.main:
            append_jsonl(self.log_path, row)

    def truncate_log(self, step: int):
        """Drop rows logged after `step`: a killed run may have logged past its last checkpoint."""
        if self.main and self.log_path.exists():
            rows = [r for r in read_jsonl(self.log_path) if r["step"] <= step]
            atomic_write(self.log_path, "".join(json.dumps(r) + "\n" for r in rows))

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(accelerate's iteration, folder) of the complete checkpoints, oldest first."""
        return [(n, p) for n, p in self._numbered() if (p / CKPT_STATE).is_file()]

    def _numbered(self) -> list[tuple[int, Path]]:
        if not self.ckpt_root.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.ckpt_root.iterdir()
                      if (m := re.fullmatch(r"checkpoint_(\d+)", p.name)))

    def drop_incomplete(self):
        """A kill mid-save leaves a checkpoint without trainer_state.json: delete it, so that
        accelerate neither resumes from it nor refuses to save over its name."""
        if self.main:
            for _, p in self._numbered():
                if not (p / CKPT_STATE).is_file():
                    shutil.rmtree(p, ignore_errors=True)

    def last_checkpoint(self) -> str:
        """For the Ctrl-C message: the newest complete checkpoint and its step."""
        ckpts = self.checkpoints()
        if not ckpts:
            return "no checkpoint yet"
        path = ckpts[-1][1]
        step = json.loads((path / CKPT_STATE).read_text()).get("step")
        return f"last checkpoint {path} (step {step}) kept"

    def export(self, name: str, write):
        """Write the folder `name` by `write(tmp)` into a tmp folder swapped in whole, so it is always complete."""
        if not self.main:
            return
        tmp, final, old = self.out / f"{name}.tmp", self.out / name, self.out / f"{name}.old"
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)


def wandb_configured(env=os.environ) -> bool:
    """Whether the user set wandb up (mode, key or login); if not we log offline, never prompt."""
    if env.get("WANDB_MODE") or env.get("WANDB_API_KEY"):
        return True
    netrc = Path(env.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text(errors="ignore")
    except OSError:
        return False


def mixed_precision_kwargs(cfg, env=os.environ) -> dict:
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


def make_accelerator(cfg):
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


def finished_results(cfg, resume: bool, runtime_keys: set) -> dict | None:
    """Refuse, before any work, a new run over an old one or a resume with other settings (but `runtime_keys`);
    a finished run's results, when resuming it."""
    files = RunFiles(Path(cfg.output_dir), False)
    if not resume and (files.has_run() or files.results_path.exists()):
        raise UserError(f"output_dir {files.out} already holds a run; pass --resume to continue it or choose "
                        "another output_dir")
    saved = files.out / "train_config.json"
    if resume and saved.is_file():
        # keys added since the run began (e.g. inputs) count as their defaults, which is what it ran with
        defaults = {k: f.get_default(call_default_factory=True) for k, f in type(cfg).model_fields.items()
                    if not f.is_required()}
        check_settings(files.out, {**defaults, **json.loads(saved.read_text())}, cfg.model_dump(), kind="run",
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
        write_json(files.out / "train_config.json", cfg.model_dump())
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
    acc.init_trackers(cfg.wandb_project, config=cfg.model_dump(), init_kwargs={"wandb": {
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


def micro_batches(acc, loader, sampler, state: dict, steps_per_epoch: int, cfg):
    """The run's remaining micro-batches, epoch by epoch; a resumed epoch skips those done before the checkpoint."""
    for epoch in range(state["step"] // steps_per_epoch, cfg.epochs):
        skip = (state["step"] - epoch * steps_per_epoch) * cfg.grad_accum
        batches = acc.skip_first_batches(loader, skip) if skip > 0 else loader
        batches.set_epoch(epoch)  # accelerate re-sets the sampler's epoch from this when iterating
        sampler.set_epoch(epoch)
        yield from batches


def optimizer_step(acc, model, optimizer, loss, cfg):
    """Backward, and (accelerate skips it but on the last micro-batch of an accumulation window) clip and step."""
    acc.backward(loss)
    if acc.sync_gradients and cfg.max_grad_norm > 0:
        acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad()


def log_eval(acc, files: RunFiles, state: dict, row: dict, loss: float) -> bool:
    """Log an evaluation's row; whether `loss` is the best yet (the state then records its step)."""
    files.log({"kind": "eval", **row})
    acc.log({f"eval/{k}": v for k, v in row.items() if k != "step"}, step=row["step"])
    if state["best_loss"] is not None and loss >= state["best_loss"]:
        return False
    state.update(best_loss=loss, best_step=row["step"])
    return True


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


@dataclass
class Run:
    """One training run, stepped by train_loop. A trainer's subclass supplies the rest: micro_step(batch) (the
    loss of one micro-batch, stepped by optimizer_step), train_row(step, lr) (log.jsonl's train row and the
    progress bar's postfix) and eval_and_export(step, bar=None) (evaluate, log_eval, export the best; its row)."""
    cfg: Any
    acc: Any
    files: RunFiles
    model: Any
    optimizer: Any
    scheduler: Any
    loader: Any
    sampler: Any
    steps_per_epoch: int
    total: int
    desc: str                     # the progress bar's
    meta: dict                    # training metadata stored with the export
    state = None                  # step, best_loss, best_step: restore_checkpoint's, set by train_loop
    what = ""                     # the exported folder (and results.json's key for it): head or drafter
    flush_at_checkpoints = False  # log a row at each checkpoint too (a loss window then restarts where it resumes)


def train_loop(run: Run, resume: bool, of: str = "", first: dict | None = None, end_training: bool = True) -> dict:
    """The run from its newest checkpoint (or afresh, evaluated at step 0 first) to its end, then results.json
    (`first`, then the best export's step and metrics). `of`: restore_checkpoint's. end_training=False leaves
    the process group up for the next head of a sweep."""
    acc, files = run.acc, run.files
    state = run.state = restore_checkpoint(acc, files, run.cfg, resume, of)
    start_trackers(acc, run.cfg, files.out)
    if state["step"] == 0:
        run.eval_and_export(0)
    run.model.train()
    # A context manager: on Ctrl-C the bar is closed before the "interrupted" line, not after it.
    with tqdm(total=run.total, initial=state["step"], disable=not acc.is_main_process, desc=run.desc) as bar:
        for batch in micro_batches(acc, run.loader, run.sampler, state, run.steps_per_epoch, run.cfg):
            with acc.accumulate(run.model):
                run.micro_step(batch)
            if acc.sync_gradients:
                after_step(run, bar)
    out = files.out / run.what
    if acc.is_main_process:  # results.json, written by the main process and read by all
        best = json.loads((out / "config.json").read_text())["metrics"]
        write_json(files.results_path, {**(first or {}), "best_step": state["best_step"], "total_steps": run.total,
                                        "best": best, run.what: str(out)})
    acc.wait_for_everyone()
    results = json.loads(files.results_path.read_text())
    acc.print(f"best {run.what} (step {results['best_step']}) in {out}: " + json.dumps(results["best"]))
    acc.free_memory()
    if end_training:
        acc.end_training()  # stops the trackers and the process group
    else:
        for tracker in acc.trackers:
            tracker.finish()
    return results


def after_step(run: Run, bar):
    """After an optimizer step: schedule, then log / evaluate / checkpoint when due."""
    cfg, state = run.cfg, run.state
    lr = run.scheduler.get_last_lr()[0]  # the lr this step used
    run.scheduler.step()
    state["step"] += 1
    step, last = state["step"], state["step"] == run.total
    bar.update(1)
    # The last step is saved too: its model.safetensors is the run's final weights.
    saving = cfg.save_every and (step % cfg.save_every == 0 or last)
    if step % cfg.log_every == 0 or last or (saving and run.flush_at_checkpoints):
        row, postfix = run.train_row(step, lr)
        run.files.log({"kind": "train", **row})
        run.acc.log({f"train/{k}": v for k, v in row.items() if k != "step"}, step=step)
        bar.set_postfix(**postfix)
    if step % cfg.eval_every == 0 or last:
        run.eval_and_export(step, bar)
    if saving:
        save_checkpoint(run.acc, run.files, state)
    stop_if_asked(cfg, step, bar)


