"""The feature drafter on a static KV cache (StaticFeatureRunner): FeatureRunner's contract and bookkeeping
(source.py: slot s holds (f_s, x_{s+1}), slots fed with f^ are fed again once the target's f arrives), with
the one-token step on fixed buffers (step.py's DrafterStep) run as one graph: captured with CUDA graphs
("cudagraph"), torch.compile'd ("compile") or eager ("eager"), as StaticCausalLM's runtimes.

The graph holds the step, the readout's logits (the kept rows, spread over the vocabulary), the attached
acceptance head and a device round's epilogue (decoding/graph_round.py), so a draft step inside a round is
one replay and one input copy. A run of the target's own states (the first step of a round, after
verification) is fed in one eager pass. Rollback writes the position; nothing is read back to the host."""
from __future__ import annotations

import time

import torch

from ..backends.contract import Counters
from ..backends.graphs import HeadForwards, capture_graph, compile_step, copy_head
from ..backends.static_runner import RUNTIMES, StaticCausalLM, cache_length
from ..errors import UserError, get_logger
from .model import FeatureDrafter, Readout
from .step import DrafterStep

log = get_logger(__name__)


class StaticFeatureRunner(HeadForwards):
    """contract.Runner and contract.HeadRunner over a FeatureDrafter; `tap` the target's HiddenTap (or None:
    every slot reads f^). runtime: "eager" | "cudagraph" (CUDA only) | "compile" (torch.compile with
    `compiler`; "eager" only traces, for tests)."""

    _tic, _toc = StaticCausalLM._tic, StaticCausalLM._toc  # forward times without a sync (CUDA events)

    def __init__(self, drafter: FeatureDrafter, readout: Readout, tap, max_cache_len: int | None = None,
                 runtime: str = "eager", compiler: str = "inductor", head=None):
        if runtime not in RUNTIMES:
            raise UserError(f"unknown runtime {runtime!r}; use one of {', '.join(RUNTIMES)}")
        self.drafter, self.readout, self.tap = drafter.eval(), readout, tap
        self.vocab_size, self.hidden_size = readout.vocab_size, drafter.hidden_size
        self.device, self.config = drafter.device, drafter.config_obj
        if runtime == "cudagraph" and self.device.type != "cuda":
            raise UserError("the cudagraph runtime captures CUDA graphs; on a CPU use runtime eager or compile")
        self.max_length = self.max_cache_len = cache_length(self.config, max_cache_len)
        self.runtime, self.compiler = runtime, compiler
        self.head = self._attached = head
        self.counters = Counters()
        self.step = DrafterStep(self.drafter, readout, self.max_cache_len)
        self._graphs: dict | None = {} if runtime == "cudagraph" else None  # (with_head, epilogue) -> (graph, out)
        self._compiled, self._cudagraphs = (compile_step(self._one, compiler, self.device) if runtime == "compile"
                                            else (None, False))
        self.reset()

    # ---- positions ------------------------------------------------------------------------

    def reset(self) -> None:
        self.length = 0
        self.slots = 0  # KV slots held (= max(0, length - 1))
        self.real = 0  # the leading slots fed with the target's own states
        self.step.pos.zero_()
        self.step.feat.zero_()  # hat[0]: what slot 0 reads without the target's state

    def rollback(self, length: int) -> None:
        if length < self.length:
            self.length = length
            self._crop(max(0, length - 1))

    def _crop(self, slots: int) -> None:
        """Keep slots 0..slots-1: later writes overwrite the rest, the mask hides them; feat = the last kept
        slot's f^ (what the next slot reads when the target's state is not there)."""
        if slots < self.slots:
            self.slots = slots
            self.real = min(self.real, slots)
            self.step.pos.fill_(slots)
            self.step.feat.copy_(self.step.hat[slots].view_as(self.step.feat))

    def _known(self) -> int:
        """Positions whose target state the tap holds."""
        return self.tap.length if self.tap is not None else 0

    # ---- the contract ---------------------------------------------------------------------

    @torch.inference_mode()
    def attach_head(self, head) -> None:
        """contract.HeadRunner: a head of the attached one's shape is copied into its tensors (the graphs read
        them by address); another shape replaces it, and the graphs holding the old one go."""
        if head is None or head is self._attached:
            return
        if not copy_head(self.head, head):
            self.head = head
            if self._graphs is not None:
                self._graphs = {key: g for key, g in self._graphs.items() if not key[0]}
        self._attached = head

    def _run(self, ids: torch.Tensor, n_logits: int, with_head: bool, epilogue=None):
        n = ids.numel()
        end = self.length + n
        if end > self.max_cache_len:
            raise UserError(f"the drafter's static KV cache holds {self.max_cache_len} positions but {end} are "
                            "needed; build the runner with a larger max_cache_len")
        if not 0 <= n_logits <= end:
            raise ValueError(f"n_logits must be in 0..{end}, got {n_logits}")
        t0 = self._tic()
        ids = ids.reshape(-1).to(self.device)
        if self.real < self.slots and self._known() > self.real:
            self._crop(self.real)  # slots fed with f^ where the target's f now exists: feed them again
        if n == 1 and n_logits == 1 and self.slots == self.length - 1:
            out = self._one_slot(ids, with_head, epilogue)  # a draft step: every output from the step's graph
        else:
            out = self._many(ids, n_logits, with_head, epilogue)
        self.length = end
        self._toc(t0)
        return out

    def _one_slot(self, ids: torch.Tensor, with_head: bool, epilogue):
        """Slot `slots` alone (its token ids [1]): the step's graph, after the target's state is put in feat
        where the tap holds it."""
        s, st = self.slots, self.step
        st.tok.copy_(ids.view(1, 1))
        if s < self._known():
            st.feat.copy_(self.tap.features(s, s + 1).view_as(st.feat))
            if self.real == s:
                self.real = s + 1
        out = self._run_step(with_head, epilogue)
        self.slots = s + 1
        return out

    def _many(self, ids: torch.Tensor, n_logits: int, with_head: bool, epilogue):
        """Any other feed: runs of the target's states in one eager pass each, every later slot the step's
        graph; logits, state, head and epilogue after, from the slots' outputs."""
        st, start = self.step, self.length
        end = start + ids.numel()
        st.toks[start:end].copy_(ids)
        while self.slots < end - 1:
            s0, known = self.slots, self._known()
            if s0 < known:
                s1 = min(end - 1, known)
                st.feed(self.tap.features(s0, s1), st.toks[s0 + 1:s1 + 1])
                self.real = s1 if self.real == s0 else self.real
            else:
                s1 = s0 + 1
                st.tok.copy_(st.toks[s1:s1 + 1].view(1, 1))
                self._run_step(False, None)
            self.slots = s1
        logits = (self.readout.logits(st.hat[end - n_logits:end]) if n_logits
                  else st.hat.new_zeros(0, self.vocab_size, dtype=torch.float32))
        hidden = st.hat[max(end - 1, 0)].clone()  # the buffer's row is overwritten by later steps
        accept = self.head.acceptance_prob(hidden).float() if with_head else None
        if epilogue is not None:
            return (epilogue(logits, hidden, accept),)
        return (logits, hidden) if accept is None else (logits, hidden, accept)

    # ---- the one-token step -----------------------------------------------------------------

    def _one(self, with_head: bool, epilogue=None):
        """The step on the fixed buffers (tok, feat at pos), its logits, head and epilogue; capturable."""
        f = self.step.advance()
        logits, hidden = self.readout.logits(f), f[0]
        accept = self.head.acceptance_prob(hidden).float() if with_head else None
        if epilogue is not None:
            return (epilogue(logits, hidden, accept),)
        return (logits, hidden) if accept is None else (logits, hidden, accept)

    def _run_step(self, with_head: bool, epilogue):
        """`_one` as the runtime runs it: a replay of its CUDA graph (recorded on first use per head and
        epilogue), the compiled step (the epilogue after it: compiling one per sampling setting and stop rule
        would cost tens of seconds inside a decode), or eagerly."""
        if self._graphs is not None:
            key = (with_head, epilogue)
            if key not in self._graphs:
                st = self.step
                keep = (st.pos, st.tok, st.feat, *(epilogue.buffers() if epilogue is not None else ()))
                self._graphs[key] = capture_graph(lambda: self._one(with_head, epilogue), self.device, keep)
            graph, out = self._graphs[key]
            graph.replay()
            return tuple(t.clone() for t in out)  # the next replay overwrites them
        if self._compiled is None:
            return self._one(with_head, epilogue)
        if self._cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        out = self._compiled(with_head)
        if self._cudagraphs:
            out = tuple(t.clone() for t in out)
        if epilogue is not None:
            out = (epilogue(*out) if with_head else epilogue(*out, None),)
        return out

    @torch.inference_mode()
    def warmup(self, shapes=(), with_head: bool | None = None) -> float:
        """Compile / capture the step (with the head too when one is attached, or as with_head says) so that
        none happens in timed code; `shapes` is StaticCausalLM.warmup's (this runner has one shape). Leaves
        the runner reset with zeroed counters; returns the seconds spent."""
        t0 = time.perf_counter()
        heads = [False] + ([True] if (self.head is not None if with_head is None else with_head) else [])
        if self.runtime != "eager":
            try:
                for wh in heads:
                    for _ in range(3):
                        self.reset()
                        self._run_step(wh, None)
            except Exception as e:  # noqa: BLE001 - a compiler that cannot lower the step must not stop the decode
                if self._compiled is None:
                    raise
                log.warning(f"torch.compile ({self.compiler}) could not compile the feature drafter's step on "
                            f"{self.device} ({type(e).__name__}); it runs eagerly (exact, slower)")
                self._compiled = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.reset()
        self.counters.restart()
        return time.perf_counter() - t0

    # ---- identity -------------------------------------------------------------------------

    def fresh(self) -> "StaticFeatureRunner":
        return StaticFeatureRunner(self.drafter, self.readout, self.tap.fresh() if self.tap is not None else None,
                                   self.max_cache_len, self.runtime, self.compiler, self.head)

    def fingerprint(self) -> str:
        from ..backends.runner import model_fingerprint

        return "feature-" + model_fingerprint(self.drafter.base)

    def numeric_path(self) -> dict:
        return {"dtype": str(self.drafter.dtype), "drafter": "feature", "runtime": self.runtime}
