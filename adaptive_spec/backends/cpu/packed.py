"""CPU kernel choice for the torch engine's linear layers: oneDNN-packed weights, row padding and FBGEMM fp16
copies, applied by pack_cpu_linears and recorded in `model.cpu_path`. Why each: docs/cpu-runtime.md."""
from __future__ import annotations

import collections
import hashlib
import json
import statistics
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

from ...runs import write_json
from ...timing import timed_runs
from .machine import cpu_name, fbgemm_fp16, onednn_packed
from ...setup.llama_build import cache_dir, cpu_flags

# torch marks the FBGEMM fp16 ops deprecated; machine.fbgemm_fp16 checks they still run before any is used
warnings.filterwarnings("ignore", message=r"fbgemm_\w+ is deprecated")


class PackedLinear(torch.nn.Module):
    """nn.Linear whose weight is pre-packed once into oneDNN's blocked layout (CPU only).

    `.weight` stays (tied embeddings share it) unless `release=True` frees it; with grad enabled the stock
    path runs (the packed op has no backward). `pad_to[M]`: an input of M rows is zero-padded to that many
    rows, as oneDNN's kernel for more rows can stream weights faster (rows are independent: values unchanged).
    Inputs whose row count is in `fp16_rows` run on the FBGEMM fp16 copy (`add_fp16`), half the bytes."""

    def __init__(self, linear: torch.nn.Linear, pad_to: tuple = (), release: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.weight_bytes = linear.weight.numel() * linear.weight.element_size()
        self.pad_to = pad_to
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


_TIMED_BYTES = 256 << 20  # more than a CPU's caches: the timing is of weights streamed from memory, as in decoding


def _timed_layers(linears: list) -> list:
    timed, total = [], 0
    for m in linears:
        if total >= _TIMED_BYTES:
            break
        timed.append(m)
        total += m.weight_bytes
    return timed


def _median_s(fn) -> float:
    """Median seconds of fn() over 3 calls after an untimed one (which pays for warm-up)."""
    return statistics.median(timed_runs(fn, 3, warmup=1)[0])


def _choice_path(kind: str, timed: list, max_rows: int):
    """Where a timed kernel choice is kept: <cache>/kernels/<key>.json, the key hashing what the choice
    depends on (the CPU, its flags, torch and its threads, the timed layers' shapes and dtype), so the
    choice is timed once per CPU and model shape, and every load after (every row of a sweep) runs the
    same kernels. Delete the folder to time again."""
    key = {"kind": kind, "cpu": cpu_name(), "flags": sorted(cpu_flags()), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "max_rows": max_rows,
           "layers": [[m.in_features, m.out_features, str(m.packed.dtype)] for m in timed]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{kind}-{digest}.json", key


def _cached_choice(kind: str, timed: list, max_rows: int, choose):
    """choose() once per key (see _choice_path); the stored value after. A cache that cannot be read or
    written is only slower: the choice is timed again."""
    path, key = _choice_path(kind, timed, max_rows)
    try:
        return json.loads(path.read_text())["value"]
    except (OSError, ValueError, KeyError):
        pass
    value = choose()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"key": key, "value": value})  # atomic: a concurrent load reads the old file or the new
    except OSError:
        pass
    return value


def choose_padding(linears: list, max_rows: int = 8, rows: int | None = None) -> tuple:
    """pad_to[M] for M = 0..max_rows: the row count r >= M at which the layers run fastest (M itself unless
    r is at least 3% faster), timed once per CPU and layer shapes (_cached_choice). `rows` N
    (PairParams.cpu_pad_rows) pads every input of fewer than N rows to N instead (0 = off)."""
    if rows is not None:
        return (0,) + (rows,) * rows if rows > 1 else ()
    timed = _timed_layers(linears)
    return tuple(_cached_choice("pad_to", timed, max_rows, lambda: list(_time_padding(timed, max_rows))))


def _time_padding(timed: list, max_rows: int) -> tuple:
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
    """Every value of every weight is exactly representable in fp16 (as bf16 checkpoints' within fp16's range);
    a model with any other weight keeps oneDNN, so that all its layers compute on the same weights. Checked in
    chunks that stay in the caches: whole-tensor temporaries cost twice the time in fresh pages."""
    return all(torch.equal(c, c.half().to(c.dtype)) for w in weights for c in w.detach().reshape(-1).split(1 << 18))


def choose_fp16_rows(linears: list, max_rows: int = 16, rows: int | None = None) -> frozenset:
    """Row counts (1..max_rows) at which the FBGEMM fp16 copies run at least 3% faster than oneDNN, timed as
    in choose_padding. `rows` N (PairParams.cpu_fp16_rows) uses fp16 for every input of at most N rows (0 = off)."""
    if rows is not None:
        return frozenset(range(1, rows + 1))
    timed = _timed_layers(linears)
    return frozenset(_cached_choice("fp16_rows", timed, max_rows, lambda: sorted(_time_fp16_rows(timed, max_rows))))


def _time_fp16_rows(timed: list, max_rows: int) -> frozenset:
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


def _why_no_fp16(dtype, fp16: bool, fp16_rows: int | None, weights) -> str | None:
    """Why the layers keep no fp16 copy (pack_cpu_linears' `fp16`), or None where they do."""
    if not fp16:
        return "off (fp16=False: batched work)"
    if dtype != torch.float32:
        return f"runs {str(dtype).removeprefix('torch.')} kernels"
    if fp16_rows == 0:
        return "cpu_fp16_rows=0"
    return fbgemm_fp16() or (None if fp16_exact(weights) else "a weight is not exactly representable in fp16")


def pack_cpu_linears(model, release: bool = False, fp16: bool = True, pack: bool = True, pad_rows: int | None = None,
                     fp16_rows: int | None = None) -> int:
    """Swap every nn.Linear of a CPU model for a PackedLinear; returns how many, and records the chosen path
    as `model.cpu_path`. A no-op (0) off the CPU, where oneDNN has no packed kernel for the dtype, or with
    pack=False. `release`: free the original weights nothing else shares. `fp16`: keep fp16 copies where
    fp32 weights allow (half the fp32 bytes again, so batched work passes False). `pad_rows` / `fp16_rows`
    fix what is otherwise timed (None)."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu":
        return 0
    why_not = "cpu_stock=True" if not pack else onednn_packed(p.dtype)
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
    why_no_fp16 = _why_no_fp16(p.dtype, fp16, fp16_rows, (getattr(m, c).weight for m, c in slots))
    packed, pad_to, rows = _pack_slots(slots, release, shared, why_no_fp16 is None, pad_rows, fp16_rows)
    if packed:
        for m in packed:
            m.pad_to = pad_to
        model.cpu_pad_to = pad_to
        model.cpu_path.update(linear="onednn-packed", pad_to=pad_to)
        if why_no_fp16 is None:
            for m in packed:
                m.fp16_rows = rows
                if not rows:
                    m.fp16 = None  # never faster here: free the copies the timing used
            model.cpu_path["fp16_rows"] = sorted(rows)
            if rows:
                model.cpu_path["linear"] = "onednn-packed + fbgemm-fp16"
        else:
            model.cpu_path["why_no_fp16"] = why_no_fp16
    return len(packed)


def _pack_slots(slots: list, release: bool, shared: set, fp16: bool, pad_rows: int | None, fp16_rows: int | None):
    """Pack each slot's layer in place: (the PackedLinears, pad_to, the fp16 row counts or None without copies).
    Both choices are made on the timed layers (the first _TIMED_BYTES) as soon as they are packed, so the layers
    after them get no fp16 copy where no row count pays. FBGEMM packs a copy on one thread (releasing the GIL): a
    layer per torch thread at a time, each original weight held only until its copy is made."""
    packed, pad_to, rows, timed_bytes = [], None, None, 0
    workers = max(1, torch.get_num_threads())
    pending = collections.deque()

    def drain(keep: int = 0):
        while len(pending) > keep:
            pending.popleft().result()

    with ThreadPoolExecutor(workers) as pool:
        for mod, cname in slots:
            child = getattr(mod, cname)
            new = PackedLinear(child, release=release and id(child.weight) not in shared)
            if fp16 and rows != frozenset():
                pending.append(pool.submit(new.add_fp16, child.weight))
                drain(keep=workers)
            setattr(mod, cname, new)
            packed.append(new)
            del child
            timed_bytes += new.weight_bytes
            if pad_to is None and timed_bytes >= _TIMED_BYTES:
                drain()  # the timing has the cores, and every timed layer its copy
                pad_to, rows = _choose(packed, fp16, pad_rows, fp16_rows)
        drain()
    if pad_to is None and packed:  # a model smaller than the timed bytes
        pad_to, rows = _choose(packed, fp16, pad_rows, fp16_rows)
    return packed, pad_to or (), rows


def _choose(packed: list, fp16: bool, pad_rows: int | None, fp16_rows: int | None):
    """pad_to, then the fp16 row counts (timed with that padding, as the layers will run), on the layers so far."""
    pad_to = choose_padding(packed, rows=pad_rows)
    for m in packed:
        m.pad_to = pad_to
    return pad_to, choose_fp16_rows(packed, rows=fp16_rows) if fp16 else None
