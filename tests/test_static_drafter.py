"""The feature drafter on a static KV cache (adaptive_spec/drafter/static.py): the runner contract, step for
step the same logits, states and bookkeeping as FeatureRunner (rollback and the re-feed of drafted slots
included), the acceptance head inside the step, greedy speculative output equal to the target's, exactness by
chi-square with a broken control, and a count that the compiled one-token step is what runs each draft step.
Runtimes on a CPU: eager, and torch.compile with dynamo's "eager" backend (it traces, compiles nothing)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from adaptive_spec.backends.contract import HeadRunner
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.decoding import sampling
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.decoding.interfaces import PolicyContext
from adaptive_spec.decoding.pipeline import make_policy
from adaptive_spec.decoding.policies import FixedK
from adaptive_spec.decoding.sampling import SamplingParams
from adaptive_spec.drafter.model import FeatureDrafter, Readout
from adaptive_spec.drafter.source import FeatureRunner, feature_pair
from adaptive_spec.drafter.static import StaticFeatureRunner
from adaptive_spec.errors import UserError
from adaptive_spec.heads.head import AcceptanceHead
from exact import chi_square_pvalue, exact_sequence_probs, sample_counts
from test_drafter import GREEDY, tiny_target
from test_runner_contract import test_every_runner_keeps_the_contract as keeps_the_contract
from tiny import make_model

RUNTIMES = {"eager": {"runtime": "eager"}, "compile": {"runtime": "compile", "compiler": "eager"}}


def static_pair(model, seed=0, kept=None, head=None, **kw):
    """(the tapped target, FeatureRunner, StaticFeatureRunner): one drafter, both runners reading one tap."""
    torch.manual_seed(seed)
    d = FeatureDrafter.for_target(model)
    tap, fr = feature_pair(CausalLM(model), model, d, kept)
    sfr = StaticFeatureRunner(fr.drafter, fr.readout, tap, max_cache_len=kw.pop("max_cache_len", 96), head=head,
                              **kw)
    sfr.warmup()
    return tap, fr, sfr


class States:
    """A tap stand-in: the target's states of the first `n` positions (random, fixed)."""

    def __init__(self, n: int, hidden: int):
        self.length, self.rows = n, torch.randn(n, hidden, generator=torch.Generator().manual_seed(5))

    def features(self, start: int, end: int) -> torch.Tensor:
        return self.rows[start:end]

    def fresh(self):
        return self


@pytest.mark.parametrize("rt", list(RUNTIMES))
@pytest.mark.parametrize("tap", ["none", "states"])
def test_the_static_drafter_keeps_the_runner_contract(rt, tap):
    """tests/test_runner_contract.py's suite (vocabulary 12, hidden 16): every slot f^ (no tap), or the first
    six positions' states held (runs of real states, single real slots and f^ slots mixed)."""
    model = make_model(12, 16, seed=3)
    torch.manual_seed(0)
    d = FeatureDrafter.for_target(model)
    lm = StaticFeatureRunner(d, Readout(model), States(6, 16) if tap == "states" else None, max_cache_len=64,
                             **RUNTIMES[rt])
    keeps_the_contract((f"static-drafter-{rt}", lm, False))
    assert isinstance(lm, HeadRunner)


def _both(runners, ids, n_logits=1):
    (l1, h1), (l2, h2) = (r.forward(ids, n_logits) for r in runners)
    return l1, h1, l2, h2


@pytest.mark.parametrize("rt", list(RUNTIMES))
@pytest.mark.parametrize("kept", [None, torch.tensor([1, 4, 5, 9, 17, 20, 23, 30])], ids=["full", "kept"])
def test_step_for_step_the_same_as_feature_runner(rt, kept):
    """The calls a decode makes (a prefill, a round's first step over the target's states, f^ steps, the
    target's verification, a re-feed of the drafted slots, rollbacks, a two-token step): the same logits, state,
    argmax and slot bookkeeping as FeatureRunner, call for call."""
    model = tiny_target()
    tap, fr, sfr = static_pair(model, kept=kept, **RUNTIMES[rt])
    ids = torch.tensor([5, 9, 4, 17, 8, 6, 11, 12, 3, 21, 7, 2, 14])

    def check(feed, n_logits=1):
        l1, h1, l2, h2 = _both((fr, sfr), feed, n_logits)
        torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h2, h1, rtol=1e-5, atol=1e-5)
        if n_logits:
            assert torch.equal(l2.argmax(-1), l1.argmax(-1))
        assert (sfr.length, sfr.slots, sfr.real) == (fr.length, fr.slots, fr.real), feed
    tap.forward(ids[:5], n_logits=0)
    check(ids[:5], 0)  # prefill: slots 0..3 real
    check(ids[5:6])  # slot 4 real (a single slot)
    for i in range(6, 9):
        check(ids[i:i + 1])  # slots 5..7 read f^
    assert sfr.real == 5 and sfr.slots == 8
    tap.forward(ids[5:8], n_logits=1)  # the target verifies x_5..x_7
    sfr.rollback(8), fr.rollback(8)  # x_8 rejected
    check(ids[8:9])  # slots 5..7 (5, 6 drafted with f^) fed again with the target's states, in one pass
    assert sfr.real == 8
    check(ids[9:10])  # slot 8 reads f^
    check(ids[10:12], 2)  # two tokens past the target: f^ slots, both rows
    sfr.rollback(4), fr.rollback(4)
    assert (sfr.length, sfr.slots, sfr.real) == (4, 3, 3)
    check(ids[4:7], 3)  # slots 3..5 real
    check(ids[7:8])  # slot 6 real (a single slot)
    check(ids[8:9])  # slot 7 real
    check(ids[9:10])  # slot 8 reads f^ again


@pytest.mark.parametrize("rt", list(RUNTIMES))
def test_the_head_in_the_step_is_the_head_on_its_state(rt):
    model = tiny_target()
    head = AcceptanceHead(24, depth=1).eval()
    tap, fr, sfr = static_pair(model, head=head, **RUNTIMES[rt])
    ids = torch.tensor([5, 9, 4, 17, 8, 6])
    tap.forward(ids[:4], n_logits=0)
    sfr.forward(ids[:4], n_logits=0)
    fr.forward(ids[:4], n_logits=0)
    for i in range(4, 6):  # a real slot, then an f^ slot
        logits, h, p = sfr.forward_with_head(ids[i:i + 1], 1)
        want, h_ref = fr.forward(ids[i:i + 1], 1)
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
        with torch.inference_mode():
            torch.testing.assert_close(p, head.acceptance_prob(h).float())
        assert p.shape == () and p.dtype == torch.float32
    other = AcceptanceHead(24, depth=1).eval()  # same shape: its values copied into the attached head
    sfr.attach_head(other)
    _, h, p = sfr.forward_with_head(ids[5:6], 1)
    with torch.inference_mode():
        torch.testing.assert_close(p, other.acceptance_prob(h).float())
    with pytest.raises(UserError, match="needs an acceptance head"):
        StaticFeatureRunner(fr.drafter, fr.readout, tap).forward_with_head(ids[:1], 1)


@pytest.mark.parametrize("rt", list(RUNTIMES))
@pytest.mark.parametrize("policy", ["fixed", "learned"])
@pytest.mark.parametrize("reads", ["token", "round"])
def test_greedy_speculative_through_the_static_drafter_equals_the_target(rt, policy, reads):
    """Greedy output with the static drafter equals the target's, the host deciding each stop ("token") or the
    device round with its epilogue in the step ("round"); the learned rule's head runs inside the step. (A
    vocabulary of 8: the random drafter's greedy tokens are accepted in some rounds, so rounds re-feed.)"""
    model = tiny_target(vocab=8)
    _, fr, sfr = static_pair(model, **RUNTIMES[rt])
    tap = sfr.tap
    prompt = [1, 2, 3, 4]
    ref = Decoder(CausalLM(model)).generate(prompt, max_new_tokens=30, sampling=GREEDY).token_ids
    kw = {"k": 3} if policy == "fixed" else {"head": AcceptanceHead(24, depth=1), "threshold": 0.3}
    ctx = PolicyContext(SimpleNamespace(target=tap, draft=sfr, eos_token_ids=[]), prompt, GREEDY, 30)
    dec = Decoder(tap, sfr, host_reads=reads)
    assert dec.draft_runs_heads
    g = dec.generate(prompt, max_new_tokens=30, sampling=GREEDY, policy=make_policy(policy, ctx, **kw))
    assert g.token_ids == ref
    assert g.metrics.n_drafted > 0 and (g.metrics.n_accepted > 0 or policy == "learned")
    if policy == "fixed":  # FeatureRunner's proposals are the same: so are the rounds
        ref_tap, ref_fr = feature_pair(CausalLM(model), model, fr.drafter)
        fk = Decoder(ref_tap, ref_fr).generate(prompt, max_new_tokens=30, sampling=GREEDY, policy=FixedK(3))
        assert g.metrics.accepted_hist == fk.metrics.accepted_hist


def test_no_host_read_in_a_step():
    """Nothing reads a tensor's value back to the host in a one-token step (a real slot, an f^ slot, with the
    head, after a rollback) nor in a re-feed of the target's states. Control: FeatureRunner reads its tokens.
    (The eager runtime: a dispatch mode that counts reads stops torch.compile; the compiled step is this one.)"""
    from test_device_round import host_reads

    model = tiny_target()
    tap, fr, sfr = static_pair(model, head=AcceptanceHead(24, depth=1).eval())
    ids = torch.tensor([5, 9, 4, 17, 8, 6, 11])
    tap.forward(ids[:4], n_logits=0)
    sfr.forward(ids[:4], n_logits=0)
    with torch.no_grad(), host_reads() as reads:
        sfr._run(ids[4:5], 1, True, None)  # slot 3 real
        sfr._run(ids[5:6], 1, True, None)  # slot 4 reads f^
        sfr._run(ids[6:7], 1, False, None)
        sfr.rollback(6)
        sfr._run(ids[6:7], 1, False, None)  # slot 5 again
        tap.forward(ids[4:7], n_logits=1)  # the target holds positions 0..6
        sfr.rollback(6)
        sfr._run(ids[6:7], 1, False, None)  # slots 4..5 fed again with the target's states
    assert reads["n"] == 0 and sfr.real == 6
    with torch.no_grad(), host_reads() as reads:
        FeatureRunner.forward.__wrapped__(fr, ids[:5], 1)
    assert reads["n"] > 0


# ---- exact output distribution (tests/test_drafter.py's, through the static drafter) --------------

V, L, N = 5, 3, 1500


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "control-wrong-residual"])
def test_distribution_through_the_static_drafter_is_exact(broken, monkeypatch):
    """Chi-square of the sampled output against the target's enumerated distribution, through the compiled
    static drafter; the control draws the correction after a rejection from p instead of the residual, and
    the same test fails it."""
    model = tiny_target(vocab=V, seed=3, scale=3.0, hidden=16)
    tap, _, sfr = static_pair(model, seed=1, **RUNTIMES["compile"])
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(CausalLM(model), prompt, params, V, L)
    if broken:
        monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    pvalue = chi_square_pvalue(sample_counts(Decoder(tap, sfr), prompt, params, FixedK(2), N, L), probs, N)
    assert (pvalue < 1e-3) if broken else (pvalue > 1e-3), pvalue


# ---- the compiled step is the one that runs ----------------------------------------------------------

class CountingBackend:
    """A torch.compile backend that runs the traced graph eagerly (as "eager" does) and counts its
    compilations and its runs: a step that fell back to Python never reaches it."""

    def __init__(self):
        self.compiled = self.runs = 0

    def __call__(self, gm, example_inputs):
        self.compiled += 1

        def run(*args):
            self.runs += 1
            return gm.forward(*args)
        return run


@pytest.mark.parametrize("reads", ["token", "round"])
def test_every_one_token_draft_step_runs_the_compiled_step(reads, monkeypatch):
    """Over a decode, the compiled graph runs once per one-token feed (counted inside the graph's backend),
    the eager step never, and the rest are runs of the target's states fed in one pass. Control: the eager
    runtime takes the same steps and never touches the backend."""
    model = tiny_target(vocab=8)
    backend = CountingBackend()
    tap, _, sfr = static_pair(model, runtime="compile", compiler=backend)
    eager_steps, feeds = [], []
    one, feed = sfr._one, sfr.step.feed
    monkeypatch.setattr(sfr, "_one", lambda *a: eager_steps.append(a) or one(*a))
    monkeypatch.setattr(sfr.step, "feed", lambda *a: feeds.append(a[1].numel()) or feed(*a))
    dec = Decoder(tap, sfr, host_reads=reads)
    backend.runs = 0
    g = dec.generate([1, 2, 3, 4], max_new_tokens=40, sampling=GREEDY, policy=FixedK(4))
    m = g.metrics
    rounds = sum(m.accepted_hist.values())
    assert eager_steps == [] and backend.compiled == 1  # traced once (at warm-up), never again
    assert backend.runs >= m.n_drafted - rounds > 0  # every step after a round's first reads f^: compiled
    assert backend.runs + len(feeds) == m.n_draft_forwards + 1  # + the prefill, fed in one pass
    assert all(n > 1 for n in feeds) and len(feeds) > 1  # re-feeds after accepting rounds; single slots: the step
    plain = StaticFeatureRunner(sfr.drafter, sfr.readout, tap, max_cache_len=96)
    backend.runs = 0
    g2 = Decoder(tap, plain, host_reads=reads).generate([1, 2, 3, 4], max_new_tokens=40, sampling=GREEDY,
                                                         policy=FixedK(4))
    assert g2.token_ids == g.token_ids and backend.runs == 0


def test_the_pair_builds_the_static_drafter_for_the_static_cache_or_a_graph_runtime(monkeypatch):
    from adaptive_spec.drafter import static

    class Traced(StaticFeatureRunner):  # dynamo's "eager" backend: inductor's compile is the GPU's to test
        def __init__(self, *a, **kw):
            super().__init__(*a, compiler="eager", **kw)
    monkeypatch.setattr(static, "StaticFeatureRunner", Traced)
    model = tiny_target()
    d = FeatureDrafter.for_target(model)
    assert isinstance(feature_pair(CausalLM(model), model, d)[1], FeatureRunner)
    for kw in ({"kv_cache": "static"}, {"kv_cache": "static", "runtime": "compile"}):
        runner = feature_pair(CausalLM(model), model, d, max_cache_len=64, **kw)[1]
        assert isinstance(runner, StaticFeatureRunner) and runner.runtime == kw.get("runtime", "eager")
    with pytest.raises(UserError, match="captures CUDA graphs"):
        StaticFeatureRunner(d, Readout(model), None, runtime="cudagraph")


def test_the_pair_loads_the_static_drafter_with_the_static_cache(tmp_path):
    """`--draft feature:PATH --kv-cache static` (SpecPair.load): the static drafter over the tapped static target,
    greedy output the target's, the learned rule's head in the drafter's step."""
    from transformers import AutoModelForCausalLM

    from adaptive_spec.decoding.pipeline import SpecPair
    from tiny import save_model

    path = save_model(tmp_path / "target", vocab_size=40, hidden_size=24, layers=2, seed=2, logit_scale=4.0)
    FeatureDrafter.for_target(AutoModelForCausalLM.from_pretrained(path)).save_pretrained(tmp_path / "d")
    pair = SpecPair.load(target=str(path), draft=f"feature:{tmp_path / 'd'}", dtype="fp32", device="cpu",
                         kv_cache="static", max_cache_len=128)
    assert isinstance(pair.draft, StaticFeatureRunner) and pair.draft.max_cache_len == 128
    kw = dict(max_new_tokens=20, temperature=0, seed=0)
    ref = pair.generate("abc de", policy="ar", **kw).token_ids
    assert pair.generate("abc de", policy="fixed", k=3, **kw).token_ids == ref


def test_a_step_the_compiler_cannot_lower_runs_eagerly(caplog):
    """A compiler that fails on the step (inductor's CPU lowering can) leaves the runner eager with a warning, and
    the decode the target's greedy output. Control: the eager runner's steps, the same tokens."""
    def failing(gm, example_inputs):
        raise RuntimeError("cannot lower")

    model = tiny_target(vocab=8)
    with caplog.at_level("WARNING"):
        tap, _, sfr = static_pair(model, runtime="compile", compiler=failing)
    assert sfr._compiled is None and "runs eagerly" in caplog.text
    kw = dict(max_new_tokens=24, sampling=GREEDY)
    got = Decoder(tap, sfr).generate([1, 2, 3, 4], policy=FixedK(3), **kw).token_ids
    assert got == Decoder(tap, None).generate([1, 2, 3, 4], policy=None, **kw).token_ids
