"""Training acceptance heads with Accelerate (SpecDec++ paper, section 4.4 and appendix D.1/D.3).

    accelerate launch train.py --config configs/train/default.yaml [key=value ...] [--resume]
    python train.py --config configs/train/sweep.yaml --sweep      # the D x w_rej grid, resumable

Data is the datagen folder (manifest.json + safetensors shards). One training example is one
response position whose token came from the draft (loss_mask == 1): input = the draft's final
hidden state there (with `inputs=hidden+stats` also the draft's own statistics of the token,
stored by datagen as draft_stats; `feature=context` reads the state before it: see
adaptive_spec/heads/features.py), target = min(1, p/q) (or the expected acceptance). Features stored in
the shards are memory-mapped, not copied, so several DDP processes share one copy in the page
cache; datasets without features get them from one pass of the frozen draft, cached on disk.

The loss is the paper's weighted BCE; every `eval_every` steps we report it with the
unweighted binary KL of Table 3, AUC (accepted vs rejected tokens) and calibration (ECE + a
reliability plot). The head with the lowest dev loss is exported with save_pretrained to
<output_dir>/head. Checkpoints hold everything that changes during training, so --resume
reproduces an uninterrupted run exactly.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import struct
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..config import config_help, config_to_dict, load_config
from ..errors import UserError, get_logger
from ..heads.features import CONTEXT_KEY, N_STATS, position_map, state_key
from ..heads.head import FEATURES, INPUTS, MAX_DEPTH, AcceptanceHead, join_inputs, reads_stats
from ..runs import append_jsonl, atomic_write, check_settings, read_jsonl
from ..runs import read_manifest as read_manifest_json
from ..runs import write_json
from ..tables import md_table

log = get_logger(__name__)

DATA_FORMAT = "adaptive_spec.datagen.v1"
STOP_EXIT_CODE = 3  # stop_after_steps exits with this, as a killed job would: no cleanup, no results
TARGETS = ("accept_prob", "expected_accept")
SWEEP_DEPTHS = [0, 1, 2, 3, 4]  # paper section 5.1
SWEEP_W_REJS = [1.0, 3.0, 6.0, 12.0]
# Keys that may change between a run and its --resume without changing what it computes.
RUNTIME_KEYS = {"stop_after_steps", "report_to", "wandb_project", "run_name", "keep_checkpoints",
                "draft", "feature_cache", "depths", "w_rejs", "eval_batch_size"}


@dataclass
class TrainConfig:
    data: str                          # dataset folder written by datagen (manifest.json + shards)
    output_dir: str = "runs/head"      # run folder: log.jsonl, checkpoints/, head/, results.json
    target: str = "accept_prob"        # accept_prob = min(1, p/q) of the sampled token | expected_accept
    depth: int = 3                     # D residual blocks (0 = linear head); paper picks 3 or 4
    feature: str = "token"             # token: e at Y_i's position (paper, one-step lag) | context: e that produced q_i (heads/head.py)
    inputs: str = "hidden"             # hidden (paper) | hidden+stats: also log q(y), H(q), top-1 - top-2 of the draft (features.py) | stats: those alone (feature=context)
    w_rej: float = 6.0                 # weight of the rejection term (paper's best: 6, with h = 0.7)
    w_acc: float = 1.0
    epochs: int = 3
    batch_size: int = 32               # positions per optimizer step, summed over processes and accumulation
    grad_accum: int = 1                # gradient accumulation steps
    lr: float = 5e-5
    warmup_ratio: float = 0.03         # linear warm-up over this share of the steps, then cosine decay
    min_lr_ratio: float = 0.0          # cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0         # 0 = no clipping
    init_bias: bool = True             # start at the best constant predictor (output bias set, output weights 0)
    seed: int = 0
    mixed_precision: str = "auto"      # auto | no | bf16 | fp16; auto = bf16 on a GPU, no on CPU
    max_train_positions: int = 0       # 0 = all; else a fixed random subset (quick runs)
    max_dev_positions: int = 0         # 0 = all
    eval_train_positions: int = 100_000  # train metrics are measured on a fixed subset of this size
    eval_every: int = 1000             # steps; also evaluated at step 0 and at the end
    eval_batch_size: int = 8192
    ece_bins: int = 10
    log_every: int = 10                # steps between train-loss log rows
    save_every: int = 1000             # steps between checkpoints (0 = none)
    keep_checkpoints: int = 2
    stop_after_steps: int = 0          # testing: exit abruptly after this step, as if killed
    report_to: str = "wandb"           # wandb | none (wandb is offline unless configured)
    wandb_project: str = "adaptive_spec"
    run_name: str = ""
    draft: str = ""                    # draft model for datasets without features ("" = manifest's)
    draft_dtype: str = "auto"          # for that draft pass: auto = bf16 on a GPU, fp32 on CPU
    feature_cache: str = ""            # where draft features are cached ("" = <output_dir>/features)
    partial_data: bool = False         # train on the shards written so far of a dataset datagen is still growing
    depths: list[int] = field(default_factory=list)   # --sweep grid ([] = 0..4)
    w_rejs: list[float] = field(default_factory=list)  # --sweep grid ([] = 1, 3, 6, 12)

    def validate(self):
        checks = [
            (self.target in TARGETS, f"target must be one of {', '.join(TARGETS)}"),
            (self.feature in FEATURES, f"feature must be one of {', '.join(FEATURES)}"),
            (self.inputs in INPUTS, f"inputs must be one of {', '.join(INPUTS)}"),
            (self.inputs != "stats" or self.feature == "context",
             "inputs=stats reads no hidden state: set feature=context (it scores each candidate with no lag)"),
            (self.ece_bins >= 2, "ece_bins must be >= 2 (10 to 15 is usual)"),
            (self.mixed_precision in ("auto", "no", "bf16", "fp16"), "mixed_precision must be auto, no, bf16 or fp16"),
            (self.report_to in ("wandb", "none"), "report_to must be wandb or none"),
            (all(0 <= d <= MAX_DEPTH for d in [self.depth, *self.depths]), f"depths must be in 0..{MAX_DEPTH}"),
            (self.w_rej > 0 and self.w_acc > 0 and all(w > 0 for w in self.w_rejs), "loss weights must be > 0"),
            (self.epochs > 0 and self.batch_size > 0 and self.grad_accum > 0, "epochs, batch_size, grad_accum must be > 0"),
            (self.lr > 0 and 0 <= self.warmup_ratio < 1, "lr must be > 0 and warmup_ratio in [0, 1)"),
            (self.eval_every > 0 and self.log_every > 0 and self.eval_batch_size > 0, "eval_every, log_every, eval_batch_size must be > 0"),
            (self.save_every >= 0 and self.keep_checkpoints >= 1, "save_every must be >= 0 and keep_checkpoints >= 1"),
            (bool(self.data), "data must name a dataset folder written by datagen"),
        ]
        for ok, msg in checks:
            if not ok:
                raise UserError(f"invalid training config: {msg}")


# ----------------------------------------------------------------------------- loss and metrics

def weighted_bce(logits: torch.Tensor, target: torch.Tensor, w_acc: float = 1.0, w_rej: float = 1.0) -> torch.Tensor:
    """Mean of -w_acc P log p - w_rej (1-P) log(1-p), p = sigmoid(logits); from logits for stability."""
    logits, target = logits.float(), target.float()
    return -(w_acc * target * F.logsigmoid(logits) + w_rej * (1 - target) * F.logsigmoid(-logits)).mean()


def binary_kl(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(P || p) = P log(P/p) + (1-P) log((1-P)/(1-p)) (paper D.3), in float64.

    P is clamped to [0, 1] and 0 log 0 = 0 (xlogy); log p comes from logsigmoid, so p = 0 or 1
    in float32 costs a large but finite value instead of inf.
    """
    p, z = target.double().clamp(0, 1), logits.double()
    return torch.xlogy(p, p) - p * F.logsigmoid(z) + torch.xlogy(1 - p, 1 - p) - (1 - p) * F.logsigmoid(-z)


def calibration_bins(pred: torch.Tensor, target: torch.Tensor, n_bins: int) -> torch.Tensor:
    """[3, n_bins] float64: count, sum of predictions, sum of targets per equal-width bin of pred."""
    pred, target = pred.double().flatten(), target.double().flatten()
    b = (pred * n_bins).long().clamp(0, n_bins - 1)
    out = torch.zeros(3, n_bins, dtype=torch.float64, device=pred.device)
    out[0].index_add_(0, b, torch.ones_like(pred))
    out[1].index_add_(0, b, pred)
    out[2].index_add_(0, b, target)
    return out


def ece(bins: torch.Tensor) -> float:
    """Expected calibration error: sum over bins of n_b/N |mean pred_b - mean P_b|.

    Bins are `ece_bins` (default 10) equal-width intervals of the predicted acceptance p_hat in
    [0, 1] (p_hat = 1 goes to the last); n_b positions fall in bin b, N in all. The targets are
    probabilities, so calibration compares the mean predicted acceptance with the mean true
    acceptance probability P = min(1, p/q) in each bin. 0 = calibrated; a constant predictor at
    the mean target also scores 0, so read it beside KL and AUC.
    """
    n = bins[0].sum().item()
    return (bins[1] - bins[2]).abs().sum().item() / n if n else float("nan")


ACCEPTED = 0.99  # AUC's line between accepted and rejected tokens (see auc)


def auc(score: torch.Tensor, target: torch.Tensor) -> float:
    """P(score of a token with P >= 0.99 > score of one with P < 0.99), ties counted half: scikit-learn's
    ROC AUC with the accepted tokens as positives.

    Not P = 1 exactly: where p and q nearly coincide, p/q lands a hair below 1 in floating point,
    and such a token is as good as accepted. NaN when either class is empty."""
    from sklearn.metrics import roc_auc_score

    pos = (target.flatten() >= ACCEPTED).cpu().numpy()
    if pos.all() or not pos.any():
        return float("nan")
    return float(roc_auc_score(pos, score.detach().double().flatten().cpu().numpy()))


def prediction_metrics(logits: torch.Tensor, target: torch.Tensor, w_acc: float = 1.0, w_rej: float = 1.0,
                       n_bins: int = 10) -> tuple[dict, torch.Tensor]:
    """({loss, kl, auc, ece, mean_target, mean_pred, n}, calibration bins) of acceptance logits
    against targets P: the numbers training logs and the ablation reports, from one place."""
    z, y = logits.double().flatten(), target.double().flatten()
    pred = torch.sigmoid(z)
    bins = calibration_bins(pred, y, n_bins)
    n = len(y)
    if not n:
        return {"n": 0}, bins
    return {"loss": weighted_bce(z, y, w_acc, w_rej).item(), "kl": binary_kl(y, z).mean().item(), "auc": auc(z, y),
            "ece": ece(bins), "mean_target": y.mean().item(), "mean_pred": pred.mean().item(), "n": n}, bins


def plot_reliability(curves: dict[str, torch.Tensor], path: Path, title: str = ""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axh) = plt.subplots(2, 1, figsize=(5, 6), gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect")
    n_bins = next(iter(curves.values())).shape[1]
    centers = (np.arange(n_bins) + 0.5) / n_bins
    for name, bins in curves.items():
        cnt, sp, st = bins.cpu().numpy()
        ok = cnt > 0
        ax.plot(sp[ok] / cnt[ok], st[ok] / cnt[ok], "o-", label=f"{name} (ECE {ece(bins):.3f})")
        axh.bar(centers, cnt / max(cnt.sum(), 1), width=1 / n_bins, alpha=0.5, label=name)
    ax.set_ylabel("mean target acceptance prob")
    ax.set_title(title)
    ax.legend(loc="upper left")
    axh.set_xlabel("predicted acceptance prob")
    axh.set_ylabel("share")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- data

def read_manifest(root: str | Path, partial: bool = False) -> dict:
    """A complete datagen manifest with the fields training reads, or a UserError saying what to do.

    partial=True accepts a dataset whose datagen run has not finished: the manifest lists only the
    shards written (atomically) so far, so training reads a consistent prefix of the run. A head
    trained on it records that in its metadata ("partial_data")."""
    root = Path(root)
    f = root / "manifest.json"
    m = read_manifest_json(root, hint="point data= at a folder written by datagen, or regenerate the dataset")
    if m.get("format") != DATA_FORMAT:
        raise UserError(f"{f} has format {m.get('format')!r}, expected {DATA_FORMAT!r}; regenerate the dataset")
    if not m.get("complete") and not partial:
        raise UserError(f"dataset {root} is incomplete (datagen was interrupted or is still running); rerun the "
                        "same `adaptive-spec datagen` command to finish it, or set partial_data=true to train on "
                        "the shards written so far")
    try:
        d = m["models"]["draft"]
        int(d["hidden_size"])
        m["splits"]["train"]["shards"]
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{f} lacks {e} (models.draft.hidden_size / splits.train.shards); regenerate the dataset") from None
    return m


def dataset_sources(manifest: dict) -> list[str]:
    """The prompt sources of a datagen mix (manifest "sources"; shard tensor source_ids indexes
    them per sequence); [] for a dataset of one source, where a per-source split adds nothing."""
    names = [str(s.get("name")) for s in manifest.get("sources") or [] if isinstance(s, dict)]
    return names if len(names) > 1 else []


# bfloat16 has no numpy dtype: map its bytes as uint16 and reinterpret them in torch.
_ST_DTYPES = {"BF16": (np.uint16, torch.bfloat16), "F16": (np.float16, torch.float16), "F32": (np.float32, torch.float32)}


def mmap_tensor(path: Path, name: str) -> torch.Tensor:
    """A tensor of a safetensors file backed by a copy-on-write memory map (nothing read up front)."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            info = json.loads(f.read(n))[name]
        np_dtype, dtype = _ST_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        arr = np.memmap(path, dtype=np_dtype, mode="c", offset=8 + n + begin, shape=shape)
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise UserError(f"shard {path} is corrupt or lacks '{name}' ({type(e).__name__}: {e}); regenerate the dataset") from None
    return torch.from_numpy(arr).view(dtype)


def read_small(path: Path, names: list[str], optional: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The shard's tensors `names` (a UserError if one is missing) and those of `optional` it has."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise UserError(f"dataset shard {path} is missing; regenerate the dataset or restore the file")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            out = {k: f.get_tensor(k) for k in [*names, *optional] if k in keys}
            out["_has_features"] = torch.tensor("features" in keys)
            out["_clean"] = torch.tensor(CONTEXT_KEY in keys)  # target-prefix states (features.PREFIXES)
    except (SafetensorError, OSError) as e:
        raise UserError(f"dataset shard {path} is corrupt ({e}); regenerate the dataset") from None
    missing = [k for k in names if k not in out]
    if missing:
        raise UserError(f"dataset shard {path} lacks {', '.join(missing)}; regenerate the dataset")
    return out


class PositionSet(torch.utils.data.Dataset):
    """Training positions: features of row `row[i]` of shard `shard[i]`, target `target[i]`, and
    with `stats` ([N, 3], inputs=hidden+stats) the draft stats of position i after them.

    Defines __getitems__, so a DataLoader fetches a whole batch with one gather per shard
    instead of one Python call per position.
    """

    def __init__(self, feats: list[torch.Tensor], shard: torch.Tensor, row: torch.Tensor, target: torch.Tensor,
                 stats: torch.Tensor | None = None):
        self.feats, self.shard, self.row, self.target, self.stats = feats, shard, row, target, stats

    def __len__(self):
        return len(self.target)

    @property
    def hidden_size(self) -> int:
        return self.feats[0].shape[1]

    def gather(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shard, row = self.shard[idx], self.row[idx]
        x = torch.empty(len(idx), self.hidden_size, dtype=self.feats[0].dtype)
        for s in shard.unique().tolist():
            m = shard == s
            x[m] = self.feats[s][row[m]]
        return (x if self.stats is None else join_inputs(x, self.stats[idx])), self.target[idx]

    def __getitems__(self, idx: list[int]):
        return self.gather(torch.as_tensor(idx, dtype=torch.long))

    def __getitem__(self, i: int):
        x, y = self.gather(torch.tensor([i]))
        return x[0], y[0]

    def subset(self, n: int, seed: int) -> "PositionSet":
        """A fixed random subset of n positions (kept in file order, for locality)."""
        if not n or n >= len(self):
            return self
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(len(self), generator=g)[:n].sort().values
        stats = None if self.stats is None else self.stats[idx]
        return PositionSet(self.feats, self.shard[idx], self.row[idx], self.target[idx], stats)

    def chunks(self, size: int):
        for start in range(0, len(self), size):
            yield self.gather(torch.arange(start, min(start + size, len(self))))


def _batch_as_is(batch):
    return batch  # __getitems__ already returns the collated (x, y)


def load_split(cfg: TrainConfig, manifest: dict, split: str, accelerator) -> PositionSet | None:
    """The split's loss positions; None if the dataset has no such split or it is empty."""
    info = (manifest.get("splits") or {}).get(split) or {}
    shards = info.get("shards") or []
    if not shards:
        return None
    root = Path(cfg.data)
    H = int(manifest["models"]["draft"]["hidden_size"])
    stats_wanted = reads_stats(cfg.inputs)
    smalls = [read_small(root / s["file"], ["loss_mask", "resp_offsets", cfg.target],
                         optional=("draft_stats",) if stats_wanted else ()) for s in shards]
    has_features = all(bool(s["_has_features"]) for s in smalls)
    clean = {bool(s["_clean"]) for s in smalls}
    if len(clean) > 1:
        raise UserError(f"{root} mixes shards with states on the target prefix and on the mixed one; derive the "
                        "folder again with one `adaptive-spec datagen-features --prefix ...`")
    clean = clean.pop()
    no_hidden = cfg.inputs == "stats"  # a stats head reads no state: the token data alone trains it
    if cfg.feature == "context" and not has_features and not no_hidden:
        raise UserError(f"feature=context needs stored draft features, and {root} has none; regenerate it "
                        "with store_features=true (or train feature=token)")
    no_stats = [s["file"] for s, small in zip(shards, smalls) if stats_wanted and "draft_stats" not in small]
    if no_stats:
        raise UserError(f"inputs={cfg.inputs} needs the draft statistics (shard tensor draft_stats) that the current "
                        f"datagen stores, and {root / no_stats[0]} has none; regenerate the dataset with the current "
                        "`adaptive-spec datagen` (or train inputs=hidden)")
    targets, shard_ids, rows, feats, stats = [], [], [], [], []
    for i, (s, small) in enumerate(zip(shards, smalls)):
        mask = small["loss_mask"].bool()
        for key in (cfg.target, "draft_stats") if stats_wanted else (cfg.target,):
            if small[key].shape[0] != len(mask):
                raise UserError(f"{root / s['file']}: {key} and loss_mask differ in length; regenerate the dataset")
        used, state_row = position_map(cfg.feature, mask, small["resp_offsets"], clean)
        pos = used.nonzero().flatten()
        targets.append(small[cfg.target].float()[pos])
        shard_ids.append(torch.full_like(pos, i, dtype=torch.int32))
        rows.append(state_row[pos])
        if stats_wanted:
            stats.append(small["draft_stats"].float()[pos])
        if has_features and not no_hidden:
            key = state_key(cfg.feature, clean)
            f = mmap_tensor(root / s["file"], key)
            if f.ndim != 2 or f.shape[0] != len(mask) or f.shape[1] != H:
                raise UserError(f"{key} in {root / s['file']} have shape {tuple(f.shape)}, expected "
                                f"[{len(mask)}, {H}] (manifest hidden_size); regenerate the dataset")
            feats.append(f)
    target = torch.cat(targets)
    if not torch.isfinite(target).all():
        raise UserError(f"{split} targets ({cfg.target}) in {root} contain NaN/inf; regenerate the dataset")
    if len(target) == 0:
        return None
    stats = torch.cat(stats) if stats_wanted else None
    if stats is not None and (stats.ndim != 2 or stats.shape[1] != N_STATS or not torch.isfinite(stats).all()):
        raise UserError(f"{split} draft_stats in {root} are not [T, {N_STATS}] finite values; regenerate the dataset")
    if no_hidden:  # rows keep their layout [hidden, stats]; the head ignores the hidden part
        return PositionSet([torch.zeros(1, H)], torch.zeros(len(target), dtype=torch.int32),
                           torch.zeros(len(target), dtype=torch.long), target.clamp(0, 1), stats)
    if has_features:
        return PositionSet(feats, torch.cat(shard_ids), torch.cat(rows), target.clamp(0, 1), stats)
    f = draft_features(cfg, manifest, split, [root / s["file"] for s in shards], accelerator)
    return PositionSet([f], torch.zeros(len(f), dtype=torch.int32), torch.arange(len(f)), target.clamp(0, 1), stats)


def draft_features(cfg: TrainConfig, manifest: dict, split: str, files: list[Path], accelerator) -> torch.Tensor:
    """Draft final hidden states at the loss positions of a split without stored features.

    Computed once by the main process with the frozen draft and cached as safetensors (keyed
    by the dataset's config hash), so resumes, later runs and every head of a sweep reuse it.
    """
    from safetensors.torch import save_file

    cache = Path(cfg.feature_cache or Path(cfg.output_dir) / "features") / f"{split}.safetensors"
    key = {"config_hash": str(manifest.get("config_hash")), "draft": cfg.draft or manifest["models"]["draft"]["name"]}

    def cached() -> torch.Tensor | None:
        if not cache.is_file():
            return None
        from safetensors import safe_open

        with safe_open(str(cache), framework="pt") as f:
            if {k: (f.metadata() or {}).get(k) for k in key} != key:
                return None
        return mmap_tensor(cache, "features")  # mapped like stored features: shared by DDP processes

    if accelerator.is_main_process and cached() is None:
        from ..datagen.features import load_draft, response_features

        dtype = cfg.draft_dtype if cfg.draft_dtype != "auto" else ("bf16" if accelerator.device.type == "cuda" else "fp32")
        # the draft configuration the data was made with (int8 weights give other hidden states)
        man = {**manifest, "config": {**manifest["config"], "draft": key["draft"]}}
        if cfg.draft and cfg.draft != manifest["config"].get("draft"):  # another copy of the draft: its own weights
            man["models"] = {**manifest["models"], "draft": {**manifest["models"]["draft"], "fingerprint": None}}
        model = load_draft(man, dtype, accelerator.device)
        out = []
        for f in files:
            t = read_small(f, ["input_ids", "input_offsets", "prompt_lens", "resp_offsets", "loss_mask"])
            out.append(response_features(model, t)[t["loss_mask"].bool()])
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        save_file({"features": torch.cat(out).contiguous()}, str(tmp), metadata=key)
        os.replace(tmp, cache)
        del model
    accelerator.wait_for_everyone()
    return cached()


class EpochShuffle(torch.utils.data.Sampler):
    """A permutation that depends only on (seed, epoch), so a resumed run sees the same order."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())


# ----------------------------------------------------------------------------- run folder

CKPT_STATE = "trainer_state.json"  # written last into a checkpoint: a folder without it is incomplete


class RunFiles:
    """log.jsonl, checkpoints/checkpoint_N, head/ and results.json of one run (written by the main process).

    Checkpoints are accelerate's (ProjectConfiguration automatic naming: checkpoint_0, _1, ...,
    the oldest deleted past keep_checkpoints); each holds trainer_state.json with its step.
    """

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

    def export_head(self, head: AcceptanceHead, extra: dict, curves: dict):
        """Write the head to head/ via a tmp folder, so head/ is always a complete export."""
        if not self.main:
            return
        tmp, final, old = self.out / "head.tmp", self.out / "head", self.out / "head.old"
        shutil.rmtree(tmp, ignore_errors=True)
        head.save_pretrained(tmp, extra=extra)  # config.json, model.safetensors, README.md (model card)
        write_json(tmp / "metrics.json", extra["metrics"])
        plot_reliability(curves, tmp / "reliability.png", f"D={head.depth} w_rej={extra['w_rej']:g} step {extra['step']}")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- accelerator

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
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

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


# ----------------------------------------------------------------------------- evaluation

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


# ----------------------------------------------------------------------------- one run

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
    state: dict = field(default_factory=lambda: {"step": 0, "best_loss": None, "best_step": None})
    loss_sum: Any = 0.0           # train loss summed since the last log row
    n_micro: int = 0


def train(cfg: TrainConfig, resume: bool = False, end_training: bool = True) -> dict:
    """Train one head; returns results (also in <output_dir>/results.json).

    end_training=False leaves the process group up for the next head of a sweep."""
    files = RunFiles(Path(cfg.output_dir), False)
    check_output_dir(cfg, files, resume)  # a finished run is reused only under the same settings
    if resume and files.results_path.is_file():
        log.info(f"{files.out} already finished; results in {files.results_path}")
        return json.loads(files.results_path.read_text())
    manifest = read_manifest(cfg.data, partial=cfg.partial_data)
    acc = make_accelerator(cfg)
    run = setup_run(cfg, manifest, acc)
    restore_or_start(run, resume)
    start_trackers(run)
    train_loop(run)
    results = finish_run(run)
    acc.free_memory()
    if end_training:
        acc.end_training()  # stops the trackers and the process group
    else:
        for tracker in acc.trackers:
            tracker.finish()
    return results


def check_output_dir(cfg: TrainConfig, files: RunFiles, resume: bool):
    """Refuse, before any work, a new run over an old one or a resume with other settings."""
    if not resume and (files.has_run() or files.results_path.exists()):
        raise UserError(f"output_dir {files.out} already holds a run; pass --resume to continue it or choose "
                        "another output_dir")
    saved = files.out / "train_config.json"
    if resume and saved.is_file():
        # keys added since the run began (e.g. inputs) count as their defaults, which is what it ran with
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
        check_settings(files.out, {**defaults, **json.loads(saved.read_text())}, config_to_dict(cfg), kind="run",
                       ignore=RUNTIME_KEYS, fix="resume with the same config or choose another output_dir")


def load_data(cfg: TrainConfig, manifest: dict, acc) -> tuple[PositionSet, PositionSet, PositionSet | None]:
    """(train positions, the fixed train subset evaluated, dev positions or None)."""
    train_set = load_split(cfg, manifest, "train", acc)
    if train_set is None:
        raise UserError(f"dataset {cfg.data} has no training positions (split 'train' with loss_mask == 1)")
    train_set = train_set.subset(cfg.max_train_positions, cfg.seed)
    dev_set = load_split(cfg, manifest, "dev", acc)
    dev_set = dev_set.subset(cfg.max_dev_positions, cfg.seed + 1) if dev_set is not None else None
    return train_set, train_set.subset(cfg.eval_train_positions, cfg.seed + 2), dev_set


def stats_sampling(manifest: dict) -> dict:
    """How the datagen run processed q before taking its draft_stats (its temperature, top-k,
    top-p; datagen's defaults where the manifest predates them): the policy processes q the same way."""
    from ..datagen.generate import DatagenConfig

    cfg, default = manifest.get("config") or {}, DatagenConfig()
    return {k: cfg.get(k, getattr(default, k)) for k in ("temperature", "top_k", "top_p")}


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


def micro_batch(cfg: TrainConfig, num_processes: int) -> int:
    per_step = num_processes * cfg.grad_accum
    if cfg.batch_size % per_step:
        raise UserError(f"batch_size {cfg.batch_size} is not divisible by processes x grad_accum = {per_step}")
    return cfg.batch_size // per_step


def setup_run(cfg: TrainConfig, manifest: dict, acc) -> Run:
    """Data, head, optimizer, loaders and schedule, prepared by accelerate."""
    from accelerate.utils import set_seed

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
    steps_per_epoch = math.ceil(len(loader) / cfg.grad_accum)  # accelerate syncs at the end of each epoch
    total = steps_per_epoch * cfg.epochs
    # Stepped by us once per optimizer step (not prepared: accelerate would step it once per process).
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer.optimizer, lr_lambda(total, int(cfg.warmup_ratio * total), cfg.min_lr_ratio))
    acc.register_for_checkpointing(scheduler)
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


def restore_or_start(run: Run, resume: bool):
    """--resume: load the newest complete checkpoint; otherwise start the run folder afresh."""
    acc, files = run.acc, run.files
    if resume:
        files.drop_incomplete()
        acc.wait_for_everyone()
    ckpts = files.checkpoints() if resume else []
    if ckpts:
        n, path = ckpts[-1]
        acc.load_state(str(path))
        # load_state does not advance the automatic naming: the next save is checkpoint_{n+1}.
        acc.project_configuration.iteration = n + 1
        run.state = json.loads((path / CKPT_STATE).read_text())
        files.truncate_log(run.state["step"])
        acc.print(f"resuming {files.out} from {path} (step {run.state['step']}/{run.total})")
    elif acc.is_main_process:
        files.out.mkdir(parents=True, exist_ok=True)
        files.log_path.unlink(missing_ok=True)  # --resume without a checkpoint starts over
        write_json(files.out / "train_config.json", config_to_dict(run.cfg))
    acc.wait_for_everyone()


def start_trackers(run: Run):
    """wandb (offline unless configured), resumed under the same run id after a kill."""
    cfg, out = run.cfg, run.files.out
    if cfg.report_to != "wandb":
        return
    id_file = out / "wandb_id.txt"
    if run.acc.is_main_process and not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:12])
    run.acc.wait_for_everyone()
    run.acc.init_trackers(cfg.wandb_project, config=config_to_dict(cfg), init_kwargs={"wandb": {
        "name": cfg.run_name or out.name, "dir": str(out), "id": id_file.read_text().strip(), "resume": "allow"}})


def train_loop(run: Run):
    from tqdm.auto import tqdm

    cfg, acc = run.cfg, run.acc
    if run.state["step"] == 0:
        eval_and_export(run, 0)
    run.loss_sum = torch.zeros((), device=acc.device)
    run.model.train()
    # A context manager: on Ctrl-C the bar is closed before the "interrupted" line, not after it.
    with tqdm(total=run.total, initial=run.state["step"], disable=not acc.is_main_process,
              desc=f"head D={cfg.depth} w_rej={cfg.w_rej:g}") as pbar:
        for epoch in range(run.state["step"] // run.steps_per_epoch, cfg.epochs):
            for x, y in epoch_batches(run, epoch):
                train_step(run, x, y)
                if acc.sync_gradients:
                    after_step(run, pbar)


def epoch_batches(run: Run, epoch: int):
    """The epoch's micro-batches; a resumed epoch skips those done before the checkpoint."""
    skip = (run.state["step"] - epoch * run.steps_per_epoch) * run.cfg.grad_accum
    loader = run.acc.skip_first_batches(run.loader, skip) if skip > 0 else run.loader
    loader.set_epoch(epoch)  # accelerate re-sets the sampler's epoch from this when iterating
    run.sampler.set_epoch(epoch)
    return loader


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
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()
    run.state["step"] = step = run.state["step"] + 1
    pbar.update(1)
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
        save_checkpoint(run)
    if cfg.stop_after_steps and step == cfg.stop_after_steps:
        pbar.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(STOP_EXIT_CODE)  # no tracker/file cleanup: what a kill leaves behind


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
        run.files.export_head(head, {**run.meta, "step": step, "metrics": row}, curves)
    return row


def save_checkpoint(run: Run):
    """accelerate's save_state (it names checkpoint_N and deletes the oldest past total_limit),
    then trainer_state.json, written last: only a checkpoint that has it is resumed from."""
    acc = run.acc
    acc.save_state()
    acc.wait_for_everyone()
    if acc.is_main_process:
        folder = run.files.ckpt_root / f"checkpoint_{acc.project_configuration.iteration - 1}"
        write_json(folder / CKPT_STATE, run.state)
    acc.wait_for_everyone()


def finish_run(run: Run) -> dict:
    acc, files, cfg = run.acc, run.files, run.cfg
    if acc.is_main_process:
        best = json.loads((files.out / "head" / "metrics.json").read_text())
        write_json(files.results_path, {"depth": cfg.depth, "w_rej": cfg.w_rej, "best_step": run.state["best_step"],
                                        "total_steps": run.total, "best": best, "head": str(files.out / "head")})
    acc.wait_for_everyone()
    results = json.loads(files.results_path.read_text())
    acc.print(f"best head (step {results['best_step']}) in {files.out / 'head'}: " + json.dumps(results["best"]))
    return results


# ----------------------------------------------------------------------------- sweep

SWEEP_COLUMNS = ["depth", "w_rej", "best_step", "train_loss", "train_kl", "train_auc", "train_ece", "dev_loss", "dev_kl",
                 "dev_auc", "dev_ece"]


def sweep(cfg: TrainConfig) -> list[dict]:
    """Train every (depth, w_rej) head of the grid under <output_dir>/d{D}_wrej{w}; skip finished ones.

    Each head is its own run (its own Accelerator and checkpoints); the process group lives for
    the whole sweep and all heads share one feature cache. Writes sweep.csv and sweep.md
    (train/dev loss, KL, ECE: paper Table 3).
    """
    from accelerate import PartialState

    root = Path(cfg.output_dir)
    grid = [(d, w) for w in (cfg.w_rejs or SWEEP_W_REJS) for d in (cfg.depths or SWEEP_DEPTHS)]
    rows = []
    for d, w in grid:
        name = f"d{d}_wrej{w:g}"
        sub = dataclasses.replace(cfg, depth=d, w_rej=float(w), output_dir=str(root / name),
                                  feature_cache=cfg.feature_cache or str(root / "features"),
                                  run_name=f"{cfg.run_name or root.name}-{name}")
        PartialState().print(f"[sweep] head {name}")
        res = train(sub, resume=True, end_training=False)
        best = res.get("best") or {}
        rows.append({"depth": d, "w_rej": w, "best_step": res.get("best_step"),
                     **{k: best.get(k) for k in SWEEP_COLUMNS[3:]}})
    if PartialState().is_main_process:
        write_table(rows, root)
    PartialState().destroy_process_group()
    return rows


def write_table(rows: list[dict], root: Path):
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SWEEP_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    atomic_write(root / "sweep.md", md_table(SWEEP_COLUMNS, [[r[c] for c in SWEEP_COLUMNS] for r in rows]) + "\n")
    log.info(f"sweep table: {root / 'sweep.md'}, {root / 'sweep.csv'}")


# ----------------------------------------------------------------------------- CLI

def parser(prog: str = "train.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=config_help(TrainConfig),
        description="Train SpecDec++ acceptance heads. Run with `accelerate launch [--num_processes N] "
                    "[--mixed_precision bf16] train.py ...` for GPUs/DDP (the launcher's mixed precision wins "
                    "over the config's), or with plain python.")
    p.add_argument("--config", help="YAML file of the config keys below (configs/train/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, applied after the YAML")
    p.add_argument("--resume", action="store_true", help="continue the run in output_dir from its last checkpoint")
    p.add_argument("--sweep", action="store_true", help="train the depths x w_rejs grid (resumes by itself)")
    return p


def resume_command(argv: list[str]) -> str:
    """The command that continues this run: the same arguments plus --resume, under the same launcher."""
    launcher = "accelerate launch train.py" if os.environ.get("ACCELERATE_MIXED_PRECISION") else "python train.py"
    args = [a for a in argv if a != "--resume"]
    return " ".join([launcher, *(shlex.quote(a) for a in args), "--resume"])


def main(argv: list[str] | None = None) -> int:
    """`train.py` / `adaptive-spec train`: 0 done, 2 bad input (one `error:` line), 130 Ctrl-C."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    cfg = None
    try:
        cfg = load_config(TrainConfig, args.config, args.overrides)
        if args.sweep:
            sweep(cfg)
        else:
            train(cfg, resume=args.resume)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Every process gets the Ctrl-C; one line, from the main one, says what is kept and what to run.
        if int(os.environ.get("RANK", "0")) == 0:
            kept = RunFiles(Path(cfg.output_dir), False).last_checkpoint() if cfg else "nothing started"
            print(f"\ninterrupted: {kept}; resume with: {resume_command(argv)}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
