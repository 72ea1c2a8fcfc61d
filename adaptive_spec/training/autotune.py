"""`adaptive-spec autotune`: the offline half of `--threshold auto` / `--k auto` (adaptive_spec.decoding.auto
has the pick and the replay this runs).

`adaptive-spec autotune --head DIR --data DATAGEN_DIR` replays the head on a datagen run's dev responses
(curve_of) and saves the expected counts per h of H_GRID and per fixed K of K_GRID as
DIR/threshold_curve.json (machine-independent; with the head's weights hash, the data, and for a mix of
sources also per source). Without --head it saves the per-K part only (--out)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from ..decoding.auto import curve_of
from ..datagen.shards import iter_shards
from ..errors import UserError, get_logger
from ..heads import head as heads
from ..heads.curve import autotune_command, curve_path, weights_hash
from ..runs import read_manifest, write_json
from ..tables import md_table
from .data import dataset_sources

log = get_logger(__name__)


def _predictions(head, shard: dict) -> np.ndarray:
    x = heads.shard_inputs(head, shard)  # as training builds them
    with torch.inference_mode():
        p = torch.cat([head.acceptance_prob(c.to(device=getattr(head, "device", "cpu"),
                                                 dtype=getattr(head, "dtype", torch.float32))).float().cpu()
                       for c in torch.split(x, 8192)]) if len(x) else torch.zeros(0)
    return p.double().numpy()


def responses(data_dir: Path, split: str, head=None):
    """(source name or None, P, p̂ or None, prompt ids, response ids) per response of a datagen split (the ids:
    for replaying a policy that reads the text, as the probe replays prompt lookup)."""
    names = dataset_sources(read_manifest(data_dir))
    for shard in iter_shards(data_dir, split):
        P = shard["accept_prob"].double().numpy()
        phat = _predictions(head, shard) if head is not None else None
        offs = shard["resp_offsets"].long().tolist()
        ids = shard["source_ids"].tolist() if names and "source_ids" in shard else [None] * (len(offs) - 1)
        tokens, x = shard["input_ids"].tolist(), shard["x_ids"].tolist()
        starts, lens = shard["input_offsets"].tolist(), shard["prompt_lens"].tolist()
        for i, (src, a, b) in enumerate(zip(ids, offs[:-1], offs[1:])):
            if b > a:
                yield ((None if src is None else names[src]), P[a:b], (None if phat is None else phat[a:b]),
                       tokens[starts[i]:starts[i] + lens[i]], x[a:b])


def build_curve(head, data_dir, split: str = "dev", k_max: int = 20) -> dict:
    """The expected counts per h (head given) and per fixed K over a datagen split (module
    docstring), pooled and, for a mix of prompt sources, per source (`by_source`); and per
    (h, cap) for the caps of CAP_GRID below k_max (`capped`)."""
    lag = 0 if getattr(head, "feature", "token") == "context" else 1
    curve = curve_of(responses(Path(data_dir), split, head), lag, k_max, head is not None)
    if curve is None:
        raise UserError(f"split {split!r} of {data_dir} holds no responses; pass a datagen run with a {split} split "
                        "(dev_frac > 0) or another --split")
    return curve


def make_curve(head_dir: str | None, data_dir: str, split: str = "dev", k_max: int = 20, out: str | None = None):
    """Replay and save; returns (path, curve). The curve goes beside the head unless `out` says otherwise."""
    if not isinstance(k_max, int) or k_max < 1:
        raise UserError(f"the hard cap on candidates per round (--k-max) must be an integer >= 1, got {k_max!r}")
    if out is None and (head_dir is None or not Path(head_dir).expanduser().is_dir()):
        raise UserError("the curve goes beside the head, which needs --head to be a local folder; otherwise (a hub "
                        "head, or no head: the per-K curve only) pass --out FILE")
    data = Path(data_dir).expanduser()
    man = read_manifest(data, hint="pass --data a folder written by `adaptive-spec datagen`")
    head = None
    if head_dir is not None:
        head = heads.load_head(head_dir, hidden_size=(man.get("models", {}).get("draft") or {}).get("hidden_size"),
                               why="autotune", inputs=heads.INPUTS)  # the replay builds any head's rows
        _warn_other_draft(head, man)
    curve = build_curve(head, data, split, k_max)
    cfg = man.get("config", {})
    curve.update(
        head=None if head is None else {"path": str(head_dir), "feature": getattr(head, "feature", "token"),
                                        "inputs": getattr(head, "inputs", "hidden"), "depth": getattr(head, "depth", None),
                                        "weights": weights_hash(head_dir)},
        data={"dir": str(data_dir), "split": split, "config_hash": man.get("config_hash"),
              "draft": (man.get("models", {}).get("draft") or {}).get("fingerprint"),
              "sampling": {k: cfg.get(k) for k in ("temperature", "top_k", "top_p")}},
        command=autotune_command(head_dir, data_dir, split, k_max, out),
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    path = Path(out).expanduser() if out else curve_path(head_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, curve)
    return path, curve


def _warn_other_draft(head, manifest: dict):
    """Replaying a head on data from another draft predicts that draft's rounds, not the head's own."""
    trained = getattr(head, "draft_fingerprint", None)
    data = (manifest.get("models", {}).get("draft") or {}).get("fingerprint")
    if trained and data and trained != data:
        log.warning(f"the head was trained on draft {trained} and the data comes from draft {data}; the curve "
                    "predicts rounds of the data's draft")


def curve_table(curve: dict) -> str:
    """Markdown: the machine-independent counts per h and per K."""
    rows = [[f"h={p['h']:g}", p["verification_rate"], p["discard_rate"], p["tokens_per_round"]]
            for p in curve["thresholds"]]
    rows += [[f"K={p['k']}", p["verification_rate"], p["discard_rate"], p["tokens_per_round"]] for p in curve["fixed_k"]]
    return md_table(["policy", "N_target/N", "N_discarded/N", "tokens/round"], rows)
