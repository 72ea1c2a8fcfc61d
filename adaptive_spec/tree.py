"""Tree drafting policies: GSD (recursive rejection) and ERSD (exponential races) over token trees.

A round drafts a token tree with the draft model and verifies ALL of it in ONE target forward
pass; the longest accepted root-to-node path is kept and both KV caches are compacted to it.
The pieces, one idea per module:
  tree_cache    a forward with a tree attention mask; cache compaction to the accepted path
  tree_shapes   sequence / batch / SpecInfer / optimal (Algorithm 3) shapes, the 0-th order
                acceptance model and its running estimate `PositionalRates`
  tree_draft    the drafted tree (`DraftTree`) and how it grows
  tree_verify   the target pass and exact verification (GSD Algorithm 4, ERSD Algorithm 5)
This module holds the policy that ties them together, `TreePolicy`, a RoundOwner.

R, the probability that a vertex is accepted, comes from (a) measured positional acceptance
rates, the 0-th order model of the paper (R of a vertex is the product of the acceptance
distribution r_i over the sibling indices on its path), or (b) a trained acceptance head
(`adaptive_spec.heads.AcceptanceHead`) on the draft's hidden state of each drafted token, which
refines R of the first-child chain per context, SpecDec++ style: R(v) = R(parent) * a(h_v). The
head only ever steers the drafting of LATER tokens (children of v, later siblings), never
whether v itself is kept, so verification stays exact.
"""
from __future__ import annotations

from .errors import UserError
from .interfaces import RoundOwner, RoundState, register
from .policies import load_pair_head
from .tree_draft import DraftTree, grow_static, grow_with_head
from .tree_shapes import DRAFTINGS, PositionalRates, shape_tree, tree_value
from .tree_verify import finish_round, plain_step, read_path, target_pass, verify_greedy, verify_gsd, verify_race


def load_tree_head(head, pair=None):
    """The acceptance head of tree_estimator 'head' (an AcceptanceHead, or a folder to load).
    grow_with_head scores a node from its own state, so it needs a `token` head: a context head
    scores the parent's next draw in expectation and cannot tell siblings apart."""
    return load_pair_head(head, pair, feature="token", why="tree_estimator 'head'")


def _pos_int(name, v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise UserError(f"{name} must be an integer >= 1, got {v!r}")
    return v


def _check_choices(method: str, drafting: str, estimator: str, head) -> None:
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


class TreePolicy(RoundOwner):
    """Tree drafting with exact verification: method "gsd" (recursive rejection sampling) or
    "ersd" (exponential races); drafting "tree" (optimal, Algorithm 3), "sequence", "batch" or
    "specinfer"; R from "positional" rates or an acceptance "head".

    Acceptance rates: `rates` (c_i, a calibration file, or a PositionalRates) are the calibrated
    start; with `adapt_rates` they adapt to the rounds of a generation. `reset()` (the decoder
    calls it at the start of each generation) puts them back where they stood when the policy was
    built, so one policy object gives the same output for the same seed every time. With
    `carry_rates=True` the rates adapted in one generation carry over to the next instead (the
    output then depends on what the object generated before).

    Per-generation statistics: rounds, predicted accepted tokens (sum of R over the drafted
    nodes, summed over rounds)."""

    def __init__(self, method: str = "gsd", drafting: str = "tree", budget: int = 8, estimator: str = "positional",
                 head=None, rates=None, adapt_rates: bool = True, name: str | None = None,
                 carry_rates: bool = False):
        _check_choices(method, drafting, estimator, head)
        self.method, self.drafting, self.estimator = method, drafting, estimator
        self.budget = _pos_int("tree budget", budget)
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

    def describe(self) -> dict:
        return {"policy": self.name, "method": self.method, "drafting": self.drafting, "tree_budget": self.budget,
                "tree_estimator": self.estimator, "cond_rates": [round(c, 4) for c in self.rates.cond()[:8]]}

    def run_round(self, state: RoundState) -> list[int]:
        cap = min(self.budget, state.remaining - 1)  # depth cap: never draft past the length limit
        self.rounds += 1
        if cap <= 0:
            return plain_step(state)
        tree = self._draft(state, cap)
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
        if self.estimator == "head":
            tree = DraftTree(*args, self.budget, max_children=self.budget)
            R = grow_with_head(tree, self.budget, r, self.head, depth_cap=cap, met=state.met)
            self.predicted += sum(R[1:])
            return tree
        parents, sibs = shape_tree(self.drafting, self.budget, r, depth_cap=cap, max_children=V)
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


def _budget(*vals, default):
    for v in vals:
        if v is not None:
            return v
    return default


def _resolve_head(estimator, head, pair):
    return load_tree_head(head, pair) if estimator == "head" else None


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
