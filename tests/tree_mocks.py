"""Mocks for tree and multi-draft decoding tests.

`TreeMockLM` is tests/tiny.py's trigram `MockLM` with the two extra operations tree decoding
needs from a model: a forward with an arbitrary attention pattern (`tree_forward`) and cache
compaction (`compact`). A token's "context" is what its attention row allows: the previous token
of a row is the last slot it may attend to before its own, exactly as a causal transformer would
see a tree path. `ConstHead` / `MockHead` stand in for an AcceptanceHead. `hf_pair` and
`mock_pair` are the (draft, target) pairs the tree tests decode with.
"""
from __future__ import annotations

import torch

from adaptive_spec.backends.runner import CausalLM
from tiny import MockLM, make_model

MOCK_V = 5  # vocabulary of mock_pair: small enough to enumerate every continuation


def hf_pair(vocab=32, scale=4.0):
    """Tiny Qwen2 models (draft, target)."""
    target = CausalLM(make_model(vocab, hidden_size=24, layers=2, seed=2, logit_scale=scale))
    draft = CausalLM(make_model(vocab, hidden_size=16, layers=2, seed=1, logit_scale=scale))
    return draft, target


def mock_pair():
    """(draft, target) trigram mocks, far apart."""
    return TreeMockLM(MOCK_V, seed=4), TreeMockLM(MOCK_V, seed=3)


class TreeMockLM(MockLM):
    def reset(self):
        super().reset()
        self.prev: list[int] = []  # cache slot of each slot's predecessor (-1: none)

    def forward(self, ids, n_logits: int = 1):
        start = len(self.tokens)
        self.prev.extend(range(start - 1, start - 1 + len(ids)))
        return super().forward(ids, n_logits)

    def tree_forward(self, ids, positions, attend, logit_from: int = 0):
        n = len(ids)
        base = len(self.tokens)
        assert tuple(attend.shape) == (n, base + n), (tuple(attend.shape), n, base)
        attend = attend.cpu()
        self.tokens.extend(int(t) for t in ids)
        V = self.vocab_size
        rows, hid = [], []
        for r in range(n):
            me = base + r
            assert attend[r, me], "a token must attend to itself"
            allowed = attend[r, :me].nonzero().flatten().tolist()
            prev = allowed[-1] if allowed else -1
            # a causal model sees its ancestors as one sequence: the allowed slots must form a chain
            chain, c = [], prev
            while c >= 0:
                chain.append(c)
                c = self.prev[c]
            assert sorted(chain) == allowed, f"attention row {r} is not a path: {allowed} vs {sorted(chain)}"
            assert int(positions[r]) == len(chain), "position id must equal the path length"
            self.prev.append(prev)
            a = self.tokens[prev] if prev >= 0 else V
            rows.append(self.table[a, self.tokens[me]])
            hid.append(torch.tensor([float(self.tokens[me]), float(len(chain) + 1)]))
        self.counters.add(0.0)
        return torch.stack(rows[logit_from:]), torch.stack(hid)

    def compact(self, base: int, extra: list[int]):
        toks = self.tokens[:base] + [self.tokens[i] for i in extra]
        prev = self.prev[:base]
        for i in range(len(extra)):
            prev.append(base - 1 + i)
        for i, e in enumerate(extra):  # the kept slots must be a path hanging off the prefix
            want = extra[i - 1] if i else base - 1
            assert self.prev[e] == want, f"compacted slot {e} does not follow {want}"
        self.tokens, self.prev = toks, prev

    def rollback(self, length: int):
        super().rollback(length)
        del self.prev[length:]


class ConstHead:
    """An 'acceptance head' predicting the same probability everywhere."""

    def __init__(self, p: float):
        self.p = p

    def acceptance_prob(self, h):
        return torch.full(h.shape[:-1], self.p)


class MockHead:
    """A context-dependent 'acceptance head' on TreeMockLM hidden states ([token, position])."""

    def __init__(self, vocab_size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.rand(vocab_size, generator=g) * 0.9 + 0.05

    def acceptance_prob(self, h):
        return self.table[h[..., 0].long()]


