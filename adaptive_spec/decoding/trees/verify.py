"""Exact verification of a drafted tree in ONE target forward pass.

The target scores every drafted node with a tree attention mask (each sees the accepted prefix, its
ancestors and itself) and position ids prefix length + depth - 1. Then (Kobus & Gunduz, appendix A):
  * GSD, Algorithm 4: a reached node's children are tested in order, child i accepted with probability
    min(1, P_i(x_i) / Q_i(x_i)); on a rejection P_{i+1} = norm(max(P_i - Q_i, 0)) and Q_{i+1} = Q_i
    without x_i, renormalised (sampling without replacement). All rejected: the next token is drawn
    from the last residual; at a leaf, from P.
  * ERSD, Algorithm 5: the race e that drafted the children is reused: the winner argmin e / P is an
    exact sample from P; the path goes on while the winner is a drafted child.
  * temperature 0: the path follows the target's argmax while it is a drafted child.
Exact for any tree shape chosen from information available before each token is drawn."""
from __future__ import annotations

from itertools import takewhile

import torch

from ..interfaces import RoundState
from ..sampling import SamplingParams, process_logits, residual, sample


def target_pass(target, seq: torch.Tensor, tree, sampling: SamplingParams) -> torch.Tensor:
    """One target forward over the pending tokens and every drafted node, with the tree mask.
    Returns P [N + 1, V]: P[0] at the root, P[j] after node j."""
    L, base, dev = seq.shape[0], target.length, seq.device
    pend = seq[base:]
    n_p, N = pend.shape[0], tree.n
    if N == 0:
        logits, _ = target.forward(pend, n_logits=1)
        return process_logits(logits, sampling)
    ids = torch.cat([pend, tree.tok[1:N + 1]])
    pos = torch.cat([torch.arange(base, L, device=dev),
                     torch.tensor([L - 1 + d for d in tree.depth[1:]], device=dev)])
    attend = torch.zeros(n_p + N, base + n_p + N, dtype=torch.bool)
    attend[:n_p, :base + n_p] = torch.ones(n_p, base + n_p, dtype=torch.bool).tril(base)
    attend[n_p:, :L] = True
    for j in range(1, N + 1):
        for a in tree.ancestors(j):
            attend[n_p + j - 1, L + a - 1] = True
    logits, _ = target.tree_forward(ids, pos, attend.to(dev), logit_from=n_p - 1)
    return process_logits(logits, sampling)


def _children_matrix(tree, nodes):
    m = max(len(tree.children[v]) for v in nodes)
    mat = [tree.children[v] + [0] * (m - len(tree.children[v])) for v in nodes]
    return torch.tensor(mat, dtype=torch.long, device=tree.device), m


def _rrs_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The target's distribution after a rejection: norm(max(p - q, 0)) (a seam for tests)."""
    return residual(p, q)


def verify_gsd(tree, P: torch.Tensor, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over siblings drawn without replacement (GSD, Algorithm 4),
    for every node with children at once. Returns device tensors (child [N+1]: the index of the
    accepted child or -1, token [N+1]: the token drawn when no child is accepted: from the last
    residual, or from P at a leaf)."""
    N1 = tree.n + 1
    child = torch.full((N1,), -1, dtype=torch.long, device=P.device)
    dist = P.clone()
    internal = [v for v in range(N1) if tree.children[v]]
    if internal:
        kids, M = _children_matrix(tree, internal)
        ctok = tree.tok[kids]
        iv = torch.tensor(internal, device=P.device)
        p = P[iv].clone()
        q = tree.q[torch.tensor([tree.row[v] for v in internal], device=P.device)].clone()
        u = torch.rand(len(internal), M, generator=gen, device=P.device)
        acc = torch.full((len(internal),), -1, dtype=torch.long, device=P.device)
        cnt = [len(tree.children[v]) for v in internal]
        for i in range(M):
            rows = [r for r, c in enumerate(cnt) if c > i]
            ri = torch.tensor(rows, device=P.device)
            x = ctok[ri, i].view(-1, 1)
            pr, qr = p[ri], q[ri]
            px, qx = pr.gather(1, x)[:, 0], qr.gather(1, x)[:, 0]
            live = acc[ri] < 0
            valid = live & (qx > 0)  # a candidate the draft could not have drawn is skipped
            ok = valid & (u[ri, i] * qx < px)
            acc[ri] = torch.where(ok, torch.full_like(acc[ri], i), acc[ri])
            upd = (valid & ~ok).view(-1, 1)
            p[ri] = torch.where(upd, _rrs_residual(pr, qr), pr)
            qz = qr.scatter(1, x, 0.0)
            qz = qz / qz.sum(-1, keepdim=True).clamp_min(1e-30)
            q[ri] = torch.where(upd, qz, qr)
        child[iv] = acc
        dist[iv] = p
    return child, sample(dist, gen)


def verify_race(tree, P: torch.Tensor, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """ERSD (Algorithm 5): at a node with children the winner of the children's race under P,
    argmax P / e, is the next token; the path continues when it is a drafted child. Leaves draw
    a fresh sample. At temperature 0 the winner is the target's argmax. Same return as GSD."""
    N1 = tree.n + 1
    if tree.greedy:
        tok = P.argmax(-1)
    else:
        tok = sample(P, gen)
        internal = [v for v in range(N1) if tree.children[v]]
        if internal:
            iv = torch.tensor(internal, device=P.device)
            e = tree.e[torch.tensor([tree.row[v] for v in internal], device=P.device)]
            tok[iv] = (P[iv] / e).argmax(-1)
    return match_children(tree, tok), tok


def match_children(tree, tok):
    N1 = tree.n + 1
    child = torch.full((N1,), -1, dtype=torch.long, device=tok.device)
    internal = [v for v in range(N1) if tree.children[v]]
    if internal:
        kids, M = _children_matrix(tree, internal)
        cnt = torch.tensor([len(tree.children[v]) for v in internal], device=tok.device)
        iv = torch.tensor(internal, device=tok.device)
        hit = (tree.tok[kids] == tok[iv].view(-1, 1)) & (torch.arange(M, device=tok.device) < cnt.view(-1, 1))
        child[iv] = torch.where(hit.any(-1), hit.long().argmax(-1), torch.full_like(cnt, -1))
    return child


def verify_greedy(tree, P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tok = P.argmax(-1)
    return match_children(tree, tok), tok


def read_path(tree, child: torch.Tensor, tok: torch.Tensor):
    """The round's one host read: walk the accepted path. Returns (path node ids, path tokens,
    next token, outcomes [(n children, accepted index or None)] of the nodes reached)."""
    N1 = tree.n + 1
    vals = torch.cat([child, tok, tree.tok[:N1]]).tolist()
    child_h, tok_h, toks = vals[:N1], vals[N1:2 * N1], vals[2 * N1:]
    path, outcomes, v = [], [], 0
    while True:
        m = len(tree.children[v])
        c = child_h[v]
        if m:
            outcomes.append((m, c if c >= 0 else None))
        if c < 0:
            break
        v = tree.children[v][c]
        path.append(v)
    return path, [toks[j] for j in path], tok_h[v], outcomes


def compact_to_path(target, draft, tree, L: int, path: list[int]) -> None:
    """Compact both caches to seq[:L] + the accepted path. The draft keeps the path's nodes it
    was run on (a leaf never is); the target ran on every node."""
    if not tree.n:
        return
    target.compact(L, [L + j - 1 for j in path])
    draft.compact(L, [L + tree.slot[j] for j in takewhile(lambda j: tree.slot[j] is not None, path)])


def finish_round(state: RoundState, tree, path: list[int]) -> None:
    compact_to_path(state.target, state.draft, tree, state.seq.shape[0], path)
    state.book(tree.n, len(path))


def plain_step(state: RoundState) -> list[int]:
    """A round without drafting (no room left): one target step, booked as a round of K = 0."""
    state.book(0, 0)
    return state.decoder.target_step(state)
