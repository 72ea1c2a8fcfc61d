"""A reduced draft vocabulary (FR-Spec): the draft's output layer, its largest matrix, keeps the V' most frequent
tokens. q is zero off them and verification's residual gives them their target probability, so only
acceptance on rare tokens is lost. A token list is a safetensors file (`ids`, most frequent first, and
`counts`) whose metadata names its tokenizer, so a list for another is refused."""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from ..errors import UserError
from ..runs import atomic_write
from .paths import parse_draft_vocab

SHIPPED = Path(__file__).resolve().parents[1] / "data" / "token_freq_qwen2.5.safetensors"


def tokenizer_hash(tok) -> str:
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def save_token_list(path: str | Path, tok, counts: Counter, source: str, always: Iterable[int] = ()) -> Path:
    """Write ids by descending count (ties by id); `always` (EOS and the chat markers) go first,
    so a reduced draft can still end a turn."""
    first = list(dict.fromkeys(int(i) for i in always))
    rest = sorted((i for i in counts if i not in set(first)), key=lambda i: (-counts[i], i))
    ids = first + rest
    tensors = {"ids": torch.tensor(ids, dtype=torch.int32),
               "counts": torch.tensor([counts.get(i, 0) for i in ids], dtype=torch.int32)}
    meta = {"tokenizer_hash": tokenizer_hash(tok), "tokenizer_size": str(len(tok)), "source": source}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, save(tensors, metadata=meta))


def load_token_list(path: str | Path, tok) -> torch.Tensor:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"draft token list {path} does not exist; build one with `adaptive-spec draft-vocab`")
    try:
        with safe_open(str(path), "pt") as f:
            meta, ids = f.metadata() or {}, f.get_tensor("ids")
    except (SafetensorError, OSError) as e:
        raise UserError(f"draft token list {path} is corrupt ({e}); rebuild it with `adaptive-spec draft-vocab`") from None
    if meta.get("tokenizer_hash") != tokenizer_hash(tok):
        raise UserError(f"draft token list {path} was counted with another tokenizer (size {meta.get('tokenizer_size')}, "
                        f"this one {len(tok)}); build one for this tokenizer with `adaptive-spec draft-vocab`")
    return ids.long()


def resolve_draft_vocab(spec, tok, vocab_size: int) -> torch.Tensor | None:
    """Kept token ids (sorted) for `--draft-vocab N | FILE | FILE:N` (N: from the shipped list); None: all."""
    parsed = parse_draft_vocab(spec)
    if parsed is None:
        return None
    path, n = parsed
    if n is not None and not 0 < n <= vocab_size:
        raise UserError(f"--draft-vocab must be in 1..{vocab_size} (the vocabulary size), got {n}")
    if not path:
        if not SHIPPED.is_file():
            raise UserError(f"no shipped token list ({SHIPPED} is missing); pass --draft-vocab FILE")
        try:
            ids = load_token_list(SHIPPED, tok)
        except UserError:
            raise UserError("the shipped token list is for the Qwen2.5 tokenizer; for this one build a list with "
                            "`adaptive-spec draft-vocab --tokenizer MODEL --out FILE` and pass --draft-vocab FILE:N") from None
    else:
        ids = load_token_list(path, tok)
    ids = ids[ids < vocab_size]
    if n is not None and n > len(ids):
        # the list holds only tokens seen in its corpus: fill up with the lowest unseen ids
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        seen[ids] = True
        ids = torch.cat([ids, (~seen).nonzero().flatten()[: n - len(ids)]])
    return ids[:n].sort().values


def reduce_output_layer(model, keep_ids: torch.Tensor) -> None:
    """Replace the output layer by one over `keep_ids` rows (untied from the embedding); the
    full vocabulary size and the kept ids stay on the model for CausalLM's logits."""
    head = model.get_output_embeddings()
    full = head.out_features
    lin = torch.nn.Linear(head.in_features, len(keep_ids), bias=head.bias is not None,
                          device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(head.weight[keep_ids.to(head.weight.device)])
        if head.bias is not None:
            lin.bias.copy_(head.bias[keep_ids.to(head.weight.device)])
    model.set_output_embeddings(lin)
    model.config.tie_word_embeddings = False
    model.kept_ids = keep_ids.to(head.weight.device)
    model.full_vocab_size = full


def build_token_list(tok, text_files: list[str], out: str | Path) -> tuple[Path, Counter]:
    """Count tokens over JSONL files (FILE:FIELD picks a field, default 'text') and write the
    list; EOS, pad and the chat markers go first. `adaptive-spec draft-vocab` calls this."""
    counts = Counter()
    for spec in text_files:
        file, _, field = spec.partition(":")
        if not Path(file).is_file():
            raise UserError(f"text file {file} does not exist; pass JSONL files of texts (FILE or FILE:FIELD)")
        with open(file) as fh:
            for line in filter(str.strip, fh):
                counts.update(tok(json.loads(line).get(field or "text", ""), add_special_tokens=False)["input_ids"])
    always = [t for t in (tok.eos_token_id, tok.pad_token_id) if t is not None]
    markers = [t for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>") if t in tok.get_vocab()]
    always += tok.convert_tokens_to_ids(markers)
    return save_token_list(out, tok, counts, source=" ".join(text_files), always=always), counts
