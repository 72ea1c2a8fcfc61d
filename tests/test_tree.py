"""Tree drafting and verification (adaptive_spec.decoding.trees.policy): tree attention and cache compaction on
tiny Qwen2 models, Algorithm 3 optimality, and exactness of GSD / ERSD trees."""
import heapq
import itertools
import random

from functools import partial

import pytest
import torch

from adaptive_spec.decoding.trees import policy as T
from adaptive_spec.decoding.trees import draft as D
from adaptive_spec.decoding.trees import shapes as S
from adaptive_spec.decoding.trees import verify as TV
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.heads.head import AcceptanceHead
from adaptive_spec.decoding.interfaces import PolicyContext
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.decoding.pipeline import make_policy
from adaptive_spec.decoding.sampling import SamplingParams
from tiny import make_model
from exact import chi_square_pvalue, exact_sequence_probs, sample_counts
from tree_mocks import MOCK_V, ConstHead, MockHead, hf_pair, mock_pair

GREEDY = SamplingParams(temperature=0)


def tree_policy(name, pair=None, **settings):
    """A tree policy built as generate builds it: typed settings, then the registered factory."""
    return make_policy(name, PolicyContext(pair), **settings)


# ---- tree attention and cache compaction on real (tiny) transformers ------------------------

@pytest.mark.parametrize("n_pending", [1, 3])
@torch.inference_mode()
def test_tree_mask_logits_and_compaction_match_plain_forwards(n_pending):
    draft, target = hf_pair()
    seq = torch.tensor([5, 9, 4, 17, 8, 6])
    L = len(seq)
    for m in (draft, target):
        m.forward(seq[:L - n_pending], n_logits=0)
        m.counters.restart()
    params = SamplingParams(1.0)
    gen = torch.Generator().manual_seed(0)
    tr = D.DraftTree(draft, seq, params, gen, max_nodes=9, max_children=3)
    # a tree with branching at several depths: root(3 children) -> chains and sub-branches
    parents = [-1, 0, 0, 0, 1, 1, 2, 4, 7, 4]
    sibs = [0, 0, 1, 2, 0, 1, 0, 0, 0, 1]
    D.grow_static(tr, parents, sibs)
    assert tr.n == 9 and draft.counters.n_forwards == 1 + 3  # the root, then one forward per inner level
    P = TV.target_pass(target, seq, tr, params)
    toks = tr.tok.tolist()
    fresh = CausalLM(target.model)
    for j in range(tr.n + 1):
        path = tr.ancestors(j)
        fresh.reset()
        logits, _ = fresh.forward(torch.cat([seq, torch.tensor([toks[a] for a in path], dtype=torch.long)]))
        torch.testing.assert_close(P[j], logits[0].softmax(-1), rtol=1e-5, atol=1e-6)
    # the draft's distributions at its forwarded nodes match plain forwards too
    for j, row in tr.row.items():
        fresh_d = CausalLM(draft.model)
        logits, _ = fresh_d.forward(torch.cat([seq, torch.tensor([toks[a] for a in tr.ancestors(j)],
                                                                 dtype=torch.long)]))
        torch.testing.assert_close(tr.q[row], logits[0].softmax(-1), rtol=1e-5, atol=1e-6)
    # compact both caches to the deepest path (its leaf was never forwarded by the draft)
    path = tr.ancestors(max(range(tr.n + 1), key=lambda j: tr.depth[j]))
    assert len(path) == 4 and [tr.slot[j] is None for j in path] == [False, False, False, True]
    TV.compact_to_path(target, draft, tr, L, path)
    assert target.length == L + 4 and draft.length == L + 3
    for lm, n in ((target, 4), (draft, 3)):
        ref = CausalLM(lm.model)
        ref.forward(torch.cat([seq, torch.tensor([toks[a] for a in path[:n]], dtype=torch.long)]), n_logits=0)
        for got, want in zip(lm.cache.layers, ref.cache.layers):
            torch.testing.assert_close(got.keys, want.keys, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-6)
        # and decoding continues from the compacted cache as from a fresh one
        nxt = torch.tensor([toks[path[3]]] if n == 3 else [3])
        a, _ = lm.forward(nxt, n_logits=1)
        b, _ = ref.forward(nxt, n_logits=1)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---- tree construction ----------------------------------------------------------------------

def brute_force_best(k, r):
    """The sum of the k largest vertex values over all vertices of depth <= k (they form a tree)."""
    vals = []
    for depth in range(1, k + 1):
        for idx in itertools.product(range(len(r)), repeat=depth):
            v = 1.0
            for i in idx:
                v *= r[i]
            vals.append(v)
    return sum(heapq.nlargest(k, vals))


@pytest.mark.parametrize("seed", range(4))
def test_optimal_tree_is_optimal(seed):
    # Algorithm 3's premise: the acceptance distribution over sibling indices is non-increasing
    rnd = random.Random(seed)
    w = sorted((rnd.random() for _ in range(5)), reverse=True)
    scale = rnd.uniform(0.6, 1.0)
    r = [x / sum(w) * scale for x in w[:4]]
    for k in range(1, 7):
        parents, sibs, R = S.optimal_tree(k, r)
        assert len(parents) == k + 1 and all(parents[j] < j for j in range(1, k + 1))
        assert S.tree_value(parents, sibs, r) == pytest.approx(sum(R[1:]))
        assert sum(R[1:]) == pytest.approx(brute_force_best(k, r), rel=1e-9)
        # and it beats the fixed shapes of the same budget
        for shape in ("sequence", "batch", "specinfer"):
            p2, s2 = S.shape_tree(shape, k, r)
            assert len(p2) == k + 1
            assert S.tree_value(p2, s2, r) <= sum(R[1:]) + 1e-12
        # Tunstall (Thm 4.1 / Lemma 4.2): an upper bound on accepted + 1
        assert S.tunstall_bound(r, k, vocab_size=1000) >= sum(R[1:]) + 1 - 1e-9


def test_optimal_tree_depth_cap_and_shapes():
    r = S.acceptance_distribution([0.9, 0.5], 8)
    parents, sibs, _ = S.optimal_tree(16, r, depth_cap=3)
    depth = [0]
    for j in range(1, len(parents)):
        depth.append(depth[parents[j]] + 1)
    assert max(depth) == 3 and len(parents) == 17
    assert S.specinfer_tree(8) == ([-1, 0, 1, 2, 3, 2, 5, 2, 7], [0, 0, 0, 0, 0, 1, 0, 2, 0])
    assert S.shape_tree("sequence", 5, r, depth_cap=2) == ([-1, 0, 1], [0, 0, 0])


def test_positional_rates_update():
    est = S.PositionalRates([0.5, 0.5], weight=2.0)
    est.update(3, 1)  # child 0 rejected, child 1 accepted
    est.update(2, None)  # both rejected
    est.update(1, 0)
    c = est.cond()
    assert c[0] == pytest.approx((1 + 1) / (2 + 3))
    assert c[1] == pytest.approx((1 + 1) / (2 + 2))
    assert c[2] == pytest.approx(0.5)
    assert S.acceptance_distribution([0.5, 0.2], 3) == pytest.approx([0.5, 0.1, 0.08])


# ---- greedy: identical to target-only decoding ---------------------------------------------

POLICIES = [
    ("tree", dict(tree_budget=6)),
    ("tree", dict(tree_budget=5, drafting="batch")),
    ("tree", dict(tree_budget=7, drafting="specinfer")),
    ("tree", dict(tree_budget=8, tree_estimator="head")),
    ("ersd", dict(drafting="sequence", k=4)),
    ("ersd", dict(drafting="batch", num_drafts=3)),
    ("ersd", dict(drafting="tree", tree_budget=8)),
]


def make(name, kw, head=None):
    kw = dict(kw)
    if kw.get("tree_estimator") == "head":
        kw["head"] = head
    return tree_policy(name, **kw)


@pytest.mark.parametrize("name,kw", POLICIES, ids=[f"{n}-{kw.get('drafting', 'tree')}-{kw.get('tree_estimator', 'pos')}"
                                                    for n, kw in POLICIES])
def test_greedy_equals_target(name, kw):
    draft, target = hf_pair()
    torch.manual_seed(0)
    head = AcceptanceHead(16, depth=1)
    dec = Decoder(target, draft)
    prompt = [5, 9, 4, 17]
    ref = dec.generate(prompt, max_new_tokens=30, sampling=GREEDY).token_ids
    pol = make(name, kw, head)
    g = dec.generate(prompt, max_new_tokens=30, sampling=GREEDY, policy=pol)
    assert g.token_ids == ref
    m = g.metrics
    assert m.n_tokens == 30 and m.n_discarded == m.n_drafted - m.n_accepted
    assert sum(m.accepted_hist.values()) == m.n_target_forwards
    # a draft equal to the target: every first-child chain is accepted to its end
    same = Decoder(target, CausalLM(target.model))
    g2 = same.generate(prompt, max_new_tokens=30, sampling=GREEDY, policy=make(name, kw, ConstHead(0.9)))
    assert g2.token_ids == ref
    if kw.get("drafting") == "sequence":
        assert g2.metrics.n_discarded == 0 and g2.metrics.acceptance_rate == 1.0


def test_metrics_and_forward_counts():
    draft, target = hf_pair()
    pol = tree_policy("tree", tree_budget=6, drafting="specinfer")  # trunk 2 + chains (2, 1, 1): depth 4
    g = Decoder(target, draft).generate([5, 9, 4], max_new_tokens=40, sampling=SamplingParams(1.0), policy=pol)
    m = g.metrics
    assert m.n_tokens == 40
    rounds = m.n_target_forwards
    assert sum(m.accepted_hist.values()) == rounds
    assert 0 < m.n_drafted <= 6 * rounds
    assert m.n_discarded == m.n_drafted - m.n_accepted
    assert m.n_accepted + rounds >= 40
    assert m.n_draft_forwards <= 4 * rounds  # one per level that has children, the root included
    assert pol.rounds == rounds and pol.predicted > 0
    assert pol.drafted == m.n_drafted and rounds - 1 <= pol.depth_sum <= 4 * rounds  # depth 4 but near the end


REUSED = [("tree", dict(tree_budget=6)), ("tree", dict(tree_budget=6, tree_estimator="head")),
          ("ersd", dict(tree_budget=6))]


@pytest.mark.parametrize("name,kw", REUSED, ids=["tree", "tree-head", "ersd"])
def test_reused_policy_object_repeats_its_output(name, kw):
    """The per-sibling rates a generation adapts must not leak into the next one.
    reset() restores the calibrated rates, so the same object, seed and prompt give the same
    output every time; carry_rates=True is the opt-in that lets them carry over."""
    draft, target = hf_pair()
    dec = Decoder(target, draft)
    torch.manual_seed(0)
    head = AcceptanceHead(16, depth=1)
    pol = make(name, kw, head)
    calibrated = pol.rates.cond()
    for seed in range(3):
        a = dec.generate([5, 9, 4, 17], max_new_tokens=30, sampling=SamplingParams(1.0), policy=pol, seed=seed)
        assert pol.rates.cond() != calibrated  # the rates did adapt during the generation
        b = dec.generate([5, 9, 4, 17], max_new_tokens=30, sampling=SamplingParams(1.0), policy=pol, seed=seed)
        assert a.token_ids == b.token_ids and a.metrics.n_accepted == b.metrics.n_accepted
    carry = make(name, kw, head)
    carry.carry_rates = True
    dec.generate([5, 9, 4, 17], max_new_tokens=30, sampling=SamplingParams(1.0), policy=carry, seed=0)
    adapted = carry.rates.cond()
    carry.reset()
    assert carry.rates.cond() == adapted


# ---- exact output distribution --------------------------------------------------------------

V, L, N = MOCK_V, 3, 2000


EXACT = [
    ("gsd-tree", lambda: tree_policy("tree", tree_budget=5), SamplingParams(1.0)),
    ("gsd-batch", lambda: tree_policy("tree", tree_budget=3, drafting="batch"), SamplingParams(1.0)),
    ("gsd-specinfer-topk", lambda: tree_policy("tree", tree_budget=5, drafting="specinfer"), SamplingParams(1.0, top_k=3)),
    ("gsd-head", lambda: tree_policy("tree", tree_budget=5, tree_estimator="head", head=MockHead(V)), SamplingParams(1.0)),
    ("ersd-tree", lambda: tree_policy("ersd", tree_budget=5), SamplingParams(1.0)),
    ("ersd-sequence", lambda: tree_policy("ersd", drafting="sequence", k=2), SamplingParams(1.0)),
    ("ersd-batch-topp", lambda: tree_policy("ersd", drafting="batch", num_drafts=3), SamplingParams(0.8, top_p=0.8)),
    ("ersd-head", lambda: tree_policy("ersd", tree_budget=4, tree_estimator="head", head=MockHead(V, seed=1)),
     SamplingParams(1.0)),
]


@pytest.mark.parametrize("name,factory,params", EXACT, ids=[e[0] for e in EXACT])
def test_tree_distribution_is_exact(name, factory, params):
    draft, target = mock_pair()
    prompt = [1, 2]
    probs = exact_sequence_probs(target, prompt, params, V, L)
    pol = factory()
    counts = sample_counts(Decoder(target, draft), prompt, params, pol, N, L)
    assert chi_square_pvalue(counts, probs, N) > 1e-3
    assert pol.rounds > 0


def test_distribution_test_catches_siblings_without_residual_update(monkeypatch):
    """GSD tried on siblings against the ORIGINAL target distribution (no residual update after a
    rejection) over-produces the draft's favourite tokens: the same check must fail."""
    draft, target = mock_pair()
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params, V, L)
    monkeypatch.setattr(TV, "_rrs_residual", lambda p, q: p)
    counts = sample_counts(Decoder(target, draft), prompt, params, tree_policy("tree", tree_budget=3, drafting="batch"), N, L)
    assert chi_square_pvalue(counts, probs, N) < 1e-3


def test_tree_distribution_is_exact_on_transformer_models():
    """The same check through tiny Qwen2 models: tree masks, tree positions, cache compaction."""
    target = CausalLM(make_model(V, hidden_size=16, layers=1, seed=3, logit_scale=3.0))
    draft = CausalLM(make_model(V, hidden_size=16, layers=1, seed=4, logit_scale=3.0))
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params, V, L)
    for pol in (tree_policy("tree", tree_budget=4), tree_policy("ersd", tree_budget=4)):
        counts = sample_counts(Decoder(target, draft), prompt, params, pol, 1000, L)
        assert chi_square_pvalue(counts, probs, 1000) > 1e-3


def test_bench_trees_smoke(tmp_path):
    """eval/bench_trees.py end to end on tiny models: results, resume, summary, plot."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "eval" / "bench_trees.py"
    spec = importlib.util.spec_from_file_location("bench_trees", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("abc de", "fgh ij", "kl mno")))
    out = tmp_path / "out"
    argv = ["--tiny", "--dataset", str(prompts), "--field", "text", "--prompts", "1", "--calib-prompts", "1",
            "--max-new-tokens", "8", "--budgets", "1,4", "--methods", "gsd,ersd", "--strategies", "tree,tree-head,batch",
            "--out", str(out)]
    bench.main(argv)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 1 + 2 * 3 * 2  # ar + methods x strategies x budgets
    summary = json.loads((out / "summary.json").read_text())["summary"]
    tree4 = next(s for s in summary if (s["method"], s["strategy"], s["k"]) == ("gsd", "tree", 4))
    assert tree4["tunstall_bound_generated"] >= 1 + tree4["predicted_0th_order"] - 1e-9
    assert (out / "accepted_vs_drafted.png").stat().st_size > 0 and (out / "calibration.json").is_file()
    bench.main(argv)  # resumed: nothing left to run
    assert len((out / "results.jsonl").read_text().splitlines()) == len(rows)


def test_tree_head_estimator_refuses_a_context_head():
    from adaptive_spec.errors import UserError
    from adaptive_spec.heads.head import AcceptanceHead
    from adaptive_spec.decoding.trees.policy import load_tree_head

    assert load_tree_head(AcceptanceHead(8, depth=0), None).feature == "token"
    with pytest.raises(UserError, match="feature=token"):
        load_tree_head(AcceptanceHead(8, depth=0, feature="context"), None)
