"""The feature drafter's one-token step on static buffers: what the static drafter runner (static.py) replays
as one graph per draft step, and what the GPU check times (evaluation/drafter_step.py).

The KV cache is written at a device position `pos` (backends/static_runner.py's positioned cache), the fed
token and state sit in fixed tensors (`tok`, `feat`), and every slot's output stays in `hat` (row s + 1: the
output f^_{s+1} of slot s; row 0 stays zero, the state a slot 0 reads without the target's), so no shape or
address depends on the position and nothing is read back to the host."""
from __future__ import annotations

import torch

from ..backends.graphs import capture_graph
from ..backends.static_runner import positioned_static_cache, static_causal_mask
from .model import FeatureDrafter, Readout


class DrafterStep:
    """One draft step on static buffers, capturable: the fed token and state (`tok`, `feat`) in fixed tensors,
    the KV cache written at the device position `pos`; the step writes its f^ back into `feat` (the state the
    next slot reads) and into `hat`, and its token into `toks` (row s + 1: the token slot s read)."""

    def __init__(self, drafter: FeatureDrafter, readout: Readout, max_cache_len: int):
        self.drafter, self.readout, dev = drafter, readout, drafter.device
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        self.cache = positioned_static_cache(drafter.config_obj, max_cache_len, self.pos, drafter.dtype, dev)
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.feat = torch.zeros(1, 1, drafter.hidden_size, dtype=drafter.dtype, device=dev)
        self.hat = torch.zeros(max_cache_len + 1, drafter.hidden_size, dtype=drafter.dtype, device=dev)
        self.toks = torch.zeros(max_cache_len + 1, dtype=torch.long, device=dev)
        for t in (self.pos, self.tok, self.feat, self.hat, self.toks):
            torch._dynamo.mark_static_address(t)  # one address for a compiled graph, as the cache's tensors
        self.graph, self.out = None, None

    def _pass(self, feats: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """feats [1, n, H], ids [1, n] at positions pos..: the drafter's output [1, n, H]; pos unchanged."""
        embeds = self.readout.embed(ids)
        position_ids, mask = static_causal_mask(self.drafter.config_obj, embeds, self.cache, self.pos)
        return self.drafter(feats, embeds, position_ids, cache=self.cache, use_cache=True, attention_mask=mask)

    def feed(self, feats: torch.Tensor, ids: torch.Tensor) -> None:
        """Slots pos..pos+n-1 from the states feats [n, H] and the tokens ids [n] in one pass (eager: a run of
        the target's own states); advances pos."""
        n = ids.numel()
        out = self._pass(feats.reshape(1, n, -1).to(self.drafter.dtype), ids.reshape(1, n))
        f = self.readout.feature(out[0]).to(self.hat.dtype)
        self.hat.index_copy_(0, self.pos + 1 + torch.arange(n, device=self.pos.device), f)
        self.feat.copy_(f[-1].view_as(self.feat))
        self.pos.add_(n)

    @torch.inference_mode()
    def prefill(self, feats: torch.Tensor, ids: torch.Tensor) -> None:
        """Slots 0..n-1 from the target's states feats [n, H] and the next tokens ids [n]."""
        self.pos.zero_()
        self.feed(feats, ids)

    def advance(self) -> torch.Tensor:
        """The one-token step: slot pos reads (feat, tok); its f^ [1, H] (the drafter's dtype) is written to
        hat[pos + 1] and feat, tok to toks[pos + 1]; advances pos. Capturable."""
        f = self.readout.feature(self._pass(self.feat, self.tok)[0]).to(self.hat.dtype)
        at = self.pos.view(1) + 1
        self.hat.index_copy_(0, at, f)
        self.toks.index_copy_(0, at, self.tok.view(1))
        self.feat.copy_(f.view_as(self.feat))
        self.pos.add_(1)
        return f

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain's step as the GPU check times it: advance, then (q over the kept ids [1, n_kept] float32, the
        argmax's id [1]), the argmax written back into tok as the next step's input."""
        q = torch.softmax(self.readout.kept_logits(self.advance()), -1)
        nxt = self.readout.kept_ids[q.argmax(-1)]
        self.tok.copy_(nxt.view(1, 1))
        return q, nxt

    @torch.inference_mode()
    def capture(self) -> None:
        """Record the chain step (`step`) into a CUDA graph, replayed by graph.replay()."""
        self.graph, self.out = capture_graph(self.step, self.pos.device, (self.pos, self.tok, self.feat))
