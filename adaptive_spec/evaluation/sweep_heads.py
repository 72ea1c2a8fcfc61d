"""The acceptance heads a sweep names: found by label, folder or glob, and loaded (on CPU) and
checked against the draft before any model loads. Part of `adaptive-spec sweep` (sweep.py)."""
from __future__ import annotations

import glob
import json
from pathlib import Path

import torch

from ..backends.paths import resolve_model_path
from ..errors import UserError
from ..heads.head import AcceptanceHead
from ..runs import PROJECT_ROOT


def head_folder(p: Path) -> Path | None:
    if (p / "config.json").is_file():
        return p
    if (p / "head" / "config.json").is_file():  # a training output dir: its exported head
        return p / "head"
    return None


def resolve_heads(patterns: list[str]) -> list[tuple[str, Path]]:
    """(label, folder) per head. A path may be a head folder, a training output dir holding head/, or
    a glob over those (folders without a head are skipped for globs). Relative paths: working
    directory first, then the project root."""
    found: list[Path] = []
    for pat in patterns:
        pat = str(Path(pat).expanduser())
        if glob.has_magic(pat):
            bases = [Path.cwd()] if Path(pat).is_absolute() else [Path.cwd(), PROJECT_ROOT]
            hits: list[Path] = []
            for base in bases:
                hits = [h for h in (head_folder(Path(m)) for m in sorted(glob.glob(str(base / pat)))) if h]
                if hits:
                    break
            if not hits:
                raise UserError(f"no acceptance head folders match {pat!r}; train one with "
                                "`python train.py --config configs/train/default.yaml` or fix the heads list")
            found += hits
            continue
        p = Path(pat)
        cands = [p] if p.is_absolute() else [p, PROJECT_ROOT / p]
        folder = next((h for h in (head_folder(c) for c in cands if c.exists()) if h), None)
        found.append(folder if folder is not None else p)  # a missing one fails in from_pretrained
    found = list(dict.fromkeys(f.resolve() if f.exists() else f for f in found))
    labels = [f.parent.name if f.name == "head" else f.name for f in found]
    if len(set(labels)) != len(labels):  # same folder names: fall back to the full paths
        labels = [str(f) for f in found]
    return list(zip(labels, found))


def find_head_folder(h: str) -> Path | None:
    """The head folder a path names (working directory first, then the project root), or None."""
    p = Path(h).expanduser()
    return next((f for f in map(head_folder, [p] if p.is_absolute() else [p, PROJECT_ROOT / p]) if f), None)


def load_heads(draft: str | None, listed: dict, tree_heads: list[str]) -> tuple[dict, dict]:
    """{label: (AcceptanceHead on CPU, info)} of every head the grid runs, and of those of `heads` alone
    (heads.json's). `listed`: label -> folder of `heads` (resolve_heads); `tree_heads`: the heads the `trees`
    entries name (a label of heads, or a folder, then labelled as written), each checked to be a token head.
    A head trained for another draft than `draft` is refused here, before any model loads."""
    hidden = draft_hidden_size(draft)
    folders = {**listed, **{h: resolve_heads([h])[0][1] for h in tree_heads if h not in listed}}
    heads = {label: _load_head(label, folder, draft, hidden) for label, folder in folders.items()}
    for h in tree_heads:
        feature = getattr(heads[h][0], "feature", "token")
        if feature != "token":
            raise UserError(f"trees: head {h} reads feature={feature}, but the tree estimator scores each drafted "
                            "node from its own hidden state and needs a head trained with feature=token")
    return heads, {label: heads[label] for label in listed}


def _load_head(label: str, folder: Path, draft: str | None, hidden_size: int | None) -> tuple:
    """(the head on CPU, its info: path, depth, w_rej, train/dev metrics, for heads.json and the report)."""
    head = AcceptanceHead.from_pretrained(folder, hidden_size=hidden_size, draft_model=draft, dtype=torch.float32)
    extra = dict(head.extra)
    metrics = extra.pop("metrics", None)
    mfile = Path(folder) / "metrics.json"
    if metrics is None and mfile.is_file():
        try:
            metrics = json.loads(mfile.read_text())
        except json.JSONDecodeError:
            metrics = None
    info = {"label": label, "path": str(folder), "depth": head.depth, "hidden_size": head.hidden_size,
            "draft_model": head.draft_model, "w_rej": extra.get("w_rej"), "step": extra.get("step"),
            "metrics": metrics or {}, "extra": {k: v for k, v in extra.items() if k not in ("w_rej", "step")}}
    return head, info


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
