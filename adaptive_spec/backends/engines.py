"""The engines a pair runs on: each an `Engine` record (capabilities, quantizations, settings, time model,
loader) that the rest reads instead of comparing names. A third engine is one module with a loader and one
`register(Engine(...))`. Stdlib only, imported by params, so every refusal comes before torch."""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import UserError
from .contract import Loaded
from .quant_names import GGUF_QUANTS, TORCH_DRAFT_QUANTS

# what a policy may need of an engine, and why it would
CAPABILITIES = {
    "hidden": "the draft's hidden states (a hidden-state acceptance head or tree estimator)",
    "tree": "a token-tree pass (the tree and ersd policies; its runners implement contract.TreeRunner)",
    "multi_draft": "several drafts in one batched pass (spectr, batch-sd)",
    "hf_generate": "transformers' own generate (the hf_assisted and hf_prompt_lookup peers)",
}
# the engine CPU users run: the reports' baseline ("x llama.cpp alone") is its target-only row
CPU_BASELINE = "llama.cpp"
# PairParams settings that only some engines read (each engine's record lists its own; `devices` says where
# it runs); the others apply to all
TORCH_PAIR_KEYS = frozenset({"dtype", "kv_cache", "runtime", "fused", "max_cache_len", "cpu_stock", "cpu_pad_rows",
                            "cpu_fp16_rows"})
LLAMA_CPP_PAIR_KEYS = frozenset({"n_ctx"})


@dataclass(frozen=True)
class Engine:
    name: str
    loader: Callable[..., Loaded]  # PairParams -> Loaded (a function that imports the engine when a pair loads)
    capabilities: frozenset = frozenset()
    draft_quants: tuple = ("none",)
    target_quants: tuple = ("none",)
    settings: frozenset = frozenset()  # the engine-specific PairParams settings it reads (TORCH_PAIR_KEYS, ...)
    devices: tuple | None = None  # the devices it runs on (None: any torch device)
    model_files: str = "hf"  # what a model name points at: "hf" (config.json + weights) or "gguf"
    time_model: str = "extended"  # the time model `auto` prices it with (auto/timemodel.py)
    # torch's threads while it decodes (None: as they are): an engine computing on its own threads wants
    # torch, which then only samples, off the cores
    decode_torch_threads: int | None = None
    # () -> None where the engine can run here, else why not (a missing binding)
    unavailable: Callable[[], str | None] | None = None
    description: str = ""

    def check_available(self, device: str | None = None, name: str = "--device") -> None:
        """Refuse, naming the fix, an engine whose runtime is missing here, or a device it cannot reach here
        (`name`: how the user spelled the device setting), before any model loads."""
        why = self.unavailable() if self.unavailable is not None else None
        if why:
            raise UserError(why)
        if self.devices is None:  # a torch device
            check_device(device, name)


_ENGINES: dict[str, Engine] = {}
# a device setting: the default (None, or auto: cuda where a GPU is visible), cpu, cuda or cuda:N
DEVICE_FORM = r"^(auto|cpu|cuda(:[0-9]+)?)$"


def check_device(device: str | None, name: str = "--device") -> None:
    """Refuse a CUDA device this torch cannot reach, naming the fix (torch refuses only when the first weights
    move there). A CPU-only build is read from torch's version file without importing torch."""
    if device is None or not device.startswith("cuda"):
        return
    spell = (lambda v: f"{name} {v}") if name.startswith("--") else (lambda v: f"{name}={v!r}")
    fix = f"install a CUDA build of torch, or run on the CPU with {spell('cpu')}"
    build = _torch_build()
    if build is not None and build[1] is None:
        raise UserError(f"{spell(device)}: this torch ({build[0]}) is a CPU-only build; {fix}")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UserError(f"{spell(device)}: torch {torch.__version__} sees no GPU (no driver loaded, or "
                        "CUDA_VISIBLE_DEVICES hides them); run where a GPU is visible, or on the CPU with "
                        f"{spell('cpu')}")
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise UserError(f"{spell(device)}: torch sees {count} GPU{'s' if count > 1 else ''} "
                        f"(cuda:0..cuda:{count - 1}); pick one of them, or {spell('cpu')}")


def _torch_build() -> tuple[str, str | None] | None:
    """(torch's version, its CUDA or ROCm version, None for a CPU-only build), read from torch/version.py
    without importing torch; None where that file is not found or not understood."""
    spec = importlib.util.find_spec("torch")
    file = Path(spec.origin).parent / "version.py" if spec is not None and spec.origin else None
    text = file.read_text() if file is not None and file.is_file() else ""
    found = dict(re.findall(r"^(__version__|cuda|hip)\b[^=\n]*=\s*(.+?)\s*$", text, re.M))
    if "__version__" not in found or "cuda" not in found:
        return None
    gpu = [v.strip("'\"") for k, v in found.items() if k in ("cuda", "hip") and v != "None"]
    return found["__version__"].strip("'\""), (gpu[0] if gpu else None)


def register(engine: Engine) -> Engine:
    _ENGINES[engine.name] = engine
    return engine


def names() -> tuple[str, ...]:
    return tuple(_ENGINES)


def get(name: str) -> Engine:
    if name not in _ENGINES:
        raise UserError(f"unknown backend {name!r}; valid backends: {', '.join(_ENGINES)}")
    return _ENGINES[name]


def quant_names(role: str) -> tuple[str, ...]:
    """Every engine's quantization names for `role` ("draft" or "target"), "none" first, in registration order."""
    out: dict[str, None] = {}
    for e in _ENGINES.values():
        out.update(dict.fromkeys(e.draft_quants if role == "draft" else e.target_quants))
    return tuple(out)


def engine_settings() -> frozenset:
    """The PairParams settings some engine does not read."""
    return frozenset().union(*(e.settings for e in _ENGINES.values()))


# the loaders import their engine only when a pair loads: params (and so every refusal) stays free of torch
def _load_torch(params) -> Loaded:
    check_device(params.device, "device")  # the Python API's way in (the commands checked it already)
    from . import torch_engine

    return torch_engine.load_pair(params)


def _load_llama_cpp(params) -> Loaded:
    from . import llamacpp_pair

    return llamacpp_pair.load_pair(params)


def _llama_cpp_unavailable() -> str | None:
    from . import llamacpp

    return llamacpp.available()


register(Engine("torch", _load_torch, capabilities=frozenset({"hidden", "tree", "multi_draft", "hf_generate"}),
                draft_quants=("none", *TORCH_DRAFT_QUANTS), settings=TORCH_PAIR_KEYS,
                description="Hugging Face weights, the default pair dequantized to bf16"))
register(Engine(
    "llama.cpp", _load_llama_cpp, draft_quants=("none", *GGUF_QUANTS), target_quants=("none", *GGUF_QUANTS),
    settings=LLAMA_CPP_PAIR_KEYS, devices=("cpu",), model_files="gguf",
    # its pass time is far from linear in its length (its CPU kernels change with the row count: a longer
    # pass can cost less than a shorter one), so the per-length table is the model that fits
    time_model="table",
    # torch only samples and runs the heads there; its OpenMP pool would spin on llama.cpp's cores
    decode_torch_threads=1,
    unavailable=_llama_cpp_unavailable,
    description="the GGUF files as they are, through llama-cpp-python; CPU"))
