"""Stop policies: who decides the candidate length K of each speculation round.

The decoder drafts y_1, y_2, ... and after each one asks the policy whether to stop; the
verification code never looks at the policy. A policy sees, per drafted token, a `DraftStep`:

    i         1-based index of y_i in this round
    token     y_i (device tensor)
    probs     q_i, the processed draft distribution y_i was drawn from [V]
    logits    the draft's raw logits at this step [V] (temperature-free confidence, entropy)
    hidden    the draft's final hidden state at the last INPUT position of this step, i.e.
              e_{i-1}, the state of y_{i-1} (for i = 1: of the round's first input token)
    pos       index of y_i among the generated tokens (0 = first new token)

Before drafting, `begin_round(pos)` returns the most tokens the policy allows this round (0 =
skip drafting: the round is one plain target step). After verification `end_round(K, n)` reports
how many of the K candidates were accepted, for policies that adapt (the +2/-1 schedule).

Policies here hold per-generation state; the decoder calls `reset()` at the start of each
generation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UserError


@dataclass
class DraftStep:
    i: int
    token: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor
    hidden: torch.Tensor
    pos: int


class StopPolicy:
    """Base class. Subclasses override `should_stop` (and optionally the other hooks)."""

    name = "base"
    k_max: int = 20

    def reset(self) -> None:
        pass

    def begin_round(self, pos: int) -> int:
        return self.k_max

    def should_stop(self, step: DraftStep) -> bool:
        return False

    def end_round(self, n_drafted: int, n_accepted: int) -> None:
        pass

    def describe(self) -> dict:
        return {"policy": self.name}


class FixedK(StopPolicy):
    """Classic speculative decoding: always K candidates (fewer only at max length)."""

    name = "fixed"

    def __init__(self, k: int):
        if not isinstance(k, int) or k < 1:
            raise UserError(f"K must be an integer >= 1, got {k!r}")
        self.k = self.k_max = k

    def describe(self) -> dict:
        return {"policy": self.name, "k": self.k}


def check_k_max(k_max: int) -> int:
    if not isinstance(k_max, int) or k_max < 1:
        raise UserError(f"the hard cap on candidates per round must be an integer >= 1, got {k_max!r}")
    return k_max


# name -> factory(**kwargs). Later modules register their policies here (see `register`).
POLICIES: dict = {}


def register(name: str):
    def deco(factory):
        POLICIES[name] = factory
        return factory
    return deco


@register("fixed")
def _make_fixed(k: int = 4, **_):
    return FixedK(k)


def make_policy(name: str, **kwargs) -> StopPolicy | None:
    """A policy by name; "ar" gives None (target-only decoding). kwargs not used by a policy
    (the pair, the prompt, the sampling settings) are ignored by it."""
    if name == "ar":
        return None
    if name not in POLICIES:
        raise UserError(f"unknown policy {name!r}; valid policies: ar, {', '.join(sorted(POLICIES))}")
    return POLICIES[name](**kwargs)
