"""The engines a pair runs on, what each can do, and the one check that a policy runs on one.

An engine builds runners to the runner contract (contract.py: forward with the logits of the last n rows,
rollback, reset, the counters it owns) and has an `Engine` record: the capabilities it offers, its
quantization choices, which settings apply to it, the time model `auto` prices it with, and how to load
a pair on it. Policies declare what they need (`params.PolicyParams.needs`); `params.check_runs_on` matches
the two before any model loads and refuses a mismatch in one line naming what does run. No module outside
backends/ compares an engine's name: they read its record; params.check_runs_on matches a policy
with one. A third engine (an ONNX, MLX or GPU runner)
is one module with a loader and one `register(Engine(...))`; the loader is a plain function that imports
the engine's module when a pair loads.

A leaf: stdlib only, imported by params (so every refusal comes before torch and the weights).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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
TORCH_SETTINGS = frozenset({"dtype", "kv_cache", "runtime", "fused", "max_cache_len", "cpu_stock", "cpu_pad_rows",
                            "cpu_fp16_rows"})
LLAMA_CPP_SETTINGS = frozenset({"n_ctx"})


@dataclass(frozen=True)
class Engine:
    name: str
    loader: Callable[..., Loaded]  # PairParams -> Loaded (a function that imports the engine when a pair loads)
    capabilities: frozenset = frozenset()
    draft_quants: tuple = ("none",)
    target_quants: tuple = ("none",)
    settings: frozenset = frozenset()  # the engine-specific PairParams settings it reads (TORCH_SETTINGS, ...)
    devices: tuple | None = None  # the devices it runs on (None: any torch device)
    model_files: str = "hf"  # what a model name points at: "hf" (config.json + weights) or "gguf"
    time_model: str = "extended"  # the time model `auto` prices it with (decoding/timemodel.py)
    # torch's threads while it decodes (None: as they are): an engine computing on its own threads wants
    # torch, which then only samples, off the cores
    decode_torch_threads: int | None = None
    # () -> None where the engine can run here, else why not (a missing binding)
    unavailable: Callable[[], str | None] | None = None
    description: str = ""

    def load(self, params) -> Loaded:
        return self.loader(params)

    def check_available(self) -> None:
        """Refuse, naming the fix, an engine whose runtime is missing here (before any model loads)."""
        why = self.unavailable() if self.unavailable is not None else None
        if why:
            raise UserError(why)


_ENGINES: dict[str, Engine] = {}


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
    from . import torch_engine

    return torch_engine.load_pair(params)


def _load_llama_cpp(params) -> Loaded:
    from . import llamacpp

    return llamacpp.load_pair(params)


def _llama_cpp_unavailable() -> str | None:
    from . import llamacpp

    return llamacpp.unavailable()


register(Engine(
    "torch", _load_torch,
    capabilities=frozenset({"hidden", "tree", "multi_draft", "hf_generate"}),
    draft_quants=("none", *TORCH_DRAFT_QUANTS), settings=TORCH_SETTINGS,
    description="Hugging Face weights, the default pair dequantized to bf16"))
register(Engine(
    "llama.cpp", _load_llama_cpp,
    capabilities=frozenset(),
    draft_quants=("none", *GGUF_QUANTS), target_quants=("none", *GGUF_QUANTS),
    settings=LLAMA_CPP_SETTINGS, devices=("cpu",), model_files="gguf",
    # its pass time is far from linear in its length (its CPU kernels change at 4 rows: a 4-token pass
    # can cost less than a 3-token one), so the per-length table is the model that fits
    time_model="table",
    # torch only samples and runs the heads there; its OpenMP pool would spin on llama.cpp's cores (one
    # thread: 0-3% faster forwards in three paired runs on a 2-core EPYC, never slower beyond noise)
    decode_torch_threads=1,
    unavailable=_llama_cpp_unavailable,
    description="the GGUF files as they are, through llama-cpp-python; CPU"))
