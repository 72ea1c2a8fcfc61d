"""Tree shapes and the 0-th order acceptance model they are chosen by.

Shapes (parents, sibs: node 0 is the root, parents[j] < j, sibs[j] the sibling index of node j): sequence,
batch (k siblings at the root), SpecInfer-style (a trunk of 2, then 3 chains), and the optimal tree for k
drafted tokens (ERSD's Algorithm 3: a priority queue ordered by acceptance probability R, O(k log k)).
Under the 0-th order model R of a vertex is the product of the rates r_i of the sibling indices on its
path; r comes from conditional rates c_i (`acceptance_distribution`), measured and adapted by
`PositionalRates`."""
from __future__ import annotations

import heapq
import json
import math
from pathlib import Path

from ...errors import UserError

# Prior conditional acceptance rates c_i = P(sibling i accepted | siblings 0..i-1 rejected), used until
# rates are calibrated or adapted: each later sibling is less likely accepted than the one before.
DEFAULT_COND_RATES = (0.6, 0.3, 0.2, 0.15, 0.12, 0.1)
DRAFTINGS = ("tree", "sequence", "batch", "specinfer")
# shapes whose n-node tree is the first n nodes of their k-node tree (k > n): a learned budget
# can grow them node by node (SpecInfer's trunk and chains re-split with every budget)
NESTED = ("tree", "sequence", "batch")


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
    parents += range(t)
    sibs += [0] * t
    rest = k - t
    lens = [rest // branches + (1 if b < rest % branches else 0) for b in range(branches)]
    for b, n in enumerate(lens):
        prev = t
        for i in range(n):
            parents.append(prev)
            sibs.append(b if i == 0 else 0)
            prev = len(parents) - 1
    return parents, sibs


def node_values(parents: list[int], sibs: list[int], r: list[float]) -> list[float]:
    """R of every node (R[0] = 1, the root) under the 0-th order model r."""
    R = [1.0]
    for j in range(1, len(parents)):
        s = sibs[j]
        R.append(R[parents[j]] * (r[s] if s < len(r) else 0.0))
    return R


def tree_value(parents: list[int], sibs: list[int], r: list[float]) -> float:
    """Expected accepted tokens per round, sum_v R(v), of a tree under the 0-th order model r."""
    return sum(node_values(parents, sibs, r)[1:])


def worth_growing(R_next: float, n: int, S: float, node_cost: float) -> bool:
    """The learned budget's stop rule: is one more drafted node, accepted with probability R_next, worth its
    cost, in a round that has drafted n nodes with predicted accepted tokens S = sum R?

    A round of n nodes takes about t_target (1 + n c), c = node_cost = (t_draft + t_cand) / t_target, and
    yields 1 + S tokens, so its throughput is T(n) = (1 + S) / (1 + n c) tokens per target step and
        T(n + 1) > T(n)  <=>  R_next (1 + n c) > c (1 + S)  <=>  R_next / c > T(n):
    grow while the next node's yield per unit of cost beats the round's average so far. Stopping at the
    first failure is optimal: T(n + 1) is the mediant of T(n) and R_next / c, so once R_next / c <= T(n)
    the rule fails at every later n too when R comes non-increasing (Algorithm 3's pop order), and
    Algorithm 3's trees are nested, so the first failure gives the best optimal tree up to the budget.

    Every node is charged a full draft step (the CPU regime, where a wave's cost grows with its width);
    where a wide forward costs about one step (a GPU) pass a smaller tree_node_cost. At least one node is
    always drafted: a round without drafting would stop measuring the acceptance rates."""
    return n == 0 or R_next * (1.0 + n * node_cost) > node_cost * (1.0 + S)


def learned_size(R: list[float], node_cost: float) -> int:
    """How many nodes to draft, 1..len(R), from the R of the candidates in drafting order (a
    nested shape: the first n nodes form the shape of budget n): grow while `worth_growing`."""
    n, S = 0, 0.0
    for x in R:
        if not worth_growing(x, n, S, node_cost):
            break
        n, S = n + 1, S + x
    return n


def shape_tree(drafting: str, k: int, r: list[float], depth_cap: int | None = None,
               max_children: int | None = None):
    """(parents, sibs) of a named drafting strategy with k drafted tokens, cut at depth_cap and
    at max_children children per node (the vocabulary size, for tiny vocabularies)."""
    if drafting == "tree":
        parents, sibs, _ = optimal_tree(k, r[:max_children] if max_children else r, depth_cap)
        return parents, sibs
    fixed = {"sequence": sequence_tree, "batch": batch_tree, "specinfer": specinfer_tree}
    if drafting not in fixed:
        raise UserError(f"unknown drafting {drafting!r}; use one of {', '.join(DRAFTINGS)}")
    parents, sibs = fixed[drafting](k)
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
    head = r[:d]
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

    def state(self) -> tuple[list[float], list[float]]:
        """A copy of the counts, for `load_state` (a policy restores its calibrated rates)."""
        return list(self.trials), list(self.hits)

    def load_state(self, state: tuple[list[float], list[float]]) -> None:
        # in place: an estimator shared by several policies (a calibration run) sees it too
        self.trials[:], self.hits[:] = state

    def to_dict(self) -> dict:
        return {"cond_rates": self.cond(), "trials": self.trials, "hits": self.hits}
