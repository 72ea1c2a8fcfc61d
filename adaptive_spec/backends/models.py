"""Loading Hugging Face causal LMs for a pair (by hub id, local folder, or "default": setup/fetch.py) and the
vocabulary check."""
from __future__ import annotations

import torch

from ..errors import UserError, first_line
from .cpu.machine import auto_dtype
from .paths import resolve_model_path
from .vocab import reduce_output_layer, resolve_draft_vocab
from .cpu.packed import pack_cpu_linears
from .cpu.quant import QUANT_LAYERS, check_quant, quantize_linears
from .runner import _vocab_rows, resolve_device


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")  # auto: see cpu/machine.auto_dtype


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str | None = None) -> torch.dtype:
    """A torch dtype for a user's name; "auto" (or None) picks per device and CPU (cpu/machine.auto_dtype)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return auto_dtype(resolve_device(device))
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype]


def load_model(name: str | None, role: str = "target", dtype=None, device=None, pack: bool = True,
               quant: str | None = "none", draft_vocab=None, fp16: bool = True, pad_rows: int | None = None,
               fp16_rows: int | None = None):
    """(model, tokenizer) for a hub id, local path or the default pair's `role`. quant int8 / int4 (cpu/quant.py)
    and draft_vocab (vocab.py) are for drafts; pack, fp16, pad_rows and fp16_rows: pack_cpu_linears."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: the model registry; when weights load

    device = resolve_device(device)
    quant = check_quant(quant, device)  # before gigabytes of weights are read
    path = resolve_model_path(name, role)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        keep_ids = None
        if draft_vocab is not None:  # refused (0, too large, wrong tokenizer) before the weights load
            from transformers import AutoConfig  # heavy: as AutoModelForCausalLM above

            keep_ids = resolve_draft_vocab(draft_vocab, tok, AutoConfig.from_pretrained(path).vocab_size)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, device))
    except (OSError, ValueError) as e:
        raise UserError(f"could not load {role} model {name!r} ({first_line(e)}); pass a local folder or a hub id "
                        "that is cached or reachable") from None
    model.to(device).eval()
    if keep_ids is not None:
        reduce_output_layer(model, keep_ids)
    if quant in QUANT_LAYERS:
        quantize_linears(model, quant)
    elif pack:
        pack_cpu_linears(model, release=True, fp16=fp16, pad_rows=pad_rows, fp16_rows=fp16_rows)
    model.name_or_path = name or ("default-" + role)
    return model, tok


def check_vocab(draft_tok, target_tok, draft_model, target_model) -> int:
    """The vocabulary size both models share (embedding matrices may be padded to different sizes; the shared
    part must cover the tokenizer); refuses pairs whose tokenizers differ, as p and q are compared by id."""
    dv, tv = draft_tok.get_vocab(), target_tok.get_vocab()
    if dv != tv:
        only_d = len(set(dv.items()) - set(tv.items()))
        raise UserError(f"draft and target vocabularies differ ({len(dv)} vs {len(tv)} tokens, {only_d} draft entries "
                        "not in the target); speculative decoding needs a draft that shares the target's tokenizer")
    v = min(_vocab_rows(draft_model), _vocab_rows(target_model))
    if len(tv) > v:
        raise UserError(f"the tokenizer has {len(tv)} tokens but a model's output layer has only {v}; "
                        "the draft and target do not fit together")
    return v
