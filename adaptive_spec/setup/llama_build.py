"""Which llama.cpp build this CPU gets, building it once, and refusing a build the CPU cannot run.

llama-cpp-python is source-only on PyPI, so pip compiles llama.cpp here: `-march=native` can die with SIGILL
on a CPU with AMX, the portable default (AVX2) leaves AVX-512 unused, and the binding does not install ggml's
runtime-dispatch libraries. So the instruction sets are named from this CPU's flags, AMX off, and the wheel
is kept under a name listing them, so another kind of machine builds its own.

    python adaptive_spec/setup/llama_build.py            # this CPU's tier, cmake flags and wheel folder
    python adaptive_spec/setup/llama_build.py install    # build (once) and install into this Python
(stdlib only, so set-up runs it as a file before the package's dependencies are installed)"""
from __future__ import annotations

import argparse
import functools
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python, pinned (constraints.txt names the same)
# what llama-cpp-python builds besides the library: nothing (no tools, tests, servers or llava)
BASE_ARGS = ("-DGGML_NATIVE=OFF", "-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF")
# x86 instruction-set switches of ggml and the /proc/cpuinfo flags each needs, in ggml's order
X86_SETS = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    # ggml's AVX512 switch compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)
# never on: the AMX crash above
AMX_OFF = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
# names in llama_print_system_info()'s "CPU : X = 1 | ..." (ggml's switch without GGML_) -> the CPU
# flags that feature needs
SYSTEM_INFO_NEEDS = {name[len("GGML_"):]: need for name, need in X86_SETS} | {
    "SSE3": ("pni",), "SSSE3": ("ssse3",), "AMX_INT8": ("amx_int8",)}


@functools.lru_cache(maxsize=None)
def cpuinfo(field: str) -> str:
    """The value of /proc/cpuinfo's first `field` line ("" off Linux). Here, stdlib only, so set-up can read the
    flags before torch is installed; backends/cpu/machine.py reads the CPU's name the same way."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset:
    """The CPU's feature flags (empty off Linux)."""
    return frozenset(cpuinfo("flags").split())


def x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def enabled_sets(flags: frozenset | set) -> list[str]:
    """ggml's switches this CPU runs; the AVX-512 extensions only on top of AVX-512 itself."""
    on = [name for name, need in X86_SETS if all(f in flags for f in need)]
    if "GGML_AVX512" not in on:
        on = [n for n in on if not n.startswith("GGML_AVX512_")]
    return on


def cmake_args(flags: frozenset | set | None = None) -> str:
    """CMAKE_ARGS for this CPU (or for the flags given): every x86 switch named on or off."""
    if not x86():
        return " ".join(BASE_ARGS)  # other architectures: ggml's own portable defaults
    on = enabled_sets(cpu_flags() if flags is None else flags)
    sets = [f"-D{name}={'ON' if name in on else 'OFF'}" for name, _ in X86_SETS]
    return " ".join((*BASE_ARGS, *sets, *AMX_OFF))


def tier(flags: frozenset | set | None = None) -> str:
    """A short name of the instruction sets a build uses, e.g. 'avx2-avx512-vbmi-vnni-bf16'."""
    if not x86():
        return platform.machine().lower() or "generic"
    on = enabled_sets(cpu_flags() if flags is None else flags)
    if "GGML_AVX2" not in on:
        return "avx" if "GGML_AVX" in on else "sse"
    parts = ["avx2"] + (["avxvnni"] if "GGML_AVX_VNNI" in on else [])
    if "GGML_AVX512" in on:
        parts += ["avx512"] + [n.split("_")[-1].lower() for n in on if n.startswith("GGML_AVX512_")]
    return "-".join(parts)


def install_command() -> str:
    """What a user runs to get the binding built for this CPU."""
    return f"{Path(sys.executable).name} -m adaptive_spec.setup.llama_build install (or `make setup`)"


def missing_instructions(system_info: str, flags: frozenset | set | None = None) -> list[str]:
    """The instruction sets a loaded llama.cpp library was compiled for that this CPU lacks."""
    flags = cpu_flags() if flags is None else flags
    if not flags or not x86():
        return []  # nothing to compare against: trust the build
    cpu_part = system_info.split("CPU :", 1)[1].split("|") if "CPU :" in system_info else []
    built = [m[1] for part in cpu_part if (m := re.match(r"\s*([A-Z0-9_]+) = 1\s*$", part))]
    return [name for name in built if name in SYSTEM_INFO_NEEDS
            and not all(f in flags for f in SYSTEM_INFO_NEEDS[name])]


def cache_dir() -> Path:
    """Root of everything this project caches: `$ADAPTIVE_SPEC_CACHE`, else ~/.cache/adaptive_spec."""
    env = os.environ.get("ADAPTIVE_SPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "adaptive_spec"


def wheel_dir() -> Path:
    return cache_dir() / "wheels" / f"llama-cpp-python-{VERSION}-{tier()}"


def _pip(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env)


def install(constraints: str | None = None, quiet: bool = True) -> Path:
    """Build the wheel for this CPU's tier once (minutes: the one long part of set-up), then install it
    into this Python; a rerun with the same tier installed does nothing."""
    marker = Path(sys.prefix) / f".llama-cpp-python-{VERSION}-{tier()}"
    out = wheel_dir()
    wheels = sorted(out.glob("llama_cpp_python-*.whl"))
    if marker.is_file() and wheels:
        return wheels[-1]
    q = ("-q",) if quiet else ()
    if not wheels:
        print(f"compiling llama.cpp for llama-cpp-python {VERSION} ({tier()}; once per CPU kind, about 5 minutes "
              f"on 2 cores) into {out}", file=sys.stderr, flush=True)
        env = dict(os.environ, CMAKE_ARGS=cmake_args(),
                   CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2)))
        tmp = out.with_name(out.name + ".partial")
        # pip's own wheel cache keys a build by its source alone, not by CMAKE_ARGS: bypass it
        _pip("wheel", *q, "--no-deps", "--no-cache-dir", "-w", str(tmp), f"llama-cpp-python=={VERSION}", env=env)
        tmp.rename(out)  # a build stopped half way leaves only the .partial folder
        wheels = sorted(out.glob("llama_cpp_python-*.whl"))
    cons = ("-c", constraints) if constraints else ()
    _pip("install", *q, *cons, "--force-reinstall", "--no-deps", str(wheels[-1]))
    _pip("install", *q, *cons, str(wheels[-1]))  # its own dependencies, at the pinned versions
    for old in Path(sys.prefix).glob(".llama-cpp-python-*"):
        old.unlink()
    marker.write_text(cmake_args() + "\n")
    return wheels[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="llama-cpp-python built for this CPU (AMX off, instruction sets "
                                             "named from /proc/cpuinfo)")
    ap.add_argument("action", nargs="?", default="show", choices=("show", "tier", "cmake-args", "install"))
    ap.add_argument("-c", "--constraints", help="pip constraints file for the binding's dependencies")
    args = ap.parse_args(argv)
    if args.action == "cmake-args":
        print(cmake_args())
    elif args.action == "tier":
        print(tier())
    elif args.action == "install":
        print(install(args.constraints))
    else:
        print(f"tier: {tier()}\nCMAKE_ARGS: {cmake_args()}\nwheel: {wheel_dir()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
