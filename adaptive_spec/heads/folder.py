"""A head folder read without torch, for the typed settings' checks before any model loads: whether a
path holds a trained head, and whether that head reads the draft's hidden states."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def check_head_folder(head: Any, who: str) -> None:
    """A head named by path must be a folder with weights; owner/name may be a hub repo."""
    if head is None or head == "":
        raise ValueError(f"{who} needs a trained acceptance head: pass --head PATH (a folder written by "
                         "`adaptive-spec train`, e.g. checkpoints/qwen-coder-0.5b-d3-wrej6)")
    if not isinstance(head, (str, Path)):
        return  # a head object (Python API, sweeps): checked against the draft when built
    text, p = str(head), Path(head).expanduser()
    looks_like_repo = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if p.is_dir():
        missing = [f for f in ("config.json", "model.safetensors") if not (p / f).is_file()]
        if missing:
            raise ValueError(f"acceptance head folder {head} has no {' or '.join(missing)}; pass a folder written "
                             "by `adaptive-spec train` (or retrain it: its training command is in its README.md)")
    elif not looks_like_repo:
        raise ValueError(f"acceptance head folder {head} does not exist; pass a folder written by `adaptive-spec "
                         "train`")


def head_needs(head: Any) -> frozenset:
    """{"hidden"} where `head` reads the draft's hidden states: a head folder by its config.json (no weights
    read), a head object by its `inputs`; a hub id is checked when it loads."""
    if head is None:
        return frozenset()
    inputs = getattr(head, "inputs", None)
    if inputs is None and isinstance(head, (str, Path)) and (Path(head).expanduser() / "config.json").is_file():
        inputs = json.loads((Path(head).expanduser() / "config.json").read_text()).get("inputs")
    return frozenset() if inputs is None or inputs == "stats" else frozenset({"hidden"})
