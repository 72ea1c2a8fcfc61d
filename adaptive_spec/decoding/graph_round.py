"""A chain round that decides its stop on the device and reads the device once (Decoder(host_reads="round")).

Why and its exactness argument: docs/design.md, "One host read per round". A drafted token's work after
the forward is an epilogue of the draft's step (`ChainEpilogue`), verification an epilogue of the
target's (`VerifyEpilogue`); a runner that captures graphs runs each inside the step's graph
(`StaticCausalLM.forward_epilogue`), any other after its forward. Nothing reads a value back, so a
round is: its uniforms (one draw), m draft steps, one verify step, one read of [n, token, k, stopped,
y_1..y_m], and the rollbacks. m is a cap chosen from the rule's recent stops (`RoundCaps`); the rule's
first stop k stays a device scalar, and verification rejects the candidates past k unseen
(`sampling.verify_u`)."""
from __future__ import annotations

from collections import deque

import torch

from .interfaces import DraftStep, StopPolicy
from .sampling import SamplingParams, process_logits, sample_u, verify_greedy, verify_u


class RoundCaps:
    """How many candidates a round that decides its stop on the device drafts: the most its rule chose in
    the last `window` rounds, or, after a round the cap cut short (the rule had not stopped), that cap
    plus `grow`. Drafting past the rule's stop costs draft steps that are never verified; a cap below it
    costs tokens the round could have proposed; the recent stops bound the first and growth the second.
    Decided from past rounds only, so the round's stop stays a stopping time of the drafting."""

    def __init__(self, start: int = 4, grow: int = 2, window: int = 4):
        self.start, self.grow = start, grow
        self.recent: deque = deque(maxlen=window)

    def reset(self) -> None:
        self.recent.clear()

    def cap(self, k_cap: int) -> int:
        return max(1, min(k_cap, max(self.recent, default=self.start)))

    def update(self, k: int, stopped: bool, m: int) -> None:
        self.recent.append(k if stopped else m + self.grow)


class ChainEpilogue:
    """A drafted token's work after the draft's forward, on the device, as one function of static buffers
    (so a graph can hold it): y_i ~ q_i from the round's uniform u_i, q_i and y_i stored at slot i, the rule's
    decision (StopPolicy.graph_stop over its running state `mem`), and the first step the rule stopped at.
    Returns y_i [1], the draft's next input.

    A round's set-up is two eager ops (`begin`): its uniforms drawn into one buffer (the m draws', the m
    acceptance tests', the last draw's) and the control pair [i, first stop] cleared (0 = no stop yet)."""

    def __init__(self, rule: StopPolicy, sampling: SamplingParams, k_max: int, vocab_size: int, device):
        self.rule, self.sampling, self.k_max = None, sampling, k_max
        self.uniforms = torch.zeros(2 * k_max + 1, dtype=torch.float64, device=device)
        self.ctrl = torch.zeros(2, dtype=torch.long, device=device)  # [slot of the next draw, first stop or 0]
        self.y = torch.zeros(k_max, dtype=torch.long, device=device)
        self.q = torch.zeros(k_max, vocab_size, device=device)
        self.mem = rule.graph_state(device)
        for t in (self.uniforms, self.ctrl, self.y, self.q, *self.mem.values()):
            torch._dynamo.mark_static_address(t)

    def begin(self, rule: StopPolicy, m: int, gen: torch.Generator) -> None:
        """Before a round of m steps: its 2m + 1 uniforms, the control pair cleared, the rule's settings
        (refreshed only when the rule is another one: a threshold lives in `mem`, not in the graph)."""
        torch.rand(2 * m + 1, generator=gen, dtype=torch.float64, out=self.uniforms[:2 * m + 1])
        self.ctrl.zero_()
        if rule is not self.rule:
            self.rule = rule
            rule.graph_begin(self.mem)

    def __call__(self, logits: torch.Tensor, hidden: torch.Tensor, accept=None) -> torch.Tensor:
        sp, i = self.sampling, self.ctrl[:1]
        q = process_logits(logits[-1], sp, sync_free=True)
        y = q.argmax(-1, keepdim=True) if sp.greedy else sample_u(q, self.uniforms.index_select(0, i)).view(1)
        self.y.index_copy_(0, i, y)
        self.q.index_copy_(0, i, q.unsqueeze(0))
        step = DraftStep(-1, y[0], q, logits[-1], hidden, -1, sp, accept=accept)
        flag = self.rule.graph_stop(step, i[0] + 1, self.mem)
        if flag is not False:  # the first stop wins: its step index, where none was set yet
            first = self.ctrl[1:]
            first.copy_(torch.where((first == 0) & flag, i + 1, first))
        i.add_(1)
        return y

    def buffers(self) -> list[torch.Tensor]:
        """What a call writes (a graph capture's warm-up runs put them back after)."""
        return [self.ctrl, self.y, self.q, *self.mem.values()]

    def stop(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, whether the rule stopped) after m steps: k = the rule's first stop, else m."""
        first = self.ctrl[1]
        return torch.where(first > 0, first, m), first > 0


class VerifyEpilogue:
    """Verification after the target's pass over the pending token(s) and the m candidates, on the device:
    returns one small tensor [n, token, k, stopped, y_1..y_m] (the round's one read)."""

    def __init__(self, chain: ChainEpilogue, m: int):
        self.chain, self.m = chain, m

    def buffers(self) -> list[torch.Tensor]:
        return []  # it writes nothing that outlives the call

    def __call__(self, logits: torch.Tensor, hidden: torch.Tensor, accept=None) -> torch.Tensor:
        c, m = self.chain, self.m
        y = c.y[:m]
        k, stopped = c.stop(m)
        if c.sampling.greedy:
            n, tok, _ = verify_greedy(y, logits, k)
        else:
            p = process_logits(logits, c.sampling, sync_free=True)
            n, tok = verify_u(y, c.q[:m], p, c.uniforms[m:2 * m].float(), c.uniforms[2 * m:2 * m + 1], k)
        return torch.cat([n.view(1), tok.view(1), k.view(1), stopped.view(1).long(), y])


class GraphRound:
    """The decoder's device rounds: the epilogues (kept per rule kind, sampling and cap, so the graphs that
    hold them are made once) and the caps."""

    def __init__(self):
        self.caps = RoundCaps()
        self._chains: dict = {}
        self._verifies: dict = {}

    def reset(self) -> None:
        self.caps.reset()

    @torch.inference_mode(False)  # buffers that outlive one decode: normal tensors, written in place by any
    def _epilogues(self, rule: StopPolicy, sampling: SamplingParams, m: int, vocab_size: int, device):
        key = (rule.graph_key(), sampling, vocab_size, str(device))
        chain = self._chains.get(key)
        if chain is None or chain.k_max < m:
            chain = self._chains[key] = ChainEpilogue(rule, sampling, max(m, min(rule.k_max, 32)), vocab_size, device)
        verify = self._verifies.get((id(chain), m))
        if verify is None:
            verify = self._verifies[(id(chain), m)] = VerifyEpilogue(chain, m)
        return chain, verify

    def round(self, dec, state, rule: StopPolicy, k_cap: int, source, every: int | None = None):
        """One chain round drafted by `source` (a decoder.ModelSource), verified and read, nothing kept yet, as
        Decoder.verified_chain: (K, n accepted, the m candidates drafted as host ints, the token drawn after the
        n). every=N: draft in chunks of N and read whether the rule stopped after each, instead of up to a learned
        cap."""
        met, target = state.met, dec.target
        capped = every is None and rule.stops_mid_chain
        m = self.caps.cap(k_cap) if capped else k_cap
        chain, _ = self._epilogues(rule, state.sampling, m, target.vocab_size, dec.device)
        chain.begin(rule, m, state.gen)  # uniforms for up to m steps; a chunked round may use fewer
        met.lap("rest")
        drafted = 0
        while drafted < m:
            for i in range(drafted + 1, min(m, drafted + (every or m)) + 1):
                source.step_epilogue(state, i, chain)
            drafted = i
            if drafted < m and rule.stops_mid_chain and met.read(chain.ctrl[1:])[0]:
                break  # the rule stopped inside this chunk
        m = drafted
        _, verify = self._epilogues(rule, state.sampling, m, target.vocab_size, dec.device)
        ids = torch.cat([state.seq[target.length:], chain.y[:m]])
        met.lap("draft_other")
        out = run_epilogue(target, ids, m + 1, verify)
        met.lap("target_forward")
        met.count_pass(ids.shape[0])
        vals = met.read(out)
        n, tok, K, stopped = vals[:4]
        if capped:
            self.caps.update(K, bool(stopped), m)
        met.n_past_stop += m - K
        state.p_y = None  # the model's candidates: nothing learns from p(y) here (prompt lookup's copies do)
        return K, n, vals[4:4 + m], tok


def run_epilogue(runner, ids: torch.Tensor, n_logits: int, epilogue, with_head: bool = False):
    """runner's forward over ids followed by `epilogue(logits, hidden, accept)`: inside the runner's graph
    where it has `forward_epilogue` (the static runners), after the forward elsewhere."""
    if hasattr(runner, "forward_epilogue"):
        return runner.forward_epilogue(ids, n_logits, epilogue, with_head=with_head)
    if with_head:
        logits, hidden, accept = runner.forward_with_head(ids, n_logits=n_logits)
    else:
        (logits, hidden), accept = runner.forward(ids, n_logits=n_logits), None
    return epilogue(logits, hidden, accept)
