"""The Python API: a draft/target pair with its tokenizer, generating text.

    from adaptive_spec import SpecPair
    pair = SpecPair.load()                      # the default pair; dtype auto; CUDA if present
    g = pair.generate("Write quicksort in Python.", policy="fixed", k=4, temperature=0,
                      max_new_tokens=128, chat=True)  # or policy=FixedParams(k=4) (params.py)
    print(g.text, g.metrics.summary())
"""
from __future__ import annotations

import contextlib

import torch
from transformers import GenerationConfig, TextStreamer

from ..backends.cpu import describe
from ..backends.llamacpp import (GGUFModel, LlamaCppLM, check_gguf_pair, check_policy, import_llama_cpp, requantized_gguf,
                                 resolve_gguf)
from ..backends.models import check_quant, check_vocab, load_model, resolve_device, resolve_model_path
from ..backends.static_runner import DRAFT_SHAPES, make_runner, verify_shapes
from ..errors import UserError
from ..params import ARParams, PairParams, PolicyParams, pair_params, policy_params
from ..prompts import encode_prompt, eos_token_ids
from . import multidraft, ngram, policies  # noqa: F401  (importing them registers their policies)
from .auto import resolve_auto
from .decoder import Decoder, Generation
from .interfaces import Policy, PolicyContext, lookup, registered
from .sampling import SamplingParams
from .trees import policy as tree  # noqa: F401  (registers the tree policies)


def policy_names() -> list[str]:
    """Every name `make_policy` accepts ("ar" first), without loading any model: for `--policy` choices."""
    return ["ar"] + registered()


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
    ctx = context or PolicyContext()
    if ctx.sampling is not None:
        params.check_sampling(ctx.sampling.temperature)
    if params.name == "ar":
        return None
    if getattr(ctx.pair, "backend", "torch") == "llama.cpp":
        check_policy(params.name)
    return lookup(params.name)(params, ctx)


class SpecPair:
    backend = "torch"

    def __init__(self, target_model, tokenizer, draft_model=None, draft_tokenizer=None, kv_cache: str = "dynamic",
                 runtime: str = "eager", max_cache_len: int | None = None, k_max: int = 20,
                 params: PairParams | None = None):
        """kv_cache "dynamic": growing KV caches (any model, any device); "static": preallocated
        caches indexed by position, with runtime eager | cudagraph | compile (GPU). `params`: the
        settings `load` was given (recorded, not re-applied)."""
        vocab = None
        if draft_model is not None:
            vocab = check_vocab(draft_tokenizer or tokenizer, tokenizer, draft_model, target_model)
        graphs = runtime != "eager"
        target = make_runner(target_model, vocab, kv_cache, runtime, max_cache_len,
                             warmup_shapes=verify_shapes(k_max) if graphs else ())
        draft = (make_runner(draft_model, vocab, kv_cache, runtime, max_cache_len,
                             warmup_shapes=DRAFT_SHAPES if graphs else ())
                 if draft_model is not None else None)
        self._init_runners(target, draft, tokenizer, eos_token_ids(tokenizer, target_model), params)

    def _init_runners(self, target, draft, tokenizer, eos: list[int], params: PairParams | None = None) -> None:
        self.tokenizer = tokenizer
        self.target, self.draft = target, draft
        self.eos_token_ids = eos
        self.decoder = Decoder(self.target, self.draft, eos_token_ids=self.eos_token_ids)
        self.params = params  # the settings it was loaded with (None: built from models directly)
        # the draft configuration a head's warning and the cost cache compare against
        self.draft_config = ({} if params is None else
                             {"backend": "llama.cpp", "draft_quant": "gguf" if params.draft_quant == "none"
                              else f"gguf-{params.draft_quant}", "draft_vocab": "full",
                              **({} if params.target_quant == "none" else {"target_quant": params.target_quant})}
                             if params.backend == "llama.cpp" else
                             {"draft_quant": params.draft_quant, "draft_vocab": params.draft_vocab or "full"})
        self.auto_picks: dict = {}  # auto.resolve_auto's picks, made once per (curve, need, model, k_max)
        self.pinned_costs = None  # costs.measure_costs(pin=...)'s measurement, kept for the pair's life

    @classmethod
    def load(cls, params: PairParams | None = None, **settings) -> "SpecPair":
        """Load a pair: `SpecPair.load(PairParams(...))` or `SpecPair.load(target=..., draft=..., ...)`
        with PairParams' keywords (params.py; "default" = the default pair; draft=None: target only).

        backend "torch": Hugging Face weights (the default pair: the GGUFs dequantized to bf16);
        "llama.cpp": the GGUF files as they are, through llama-cpp-python (llamacpp.py), with a
        context of n_ctx positions. dtype "auto": bf16, or fp32 on a CPU without bf16 kernels
        (cpu.py). The torch draft may be made cheaper without touching exactness: draft_quant
        "int8" / "int4" (weight-only), draft_vocab N | FILE | FILE:N (its output layer keeps the N
        most frequent tokens; vocab.py). Every setting is checked before any weights load."""
        if params is None:
            params = pair_params(**settings)
        elif settings:
            raise UserError(f"pass the settings {', '.join(settings)} inside the PairParams, not beside them")
        if params.backend == "llama.cpp":
            return cls._load_llama_cpp(params)
        params.check_draft_vocab_size()
        if params.threads:
            torch.set_num_threads(params.threads)
        device = resolve_device(params.device)
        check_quant(params.draft_quant, device)  # refused before any weights load
        target_model, tok = load_model(params.target, "target", params.dtype, device)
        draft_model, dtok = ((load_model(params.draft, "draft", params.dtype, device, quant=params.draft_quant,
                                         draft_vocab=params.draft_vocab)
                              if params.draft is not None else (None, None)))
        return cls(target_model, tok, draft_model, dtok, kv_cache=params.kv_cache, runtime=params.runtime,
                   max_cache_len=params.max_cache_len, params=params)

    @classmethod
    def _load_llama_cpp(cls, params: PairParams) -> "SpecPair":
        """Both models as GGUF files in llama.cpp; the Hugging Face tokenizer (the same ids as the torch
        backend, chat template included). PairParams has refused the torch-only settings already."""
        import_llama_cpp()
        target_path = resolve_gguf(params.target, "target")
        draft_path = resolve_gguf(params.draft, "draft") if params.draft is not None else None
        if draft_path is not None:
            check_gguf_pair(draft_path, target_path)
            if params.draft_quant != "none":
                draft_path = requantized_gguf(draft_path, params.draft_quant, params.threads)
        tok, eos = _gguf_tokenizer(params.target, target_path)  # the fetched file's, beside it
        if params.target_quant != "none":
            target_path = requantized_gguf(target_path, params.target_quant, params.threads)
        threads = params.threads or torch.get_num_threads()
        t = LlamaCppLM(GGUFModel(target_path), n_ctx=params.n_ctx, n_threads=threads)
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
        pair._init_runners(t, d, tok, eos, params)
        return pair

    def runtime_info(self) -> dict:
        """The machine and each model's numeric path: recorded with every measurement."""
        info = {"machine": describe(), "backend": self.backend, **self.draft_config}
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

    def generate(self, prompt: str | list[int], policy: str | PolicyParams = "fixed", max_new_tokens: int = 128,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = 0,
                 chat: bool = False, on_text=None, **settings) -> Generation:
        """Generate from a prompt (text, or token ids). policy: a PolicyParams (params.py), or a
        name ("ar" for target-only decoding, "fixed", "learned", ...) with its settings as keywords
        (k=4; head=..., threshold=0.7), checked against the policy's PolicyParams.

        threshold="auto" (learned) / k="auto" (fixed): the h / K of best predicted throughput on
        this machine, from the head's threshold_curve.json (or curve=PATH; auto.py); the pick
        is printed once per pair and kept as `Generation.auto`."""
        params = as_policy_params(policy, settings)
        sampling = SamplingParams(temperature, top_k, top_p)
        ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
        params, auto = resolve_auto(self, params, temperature=temperature)
        params = params or ARParams()  # auto found that no drafting pays on this machine
        pol = make_policy(params, PolicyContext(self, ids, sampling, max_new_tokens))
        on_tokens = None
        if on_text is not None:
            on_tokens = _Streamer(self.tokenizer, on_text)
        with _torch_threads(LLAMA_CPP_TORCH_THREADS if self.backend == "llama.cpp" else None):
            g = self.decoder.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, policy=pol,
                                      seed=seed, on_tokens=on_tokens)
        if on_tokens is not None:
            on_tokens.end()
        g.text = self.tokenizer.decode(g.token_ids, skip_special_tokens=True)
        g.auto = auto
        return g


# torch's threads while a llama.cpp pair decodes (None: leave them). torch only samples and runs the
# heads there (rows of 151,936 logits at most), and its OpenMP pool would spin on the cores llama.cpp's
# own pool computes on: with one torch thread llama.cpp's forward was 0-3% faster in three paired runs
# on a 2-core EPYC, never slower beyond noise (eval/bench_llama_cpp_overhead.py).
LLAMA_CPP_TORCH_THREADS: int | None = 1


@contextlib.contextmanager
def _torch_threads(n: int | None):
    """torch on n threads inside the block (None: as it is)."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _gguf_tokenizer(name, gguf_path):
    """(Hugging Face tokenizer, its EOS ids or None) for a llama.cpp pair: the default pair's converted folder
    (fetched once), a folder beside the GGUF with a tokenizer, or the tokenizer transformers builds
    from the GGUF itself. Prompts are encoded by it, so both backends feed the same ids."""
    from transformers import AutoTokenizer  # heavy: the tokenizer registry, only for a llama.cpp pair

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
