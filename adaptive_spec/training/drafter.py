"""Training the feature drafter (adaptive_spec/drafter/): `accelerate launch train.py --config
configs/train/drafter_quick.yaml` (a config with `kind: drafter`; train.py hands it here).

The loss is EAGLE's: a feature loss, smooth L1 between the drafter's f^_{t+1} and the target's f_{t+1},
plus the cross-entropy of the drafter's next-token distribution against the target's (both read out through
the target's LM head), weighted `feature_weight` and `ce_weight`. Inputs get uniform noise of width `noise`:
in decoding the drafter reads its own imperfect f^ after the first step, and `rollout: 2` trains that second
step on the drafter's own f^ (drafter_loss). The target's states come from
drafter/data.py, computed once into `states_dir` (resumable) before the first step.

Same conventions as the heads' loop (loop.py), from runfiles.py: accelerate, wandb offline unless configured,
checkpoints that make --resume continue the run, the best drafter by dev loss exported with save_pretrained to
<output_dir>/drafter, results.json at the end.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ..backends.paths import check_draft_vocab_spec
from ..config import Config
from ..errors import UserError, get_logger
from .data import EpochShuffle
from .runfiles import (Run, RunFiles, finished_results, log_eval, make_accelerator, make_scheduler, micro_batch,
                       optimizer_step, train_loop)

log = get_logger(__name__)
RUNTIME_KEYS = {"stop_after_steps", "report_to", "wandb_project", "run_name", "keep_checkpoints", "threads"}


class DrafterConfig(Config):
    data: str                          # datagen folder whose sequences the target's states are computed along
    kind: Literal["drafter"] = "drafter"  # what train.py trains (the heads' configs have no kind)
    target: str = "default"            # the target the drafter reads: hub id, folder or default
    target_dtype: str = "auto"         # for the states and the readout: auto = bf16 where the CPU has the kernels
    states_dir: str = ""               # where the target's states go ("" = <output_dir>/states)
    output_dir: str = "runs/drafter"   # run folder: log.jsonl, checkpoints/, drafter/, results.json
    max_train_seqs: int = 0            # 0 = every training sequence of `data`
    max_dev_seqs: int = 0
    prompt_tail: int = 128             # prompt tokens kept before each response
    max_len: int = 512                 # tokens a sequence keeps at most
    init_from_target: bool = True      # the layer starts as a copy of the target's last one
    init_from: str = ""                # a saved drafter (folder or hub id) to start from instead: training goes on
    intermediate_size: int = 0         # the drafter's MLP width (0 = the target's); narrower: a smaller file
    feature_weight: float = 1.0        # smooth L1 on the states
    ce_weight: float = 0.1             # cross-entropy against the target's next-token distribution
    noise: float = 0.1                 # uniform noise U(-noise, noise) on the input states
    rollout: int = 1                   # drafted steps trained: 2 also trains on the drafter's own f^ input
    ce_vocab: str = "full"             # the cross-entropy's vocabulary: full, or N | FILE | FILE:N as --draft-vocab
    references: dict[str, int] = {}    # {prompt set: n}: also train on n reference answers of each (sharegpt, ...)
    epochs: int = 1
    batch_size: int = 4                # sequences per optimizer step, summed over processes and accumulation
    grad_accum: int = 1
    lr: float = 3.0e-5
    warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    seed: int = 0
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    eval_every: int = 200              # steps; also at the end
    log_every: int = 10
    save_every: int = 200              # steps between checkpoints (0 = none)
    keep_checkpoints: int = 2
    stop_after_steps: int = 0          # testing: exit abruptly after this step, as if killed
    report_to: Literal["wandb", "none"] = "wandb"
    wandb_project: str = "adaptive_spec"
    run_name: str = ""
    threads: int = 0                   # CPU threads (0 = torch's count)

    def validate(self) -> None:
        checks = [
            (bool(self.data), "data must name a datagen folder"),
            (self.feature_weight >= 0 and self.ce_weight >= 0 and self.feature_weight + self.ce_weight > 0,
             "feature_weight and ce_weight must be >= 0, not both 0"),
            (self.epochs > 0 and self.batch_size > 0 and self.grad_accum > 0, "epochs, batch_size, grad_accum must be > 0"),
            (self.lr > 0 and 0 <= self.warmup_ratio < 1, "lr must be > 0 and warmup_ratio in [0, 1)"),
            (self.prompt_tail >= 0 and self.max_len >= 2, "prompt_tail must be >= 0 and max_len >= 2"),
            (self.eval_every > 0 and self.log_every > 0 and self.save_every >= 0, "eval_every, log_every must be > 0"),
            (self.noise >= 0, "noise must be >= 0"),
            (self.rollout in (1, 2), "rollout must be 1 (EAGLE's loss) or 2 (also the second drafted step)"),
            (self.intermediate_size >= 0, "intermediate_size must be >= 0 (0 = the target's MLP width)"),
        ]
        from ..prompts import EVAL_SETS

        checks += [(n > 0, f"references: {name} must ask for n > 0 answers") for name, n in self.references.items()]
        checks += [(name not in EVAL_SETS, f"references: {name} holds the benchmarks' prompts; use a training set "
                    "(sharegpt, sharegpt-code, gsm8k-train) or a local file") for name in self.references]
        try:
            check_draft_vocab_spec(self.ce_vocab)
        except ValueError as e:
            raise UserError(f"invalid drafter training config: ce_vocab: {e} (or full)") from None
        for ok, msg in checks:
            if not ok:
                raise UserError(f"invalid drafter training config: {msg}")


# ----------------------------------------------------------------------------- the loss

def collate(seqs: list[dict]):
    """Sequences -> (states [B, T, H], ids [B, T], valid [B, T]), right-padded (causal attention never reads
    the padding of a row's own past)."""
    T = max(len(s["ids"]) for s in seqs)
    H = seqs[0]["hidden"].shape[-1]
    feats = torch.zeros(len(seqs), T, H, dtype=seqs[0]["hidden"].dtype)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    valid = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, s in enumerate(seqs):
        n = len(s["ids"])
        feats[b, :n], ids[b, :n], valid[b, :n] = s["hidden"], s["ids"], True
    return feats, ids, valid


def drafter_loss(drafter, readout, feats, ids, valid, cfg: DrafterConfig, noise: float = 0.0,
                 steps: int | None = None, scores: bool = True):
    """(loss, parts) over every slot t: input (f_t, x_{t+1}), target f_{t+1} and the target's distribution of
    x_{t+2}; parts: feature, ce, top1 (argmax q == argmax p: greedy acceptance), accept (sum min(p, q): the
    expected acceptance at T = 1).

    `steps` (default cfg.rollout) drafted steps are trained, as decoding drafts them: a draft's second token is
    read from the drafter's own f^_{t+1} in place of the target's f_{t+1}, which decoding does not have yet.
    Step 2 runs the layer again on the inputs (f_0, f^_1, ..., f^_{T-2}) (step 1's outputs, detached) with the
    same tokens and targets; its parts carry the suffix _2. Step 2 reads f^ at every earlier slot where
    decoding reads the target's own f there: a harder task than decoding's, never an easier one.
    scores=False leaves top1 and accept out (two passes over every position's full-vocabulary rows, a
    fifth of a training step: the loop scores only the steps it logs)."""
    dev = next(drafter.parameters()).device  # `drafter` may be accelerate's wrapper: called, never unwrapped
    feats, ids, valid = feats.to(dev), ids.to(dev), valid.to(dev)
    steps = cfg.rollout if steps is None else steps
    f_in = feats[:, :-1].float()
    B, T1 = f_in.shape[:2]
    pos = torch.arange(T1, device=dev).expand(B, T1)
    emb = readout.embed(ids[:, 1:])
    m = valid[:, 1:]
    tgt = feats[:, 1:].float()[m]
    # a reduced CE vocabulary (EAGLE-3's): both distributions over the kept ids alone, the target's renormalized
    # there, so a step reads V' rows of the LM head instead of V; the scores still compare with the full p
    reduced = readout.kept_ids is not None
    head = readout.kept_logits if reduced else readout.logits
    with torch.no_grad():
        p = head(tgt).softmax(-1)
        p_full = readout.full_logits(tgt).softmax(-1) if reduced and scores else p
    loss, parts = 0.0, {}
    for j in range(steps):
        x = f_in + (torch.rand_like(f_in) * 2 - 1) * noise if noise else f_in
        fhat_all = readout.feature(drafter(x, emb, pos))
        fhat = fhat_all[m].float()
        feat = F.smooth_l1_loss(fhat, tgt, reduction="none").mean(-1)
        logq = head(fhat).log_softmax(-1)
        ce = -(p * logq).sum(-1)
        step_loss = cfg.feature_weight * feat.mean() + cfg.ce_weight * ce.mean()
        loss = loss + step_loss / steps
        with torch.no_grad():
            sfx = "" if j == 0 else f"_{j + 1}"
            parts.update({"loss" + sfx: step_loss.item(), "feature" + sfx: feat.mean().item(),
                          "ce" + sfx: ce.mean().item()})
            if scores:
                guess = readout.kept_ids[logq.argmax(-1)] if reduced else logq.argmax(-1)
                p_kept = p_full[:, readout.kept_ids] if reduced else p_full
                parts.update({"top1" + sfx: (guess == p_full.argmax(-1)).float().mean().item(),
                              "accept" + sfx: torch.minimum(p_kept, logq.exp()).sum(-1).mean().item()})
        if j + 1 < steps:  # the next step's inputs: slot t + 1 reads this step's f^_{t+1} (slot t's output)
            f_in = torch.cat([f_in[:, :1], fhat_all[:, :-1].detach().float()], 1)
    return loss, parts


# ----------------------------------------------------------------------------- data and models

def build_states(cfg: DrafterConfig) -> Path:
    """The target's states along the config's sequences (drafter/data.py), computed where missing; those
    along reference answers go to <states>/references."""
    from ..backends.models import load_model
    from ..backends.runner import model_fingerprint
    from ..drafter import data

    out = states_folder(cfg)

    @functools.cache  # loaded only where states are missing, once for both folders
    def load():
        model, tok = load_model(cfg.target, "target", cfg.target_dtype, "cpu" if not torch.cuda.is_available()
                                else None, pack=True, fp16=False)
        return model, tok, {"name": cfg.target, "hidden_size": model.config.hidden_size,
                            "fingerprint": model_fingerprint(model)}

    settings = {"target": cfg.target, "target_dtype": cfg.target_dtype}
    target = lambda: (load()[0], load()[2])  # noqa: E731 (data.py's load_target)
    data.build(cfg.data, out, target, settings,
               {"train": cfg.max_train_seqs, "dev": cfg.max_dev_seqs}, cfg.prompt_tail, cfg.max_len)
    if cfg.references:
        data.build_references(cfg.data, out / "references", target, lambda: load()[1], settings,
                              cfg.references, cfg.prompt_tail, cfg.max_len)
    return out


def states_folder(cfg: DrafterConfig) -> Path:
    return Path(cfg.states_dir or Path(cfg.output_dir) / "states")


def load_readout(cfg: DrafterConfig, device):
    """(the target's readout, a new drafter for it, the target's fingerprint); the target's layers are
    dropped once the drafter has copied the last one: only the embedding, final norm and LM head stay."""
    from ..backends.models import load_model
    from ..backends.runner import model_fingerprint
    from ..backends.vocab import resolve_draft_vocab
    from ..drafter.model import FeatureDrafter, Readout

    model, tok = load_model(cfg.target, "target", cfg.target_dtype, device, pack=False)
    fp = model_fingerprint(model)
    if cfg.init_from:
        drafter = FeatureDrafter.from_pretrained(cfg.init_from, hidden_size=model.config.hidden_size).float()
        if drafter.target_fingerprint not in (None, fp):
            raise UserError(f"init_from: {cfg.init_from} was trained on another target's weights (fingerprint "
                            f"{drafter.target_fingerprint}, this target's {fp}); start from a drafter of this target "
                            "or set init_from: \"\"")
    else:
        drafter = FeatureDrafter.for_target(model, cfg.init_from_target, name=cfg.target, fingerprint=fp,
                                            intermediate_size=cfg.intermediate_size).float()
    model.base_model.layers = torch.nn.ModuleList()
    kept = resolve_draft_vocab(cfg.ce_vocab, tok, model.get_output_embeddings().out_features)
    return Readout(model, kept_ids=kept), drafter, fp


# ----------------------------------------------------------------------------- the run

def train_drafter(cfg: DrafterConfig, resume: bool = False) -> dict:
    """One drafter run; returns results (also in <output_dir>/results.json)."""
    from accelerate.utils import set_seed  # optional: the [train] extra

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    done = finished_results(cfg, resume, RUNTIME_KEYS)
    if done is not None:
        return done
    acc = make_accelerator(cfg)
    files = RunFiles(Path(cfg.output_dir), acc.is_main_process)
    if acc.is_main_process:
        build_states(cfg)
    acc.wait_for_everyone()
    train_set, dev_set, n_refs = _load_sets(cfg)
    set_seed(cfg.seed)
    readout, drafter, fp = load_readout(cfg, acc.device)
    sampler = EpochShuffle(len(train_set), cfg.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=micro_batch(cfg, acc.num_processes), sampler=sampler,
                                         collate_fn=collate)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    model, opt, loader = acc.prepare(drafter, opt, loader)
    sched, per_epoch, total = make_scheduler(acc, opt, loader, cfg)
    meta = {"dataset": cfg.data, "target_fingerprint": fp, "n_train_seqs": len(train_set),
            "n_reference_seqs": n_refs, "epochs": cfg.epochs,
            "lr": cfg.lr, "feature_weight": cfg.feature_weight, "ce_weight": cfg.ce_weight, "ce_vocab": cfg.ce_vocab,
            "rollout": cfg.rollout, **({"init_from": cfg.init_from} if cfg.init_from else {})}
    run = DrafterRun(cfg, acc, files, model, opt, sched, loader, sampler, per_epoch, total, "drafter", meta, readout,
                     dev_set or train_set[: max(1, len(train_set) // 8)])
    return train_loop(run, resume)


def _load_sets(cfg: DrafterConfig) -> tuple[list[dict], list[dict], int]:
    """(training sequences, the reference answers' last; dev sequences; how many are references)."""
    from ..drafter import data

    states = states_folder(cfg)
    refs = data.load_split(states / "references", "train") if cfg.references else []
    return data.load_split(states, "train") + refs, data.load_split(states, "dev"), len(refs)


@torch.no_grad()
def evaluate(drafter, readout, seqs: list[dict], cfg: DrafterConfig, batch: int = 4) -> dict:
    """Mean loss and its parts over `seqs`, weighted by their slots: both drafted steps' parts (the second
    with the suffix _2) whatever the run trains, and the loss of the steps it trains."""
    drafter.eval()
    tot, n = {}, 0
    for i in range(0, len(seqs), batch):
        feats, ids, valid = collate(seqs[i:i + batch])
        _, parts = drafter_loss(drafter, readout, feats, ids, valid, cfg, steps=2)
        parts["loss"] = sum(parts[k] for k in ("loss", "loss_2")[:cfg.rollout]) / cfg.rollout  # the run's loss
        w = int(valid[:, 1:].sum())
        for k, v in parts.items():
            tot[k] = tot.get(k, 0.0) + v * w
        n += w
    drafter.train()
    return {k: v / max(n, 1) for k, v in tot.items()}


@dataclass
class DrafterRun(Run):
    """A drafter's run: EAGLE's loss, the last micro-batch's loss and parts logged, evaluated on `dev`."""
    readout: Any
    dev: list[dict]               # the dev sequences (without a dev split: an eighth of the training ones)
    last: tuple = ()              # the last micro-batch's (loss, parts): drafter_loss's
    what = "drafter"

    def micro_step(self, batch):
        cfg, step = self.cfg, self.state["step"] + 1
        with self.acc.autocast():  # the readout's logits too, not only the prepared drafter's forward
            # top1 and accept are scored only where this step is logged
            self.last = drafter_loss(self.model, self.readout, *batch, cfg, cfg.noise,
                                     scores=step % cfg.log_every == 0 or step == self.total)
            optimizer_step(self.acc, self.model, self.optimizer, self.last[0], cfg)

    def train_row(self, step: int, lr: float) -> tuple[dict, dict]:
        loss, parts = self.last[0].item(), self.last[1]
        row = {"step": step, "lr": lr, "loss": loss, **{f"train_{k}": v for k, v in parts.items()}}
        return row, {"loss": f"{loss:.4f}", "top1": f"{parts['top1']:.3f}"}

    def eval_and_export(self, step: int, bar=None) -> dict:
        drafter = self.acc.unwrap_model(self.model)
        row = {"step": step, **{f"dev_{k}": v for k, v in evaluate(drafter, self.readout, self.dev, self.cfg).items()}}
        if log_eval(self.acc, self.files, self.state, row, row["dev_loss"]):
            self.files.export("drafter", lambda tmp: drafter.save_pretrained(
                tmp, extra={**self.meta, "step": step, "metrics": row}, dtype=torch.bfloat16))
        return row
