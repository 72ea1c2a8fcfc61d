"""The Python API: a draft/target pair with its tokenizer, generating text.

    from adaptive_spec import SpecPair
    pair = SpecPair.load()                      # the default pair, bf16, CUDA if present
    g = pair.generate("Write quicksort in Python.", policy="fixed", k=4, temperature=0,
                      max_new_tokens=128, chat=True)
    print(g.text, g.metrics.summary())
"""
from __future__ import annotations

import torch

from .decoding import Decoder, Generation
from .errors import UserError
from .models import check_vocab, load_model, resolve_device
from .policies import make_policy
from .sampling import SamplingParams


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
        eos = set()
        for cfg in (target_model.generation_config, target_model.config):
            e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
            eos.update(e if isinstance(e, (list, tuple)) else ([e] if e is not None else []))
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.decoder = Decoder(self.target, self.draft, eos_token_ids=self.eos_token_ids)

    @classmethod
    def load(cls, target: str | None = "default", draft: str | None = "default", dtype="bf16",
             device: str | None = None, num_threads: int | None = None, **runner_kwargs) -> "SpecPair":
        """Load a pair by hub id or local path ("default" = the default pair; draft=None: target only)."""
        if num_threads:
            torch.set_num_threads(num_threads)
        device = resolve_device(device)
        target_model, tok = load_model(target, "target", dtype, device)
        draft_model, dtok = (load_model(draft, "draft", dtype, device) if draft is not None else (None, None))
        return cls(target_model, tok, draft_model, dtok, **runner_kwargs)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if not prompt or not prompt.strip():
            raise UserError("the prompt is empty; pass some prompt text")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise UserError("this tokenizer has no chat template; drop --chat to use the raw prompt")
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    def generate(self, prompt: str | list[int], policy: str = "fixed", max_new_tokens: int = 128,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = 0,
                 chat: bool = False, on_text=None, **policy_kwargs) -> Generation:
        """Generate from a prompt (text, or token ids). policy: "ar" for target-only decoding,
        "fixed" (k=...), or any name `make_policy` knows, with its keyword arguments."""
        ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
        sampling = SamplingParams(temperature, top_k, top_p)
        pol = make_policy(policy, pair=self, prompt_ids=ids, sampling=sampling,
                          max_new_tokens=max_new_tokens, **policy_kwargs)
        on_tokens = None
        if on_text is not None:
            on_tokens = _Streamer(self.tokenizer, on_text)
        g = self.decoder.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, policy=pol,
                                  seed=seed, on_tokens=on_tokens)
        g.text = self.tokenizer.decode(g.token_ids, skip_special_tokens=True)
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
