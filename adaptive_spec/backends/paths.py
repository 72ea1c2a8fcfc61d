"""What a user names, resolved without torch (params' checks run before the weights load): a model, a
`--draft` that names a feature drafter, and a `--draft-vocab` spec."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

FEATURE = "feature:"


@dataclass(frozen=True)
class FeatureDraft:
    """`--draft feature:PATH`: a feature drafter (drafter/) where a draft model would be; it reads the target's
    own hidden states, so it loads with the target (drafter/source.py). `path`: its folder or hub id."""

    path: str

    def __str__(self) -> str:
        return FEATURE + self.path


def parse_draft(name: str) -> "str | FeatureDraft | None":
    """`--draft` typed: None for none (the target alone), a FeatureDraft for feature:PATH, any other name as it is."""
    if name.lower() == "none":
        return None
    if not name.startswith(FEATURE):
        return name
    if name == FEATURE:
        raise ValueError("--draft feature: needs the drafter's folder or hub id, e.g. --draft feature:runs/drafter/"
                         "quick/drafter")
    return FeatureDraft(name[len(FEATURE):])


def split_draft_config(spec: str) -> tuple[str, str | None]:
    """A draft configuration QUANT[:VOCAB] (a sweep's `drafts` entry, the benchmarks' --drafts) ->
    (draft_quant, draft_vocab): "none" | "int8" | "int8:32768" | "none:32768"."""
    quant, _, vocab = spec.partition(":")
    return quant or "none", vocab or None


def parse_draft_vocab(spec) -> tuple[str, int | None] | None:
    """`--draft-vocab` split into (FILE or "", N or None); None means the whole vocabulary.
    "N" -> ("", N), "FILE" -> (FILE, None), "FILE:N" -> (FILE, N). Bounds are checked by the callers."""
    if spec in (None, "", "none", "full"):
        return None
    spec = str(spec).strip()
    path, _, n = spec.rpartition(":")
    if not n.lstrip("-").isdigit():
        path, n = spec, ""
    return path, int(n) if n else None


def check_draft_vocab_spec(spec: str) -> None:
    """N must be a positive count; a FILE must exist (a ValueError: the typed settings' validators raise it)."""
    parsed = parse_draft_vocab(spec)
    if parsed is None:  # full / none: the whole vocabulary
        return
    path, n = parsed
    if n is not None and n < 1:
        raise ValueError(f"--draft-vocab must be a token count >= 1 or a token-list file, got {spec}")
    if path and not Path(path).is_file():
        raise ValueError(f"--draft-vocab file {path} does not exist; build one with `adaptive-spec draft-vocab`")


def resolve_model_path(name: str | None, role: str, auto_fetch: bool = True) -> str:
    """A user's model name as `from_pretrained` takes it: the default pair's folder (fetched on first use when
    auto_fetch), an existing folder, or a hub id."""
    if name in (None, "", "default"):
        from ..setup import fetch, pair  # only to build the default pair: keeps the download code off the generation path

        paths = pair.default_pair_paths()
        if not pair.is_fetched(role):
            if not auto_fetch:
                raise UserError(f"the default {role} model is not fetched yet; run `adaptive-spec fetch-models`")
            fetch.fetch_default_pair(roles=[role])
        return str(paths[role])
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise UserError(f"{role} model folder {p} has no config.json; point --{role} at a folder "
                            "saved with save_pretrained, or at a hub id")
        return str(p)
    # a hub id is "name" or "org/name"; anything else that does not exist is a missing folder
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise UserError(f"{role} model path {name} does not exist; pass an existing folder or a hub id "
                        "such as Qwen/Qwen2.5-Coder-0.5B-Instruct")
    return name


def file_fingerprint(path: str | Path) -> str:
    """Name, size and the first MiB of a file: instant, and enough to tell two GGUFs apart."""
    path = Path(path)
    h = hashlib.sha256(f"{path.name}:{path.stat().st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]
