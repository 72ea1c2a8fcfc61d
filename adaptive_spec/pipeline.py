"""The Python API: a draft/target pair with its tokenizer, generating text.

    from adaptive_spec import SpecPair
    pair = SpecPair.load()                      # the default pair; dtype auto; CUDA if present
    g = pair.generate("Write quicksort in Python.", policy="fixed", k=4, temperature=0,
                      max_new_tokens=128, chat=True)
    print(g.text, g.metrics.summary())
"""
from __future__ import annotations

import torch

from . import multidraft, policies, tree  # noqa: F401  (importing them registers their policies)
from .autotune import resolve_auto
from .decoding import Decoder, Generation
from .interfaces import Policy, lookup, registered
from .models import check_quant, check_vocab, load_model, resolve_device
from .prompts import encode_prompt, eos_token_ids
from .sampling import SamplingParams


def policy_names() -> list[str]:
    """Every name `make_policy` accepts ("ar" first), without loading any model: for `--policy` choices."""
    return ["ar"] + registered()


def make_policy(name: str, **kwargs) -> Policy | None:
    """A policy by name; "ar" gives None (target-only decoding). kwargs not used by a policy
    (the pair, the prompt, the sampling settings) are ignored by it."""
    if name == "ar":
        return None
    return lookup(name)(**kwargs)


class SpecPair:
    def __init__(self, target_model, tokenizer, draft_model=None, draft_tokenizer=None, backend: str = "dynamic",
                 runtime: str = "eager", max_cache_len: int | None = None, k_max: int = 20):
        """backend "dynamic": growing KV caches (any model, any device); "static": preallocated
        caches indexed by position, with runtime eager | cudagraph | compile (GPU)."""
        from .static_runner import DRAFT_SHAPES, make_runner, verify_shapes

        vocab = None
        if draft_model is not None:
            vocab = check_vocab(draft_tokenizer or tokenizer, tokenizer, draft_model, target_model)
        self.tokenizer = tokenizer
        graphs = runtime != "eager"
        self.target = make_runner(target_model, vocab, backend, runtime, max_cache_len,
                                  warmup_shapes=verify_shapes(k_max) if graphs else ())
        self.draft = (make_runner(draft_model, vocab, backend, runtime, max_cache_len,
                                  warmup_shapes=DRAFT_SHAPES if graphs else ())
                      if draft_model is not None else None)
        self.eos_token_ids = eos_token_ids(tokenizer, target_model)
        self.decoder = Decoder(self.target, self.draft, eos_token_ids=self.eos_token_ids)

    @classmethod
    def load(cls, target: str | None = "default", draft: str | None = "default", dtype="auto",
             device: str | None = None, num_threads: int | None = None, draft_quant: str = "none",
             draft_vocab=None, **runner_kwargs) -> "SpecPair":
        """Load a pair by hub id or local path ("default" = the default pair; draft=None: target only).

        dtype "auto": bf16, or fp32 on a CPU without bf16 kernels (cpu.py). The draft may be made
        cheaper without touching exactness: draft_quant "int8" / "int4" (weight-only), draft_vocab
        N | FILE | FILE:N (its output layer keeps the N most frequent tokens; vocab.py)."""
        if num_threads:
            torch.set_num_threads(num_threads)
        device = resolve_device(device)
        check_quant(draft_quant, device)  # refused before any weights load
        target_model, tok = load_model(target, "target", dtype, device)
        draft_model, dtok = ((load_model(draft, "draft", dtype, device, quant=draft_quant, draft_vocab=draft_vocab)
                              if draft is not None else (None, None)))
        pair = cls(target_model, tok, draft_model, dtok, **runner_kwargs)
        pair.draft_config = {"draft_quant": draft_quant or "none", "draft_vocab": draft_vocab or "full"}
        return pair

    def runtime_info(self) -> dict:
        """The machine and each model's numeric path: recorded with every measurement."""
        from .cpu import describe

        info = {"machine": describe(), **getattr(self, "draft_config", {})}
        for role, lm in (("target", self.target), ("draft", self.draft)):
            if lm is not None:
                info[f"{role}_path"] = getattr(lm.model, "cpu_path", {"dtype": str(next(lm.model.parameters()).dtype)})
        return info

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat)

    def generate(self, prompt: str | list[int], policy: str = "fixed", max_new_tokens: int = 128,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = 0,
                 chat: bool = False, on_text=None, **policy_kwargs) -> Generation:
        """Generate from a prompt (text, or token ids). policy: "ar" for target-only decoding,
        "fixed" (k=...), or any name `make_policy` knows, with its keyword arguments.

        threshold="auto" (learned) / k="auto" (fixed): the h / K of best predicted throughput on
        this machine, from the head's threshold_curve.json (or curve=PATH; autotune.py); the pick
        is printed once per pair and kept as `Generation.auto`."""
        ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
        sampling = SamplingParams(temperature, top_k, top_p)
        policy_kwargs, auto = resolve_auto(self, policy, policy_kwargs, temperature=temperature)
        pol = make_policy(policy, pair=self, prompt_ids=ids, sampling=sampling,
                          max_new_tokens=max_new_tokens, **policy_kwargs)
        on_tokens = None
        if on_text is not None:
            on_tokens = _Streamer(self.tokenizer, on_text)
        g = self.decoder.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, policy=pol,
                                  seed=seed, on_tokens=on_tokens)
        g.text = self.tokenizer.decode(g.token_ids, skip_special_tokens=True)
        g.auto = auto
        return g


class _Streamer:
    """Decodes the growing output and emits only the new text (so multi-token characters work)."""

    def __init__(self, tokenizer, emit):
        self.tokenizer, self.emit, self.ids, self.printed = tokenizer, emit, [], 0

    def __call__(self, new_ids):
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next tokens
            return
        self.emit(text[self.printed:])
        self.printed = len(text)
