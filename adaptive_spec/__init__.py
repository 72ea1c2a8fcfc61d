"""adaptive_spec: exact speculative decoding with trainable adaptive drafting (SpecDec++).

Data flows one way: prompts -> datagen -> training -> acceptance head -> decoder -> sweep -> report.

The public names load on first use (PEP 562), so `import adaptive_spec.params` (every check the
command line runs before a model loads) does not import torch."""
from __future__ import annotations

import importlib

_WHERE = {
    "CausalLM": "backends.models", "load_model": "backends.models",
    "AcceptanceHead": "heads.head", "load_head": "heads.head",
    "Decoder": "decoding.decoder", "Generation": "decoding.decoder", "Metrics": "decoding.decoder",
    "DraftStep": "decoding.interfaces", "RoundOwner": "decoding.interfaces", "RoundState": "decoding.interfaces",
    "StopPolicy": "decoding.interfaces", "register": "decoding.interfaces",
    "SpecPair": "decoding.pipeline", "make_policy": "decoding.pipeline", "policy_names": "decoding.pipeline",
    "NgramPolicy": "decoding.ngram", "FixedK": "decoding.policies", "LearnedThreshold": "decoding.policies",
    "SamplingParams": "decoding.sampling", "UserError": "errors",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'adaptive_spec' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # once: later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
