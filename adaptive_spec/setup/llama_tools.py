"""llama.cpp's own tools (llama-bench, llama-speculative-simple), built once into the cache from the binding's
sdist with its flags, and their outputs read: for the benchmarks that set our engine beside llama.cpp's loop."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from ..errors import get_logger
from .llama_build import VERSION, X86_SETS, cache_dir, cmake_args, tier

log = get_logger(__name__)

TOOLS = ("llama-bench", "llama-speculative-simple")


def tool_flags(cpu_flags=None) -> list[str]:
    """The binding's flags (llama_build.cmake_args()) minus what only the Python package knows, plus the tools."""
    return [a for a in cmake_args(cpu_flags).split() if "LLAVA" not in a and "EXAMPLES" not in a and "TOOLS" not in a] + [
        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DCMAKE_BUILD_TYPE=Release"]


def run(cmd: list[str], timeout: float = 3600) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return p.stdout + p.stderr


def build(threads: int, cpu_flags=None, tools=TOOLS) -> Path:
    """llama.cpp's tools, built once into the cache from the llama-cpp-python sdist (pip download),
    for this CPU's instruction sets or for those `cpu_flags` (a subset of them) give."""
    root = cache_dir() / "llama.cpp" / f"llama-cpp-python-{VERSION}"
    bins = root / f"build-{tier(cpu_flags)}" / "bin"
    if all((bins / t).is_file() for t in tools):
        return bins
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file():
        sdist_dir = root / "sdist"
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(sdist_dir),
             f"llama-cpp-python=={VERSION}"])
        sdist = next(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tf:
            tf.extractall(root / "unpacked", filter="data")
        (root / "unpacked" / sdist.name[:-len(".tar.gz")] / "vendor" / "llama.cpp").rename(src)
    log.info(f"building {', '.join(tools)} from llama-cpp-python {VERSION}'s llama.cpp for {tier(cpu_flags)} (once)")
    run(["cmake", "-S", str(src), "-B", str(bins.parent), *tool_flags(cpu_flags)])
    run(["cmake", "--build", str(bins.parent), f"-j{threads}", "--target", *tools])
    return bins


def build_flags(bins: Path) -> str:
    cache = (bins.parent / "CMakeCache.txt").read_text()
    on = [m[1] for m in re.finditer(r"^(GGML_[A-Z0-9_]+):BOOL=ON$", cache, re.M)
          if m[1] in {name for name, _ in X86_SETS} | {"GGML_NATIVE", "GGML_AMX_INT8", "GGML_OPENMP"}]
    return ("ggml build flags on: " + (", ".join(on) or "none")
            + f" (GGML_NATIVE and AMX off; tier {tier()}: this CPU's instruction sets, the binding's too)")


def bench_tg(bins: Path, gguf: Path, n: int, depth: int, threads: int, reps: int = 5) -> float:
    """llama-bench tg: tokens/s generating n tokens after `depth` tokens of context (its mean over reps)."""
    out = run([str(bins / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(n), "-d", str(depth),
               "-t", str(threads), "-r", str(reps), "-o", "json"])
    return float(json.loads(out[out.index("["): out.rindex("]") + 1])[0]["avg_ts"])


def spec_example(bins: Path, target: Path, draft: Path | None, text: str, n: int, k: int | None, threads: int,
                 spec_type: str = "draft-simple") -> dict:
    """llama.cpp's speculative example, greedy (its acceptance rule is greedy matching): decode tokens/s
    (prefill left out, its 'decoded' line) and acceptance. `spec_type` ngram-simple drafts by prompt
    lookup, without a draft model, at its own defaults where `k` is None."""
    cmd = [str(bins / "llama-speculative-simple"), "-m", str(target), "-p", text, "-n", str(n), "--temp", "0",
           "--top-k", "1", "--seed", "0", "-t", str(threads), "--spec-type", spec_type, "-c", "4096"]
    if draft is not None:
        cmd += ["-md", str(draft), "-td", str(threads)]
    if k is not None:
        cmd += ["--spec-draft-n-max", str(k)]
    out = run(cmd)
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", out)
    drafted, accepted = re.search(r"n_drafted = (\d+)", out), re.search(r"n_accept\s+= (\d+)", out)
    if not dec:
        raise SystemExit(f"could not read llama-speculative-simple's timing:\n{out[-2000:]}")
    n_tok, s = int(dec[1]), float(dec[2])
    return {"n_tokens": n_tok, "decode_s": s, "decode_tok_s": n_tok / s,
            "acceptance": int(accepted[1]) / max(int(drafted[1]), 1) if drafted and accepted else None}
