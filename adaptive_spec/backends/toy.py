"""Tiny random Hugging Face models and a character-level tokenizer, running the real Qwen2/Llama code paths in
milliseconds: for the tests and eval/'s --smoke runs (which import nothing from tests/)."""
from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"


def make_tokenizer(vocab_size: int):
    """Character-level Qwen2Tokenizer (transformers picks the class from a folder's model config): ids 0..3
    are specials, then a-z, space, 0-9."""
    import string

    from transformers import Qwen2Tokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "<|user|>": 3}
    for c in list(string.ascii_lowercase) + ["\u0120"] + list(string.digits):
        if len(vocab) >= vocab_size:
            break
        vocab[c] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model(vocab_size: int = 8, hidden_size: int = 16, layers: int = 2, seed: int = 0,
               max_positions: int = 128, arch: str = "qwen2", logit_scale: float = 1.0):
    """A random causal LM; logit_scale sharpens its next-token distributions."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = cfg_cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=max_positions, tie_word_embeddings=False,
                  bos_token_id=3, eos_token_id=1, pad_token_id=0)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


def save_model(path: Path, vocab_size: int = 8, **kw) -> Path:
    """Save a tiny model + tokenizer to `path` (a folder usable wherever a model path is)."""
    path = Path(path)
    make_model(vocab_size=vocab_size, **kw).save_pretrained(path)
    make_tokenizer(vocab_size).save_pretrained(path)
    return path
