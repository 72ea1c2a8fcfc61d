"""Tree drafting policies: GSD (recursive rejection) and ERSD (exponential races) over token trees.

A round drafts a token tree and verifies ALL of it in ONE target pass; the longest accepted path is kept
and both KV caches are compacted to it. `TreePolicy`, a RoundOwner, ties together shapes.py (shapes, the
0-th order acceptance model, `PositionalRates`), draft.py (`DraftTree`, how it grows) and verify.py (the
target pass, GSD Algorithm 4, ERSD Algorithm 5).

R, the probability that a vertex is accepted, comes from measured positional rates (the product of the
sibling indices' rates on its path) or from a trained acceptance head on each drafted token's hidden
state, refining R of the first-child chain per context: R(v) = R(parent) * a(h_v). The head, and a
learned budget (as many tokens as are worth their cost: shapes.worth_growing, at most the budget), only
steer what is drafted, from information available before each token is drawn, never whether a vertex
is kept, so verification stays exact. With positional R the round's size is picked before drafting;
with the head the tree stops growing between waves."""
from __future__ import annotations

import math

from ...errors import UserError
from ...params import ErsdParams, TreeParams
from ..interfaces import PolicyContext, RoundOwner, RoundState, register
from ..policies import load_pair_head
from .draft import DraftTree, grow_static, grow_with_head
from .shapes import DRAFTINGS, NESTED, PositionalRates, learned_size, node_values, shape_tree, tree_value
from .verify import finish_round, plain_step, read_path, target_pass, verify_greedy, verify_gsd, verify_race


def load_tree_head(head, pair=None):
    """The acceptance head of tree_estimator 'head' (an AcceptanceHead, or a folder to load).
    grow_with_head scores a node from its own state, so it needs a `token` head: a context head
    scores the parent's next draw in expectation and cannot tell siblings apart."""
    return load_pair_head(head, pair, feature="token", why="tree_estimator 'head'")


def _check_choices(method: str, drafting: str, estimator: str, head) -> None:
    if method not in ("gsd", "ersd"):
        raise UserError(f"unknown tree verification {method!r}; use gsd or ersd")
    if drafting not in DRAFTINGS:
        raise UserError(f"unknown drafting {drafting!r}; use one of {', '.join(DRAFTINGS)}")
    if estimator not in ("positional", "head"):
        raise UserError(f"unknown tree_estimator {estimator!r}; use positional or head")
    if estimator == "head" and drafting != "tree":
        raise UserError("tree_estimator 'head' builds the optimal tree; use it with drafting 'tree'")
    if estimator == "head" and head is None:
        raise UserError("tree_estimator 'head' needs an acceptance head: set head (--head DIR) to a trained head, "
                        "or use tree_estimator positional")


def _check_learned(learned_budget, node_cost, drafting: str):
    """(learned_budget, node_cost) checked: node_cost a number > 0, required by a learned budget."""
    if learned_budget not in (True, False, None):
        raise UserError(f"tree_learned must be true or false, got {learned_budget!r}")
    learned_budget = bool(learned_budget)
    if learned_budget and drafting not in NESTED:
        raise UserError(f"tree_learned grows the tree node by node, which drafting {drafting!r} cannot; "
                        f"use drafting {', '.join(NESTED)}, or tree_learned false")
    if node_cost is None:
        if learned_budget:
            raise UserError("tree_learned needs tree_node_cost, the cost of one drafted token in target steps, "
                            "(t_draft + t_cand) / t_target, e.g. 0.3; pass it, or build the policy with a pair "
                            "to measure it")
        return learned_budget, None
    if isinstance(node_cost, bool) or not isinstance(node_cost, (int, float)) or not math.isfinite(node_cost) \
            or node_cost <= 0:
        raise UserError(f"tree_node_cost must be a number > 0 (the cost of one drafted token in target steps, "
                        f"(t_draft + t_cand) / t_target, e.g. 0.3), got {node_cost!r}")
    return learned_budget, float(node_cost)


class TreePolicy(RoundOwner):
    """Tree drafting with exact verification: method "gsd" (recursive rejection sampling) or "ersd"
    (exponential races); drafting "tree" (optimal, Algorithm 3), "sequence", "batch" or "specinfer"; R from
    "positional" rates or an acceptance "head".

    `rates` (c_i, a calibration file, or a PositionalRates) are the calibrated start; with `adapt_rates`
    they follow a generation's rounds, and `reset()` puts them back, so one policy object gives the same
    output for the same seed every time (`carry_rates=True` carries them to the next generation instead).
    Budget: `budget` tokens per round, or with `learned_budget` as many as are worth `node_cost`
    (shapes.worth_growing), at most `budget`; a learned budget needs a nested drafting (tree, sequence,
    batch). Per-generation statistics (reset by `reset()`), summed over rounds: rounds, predicted accepted
    tokens, drafted nodes (= Metrics.n_drafted) and depth_sum."""

    def __init__(self, method: str = "gsd", drafting: str = "tree", budget: int = 8, estimator: str = "positional",
                 head=None, rates=None, adapt_rates: bool = True, name: str | None = None,
                 carry_rates: bool = False, learned_budget: bool = False, node_cost: float | None = None):
        _check_choices(method, drafting, estimator, head)
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise UserError(f"tree_budget (for drafting sequence: k; batch: num_drafts) must be an integer >= 1, "
                            f"the most tokens a round drafts, got {budget!r}; e.g. tree_budget: 8")
        self.method, self.drafting, self.estimator, self.budget = method, drafting, estimator, budget
        self.learned_budget, self.node_cost = _check_learned(learned_budget, node_cost, drafting)
        self.head = head
        self.rates = rates if isinstance(rates, PositionalRates) else PositionalRates(rates, adapt=adapt_rates,
                                                                                      method=method)
        self.calibrated = self.rates.state()
        self.carry_rates = carry_rates
        self.name = name or ("tree" if method == "gsd" else "ersd")
        self.k_max = self.budget
        self.reset()

    def reset(self):
        if not self.carry_rates:
            self.rates.load_state(self.calibrated)
        self.rounds = 0
        self.predicted = 0.0
        self.drafted = 0
        self.depth_sum = 0

    def describe(self) -> dict:
        return {"policy": self.name, "method": self.method, "drafting": self.drafting, "tree_budget": self.budget,
                "tree_estimator": self.estimator, "tree_learned": self.learned_budget,
                "tree_node_cost": self.node_cost, "cond_rates": [round(c, 4) for c in self.rates.cond()[:8]]}

    def run_round(self, state: RoundState) -> list[int]:
        cap = min(self.budget, state.remaining - 1)  # depth cap: never draft past the length limit
        self.rounds += 1
        if cap <= 0:
            return plain_step(state)
        tree = self._draft(state, cap)
        self.drafted += tree.n
        self.depth_sum += max(tree.depth)
        P = target_pass(state.target, state.seq, tree, state.sampling)
        child, tok = self._verify(tree, P, state)
        path, path_tok, nxt, outcomes = read_path(tree, child, tok)
        finish_round(state, tree, path)
        for m, idx in outcomes:
            self.rates.update(m, idx)
        return path_tok + [nxt]

    def _draft(self, state: RoundState, cap: int) -> DraftTree:
        """The round's tree, of depth <= cap; adds its predicted accepted tokens to `predicted`."""
        V = state.draft.vocab_size
        r = self.rates.dist(min(self.budget, V))
        args = (state.draft, state.seq, state.sampling, state.gen)
        node_cost = self.node_cost if self.learned_budget else None
        if self.estimator == "head":
            tree = DraftTree(*args, self.budget, max_children=self.budget)
            R = grow_with_head(tree, self.budget, r, self.head, depth_cap=cap, met=state.met, node_cost=node_cost)
            self.predicted += sum(R[1:])
            return tree
        parents, sibs = shape_tree(self.drafting, self.budget, r, depth_cap=cap, max_children=V)
        if node_cost is not None:  # a nested shape: its first n nodes are the shape of budget n
            keep = 1 + learned_size(node_values(parents, sibs, r)[1:], node_cost)
            parents, sibs = parents[:keep], sibs[:keep]
        self.predicted += tree_value(parents, sibs, r)
        tree = DraftTree(*args, len(parents) - 1, max_children=max(sibs) + 1 if len(sibs) > 1 else 0)
        grow_static(tree, parents, sibs)
        return tree

    def _verify(self, tree: DraftTree, P, state: RoundState):
        if state.sampling.greedy:
            return verify_greedy(tree, P)
        if self.method == "gsd":
            return verify_gsd(tree, P, state.gen)
        return verify_race(tree, P, state.gen)


def round_budget(p) -> int:
    """Tokens a round drafts (a learned budget's cap) under tree or ersd settings `p`: the factories
    below draft it, and a sweep's key and rows name it (evaluation/sweep_grid.py)."""
    if p.name == "ersd" and p.drafting == "sequence":
        order, default = (p.k, p.tree_budget), 4
    elif p.name == "ersd" and p.drafting == "batch":
        order, default = (p.num_drafts, p.tree_budget, p.k), 4
    else:
        order, default = (p.tree_budget, p.k), 8
    return next((v for v in order if v is not None), default)


def _node_cost(tree_learned, tree_node_cost, ctx: PolicyContext, drafting):
    """tree_node_cost, measured on the context's pair (auto's measure_costs) when a learned budget leaves it
    unset (TreePolicy refuses the rest, before anything is timed)."""
    if tree_learned is True and tree_node_cost is None and ctx.pair is not None and drafting in NESTED:
        return ctx.measure_costs(ctx.pair).node_cost
    return tree_node_cost


def _factory(method: str):
    """`tree` (GSD) or `ersd` (exponential races): round_budget(p) drafted tokens per round; with tree_learned,
    as many as are worth tree_node_cost each (unset: measured on the pair), at most that budget."""
    def make(p: TreeParams | ErsdParams, ctx: PolicyContext):
        head = load_tree_head(p.head, ctx.pair) if p.tree_estimator == "head" else None
        return TreePolicy(method, p.drafting, round_budget(p), p.tree_estimator, head, p.tree_rates, p.adapt_rates,
                          learned_budget=p.tree_learned,
                          node_cost=_node_cost(p.tree_learned, p.tree_node_cost, ctx, p.drafting))
    return make


register("tree")(_factory("gsd"))
register("ersd")(_factory("ersd"))
