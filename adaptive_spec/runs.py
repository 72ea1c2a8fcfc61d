"""Run folders: the files every long job (datagen, sweep, training, benchmarks) keeps on disk, one contract
for each so that a resume behaves the same everywhere: writes that a kill never leaves half done, JSONL
reads that drop (and repair) a torn last line, manifests, tensor shards and the loop that fills a folder of
them, the settings check, and a folder lock."""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from .errors import UserError

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    """Write `data` to `path` through a temp file beside it and a rename (atomic on POSIX)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def write_json(path: str | Path, obj, **dumps_kwargs) -> Path:
    """Atomic JSON file, indented, newline-terminated."""
    dumps_kwargs.setdefault("indent", 2)
    return atomic_write(path, json.dumps(obj, **dumps_kwargs) + "\n")


def append_jsonl(path: str | Path, row: dict):
    """One line per write, flushed and fsynced: an interrupted run loses at most the line in flight."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | Path, repair: bool = False) -> list[dict]:
    """The rows of a JSONL file ([] when it does not exist). A torn last line (no newline: a kill
    mid-write) is dropped, and with `repair` cut from the file so appends start on a fresh line;
    other undecodable lines are skipped. A `<path>.gz` beside it (a finished log committed once,
    compressed) is read first: its rows, then the plain file's, which later appends grow."""
    path = Path(path)
    gz = path.with_name(path.name + ".gz")
    rows = _rows(gzip.decompress(gz.read_bytes())) if gz.is_file() else []
    if not path.is_file():
        return rows
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    if repair and cut < len(data):
        with open(path, "r+b") as f:
            f.truncate(cut)
    return rows + _rows(data[:cut])


def _rows(data: bytes) -> list[dict]:
    rows = []
    for line in data[:data.rfind(b"\n") + 1].decode("utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def read_json(path: str | Path, required: bool = True, hint: str = "") -> dict | None:
    """A JSON file as a dict. Missing: a UserError when `required`, else None. Present but not
    valid JSON: always a UserError (a corrupt file is never mistaken for an absent one)."""
    path = Path(path)
    fix = f"; {hint}" if hint else ""
    if not path.is_file():
        if required:
            raise UserError(f"{path} does not exist{fix}")
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}){fix}") from None


def read_manifest(folder: str | Path, required: bool = True, hint: str = "") -> dict | None:
    """folder/manifest.json (see `read_json` for the contract)."""
    return read_json(Path(folder) / "manifest.json", required, hint)


def settings_problem(folder: str | Path, old: dict, new: dict, kind: str = "run", ignore=()) -> str | None:
    """'<folder> holds a <kind> made with other settings (k: a -> b, ...)', or None when they agree; the keys of
    either dict count, `ignore` left out."""
    keys = sorted((set(old) | set(new)) - set(ignore))
    diff = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    if not diff:
        return None
    return f"{folder} holds a {kind} made with other settings ({', '.join(diff)})"


def check_settings(folder: str | Path, old: dict, new: dict, fix: str, kind: str = "run", ignore=()):
    """Refuse to continue a run in `folder` with settings other than the ones it was made with:
    mixing them would silently corrupt the results. `fix` says what to do instead."""
    problem = settings_problem(folder, old, new, kind, ignore)
    if problem:
        raise UserError(f"{problem}; {fix}")


def save_tensors(path: Path, tensors: dict, key: str, meta: dict) -> Path:
    """A safetensors file written atomically, its folder made, with `meta` in ONE metadata key as sorted JSON:
    safetensors stores the metadata map in hash order, which would break byte-identical reruns with several keys."""
    from safetensors.torch import save  # torch: only the jobs that write tensors load it

    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, save(tensors, metadata={key: json.dumps(meta, sort_keys=True)}))


def tensors_meta(path: str | Path, key: str) -> dict:
    """The metadata `key` of a file written by save_tensors ({} when it has none)."""
    from safetensors import safe_open  # only the jobs that read tensors load it

    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get(key, "{}"))


def fill_shards(folder: Path, todo: list, manifest, stop_after: int = 0, first: bool = False):
    """The loop of a resumable shard folder: yields each job of `todo` (the shards it lacks) for the caller to write
    its shard, rewriting folder/manifest.json from manifest() after each (`first`: before the first too) and at the
    end, so that it lists the shards present. stop_after: stop after that many, as a kill would (for the tests)."""
    folder.mkdir(parents=True, exist_ok=True)
    if first:  # a folder with anything in it is then always recognisable
        write_json(folder / "manifest.json", manifest())
    for i, job in enumerate(todo):
        yield job
        write_json(folder / "manifest.json", manifest())
        if stop_after and i + 1 >= stop_after:
            return
    write_json(folder / "manifest.json", manifest())


def lock_dir(folder: str | Path, what: str = "run"):
    """Hold an exclusive lock on `folder` for this process's lifetime (released at exit, even on a
    kill): two processes appending to one run would duplicate work and, on shared cores, time each
    other's runs. Returns the open lock file (keep a reference), or None without flock (Windows)."""
    if fcntl is None:  # no flock: run unguarded
        return None
    f = open(Path(folder) / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise UserError(f"another {what} (pid {holder}) is writing to {folder}; wait for it to finish or stop it, "
                        "then rerun this command to resume") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


# the checkout (or, installed, site-packages' parent): runs/ and ../shared are found from here
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def project_path(p: str | Path) -> Path:
    """Relative paths are relative to the project root (where runs/ lives), so a job writes to the
    same folder from any working directory; outside a checkout, to the working directory."""
    p = Path(p).expanduser()
    if p.is_absolute():
        return p
    root = PROJECT_ROOT if (PROJECT_ROOT / "pyproject.toml").is_file() else Path.cwd()
    return root / p
