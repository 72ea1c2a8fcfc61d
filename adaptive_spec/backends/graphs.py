"""The static runner's graphs, one per input shape: captured (CUDA graphs) or compiled (torch.compile) by
`warmup`, replayed by `_run` for the shapes warmed up, every other shape run eagerly. `ShapeGraphs` is
StaticCausalLM's half that owns them (its state is set up in StaticCausalLM.__init__)."""
from __future__ import annotations

import contextlib
import os
import time
from typing import Iterable

import torch

from ..errors import UserError


def raise_recompile_limit(n: int = 64):
    """One graph per shape: K_max + 3 specialisations of one function, more than dynamo's
    default recompile limit (8) allows."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)


def persist_compile_caches() -> None:
    """torch.compile's caches in the project's cache folder, not a temporary one, so a later process compiles a
    known shape in seconds. A TORCHINDUCTOR_CACHE_DIR the user set wins; inductor's own default (which it
    writes into the environment once used) does not."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        default = os.path.abspath(default_cache_dir())
    except ImportError:  # an older torch: only an unset variable is replaced
        default = None
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or (default is not None and os.path.abspath(current) == default):
        from ..setup.llama_build import cache_dir  # stdlib only: the project's one cache root

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    if "TORCHINDUCTOR_FX_GRAPH_CACHE" not in os.environ:
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = True


def compile_step(fn, compiler: str, device: torch.device):
    """(torch.compile of a runner's step fn, whether it runs torch.compile's own CUDA graphs, whose outputs must
    be copied out)."""
    raise_recompile_limit()
    if compiler == "inductor":
        persist_compile_caches()
    cudagraphs = device.type == "cuda"
    kw = {"mode": "reduce-overhead" if cudagraphs else "default"} if compiler == "inductor" else {}
    return torch.compile(fn, backend=compiler, fullgraph=True, dynamic=False, **kw), cudagraphs


def capture_graph(fn, device, keep=()):
    """(a CUDA graph of fn(), its static outputs), recorded after two warm-up runs on a side stream (as
    torch.cuda.graphs asks). The tensors `keep` are put back after each run, so every run starts from the same
    state (a second run must not step an epilogue's index past its end) and none moves what the first replay
    reads."""
    saved = [(t, t.clone()) for t in keep]

    def restore():
        for t, s in saved:
            t.copy_(s)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
            restore()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    restore()
    return graph, out


def copy_head(into, head) -> bool:
    """Copy `head`'s tensors into the attached head `into` where both have the same names, shapes and dtypes (a
    captured graph reads them by address); False, copying nothing, where they differ or `into` is None."""
    mine, theirs = (into.state_dict() if into is not None else {}), head.state_dict()
    if not mine or mine.keys() != theirs.keys() or any(
            (t.shape, t.dtype) != (theirs[k].shape, theirs[k].dtype) for k, t in mine.items()):
        return False
    for k, t in mine.items():
        t.copy_(theirs[k].to(t.device))
    return True


class HeadForwards:
    """A static runner's forward, forward_with_head and forward_epilogue, each its `_run(ids, n_logits,
    with_head, epilogue=None)`: the step, the head and a device round's epilogue (decoding/graph_round.py) in
    one graph where the shape has one."""

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, n_logits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run(ids, n_logits, False)

    @torch.inference_mode()
    def forward_with_head(self, ids: torch.Tensor, n_logits: int = 1):
        """`forward` plus the attached head's acceptance probability [] float32 of the returned hidden state."""
        if self.head is None:
            raise UserError("forward_with_head needs an acceptance head: attach_head(head) first, or build the "
                            "runner with head=...")
        return self._run(ids, n_logits, True)

    @torch.inference_mode()
    def forward_epilogue(self, ids: torch.Tensor, n_logits: int, epilogue, with_head: bool = False):
        """`forward` (or forward_with_head) then epilogue(logits, hidden, accept); returns the epilogue's output."""
        if with_head and self.head is None:
            raise UserError("forward_epilogue(with_head=True) needs an acceptance head: attach_head(head) first, "
                            "or build the runner with head=...")
        return self._run(ids, n_logits, with_head, epilogue)[0]


class ShapeGraphs(HeadForwards):
    """Capture, compile, replay and warm up the runner's step per (n, n_logits, with_head, rows[, epilogue]) shape
    (rows: forward_hidden's variant, every fed row's hidden state returned)."""

    def _buf(self, n: int) -> torch.Tensor:
        buf = self._ids_buf.get(n)
        if buf is None:
            buf = self._ids_buf[n] = torch.zeros(1, n, dtype=torch.long, device=self.device)
            torch._dynamo.mark_static_address(buf)
        return buf

    def _capture(self, key):
        n, n_logits, wh, rows = key[:4]
        epilogue = key[4] if len(key) > 4 else None
        buf = self._buf(n)
        # the warm-up runs move the position and an epilogue's state (its `buffers()`)
        keep = (self._pos, *(epilogue.buffers() if epilogue is not None else ()))
        self._graphs[key] = capture_graph(lambda: self._step(buf, n_logits, wh, epilogue, rows), self.device, keep)

    def _run(self, ids: torch.Tensor, n_logits: int, with_head: bool, epilogue=None, rows: bool = False):
        if epilogue is not None and self._graphs is None:
            # without captured graphs the epilogue runs after the (eager or compiled) step: compiling one per
            # sampling setting and stop rule would cost tens of seconds inside the decode that first asks
            out = self._run(ids, n_logits, with_head)
            return (epilogue(*out) if with_head else epilogue(*out, None),)
        n = ids.shape[-1]
        if not 0 <= n_logits <= n:
            raise ValueError(f"n_logits must be in 0..{n}, got {n_logits}")
        if self.length + n > self.max_cache_len:
            raise UserError(f"the static KV cache holds {self.max_cache_len} positions but {self.length + n} are "
                            "needed; build the runner with a larger max_cache_len")
        t0 = self._tic()
        key = (n, n_logits, with_head, rows) + (() if epilogue is None else (epilogue,))
        if epilogue is not None and key not in self._graphs and key[:4] in self._warm:
            # captured on first use, for the shapes warmed up for graphs (a prompt's length runs eagerly): a
            # capture costs a forward or three, and the epilogue (its sampling, its stop rule) is known only
            # once a decode asks for it
            self._capture(key)
            self._warm.add(key)
        if key in self._warm:
            # a fixed input buffer per length: one address for the graph, and one tensor kind
            # whatever the caller passes (dynamo's guards would otherwise recompile)
            buf = self._buf(n)
            buf.copy_(ids.reshape(1, n))
            if self._graphs is not None:
                graph, static_out = self._graphs[key]
                graph.replay()
                out = tuple(t.clone() for t in static_out)  # the next replay overwrites them
            else:
                if self._cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                out = self._compiled(buf, n_logits, with_head, None, rows)
                if self._cudagraphs:
                    out = tuple(t.clone() for t in out)
        else:
            out = self._step(ids.reshape(1, n).to(self.device), n_logits, with_head, epilogue, rows)
        self.length += n
        self._toc(t0)
        return out

    @contextlib.contextmanager
    def eager(self):
        """Within it, every forward runs the eager step (for fused.step_launches)."""
        warm, self._warm = self._warm, set()
        try:
            yield self
        finally:
            self._warm = warm

    @torch.inference_mode()
    def warmup(self, shapes: Iterable = (), with_head: bool | None = None, rows: bool = False) -> float:
        """Compile / capture every (n, n_logits) shape (an int n means (n, n)) so that none happens in timed code;
        with_head (default: whether a head is set) also the forward_with_head variant; rows: forward_hidden's
        variant in place of forward's (a target whose every row a feature drafter reads). Leaves the runner reset
        with zeroed counters; returns the seconds spent."""
        t0 = time.perf_counter()
        variants = [(False, rows)] + ([(True, False)] if (self.head is not None if with_head is None else with_head)
                                      else [])
        for s in shapes:
            n, n_logits = (s, s) if isinstance(s, int) else (int(s[0]), int(s[1]))
            if n > self.max_cache_len or not 0 <= n_logits <= n:
                raise UserError(f"bad warm-up shape ({n}, {n_logits}) for max_cache_len {self.max_cache_len}")
            for wh, rw in variants:
                key = (n, n_logits, wh, rw)
                if self._graphs is not None and key not in self._graphs:
                    self._capture(key)
                if self._graphs is not None or self._compiled is not None:
                    self._warm.add(key)
                for _ in range(3):
                    self.reset()
                    self._run(torch.zeros(n, dtype=torch.long, device=self.device), n_logits, wh, rows=rw)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.reset()
        self.counters.restart()
        return time.perf_counter() - t0
