"""A reduced draft vocabulary on llama.cpp (`--draft-vocab N`): the draft's GGUF rewritten so its embedding
and output matrices (llama.cpp sizes both by one n_vocab) keep V' rows, and the two maps with which
llamacpp.LlamaCppLM stands in for the full-vocabulary draft: in, a dropped id goes to the kept token whose
text is its longest prefix (costs acceptance, never exactness); out, the dropped ids get -inf (q = 0).
Made once into <cache>/gguf/ beside a `.vocab.npz` of the maps; the GGUF is renamed into place last."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from ..errors import UserError, get_logger
from ..setup.llama_build import cache_dir
from .paths import file_fingerprint

log = get_logger(__name__)

# the tokenizer keys that name one token id: remapped into the reduced ids (dropped when the token is)
_ID_KEYS = ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "padding_token_id", "unknown_token_id",
            "seperator_token_id", "cls_token_id", "mask_token_id", "fim_pre_token_id", "fim_suf_token_id",
            "fim_mid_token_id", "fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id")
_VOCAB_ROWS = ("token_embd.weight", "output.weight")  # the matrices with one row per token


def byte_level_chars() -> set[str]:
    """The 256 characters a byte-level BPE vocabulary (GPT-2's, Qwen's) writes single bytes as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    # the other bytes are written as chr(256), chr(257), ... in byte order
    return {chr(c) for c in printable} | {chr(256 + n) for n in range(256 - len(printable))}


def complete_keep(keep_ids, tokens: list[str] | None, token_types: list[int] | None, n_vocab: int) -> np.ndarray:
    """The kept ids (sorted) with what the reduced file must hold whatever the list says: every control or
    user-defined token (end of turn, chat markers: llama.cpp looks them up at load) and the byte tokens
    (so every dropped token has a kept prefix)."""
    keep = {int(i) for i in keep_ids if 0 <= int(i) < n_vocab}
    if token_types is not None:
        keep |= {i for i, t in enumerate(token_types) if t not in (1,)}  # 1: NORMAL
    if tokens is not None:
        single = byte_level_chars()
        keep |= {i for i, s in enumerate(tokens) if s in single}
        newline = [i for i, s in enumerate(tokens) if s in ("Ċ", "\n", "<0x0A>")]
        keep |= set(newline[:1])  # llama.cpp tokenizes "\n" at load
    if not keep:
        raise UserError("--draft-vocab keeps no token of this draft; pass N >= 1")
    return np.array(sorted(keep), dtype=np.int64)


def input_map(kept: np.ndarray, n_vocab: int, tokens: list[str] | None) -> np.ndarray:
    """[n_vocab] int32: each full-vocabulary id's row in the reduced file (see the module's docstring)."""
    out = np.full(n_vocab, 0, dtype=np.int32)  # no text to go by: the first kept id
    out[kept] = np.arange(len(kept), dtype=np.int32)
    if tokens is not None:
        row = {tokens[i]: r for r, i in enumerate(kept.tolist())}
        dropped = np.ones(n_vocab, dtype=bool)
        dropped[kept] = False
        for i in np.flatnonzero(dropped).tolist():
            s = tokens[i]
            for end in range(len(s) - 1, 0, -1):
                r = row.get(s[:end])
                if r is not None:
                    out[i] = r
                    break
    return out


def _tag(ids: np.ndarray) -> str:
    return f"vocab{len(ids)}-{hashlib.sha256(ids.astype(np.int64).tobytes()).hexdigest()[:8]}"


def reduced_draft_gguf(src: str | Path, keep_ids) -> tuple[Path, np.ndarray, np.ndarray]:
    """(reduced GGUF, kept ids [V'] sorted, input map [V]) for `src` keeping `keep_ids` (plus what
    complete_keep adds); cached under the source's fingerprint and the ids asked for, so a load that finds
    it never opens gguf's reader (seconds)."""
    src = Path(src)
    asked = np.unique(np.asarray(keep_ids, dtype=np.int64))
    out = cache_dir() / "gguf" / f"{src.stem}.{_tag(asked)}.{file_fingerprint(src)}.gguf"
    maps = out.with_name(out.name + ".vocab.npz")
    if out.is_file() and maps.is_file():
        with np.load(maps) as z:
            return out, z["kept_ids"], z["input_map"]
    import gguf  # the GGUF reader/writer (a dependency); only when a reduced draft is made

    reader = gguf.GGUFReader(str(src))
    fields = reader.fields
    tokens = fields["tokenizer.ggml.tokens"].contents() if "tokenizer.ggml.tokens" in fields else None
    types = fields["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in fields else None
    rows = {t.name: t for t in reader.tensors if t.name in _VOCAB_ROWS}
    if "token_embd.weight" not in rows:
        raise UserError(f"{src.name} has no token_embd.weight; --draft-vocab needs a draft with one (a llama-style GGUF)")
    n_vocab = int(rows["token_embd.weight"].shape[-1])
    kept = complete_keep(asked, tokens, types, n_vocab)
    imap = input_map(kept, n_vocab, tokens)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_maps = maps.with_name(maps.name + ".partial.npz")
    np.savez(tmp_maps, kept_ids=kept, input_map=imap)
    os.replace(tmp_maps, maps)
    tmp = out.with_name(out.name + ".partial")
    log.info("writing %s with %d of %d tokens (once; kept as %s)", src.name, len(kept), n_vocab, out)
    _write(reader, tmp, kept, n_vocab)
    os.replace(tmp, out)
    return out, kept, imap


def _write(reader, path: Path, kept: np.ndarray, n_vocab: int) -> None:
    """Copy `reader`'s file to `path`, every per-token array and matrix cut to the kept rows."""
    import gguf

    fields = reader.fields
    arch = fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(path), arch)
    new_id = {int(i): r for r, i in enumerate(kept.tolist())}
    for key, f in fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        val = f.contents()
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in _ID_KEYS:
            if int(val) not in new_id:
                continue  # its token was dropped: llama.cpp then finds none of that kind
            val = new_id[int(val)]
        elif key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores") \
                and len(val) == n_vocab:
            val = [val[i] for i in kept.tolist()]
        elif key == f"{arch}.vocab_size":
            val = len(kept)
        w.add_key_value(key, val, vtype, sub_type=sub)
    data = {}
    for t in reader.tensors:
        d = t.data[kept] if t.name in _VOCAB_ROWS else t.data  # a row is its blocks: cut as stored
        data[t.name] = d
        w.add_tensor_info(t.name, d.shape, d.dtype, d.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(data[t.name])
    w.close()
