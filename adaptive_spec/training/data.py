"""A datagen folder as training reads it: the manifest, the loss positions of a split
(PositionSet), their features (memory-mapped from the shards, or from one pass of the frozen draft,
cached on disk) and the epoch order (EpochShuffle)."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..datagen.features import load_draft, response_features
from ..datagen.shards import FORMAT
from ..errors import UserError
from ..heads.features import CONTEXT_KEY, N_STATS, position_map, state_key
from ..heads.head import join_inputs, reads_stats
from ..runs import read_manifest as read_manifest_json
from .settings import TrainConfig


def read_manifest(root: str | Path, partial: bool = False) -> dict:
    """A complete datagen manifest with the fields training reads, or a UserError saying what to do.

    partial=True accepts a dataset whose datagen run has not finished: the manifest lists only the
    shards written (atomically) so far, so training reads a consistent prefix of the run. A head
    trained on it records that in its metadata ("partial_data")."""
    root = Path(root)
    f = root / "manifest.json"
    m = read_manifest_json(root, hint="point data= at a folder written by datagen, or regenerate the dataset")
    if m.get("format") != FORMAT:
        raise UserError(f"{f} has format {m.get('format')!r}, expected {FORMAT!r}; regenerate the dataset")
    if not m.get("complete") and not partial:
        raise UserError(f"dataset {root} is incomplete (datagen was interrupted or is still running); rerun the "
                        "same `adaptive-spec datagen` command to finish it, or set partial_data=true to train on "
                        "the shards written so far")
    try:
        int(m["models"]["draft"]["hidden_size"])
        m["splits"]["train"]["shards"]
        stats_sampling(m)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{f} lacks {e} (models.draft.hidden_size / splits.train.shards / config.temperature, top_k, "
                        "top_p); regenerate the dataset") from None
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
    instead of one Python call per position."""

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


def _check_shards(cfg: TrainConfig, root: Path, shards: list, smalls: list, stats_wanted: bool) -> tuple[bool, bool]:
    """(whether every shard stores draft features, whether their states are on the target prefix), refusing
    a split whose shards disagree or lack what `cfg` reads."""
    has_features = all(bool(s["_has_features"]) for s in smalls)
    clean = {bool(s["_clean"]) for s in smalls}
    if len(clean) > 1:
        raise UserError(f"{root} mixes shards with states on the target prefix and on the mixed one; derive the "
                        "folder again with one `adaptive-spec datagen-features --prefix ...`")
    if cfg.feature == "context" and not has_features and cfg.inputs != "stats":
        raise UserError(f"feature=context needs stored draft features, and {root} has none; regenerate it "
                        "with store_features=true (or train feature=token)")
    no_stats = [s["file"] for s, small in zip(shards, smalls) if stats_wanted and "draft_stats" not in small]
    if no_stats:
        raise UserError(f"inputs={cfg.inputs} needs the draft statistics (shard tensor draft_stats) that the current "
                        f"datagen stores, and {root / no_stats[0]} has none; regenerate the dataset with the current "
                        "`adaptive-spec datagen` (or train inputs=hidden)")
    return has_features, clean.pop()


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
    has_features, clean = _check_shards(cfg, root, shards, smalls, stats_wanted)
    no_hidden = cfg.inputs == "stats"  # a stats head reads no state: the token data alone trains it
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
    shard_ids, rows = torch.cat(shard_ids), torch.cat(rows)
    if no_hidden:  # rows keep their layout [hidden, stats]; the head ignores the hidden part
        feats, shard_ids, rows = [torch.zeros(1, H)], torch.zeros_like(shard_ids), torch.zeros_like(rows)
    elif not has_features:  # one tensor of the loss positions' states, in order
        feats = [draft_features(cfg, manifest, split, [root / s["file"] for s in shards], accelerator)]
        shard_ids, rows = torch.zeros_like(shard_ids), torch.arange(len(target))
    return PositionSet(feats, shard_ids, rows, target.clamp(0, 1), stats)


def draft_features(cfg: TrainConfig, manifest: dict, split: str, files: list[Path], accelerator) -> torch.Tensor:
    """Draft final hidden states at the loss positions of a split without stored features.

    Computed once by the main process with the frozen draft and cached as safetensors (keyed
    by the dataset's config hash), so resumes, later runs and every head of a sweep reuse it."""
    cache = Path(cfg.feature_cache or Path(cfg.output_dir) / "features") / f"{split}.safetensors"
    key = {"config_hash": str(manifest.get("config_hash")), "draft": cfg.draft or manifest["models"]["draft"]["name"]}

    def cached() -> torch.Tensor | None:
        if not cache.is_file():
            return None
        with safe_open(str(cache), framework="pt") as f:
            if {k: (f.metadata() or {}).get(k) for k in key} != key:
                return None
        return mmap_tensor(cache, "features")  # mapped like stored features: shared by DDP processes

    if accelerator.is_main_process and cached() is None:
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


def stats_sampling(manifest: dict) -> dict:
    """How the datagen run processed q before taking its draft_stats (its temperature, top-k, top-p; read_manifest
    checks the manifest has them): the policy processes q the same way."""
    return {k: manifest["config"][k] for k in ("temperature", "top_k", "top_p")}
