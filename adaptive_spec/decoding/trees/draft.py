"""The drafted token tree: nodes, the draft's distributions at them, and how it grows.

Node 0 is the root (the context: the accepted sequence), nodes 1..N are drafted tokens. The
children of a node are the first arrivals of an exponential race under the draft's distribution
Q at that node, i.e. draws WITHOUT replacement in order (Gumbel-top-k); the i-th child is the
node's "sibling index i". At temperature 0 the children are the draft's top tokens instead.

A tree grows either to a fixed topology (`grow_static`) or by Algorithm 3's priority queue with
R refined by an acceptance head on each drafted token's hidden state (`grow_with_head`), which
a learned budget stops as soon as the next node is not worth its cost."""
from __future__ import annotations

import heapq

import torch

from ..sampling import SamplingParams, process_logits
from .shapes import worth_growing


class DraftTree:
    """A drafted token tree with the draft's distributions at its forwarded nodes.

    Node 0 is the root; for every node: parent, depth, sibling index, children (in sibling order),
    its token (device tensor `tok`, and `tok_host` where known) and, when the draft was run on it,
    the draft's processed distribution Q, the ranking of candidate children and (for races) the
    exponentials e. The draft cache holds the prefix seq[:L] then forwarded nodes in `slot` order."""

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
        self.row.update((j, base + i) for i, j in enumerate(nodes))
        self._q.append(q)
        self._hidden.append(hidden)
        self.q, self.hidden = _cat(self._q), _cat(self._hidden)
        if self.max_children:
            if self.greedy:
                rank = logits.float()
            else:
                e = torch.empty_like(q).exponential_(1.0, generator=self.gen)
                rank = q / e  # the race: arrival order = draws without replacement from q
                self._e.append(e)
                self.e = _cat(self._e)
            self._order.append(torch.topk(rank, self.max_children, dim=-1).indices)
            self.order = _cat(self._order)

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
        logits, h = d.tree_forward(self.tok[idx], pos, attend.to(self.device))
        for r, j in enumerate(nodes):
            self.slot[j] = self.n_fwd + r
        self.n_fwd += n
        self._add_dists(nodes, logits, h)
        return h


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if len(parts) > 1 else parts[0]


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
        ids.update(zip(level, new))
        fwd = [ids[j] for j in level if has_kids[j]]
        if fwd:
            tree.forward_nodes(fwd)


def grow_with_head(tree: DraftTree, budget: int, r: list[float], head, depth_cap: int, met=None,
                   node_cost: float | None = None):
    """Priority-queue drafting (Algorithm 3) with R refined by an acceptance head.

    The draft runs in waves: pop every candidate whose key beats the best key a child of a
    not-yet-forwarded node could have (R(v) * r_0), forward all nodes popped in the wave at once,
    then set R(v) = R(parent) * a(h_v) for first children (the head's probability that v is
    accepted) and queue their children. With a constant head this is exactly Algorithm 3 with the
    0-th order R. Returns R of every node (the predicted accepted tokens are their sum).

    node_cost (a learned budget, tree_shapes.worth_growing): a candidate is drafted only while the
    rule holds for its key, and a wave is forwarded only while the best key one of its children
    could get before the head sees it (the bound) would be worth drafting: that forward is paid
    only for the sake of the children. `budget` stays the cap. With a constant head a = r_0 this
    drafts the first learned_size(R) nodes of Algorithm 3."""
    R = [1.0]

    def worth(key):
        return node_cost is None or worth_growing(key, len(R) - 1, sum(R[1:]), node_cost)

    heap = [(-r[0], 0, 0, 0)]
    tick, bound, wave = 1, 0.0, []
    while tree.n < budget:
        pairs = []
        while heap and tree.n + len(pairs) < budget and -heap[0][0] >= bound and worth(-heap[0][0]):
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
        if tree.n >= budget or not pairs or (not heap and not fwd) or (fwd and not worth(bound)):
            break
        bound = 0.0
        if not fwd:
            continue
        h = tree.forward_nodes(fwd)
        if met is not None:
            met.lap("round")
        a = head.acceptance_prob(h).float().clamp(0.0, 1.0).tolist()
        if met is not None:
            met.lap("policy")
        for j, aj in zip(fwd, a):
            if tree.sib[j] == 0:
                R[j] = R[tree.parent[j]] * aj
            heapq.heappush(heap, (-R[j] * r[0], tick, j, 0))
            tick += 1
    return R
