"""Scoring acceptance predictors on a datagen folder: the rows eval/score_heads.py reads (its `probe` and
`ablate` subcommands), the cross-validated logistic baselines, and metrics per prompt source.

Every function takes a datagen manifest (adaptive_spec.datagen.v1) and its folder; torch, safetensors and
scikit-learn load here, so a caller that only rebuilds a report from a run folder does not import this."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import UserError

if TYPE_CHECKING:
    from ..decoding.sampling import SamplingParams
    from ..heads.head import AcceptanceHead
    from ..training.settings import TrainConfig


def split_shards(manifest: dict, split: str) -> list[dict]:
    """The manifest's shard entries ({"file", "n_seqs", ...}) of `split`; [] where it has none (a partial
    datagen run lists only the shards written so far, and may not have reached the split)."""
    return ((manifest.get("splits") or {}).get(split) or {}).get("shards") or []


def source_of_positions(shard: dict) -> torch.Tensor:
    """[T] source index of each response position (datagen stores one per sequence)."""
    return torch.repeat_interleave(shard["source_ids"].long(), shard["resp_offsets"].long().diff())


def probe_rows(root: Path, manifest: dict, split: str, lm_head: torch.Tensor, params: SamplingParams,
               chunk: int = 512) -> dict[str, torch.Tensor | None]:
    """Per draft token Y_i of `split` (loss positions but a response's first, whose context state is the
    prompt's and is not stored; every position of a target-prefix folder): P (accept_prob), the context
    state "ctx" (e_{i-1}, or context_features), the token state "tok" (e_i), log q(Y_i) "log_qy", H(q) "H"
    and the stored draft_stats "stats" (None for a folder made before datagen stored them; log q and H
    then come from the draft's `lm_head` on e_{i-1}, a weaker stand-in on mixed-prefix states)."""
    from ..decoding.sampling import process_logits
    from ..heads.features import CONTEXT_KEY, response_starts
    from ..training.data import mmap_tensor, read_small

    shards = split_shards(manifest, split)
    if not shards:
        raise UserError(f"{root} has no {split} shards; run datagen first or pick another --split")
    out = {"P": [], "ctx": [], "tok": [], "log_qy": [], "H": [], "stats": []}
    for shard in shards:
        fn = root / shard["file"]
        g = read_small(fn, ["loss_mask", "resp_offsets", "y_ids", "accept_prob"], optional=("draft_stats",))
        if not bool(g["_has_features"]):
            raise UserError(f"{fn} has no stored features; regenerate with store_features=true")
        g["features"] = mmap_tensor(fn, "features")
        mask = g["loss_mask"].bool()
        if bool(g["_clean"]):  # target-prefix states: every position, each with its own context state
            pos = torch.arange(len(mask))
            ctx = mmap_tensor(fn, CONTEXT_KEY)[pos]
        else:
            pos = (mask & ~response_starts(g["resp_offsets"], len(mask))).nonzero().flatten()
            ctx = g["features"][pos - 1]
        y = g["y_ids"][pos].long()
        if "draft_stats" in g:  # q_i's own statistics, stored by datagen (none before it did: no stats heads)
            out["log_qy"].append(g["draft_stats"][pos, 0])
            out["H"].append(g["draft_stats"][pos, 1])
            out["stats"].append(g["draft_stats"][pos])
        else:
            for s in range(0, len(pos), chunk):  # [chunk, V] float32 at a time: V = 151,936 is large
                q = process_logits(ctx[s:s + chunk].to(lm_head.dtype) @ lm_head.T, params)
                out["log_qy"].append(q.gather(1, y[s:s + chunk, None])[:, 0].clamp_min(1e-8).log())
                out["H"].append(-(q * q.clamp_min(1e-30).log()).sum(-1))
        out["P"].append(g["accept_prob"][pos].float())
        out["ctx"].append(ctx)
        out["tok"].append(g["features"][pos])
    return {k: torch.cat(v) if v else None for k, v in out.items()}


def cv_logistic(X: torch.Tensor, t: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Out-of-fold logits of a logistic regression (soft targets `t`) on the columns of X, 2 folds: fitted
    and scored inside one split, so it is honest about what the split allows."""
    n = len(t)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    folds = [idx[: n // 2], idx[n // 2:]]
    pred = torch.empty(n)
    for a, b in (folds, folds[::-1]):
        mu, sd = X[a].mean(0), X[a].std(0) + 1e-6
        w = torch.zeros(X.shape[1], requires_grad=True)
        b0 = torch.zeros(1, requires_grad=True)
        opt = torch.optim.LBFGS([w, b0], max_iter=200)
        Xa = (X[a] - mu) / sd

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(Xa @ w + b0, t[a])
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            pred[b] = ((X[b] - mu) / sd) @ w + b0
    return pred


def dev_metrics(head: AcceptanceHead, cfg: TrainConfig, manifest: dict, data: Path | None = None) -> dict:
    """{"all": metrics, source: metrics, ...} of `head` on every dev shard of `data` (default: the
    training data), from shard_inputs rows at the positions training uses (shard_positions)."""
    from safetensors.torch import load_file

    from ..heads.head import shard_inputs, shard_positions
    from ..training.data import dataset_sources
    from ..training.metrics import prediction_metrics

    names = dataset_sources(manifest)
    zs, ys, srcs = [], [], []
    for entry in split_shards(manifest, "dev"):
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


def reference_auc(data: Path, manifest: dict) -> dict:
    """{"all": AUC, source: AUC} of the draft's own log q(Y_i) (draft_stats), no head, on the dev
    split at the positions a token head is scored on: what a head must beat to be worth its cost."""
    from safetensors.torch import load_file

    from ..heads.features import CONTEXT_KEY, position_map
    from ..training.data import dataset_sources
    from ..training.metrics import auc

    names = dataset_sources(manifest)
    lq, ps, srcs = [], [], []
    for entry in split_shards(manifest, "dev"):
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
