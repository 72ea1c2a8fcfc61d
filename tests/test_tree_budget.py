"""The learned tree budget: grow the tree while the next node is worth its
cost (tree_shapes.worth_growing). The rule's arithmetic, its optimality over Algorithm 3's
nested trees, the head-estimated variant, and that it never touches exactness: only what is
drafted changes, never what is kept."""
import random
import types
from collections import Counter
from functools import partial

import pytest
import torch

from adaptive_spec.decoding.trees import policy as T
from adaptive_spec.decoding.trees import draft as D
from adaptive_spec.decoding.trees import shapes as S
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.errors import UserError
from adaptive_spec.heads.head import AcceptanceHead
from adaptive_spec.decoding.interfaces import PolicyContext
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.decoding.pipeline import make_policy
from adaptive_spec.decoding.sampling import SamplingParams
from exact import chi_square_pvalue, exact_sequence_probs, sample_counts
from tree_mocks import MOCK_V, ConstHead, MockHead, TreeMockLM, hf_pair, mock_pair

GREEDY, T1 = SamplingParams(temperature=0), SamplingParams(1.0)
PROMPT = [5, 9, 4, 17]


def tree_policy(name, pair=None, **settings):
    """A tree policy built as generate builds it: typed settings, then the registered factory."""
    return make_policy(name, PolicyContext(pair), **settings)


def throughput(R, n, c):
    return (1 + sum(R[:n])) / (1 + n * c)


# ---- the rule's arithmetic ------------------------------------------------------------------

def test_stop_rule_on_hand_computed_R():
    R = [0.9, 0.8, 0.5, 0.3, 0.1]
    # c = 0.2: 0.8 * 1.2 = 0.96 > 0.2 * 1.9; 0.5 * 1.4 = 0.70 > 0.2 * 2.7 = 0.54; 0.3 * 1.6 = 0.48 < 0.64
    assert S.worth_growing(0.5, 2, 1.7, 0.2) and not S.worth_growing(0.3, 3, 2.2, 0.2)
    assert S.learned_size(R, 0.2) == 3
    # c = 0.05: 0.3 * 1.15 = 0.345 > 0.16, then 0.1 * 1.2 = 0.12 < 0.05 * 3.5 = 0.175
    assert S.learned_size(R, 0.05) == 4
    assert S.learned_size(R, 1.0) == 1  # 0.8 * 2 < 1.9: only the first node
    assert S.learned_size(R, 1e-9) == 5  # nearly free nodes: the whole budget
    assert S.learned_size([0.01], 50.0) == 1 and S.worth_growing(0.0, 0, 0.0, 50.0)  # at least one
    assert S.learned_size([], 0.2) == 0
    # the rule is T(n + 1) > T(n)
    assert throughput(R, 3, 0.2) > throughput(R, 2, 0.2) and throughput(R, 4, 0.2) < throughput(R, 3, 0.2)


@pytest.mark.parametrize("seed", range(6))
def test_stop_rule_picks_the_best_prefix(seed):
    """For non-increasing R the first failure maximises the round's throughput over every size
    up to the budget, and the size shrinks as a node gets dearer."""
    rnd = random.Random(seed)
    R = sorted((rnd.random() ** 2 for _ in range(rnd.randint(1, 12))), reverse=True)
    last = len(R)
    for c in (1e-6, 0.01, 0.05, 0.1, 0.3, 1.0, 3.0):
        n = S.learned_size(R, c)
        assert 1 <= n <= len(R) and n <= last
        best = max(throughput(R, m, c) for m in range(1, len(R) + 1))
        assert throughput(R, n, c) == pytest.approx(best, rel=1e-12)
        last = n


@pytest.mark.parametrize("cond", [(0.6, 0.3, 0.2), (0.9, 0.5), (0.35,)])
def test_learned_optimal_tree_beats_every_optimal_tree_size(cond):
    """Truncating Algorithm 3's budget-k tree at the learned size gives the optimal tree of that
    size, and no optimal tree of another size up to k has a better modelled throughput."""
    r = S.acceptance_distribution(cond, 6)
    k = 12
    parents, sibs, R = S.optimal_tree(k, r)
    for c in (0.02, 0.1, 0.25, 0.6):
        n = S.learned_size(R[1:], c)
        assert S.tree_value(parents[:n + 1], sibs[:n + 1], r) == pytest.approx(sum(S.optimal_tree(n, r)[2][1:]))
        rate = lambda m: (1 + sum(S.optimal_tree(m, r)[2][1:])) / (1 + m * c)  # noqa: E731
        assert rate(n) >= max(rate(m) for m in range(1, k + 1)) - 1e-12


@pytest.mark.parametrize("c", [1e-9, 0.02, 0.1, 0.3, 1.0])
def test_head_growth_with_a_constant_head_follows_the_rule(c):
    """grow_with_head with a head that always says r_0 is Algorithm 3: with a learned budget it
    drafts exactly learned_size of Algorithm 3's R, in waves."""
    V, budget = 12, 10
    draft = TreeMockLM(V, seed=4)
    r = S.acceptance_distribution([0.7, 0.3, 0.2], budget)
    tree = D.DraftTree(draft, torch.tensor([1, 2, 3]), T1, torch.Generator().manual_seed(0), budget,
                       max_children=budget)
    R = D.grow_with_head(tree, budget, r, ConstHead(r[0]), depth_cap=budget, node_cost=c)
    R_alg3 = S.optimal_tree(budget, r)[2][1:]
    n = S.learned_size(R_alg3, c)
    assert tree.n == n and sum(R[1:]) == pytest.approx(sum(R_alg3[:n]))


# ---- policies: what gets drafted ------------------------------------------------------------

LEARNED = [
    ("tree", dict(tree_budget=6)),
    ("tree", dict(tree_budget=8, tree_estimator="head")),
    ("tree", dict(tree_budget=5, drafting="batch")),
    ("ersd", dict(tree_budget=6)),
    ("ersd", dict(drafting="sequence", k=5)),
]
IDS = [f"{n}-{kw.get('drafting', 'tree')}-{kw.get('tree_estimator', 'pos')}" for n, kw in LEARNED]


def make(name, kw, node_cost=None, head=None, **extra):
    kw = dict(kw, **extra)
    if kw.get("tree_estimator") == "head":
        kw["head"] = head
    if node_cost is not None:
        kw.update(tree_learned=True, tree_node_cost=node_cost)
    return tree_policy(name, **kw)


def random_head():
    torch.manual_seed(0)
    return AcceptanceHead(16, depth=1)


def check_stats(pol, m):
    """The policy's per-generation statistics against the generation's metrics."""
    rounds = sum(m.accepted_hist.values())
    assert pol.rounds == rounds == m.n_target_forwards
    assert pol.drafted == m.n_drafted == m.n_accepted + m.n_discarded
    assert pol.drafted <= pol.budget * rounds and pol.predicted > 0
    # every round drafts a tree of depth >= 1 but a generation's last, which may be a plain step
    assert rounds - 1 <= pol.depth_sum <= pol.drafted
    if pol.drafting == "sequence":
        assert pol.depth_sum == pol.drafted
    if pol.drafting == "batch":
        assert pol.depth_sum <= rounds


@pytest.mark.parametrize("name,kw", LEARNED, ids=IDS)
def test_learned_greedy_equals_target(name, kw):
    draft, target = hf_pair()
    dec = Decoder(target, draft)
    ref = dec.generate(PROMPT, max_new_tokens=30, sampling=GREEDY).token_ids
    for c in (0.05, 0.3, 2.0):
        pol = make(name, kw, c, random_head())
        g = dec.generate(PROMPT, max_new_tokens=30, sampling=GREEDY, policy=pol)
        assert g.token_ids == ref
        check_stats(pol, g.metrics)
    same = Decoder(target, CausalLM(target.model))  # a draft equal to the target
    assert same.generate(PROMPT, max_new_tokens=30, sampling=GREEDY,
                         policy=make(name, kw, 0.1, ConstHead(0.9))).token_ids == ref


@pytest.mark.parametrize("name,kw", LEARNED, ids=IDS)
def test_free_nodes_give_the_fixed_budget(name, kw):
    """node_cost -> 0: every candidate is worth drafting, so the learned tree is the fixed one,
    draw for draw: same tokens, same drafted and accepted counts."""
    draft, target = hf_pair()
    dec = Decoder(target, draft)
    head = random_head()
    for seed in range(3):
        a = dec.generate(PROMPT, max_new_tokens=24, sampling=T1, policy=make(name, kw, None, head), seed=seed)
        pol = make(name, kw, 1e-9, head)
        b = dec.generate(PROMPT, max_new_tokens=24, sampling=T1, policy=pol, seed=seed)
        assert a.token_ids == b.token_ids
        assert (a.metrics.n_drafted, a.metrics.n_accepted) == (b.metrics.n_drafted, b.metrics.n_accepted)
        check_stats(pol, b.metrics)


def test_dearer_nodes_draft_fewer():
    """With fixed rates the round's size is a function of node_cost: the mean drafted nodes per
    drafting round fall as nodes get dearer, down to one node per round (a depth-1 tree)."""
    draft, target = hf_pair()
    dec = Decoder(target, draft)
    means = []
    for c in (0.005, 0.2, 5.0):
        pol = tree_policy("tree", tree_budget=6, adapt_rates=False, tree_learned=True, tree_node_cost=c)
        m = dec.generate(PROMPT, max_new_tokens=40, sampling=T1, policy=pol, seed=1).metrics
        check_stats(pol, m)
        means.append(pol.drafted / pol.rounds)
        if c == 5.0:  # one node of depth 1 every round (but a plain last step)
            assert pol.depth_sum == pol.drafted >= pol.rounds - 1
    assert means[0] > means[1] > means[2]
    assert means[0] > 4  # nearly free: close to the budget of 6


def test_stats_reset_per_generation():
    draft, target = hf_pair()
    dec = Decoder(target, draft)
    pol = tree_policy("tree", tree_budget=6, tree_learned=True, tree_node_cost=0.1)
    dec.generate(PROMPT, max_new_tokens=30, sampling=T1, policy=pol, seed=0)
    first = (pol.rounds, pol.drafted, pol.depth_sum)
    g = dec.generate(PROMPT, max_new_tokens=10, sampling=T1, policy=pol, seed=0)
    check_stats(pol, g.metrics)  # the second generation's counts only
    assert pol.rounds < first[0] and pol.drafted < first[1]


# ---- exactness ------------------------------------------------------------------------------

L, N = 3, 2000
# node costs where the rule's choice varies with the round (its depth cap, the adapted rates and,
# for the head, the context), so the check covers trees of several sizes
EXACT = [
    ("gsd-tree", lambda: tree_policy("tree", tree_budget=5, tree_learned=True, tree_node_cost=0.15), T1),
    ("gsd-head", lambda: tree_policy("tree", tree_budget=5, tree_estimator="head", head=MockHead(MOCK_V),
                                      tree_learned=True, tree_node_cost=0.15), T1),
    ("gsd-batch-topk", lambda: tree_policy("tree", tree_budget=4, drafting="batch", tree_learned=True,
                                            tree_node_cost=0.05), SamplingParams(1.0, top_k=3)),
    ("ersd-tree", lambda: tree_policy("ersd", tree_budget=5, tree_learned=True, tree_node_cost=0.15), T1),
    ("ersd-head", lambda: tree_policy("ersd", tree_budget=4, tree_estimator="head", head=MockHead(MOCK_V, seed=1),
                                       tree_learned=True, tree_node_cost=0.05), T1),
]


@pytest.mark.parametrize("name,factory,params", EXACT, ids=[e[0] for e in EXACT])
def test_learned_budget_distribution_is_exact(name, factory, params, monkeypatch):
    draft, target = mock_pair()
    prompt = [1, 2]
    sizes = Counter()
    draft_tree = T.TreePolicy._draft

    def spy(self, state, cap):
        tree = draft_tree(self, state, cap)
        sizes[tree.n] += 1
        return tree

    monkeypatch.setattr(T.TreePolicy, "_draft", spy)
    probs = exact_sequence_probs(target, prompt, params, MOCK_V, L)
    counts = sample_counts(Decoder(target, draft), prompt, params, factory(), N, L)
    assert chi_square_pvalue(counts, probs, N) > 1e-3
    assert len(sizes) >= 2  # the rule did vary the tree's size from round to round


# ---- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(tree_learned=True), "tree_learned needs tree_node_cost"),
    (dict(tree_learned=True, tree_node_cost=0), r"tree_node_cost must be > 0 and finite \(target steps"),
    (dict(tree_learned=True, tree_node_cost=-0.5), r"tree_node_cost must be > 0 and finite \(target steps"),
    (dict(tree_learned=True, tree_node_cost=float("nan")), r"tree_node_cost must be > 0 and finite \(target steps"),
    (dict(tree_learned=True, tree_node_cost="x"), r"tree_node_cost must be > 0 and finite \(target steps"),
    (dict(tree_node_cost=0.3), "--tree-node-cost applies only with --tree-learned"),
    (dict(tree_learned="maybe", tree_node_cost=0.3), "tree_learned must be "),
    (dict(tree_learned=True, tree_node_cost=0.3, drafting="specinfer"), "drafting 'specinfer' cannot"),
    (dict(tree_budget=0), "tree_budget must be an integer >= 1"),
    (dict(tree_estimator="oracle"), "tree_estimator must be positional or head for policy"),
    (dict(num_drafts=3), "num_drafts: not a setting of policy tree|--num-drafts applies to ersd only with"),
])
def test_bad_input(kw, match):
    for factory in (partial(tree_policy, "tree"), partial(tree_policy, "ersd")):
        with pytest.raises(UserError, match=match):
            factory(**kw)


def test_node_cost_measured_on_the_pair_when_unset(monkeypatch):
    from adaptive_spec.decoding import pipeline  # make_policy hands its measure_costs to the factories

    calls = []
    monkeypatch.setattr(pipeline, "measure_costs",
                        lambda pair: calls.append(pair) or types.SimpleNamespace(node_cost=0.25))
    pair = object()
    for factory in (partial(tree_policy, "tree"), partial(tree_policy, "ersd")):
        pol = factory(tree_learned=True, pair=pair)
        assert pol.node_cost == 0.25 and pol.learned_budget
        assert pol.describe()["tree_learned"] is True and pol.describe()["tree_node_cost"] == 0.25
        assert factory(tree_learned=True, tree_node_cost=0.5, pair=pair).node_cost == 0.5  # given: not timed
        assert factory(pair=pair).describe()["tree_learned"] is False  # not learned: not timed
    assert calls == [pair, pair]
    with pytest.raises(UserError, match="drafting 'specinfer'"):  # refused before anything is timed
        tree_policy("tree", tree_learned=True, drafting="specinfer", pair=pair)
    assert len(calls) == 2
