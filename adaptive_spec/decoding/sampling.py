"""Sampling and exact rejection-sampling verification.

Conventions (those of the SpecDec++ paper): q is the draft's next-token distribution, p the
target's. Temperature, top-k and top-p are applied identically to both by `process_logits`,
so speculative decoding reproduces exactly the distribution of plain sampling from the
processed p. Temperature 0 (greedy) is the point mass on the argmax: with one-hot p and q the
same rejection rule accepts exactly when the draft token is the target's argmax and the
residual is the target's argmax, so greedy needs no separate verification code.

Nothing here reads a value back to the host: tokens stay on the device, and the decoder
reads (n_accepted, next_token) once per round.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise UserError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise UserError(f"top-p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_k(logits: torch.Tensor, k: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest logits of each row [..., V], largest first: torch.topk's
    values, found without its pass over the whole row (0.28 ms a row of 151,936 on one CPU thread;
    this: ~0.05 ms, which a verification pays per row and a draft per token).

    Each of the k largest values lies in one of the k blocks (of `block` values) with the largest
    maxima: a value outside those has k block maxima, k distinct values, at least as large. So topk
    over the block maxima, then over the k chosen blocks, gives the same values (among values tied at
    the k-th place it may return other indices than torch.topk; process_logits keeps every tie)."""
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


def _sparse_top_k(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """process_logits with top-k from the k + TIE_SLACK largest logits only: the softmax over those, not
    over the vocabulary (~0.1 ms a row of 151,936 on one CPU thread, against ~1 ms for masking and
    exponentiating it all); None where ties at the k-th value may reach past them (the dense path
    then). The kept logits are ordered like the dense path's stable sort (by value, ties by index),
    so top-p drops the same tokens either way. One bool is read on the host: CPU only."""
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


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> float32 probabilities after temperature, top-k and top-p.

    Top-k keeps every token at least as likely as the k-th (more than k where logits tie there,
    common with bf16 logits); top-p then drops a token when the tokens ranked above it (by value, ties
    by index) already hold top_p of the mass."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if params.top_k and params.top_k < logits.shape[-1]:
        if logits.device.type == "cpu":
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


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` [..., V] (need not be normalised), without a host sync.

    Inverse CDF: the first token whose cumulative mass exceeds u * total, u ~ U[0, 1). A token
    of probability 0 owns an empty interval of the CDF, so it is never drawn. The cumulative sum
    runs in float64, so the intervals' rounding (~1e-16 of the mass) is far below anything a
    test or a run could see. Why not the exponential race argmax(p / E): it needs V random
    numbers a row, and on a CPU drawing them dominated sampling (151,936 tokens: 3.5 ms a row
    against 0.2 ms here; 126 ms against 31 ms for datagen's 32 rows).

    On a large vocabulary the CDF is walked in two levels, the same inverse CDF: the blocks' masses
    (blocks of `SAMPLE_BLOCK` tokens) locate u's block, then that block's own cumulative sum its token,
    instead of a float64 cumulative sum over the whole row (0.3-1 ms a row of 151,936 on one CPU
    thread; this: ~0.1 ms, paid per drafted token and per verification). An offset that rounding puts
    past its block's last token is pulled back inside, so a token of probability 0 is still never drawn.
    """
    V = probs.shape[-1]
    u = torch.rand((*probs.shape[:-1], 1), generator=generator, dtype=torch.float64, device=probs.device)
    if V < 16 * SAMPLE_BLOCK:
        cdf = probs.double().cumsum(-1)
        return torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1).clamp_max(V - 1)
    lead = probs.shape[:-1]
    rows = probs.reshape(-1, V)
    pad = (-V) % SAMPLE_BLOCK
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    blocks = rows.view(rows.shape[0], -1, SAMPLE_BLOCK)
    mass = blocks.sum(-1, dtype=torch.float64)  # [R, blocks]
    cdf = mass.cumsum(-1)
    target = u.view(-1, 1) * cdf[:, -1:]
    b = torch.searchsorted(cdf, target, right=True).clamp_max(cdf.shape[-1] - 1)  # [R, 1]
    inner = blocks.gather(1, b.unsqueeze(-1).expand(-1, -1, SAMPLE_BLOCK)).squeeze(1).double().cumsum(-1)
    offset = (target - (cdf.gather(1, b) - mass.gather(1, b))).clamp_min(0.0)
    offset = torch.minimum(offset, inner[:, -1:] * (1 - 1e-12))  # rounding never lands past the block's mass
    j = torch.searchsorted(inner, offset, right=True).clamp_max(SAMPLE_BLOCK - 1)
    return (b * SAMPLE_BLOCK + j).view(lead).clamp_max(V - 1)


SAMPLE_BLOCK = 128


def draw(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` = process_logits(logits, params). Greedy: the one-hot's token,
    the one `sample` would draw, taken by argmax without sample's float64 cumulative sum over the
    vocabulary (1.2 ms of a token's 1.5 ms of sampling at 151,936 tokens on one CPU thread)."""
    return probs.argmax(-1) if params.greedy else sample(probs, generator)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) row-wise; where p == q (the residual is never used then) it is p."""
    r = (p - q).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)


def verify(
    y: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (Algorithm 2 of SpecDec++; Leviathan et al.; Chen et al.).

    y: [K] draft tokens, q: [K, V] draft distributions they were drawn from, p: [K+1, V] target
    distributions at the same positions plus one. Returns device tensors (n, token): n in 0..K
    tokens accepted, then `token`, drawn from norm(max(p_{n+1} - q_{n+1}, 0)) after a rejection
    or from p_{K+1} (the bonus token) when all K were accepted.
    """
    K = y.shape[0]
    if K == 0:
        return torch.zeros((), dtype=torch.long, device=p.device), sample(p[0], generator)
    rows = torch.arange(K, device=p.device)
    p_y = p[rows, y]
    q_y = q[rows, y]
    r = torch.rand(K, generator=generator, device=p.device)
    # accept y_i with probability min(1, p/q): r < p/q, written without the division
    accepted = r * q_y < p_y
    n = accepted.long().cumprod(0).sum()
    # only row n is drawn from: its residual norm(max(p_n - q_n, 0)) after a rejection (n < K), p_{K+1}
    # when all K were accepted (q_n zeroed), built for that one row, not all K (K x V work a round).
    # index_select, not p[n]: indexing with a 0-d device tensor reads it back to the host
    p_n = p.index_select(0, n.view(1))[0]
    q_n = q.index_select(0, n.clamp_max(K - 1).view(1))[0] * (n < K)
    return n, sample(residual(p_n, q_n), generator)


def verify_greedy(y: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify` at temperature 0 from the target's raw logits [K + 1, V], without building the one-hot
    distributions: p is the point mass on each row's argmax, so y_i is accepted exactly when it is that
    argmax (whatever point mass or copy q proposed it), and the residual after a rejection, like the
    bonus, is the point mass on that row's argmax. Returns (n, token, p(y_i) [K], 0 or 1)."""
    amax = logits.argmax(-1)
    K = y.shape[0]
    accepted = y == amax[:K]
    n = accepted.long().cumprod(0).sum()
    return n, amax.index_select(0, n.view(1))[0], accepted.float()


def entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = logits.float().log_softmax(-1)
    # xlogy: 0 * log 0 = 0 where a reduced draft vocabulary gives a token logit -inf
    return -torch.special.xlogy(logp.exp(), logp.exp()).sum(-1)
