"""A model's logits made into the distribution a token is drawn from (temperature, top-k, top-p): one function
for the draft's q and the target's p, so speculative decoding reproduces plain sampling from p exactly."""
from __future__ import annotations

import torch


def top_k(logits: torch.Tensor, k: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk's values over rows [..., V] without its slow CPU pass over the whole row. Each of the k largest
    values lies in one of the k blocks with the largest maxima (any value outside has k block maxima at least
    as large), so topk over block maxima, then over those blocks, gives the same values (ties at the k-th
    place may get other indices; process_logits keeps every tie)."""
    V = logits.shape[-1]
    if V < 8 * block or k * block * 4 > V:  # small rows (tests' tiny vocabularies) or k near V: plain topk
        return torch.topk(logits, k, dim=-1)
    lead = logits.shape[:-1]
    rows = logits.reshape(-1, V)
    pad = (-V) % block
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad), value=float("-inf"))
    blocks = rows.view(rows.shape[0], -1, block)
    top_blocks = torch.topk(blocks.amax(-1), k, dim=-1).indices  # [R, k]
    chosen = torch.gather(blocks, 1, top_blocks.unsqueeze(-1).expand(-1, -1, block))  # [R, k, block]
    vals, inner = torch.topk(chosen.reshape(rows.shape[0], -1), k, dim=-1)
    idx = top_blocks.gather(1, inner // block) * block + inner % block
    return vals.view(*lead, k), idx.view(*lead, k)


def _drop_top_p(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Sorted (descending) logits with the tokens past the top-p mass set to -inf: a token goes when
    the tokens ranked above it already hold top_p of the mass; the most likely one always stays."""
    sorted_probs = sorted_logits.softmax(-1)
    drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    return sorted_logits.masked_fill(drop, float("-inf"))


# values found beyond the k-th, so that logits tied at the k-th value are kept (as masking `< k-th` keeps them)
TIE_SLACK = 8


def _sparse_top_k(logits: torch.Tensor, params) -> torch.Tensor | None:
    """process_logits with top-k over the k + TIE_SLACK largest logits only, not the whole vocabulary; None where
    ties at the k-th value may reach past them. Ordered like the dense path's stable sort, so top-p drops the
    same tokens. Reads one bool on the host: CPU only."""
    k, V = params.top_k, logits.shape[-1]
    n = min(k + TIE_SLACK, V)
    vals, idx = top_k(logits, n)
    kth = vals[..., k - 1:k]
    if n < V and bool((vals[..., -1:] == kth).any()):
        return None
    idx, order = idx.sort(-1)
    vals = vals.gather(-1, order)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)
    idx = idx.gather(-1, order)
    vals = vals.masked_fill(vals < kth, float("-inf")) / params.temperature
    if params.top_p < 1.0:
        vals = _drop_top_p(vals, params.top_p)
    return torch.zeros_like(logits).scatter_(-1, idx, vals.softmax(-1))


def process_logits(logits: torch.Tensor, params, sync_free: bool = False) -> torch.Tensor:
    """Logits [..., V] -> float32 probabilities after a SamplingParams' temperature, top-k (every token tied
    with the k-th kept) and top-p. sync_free: never read back to the host (for captured graphs)."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if params.top_k and params.top_k < logits.shape[-1]:
        if logits.device.type == "cpu" and not sync_free:
            sparse = _sparse_top_k(logits, params)
            if sparse is not None:
                return sparse
        kth = top_k(logits, params.top_k)[0][..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logits = logits / params.temperature
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        kept = _drop_top_p(sorted_logits, params.top_p)
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, order, kept)
    return logits.softmax(-1)
