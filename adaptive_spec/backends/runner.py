"""The torch engine's KV runner (CausalLM), the KV keyword transformers' version takes, and the weights'
fingerprint that costs and heads key on."""
from __future__ import annotations

import functools
import hashlib
import inspect
import json

import torch
from transformers import DynamicCache

from ..errors import UserError
from ..timing import timed
from .contract import Counters


def resolve_device(device: str | None = None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@functools.lru_cache(maxsize=None)
def _cache_name(fn) -> str:
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def kv(fn, cache) -> dict:
    """The KV-cache keyword for `fn` (a forward, a masking function): newer transformers renamed
    `past_key_values` to `cache`, and the versions pyproject allows know one or the other."""
    return {_cache_name(fn): cache}


def model_kv(model, cache) -> dict:
    """kv() for a model instance: keyed on its class's forward, so the signature is read once per class."""
    return kv(type(model).forward, cache)


def spread_kept_logits(logits: torch.Tensor, kept_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits of a reduced output layer (columns = kept_ids, all < vocab_size) over the whole
    vocabulary: -inf, i.e. q = 0, at every other id."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., kept_ids] = logits[..., : len(kept_ids)]
    return full


def _vocab_rows(model) -> int:
    """Rows of the model's full output layer (a reduced draft vocabulary keeps fewer: see vocab.py)."""
    return getattr(model, "full_vocab_size", None) or model.get_output_embeddings().out_features


class CausalLM:
    """A causal LM with its own KV cache, fed in chunks, rolled back by cropping. Logits are computed only for
    the rows a caller needs: the LM head is a large share of a small draft's forward."""

    def __init__(self, model, vocab_size: int | None = None):
        self.model = model.eval()
        self.config = model.config
        self.base = model.base_model
        self.lm_head = model.get_output_embeddings()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.vocab_size = vocab_size or _vocab_rows(model)
        # a reduced draft vocabulary (vocab.py): the head scores these ids, every other id gets
        # logit -inf, i.e. q = 0 there; verification's residual still reaches those tokens
        kept = getattr(model, "kept_ids", None)
        self.kept_ids = None if kept is None else kept[kept < self.vocab_size]
        self.hidden_size = model.config.hidden_size
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self.counters = Counters()  # seconds inside forward(), synced where the device is async
        self.reset()

    def reset(self):
        self.cache = DynamicCache(config=self.config)
        self.length = 0

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.lm_head(hidden).float()
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        if self.kept_ids is None:
            return out[..., : self.vocab_size]
        return spread_kept_logits(out, self.kept_ids, self.vocab_size)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, n_logits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        logits, h = self.forward_hidden(ids, n_logits)
        return logits, h[-1]

    @torch.inference_mode()
    def forward_hidden(self, ids: torch.Tensor, n_logits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, with the final hidden state of every fed row [n, H] (a feature drafter reads them)."""
        with timed(self.device) as t:
            n = ids.shape[-1]
            pos = torch.arange(self.length, self.length + n, device=self.device)
            out = self.base(input_ids=ids.view(1, n), **model_kv(self.base, self.cache), use_cache=True,
                            position_ids=pos.view(1, n))
            h = out.last_hidden_state[0]
            logits = self.logits(h[n - n_logits:]) if n_logits else h.new_empty(0, self.vocab_size)
            self.length += n
        self.counters.add(t.s)
        return logits, h

    def rollback(self, length: int):
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: drop that many trailing positions
            self.length = length

    # ---- the tree contract (contract.TreeRunner): tree drafting and verification ------------------

    @torch.inference_mode()
    def tree_forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor,
                     logit_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """contract.TreeRunner."""
        with timed(self.device) as t:
            n = ids.shape[0]
            kv_len = self.length + n
            if tuple(attend.shape) != (n, kv_len):
                raise ValueError(f"attend must be [{n}, {kv_len}], got {tuple(attend.shape)}")
            dtype = self.model.dtype
            # an additive float mask works for the eager and the sdpa attention alike; a 4D mask is
            # passed through by transformers' masking_utils untouched
            mask = torch.zeros(1, 1, n, kv_len, dtype=dtype, device=self.device)
            mask.masked_fill_(~attend.to(self.device).view(1, 1, n, kv_len), torch.finfo(dtype).min)
            out = self.base(input_ids=ids.view(1, n), attention_mask=mask,
                            position_ids=positions.view(1, n).to(self.device), **model_kv(self.base, self.cache),
                            use_cache=True)
            h = out.last_hidden_state[0]
            logits = self.logits(h[logit_from:])
            self.length += n
        self.counters.add(t.s)
        return logits, h

    @torch.inference_mode()
    def compact(self, base: int, extra: list[int]):
        """contract.TreeRunner; only len(extra) rows are moved per layer."""
        n = len(extra)
        if extra == list(range(base, base + n)):  # already in place: a crop
            self.rollback(base + n)
            return
        idx = torch.tensor(extra, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            keys = getattr(layer, "keys", None)
            if keys is None or keys.numel() == 0:
                continue
            if getattr(layer, "cumulative_length", 0) > keys.shape[-2]:
                raise UserError("tree verification does not support sliding-window caches that already dropped tokens")
            for name in ("keys", "values"):
                t = getattr(layer, name)
                rows = t.index_select(-2, idx)
                t[..., base:base + n, :] = rows
                setattr(layer, name, t[..., :base + n, :])
            if getattr(layer, "cumulative_length", None) is not None:
                layer.cumulative_length = base + n
        self.length = base + n

    def fresh(self) -> "CausalLM":
        """Another runner on the same weights with its own empty cache (for work beside a running decode)."""
        return CausalLM(self.model, self.vocab_size)

    def fingerprint(self) -> str:
        return model_fingerprint(self.model)

    def numeric_path(self) -> dict:
        """What a measurement on this runner depends on: its dtype and the CPU kernels chosen at load."""
        return getattr(self.model, "cpu_path", None) or {"dtype": str(next(self.model.parameters()).dtype)}


def model_fingerprint(model) -> str:
    """Short hash of the config and 16 strided values of every weight, rounded to bf16 (the config's dtype
    ignored), so one checkpoint loaded in bf16 or fp32 gets the same fingerprint."""
    conf = {k: v for k, v in model.config.to_dict().items()
            if not k.startswith("_") and k not in ("transformers_version", "name_or_path", "dtype", "torch_dtype")}
    h = hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode())
    for name, w in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        flat = w.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 16)][:16]
        h.update(name.encode())
        h.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
