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
from .autotune import AR, resolve_auto
from .decoding import Decoder, Generation
from .errors import UserError
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
    pair = kwargs.get("pair")
    if pair is not None and getattr(pair, "backend", "torch") == "llama.cpp":
        from .llamacpp import check_policy

        check_policy(name)
    return lookup(name)(**kwargs)


class SpecPair:
    backend = "torch"

    def __init__(self, target_model, tokenizer, draft_model=None, draft_tokenizer=None, kv_cache: str = "dynamic",
                 runtime: str = "eager", max_cache_len: int | None = None, k_max: int = 20):
        """kv_cache "dynamic": growing KV caches (any model, any device); "static": preallocated
        caches indexed by position, with runtime eager | cudagraph | compile (GPU)."""
        from .static_runner import DRAFT_SHAPES, make_runner, verify_shapes

        vocab = None
        if draft_model is not None:
            vocab = check_vocab(draft_tokenizer or tokenizer, tokenizer, draft_model, target_model)
        graphs = runtime != "eager"
        target = make_runner(target_model, vocab, kv_cache, runtime, max_cache_len,
                             warmup_shapes=verify_shapes(k_max) if graphs else ())
        draft = (make_runner(draft_model, vocab, kv_cache, runtime, max_cache_len,
                             warmup_shapes=DRAFT_SHAPES if graphs else ())
                 if draft_model is not None else None)
        self._init_runners(target, draft, tokenizer, eos_token_ids(tokenizer, target_model))

    def _init_runners(self, target, draft, tokenizer, eos: list[int]) -> None:
        self.tokenizer = tokenizer
        self.target, self.draft = target, draft
        self.eos_token_ids = eos
        self.decoder = Decoder(self.target, self.draft, eos_token_ids=self.eos_token_ids)

    @classmethod
    def load(cls, target: str | None = "default", draft: str | None = "default", dtype="auto",
             device: str | None = None, num_threads: int | None = None, draft_quant: str = "none",
             draft_vocab=None, backend: str = "torch", n_ctx: int | None = None, **runner_kwargs) -> "SpecPair":
        """Load a pair by hub id or local path ("default" = the default pair; draft=None: target only).

        backend "torch": Hugging Face weights (the default pair: the GGUFs dequantized to bf16);
        "llama.cpp": the GGUF files as they are, through llama-cpp-python (llamacpp.py), with a
        context of n_ctx positions. dtype "auto": bf16, or fp32 on a CPU without bf16 kernels
        (cpu.py). The torch draft may be made cheaper without touching exactness: draft_quant
        "int8" / "int4" (weight-only), draft_vocab N | FILE | FILE:N (its output layer keeps the N
        most frequent tokens; vocab.py)."""
        from .llamacpp import check_backend

        if check_backend(backend) == "llama.cpp":
            return cls._load_llama_cpp(target, draft, dtype, device, num_threads, draft_quant, draft_vocab, n_ctx,
                                       runner_kwargs)
        if n_ctx is not None:
            raise UserError("n_ctx (--n-ctx) sets the llama.cpp context; the torch backend sizes its caches itself")
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

    @classmethod
    def _load_llama_cpp(cls, target, draft, dtype, device, num_threads, draft_quant, draft_vocab, n_ctx,
                        runner_kwargs) -> "SpecPair":
        """Both models as GGUF files in llama.cpp; the Hugging Face tokenizer (the same ids as the torch
        backend, chat template included). Every check that needs no weights comes first."""
        from .llamacpp import GGUFModel, LlamaCppLM, check_gguf_pair, import_llama_cpp, resolve_gguf

        unused = {"dtype": dtype if dtype not in (None, "auto") else None,
                  "device": device if device not in (None, "cpu") else None,
                  "draft_quant": draft_quant if draft_quant not in (None, "none") else None,
                  "draft_vocab": draft_vocab, **{k: v for k, v in runner_kwargs.items() if v not in (None, "dynamic",
                                                                                                 "eager")}}
        unused = {k: v for k, v in unused.items() if v is not None}
        if unused:
            raise UserError(f"{', '.join(f'{k}={v!r}' for k, v in unused.items())}: the llama.cpp backend runs the GGUF "
                            "files as they are, on the CPU; these settings apply to the torch backend only")
        import_llama_cpp()
        target_path = resolve_gguf(target, "target")
        draft_path = resolve_gguf(draft, "draft") if draft is not None else None
        if draft_path is not None:
            check_gguf_pair(draft_path, target_path)
        tok, eos = _gguf_tokenizer(target, target_path)
        threads = num_threads or torch.get_num_threads()
        t = LlamaCppLM(GGUFModel(target_path), n_ctx=n_ctx, n_threads=threads)
        d = None
        if draft_path is not None:
            d = LlamaCppLM(GGUFModel(draft_path), n_ctx=t.max_length, n_threads=threads)
            vocab = min(t.n_vocab, d.n_vocab)
            if len(tok) > vocab:
                raise UserError(f"the tokenizer has {len(tok)} tokens but a model's output layer has only {vocab}; "
                                "the draft and target do not fit together")
            t.vocab_size = d.vocab_size = vocab
        pair = cls.__new__(cls)
        pair.backend = "llama.cpp"
        if eos is None:
            eos = sorted(({tok.eos_token_id} - {None}) | _eog_ids(t))
        pair._init_runners(t, d, tok, eos)
        pair.draft_config = {"backend": "llama.cpp", "draft_quant": "gguf", "draft_vocab": "full"}
        return pair

    def runtime_info(self) -> dict:
        """The machine and each model's numeric path: recorded with every measurement."""
        from .cpu import describe

        info = {"machine": describe(), "backend": self.backend, **getattr(self, "draft_config", {})}
        for role, lm in (("target", self.target), ("draft", self.draft)):
            if lm is None:
                continue
            if hasattr(lm, "numeric_path"):
                info[f"{role}_path"] = lm.numeric_path()
            else:
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
        if auto is not None and auto["value"] == AR:
            policy = "ar"  # auto found that no drafting pays on this machine
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


def _gguf_tokenizer(name, gguf_path):
    """(Hugging Face tokenizer, its EOS ids or None) for a llama.cpp pair: the default pair's converted folder
    (fetched once), a folder beside the GGUF with a tokenizer, or the tokenizer transformers builds
    from the GGUF itself. Prompts are encoded by it, so both backends feed the same ids."""
    from transformers import AutoTokenizer, GenerationConfig

    from .models import resolve_model_path

    folder = (resolve_model_path("default", "target") if name in (None, "default")
              else str(gguf_path.parent) if (gguf_path.parent / "tokenizer_config.json").is_file() else None)
    if folder is None:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        return tok, None  # no generation config: llama.cpp's end-of-generation ids stand in
    tok = AutoTokenizer.from_pretrained(folder)
    try:
        gen = GenerationConfig.from_pretrained(folder)
    except OSError:
        gen = None
    return tok, eos_token_ids(tok, type("_Cfg", (), {"generation_config": gen})())


def _eog_ids(lm) -> set[int]:
    """The ids llama.cpp's vocabulary marks end-of-generation (EOS, EOT, <|im_end|> and the like)."""
    ll, vocab = lm.ll, lm.ll.llama_model_get_vocab(lm.model.ptr)
    return {i for i in range(lm.vocab_size) if ll.llama_vocab_is_eog(vocab, i)}


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
