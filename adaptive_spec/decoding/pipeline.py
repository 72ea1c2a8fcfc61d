"""The Python API: a draft/target pair with its tokenizer, generating text.

    from adaptive_spec import SpecPair
    pair = SpecPair.load()                      # the default pair; dtype auto; CUDA if present
    g = pair.generate("Write quicksort in Python.", policy="fixed", k=4, temperature=0,
                      max_new_tokens=128, chat=True)  # or policy=FixedParams(k=4) (params.py)
    print(g.text, g.metrics.summary())"""
from __future__ import annotations

from dataclasses import replace
from functools import cached_property

import torch
from transformers import TextStreamer

from ..backends import engines, torch_engine
from ..backends.cpu.machine import describe
from .. import registry
from ..backends.paths import FeatureDraft
from ..backends.window import WindowedDraft
from ..drafter.source import load_feature_pair
from ..errors import UserError
from ..params import ARParams, PairParams, check_runs_on, pair_params, policy_params
from ..prompts import encode_prompt
from ..timing import torch_threads
from ..typed import PolicyParams
from . import multidraft, ngram, policies  # noqa: F401  (importing them registers their policies)
from .auto import measure_costs, predicted_wall, resolve_auto
from .decoder import Decoder
from .metrics import Generation
from .interfaces import Policy, PolicyContext
from .sampling import SamplingParams
from .trees import policy as tree  # noqa: F401  (registers the tree policies)


policy_names = registry.names  # every name `make_policy` accepts ("ar" first)


def as_policy_params(policy: str | PolicyParams, settings: dict) -> PolicyParams:
    """A policy's settings from either way in: a PolicyParams as it is, or a name and keywords
    (checked by the policy's class). Settings beside a PolicyParams are refused, not merged."""
    if not isinstance(policy, PolicyParams):
        return policy_params(policy, **settings)
    if settings:
        raise UserError(f"pass the settings {', '.join(settings)} inside the {policy.name} params, not beside them")
    return policy


def make_policy(policy: str | PolicyParams, context: PolicyContext | None = None, **settings) -> Policy | None:
    """A policy from its settings (a PolicyParams, or a name and keywords, validated here, once);
    "ar" gives None (target-only decoding). `context`: the pair, prompt and sampling it serves."""
    params = as_policy_params(policy, settings)
    ctx = replace(context or PolicyContext(), measure_costs=measure_costs, resolve_auto=resolve_auto)
    if ctx.sampling is not None:
        params.check_sampling(ctx.sampling.temperature)
    if params.name == "ar":
        return None
    engine = getattr(ctx.pair, "engine", None)
    if engine is not None:
        check_runs_on(params, engine)
    policy = registry.factory(params.name)(params, ctx)
    policy.needs = params.needs  # what its settings declare, read by the decoder
    return policy


class SpecPair:
    """A draft/target pair of runners on one engine, with the tokenizer prompts are encoded with.

    `SpecPair.load(...)` loads one by its settings (params.PairParams) on the engine they name;
    `SpecPair.from_models(...)` wraps Hugging Face models already loaded (the torch engine);
    `SpecPair(target, draft, tokenizer, eos_token_ids, engine)` takes runners an engine built."""

    def __init__(self, target, draft, tokenizer, eos_token_ids: list[int], engine: str | engines.Engine = "torch",
                 params: PairParams | None = None, draft_config: dict | None = None, prepare=None):
        """`params`: the settings `load` was given (recorded, not re-applied); `draft_config`: the draft
        configuration a head's warning and the cost cache compare against; `prepare(k_max)`: the engine's
        hook that readies the runners for a policy's longest round (contract.Loaded.prepare)."""
        self.prepare = prepare
        self.tokenizer = tokenizer
        self.target, self.draft = target, draft
        self.eos_token_ids = list(eos_token_ids)
        self.engine = engines.get(engine) if isinstance(engine, str) else engine
        self.decoder = Decoder(self.target, self.draft, eos_token_ids=self.eos_token_ids,
                               host_reads=params.host_reads if params is not None else "auto")
        self.params = params
        self.draft_config = dict(draft_config or {})
        self.auto_picks: dict = {}  # auto.resolve_auto's picks, made once per (curve, need, model, k_max, loop)
        self.pinned_costs = None  # costs.measure_costs(pin=...)'s measurement, kept for the pair's life

    @cached_property
    def draft_alone(self) -> "SpecPair":
        """The draft as the target of a pair of its own (no draft): its stand-alone decoding, whose forwards
        generate counts as the target's."""
        return type(self)(self.draft, None, self.tokenizer, self.eos_token_ids, self.engine)

    @property
    def backend(self) -> str:
        """The engine's name (what `--backend` and every result row say)."""
        return self.engine.name

    @classmethod
    def from_models(cls, target_model, tokenizer, draft_model=None, draft_tokenizer=None, kv_cache: str = "auto",
                    runtime: str = "auto", max_cache_len: int | None = None, k_max: int = 20, fused="auto",
                    params: PairParams | None = None) -> "SpecPair":
        """A torch pair over Hugging Face models already loaded (torch_engine.from_models: kv_cache
        dynamic | static, runtime eager | cudagraph | compile)."""
        loaded = torch_engine.from_models(target_model, tokenizer, draft_model, draft_tokenizer, kv_cache, runtime,
                                          max_cache_len, k_max, fused)
        return cls(loaded.target, loaded.draft, loaded.tokenizer, loaded.eos_token_ids, "torch", params,
                   prepare=loaded.prepare)

    @classmethod
    def load(cls, params: PairParams | None = None, share_target: "SpecPair | None" = None, **settings) -> "SpecPair":
        """Load a pair: `SpecPair.load(PairParams(...))` or `SpecPair.load(target=..., draft=..., ...)`
        with PairParams' keywords (params.py; "default" = the default pair; draft=None: target only),
        on the engine `backend` names (backends/engines.py: `torch`, Hugging Face weights; `llama.cpp`,
        the GGUF files as they are). Every setting is checked before any weights load. `share_target`: a loaded
        pair whose target (and tokenizer) this one's draft runs against, so that pairs of several drafts compare on
        the same weights and kernels (the sweep's `drafts`); the engine's own target load is dropped at once."""
        if params is None:
            params = pair_params(**settings)
        elif settings:
            raise UserError(f"pass the settings {', '.join(settings)} inside the PairParams, not beside them")
        engine = params.engine
        engine.check_available()
        # a feature drafter loads with the target whose hidden states it reads (drafter/source.py)
        loaded = (load_feature_pair if isinstance(params.draft, FeatureDraft) else engine.loader)(params)
        draft, config = loaded.draft, loaded.draft_config
        if params.draft_context is not None and draft is not None:  # any engine's draft: window.py says why
            draft, config = WindowedDraft(draft, params.draft_context), {**config, "draft_context": params.draft_context}
        if share_target is not None:  # the engine's prepare readies the target it loaded, which is dropped: none here
            s = share_target
            return cls(s.target, draft, s.tokenizer, s.eos_token_ids, engine, params, config)
        return cls(loaded.target, draft, loaded.tokenizer, loaded.eos_token_ids, engine, params, config, loaded.prepare)

    def runtime_info(self) -> dict:
        """The machine and each model's numeric path: recorded with every measurement."""
        info = {"machine": describe(), "backend": self.backend, **self.draft_config}
        for role, lm in (("target", self.target), ("draft", self.draft)):
            if lm is not None:
                info[f"{role}_path"] = lm.numeric_path()
        return info

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat)

    def generate(self, prompt: str | list[int], policy: str | PolicyParams = "fixed", max_new_tokens: int = 128,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = 0,
                 chat: bool = False, on_text=None, extras=(), **settings) -> Generation:
        """Generate from a prompt (text, or token ids). policy: a PolicyParams (params.py), or a
        name ("ar" for target-only decoding, "fixed", "learned", ...) with its settings as keywords
        (k=4; head=..., threshold=0.7), checked against the policy's PolicyParams.

        threshold="auto" (learned) / k="auto" (fixed): the h / K of best predicted throughput on
        this machine, from the head's threshold_curve.json (or curve=PATH; auto.py); the pick
        is printed once per pair and kept as `Generation.auto`. `extras`: as Decoder.generate's."""
        params = as_policy_params(policy, settings)
        sampling = SamplingParams(temperature, top_k, top_p)
        ids = self.encode(prompt, chat) if isinstance(prompt, str) or _is_messages(prompt) else list(prompt)
        on_tokens = _Streamer(self.tokenizer, on_text) if on_text is not None else None
        # the costs auto measures (the loop's sampling among them) are taken on the threads the decode has
        with torch_threads(self.engine.decode_torch_threads):
            params, auto = resolve_auto(self, params, temperature=temperature)
            params = params or ARParams()  # auto found that no drafting pays on this machine
            pol = make_policy(params, PolicyContext(self, ids, sampling, max_new_tokens))
            if self.prepare is not None:
                self.prepare(pol.k_max if pol is not None else 0, pol.graph_head if pol is not None else None)
            g = self.decoder.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, policy=pol,
                                      seed=seed, on_tokens=on_tokens, extras=extras)
        if on_tokens is not None:
            on_tokens.end()
        g.text = self.tokenizer.decode(g.token_ids, skip_special_tokens=True)
        g.auto = None if auto is None else {**auto, **predicted_wall(auto, len(ids), g.metrics.n_tokens)}
        return g


def _is_messages(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


class _Streamer(TextStreamer):
    """transformers' streamer (it holds text back until a word or a UTF-8 sequence is complete),
    fed the decoder's new token ids per round and emitting to a callback instead of stdout."""

    def __init__(self, tokenizer, emit):
        super().__init__(tokenizer, skip_special_tokens=True)
        self.emit = emit

    def __call__(self, new_ids):
        self.put(torch.tensor(new_ids))

    def on_finalized_text(self, text: str, stream_end: bool = False):
        if text:
            self.emit(text)
