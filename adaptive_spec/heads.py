"""The acceptance prediction head of SpecDec++ (paper section 4.3, 5.1).

A (D+1)-layer ResNet with SiLU on the draft's final hidden state e_i of a candidate token Y_i:
D residual blocks x + SiLU(W_d x + b_d), then a linear layer to one logit. sigmoid(logit)
predicts P(Y_i accepted | Y_1..Y_{i-1} accepted), i.e. min(1, p(Y_i)/q(Y_i)) in expectation.
D = 0 is a single linear layer. The paper sweeps D in 0..4 and picks D = 3 or 4.

Which hidden state the head reads (`feature`):
  token    e_i, the state at y_i's own position (the paper's setting). It exists only once y_i
           has been fed to the draft, so in decoding the score of y_i arrives one step late.
  context  e_{i-1}, the state that produced q_i. It scores y_i before y_i is fed (in expectation
           over y_i ~ q_i), so a round may stop after its first candidate (K = 1): on hardware
           where a draft step is not cheap relative to a target pass, that is often the best K.

A saved head is a folder with config.json (sizes, the draft it was trained on, training
metadata) and model.safetensors. The draft is part of the contract: the head reads that
draft's hidden states, so loading checks the hidden size and refuses a mismatch.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .errors import UserError

HEAD_FORMAT = "adaptive_spec.head.v1"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MAX_DEPTH = 4
FEATURES = ("token", "context")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class AcceptanceHead(nn.Module):
    def __init__(self, hidden_size: int, depth: int = 3, draft_model: str | None = None,
                 draft_fingerprint: str | None = None, feature: str = "token"):
        super().__init__()
        if feature not in FEATURES:
            raise UserError(f"head feature must be one of {', '.join(FEATURES)}, got {feature!r}")
        if not (isinstance(depth, int) and 0 <= depth <= MAX_DEPTH):
            raise UserError(f"head depth must be an integer in 0..{MAX_DEPTH}, got {depth!r}")
        if not (isinstance(hidden_size, int) and hidden_size > 0):
            raise UserError(f"head hidden_size must be a positive integer, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.depth = depth
        self.draft_model = draft_model
        self.draft_fingerprint = draft_fingerprint
        self.feature = feature
        self.extra: dict = {}  # training metadata read back by from_pretrained
        # A list comprehension, not [ResBlock(h)] * depth: each block needs its own weights.
        self.blocks = nn.ModuleList([ResBlock(hidden_size) for _ in range(depth)])
        self.out = nn.Linear(hidden_size, 1)

    @property
    def dtype(self) -> torch.dtype:
        return self.out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.out.weight.device

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> acceptance logits [...]."""
        x = h.to(self.out.weight.dtype)
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1)

    def acceptance_prob(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self(h))

    def config_dict(self, extra: dict | None = None) -> dict:
        core = {"format": HEAD_FORMAT, "hidden_size": self.hidden_size, "depth": self.depth,
                "draft_model": self.draft_model, "draft_fingerprint": self.draft_fingerprint,
                "feature": self.feature}
        return {**(extra or {}), **core}  # metadata never overrides the fields loading relies on

    def save_pretrained(self, path: str | Path, extra: dict | None = None) -> Path:
        """Write config.json + model.safetensors; each file is written whole or not at all."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        tmp = path / (WEIGHTS_NAME + ".tmp")
        save_file(state, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path / WEIGHTS_NAME)
        tmp = path / (CONFIG_NAME + ".tmp")
        tmp.write_text(json.dumps(self.config_dict(extra), indent=2, default=str) + "\n")
        os.replace(tmp, path / CONFIG_NAME)
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path, hidden_size: int | None = None, draft_model: str | None = None,
                        device=None, dtype=None) -> "AcceptanceHead":
        """Load a head saved by save_pretrained; `hidden_size` (the draft in use) is checked against it."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path).expanduser()
        fix = "train one with `python train.py --config configs/train/default.yaml` or pass its folder"
        if not path.is_dir():
            raise UserError(f"acceptance head folder {path} does not exist; {fix}")
        cfg_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
        for f in (cfg_file, weights_file):
            if not f.is_file():
                raise UserError(f"acceptance head folder {path} has no {f.name}; it is not a saved head "
                                f"(or its export was interrupted); {fix}")
        try:
            cfg = json.loads(cfg_file.read_text())
            h, depth = int(cfg["hidden_size"]), int(cfg["depth"])
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{cfg_file} is corrupt ({type(e).__name__}: {e}); re-export the head, {fix}") from None
        trained_for = cfg.get("draft_model")
        if hidden_size is not None and int(hidden_size) != h:
            in_use = f" '{draft_model}'" if draft_model else ""
            raise UserError(
                f"head at {path} was trained for draft model '{trained_for}' (hidden size {h}) but the draft in "
                f"use{in_use} has hidden size {hidden_size}; pass the draft it was trained for or train a head "
                "for this draft")
        feature = cfg.get("feature", "token")  # heads saved before `feature` existed are token heads
        if feature not in FEATURES:
            raise UserError(f"{cfg_file} names feature {feature!r}; expected one of {', '.join(FEATURES)}. {fix}")
        head = cls(h, depth, draft_model=trained_for, draft_fingerprint=cfg.get("draft_fingerprint"), feature=feature)
        try:
            state = load_file(str(weights_file))
            head.load_state_dict(state, strict=True)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{weights_file} is corrupt or does not match config.json ({first}); "
                            f"re-export the head, {fix}") from None
        core = set(head.config_dict())
        head.extra = {k: v for k, v in cfg.items() if k not in core}
        head.to(device=device, dtype=dtype if dtype is None or isinstance(dtype, torch.dtype) else _dtype(dtype))
        return head.eval()


def _dtype(name: str) -> torch.dtype:
    from .models import resolve_dtype

    return resolve_dtype(name)


def load_head(head, hidden_size: int | None = None, draft_model: str | None = None, device=None,
              dtype=torch.float32, feature: str | None = None, why: str = "the learned policy"):
    """The one way to get a head for decoding: an AcceptanceHead (or anything with
    `acceptance_prob`) is returned as is; a folder (or hub id) is loaded and checked against the
    draft in use (`hidden_size`). `feature`: refuse a head that reads another feature; `why`
    names who asked, for the error."""
    if head is None or head == "":
        raise UserError(f"{why} needs a trained acceptance head: pass --head PATH (a folder written by "
                        "`adaptive-spec train`, e.g. checkpoints/qwen-coder-0.5b-d3-wrej6)")
    if not hasattr(head, "acceptance_prob"):
        head = AcceptanceHead.from_pretrained(head, hidden_size=hidden_size, draft_model=draft_model,
                                              device=device, dtype=dtype)
    got = getattr(head, "feature", "token")
    if feature is not None and got != feature:
        raise UserError(f"{why} needs a head trained with feature={feature}; this one reads feature={got}")
    return head.eval() if hasattr(head, "eval") else head
