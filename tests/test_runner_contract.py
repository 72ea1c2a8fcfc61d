"""One conformance suite over every runner (backends/contract.py): the torch runners (dynamic and static KV
cache, the fused decoder), the llama.cpp runner (a tiny GGUF; skipped, naming why, without the binding), the windowed draft and
the tests' table runners. Each is fed the same way the decoder feeds it: a prefill, one-row steps, a
multi-row verify pass, a rollback, a reset; the engine records' "tree" capability is held to the tree
contract of the runners they build."""
from __future__ import annotations

import pytest
import torch

from adaptive_spec.backends import engines, llamacpp
from adaptive_spec.backends.contract import Counters, Runner, TreeRunner
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.backends.static_runner import FusedCausalLM, StaticCausalLM
from adaptive_spec.backends.window import WindowedDraft
from tiny import MockLM, make_model, save_gguf
from tree_mocks import TreeMockLM

V = 12
IDS = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])


def _gguf(tmp_path):
    why = llamacpp.available()
    if why:
        pytest.skip(f"llama.cpp backend unavailable: {why}")
    return llamacpp.LlamaCppLM(save_gguf(make_model(V, 16, seed=3), tmp_path / "t.gguf"), n_ctx=64, n_threads=1)


# name -> (runner factory, whether its engine declares the tree capability)
RUNNERS = {
    "dynamic": (lambda tmp: CausalLM(make_model(V, 16, seed=3)), True),
    "static": (lambda tmp: StaticCausalLM(make_model(V, 16, seed=3), max_cache_len=64), True),
    "fused": (lambda tmp: FusedCausalLM(make_model(V, 16, seed=3), max_cache_len=64), True),
    "llama.cpp": (_gguf, False),
    # a window past the longest feed here: what the window drops is test_ngram.py's
    "windowed": (lambda tmp: WindowedDraft(CausalLM(make_model(V, 16, seed=3)), 16), False),
    "mock": (lambda tmp: MockLM(V, seed=0), False),
    "tree-mock": (lambda tmp: TreeMockLM(V, seed=0), True),
}


@pytest.fixture(params=list(RUNNERS))
def runner(request, tmp_path):
    make, tree = RUNNERS[request.param]
    return request.param, make(tmp_path), tree


def test_every_runner_keeps_the_contract(runner):
    name, lm, tree = runner
    assert isinstance(lm, Runner) and isinstance(lm.counters, Counters)
    assert lm.vocab_size == V and isinstance(lm.device, torch.device)
    lm.reset()
    lm.counters.restart()
    assert lm.length == 0
    # prefill without logits, then the decoder's steps: one row, two rows (a fully accepted round), a verify pass
    logits, hidden = lm.forward(IDS[:5], n_logits=0)
    assert tuple(logits.shape) == (0, V) and hidden.dim() == 1 and lm.length == 5
    lm.counters.end_prefill()
    assert lm.counters.n_forwards == 0 and lm.counters.prefill_s == lm.counters.seconds >= 0
    step, _ = lm.forward(IDS[5:6], n_logits=1)
    two, _ = lm.forward(IDS[6:8], n_logits=1)
    verify, _ = lm.forward(IDS[8:10], n_logits=2)
    assert tuple(step.shape) == (1, V) and tuple(verify.shape) == (2, V) and step.dtype == torch.float32
    assert lm.length == 10 and lm.counters.n_forwards == 3 and lm.counters.seconds >= lm.counters.prefill_s
    # a rollback forgets exactly the positions past it: the same feed gives the same logits
    lm.rollback(8)
    assert lm.length == 8
    again, _ = lm.forward(IDS[8:10], n_logits=2)
    torch.testing.assert_close(again, verify, rtol=1e-4, atol=1e-4)
    lm.rollback(20)  # past the end: nothing to forget
    assert lm.length == 10
    # chunked feeding equals one pass (what lets a round feed the pending token with its candidates)
    lm.reset()
    whole, _ = lm.forward(IDS, n_logits=2)
    torch.testing.assert_close(whole, verify, rtol=1e-4, atol=1e-4)
    before = lm.counters.saved()
    lm.reset()  # the counters are their owner's: a reset leaves them
    assert lm.counters.saved() == before and lm.length == 0
    if lm.max_length is not None:
        assert lm.max_length >= len(IDS)
    # the engine's "tree" capability promises the tree contract, and only then is it there
    assert isinstance(lm, TreeRunner) == tree, name


@pytest.mark.parametrize("name", ["dynamic", "static", "fused"])
def test_forward_hidden_gives_every_rows_state(name, tmp_path):
    """forward_hidden (what a feature drafter reads): forward's logits, and one final hidden state per fed row,
    the last of them forward's; a verify pass after a rollback gives the rows of a single pass."""
    lm, ref = RUNNERS[name][0](tmp_path), RUNNERS[name][0](tmp_path)
    lm.reset()
    ref.reset()
    _, rows = lm.forward_hidden(IDS[:6], n_logits=0)
    assert tuple(rows.shape) == (6, 16) and lm.length == 6
    lm.forward(IDS[6:8], n_logits=1)
    lm.rollback(7)
    logits, tail = lm.forward_hidden(IDS[7:10], n_logits=2)
    want, last = ref.forward(IDS[:10], n_logits=2)
    _, every = RUNNERS[name][0](tmp_path).forward_hidden(IDS[:10], n_logits=0)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert tuple(tail.shape) == (3, 16)
    torch.testing.assert_close(rows, every[:6], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tail, every[7:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tail[-1], last, rtol=1e-4, atol=1e-4)
    assert lm.length == 10


@pytest.mark.parametrize("name", [n for n, (_, tree) in RUNNERS.items() if tree])
def test_tree_runners_match_a_plain_pass_on_a_chain(name, tmp_path):
    """A tree pass whose attention pattern is a chain is an ordinary forward; compacting to a path keeps it."""
    lm = RUNNERS[name][0](tmp_path)
    lm.reset()
    lm.forward(IDS[:6], n_logits=0)
    n = 4
    attend = torch.tril(torch.ones(n, 6 + n, dtype=torch.bool), diagonal=6)
    logits, h = lm.tree_forward(IDS[6:10], torch.arange(6, 10), attend, logit_from=0)
    assert tuple(logits.shape) == (n, V) and h.shape[0] == n and lm.length == 10
    lm.compact(6, [6, 7])  # keep the first two chain nodes: a crop
    assert lm.length == 8
    ref = RUNNERS[name][0](tmp_path)
    ref.reset()
    want, _ = ref.forward(IDS[:10], n_logits=4)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    nxt, _ = lm.forward(IDS[8:10], n_logits=2)
    torch.testing.assert_close(nxt, want[2:], rtol=1e-4, atol=1e-4)


def test_the_torch_engine_declares_what_its_runners_do():
    """The records and the runners agree: torch builds TreeRunners and says "tree"; llama.cpp does not."""
    assert "tree" in engines.get("torch").capabilities and "tree" not in engines.get("llama.cpp").capabilities
    def tree_hooks(cls):  # a Protocol with data members refuses issubclass: read the two methods
        return all(callable(getattr(cls, m, None)) for m in ("tree_forward", "compact"))

    assert tree_hooks(CausalLM) and tree_hooks(StaticCausalLM) and not tree_hooks(llamacpp.LlamaCppLM)


def test_counters_time_later_and_restore():
    """Pending times (CUDA events) are read once, when read; a measurement beside a decode restores them."""
    c = Counters()
    calls = []
    c.add(0.5)
    c.add_pending(lambda: calls.append(1) or 0.25)
    assert c.n_forwards == 2 and not calls
    assert c.seconds == 0.75 and c.seconds == 0.75 and calls == [1]
    saved = c.saved()
    c.add(1.0)
    c.end_prefill()
    assert c.n_forwards == 0 and c.prefill_s == 1.75
    c.restore(saved)
    assert c.saved() == (0.75, 2, 0.0)
