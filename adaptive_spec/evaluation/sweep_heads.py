"""The acceptance heads a sweep runs (their folders: sweep_grid.py), loaded (on CPU) and checked against the
draft before any model loads. Part of `adaptive-spec sweep` (sweep.py)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..backends.paths import resolve_model_path
from ..errors import UserError
from ..heads.head import AcceptanceHead


def load_heads(draft: str | None, listed: dict, named: dict) -> tuple[dict, dict]:
    """{label: (AcceptanceHead on CPU, info: path, depth, w_rej, train/dev metrics)} of every head the grid runs,
    and of those of `heads` alone (heads.json's). `listed`: label -> folder of `heads`; `named`: the same of the
    heads `trees` entries name (a label of heads, or a folder, then labelled as written), each checked to be a
    token head. A head trained for another draft than `draft` is refused here, before any model loads."""
    hidden, heads = draft_hidden_size(draft), {}
    for label, folder in {**listed, **named}.items():
        head = AcceptanceHead.from_pretrained(folder, hidden_size=hidden, draft_model=draft, dtype=torch.float32)
        if label in named and getattr(head, "feature", "token") != "token":
            raise UserError(f"trees: head {label} reads feature={head.feature}, but the tree estimator scores each "
                            "drafted node from its own hidden state and needs a head trained with feature=token")
        extra = dict(head.extra)
        metrics = extra.pop("metrics", None)
        mfile = Path(folder) / "metrics.json"
        if metrics is None and mfile.is_file():
            try:
                metrics = json.loads(mfile.read_text())
            except json.JSONDecodeError:
                metrics = None
        heads[label] = head, {"label": label, "path": str(folder), "depth": head.depth, "hidden_size": head.hidden_size,
                              "draft_model": head.draft_model, "w_rej": extra.get("w_rej"), "step": extra.get("step"),
                              "metrics": metrics or {},
                              "extra": {k: v for k, v in extra.items() if k not in ("w_rej", "step")}}
    return heads, {k: heads[k] for k in listed}


def draft_hidden_size(draft: str) -> int | None:
    """The draft's hidden size from its config.json when it is a local folder (no weights loaded)."""
    try:
        path = Path(resolve_model_path(draft, "draft", auto_fetch=False))
    except UserError:
        return None
    if not (path / "config.json").is_file():
        return None
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError:
        return None
    h = cfg.get("hidden_size") or (cfg.get("text_config") or {}).get("hidden_size")
    return int(h) if h else None
