"""The feature drafter (EAGLE, Li et al. 2024): one decoder layer of the target's architecture that reads the
target's own hidden states.

At position t it reads f_t, the target's final hidden state there (after its final norm: what the LM head
reads), and e_{t+1}, the target's embedding of the next token; a linear layer maps [e_{t+1}, f_t] (2H) to H,
the decoder layer (with its own KV cache) runs on that, and the target's final norm turns its output into
f^_{t+1}, a prediction of f_{t+1}. The target's LM head reads f^_{t+1} as it would read f_{t+1}: the next
token's distribution. Drafting feeds f^ back in place of the f the target has not computed yet.

Only the linear layer and the decoder layer are the drafter's own weights; the embedding, the final norm and
the LM head are the target's, frozen and shared (`Readout`). A saved drafter is a folder (or a hub repo) with
config.json (the one-layer config, the target it was trained on, training metadata) and model.safetensors;
hub.HubModel (huggingface_hub's PyTorchModelHubMixin) gives `from_pretrained` by folder or hub id and
`push_to_hub`, as for the acceptance heads (heads/head.py).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError, first_line
from ..hub import CONFIG_NAME, HubModel

DRAFTER_FORMAT = "adaptive_spec.drafter.v1"


def layer_config(target_config, intermediate_size: int | None = None):
    """The target's config cut to one decoder layer; no vocabulary of its own (the target's embedding and LM
    head are used), so no 150k-row matrix is allocated for it. `intermediate_size`: the layer's MLP width
    (None or 0: the target's); a narrower MLP is what keeps a committed drafter small."""
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = 1
    if intermediate_size:
        if not hasattr(cfg, "intermediate_size"):
            raise UserError(f"the target's architecture ({cfg.model_type}) has no intermediate_size; drop "
                            "intermediate_size from the drafter config")
        cfg.intermediate_size = int(intermediate_size)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[-1:])
    cfg.vocab_size = 1
    cfg.pad_token_id = cfg.bos_token_id = cfg.eos_token_id = None
    cfg.tie_word_embeddings = False
    return cfg


class FeatureDrafter(nn.Module, HubModel, library_name="adaptive-spec",
                     tags=["speculative-decoding", "eagle"], paper_url="https://arxiv.org/abs/2401.15077"):
    _NAME = "feature drafter"
    _SAVED = "feature drafter"
    _NO_WEIGHTS = "{} has no {}; it is not a saved feature drafter; "
    _REEXPORT = ""
    _FIX = ("train one with `accelerate launch train.py --config configs/train/drafter_quick.yaml` or pass its "
            "folder or hub id")
    _ANCHOR = "fc"

    def __init__(self, layer_config: dict, target_model: str | None = None, target_fingerprint: str | None = None):
        from transformers import AutoConfig, AutoModel  # heavy: the model registry

        super().__init__()
        conf = dict(layer_config)
        try:
            cfg = AutoConfig.for_model(conf.pop("model_type"), **conf)
        except (KeyError, ValueError) as e:
            raise UserError(f"drafter layer_config names no known architecture ({first_line(e)}); {self._FIX}") from None
        self.config_obj = cfg
        self.hidden_size = cfg.hidden_size
        self.target_model = target_model
        self.target_fingerprint = target_fingerprint
        self.extra: dict = {}  # training metadata read back by from_pretrained
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.base = AutoModel.from_config(cfg)
        # inputs arrive as embeddings and the target's final norm reads the output: the base's own are unused
        self.base.embed_tokens = nn.Identity()
        self.base.norm = nn.Identity()

    @classmethod
    def for_target(cls, target_model, init_from_target: bool = True, name: str | None = None,
                   fingerprint: str | None = None, intermediate_size: int | None = None) -> "FeatureDrafter":
        """A new drafter for a Hugging Face causal LM; its layer starts as a copy of the target's last one (the
        fc then only has to learn the input map, and training starts near the target). With a narrower MLP
        (`intermediate_size`) the MLP keeps the target's first `intermediate_size` neurons (the first rows of
        its gate and up projections, the first columns of its down projection): a sum over fewer neurons, a
        start closer to the target's layer than a random MLP. Any other tensor whose shape differs stays
        random."""
        cfg = layer_config(target_model.config, intermediate_size)
        d = cls(cfg.to_dict(), target_model=name or getattr(target_model, "name_or_path", None),
                target_fingerprint=fingerprint)
        if init_from_target:
            own = d.base.layers[0].state_dict()
            last = {k: _leading_block(v.detach().float(), own[k].shape)
                    for k, v in target_model.base_model.layers[-1].state_dict().items() if k in own}
            d.base.layers[0].load_state_dict({k: v for k, v in last.items() if v is not None}, strict=False)
            with torch.no_grad():  # the layer's input starts as e_{t+1} + f_t, a residual stream it can read
                H = cfg.hidden_size
                d.fc.weight.copy_(torch.cat([torch.eye(H), torch.eye(H)], 1))
                d.fc.bias.zero_()
        p = next(target_model.parameters())
        return d.to(device=p.device, dtype=p.dtype)

    def forward(self, feats: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor, cache=None,
                use_cache: bool = False, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """feats, embeds [B, T, H] (f_t and e_{t+1}), position_ids [B, T] -> the layer's output [B, T, H],
        before the target's final norm (Readout.feature turns it into f^_{t+1}). attention_mask: causal when
        None, else [B, 1, T, cached + T] bool, True where a row may attend a key (datagen's simulated rounds)."""
        from ..backends.runner import model_kv

        x = self.fc(torch.cat([embeds, feats], -1).to(self.dtype))
        kw = model_kv(self.base, cache) if cache is not None else {}
        if attention_mask is not None:
            kw["attention_mask"] = attention_mask
        out = self.base(inputs_embeds=x, position_ids=position_ids, use_cache=use_cache, **kw)
        return out.last_hidden_state

    def config_dict(self, extra: dict | None = None) -> dict:
        core = {"format": DRAFTER_FORMAT, "layer_config": self.config_obj.to_dict(), "hidden_size": self.hidden_size,
                "target_model": self.target_model, "target_fingerprint": self.target_fingerprint}
        return {**(extra or {}), **core}

    def save_pretrained(self, save_directory: str | Path, extra: dict | None = None, dtype: torch.dtype | None = None,
                        **kwargs) -> Path:
        """HubModel.save_pretrained; `dtype`: the weights' dtype on disk (None: as they are; the training export
        writes bf16, half the bytes of fp32, which is what drafting runs in on a bf16 target anyway)."""
        self._save_dtype = dtype
        return super().save_pretrained(save_directory, extra, **kwargs)

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, hidden_size: int | None = None, device=None, dtype=None,
                        **hub_kwargs) -> "FeatureDrafter":
        """A drafter from a local folder or a hub repo id; `hidden_size`: the target in use (a drafter trained
        for another is refused naming both)."""
        return cls._load(name_or_path, device, dtype, hub_kwargs, target_hidden_size=hidden_size)

    @classmethod
    def _from_config(cls, config: dict | None, where: str, target_hidden_size: int | None = None) -> "FeatureDrafter":
        if not config or config.get("format") != DRAFTER_FORMAT:
            raise UserError(f"{where} is not a saved feature drafter (its {CONFIG_NAME} is missing or has no format "
                            f"{DRAFTER_FORMAT!r}); {cls._FIX}")
        h = int(config["hidden_size"])
        if target_hidden_size is not None and int(target_hidden_size) != h:
            raise UserError(f"feature drafter {where} was trained for target '{config.get('target_model')}' (hidden "
                            f"size {h}) but the target in use has hidden size {target_hidden_size}; pass the target it "
                            "was trained for or train a drafter for this target")
        return cls(config["layer_config"], config.get("target_model"), config.get("target_fingerprint"))


@torch.no_grad()
def head_rows(lm_head, kept: torch.Tensor, hidden_size: int, chunk: int = 256) -> torch.Tensor:
    """The LM head's weight rows at `kept`. A packed CPU layer (backends/cpu/packed.py) may have released its
    weight: it gives the rows back through itself, since the identity times W reads every weight exactly (one
    nonzero term per output, whatever the kernel's accumulation)."""
    w = lm_head.weight
    if w.numel():
        return w.detach()[kept].contiguous()
    eye = torch.eye(hidden_size, dtype=w.dtype, device=w.device)
    bias = getattr(lm_head, "bias", None)
    cols = [lm_head(eye[i:i + chunk])[:, kept] for i in range(0, hidden_size, chunk)]  # W[kept, i:i+chunk]^T
    rows = torch.cat(cols, 0).t()
    return (rows - bias[kept, None] if bias is not None else rows).contiguous()


class Readout(nn.Module):
    """The target's embedding, final norm and LM head, frozen and shared: what the drafter reads its tokens
    through and writes its states into. `kept_ids`: a reduced draft vocabulary (logits of every other id are
    -inf, so q = 0 there and verification's residual reaches them: exact)."""

    def __init__(self, target_model, vocab_size: int | None = None, kept_ids: torch.Tensor | None = None):
        super().__init__()
        self.embed = target_model.get_input_embeddings()
        self.norm = target_model.base_model.norm
        self.lm_head = target_model.get_output_embeddings()
        self.softcap = getattr(target_model.config, "final_logit_softcapping", None)
        self.vocab_size = vocab_size or self.lm_head.out_features
        self.dtype = self.embed.weight.dtype  # the LM head's (a packed CPU layer may hold no .weight)
        self.kept_ids = None
        self.weight = None
        if kept_ids is not None:
            w = getattr(self.lm_head, "weight", None)
            if w is None:
                raise UserError("a reduced draft vocabulary needs the target's LM head weights; load the target with "
                                "stock CPU kernels (--cpu-stock) or drop --draft-vocab")
            self.kept_ids = kept_ids[kept_ids < self.vocab_size].to(w.device)
            self.weight = head_rows(self.lm_head, self.kept_ids, target_model.config.hidden_size)
        for p in self.parameters():
            p.requires_grad_(False)

    def feature(self, out: torch.Tensor) -> torch.Tensor:
        """The drafter's layer output -> f^, in the space of the target's final hidden states."""
        return self.norm(out.float())  # float32 in: the norm computes and returns float32

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> float32 logits over the pair's vocabulary."""
        if self.weight is not None:
            from ..backends.runner import spread_kept_logits

            return spread_kept_logits(self.kept_logits(f), self.kept_ids, self.vocab_size)
        return self.full_logits(f)

    def kept_logits(self, f: torch.Tensor) -> torch.Tensor:
        """float32 logits of the kept ids alone (column j = kept_ids[j]): the reduced vocabulary's rows only."""
        return F.linear(f.to(self.weight.dtype), self.weight).float()

    def full_logits(self, f: torch.Tensor) -> torch.Tensor:
        """float32 logits over the whole vocabulary, whatever is kept."""
        out = self.lm_head(f.to(self.dtype)).float()
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out[..., : self.vocab_size]


def _leading_block(t: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """t's leading block of `shape` (its first rows/columns), or None where t is smaller along some axis."""
    if t.dim() != len(shape) or any(a < b for a, b in zip(t.shape, shape)):
        return None
    return t[tuple(slice(0, n) for n in shape)].clone()
