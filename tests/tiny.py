"""Tiny random Hugging Face models and a word-level tokenizer for fast CPU tests.

Real Qwen2/Llama code paths (KV cache, crop, position ids) run on them, so tests exercise the
same runtime as the default pair, in milliseconds.
"""
from __future__ import annotations

from pathlib import Path

import torch

from adaptive_spec.backends.contract import Counters

# the tiny HF models and tokenizer live in the package (eval/'s smoke runs build them too)
from adaptive_spec.backends.toy import CHAT_TEMPLATE, make_model, make_tokenizer, save_model  # noqa: F401


class MockLM:
    """A trigram language model with the `CausalLM` runner interface, for sampler tests.

    next-token logits depend on the last two tokens through a fixed random table, so drafts
    and targets built from different seeds disagree in context-dependent ways. No transformer:
    a forward is a table lookup, so exactness tests can afford thousands of generations.
    """

    def __init__(self, vocab_size: int, seed: int, scale: float = 3.0, max_length: int | None = None):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab_size + 1, vocab_size + 1, vocab_size, generator=g) * scale
        self._args = (vocab_size, seed, scale, max_length)
        self.vocab_size = vocab_size
        self.hidden_size = 2
        self.max_length = max_length
        self.device = torch.device("cpu")
        self.counters = Counters()
        self.reset()

    def reset(self):
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def forward(self, ids, n_logits: int = 1):
        self.tokens.extend(int(t) for t in ids)
        self.counters.add(0.0)
        V = self.vocab_size
        rows = []
        for j in range(len(self.tokens) - n_logits, len(self.tokens)):
            a = self.tokens[j - 1] if j >= 1 else V  # V = "no token" (start of text)
            rows.append(self.table[a, self.tokens[j]])
        logits = torch.stack(rows) if rows else torch.empty(0, V)
        hidden = torch.tensor([float(self.tokens[-1]), float(len(self.tokens))])
        return logits, hidden

    def rollback(self, length: int):
        del self.tokens[length:]

    def fresh(self):
        return type(self)(*self._args)


# qwen2's tensor names in GGUF (llama.cpp's), per layer and for the whole model
_GGUF_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
               "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
               "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def save_gguf(model, path: Path, tokens: list[str] | None = None) -> Path:
    """Write a tiny Qwen2 model (make_model(arch="qwen2")) as an fp32 GGUF file llama.cpp loads.

    The tokenizer is llama.cpp's "none" type with `vocab_size` dummy tokens unless `tokens` names
    them (a SentencePiece-style vocabulary, so two files can be told apart by their token strings): this project
    tokenizes with Hugging Face's tokenizer, so llama.cpp only ever sees ids. Qwen2 uses NeoX rope
    in both libraries, so the attention weights go over unpermuted."""
    import gguf

    cfg = model.config
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_file_type(0)  # all F32
    if tokens is None:
        w.add_tokenizer_model("none")
        w.add_vocab_size(cfg.vocab_size)
    else:
        w.add_tokenizer_model("llama")  # SentencePiece-style: a token list with scores, no merges
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * len(tokens))
        w.add_token_types([1] * len(tokens))
    for name, p in model.state_dict().items():
        if name in _GGUF_TOP:
            gname = _GGUF_TOP[name]
        else:
            _, _, i, rest = name.split(".", 3)  # model.layers.<i>.<rest>
            gname = f"blk.{i}.{_GGUF_LAYER[rest]}"
        w.add_tensor(gname, p.detach().float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
