"""Cache surgery for tree drafting: a forward with an arbitrary attention pattern, and cache
compaction to the accepted path.

Both work on a `models.CausalLM` (a transformers DynamicCache) and defer to the runner's own
`tree_forward` / `compact` when it has them (the static-cache runner, the test mocks).
"""
from __future__ import annotations

import time

import torch

from ...backends.models import model_kv
from ...errors import UserError


@torch.inference_mode()
def tree_forward(lm, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor,
                 logit_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed `ids` [n] after lm's cache with an arbitrary attention pattern.

    attend [n, lm.length + n] bool: row r may attend to cache slot c (the new tokens take slots
    lm.length .. lm.length + n - 1). positions [n]: their position ids. Returns (logits of rows
    logit_from.. [n - logit_from, V] float32, final hidden states [n, H]). The new tokens are
    appended to the cache (lm.length += n); counters n_forwards / fwd_time are updated.
    """
    if hasattr(lm, "tree_forward"):  # test mocks implement the same contract natively
        return lm.tree_forward(ids, positions, attend, logit_from)
    t0 = time.perf_counter()
    n = ids.shape[0]
    kv = lm.length + n
    if tuple(attend.shape) != (n, kv):
        raise ValueError(f"attend must be [{n}, {kv}], got {tuple(attend.shape)}")
    dtype = lm.model.dtype
    # an additive float mask works for the eager and the sdpa attention alike; a 4D mask is
    # passed through by transformers' masking_utils untouched
    mask = torch.zeros(1, 1, n, kv, dtype=dtype, device=lm.device)
    mask.masked_fill_(~attend.to(lm.device).view(1, 1, n, kv), torch.finfo(dtype).min)
    out = lm.base(input_ids=ids.view(1, n), attention_mask=mask, position_ids=positions.view(1, n).to(lm.device),
                  **model_kv(lm.base, lm.cache), use_cache=True)
    h = out.last_hidden_state[0]
    logits = lm.logits(h[logit_from:])
    lm.length += n
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    lm.fwd_time += time.perf_counter() - t0
    lm.n_forwards += 1
    return logits, h


@torch.inference_mode()
def compact_cache(lm, base: int, extra: list[int]):
    """Keep cache slots [0, base) followed by the slots `extra` (in that order), drop the rest.

    Used after verification to keep exactly the accepted path: `extra` are the cache slots of
    the accepted tree nodes, ancestors first. Only len(extra) rows are moved per layer."""
    if hasattr(lm, "compact"):
        lm.compact(base, extra)
        return
    n = len(extra)
    if extra == list(range(base, base + n)):  # already in place: a crop
        lm.rollback(base + n)
        return
    idx = torch.tensor(extra, dtype=torch.long, device=lm.device)
    for layer in lm.cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is None or keys.numel() == 0:
            continue
        if hasattr(layer, "sliding_window") and getattr(layer, "cumulative_length", 0) > keys.shape[-2]:
            raise UserError("tree verification does not support sliding-window caches that already dropped tokens")
        for name in ("keys", "values"):
            t = getattr(layer, name)
            rows = t.index_select(-2, idx)
            t[..., base:base + n, :] = rows
            setattr(layer, name, t[..., :base + n, :])
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = base + n
    lm.length = base + n
