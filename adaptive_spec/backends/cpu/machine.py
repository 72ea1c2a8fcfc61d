"""What this CPU can do, and which numeric path each model runs on it: bf16 where oneDNN runs it natively,
else fp32 (docs/cpu-runtime.md says why). `describe()` is the machine every benchmark row records."""
from __future__ import annotations

import functools
import platform
import warnings

import torch

from ...errors import first_line
from ...setup.llama_build import cpu_flags, cpuinfo  # /proc/cpuinfo read in the stdlib-only set-up module

# the flags that decide a kernel; the rest of /proc/cpuinfo says nothing about our paths
KEY_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512_bf16", "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8")


def cpu_name() -> str:
    return cpuinfo("model name") or platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def onednn_packed(dtype: torch.dtype) -> str | None:
    """None when oneDNN's pre-packed linear runs in `dtype` on this CPU, else why not. Probed, not inferred from
    flags: the kernel's own check is the authority, and a torch build may lack oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    try:
        w = torch.zeros(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 8, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError as e:
        return first_line(e)
    return None


@functools.lru_cache(maxsize=None)
def fbgemm_fp16() -> str | None:
    """None when FBGEMM's fp16-weight, fp32-activation linear runs on this CPU, else why not (torch marks the op
    deprecated; where a build drops it, oneDNN alone runs)."""
    if not hasattr(torch, "fbgemm_linear_fp16_weight_fp32_activation"):
        return "this torch build has no torch.fbgemm_linear_fp16_weight_fp32_activation"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            w = torch.fbgemm_pack_gemm_matrix_fp16(torch.ones(8, 8))
            torch.fbgemm_linear_fp16_weight_fp32_activation(torch.ones(2, 8), w, torch.zeros(8))
    except RuntimeError as e:
        return first_line(e)
    return None


def native_bf16() -> bool:
    """bf16 matrix products run at full speed: oneDNN's packed bf16 path is available."""
    return onednn_packed(torch.bfloat16) is None


def auto_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 on accelerators and on CPUs with native bf16 kernels; fp32 on the others (AVX2)."""
    if torch.device(device).type != "cpu" or native_bf16():
        return torch.bfloat16
    return torch.float32


def describe() -> dict:
    """The machine facts every benchmark table and result row carries."""
    flags = cpu_flags()
    return {"cpu": cpu_name(), "isa": torch.backends.cpu.get_cpu_capability(),
            "cpu_flags": " ".join(f for f in KEY_FLAGS if f in flags),
            "bf16_kernels": "native" if native_bf16() else "none (" + (onednn_packed(torch.bfloat16) or "") + ")",
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def flags_line() -> str:
    """One line for the top of a benchmark table."""
    d = describe()
    return (f"CPU: {d['cpu']} | ISA {d['isa']} | flags: {d['cpu_flags'] or '-'} | bf16 kernels: "
            f"{d['bf16_kernels']} | {d['threads']} threads | torch {d['torch']}")
