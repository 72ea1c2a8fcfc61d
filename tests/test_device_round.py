"""Rounds that decide their stop on the device and read it once (Decoder(host_reads="round")).

Counted, not assumed: every read of a tensor's value by the host (a `_local_scalar_dense` under a dispatch
mode, and the Tensor methods that read: item, bool, int, float, index, tolist, numpy, cpu) is
counted over whole generations on the static runners, and held at one per round. The output distribution
through the device round is the target's (chi-square against enumeration, with a broken control), greedy
output equals the target's token for token, and a cap that never binds gives the host rule's rounds.
"""
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaptive_spec.backends.static_runner import StaticCausalLM
from adaptive_spec.decoding import sampling
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.decoding.graph_round import RoundCaps
from adaptive_spec.decoding.policies import ConfidenceThreshold, EntropyThreshold, FixedK, LearnedThreshold
from adaptive_spec.decoding.sampling import SamplingParams
from adaptive_spec.errors import UserError
from adaptive_spec.heads.head import AcceptanceHead
from test_decoding import L, V, chi_square_pvalue, exact_pair, exact_sequence_probs, sample_counts

N_SAMPLES = 1500  # seeded generations a distribution check draws (the controls fail far below 1e-3 at this count)
from tiny import make_model

GREEDY = SamplingParams(temperature=0)


_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default)


class _ScalarReads(TorchDispatchMode):
    """Counts reads inside torch's own ops (outside inference_mode, where a dispatch mode sees them)."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _READS and not self.out["in_method"]:
            self.out["n"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_reads():
    """Counts every read of a tensor's value by the host inside the block: {"n": count}."""
    out = {"n": 0, "in_method": 0}
    patched = {}
    for name in ("tolist", "numpy", "cpu", "item", "__bool__", "__int__", "__float__", "__index__"):
        orig = getattr(torch.Tensor, name)

        def counting(self, *a, _orig=orig, **k):
            out["n"] += not out["in_method"]
            out["in_method"] += 1
            try:
                return _orig(self, *a, **k)
            finally:
                out["in_method"] -= 1
        patched[name] = orig
        setattr(torch.Tensor, name, counting)
    try:
        with _ScalarReads(out):
            yield out
    finally:
        for name, orig in patched.items():
            setattr(torch.Tensor, name, orig)


def generate(dec, *a, **k):
    """Decoder.generate under no_grad instead of inference_mode, which hides ops from a dispatch mode."""
    with torch.no_grad():
        return Decoder.generate.__wrapped__(dec, *a, **k)


@pytest.fixture(scope="module")
def runners():
    torch.manual_seed(0)
    target = StaticCausalLM(make_model(64, hidden_size=16, layers=2, seed=3), max_cache_len=128)
    draft = StaticCausalLM(make_model(64, hidden_size=16, layers=1, seed=3), max_cache_len=128,
                           head=AcceptanceHead(16, depth=1))
    return target, draft


def _rules(draft):
    head = draft.head
    return {"fixed": FixedK(3), "learned": LearnedThreshold(head, 0.5, k_max=8),
            "confidence": ConfidenceThreshold(0.3, k_max=8), "entropy": EntropyThreshold(2.0, k_max=8)}


@pytest.mark.parametrize("params", [SamplingParams(1.0, top_k=8, top_p=0.9), GREEDY], ids=["t1-topk-topp", "greedy"])
@pytest.mark.parametrize("rule", ["fixed", "learned", "confidence", "entropy"])
def test_one_host_read_per_round(runners, rule, params):
    target, draft = runners
    dec = Decoder(target, draft, host_reads="round")
    policy = _rules(draft)[rule]
    dec.generate([5, 9, 4], 4, params, policy, seed=1)  # warm: lazy imports and first-call paths read nothing later
    with host_reads() as reads:
        g = generate(dec, [5, 9, 4], 24, params, policy, seed=0)
    m = g.metrics
    rounds = sum(m.accepted_hist.values())
    assert rounds >= 3 and m.n_tokens == 24
    assert reads["n"] == rounds == m.host_reads, (reads["n"], rounds)


def test_the_counter_sees_a_read_per_drafted_token_when_the_host_decides(runners):
    """The broken control: the same learned rule asked on the host reads once per drafted token too."""
    target, draft = runners
    dec = Decoder(target, draft, host_reads="token")
    policy = _rules(draft)["learned"]
    with host_reads() as reads:
        g = generate(dec, [5, 9, 4], 24, GREEDY, policy, seed=0)
    rounds = sum(g.metrics.accepted_hist.values())
    assert reads["n"] >= g.metrics.n_drafted + 1  # a stop read per drafted token, and the verify reads


def test_an_unbinding_cap_gives_the_host_rules_rounds(runners):
    """Greedy and a cap at k_max: the device's first stop is the host rule's stop, round for round."""
    target, draft = runners
    for name in ("learned", "confidence", "entropy", "fixed"):
        host = Decoder(target, draft, host_reads="token").generate([5, 9, 4], 30, GREEDY, _rules(draft)[name])
        dev = Decoder(target, draft, host_reads="round")
        dev.graph_round.caps = RoundCaps(start=8, window=0)  # no history: every round drafts k_max
        got = dev.generate([5, 9, 4], 30, GREEDY, _rules(draft)[name])
        assert got.token_ids == host.token_ids, name
        assert got.metrics.accepted_hist == host.metrics.accepted_hist, name
        assert got.metrics.n_drafted == host.metrics.n_drafted, name


def test_greedy_device_rounds_equal_the_target_alone(runners):
    target, draft = runners
    ref = Decoder(target).generate([5, 9, 4], 40, GREEDY).token_ids
    for name, rule in _rules(draft).items():
        g = Decoder(target, draft, host_reads="round").generate([5, 9, 4], 40, GREEDY, rule)
        assert g.token_ids == ref, name
        m = g.metrics
        assert m.n_drafted == m.n_accepted + m.n_discarded
        assert m.n_draft_forwards >= m.n_drafted + m.n_past_stop - sum(m.accepted_hist.values())


class _OpsOutsideSteps(TorchDispatchMode):
    """Counts the ops dispatched outside the static runners' steps (StaticCausalLM._run: the step and its
    epilogue, one captured graph on a GPU): what a decode launches eagerly around the graphs."""

    def __init__(self):
        super().__init__()
        self.n, self.depth = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += self.depth == 0 and not func.is_view  # a view launches nothing
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rule", ["learned", "fixed"])
def test_eager_ops_around_the_graphs_per_round(runners, rule, monkeypatch):
    """A device round launches a bounded number of eager ops around the steps' graphs: the round's uniforms
    and buffer resets, the verify input, the read, the rollbacks and the loop's bookkeeping, and nothing per
    drafted token. The host-decided round pays its sampling and stop rule per drafted token (the control)."""
    target, draft = runners
    mode = _OpsOutsideSteps()
    inner = StaticCausalLM._run

    def run(self, *a, **k):
        mode.depth += 1
        try:
            return inner(self, *a, **k)
        finally:
            mode.depth -= 1
    monkeypatch.setattr(StaticCausalLM, "_run", run)
    per = {}
    for reads in ("round", "token"):
        dec = Decoder(target, draft, host_reads=reads)
        dec.generate([5, 9, 4], 4, SamplingParams(1.0, top_k=8), _rules(draft)[rule], seed=1)
        mode.n = 0
        with mode:
            g = dec.generate([5, 9, 4], 40, SamplingParams(1.0, top_k=8), _rules(draft)[rule], seed=0)
        m = g.metrics
        rounds = sum(m.accepted_hist.values())
        per[reads] = (mode.n / rounds, mode.n / max(m.n_drafted, 1))
    # per round, whatever its length: the uniforms, the control pair, the verify input, the rollbacks, the
    # sequence's growth; a host-decided round pays tens per drafted token
    assert per["round"][0] <= 9, per
    assert per["token"][1] > 2 * per["round"][1], per


def test_round_caps_follow_the_rules_recent_stops():
    caps = RoundCaps(start=4, grow=2, window=2)
    assert caps.cap(20) == 4 and caps.cap(3) == 3
    caps.update(2, True, 4)
    assert caps.cap(20) == 2
    caps.update(6, False, 6)  # the cap cut the rule short: grow past it
    assert caps.cap(20) == 8
    caps.update(1, True, 8), caps.update(1, True, 2)
    assert caps.cap(20) == 1
    caps.reset()
    assert caps.cap(20) == 4


class _MockHead(torch.nn.Module):
    """An acceptance head of the mocks' 2-wide hidden state that varies with the context. A context head (it
    scores y_i at step i: no lag), so that a round of L = 3 tokens can stop at its first candidate."""

    feature = "context"

    def acceptance_prob(self, h):
        return torch.sigmoid(h[..., 0] - 2.0).reshape(())


@pytest.mark.parametrize("params,rule", [
    (SamplingParams(1.0), "learned"),
    (SamplingParams(1.0), "learned-past-stop"),
    (SamplingParams(1.0, top_k=3), "confidence"),
    (SamplingParams(0.8, top_p=0.7), "fixed"),
    (SamplingParams(1.0), "entropy"),
], ids=["t1-learned", "t1-learned-past-stop", "topk3-confidence", "topp0.7-fixed", "t1-entropy"])
def test_device_round_distribution_is_exact(params, rule):
    draft, target = exact_pair()
    policy = {"learned": LearnedThreshold(_MockHead(), 0.6, k_max=4),
              "learned-past-stop": LearnedThreshold(_MockHead(), 0.3, k_max=4), "confidence": ConfidenceThreshold(0.5, k_max=4),
              "fixed": FixedK(2), "entropy": EntropyThreshold(1.0, k_max=4)}[rule]
    probs = exact_sequence_probs(target, [1, 2], params)
    dec = Decoder(target, draft, host_reads="round")
    # past the rule's stop in some rounds, short of it in others; or always past it
    dec.graph_round.caps = RoundCaps(start=4, window=0) if rule == "learned-past-stop" else RoundCaps(start=3)
    counts = sample_counts(dec, [1, 2], params, policy, n=N_SAMPLES)
    assert chi_square_pvalue(counts, probs, N_SAMPLES) > 1e-3


def _bonus_as_rejection(y, q, p, r, u, k=None):
    """verify_u with one mistake: when all k proposed candidates are accepted but the round drafted more
    (k < m), the token after them is drawn from the residual against the q of the next, unproposed
    candidate instead of from p_{k+1}."""
    m = y.shape[0]
    rows = torch.arange(m)
    n = ((r * q[rows, y] < p[rows, y]) & (rows < k)).long().cumprod(0).sum()
    q_n = q.index_select(0, n.clamp_max(m - 1).view(1))[0] * (n < m)
    return n, sampling.sample_u(sampling.residual(p.index_select(0, n.view(1))[0], q_n), u)


def test_device_round_distribution_test_catches_a_wrong_bonus_row(monkeypatch):
    """The broken control: the same check fails when the bonus after the rule's stop is drawn wrongly."""
    draft, target = exact_pair()
    params = SamplingParams(1.0)
    probs = exact_sequence_probs(target, [1, 2], params)
    monkeypatch.setattr("adaptive_spec.decoding.graph_round.verify_u", _bonus_as_rejection)
    dec = Decoder(target, draft, host_reads="round")
    dec.graph_round.caps = RoundCaps(start=4, window=0)  # every round drafts past the rule's stop
    counts = sample_counts(dec, [1, 2], params, LearnedThreshold(_MockHead(), 0.3, k_max=4), n=N_SAMPLES)
    assert chi_square_pvalue(counts, probs, N_SAMPLES) < 1e-3


def test_sampling_from_given_uniforms_is_the_generators_draw():
    """sample_u is sample with its uniform handed in: the same token for the same uniform."""
    g = torch.Generator().manual_seed(0)
    for V_ in (7, 5000):
        probs = torch.rand(3, V_, generator=g)
        probs[:, ::3] = 0
        a = sampling.sample(probs, torch.Generator().manual_seed(5))
        u = torch.rand((3, 1), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        assert torch.equal(a, sampling.sample_u(probs, u))


def test_breakdown_adds_up_on_one_clock(runners):
    target, draft = runners
    for reads in ("round", "token"):
        g = Decoder(target, draft, host_reads=reads).generate([5, 9, 4], 16, SamplingParams(1.0), _rules(draft)["learned"])
        parts = g.metrics.breakdown()
        # a device round's rule runs in the draft's step (its epilogue), so it has no part of its own
        assert {"prefill", "draft_forward", "target_forward", "draft_other", "verify_other", "rollback",
                "rest"} | ({"policy"} if reads == "token" else set()) <= set(parts)
        assert sum(parts.values()) == pytest.approx(g.metrics.wall_s, rel=1e-9)
        assert all(v >= 0 for v in parts.values())


def test_a_bad_host_reads_is_refused(runners):
    for bad in ("sometimes", 0, True):
        with pytest.raises(UserError, match="round or an integer N >= 1"):
            Decoder(runners[0], host_reads=bad)


def test_generate_with_one_read_a_round_from_the_command_line(tiny_pair, capsys):
    """--host-reads round on the CPU, through the command line: the same greedy tokens as the target alone,
    and one read a round (the --json metrics)."""
    import json

    from adaptive_spec.cli import main

    draft, target = tiny_pair
    common = ["--prompt", "abc", "--target", str(target), "--dtype", "fp32", "--temperature", "0",
              "--max-new-tokens", "20", "--json"]
    outs = {}
    for name, extra in (("ar", ["--policy", "ar"]),
                        ("round", ["--draft", str(draft), "--policy", "entropy", "--threshold", "2.0",
                                   "--host-reads", "round", "--kv-cache", "static"]),
                        ("token", ["--draft", str(draft), "--policy", "entropy", "--threshold", "2.0",
                                   "--host-reads", "token"])):
        assert main(["generate", *common, *extra]) == 0
        outs[name] = json.loads(capsys.readouterr().out)
    assert outs["round"]["token_ids"] == outs["token"]["token_ids"] == outs["ar"]["token_ids"]
    m = outs["round"]["metrics"]
    assert m["host_reads"] == sum(m["accepted_hist"].values())
    assert outs["token"]["metrics"]["host_reads"] > m["host_reads"]


class _FakeGraph:
    """A CUDA graph stand-in on the CPU: 'capturing' records the step's call, `replay` runs it again and writes
    its results into the captured outputs, as a replay writes a graph's static outputs."""

    def replay(self):
        for o, n in zip(self.out, self.fn()):
            o.copy_(n)


def _fake_cuda_graphs(monkeypatch):
    active = {}

    @contextlib.contextmanager
    def graph(g, **kw):
        active["g"] = g
        try:
            yield
        finally:
            active.pop("g")
    step = StaticCausalLM._step

    def recording_step(self, *a):
        out = step(self, *a)
        if "g" in active:
            active["g"].fn, active["g"].out = (lambda: step(self, *a)), out
        return out

    class _Stream:
        def __init__(self, *a):
            pass

        def wait_stream(self, other):
            pass
    monkeypatch.setattr(StaticCausalLM, "_step", recording_step)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())


@pytest.mark.parametrize("params", [SamplingParams(1.0, top_k=8), GREEDY], ids=["t1-topk", "greedy"])
def test_epilogues_captured_in_graphs_decode_as_eagerly(params, monkeypatch):
    """The capture path's bookkeeping (the warm-up runs put the position and the epilogue's state back; the
    epilogue's graph made on first use, only for the shapes warmed up; outputs copied out of a replay) under
    stand-in graphs on the CPU: seed for seed the tokens and rounds of the eager runners."""
    _fake_cuda_graphs(monkeypatch)

    def pair(graphs: bool):
        torch.manual_seed(0)
        head = AcceptanceHead(16, depth=1)
        target = StaticCausalLM(make_model(64, hidden_size=16, layers=2, seed=3), max_cache_len=128)
        draft = StaticCausalLM(make_model(64, hidden_size=16, layers=1, seed=3), max_cache_len=128, head=head)
        if graphs:
            target._graphs, draft._graphs = {}, {}
            target.warmup(range(1, 10))
            draft.warmup([(1, 1), (2, 1)], with_head=True)
        return target, draft, head

    got = {}
    for graphs in (False, True):
        target, draft, head = pair(graphs)
        dec = Decoder(target, draft, host_reads="round")
        got[graphs] = [dec.generate([5, 9, 4], 30, params, rule, seed=s)
                       for s in range(2) for rule in (LearnedThreshold(head, 0.5, k_max=8), FixedK(3))]
        if graphs:
            assert any(len(k) == 4 for k in draft._graphs) and any(len(k) == 4 for k in target._graphs)
    for a, b in zip(got[False], got[True]):
        assert a.token_ids == b.token_ids
        assert a.metrics.accepted_hist == b.metrics.accepted_hist and a.metrics.n_drafted == b.metrics.n_drafted


def test_device_rounds_with_the_feature_drafter():
    """The feature drafter reads every verified row's state through its tap: a device round's verification runs
    after the tapped forward (never inside the target's graph, which returns the last row), so greedy output is
    the target's and the distribution is exact."""
    from adaptive_spec.drafter.model import FeatureDrafter
    from adaptive_spec.drafter.source import feature_pair

    for vocab, hidden, seed in ((32, 24, 2), (V, 16, 3)):
        model = make_model(vocab, hidden_size=hidden, layers=2, seed=seed, logit_scale=4.0 if vocab == 32 else 3.0)
        torch.manual_seed(1)
        tap, fr = feature_pair(StaticCausalLM(model, max_cache_len=64), model, FeatureDrafter.for_target(model))
        dec = Decoder(tap, fr, host_reads="round")
        if vocab == 32:
            ref = Decoder(StaticCausalLM(model, max_cache_len=64)).generate([5, 9, 4], 30, GREEDY).token_ids
            for rule in (FixedK(3), EntropyThreshold(1.5, k_max=6)):
                g = dec.generate([5, 9, 4], 30, GREEDY, rule)
                assert g.token_ids == ref and g.metrics.host_reads == sum(g.metrics.accepted_hist.values())
                # the tap kept a state for every position the target holds (none read as zeros)
                assert tap.features(0, tap.length).abs().sum(-1).min() > 0
        else:
            params = SamplingParams(1.0)
            probs = exact_sequence_probs(StaticCausalLM(model, max_cache_len=64), [1, 2], params)
            counts = sample_counts(dec, [1, 2], params, EntropyThreshold(1.0, k_max=3), n=1000)
            assert chi_square_pvalue(counts, probs, 1000) > 1e-3


@pytest.mark.parametrize("every", [1, 2, 3])
def test_chunked_device_rounds_read_once_a_chunk(runners, every):
    """host_reads=N: the stop is read after every N drafted tokens (and verification once): reads per round
    = the chunks that ended short of the cap + 1; greedy output is the target's, and at most N - 1 steps run
    past the rule's stop in a round."""
    target, draft = runners
    ref = Decoder(target).generate([5, 9, 4], 30, GREEDY).token_ids
    host = Decoder(target, draft, host_reads="token").generate([5, 9, 4], 30, GREEDY, _rules(draft)["learned"])
    dec = Decoder(target, draft, host_reads=every)
    with host_reads() as reads:
        g = generate(dec, [5, 9, 4], 30, GREEDY, _rules(draft)["learned"], seed=0)
    m = g.metrics
    rounds = sum(m.accepted_hist.values())
    assert g.token_ids == ref
    # the rule's own stops (no cap): the host rule's rounds
    assert m.accepted_hist == host.metrics.accepted_hist and m.n_drafted == host.metrics.n_drafted
    steps = m.n_drafted + m.n_past_stop  # drafted steps: a read after each chunk of them, one verify read a round
    assert rounds < reads["n"] == m.host_reads <= 2 * rounds + steps / every
    assert m.n_past_stop <= (every - 1) * rounds
    if every == 1:
        assert m.n_past_stop == 0


@pytest.mark.parametrize("rule", ["learned", "confidence"])
def test_chunked_device_round_distribution_is_exact(rule):
    draft, target = exact_pair()
    params = SamplingParams(1.0, top_k=4)
    policy = {"learned": LearnedThreshold(_MockHead(), 0.3, k_max=4), "confidence": ConfidenceThreshold(0.5, k_max=4)}
    probs = exact_sequence_probs(target, [1, 2], params)
    counts = sample_counts(Decoder(target, draft, host_reads=2), [1, 2], params, policy[rule], n=N_SAMPLES)
    assert chi_square_pvalue(counts, probs, N_SAMPLES) > 1e-3
