"""GPU pair presets: draft/target pairs named by their hub ids, with the architecture values (from each
repository's config.json) that build random-weight models of the same shapes offline: a forward's cost
does not depend on the weights' values, so a benchmark without the download times random weights, the
acceptance coming from a trace (decoding/replay.py). Stdlib only at import (names are checked before torch)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import UserError

QWEN_ROWS = 151_936  # output rows of Qwen2.5 0.5B..3B; 7B and up pad to 152,064
TINY_VOCAB = 256  # a --tiny pair's shared vocabulary


@dataclass(frozen=True)
class Shape:
    """One model's architecture: what Qwen2Config needs to build it with random weights."""

    hub_id: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab_rows: int  # rows of the output layer (the tokenizer's ids, padded)
    tie_word_embeddings: bool
    rope_theta: float = 1_000_000.0
    max_positions: int = 32_768
    rms_norm_eps: float = 1e-6
    bos_token_id: int = 151643
    eos_token_id: int = 151645  # <|im_end|>, what the Instruct models end a turn with

    def config(self) -> dict:
        """Qwen2Config keywords (full attention: Qwen2.5 ships use_sliding_window false)."""
        return dict(hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, intermediate_size=self.intermediate,
                    vocab_size=self.vocab_rows, tie_word_embeddings=self.tie_word_embeddings,
                    rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                    max_position_embeddings=self.max_positions, rms_norm_eps=self.rms_norm_eps,
                    hidden_act="silu", use_sliding_window=False, attention_dropout=0.0,
                    bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id)

    def n_params(self) -> int:
        """Parameters, from the shapes (q/k/v biases included, the output layer once when tied)."""
        hd = self.hidden // self.heads
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * hd + (self.heads + 2 * self.kv_heads) * hd \
            + self.heads * hd * self.hidden
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        emb = self.vocab_rows * self.hidden * (1 if self.tie_word_embeddings else 2)
        return self.layers * layer + emb + self.hidden

    def tiny(self, vocab_rows: int) -> "Shape":
        """The same structure scaled down: the GQA group, tied or not, the MLP's width ratio, padding
        rows past the shared vocabulary; head_dim 8, at most 2 kv heads, a layer per 8."""
        group = self.heads // self.kv_heads
        kv = min(self.kv_heads, 2)
        hidden = group * kv * 8
        inter = max(8, round(hidden * self.intermediate / self.hidden / 8) * 8)
        return replace(self, hub_id=f"tiny:{self.hub_id}", hidden=hidden, layers=max(2, self.layers // 8),
                       heads=group * kv, kv_heads=kv, intermediate=inter, vocab_rows=vocab_rows,
                       max_positions=2048, bos_token_id=TINY_VOCAB - 2, eos_token_id=TINY_VOCAB - 1)


def _qwen(size: str, coder: bool) -> Shape:
    hub = f"Qwen/Qwen2.5-{'Coder-' if coder else ''}{size}-Instruct"
    return {"0.5B": Shape(hub, 896, 24, 14, 2, 4864, QWEN_ROWS, True),
            "1.5B": Shape(hub, 1536, 28, 12, 2, 8960, QWEN_ROWS, True),
            "7B": Shape(hub, 3584, 28, 28, 4, 18944, 152_064, False)}[size]


@dataclass(frozen=True)
class Preset:
    name: str
    draft: Shape
    target: Shape
    note: str = ""

    @property
    def vocab_size(self) -> int:
        """The shared vocabulary: the runners' columns (rows past it are padding)."""
        return min(self.draft.vocab_rows, self.target.vocab_rows)

    @property
    def hub_ids(self) -> tuple[str, str]:
        return self.draft.hub_id, self.target.hub_id

    def tiny(self) -> "Preset":
        """Scaled-down shapes of the same structure (CPU smoke runs and tests): shared vocabulary
        TINY_VOCAB, a model with padding rows keeps some (1 per 16 of the real ones, at least 1)."""
        def rows(s: Shape) -> int:
            extra = s.vocab_rows - self.vocab_size
            return TINY_VOCAB + (-(-extra // 16) if extra else 0)

        return Preset(f"{self.name}:tiny", self.draft.tiny(rows(self.draft)), self.target.tiny(rows(self.target)),
                      f"tiny shapes of {self.name}")

    def describe(self) -> dict:
        return {"name": self.name, "draft": self.draft.hub_id, "target": self.target.hub_id,
                "vocab_size": self.vocab_size, "draft_rows": self.draft.vocab_rows,
                "target_rows": self.target.vocab_rows}


PRESETS = {p.name: p for p in (
    Preset("default", _qwen("0.5B", True), _qwen("1.5B", True), "the default pair (adaptive-spec fetch-models)"),
    Preset("coder-0.5b-7b", _qwen("0.5B", True), _qwen("7B", True)),
    Preset("qwen-0.5b-7b", _qwen("0.5B", False), _qwen("7B", False)),
    Preset("coder-1.5b-7b", _qwen("1.5B", True), _qwen("7B", True)),
    Preset("qwen-1.5b-7b", _qwen("1.5B", False), _qwen("7B", False)),
)}


def preset(name: str, tiny: bool = False) -> Preset:
    """The preset `name` (its --tiny shapes with tiny=True); a UserError naming the presets otherwise."""
    if name not in PRESETS:
        raise UserError(f"unknown pair preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name].tiny() if tiny else PRESETS[name]


def by_hub_ids(draft: str, target: str) -> Preset | None:
    """The preset of this hub-id pair (None: none has it)."""
    return next((p for p in PRESETS.values() if p.hub_ids == (draft, target)), None)


def build_model(shape: Shape, dtype=None, device=None, seed: int = 0):
    """A random-weight Qwen2ForCausalLM of `shape`, initialised on `device` in `dtype` (default fp32, CPU):
    real tensors from the start, no meta device and no CPU copy of a GPU model."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**shape.config())
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32, attn_implementation="sdpa")
    return model.eval()


def build_pair(p: Preset, dtype=None, device=None, seed: int = 0):
    """(draft, target) random-weight models of preset `p` (different seeds: they disagree as real pairs do)."""
    return build_model(p.draft, dtype, device, seed), build_model(p.target, dtype, device, seed + 1)
