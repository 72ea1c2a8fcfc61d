"""Tree drafting and exact tree verification: GSD (recursive rejection) and ERSD (exponential races).

A round drafts a token tree with the draft model and verifies ALL of it in ONE target forward
pass, using a tree attention mask (each drafted token sees the accepted prefix, its ancestors and
itself) and tree position ids (prefix length + depth - 1). The longest accepted root-to-node path
is kept, and both KV caches are compacted to exactly that path.

Node 0 is the root (the context: the accepted sequence), nodes 1..N are drafted tokens. The
children of a node are the first arrivals of an exponential race under the draft's distribution
Q at that node, i.e. draws WITHOUT replacement in order (Gumbel-top-k); the i-th child is the
node's "sibling index i". At temperature 0 the children are the draft's top tokens instead.

Verification (Kobus & Gunduz, "Speculative Decoding via Exponential Races", appendix A):
  * GSD, Algorithm 4: at a reached node, children are tested in order; child i is accepted with
    probability min(1, P_i(x_i) / Q_i(x_i)); on a rejection P_{i+1} = norm(max(P_i - Q_i, 0)) and
    Q_{i+1} = Q_i with x_i removed, renormalised (sampling without replacement). If all children are
    rejected, the next token is drawn from the last residual; at a leaf, from P.
  * ERSD, Algorithm 5: the race e that drafted the children is reused for the target: the winner
    argmin e / P is an exact sample from P; the path goes on while the winner is a drafted child.
  * temperature 0: the path follows the target's argmax while it is a drafted child.
Both are exact for any tree shape chosen from information available before each token is drawn.

Tree shapes: sequence (a chain), batch (k siblings at the root), SpecInfer-style (a shared trunk
of 2 tokens, then 3 chains), and the optimal tree for a budget of k drafted tokens (Algorithm 3: a
priority queue over candidate vertices ordered by their acceptance probability R, O(k log k)).
R comes from (a) measured positional acceptance rates, the 0-th order model of the paper (R of a
vertex is the product of the acceptance distribution r_i over the sibling indices on its path), or
(b) a trained acceptance head (`adaptive_spec.heads.AcceptanceHead`) on the draft's hidden state
of each drafted token, which refines R of the first-child chain per context, SpecDec++ style:
R(v) = R(parent) * a(h_v). The head only ever steers the drafting of LATER tokens (children of v,
later siblings), never whether v itself is kept, so verification stays exact.
"""
from __future__ import annotations

import heapq
import json
import math
import time
from pathlib import Path

import torch

from .errors import UserError
from .policies import StopPolicy, register
from .sampling import SamplingParams, process_logits, residual, sample

# Conditional acceptance rates c_i = P(sibling i accepted | siblings 0..i-1 rejected) used before
# any measurement: a first draft token accepted ~60% of the time, later siblings less and less.
DEFAULT_COND_RATES = (0.6, 0.3, 0.2, 0.15, 0.12, 0.1)
DRAFTINGS = ("tree", "sequence", "batch", "specinfer")


# ---- model operations on a CausalLM (or a mock with tree_forward / compact) --------------------

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
                  past_key_values=lm.cache, use_cache=True)
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


# ---- tree shapes ----------------------------------------------------------------------------

def acceptance_distribution(cond, n: int) -> list[float]:
    """r_i = c_i * prod_{j<i} (1 - c_j), i < n: the probability that the i-th sibling is the one
    accepted (the 0-th order acceptance distribution R of the paper). c beyond its end repeats
    its last value."""
    out, reach = [], 1.0
    for i in range(n):
        c = cond[min(i, len(cond) - 1)]
        out.append(reach * c)
        reach *= 1.0 - c
    return out


def optimal_tree(k: int, r: list[float], depth_cap: int | None = None):
    """Algorithm 3 (ERSD paper): the k-vertex tree maximising sum_v R(v) for a 0-th order R.

    r: the acceptance distribution over sibling indices (len(r) = the most children a vertex may
    get). R(v) = prod of r over the sibling indices on v's path. A max-priority queue holds
    candidate vertices; popping v adds v and pushes its first child and its next sibling, so the
    queue holds at most 2k entries: O(k log k). Returns (parents, sibs, R) for nodes 1..k in pop
    order (parents[0] = -1 is the root; a parent always precedes its children)."""
    parents, sibs, R, depth = [-1], [0], [1.0], [0]
    if k <= 0 or not r:
        return parents, sibs, R
    heap = [(-r[0], 0, 0, 0)]  # (-R, tie-break, parent, sibling index)
    tick = 1
    while heap and len(parents) <= k:
        negR, _, p, s = heapq.heappop(heap)
        j = len(parents)
        parents.append(p)
        sibs.append(s)
        R.append(-negR)
        depth.append(depth[p] + 1)
        if depth_cap is None or depth[j] < depth_cap:
            heapq.heappush(heap, (negR * r[0], tick, j, 0))
            tick += 1
        if s + 1 < len(r) and r[s + 1] > 0:
            heapq.heappush(heap, (-R[p] * r[s + 1], tick, p, s + 1))
            tick += 1
    return parents, sibs, R


def sequence_tree(k: int):
    return [-1] + list(range(k)), [0] * (k + 1)


def batch_tree(k: int):
    return [-1] + [0] * k, [0] + list(range(k))


def specinfer_tree(k: int, trunk: int = 2, branches: int = 3):
    """SpecInfer-style fixed tree: a trunk of `trunk` tokens, then `branches` chains sharing it,
    the rest of the budget split as evenly as possible (the first chains get the extra)."""
    parents, sibs = [-1], [0]
    t = min(trunk, k)
    for i in range(t):
        parents.append(i)
        sibs.append(0)
    rest = k - t
    lens = [rest // branches + (1 if b < rest % branches else 0) for b in range(branches)]
    for b, n in enumerate(lens):
        prev = t
        for i in range(n):
            parents.append(prev)
            sibs.append(b if i == 0 else 0)
            prev = len(parents) - 1
    return parents, sibs


def tree_value(parents: list[int], sibs: list[int], r: list[float]) -> float:
    """Expected accepted tokens per round, sum_v R(v), of a tree under the 0-th order model r."""
    R = [1.0]
    for j in range(1, len(parents)):
        s = sibs[j]
        R.append(R[parents[j]] * (r[s] if s < len(r) else 0.0))
    return sum(R[1:])


def shape_tree(drafting: str, k: int, r: list[float], depth_cap: int | None = None,
               max_children: int | None = None):
    """(parents, sibs) of a named drafting strategy with k drafted tokens, cut at depth_cap and
    at max_children children per node (the vocabulary size, for tiny vocabularies)."""
    if drafting == "tree":
        parents, sibs, _ = optimal_tree(k, r[:max_children] if max_children else r, depth_cap)
        return parents, sibs
    if drafting == "sequence":
        parents, sibs = sequence_tree(k)
    elif drafting == "batch":
        parents, sibs = batch_tree(k)
    elif drafting == "specinfer":
        parents, sibs = specinfer_tree(k)
    else:
        raise UserError(f"unknown drafting {drafting!r}; use one of {', '.join(DRAFTINGS)}")
    if depth_cap is not None or max_children is not None:
        parents, sibs = _prune(parents, sibs, depth_cap, max_children)
    return parents, sibs


def _prune(parents, sibs, cap, max_children):
    """Drop the nodes deeper than cap or with a sibling index >= max_children (and their subtrees)."""
    cap = cap if cap is not None else len(parents)
    max_children = max_children if max_children is not None else len(parents)
    depth, keep, new_id = [0], [0], {0: 0}
    for j in range(1, len(parents)):
        depth.append(depth[parents[j]] + 1)
        if depth[j] <= cap and sibs[j] < max_children and parents[j] in new_id:
            new_id[j] = len(keep)
            keep.append(j)
    return [-1] + [new_id[parents[j]] for j in keep[1:]], [0] + [sibs[j] for j in keep[1:]]


def tunstall_bound(r: list[float], k: int, vocab_size: int) -> float:
    """Upper bound on the expected generated tokens per target pass (accepted + 1) of the optimal
    tree with k drafted tokens: Theorem 4.1 of the ERSD paper, in the tightened form of its Lemma
    4.2, minimised over m. d = the largest sibling index (1-based) the optimal tree explores;
    R_res = (r_1..r_d, p_res) with p_res = 1 - sum_{i<=d} r_i spread evenly over m >= p_res /
    min r further indices:  (log(d + m) + log(k + 1)) / (H[R_res] + p_res log m). Capped at k + 1
    (a round never yields more)."""
    if k <= 0:
        return 1.0
    _, sibs, _ = optimal_tree(k, r)
    d = max(sibs[1:]) + 1
    head = [x for x in r[:d]]
    p_res = max(0.0, 1.0 - sum(head))
    h = -sum(x * math.log(x) for x in head if x > 0) - (p_res * math.log(p_res) if p_res > 0 else 0.0)
    min_r = min(x for x in head if x > 0) if any(x > 0 for x in head) else 1.0
    m0 = max(1, math.ceil(p_res / min_r - 1e-12))
    best = float("inf")
    cands = set(range(m0, m0 + 64))
    m = m0
    while m < vocab_size:
        cands.add(m)
        m = max(m + 1, int(m * 1.25))
    for m in cands:
        if m + d > max(vocab_size, d + 1):
            continue
        den = h + (p_res * math.log(m) if m > 1 else 0.0)
        if den <= 0:
            continue
        best = min(best, (math.log(d + m) + math.log(k + 1)) / den)
    return min(best, k + 1.0)


# ---- acceptance-rate estimation -------------------------------------------------------------

def load_rates(path, method: str = "gsd") -> list[float]:
    """Conditional rates c_i from a JSON file: a list, {"cond_rates": [...]}, or the
    calibration.json of eval/bench_trees.py ({"gsd": {"cond_rates": ...}, "ersd": ...})."""
    p = Path(path).expanduser()
    fix = "pass a JSON list of rates or a calibration.json written by eval/bench_trees.py"
    if not p.is_file():
        raise UserError(f"acceptance-rate file {p} does not exist; {fix}")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"acceptance-rate file {p} is not valid JSON ({e}); {fix}") from None
    if isinstance(d, dict) and "cond_rates" not in d and isinstance(d.get(method), dict):
        d = d[method]
    rates = d.get("cond_rates") if isinstance(d, dict) else d
    if not isinstance(rates, list):
        raise UserError(f"acceptance-rate file {p} holds no rates for {method}; {fix}")
    return rates


class PositionalRates:
    """Running estimate of the 0-th order conditional acceptance rates c_i per sibling index.

    Counts start from a prior (c_i with `weight` pseudo-observations each) and, if `adapt`, grow
    with every verified node: a node with m drafted children whose child `idx` was taken (None:
    all rejected) counts as a trial for sibling indices 0..min(idx, m-1), a success at idx.
    `rates` may be a list of c_i or a JSON file holding one (key "cond_rates")."""

    def __init__(self, rates=None, weight: float = 4.0, adapt: bool = True, max_index: int = 64,
                 method: str = "gsd"):
        if isinstance(rates, (str, Path)):
            rates = load_rates(rates, method)
        prior = list(rates) if rates is not None else list(DEFAULT_COND_RATES)
        if not prior or not all(0.0 <= float(c) <= 1.0 for c in prior):
            raise UserError(f"acceptance rates must be a non-empty list of numbers in [0, 1], got {rates!r}")
        prior = [float(c) for c in prior]
        self.max_index = max_index
        self.adapt = adapt
        ext = [prior[min(i, len(prior) - 1)] for i in range(max_index)]
        self.trials = [weight] * max_index
        self.hits = [weight * c for c in ext]

    def cond(self) -> list[float]:
        return [h / t if t > 0 else 0.0 for h, t in zip(self.hits, self.trials)]

    def dist(self, n: int | None = None) -> list[float]:
        return acceptance_distribution(self.cond(), n or self.max_index)

    def update(self, m: int, idx: int | None):
        if not self.adapt or m <= 0:
            return
        last = min(m - 1 if idx is None else idx, self.max_index - 1)
        for j in range(last + 1):
            self.trials[j] += 1
        if idx is not None and idx < self.max_index:
            self.hits[idx] += 1

    def to_dict(self) -> dict:
        return {"cond_rates": self.cond(), "trials": self.trials, "hits": self.hits}


# ---- the draft tree -------------------------------------------------------------------------

class DraftTree:
    """A drafted token tree with the draft's distributions at its forwarded nodes.

    Node 0 is the root; for every node: parent, depth, sibling index, children (in sibling order),
    its token (device tensor `tok`, and `tok_host` where known) and, when the draft was run on it,
    the draft's processed distribution Q, the ranking of candidate children and (for races) the
    exponentials e. The draft cache holds the prefix seq[:L] then forwarded nodes in `slot` order.
    """

    def __init__(self, draft, seq: torch.Tensor, sampling: SamplingParams, gen: torch.Generator,
                 max_nodes: int, max_children: int = 0):
        self.draft, self.sampling, self.gen = draft, sampling, gen
        self.device = seq.device
        self.L = seq.shape[0]
        self.V = draft.vocab_size
        self.greedy = sampling.greedy
        self.max_children = min(max_children, self.V)
        self.parent, self.depth, self.sib, self.children = [-1], [0], [0], [[]]
        self.tok = torch.zeros(max_nodes + 1, dtype=torch.long, device=self.device)
        self.tok_host: list[int | None] = [None]
        self.slot: list[int | None] = [None]
        self.n_fwd = 0
        self.row: dict[int, int] = {}  # node -> row of q/e/order
        self._q, self._e, self._order, self._hidden = [], [], [], []
        self.q = self.e = self.order = self.hidden = None
        logits, h = draft.forward(seq[draft.length:], n_logits=1)
        self._add_dists([0], logits, h.view(1, -1))

    @property
    def n(self) -> int:
        return len(self.parent) - 1

    def _add_dists(self, nodes, logits, hidden):
        q = process_logits(logits, self.sampling)
        base = sum(x.shape[0] for x in self._q)
        for i, j in enumerate(nodes):
            self.row[j] = base + i
        self._q.append(q)
        self._hidden.append(hidden)
        if self.max_children:
            if self.greedy:
                rank = logits.float()
                self._e.append(None)
            else:
                e = torch.empty_like(q).exponential_(1.0, generator=self.gen)
                rank = q / e  # the race: arrival order = draws without replacement from q
                self._e.append(e)
            self._order.append(torch.topk(rank, self.max_children, dim=-1).indices)
        self.q = torch.cat(self._q) if len(self._q) > 1 else self._q[0]
        self.hidden = torch.cat(self._hidden) if len(self._hidden) > 1 else self._hidden[0]
        if self.max_children:
            self.order = torch.cat(self._order) if len(self._order) > 1 else self._order[0]
            if not self.greedy:
                self.e = torch.cat(self._e) if len(self._e) > 1 else self._e[0]

    def new_node(self, parent: int, sib: int, token_host: int | None = None) -> int:
        j = len(self.parent)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.sib.append(sib)
        self.children.append([])
        self.children[parent].append(j)
        self.tok_host.append(token_host)
        self.slot.append(None)
        return j

    def add_children(self, pairs: list[tuple[int, int]]) -> list[int]:
        """New nodes (parent, sibling index): token = the parent's sib-th ranked candidate."""
        if not pairs:
            return []
        new = [self.new_node(p, s) for p, s in pairs]
        rows = torch.tensor([self.row[p] for p, _ in pairs], device=self.device)
        cols = torch.tensor([s for _, s in pairs], device=self.device)
        self.tok[torch.tensor(new, device=self.device)] = self.order[rows, cols]
        return new

    def ancestors(self, j: int) -> list[int]:
        out = []
        while j > 0:
            out.append(j)
            j = self.parent[j]
        return out[::-1]

    def forward_nodes(self, nodes: list[int]) -> torch.Tensor:
        """Run the draft on `nodes` (their parents already forwarded) in one tree forward;
        returns their final hidden states [n, H]."""
        d = self.draft
        n, base = len(nodes), d.length
        attend = torch.zeros(n, base + n, dtype=torch.bool)
        attend[:, :self.L] = True
        for r, j in enumerate(nodes):
            for a in self.ancestors(self.parent[j]):
                attend[r, self.L + self.slot[a]] = True
            attend[r, base + r] = True
        idx = torch.tensor(nodes, device=self.device)
        pos = torch.tensor([self.L - 1 + self.depth[j] for j in nodes], device=self.device)
        logits, h = tree_forward(d, self.tok[idx], pos, attend.to(self.device))
        for r, j in enumerate(nodes):
            self.slot[j] = self.n_fwd + r
        self.n_fwd += n
        self._add_dists(nodes, logits, h)
        return h


def grow_static(tree: DraftTree, parents: list[int], sibs: list[int]):
    """Draft a fixed topology (parents/sibs, parent before child) depth by depth: one draft
    forward per level, over the nodes of that level that have children. The tree's node ids are
    assigned level by level, so they may differ from the topology's indices."""
    if len(parents) <= 1:
        return
    depth, has_kids = [0], [False] * len(parents)
    for j in range(1, len(parents)):
        depth.append(depth[parents[j]] + 1)
        has_kids[parents[j]] = True
    ids = {0: 0}
    for dl in range(1, max(depth) + 1):
        level = [j for j in range(1, len(parents)) if depth[j] == dl]
        level.sort(key=lambda j: (ids[parents[j]], sibs[j]))
        new = tree.add_children([(ids[parents[j]], sibs[j]) for j in level])
        for j, v in zip(level, new):
            ids[j] = v
        fwd = [ids[j] for j in level if has_kids[j]]
        if fwd:
            tree.forward_nodes(fwd)


def grow_with_head(tree: DraftTree, budget: int, r: list[float], head, depth_cap: int, met=None):
    """Priority-queue drafting (Algorithm 3) with R refined by an acceptance head.

    The draft runs in waves: pop every candidate whose key beats the best key a child of a
    not-yet-forwarded node could have (R(v) * r_0), forward all nodes popped in the wave at once,
    then set R(v) = R(parent) * a(h_v) for first children (the head's probability that v is
    accepted) and queue their children. With a constant head this is exactly Algorithm 3 with the
    0-th order R. Returns R of every node (the predicted accepted tokens are their sum)."""
    R = [1.0]
    heap = [(-r[0], 0, 0, 0)]
    tick, bound, wave = 1, 0.0, []
    while tree.n < budget:
        pairs = []
        while heap and tree.n + len(pairs) < budget and -heap[0][0] >= bound:
            negR, _, p, s = heapq.heappop(heap)
            pairs.append((p, s))
            R.append(-negR)
            d = tree.depth[p] + 1
            if d < depth_cap:
                bound = max(bound, -negR * r[0])
            if s + 1 < len(r) and r[s + 1] > 0:
                heapq.heappush(heap, (-R[p] * r[s + 1], tick, p, s + 1))
                tick += 1
        wave = tree.add_children(pairs)
        fwd = [j for j in wave if tree.depth[j] < depth_cap]
        if tree.n >= budget or (not heap and not fwd):
            break
        bound = 0.0
        if not fwd:
            continue
        h = tree.forward_nodes(fwd)
        t0 = time.perf_counter()
        a = head.acceptance_prob(h).float().clamp(0.0, 1.0).tolist()
        if met is not None:
            met.policy_s += time.perf_counter() - t0
        for j, aj in zip(fwd, a):
            if tree.sib[j] == 0:
                R[j] = R[tree.parent[j]] * aj
            heapq.heappush(heap, (-R[j] * r[0], tick, j, 0))
            tick += 1
    return R


# ---- verification ---------------------------------------------------------------------------

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
    logits, _ = tree_forward(target, ids, pos, attend.to(dev), logit_from=n_p - 1)
    return process_logits(logits, sampling)


def _children_matrix(tree, nodes):
    m = max(len(tree.children[v]) for v in nodes)
    mat = [[c for c in tree.children[v]] + [0] * (m - len(tree.children[v])) for v in nodes]
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
    return _match_children(tree, tok), tok


def _match_children(tree, tok):
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
    return _match_children(tree, tok), tok


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


def finish_round(decoder, tree, seq, path, met, hist) -> None:
    """Compact both caches to the accepted path and book the round in the metrics."""
    L = seq.shape[0]
    target, draft = decoder.target, decoder.draft
    if tree.n:
        compact_cache(target, L, [L + j - 1 for j in path])
        slots = []
        for j in path:
            if tree.slot[j] is None:
                break
            slots.append(L + tree.slot[j])
        compact_cache(draft, L, slots)
    n = len(path)
    met.n_drafted += tree.n
    met.n_accepted += n
    met.n_discarded += tree.n - n
    hist[n] += 1


def plain_step(decoder, seq, sampling, gen, hist) -> list[int]:
    """A round without drafting (no room left): one target step."""
    logits, _ = decoder.target.forward(seq[decoder.target.length:], n_logits=1)
    hist[0] += 1
    return [int(sample(process_logits(logits[0], sampling), gen))]


# ---- policies -------------------------------------------------------------------------------

def _load_head(head, pair):
    if head is None:
        raise UserError("tree_estimator 'head' needs an acceptance head: pass --head DIR (a head trained "
                        "for this draft)")
    if not hasattr(head, "acceptance_prob"):
        from .heads import AcceptanceHead

        draft = getattr(pair, "draft", None) if pair is not None else None
        hidden = draft.hidden_size if draft is not None else None
        dev = draft.device if draft is not None else None
        head = AcceptanceHead.from_pretrained(head, hidden_size=hidden, device=dev)
    if getattr(head, "feature", "token") != "token":
        # grow_with_head scores a node from its own state; a context head scores the parent's
        # next draw in expectation and cannot tell siblings apart.
        raise UserError("tree_estimator 'head' needs a head trained with feature=token; this one reads "
                        f"feature={head.feature}")
    return head


def _pos_int(name, v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise UserError(f"{name} must be an integer >= 1, got {v!r}")
    return v


class TreePolicy(StopPolicy):
    """Tree drafting with exact verification: method "gsd" (recursive rejection sampling) or
    "ersd" (exponential races); drafting "tree" (optimal, Algorithm 3), "sequence", "batch" or
    "specinfer"; R from "positional" rates or an acceptance "head".

    Per-generation statistics (reset by the decoder): rounds, predicted accepted tokens (sum of
    R over the drafted nodes, summed over rounds)."""

    def __init__(self, method: str = "gsd", drafting: str = "tree", budget: int = 8, estimator: str = "positional",
                 head=None, rates=None, adapt_rates: bool = True, name: str | None = None):
        if method not in ("gsd", "ersd"):
            raise UserError(f"unknown tree verification {method!r}; use gsd or ersd")
        if drafting not in DRAFTINGS:
            raise UserError(f"unknown drafting {drafting!r}; use one of {', '.join(DRAFTINGS)}")
        if estimator not in ("positional", "head"):
            raise UserError(f"unknown tree estimator {estimator!r}; use positional or head")
        if estimator == "head" and drafting != "tree":
            raise UserError("tree_estimator 'head' builds the optimal tree; use it with drafting 'tree'")
        if estimator == "head" and not hasattr(head, "acceptance_prob"):
            raise UserError("tree_estimator 'head' needs an acceptance head (an AcceptanceHead, or pass --head DIR)")
        self.method, self.drafting, self.budget, self.estimator = method, drafting, _pos_int("tree budget", budget), estimator
        self.head = head
        self.rates = rates if isinstance(rates, PositionalRates) else PositionalRates(rates, adapt=adapt_rates,
                                                                                      method=method)
        self.name = name or ("tree" if method == "gsd" else "ersd")
        self.k_max = self.budget
        self.reset()

    def reset(self):
        self.rounds = 0
        self.predicted = 0.0

    def describe(self) -> dict:
        return {"policy": self.name, "method": self.method, "drafting": self.drafting, "tree_budget": self.budget,
                "tree_estimator": self.estimator, "cond_rates": [round(c, 4) for c in self.rates.cond()[:8]]}

    def run_round(self, decoder, seq, pos, remaining, sampling, gen, met, hist) -> list[int]:
        cap = min(self.budget, remaining - 1)
        self.rounds += 1
        if cap <= 0:
            return plain_step(decoder, seq, sampling, gen, hist)
        r = self.rates.dist(min(self.budget, decoder.draft.vocab_size))
        if self.estimator == "head":
            tree = DraftTree(decoder.draft, seq, sampling, gen, self.budget, max_children=self.budget)
            R = grow_with_head(tree, self.budget, r, self.head, depth_cap=cap, met=met)
            self.predicted += sum(R[1:])
        else:
            parents, sibs = shape_tree(self.drafting, self.budget, r, depth_cap=cap,
                                       max_children=decoder.draft.vocab_size)
            self.predicted += tree_value(parents, sibs, r)
            tree = DraftTree(decoder.draft, seq, sampling, gen, len(parents) - 1,
                             max_children=max(sibs) + 1 if len(sibs) > 1 else 0)
            grow_static(tree, parents, sibs)
        P = target_pass(decoder.target, seq, tree, sampling)
        if sampling.greedy:
            child, tok = verify_greedy(tree, P)
        elif self.method == "gsd":
            child, tok = verify_gsd(tree, P, gen)
        else:
            child, tok = verify_race(tree, P, gen)
        path, path_tok, nxt, outcomes = read_path(tree, child, tok)
        finish_round(decoder, tree, seq, path, met, hist)
        for m, idx in outcomes:
            self.rates.update(m, idx)
        return path_tok + [nxt]


def _budget(*vals, default):
    for v in vals:
        if v is not None:
            return v
    return default


def _resolve_head(estimator, head, pair):
    return _load_head(head, pair) if estimator == "head" else None


@register("tree")
def _make_tree(tree_budget=None, tree_estimator=None, head=None, drafting=None, k=None, tree_rates=None,
               adapt_rates=True, pair=None, **_):
    """GSD tree drafting: tree_budget drafted tokens per round (default: k, else 8)."""
    est = tree_estimator or "positional"
    return TreePolicy("gsd", drafting or "tree", _budget(tree_budget, k, default=8), est,
                      _resolve_head(est, head, pair), tree_rates, adapt_rates, name="tree")


@register("ersd")
def _make_ersd(drafting=None, num_drafts=None, tree_budget=None, k=None, tree_estimator=None, head=None,
               tree_rates=None, adapt_rates=True, pair=None, **_):
    """Exponential-race SD. drafting sequence (k tokens), batch (num_drafts alternatives for the
    next token), tree (optimal tree of tree_budget tokens), specinfer (tree_budget)."""
    drafting = drafting or "tree"
    if drafting == "sequence":
        budget = _budget(k, tree_budget, default=4)
    elif drafting == "batch":
        budget = _budget(num_drafts, tree_budget, k, default=4)
    else:
        budget = _budget(tree_budget, k, default=8)
    est = tree_estimator or "positional"
    return TreePolicy("ersd", drafting, budget, est, _resolve_head(est, head, pair), tree_rates, adapt_rates,
                      name="ersd")
