"""The torch engine's loader: Hugging Face weights (the default pair: the fetched GGUFs dequantized to
bf16) on KV runners (models.CausalLM, or static_runner's static cache), as engines.Loaded.

dtype "auto": bf16, or fp32 on a CPU without bf16 kernels (cpu.py). The draft may be made cheaper
without touching exactness: draft_quant "int8" / "int4" (weight-only), draft_vocab N | FILE | FILE:N
(its output layer keeps the N most frequent tokens; vocab.py).
"""
from __future__ import annotations

import torch

from ..prompts import eos_token_ids
from .engines import Loaded
from .models import check_quant, check_vocab, load_model, resolve_device
from .static_runner import DRAFT_SHAPES, make_runner, verify_shapes


def load_pair(params) -> Loaded:
    """The pair PairParams name, every setting checked before any weights load."""
    params.check_draft_vocab_size()
    if params.threads:
        torch.set_num_threads(params.threads)
    device = resolve_device(params.device)
    check_quant(params.draft_quant, device)  # refused before any weights load
    kernels = params.cpu_kernels()
    target_model, tok = load_model(params.target, "target", params.dtype, device, **kernels)
    draft_model, dtok = ((load_model(params.draft, "draft", params.dtype, device, quant=params.draft_quant,
                                     draft_vocab=params.draft_vocab, **kernels)
                          if params.draft is not None else (None, None)))
    loaded = from_models(target_model, tok, draft_model, dtok, kv_cache=params.kv_cache, runtime=params.runtime,
                         max_cache_len=params.max_cache_len)
    loaded.draft_config = {"draft_quant": params.draft_quant, "draft_vocab": params.draft_vocab or "full"}
    return loaded


def from_models(target_model, tokenizer, draft_model=None, draft_tokenizer=None, kv_cache: str = "dynamic",
                runtime: str = "eager", max_cache_len: int | None = None, k_max: int = 20) -> Loaded:
    """Runners over Hugging Face models already loaded. kv_cache "dynamic": growing KV caches (any model,
    any device); "static": preallocated caches indexed by position, with runtime eager | cudagraph |
    compile (GPU), graphs captured for the shapes a round of up to k_max candidates feeds."""
    vocab = None
    if draft_model is not None:
        vocab = check_vocab(draft_tokenizer or tokenizer, tokenizer, draft_model, target_model)
    graphs = runtime != "eager"
    target = make_runner(target_model, vocab, kv_cache, runtime, max_cache_len,
                         warmup_shapes=verify_shapes(k_max) if graphs else ())
    draft = (make_runner(draft_model, vocab, kv_cache, runtime, max_cache_len,
                         warmup_shapes=DRAFT_SHAPES if graphs else ())
             if draft_model is not None else None)
    return Loaded(target, draft, tokenizer, eos_token_ids(tokenizer, target_model), {})
