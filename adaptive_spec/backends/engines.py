"""The engines a pair runs on, what each can do, and the one check that a policy runs on one.

An engine is a runner with the `models.CausalLM` interface (forward with the logits of the last n rows,
rollback, reset, the counters it owns) plus an `Engine` record: the capabilities it offers, its
quantization choices, which settings apply to it, the time model `auto` prices it with, and how to load
a pair on it. Policies declare what they need (`params.PolicyParams.needs`); `params.check_runs_on` matches
the two before any model loads and refuses a mismatch in one line naming what does run. No module outside
backends/ compares an engine's name: they read its record; params.check_runs_on matches a policy
with one. A third engine (an ONNX, MLX or GPU runner)
is one module with a loader and one `register(Engine(...))`.

A leaf: stdlib only, imported by params (so every refusal comes before torch and the weights).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import UserError

# what a policy may need of an engine, and why it would
CAPABILITIES = {
    "hidden": "the draft's hidden states (a hidden-state acceptance head or tree estimator)",
    "tree": "a token-tree pass (the tree and ersd policies)",
    "multi_draft": "several drafts in one batched pass (spectr, batch-sd)",
    "hf_generate": "transformers' own generate (the hf_assisted and hf_prompt_lookup peers)",
}
# llama.cpp's re-quantizations of a GGUF file (llamacpp.GGUF_QUANTS says what each one is, and why)
GGUF_QUANTS = ("q4_0", "q8_0", "q4_0-pure", "q4_k-pure", "iq4_nl-pure")
# the engine CPU users run: the reports' baseline ("x llama.cpp alone") is its target-only row
CPU_BASELINE = "llama.cpp"


@dataclass
class Loaded:
    """What an engine's loader gives: the two runners (draft None: the target alone), the tokenizer
    prompts are encoded with, the ids that end a response, and the draft configuration a head's
    warning and the cost cache compare against."""

    target: Any
    draft: Any
    tokenizer: Any
    eos_token_ids: list
    draft_config: dict


@dataclass(frozen=True)
class Engine:
    name: str
    # PairParams -> Loaded: a callable, or "module:function" (imported only when a pair loads)
    loader: str | Callable[..., Any]
    capabilities: frozenset = frozenset()
    draft_quants: tuple = ("none",)
    target_quants: tuple = ("none",)
    torch_settings: bool = True  # dtype, kv_cache, runtime, max_cache_len, device apply to it
    context_setting: bool = False  # n_ctx (--n-ctx) sets its context
    time_model: str = "extended"  # the time model `auto` prices it with (decoding/timemodel.py)
    # torch's threads while it decodes (None: as they are): an engine computing on its own threads wants
    # torch, which then only samples, off the cores
    decode_torch_threads: int | None = None
    # "module:function" returning None where the engine can run here, else why not (a missing binding)
    available: str | None = None
    description: str = ""

    def load(self, params) -> Loaded:
        loader = self.loader
        if isinstance(loader, str):
            module, _, fn = loader.partition(":")
            loader = getattr(importlib.import_module(module), fn)
        return loader(params)

    def check_available(self) -> None:
        """Refuse, naming the fix, an engine whose runtime is missing here (before any model loads)."""
        if self.available:
            module, _, fn = self.available.partition(":")
            why = getattr(importlib.import_module(module), fn)()
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


register(Engine(
    "torch", "adaptive_spec.backends.torch_engine:load_pair",
    capabilities=frozenset({"hidden", "tree", "multi_draft", "hf_generate"}),
    draft_quants=("none", "int8", "int4"),
    description="Hugging Face weights (the default pair dequantized to bf16)"))
register(Engine(
    "llama.cpp", "adaptive_spec.backends.llamacpp:load_pair",
    capabilities=frozenset(),
    draft_quants=("none", *GGUF_QUANTS), target_quants=("none", *GGUF_QUANTS),
    torch_settings=False, context_setting=True,
    # its pass time is far from linear in its length (its CPU kernels change at 4 rows: a 4-token pass
    # can cost less than a 3-token one), so the per-length table is the model that fits
    time_model="table",
    # torch only samples and runs the heads there; its OpenMP pool would spin on llama.cpp's cores (one
    # thread: 0-3% faster forwards in three paired runs on a 2-core EPYC, never slower beyond noise)
    decode_torch_threads=1,
    available="adaptive_spec.backends.llamacpp:unavailable",
    description="the GGUF files as they are, through llama-cpp-python; CPU"))
