"""A GPU-oriented runner to the runner contract (docs/design.md, "GPU runtime"), in the style of gpt-fast.

The KV cache is preallocated and written at absolute positions read from one device scalar `_pos`; the
mask is causal over all `max_cache_len` slots, so stale slots are never attended and rollback is one fill
of `_pos`. Every shape depends only on (n, n_logits) and nothing is read back to the host, so one graph per
shape is captured up front (graphs.py). Attention reads every slot (masked): keep max_cache_len near the
longest context. Sliding-window models are refused (use CausalLM)."""
from __future__ import annotations

import functools
import time

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from ..errors import UserError
from .fused import FusedDecoder, unsupported_reason
from .graphs import ShapeGraphs, compile_step, copy_head
from .runner import CausalLM, kv, model_kv

DEFAULT_MAX_CACHE_LEN = 2048


class PositionedStaticLayer(StaticLayer):
    """A StaticLayer written at the runner's position `pos` (a shared 0-d device tensor)
    instead of its own running counter: rolling back is then a write to `pos` only."""

    def __init__(self, max_cache_len: int, pos: torch.Tensor):
        super().__init__(max_cache_len=max_cache_len)
        self.pos = pos

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        idx = self.pos + torch.arange(key_states.shape[-2], device=self.pos.device)
        self.keys.index_copy_(2, idx, key_states)
        self.values.index_copy_(2, idx, value_states)
        return self.keys, self.values

    def get_seq_length(self):
        return self.pos

    def reset(self) -> None:  # stale slots are masked; nothing to clear
        pass


def positioned_static_cache(config, max_cache_len: int, pos: torch.Tensor, dtype, device) -> StaticCache:
    """A StaticCache of `config`'s layers, allocated now (batch 1), every layer written at the 0-d device
    position `pos`."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    cache.layers = [PositionedStaticLayer(max_cache_len, pos) for _ in cache.layers]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    cache.early_initialization(batch_size=1, num_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device)
    return cache


def cache_length(config, max_cache_len: int | None) -> int:
    """The static cache's slots: max_cache_len, by default DEFAULT_MAX_CACHE_LEN or the model's context if shorter."""
    max_pos = getattr(config, "max_position_embeddings", None)
    n = int(max_cache_len or min(DEFAULT_MAX_CACHE_LEN, max_pos or DEFAULT_MAX_CACHE_LEN))
    if n < 1 or (max_pos and n > max_pos):
        raise UserError(f"max_cache_len must be in 1..{max_pos} (the model's context), got {n}")
    return n


def static_causal_mask(config, embeds: torch.Tensor, cache, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position ids [1, n] from the 0-d device position pos, the causal mask of embeds [1, n, H] over every slot
    of the static cache): kv length = max_cache_len and queries at absolute positions pos..pos+n-1, so slot j
    is visible iff j <= the query's position and stale slots past it are masked."""
    from transformers.masking_utils import create_causal_mask  # heavy: slow to import, and only a step needs it

    n = embeds.shape[1]
    position_ids = (pos + torch.arange(n, device=embeds.device)).view(1, n)
    # allow_is_causal_skip=False: always a real mask, no shortcut that reads pos on the host
    mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, **kv(create_causal_mask, cache),
                              position_ids=position_ids, allow_is_causal_skip=False)
    return position_ids, mask


def _event_seconds(start, end) -> float:
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def verify_shapes(k_max: int) -> list[tuple[int, int]]:
    """Target shapes of a speculative round: the pending token plus K candidates, all scored."""
    return [(n, n) for n in range(1, k_max + 2)]


DRAFT_SHAPES = [(1, 1), (2, 1)]  # one pending token, or two after a fully accepted round

KV_CACHES = ("dynamic", "static")
RUNTIMES = ("eager", "cudagraph", "compile")


def make_runner(model, vocab_size: int | None = None, kv_cache: str = "dynamic", runtime: str = "eager",
                max_cache_len: int | None = None, warmup_shapes=(), head=None, fused: bool = False):
    """CausalLM for the dynamic `kv_cache`; for the static one StaticCausalLM (FusedCausalLM with `fused`) with
    `runtime`, warmed up on `warmup_shapes` (verify_shapes(k_max) for a target, DRAFT_SHAPES for a draft)."""
    if kv_cache not in KV_CACHES:
        raise UserError(f"unknown kv_cache {kv_cache!r}; use one of {', '.join(KV_CACHES)}")
    if runtime not in RUNTIMES:
        raise UserError(f"unknown runtime {runtime!r}; use one of {', '.join(RUNTIMES)}")
    if kv_cache == "dynamic":
        if runtime != "eager" or fused:
            what = f"--runtime {runtime}" if runtime != "eager" else "the fused decoder"
            raise UserError(f"{what} needs the static KV cache: add --kv-cache static")
        return CausalLM(model, vocab_size)
    cls = FusedCausalLM if fused else StaticCausalLM
    lm = cls(model, vocab_size, max_cache_len=max_cache_len, compile=runtime == "compile",
             cuda_graphs=runtime == "cudagraph", head=head)
    if warmup_shapes:
        lm.warmup(warmup_shapes)
    return lm


class StaticCausalLM(ShapeGraphs, CausalLM):
    """`CausalLM` with a static KV cache indexed by position. compile: torch.compile each warmed-up shape
    (compiler="eager" only traces, for tests); cuda_graphs: capture each with torch.cuda.CUDAGraph instead;
    head: an AcceptanceHead run in the same graph by `forward_with_head`. A subclass with another step
    overrides `_alloc_kv`, `_kv_buffers`, `_last_hidden` and `_tree_hidden`."""

    fused = False  # the Hugging Face modules run the step

    def __init__(self, model, vocab_size: int | None = None, max_cache_len: int | None = None,
                 compile: bool = False, compiler: str = "inductor",
                 cuda_graphs: bool = False, head=None):
        cfg = model.config
        types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if types != {"full_attention"} or getattr(cfg, "use_sliding_window", False):
            raise UserError(f"the static runner supports full-attention models only (this one has {sorted(types)}); "
                            "use the dynamic-cache runner (CausalLM)")
        self.max_cache_len = cache_length(cfg, max_cache_len)
        if compile and cuda_graphs:
            raise UserError("pick one of compile=True (torch.compile, CUDA graphs included) and cuda_graphs=True")
        self.head = head
        self._attached = head  # the head last attached (its values may live in self.head's tensors)
        self.compile = bool(compile)
        self._cache_ready = False
        super().__init__(model, vocab_size)  # sets model/base/lm_head/device/... and calls reset()
        self.max_length = self.max_cache_len
        if cuda_graphs and self.device.type != "cuda":
            raise UserError("cuda_graphs=True needs a CUDA device; on CPU the runner runs eagerly")
        self._warm: set = set()  # (n, n_logits, with_head, rows) shapes run through a graph
        self._ids_buf: dict = {}  # n -> static [1, n] input buffer of the captured step
        self._graphs: dict | None = {} if cuda_graphs else None  # key -> (CUDAGraph, static outputs)
        self._compiled, self._cudagraphs = (compile_step(self._step, compiler, self.device) if compile
                                            else (None, False))

    @property
    def runtime(self) -> str:
        return "compile" if self.compile else ("cudagraph" if self._graphs is not None else "eager")

    # ---- cache ---------------------------------------------------------------------------

    def _build_cache(self):
        self._pos = torch.zeros((), dtype=torch.long, device=self.device)
        torch._dynamo.mark_static_address(self._pos)
        self._alloc_kv()
        # bytes of K and V per cached position, all layers (what attention reads per slot)
        self.kv_bytes_per_slot = sum(t.shape[1] * t.shape[3] * t.element_size()
                                     for kv in self._kv_buffers() for t in kv)
        self._cache_ready = True

    def _alloc_kv(self):
        dtype = next(self.model.parameters()).dtype
        self.cache = positioned_static_cache(self.config, self.max_cache_len, self._pos, dtype, self.device)

    def _kv_buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [1, kv_heads, max_cache_len, head_dim]: slot = dim 2."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def reset(self):
        if not self._cache_ready:
            self._build_cache()
        self.length = 0
        self._pos.zero_()

    def rollback(self, length: int):
        """Forget positions >= length: later writes overwrite them, the mask hides them."""
        if length < self.length:
            self.length = length
            self._pos.fill_(length)

    # ---- timing without syncs ---------------------------------------------------------------

    def _tic(self):
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _toc(self, t0):
        """Count one forward; on CUDA its time is read (one sync) only when the counters' seconds are."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.counters.add_pending(functools.partial(_event_seconds, t0, ev))
        else:
            self.counters.add(time.perf_counter() - t0)

    # ---- the step -------------------------------------------------------------------------

    def _step(self, ids: torch.Tensor, n_logits: int, with_head: bool, epilogue=None, rows: bool = False):
        """ids [1, n] fed at positions pos..; capturable. (logits, the last row's hidden state[, accept]), with
        `rows` every fed row's [n, H] in its place; `epilogue(logits, hidden, accept)`: run in the same graph,
        its outputs returned."""
        n = ids.shape[-1]
        h = self._last_hidden(ids, n if rows else max(n_logits, 1))
        logits = (self.logits(h[h.shape[0] - n_logits:]) if n_logits
                  else h.new_zeros(0, self.vocab_size, dtype=torch.float32))
        self._pos.add_(n)
        last = h[-1]
        accept = self.head.acceptance_prob(last).float() if with_head else None
        if epilogue is not None:
            return (epilogue(logits, last, accept),)
        hidden = h[-n:] if rows else last
        return (logits, hidden) if accept is None else (logits, hidden, accept)

    def _last_hidden(self, ids: torch.Tensor, rows: int) -> torch.Tensor:
        """Feed ids [1, n] at positions pos.. (pos left as it is): final hidden states of at least the last
        `rows` positions [>= rows, H]."""
        embeds = self.base.embed_tokens(ids)
        position_ids, mask = static_causal_mask(self.config, embeds, self.cache, self._pos)
        out = self.base(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids,
                        **model_kv(self.base, self.cache), use_cache=True)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def forward_hidden(self, ids: torch.Tensor, n_logits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with every fed row's hidden state [n, H]: the step's rows variant, through a graph for the
        shapes warmed with rows=True, eagerly otherwise."""
        return self._run(ids, n_logits, False, rows=True)

    @torch.inference_mode()
    def attach_head(self, head) -> None:
        """contract.HeadRunner. A captured graph reads the head's parameters by address, so a head of the attached
        one's shape is copied into its tensors; another shape replaces it and its graphs go."""
        if head is None or head is self._attached:
            return
        if not copy_head(self.head, head):
            self.head = head
            self._warm = {key for key in self._warm if not key[2]}
            if self._graphs is not None:
                self._graphs = {key: g for key, g in self._graphs.items() if not key[2]}
        self._attached = head

    # ---- the tree contract (contract.TreeRunner) ------------------------------------------------

    @torch.inference_mode()
    def tree_forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor, logit_from: int = 0):
        """contract.TreeRunner (eager)."""
        n = ids.shape[0]
        kv = self.length + n
        if tuple(attend.shape) != (n, kv):
            raise ValueError(f"attend must be [{n}, {kv}], got {tuple(attend.shape)}")
        if kv > self.max_cache_len:
            raise UserError(f"the static KV cache holds {self.max_cache_len} positions but {kv} are needed")
        t0 = self._tic()
        dtype = next(self.model.parameters()).dtype
        mask = torch.full((n, self.max_cache_len), torch.finfo(dtype).min, dtype=dtype, device=self.device)
        mask[:, :kv].masked_fill_(attend.to(self.device), 0.0)
        h = self._tree_hidden(ids.to(self.device), positions.to(self.device), mask)
        logits = self.logits(h[logit_from:])
        self.length += n
        self._pos.fill_(self.length)
        self._toc(t0)
        return logits, h

    def _tree_hidden(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, H] of ids [n] at `positions`, K/V written to slots pos.., under the additive mask."""
        n = ids.shape[0]
        out = self.base(input_ids=ids.view(1, n), attention_mask=mask.view(1, 1, n, -1),
                        position_ids=positions.view(1, n), **model_kv(self.base, self.cache), use_cache=True)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def compact(self, base: int, extra: list[int]):
        n = len(extra)
        if extra != list(range(base, base + n)):
            idx = torch.tensor(extra, dtype=torch.long, device=self.device)
            dst = torch.arange(base, base + n, device=self.device)
            for kv in self._kv_buffers():
                for t in kv:
                    t.index_copy_(2, dst, t.index_select(2, idx))
        self.length = base + n
        self._pos.fill_(self.length)


class FusedCausalLM(StaticCausalLM):
    """StaticCausalLM over fused.FusedDecoder: same arguments and contract; models it cannot run are refused
    before any weight moves."""

    fused = True

    def __init__(self, model, vocab_size: int | None = None, **kw):
        reason = unsupported_reason(model)
        if reason:
            raise UserError(reason + "; use the static runner without fused=True")
        super().__init__(model, vocab_size, **kw)

    def _alloc_kv(self):
        self.decoder = FusedDecoder(self.model, self.max_cache_len)

    def _kv_buffers(self):
        return self.decoder.kv_buffers()

    def _last_hidden(self, ids: torch.Tensor, rows: int) -> torch.Tensor:
        n = ids.shape[-1]
        positions = self._pos + self.decoder.slots[:n]  # position i in slot i
        x = self.decoder(ids.view(n), positions, positions, self.decoder.causal_mask(positions))
        return self.decoder.norm(x[n - rows:])

    def _tree_hidden(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        slots = self._pos + self.decoder.slots[:ids.shape[0]]
        return self.decoder.norm(self.decoder(ids, positions, slots, mask))
