"""The torch engine's KV runner (CausalLM): a causal LM with its own cache, fed in chunks, rolled back by
cropping, logits only for the rows a caller reads; the KV keyword transformers' version takes (kv,
model_kv); and the weights' fingerprint costs and heads key on.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json

import torch
from transformers import DynamicCache

from ..timing import timed


def resolve_device(device: str | None = None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@functools.lru_cache(maxsize=None)
def _cache_name(fn) -> str:
    params = inspect.signature(fn).parameters
    return "cache" if "cache" in params else "past_key_values"


def kv(fn, cache) -> dict:
    """The KV-cache keyword argument for the function `fn` (a model class's forward, a masking
    function). transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes
    in 5.40); pyproject allows >=5.17, which only knows the old one, so the signature decides."""
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
    """A causal LM with its own KV cache, fed in chunks, rolled back by cropping.

    Invariant kept by the decoders: the cache covers seq[:length] and seq[length:] (at least
    one token) is still to be fed. The final hidden state is taken from the base model, and
    logits are computed only for the rows a caller needs: the LM head over 151,936 tokens is a
    large share of a small draft's forward, and prefill needs none of it.
    """

    def __init__(self, model, vocab_size: int | None = None):
        self._cache_cls = DynamicCache
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
        self.fwd_time = 0.0  # seconds spent in forward(), synced where the device is async
        self.n_forwards = 0
        self.prefill_s = 0.0  # the last prompt prefill (Decoder sets it), part of fwd_time
        self.reset()

    def reset(self):
        self.cache = self._cache_cls(config=self.config)
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
        """Feed `ids` [n] after the cached prefix. Returns (logits of the last n_logits
        positions [n_logits, V] float32, final hidden state of the last position [H])."""
        with timed(self.device) as t:
            n = ids.shape[-1]
            pos = torch.arange(self.length, self.length + n, device=self.device)
            out = self.base(input_ids=ids.view(1, n), **model_kv(self.base, self.cache), use_cache=True,
                            position_ids=pos.view(1, n))
            h = out.last_hidden_state[0]
            logits = self.logits(h[n - n_logits:]) if n_logits else h.new_empty(0, self.vocab_size)
            self.length += n
        self.fwd_time += t.s
        self.n_forwards += 1
        return logits, h[-1]

    def rollback(self, length: int):
        """Forget cached positions >= length (cheap: slices the cache tensors)."""
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: drop that many trailing positions
            self.length = length

    def fresh(self) -> "CausalLM":
        """Another runner on the same weights with its own empty cache (for work beside a running decode)."""
        return CausalLM(self.model, self.vocab_size)

    def fingerprint(self) -> str:
        return model_fingerprint(self.model)

    def numeric_path(self) -> dict:
        """What a measurement on this runner depends on: its dtype and the CPU kernels chosen at load."""
        return getattr(self.model, "cpu_path", None) or {"dtype": str(next(self.model.parameters()).dtype)}


def model_fingerprint(model) -> str:
    """Short hash of the config and a strided sample of every weight.

    Weights are rounded to bf16 and the config's dtype ignored, so one checkpoint loaded in
    bf16 or fp32 gets the same fingerprint; touching ~16 values per tensor keeps it instant.
    """
    conf = {k: v for k, v in model.config.to_dict().items()
            if not k.startswith("_") and k not in ("transformers_version", "name_or_path", "dtype", "torch_dtype")}
    h = hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode())
    for name, w in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        flat = w.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 16)][:16]
        h.update(name.encode())
        h.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
