"""Sampling and exact rejection-sampling verification.

q is the draft's next-token distribution, p the target's (the SpecDec++ paper's names). `process_logits`
(backends/logits.py) applies temperature, top-k and top-p to both alike, so speculative decoding reproduces
exactly plain sampling from the processed p. Greedy is the point mass on the argmax, for which the same
rejection rule accepts exactly the target's argmax: no separate verification code. Nothing here reads a
value back to the host; the decoder reads (n_accepted, next_token) once per round."""
from __future__ import annotations

import torch

# the distribution a token is drawn from (temperature, top-k, top-p): below the decoder and the heads
from ..backends.logits import process_logits  # noqa: F401 (the sampling API: processing the logits is its first step)
from ..typed import SamplingParams  # noqa: F401 (the sampling API: the settings it processes with)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` [..., V] (need not be normalised), without a host sync.

    Inverse CDF: the first token whose cumulative mass exceeds u * total, u ~ U[0, 1), so a token of
    probability 0 (an empty interval) is never drawn; the cumulative sum runs in float64. Not the exponential
    race argmax(p / E): it needs V random numbers a row, which on a CPU cost more than the rest of sampling.
    On a large vocabulary the CDF is walked in two levels (blocks of `SAMPLE_BLOCK` tokens, then the block's
    own cumulative sum) instead of a float64 cumulative sum over the whole row, the slow part on a CPU; an
    offset that rounding puts past its block's last token is pulled back inside."""
    u = torch.rand((*probs.shape[:-1], 1), generator=generator, dtype=torch.float64, device=probs.device)
    return sample_u(probs, u)


def sample_u(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sample` with its uniform given: u [..., 1] float64 in [0, 1). A round that draws all its uniforms
    at once hands each draw its own, so the draws need no generator of their own (a captured graph reads
    them from a buffer) and `sample(probs, gen)` equals `sample_u(probs, <the same u>)` draw for draw."""
    V = probs.shape[-1]
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
    """One token per row of `probs` = process_logits(logits, params), from `generator`. Greedy: the one-hot's
    token, the one `sample` would draw, taken by argmax without sample's float64 cumulative sum over the vocabulary."""
    if params.greedy:
        return probs.argmax(-1)
    return sample(probs, generator)


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
    or from p_{K+1} (the bonus token) when all K were accepted."""
    K = y.shape[0]
    if K == 0:
        return torch.zeros((), dtype=torch.long, device=p.device), sample(p[0], generator)
    r = torch.rand(K, generator=generator, device=p.device)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=p.device)
    return verify_u(y, q, p, r, u)


def verify_u(y: torch.Tensor, q: torch.Tensor, p: torch.Tensor, r: torch.Tensor, u: torch.Tensor,
             k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` with its uniforms given (r [m] for the acceptance tests, u [1] float64 for the one draw)
    and, optionally, the chain's length k as a device scalar (0 < k <= m): the candidates past k were
    drafted but never proposed (a round that decided its stop on the device drafts up to its cap and cuts
    there), so they are rejected unseen and the bonus row is p_{k+1}. Nothing is read back to the host."""
    m = y.shape[0]
    rows = torch.arange(m, device=p.device)
    # accept y_i with probability min(1, p/q): r < p/q, written without the division
    accepted = r * q[rows, y] < p[rows, y]
    if k is not None:
        accepted = accepted & (rows < k)
    n = accepted.long().cumprod(0).sum()
    # only row n is drawn from: its residual norm(max(p_n - q_n, 0)) after a rejection (n < k), p_{k+1}
    # when all k were accepted (q_n zeroed), built for that one row, not all m (m x V work a round).
    # index_select, not p[n]: indexing with a 0-d device tensor reads it back to the host
    p_n = p.index_select(0, n.view(1))[0]
    q_n = q.index_select(0, n.clamp_max(m - 1).view(1))[0] * (n < (m if k is None else k))
    return n, sample_u(residual(p_n, q_n), u)


def verify_greedy(y: torch.Tensor, logits: torch.Tensor,
                  k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify` at temperature 0 from the target's raw logits [K + 1, V], without building the one-hot
    distributions: p is the point mass on each row's argmax, so y_i is accepted exactly when it is that
    argmax (whatever point mass or copy q proposed it), and the residual after a rejection, like the
    bonus, is the point mass on that row's argmax. Returns (n, token, p(y_i) [K], 0 or 1). `k`: as in
    verify_u, the chain's length when candidates past it were drafted but not proposed."""
    amax = logits.argmax(-1)
    K = y.shape[0]
    accepted = y == amax[:K]
    if k is not None:
        accepted = accepted & (torch.arange(K, device=y.device) < k)
    n = accepted.long().cumprod(0).sum()
    return n, amax.index_select(0, n.view(1))[0], accepted.float()


def entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = logits.float().log_softmax(-1)
    # xlogy: 0 * log 0 = 0 where a reduced draft vocabulary gives a token logit -inf
    return -torch.special.xlogy(logp.exp(), logp.exp()).sum(-1)
