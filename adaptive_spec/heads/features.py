"""What an acceptance head reads, defined once for datagen, training and decoding.

`draft_stats(q, y)` are the draft's own statistics of a candidate y drawn from q: log q(y) (floored at
MIN_LOG_Q: q(y) = 0 where decoding processes q differently from datagen, e.g. a smaller top-k), the
entropy H(q) in nats, and the top-1 minus top-2 probability. At decoding time the learned policy
recomputes q from the step's raw logits with datagen's sampling parameters (the head's
`stats_sampling`) rather than using the decoder's q: at temperature 0 that is a point mass, whose
statistics training never saw. Sums run in float64, rounded once to float32, so a batched datagen step
and a one-row decode step give the same rows. Where the decoder samples with the head's own parameters
its q is reused, and a top-k q is read through one partial sort (truncated_stats).

Position in the round is deliberately not a feature: given the accepted prefix, whether y_i is accepted
does not depend on where the round began, and datagen has no rounds, so a position could only be
simulated (a head learns to ignore it) or taken from some policy's rounds (tying the head to that
policy's threshold). The product 1 - prod p_hat_i already accounts for the round's length.

`position_map` says which response positions a head trains on and which stored state it reads there
(token: the state at Y_i's own position; context: the state after Z_{i-1}, at every position but a
response's first). Which prefix the stored states were computed on (`PREFIXES`):
  mixed   the token-mixed response (x, Z): the paper's construction (section 4.4); the head reads
          (x, Z_<i, Y_i), one pass per response, instead of the ideal (x, X_<i, Y_i).
  target  the target's own response: `features`[i] = e(x, X_<i, Y_i) and `context_features`[i] =
          e(x, X_<i), the inputs the decoder gives a head after an accepted prefix
          (`adaptive-spec datagen-features --prefix target`); only these shards hold
          `context_features`."""
from __future__ import annotations

import torch

from ..backends.logits import process_logits
from ..typed import SamplingParams

STATS = ("log_q", "entropy", "margin")
N_STATS = len(STATS)
MIN_LOG_Q = -20.0  # q(y) < 2e-9: as good as impossible; the floor keeps standardisation sane


def draft_stats(q_probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """q [..., V] probabilities, y [...] token ids -> [..., 3] float32 (log q(y), H(q), top1 - top2)."""
    return _stats(q_probs, y, q_probs, q_probs.topk(min(2, q_probs.shape[-1]), dim=-1).values)


def _stats(q_probs: torch.Tensor, y: torch.Tensor, support: torch.Tensor, top2: torch.Tensor) -> torch.Tensor:
    """The rows of draft_stats from `support`, values of q that hold all its nonzeros (q itself,
    or its largest entries), and `top2`, q's two largest values."""
    q_y = q_probs.gather(-1, y.long().unsqueeze(-1)).squeeze(-1).double()
    log_q = q_y.log().clamp_min(MIN_LOG_Q)  # log 0 = -inf, floored
    # per-element terms in q's dtype, summed in float64: one pass over the support, and a sum
    # whose rounding does not depend on how many rows share the call
    ent = -torch.special.xlogy(support, support).sum(-1, dtype=torch.float64)  # 0 log 0 = 0
    top2 = top2.double()
    margin = top2[..., 0] - (top2[..., 1] if top2.shape[-1] > 1 else 0.0)
    return torch.stack([log_q, ent, margin], -1).float()


def truncated_stats(q_probs: torch.Tensor, y: torch.Tensor, top_k: int) -> torch.Tensor:
    """draft_stats for a q processed with top-k = `top_k`, reading only its largest values.

    Such a q has about top_k nonzeros (more where logits tie at the k-th value, common with bf16
    logits), so H(q) and the margin come from its 2 top_k largest entries, one partial sort
    instead of two passes over the vocabulary, whenever the smallest of those is 0 (then every
    nonzero is among them and the sums hold the same terms). Otherwise, or without top-k, it is
    draft_stats itself. The check reads one value on the host: the policy syncs per step anyway."""
    n = 2 * top_k
    if top_k <= 0 or n >= q_probs.shape[-1]:
        return draft_stats(q_probs, y)
    top = q_probs.topk(n, dim=-1).values
    if bool(top[..., -1].max() > 0):
        return draft_stats(q_probs, y)
    return _stats(q_probs, y, top, top[..., :2])


def step_stats(logits: torch.Tensor, token: torch.Tensor, sampling: SamplingParams,
               probs: torch.Tensor | None = None, probs_sampling: SamplingParams | None = None) -> torch.Tensor:
    """draft_stats of a drafted token, q from the raw logits processed as datagen processed them.
    `probs`, the decoder's own q, is reused when it was processed with the same parameters
    (`probs_sampling == sampling`): the same function of the same logits, so the same tensor."""
    q = probs if probs is not None and probs_sampling == sampling else process_logits(logits, sampling)
    return truncated_stats(q, token, sampling.top_k)


def sampling_from(d: dict | None) -> SamplingParams:
    """SamplingParams from a head's `stats_sampling` record (None: temperature 1, no truncation)."""
    d = d or {}
    return SamplingParams(float(d.get("temperature", 1.0)), int(d.get("top_k", 0)), float(d.get("top_p", 1.0)))


def response_starts(resp_offsets: torch.Tensor, n: int) -> torch.Tensor:
    """[n] bool: True at each response's first position. Its context state (that produced q_1)
    is the prompt's last, which datagen does not store, so context features skip it."""
    starts = resp_offsets.long()[:-1]
    first = torch.zeros(n, dtype=torch.bool)
    first[starts[starts < n]] = True
    return first


PREFIXES = ("mixed", "target")
CONTEXT_KEY = "context_features"  # the shard tensor of target-prefix context states


def state_key(feature: str, clean: bool) -> str:
    """The shard tensor a head of this `feature` reads: `clean` = the shard holds target-prefix states."""
    return CONTEXT_KEY if clean and feature == "context" else "features"


def position_map(feature: str, loss_mask: torch.Tensor, resp_offsets: torch.Tensor,
                 clean: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(used [T] bool, state_row [T] long) for a shard's T response positions.

    used: the positions a head of this `feature` trains on; state_row[i]: the row of the tensor
    `state_key(feature, clean)` it reads for Y_i (always a valid row index; meaningless where a
    context head has no state). clean: the shard holds target-prefix states (see PREFIXES)."""
    T = len(loss_mask)
    rows = torch.arange(T)
    if clean:  # every Y_i has both of its own states, a response's first included
        return torch.ones(T, dtype=torch.bool), rows
    if feature == "context":
        # Y_i from the state after Z_{i-1}, which never contains Y_i: usable mixed or not
        return ~response_starts(resp_offsets, T), (rows - 1).clamp_min(0)
    return loss_mask.bool(), rows  # Z_i came from Y_i: its own state is the head's input
