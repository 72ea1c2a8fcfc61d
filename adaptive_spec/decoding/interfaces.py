"""The decoder's extension points: `StopPolicy` (a stop rule for chain drafting), `DraftSource` (who proposes
a chain round's candidates), `RoundOwner` (a policy that runs its whole round), and `register` (a policy's
factory joins the registry entry its settings class declared). Their contracts in prose: docs/design.md,
"Extension points".

Near a leaf: it imports only the registry and the typed settings (neither imports decoding), so every
policy module can import it and the decoder can dispatch on it without any module importing a policy
module back."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .. import params, registry, typed  # noqa: F401  (params: importing it declares the built-in policies' settings)
from ..registry import Needs


@dataclass
class DraftStep:
    """One drafted token y_i, as a stop rule sees it.

    i         1-based index of y_i in this round
    token     y_i (device tensor)
    probs     q_i, the processed draft distribution y_i was drawn from [V]
    logits    the draft's raw logits at this step [V] (temperature-free confidence, entropy)
    hidden    the draft's final hidden state at the last INPUT position of this step, i.e.
              e_{i-1}, the state of y_{i-1} (for i = 1: of the round's first input token)
    pos       index of y_i among the generated tokens (0 = first new token)
    sampling  the SamplingParams that made `probs` (so a policy can reuse q instead of recomputing it)
    source    what proposed y_i: "model" (the draft model), "ngram" (copied from the context: `probs`
              is the one-hot of y_i, `logits` and `hidden` are None)
    accept    the rule's graph_head's acceptance probability of `hidden`, computed inside the draft's
              forward (a contract.HeadRunner draft); None: the rule computes it itself"""
    i: int
    token: Any  # torch.Tensor, like the fields below (kept untyped: this module imports no torch)
    probs: Any
    logits: Any
    hidden: Any
    pos: int
    sampling: Any = None
    source: str = "model"
    accept: Any = None


class DraftSource:
    """Who proposes a chain round's candidates: `step(state, i, ys)` gives y_i as a DraftStep (its proposal
    q_i in `probs`), or None when it has nothing more this round. The draft model is one (decoder.ModelSource),
    a copied span another (ngram.SpanSource, q the one-hot of the copied token): verification is the same
    rejection sampler for every source, a one-hot q being a special case of it, not a second code path."""

    name = "base"

    def step(self, state: "RoundState", i: int, ys: list) -> DraftStep | None:
        raise NotImplementedError


class _Policy:
    """What every policy has: `reset()` starts a generation, `describe()` is its settings for a row."""

    name = "base"
    needs: Needs = Needs()
    k_max: int = 20  # the most candidates a round verifies in one chain pass (graph runtimes warm up to it)
    # an acceptance head a draft runner may evaluate inside its own forward on DraftStep.hidden (the step
    # then carries its output in `accept`): one graph instead of a graph and the head's own launches; a
    # RoundOwner's, for the stop rule of the model rounds it runs
    graph_head: Any = None

    def reset(self) -> None:
        pass

    def describe(self) -> dict:
        return {"policy": self.name}


class StopPolicy(_Policy):
    """A stop rule for chain drafting: `should_stop(step)` per drafted token. `begin_round(pos)` returns the
    most tokens the rule allows this round (0: the round is one plain target step); `end_round(K, n)` reports
    how many of the K candidates were accepted, for rules that adapt."""

    def begin_round(self, pos: int) -> int:
        return self.k_max

    def should_stop(self, step: DraftStep) -> bool:
        return False

    # A rule that can decide on the device sets decides_on_device and gives `graph_stop(step, i, mem)`:
    # should_stop's decision as a 0-d bool device tensor (False: it never stops at this step) from the step's
    # tensors, the step's index i as a device scalar and its running state `mem` (the device buffers
    # `graph_state` made; `graph_begin` refreshes them before a round), reading nothing back and branching on
    # no value, so that a captured graph can hold it (graph_round.py). A round then reads the device once
    # instead of once per drafted token. `graph_key()` names what the graph bakes in (settings that live in
    # `mem`, like a threshold, are not part of it). stops_mid_chain: whether the rule can stop before its
    # begin_round cap (fixed K and schedules cannot: their round drafts exactly the cap).
    decides_on_device: bool = False
    stops_mid_chain: bool = True

    @property
    def reads_steps(self) -> bool:
        """Whether should_stop reads a step's tensors back (a rule that only counts to a cap does not)."""
        return self.stops_mid_chain

    def graph_key(self) -> tuple:
        return (type(self).__name__,)

    def graph_state(self, device) -> dict:
        return {}

    def graph_begin(self, mem: dict) -> None:
        pass

    def graph_stop(self, step: DraftStep, i, mem: dict):
        raise NotImplementedError(f"the {self.name} stop rule decides on the host only")

    def end_round(self, n_drafted: int, n_accepted: int) -> None:
        pass


class CapOnly(StopPolicy):
    """A rule that only caps the round (begin_round's K): it never stops mid-chain, so a device round asks it
    nothing."""

    decides_on_device, stops_mid_chain = True, False

    def graph_stop(self, step: DraftStep, i, mem: dict):
        return False


@dataclass(kw_only=True)
class RoundState:
    """Everything one round may read or update.

    decoder    the Decoder: .target, .draft (runners: backends/contract.py), .eos, .chain_round(state, rule)
    seq        prompt + tokens generated so far [L] (device tensor)
    pos        tokens generated so far (index of the round's first new token)
    remaining  tokens the generation may still add (the round must add at most this many)
    sampling   SamplingParams, gen the torch.Generator, met the Metrics (the round books itself there)
    tokens     seq as a host list (read it, never change it)
    p_y        after a chain round's verification: the target's probability of each of its K candidates
               [K] (the processed p; 0 or 1 when greedy), for sources that learn from them"""

    decoder: Any
    seq: Any
    pos: int
    remaining: int
    sampling: Any
    gen: Any
    met: Any
    tokens: list
    p_y: Any = None

    @property
    def target(self):
        return self.decoder.target

    @property
    def draft(self):
        return self.decoder.draft

    def book(self, n_drafted: int, n_accepted: int, source: str = "model") -> None:
        """Count one verified round of K = n_drafted candidates, n of them accepted, drafted by `source`
        (Metrics.book_round: the one place a round is counted)."""
        self.met.book_round(n_drafted, n_accepted, source)


class RoundOwner(_Policy):
    """A policy that runs its own rounds (a token tree, several drafts, a chain round wrapped in extra work):
    `run_round(state)` returns the accepted candidates followed by one token the target drew, leaves both
    caches covering exactly seq + the new tokens but the last, and books the round (`RoundState.book`)."""

    name = "round-owner"

    def run_round(self, state: RoundState) -> list[int]:
        raise NotImplementedError


Policy = StopPolicy | RoundOwner


@dataclass
class PolicyContext:
    """What a factory may need beyond the policy's own settings: the decode it serves."""

    pair: Any = None  # a SpecPair (or anything with target, draft, eos_token_ids)
    prompt_ids: list[int] | None = None
    sampling: Any = None  # SamplingParams
    max_new_tokens: int = 128
    # auto's measure_costs and resolve_auto, handed in by pipeline.make_policy: a factory prices with this
    # machine's costs (ngram's k auto and learned fallback, a learned tree's node cost) without importing auto,
    # which times the decoder and replays these policies to predict them
    measure_costs: Callable | None = None
    resolve_auto: Callable | None = None


def register(name: str):
    """Declare a policy's factory under `name`; its settings class is the one params declared under the
    same name (an extension without one gets an empty settings class: it takes no keywords)."""
    def deco(factory: Callable[..., Policy]):
        if registry.entry_params(name) is None:
            typed.policy(name)(type(f"Params_{name}", (typed.PolicyParams,), {}))
        registry.declare(name, factory=factory)
        return factory
    return deco
