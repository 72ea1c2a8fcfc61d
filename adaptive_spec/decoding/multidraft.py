"""Multi-draft speculative decoding with i.i.d. draft sequences: SpecTr and batch SD.

Each round the draft samples `num_drafts` independent sequences of `k` tokens (with replacement:
two drafts may share a prefix or be identical). They are merged into a prefix tree (trie), so a
shared prefix is scored once, and the target verifies the whole trie in ONE forward pass with the
tree attention mask of `adaptive_spec.decoding.trees.verify`; both caches are then compacted to the accepted path.

  * SpecTr (Sun et al., "SpecTr: Fast Speculative Decoding via Optimal Transport"), Algorithm 3
    draft selection: at a reached node the next tokens of the drafts through it are i.i.d. samples
    X_1..X_n from the draft's q; K-SEQ (Algorithm 2) picks Y: X_i is accepted with probability
    min(1, p(X_i) / (gamma q(X_i))), the first accepted is Y, else Y ~ p_res. gamma* solves
    1 - (1 - beta(gamma))^n = gamma beta(gamma), beta(gamma) = sum_x min(q(x), p(x)/gamma), found by
    bisection on [1, n] (the valid side is kept). The path goes on with the drafts whose next token
    is Y (Y may come from p_res and still match a draft).
  * Batch SD (Algorithm 4 of "A theoretical perspective on speculative decoding"; that paper names
    the draft p and the target q): the drafts' first tokens are tried in turn, each accepted with
    probability min(1, p(x)/q(x)), the target's distribution replaced by norm(max(p - q, 0)) after
    each rejection (the draft's stays: samples were drawn with replacement). Once a first token is
    accepted, only that draft is followed, with standard speculative sampling; if all are rejected
    the next token is drawn from the last residual.
Here p is the target's processed distribution and q the draft's, as in sampling.py.

Building the trie reads each level's sampled tokens to the host (one small read per level); the
verification itself does one host read per round."""
from __future__ import annotations

import torch

from ..errors import UserError
from .interfaces import RoundOwner, RoundState, register
from .sampling import residual, sample, verify
from .trees.draft import DraftTree
from .trees.verify import finish_round, match_children, plain_step, read_path, target_pass, verify_greedy

METHODS = ("spectr", "batch-sd")


def draft_trie(draft, seq, sampling, gen, num_drafts: int, k: int):
    """Sample num_drafts i.i.d. draft sequences of k tokens into a trie. Returns (tree, the node
    ids of each draft's tokens [num_drafts][k])."""
    tree = DraftTree(draft, seq, sampling, gen, num_drafts * k, max_children=0)
    cur = [0] * num_drafts
    paths = [[] for _ in range(num_drafts)]
    for d in range(1, k + 1):
        rows = torch.tensor([tree.row[c] for c in cur], device=tree.device)
        x = sample(tree.q[rows], gen).tolist()
        index, new = {}, []
        for m in range(num_drafts):
            key = (cur[m], x[m])
            if key not in index:
                hit = next((c for c in tree.children[cur[m]] if tree.tok_host[c] == x[m]), None)
                if hit is None:
                    hit = tree.new_node(cur[m], len(tree.children[cur[m]]), token_host=x[m])
                    new.append(hit)
                index[key] = hit
            cur[m] = index[key]
            paths[m].append(cur[m])
        if new:
            tree.tok[torch.tensor(new, device=tree.device)] = torch.tensor([tree.tok_host[j] for j in new],
                                                                          device=tree.device)
        if d < k and new:
            tree.forward_nodes(new)
    return tree, paths


def kseq_gamma(p: torch.Tensor, q: torch.Tensor, n: torch.Tensor, iters: int = 50) -> torch.Tensor:
    """gamma* of K-SEQ per row by bisection: the root in [1, n] of
    f(gamma) = 1 - (1 - beta(gamma))^n - gamma beta(gamma), beta(gamma) = sum min(q, p / gamma).
    f decreases in gamma (f(1) >= 0 >= f(n)); the upper end of the bracket is returned, so that
    f(gamma) <= 0, the condition under which K-SEQ is a valid coupling (Theorem 2). f is evaluated
    as sum max(p - gamma q, 0) - (sum max(q - p / gamma, 0))^n, the same quantity without the
    cancellation against 1 that would swamp it in float32 when p is close to q.
    Both sums only involve the tokens whose ratio t = p/q lies above (resp. below) gamma, so the
    rows are sorted by t once and each bisection step is a binary search on prefix sums (float64)
    instead of a pass over the vocabulary."""
    B = p.shape[0]
    p64, q64 = p.double(), q.double()
    t = torch.where(q64 > 0, p64 / q64.clamp_min(1e-300), torch.where(p64 > 0, torch.inf, 1.0))
    t, order = torch.sort(t, dim=-1)
    cp = torch.cat([p64.new_zeros(B, 1), p64.gather(1, order).cumsum(-1)], dim=-1)
    cq = torch.cat([q64.new_zeros(B, 1), q64.gather(1, order).cumsum(-1)], dim=-1)
    n = n.to(torch.float64)
    lo, hi = torch.ones_like(n), n.clone()
    for _ in range(iters):
        mid = (lo + hi) / 2
        g = mid.view(-1, 1)
        below = torch.searchsorted(t, g, right=False)  # tokens with t < gamma
        above = torch.searchsorted(t, g, right=True)  # tokens with t <= gamma
        b_sum = (cq.gather(1, below) - cp.gather(1, below) / g)[:, 0]  # sum max(q - p/gamma, 0)
        a_sum = ((cp[:, -1:] - cp.gather(1, above)) - g * (cq[:, -1:] - cq.gather(1, above)))[:, 0]
        f = a_sum.clamp_min(0) - b_sum.clamp_min(0) ** n
        ok = f <= 0
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid)
    return hi.to(p.dtype)


def kseq(p: torch.Tensor, q: torch.Tensor, xs: torch.Tensor, n: torch.Tensor, gen) -> torch.Tensor:
    """K-SEQ (SpecTr Algorithm 2) for a batch of rows: p target [B, V], q draft [B, V], xs [B, K]
    i.i.d. draft samples (the first n[b] of row b are real). Returns Y [B], distributed as p."""
    B, K = xs.shape
    gamma = kseq_gamma(p, q, n)
    mins = torch.minimum(q, p / gamma.view(-1, 1))
    beta = mins.sum(-1)
    p_acc = 1 - (q - mins).sum(-1) ** n.to(p.dtype)  # 1 - (1 - beta)^n
    scale = torch.where(beta > 0, p_acc / beta.clamp_min(1e-30), torch.zeros_like(beta))
    res = (p - mins * scale.view(-1, 1)).clamp_min(0)
    res = torch.where(res.sum(-1, keepdim=True) > 0, res / res.sum(-1, keepdim=True).clamp_min(1e-30), p)
    y = sample(res, gen)
    eta = torch.rand(B, K, generator=gen, device=p.device)
    px, qx = p.gather(1, xs), q.gather(1, xs)
    real = torch.arange(K, device=p.device).view(1, -1) < n.view(-1, 1)
    ok = real & (eta * gamma.view(-1, 1) * qx <= px) & (qx > 0)
    first = ok.long().argmax(-1)
    return torch.where(ok.any(-1), xs.gather(1, first.view(-1, 1))[:, 0], y)


def verify_spectr(tree, paths, P: torch.Tensor, gen):
    """SpecTr draft selection over the trie: per node the K-SEQ choice among the next tokens of
    the drafts through it (leaves: a sample from P). Same return as tree.verify_gsd."""
    tok = sample(P, gen)
    through = {}
    for path in paths:
        prev = 0
        for j in path:
            through.setdefault(prev, []).append(j)
            prev = j
    internal = sorted(through)
    if internal:
        K = max(len(v) for v in through.values())
        xs = [through[v] + [0] * (K - len(through[v])) for v in internal]
        dev = P.device
        nodes = torch.tensor(xs, device=dev)
        n = torch.tensor([len(through[v]) for v in internal], device=dev)
        iv = torch.tensor(internal, device=dev)
        q = tree.q[torch.tensor([tree.row[v] for v in internal], device=dev)]
        tok[iv] = kseq(P[iv], q, tree.tok[nodes], n, gen)
    return match_children(tree, tok), tok


def verify_batch_sd(tree, paths, P: torch.Tensor, gen):
    """Batch SD (Algorithm 4): returns device tensors (first accepted draft or -1, the root's
    fallback token, per draft: tokens accepted after its first, the token drawn after them)."""
    dev = P.device
    M = len(paths)
    q0 = tree.q[tree.row[0]]
    p_cur = P[0].clone()
    first = torch.tensor(-1, device=dev)
    u = torch.rand(M, generator=gen, device=dev)
    x = tree.tok[torch.tensor([path[0] for path in paths], device=dev)]
    for m in range(M):
        free = first < 0
        ok = free & (u[m] * q0[x[m]] < p_cur[x[m]])
        first = torch.where(ok, torch.tensor(m, device=dev), first)
        p_cur = torch.where(free & ~ok, residual(p_cur, q0), p_cur)
    root_tok = sample(p_cur, gen)
    ns, toks = [], []
    for path in paths:
        idx = torch.tensor(path, device=dev)
        y = tree.tok[idx[1:]]
        q = tree.q[torch.tensor([tree.row[j] for j in path[:-1]], device=dev)] if len(path) > 1 \
            else P.new_empty(0, P.shape[-1])
        n_m, t_m = verify(y, q, P[idx], gen)
        ns.append(n_m)
        toks.append(t_m)
    return first, root_tok, torch.stack(ns), torch.stack(toks)


class MultiDraftPolicy(RoundOwner):
    def __init__(self, method: str, num_drafts: int = 4, k: int = 4):
        if method not in METHODS:
            raise UserError(f"unknown multi-draft method {method!r}; use one of {', '.join(METHODS)}")
        for name, v in (("num_drafts", num_drafts), ("k", k)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"{name} must be an integer >= 1, got {v!r}")
        self.method, self.num_drafts, self.k = method, num_drafts, k
        self.name = method
        self.k_max = k
        self.reset()

    def reset(self):
        # per-generation counts for the sweep's rows (sweep_run.tree_stats): rounds and the drafted
        # tries' depths (k, less where a draft ended early or the length limit cut the round)
        self.rounds = 0
        self.depth_sum = 0

    def describe(self) -> dict:
        return {"policy": self.name, "num_drafts": self.num_drafts, "k": self.k}

    def run_round(self, state: RoundState) -> list[int]:
        cap = min(self.k, state.remaining - 1)  # never draft past the length limit
        self.rounds += 1
        if cap <= 0:
            return plain_step(state)
        tree, paths = draft_trie(state.draft, state.seq, state.sampling, state.gen, self.num_drafts, cap)
        self.depth_sum += max(tree.depth)
        P = target_pass(state.target, state.seq, tree, state.sampling)
        if self.method == "batch-sd":
            path, nxt = _batch_sd_path(tree, paths, P, state.gen)
        else:
            child, tok = verify_greedy(tree, P) if state.sampling.greedy else verify_spectr(tree, paths, P, state.gen)
            path, _, nxt, _ = read_path(tree, child, tok)
        finish_round(state, tree, path)
        return [tree.tok_host[j] for j in path] + [nxt]


def _batch_sd_path(tree, paths, P: torch.Tensor, gen) -> tuple[list[int], int]:
    """Batch SD's accepted path (node ids) and next token, read to the host in one go."""
    first, root_tok, ns, toks = verify_batch_sd(tree, paths, P, gen)
    vals = torch.cat([first.view(1), root_tok.view(1), ns, toks]).tolist()
    M, f = len(paths), vals[0]
    if f < 0:
        return [], vals[1]
    return paths[f][:1 + vals[2 + f]], vals[2 + M + f]


# SpecTr (K-SEQ draft selection) and batch SD: num_drafts i.i.d. drafts of k tokens each (default 4 x 4)
register("spectr")(lambda p, ctx: MultiDraftPolicy("spectr", p.num_drafts, p.k))
register("batch-sd")(lambda p, ctx: MultiDraftPolicy("batch-sd", p.num_drafts, p.k))
