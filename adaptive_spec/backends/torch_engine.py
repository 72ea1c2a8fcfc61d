"""The torch engine's loader: Hugging Face weights on KV runners (runner.CausalLM, or static_runner's), as
contract.Loaded."""
from __future__ import annotations

import torch

from ..errors import UserError, get_logger
from ..prompts import eos_token_ids
from .contract import Loaded
from .fused import unsupported_reason
from .models import check_vocab, load_model
from .cpu.quant import check_quant
from .runner import resolve_device
from .static_runner import DRAFT_SHAPES, make_runner, verify_shapes

log = get_logger(__name__)


def runtime_for(kv_cache: str, runtime: str, device: torch.device) -> tuple[str, str]:
    """(kv_cache, runtime) with "auto" resolved for `device`: on a GPU the static cache and compiled graphs (a
    step's time is its kernel launches), on the CPU the dynamic cache run eagerly. Refuses GPU-only choices
    on a CPU before any weights."""
    cuda = device.type == "cuda"
    kv_cache = ("static" if cuda else "dynamic") if kv_cache == "auto" else kv_cache
    if runtime == "auto":
        runtime = "compile" if cuda and kv_cache == "static" else "eager"
    if runtime == "cudagraph" and not cuda:
        raise UserError(f"--runtime cudagraph captures CUDA graphs, and this pair runs on {device}; use --runtime "
                        "eager (or auto), or a GPU")
    if runtime != "eager" and kv_cache != "static":
        raise UserError(f"--runtime {runtime} needs the static KV cache: add --kv-cache static (or auto)")
    return kv_cache, runtime


def load_pair(params) -> Loaded:
    """The pair PairParams name, every setting checked before any weights load."""
    params.check_draft_vocab_size()
    if params.threads:
        torch.set_num_threads(params.threads)
    device = resolve_device(params.device)
    kv_cache, runtime = runtime_for(params.kv_cache, params.runtime, device)
    check_quant(params.draft_quant, device)  # refused before any weights load
    kernels = params.cpu_kernels()
    target_model, tok = load_model(params.target, "target", params.dtype, device, **kernels)
    draft_model, dtok = ((load_model(params.draft, "draft", params.dtype, device, quant=params.draft_quant,
                                     draft_vocab=params.draft_vocab, **kernels)
                          if params.draft is not None else (None, None)))
    loaded = from_models(target_model, tok, draft_model, dtok, kv_cache=kv_cache, runtime=runtime,
                         max_cache_len=params.max_cache_len, fused=params.fused)
    loaded.draft_config = {"draft_quant": params.draft_quant, "draft_vocab": params.draft_vocab or "full"}
    return loaded


def from_models(target_model, tokenizer, draft_model=None, draft_tokenizer=None, kv_cache: str = "auto",
                runtime: str = "auto", max_cache_len: int | None = None, k_max: int = 20,
                fused: bool | str = "auto") -> Loaded:
    """Runners over Hugging Face models already loaded ("auto": runtime_for, _fused_for); graph runtimes are
    captured for rounds of up to k_max candidates (more through Loaded.prepare)."""
    vocab = None
    if draft_model is not None:
        vocab = check_vocab(draft_tokenizer or tokenizer, tokenizer, draft_model, target_model)
    kv_cache, runtime = runtime_for(kv_cache, runtime, next(target_model.parameters()).device)

    def runner(model):
        return make_runner(model, vocab, kv_cache, runtime, max_cache_len, fused=_fused_for(model, fused, kv_cache))
    target = runner(target_model)
    draft = runner(draft_model) if draft_model is not None else None
    prepare = graph_warmup(target, draft, runtime) if runtime != "eager" else None
    if prepare is not None:
        prepare(k_max)
    return Loaded(target, draft, tokenizer, eos_token_ids(tokenizer, target_model), {}, prepare=prepare)


def _fused_for(model, fused: bool | str, kv_cache: str) -> bool:
    """Whether `model` runs on the fused decoder: as asked, or with "auto" where it pays (the static cache on
    a GPU, where a step's time is its kernels) and the architecture is supported."""
    if fused == "auto":  # the architecture is read only where the fused decoder would run
        return kv_cache == "static" and next(model.parameters()).device.type == "cuda" and unsupported_reason(model) is None
    why = unsupported_reason(model) if fused else None
    if why:
        raise UserError(f"--fused true: {why}; use --fused false")
    return bool(fused)


def graph_warmup(target, draft, runtime: str, rows: bool = False):
    """The pair's `prepare(k_max, head)` (contract.Loaded), each shape captured once; rows: the target's
    forward_hidden variant in place of forward's (a feature drafter's target, drafter/source.py)."""
    done = {"k": -1, "head": False}

    def prepare(k_max: int, head=None) -> None:
        t = 0.0
        if k_max > done["k"]:
            shapes = [s for s in verify_shapes(k_max) if s[0] > done["k"] + 1]
            log.info(f"{'compiling' if runtime == 'compile' else 'capturing'} {runtime} graphs for verify passes of "
                     f"{shapes[0][0]}..{shapes[-1][0]} rows (once per process; torch keeps compiled kernels on disk)")
            t += target.warmup(shapes, rows=rows)
            if draft is not None and done["k"] < 0:
                t += draft.warmup(DRAFT_SHAPES, with_head=False)
            done["k"] = k_max
        if head is not None and draft is not None:
            draft.attach_head(head)  # the same head again: its values copied in, the graphs kept
            if not done["head"]:
                log.info("capturing the draft's steps with the acceptance head in their graph")
                t += draft.warmup(DRAFT_SHAPES, with_head=True)
                done["head"] = True
        if t:
            log.info(f"graphs ready in {t:.1f} s")

    return prepare
