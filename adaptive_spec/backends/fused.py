"""A fused Qwen2 / Llama decoder over a static KV cache: the Hugging Face modules' numbers in several
times fewer kernels per step, as a GPU decode step at batch 1 costs what it launches, not what it reads.

A layer is 11 ops that do work for any n tokens (every reshape a view): rms_norm; q/k/v as one matrix;
RoPE as one batched matmul (each kv-head group of q and k times its token's rotation R_p, v times the
identity); one index_copy_ of K and V into the cache; scaled_dot_product_attention under an additive mask
(GQA by enable_gqa, never the math fallback); o with the residual add inside; rms_norm; gate and up as
one matrix; silu; mul; down with the residual add inside. The model's weights become views of the fused
matrices, so a `CausalLM` over the same model agrees; norm weights are not folded into the next matrix,
which would change the shared matrices. static_runner.FusedCausalLM is the runner around it.

`step_launches(lm)` counts what one step of any torch runner dispatches (the CPU tests bound it per layer)."""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ARCHITECTURES = ("qwen2", "llama")
# rope types whose inverse frequencies are fixed at load (dynamic / longrope change them with the
# sequence length inside Hugging Face's forward)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_type(model) -> str:
    params = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def unsupported_reason(model) -> str | None:
    """Why the fused decoder cannot run `model` (None: it can). Checked before any weight is touched."""
    cfg = model.config
    if cfg.model_type not in ARCHITECTURES:
        return f"the fused decoder supports {' and '.join(ARCHITECTURES)} models, not {cfg.model_type!r}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"the fused decoder supports the SiLU MLP only, not hidden_act={cfg.hidden_act!r}"
    rope = _rope_type(model)
    if rope not in ROPE_TYPES:
        return f"the fused decoder supports rope types {', '.join(ROPE_TYPES)}, not {rope!r}"
    rotary = getattr(model.base_model, "rotary_emb", None)
    head_dim = model.base_model.layers[0].self_attn.head_dim
    if rotary is None or rotary.inv_freq.numel() * 2 != head_dim:
        return "the fused decoder supports RoPE over the whole head dimension only"
    for i, layer in enumerate(model.base_model.layers):
        linears = [getattr(layer.self_attn, k) for k in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(layer.mlp, k) for k in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not nn.Linear for m in linears):
            kinds = sorted({type(m).__name__ for m in linears} - {"Linear"})
            return (f"the fused decoder needs plain nn.Linear projections (layer {i} has {', '.join(kinds)}); "
                    "load the model unpacked and unquantized")
    return None


def _fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias, zeros where a part has none) for linears that read the same input. Each
    module's parameters become views of it: the fused matrix is the only copy."""
    w = torch.cat([m.weight.detach() for m in linears])
    b = None
    if any(m.bias is not None for m in linears):
        b = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                       for m in linears])
    row = 0
    for m in linears:
        rows = m.out_features
        m.weight = nn.Parameter(w[row:row + rows], requires_grad=False)
        if m.bias is not None:
            m.bias = nn.Parameter(b[row:row + rows], requires_grad=False)
        row += rows
    return w, b


def _param(t: torch.Tensor | None):
    return None if t is None else nn.Parameter(t.detach(), requires_grad=False)


class FusedLayer(nn.Module):
    """One decoder layer's weights, fused: norms, qkv (+ bias), o (+ bias), gate_up (+ bias), down (+ bias)."""

    def __init__(self, layer):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_b = _fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up, gate_up_b = _fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.norm1, self.norm2 = _param(layer.input_layernorm.weight), _param(layer.post_attention_layernorm.weight)
        self.qkv, self.qkv_b = _param(qkv), _param(qkv_b)
        self.o, self.o_b = _param(attn.o_proj.weight), _param(attn.o_proj.bias)
        self.gate_up, self.gate_up_b = _param(gate_up), _param(gate_up_b)
        self.down, self.down_b = _param(mlp.down_proj.weight), _param(mlp.down_proj.bias)


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    scale: float

    @property
    def group(self) -> int:  # q heads per kv head
        return self.heads // self.kv_heads


def _residual_linear(residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """residual + x @ w.T (+ b), the add inside the matmul."""
    out = torch.addmm(residual, x, w.t())
    return out if b is None else out + b


# the CUDA attention kernel reads the mask in rows aligned to this many elements (it pads a copy otherwise)
MASK_ALIGN = 8


class FusedDecoder(nn.Module):
    """The decoder layers of a Qwen2 / Llama model, fused, over a KV cache of `max_cache_len` slots; the caller
    checks `unsupported_reason` first. Positions and slots are device tensors, so no step reads the host."""

    def __init__(self, model, max_cache_len: int):
        super().__init__()
        base = model.base_model
        attn = base.layers[0].self_attn
        cfg = model.config
        kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.dims = Dims(hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=kv_heads,
                         head_dim=attn.head_dim, inter=base.layers[0].mlp.gate_proj.out_features,
                         eps=base.layers[0].input_layernorm.variance_epsilon, scale=attn.scaling)
        with torch.no_grad():
            self.layers = nn.ModuleList(FusedLayer(layer) for layer in base.layers)
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        self.final_eps = base.norm.variance_epsilon
        d, dtype, dev = attn.head_dim, self.embed.dtype, self.embed.device
        # keys and values of a layer in one buffer, so one index_copy_ writes both
        self.kv_cache = [torch.zeros(2, kv_heads, max_cache_len, d, dtype=dtype, device=dev) for _ in base.layers]
        self.slots = torch.arange(max_cache_len, device=dev)  # slot ids, and the offsets 0..n-1 of a pass
        width = -(-max_cache_len // MASK_ALIGN) * MASK_ALIGN
        self.mask_cols = torch.arange(width, device=dev)  # the mask's columns, padded (sliced off after)
        self.rope = self._rope_table(base.rotary_emb, max_cache_len, d, dtype, dev)
        self.eye = torch.eye(d, dtype=dtype, device=dev)
        cols = torch.arange(d, device=dev)
        self.swap = torch.zeros(d, d, dtype=dtype, device=dev)  # swap[j, k] = 1 iff j = k +- d/2
        self.swap[(cols + d // 2) % d, cols] = 1
        self.fill = torch.tensor([torch.finfo(dtype).min, 0.0], dtype=dtype, device=dev)  # masked, visible
        for t in (*self.kv_cache, self.slots, self.mask_cols, self.rope, self.eye, self.swap, self.fill):
            torch._dynamo.mark_static_address(t)

    @staticmethod
    def _rope_table(rotary, max_cache_len: int, d: int, dtype, dev) -> torch.Tensor:
        """[max_cache_len, 2, head_dim]: cos and sign-folded sin per position, as Hugging Face's rotary
        module computes them (float32 product, cos/sin, attention scaling, cast):
        rotate_half(x)*sin = swap(x)*[-sin_lo, sin_hi]."""
        freqs = torch.arange(max_cache_len, device=dev).float()[:, None] * rotary.inv_freq.to(dev, torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * rotary.attention_scaling).to(dtype)
        sin = (emb.sin() * rotary.attention_scaling).to(dtype)
        sin[:, : d // 2].neg_()
        return torch.stack((cos, sin), dim=1)

    def kv_buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [1, kv_heads, max_cache_len, head_dim] (views of the layer's
        buffer): slot = dim 2."""
        return [(kv[:1], kv[1:]) for kv in self.kv_cache]

    def causal_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """Additive mask [n, max_cache_len]: slot j visible to the query at position i iff j <= i."""
        mask = torch.where(self.mask_cols > positions[:, None], self.fill[0], self.fill[1])
        return mask[:, :self.slots.shape[0]]

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.dims.hidden,), self.final_norm, self.final_eps)

    def rotations(self, positions: torch.Tensor) -> torch.Tensor:
        """[n * (group + 2), head_dim, head_dim]: per token, R_p for each of the group + 1 head groups of q
        and k (kv_heads heads each), then the identity for v's group: the RoPE matmul's right factors."""
        c, n = self.dims, positions.shape[0]
        cs = self.rope.index_select(0, positions)  # [n, 2, head_dim]
        rot = torch.addcmul(self.eye * cs[:, :1], self.swap, cs[:, 1:])  # R_p = diag(cos) + swap * sin
        shape = (n, c.group + 1, c.head_dim, c.head_dim)
        rot = torch.cat((rot[:, None].expand(shape), self.eye.expand(n, 1, c.head_dim, c.head_dim)), dim=1)
        return rot.view(-1, c.head_dim, c.head_dim)

    def forward(self, ids, positions, slots, mask):
        """ids [n] at position ids `positions` [n], K/V written to cache `slots` [n], attention under the
        additive mask [n, max_cache_len]: the residual stream [n, H] before the final norm."""
        if mask.stride(0) % MASK_ALIGN:  # a caller's mask (the tree hooks): aligned once, not per layer
            mask = F.pad(mask, (0, self.mask_cols.shape[0] - mask.shape[1]))[:, :mask.shape[1]]
        rot = self.rotations(positions)
        x = F.embedding(ids, self.embed)
        for w, kv in zip(self.layers, self.kv_cache):
            x = self._layer(w, x, rot, slots, mask, kv)
        return x

    def _layer(self, w: FusedLayer, x, rot, slots, mask, kv):
        c, n = self.dims, x.shape[0]
        h = F.rms_norm(x, (c.hidden,), w.norm1, c.eps)
        qkv = F.linear(h, w.qkv, w.qkv_b)  # [n, (heads + 2 kv_heads) * head_dim]
        # RoPE on q and k, identity on v: [n, group + 2, kv_heads, head_dim] = q groups, k, v
        qkv = torch.bmm(qkv.view(-1, c.kv_heads, c.head_dim), rot).view(n, c.group + 2, c.kv_heads, c.head_dim)
        kv.index_copy_(2, slots, qkv[:, c.group:].permute(1, 2, 0, 3))  # K and V, one write
        q = qkv[:, :c.group].reshape(n, c.heads, c.head_dim).transpose(0, 1).unsqueeze(0)  # a view
        o = F.scaled_dot_product_attention(q, kv[:1], kv[1:], attn_mask=mask, scale=c.scale,
                                           enable_gqa=c.group > 1)  # [1, heads, n, head_dim], token-major
        x = _residual_linear(x, o[0].transpose(0, 1).reshape(n, c.heads * c.head_dim), w.o, w.o_b)
        h = F.rms_norm(x, (c.hidden,), w.norm2, c.eps)
        gu = F.linear(h, w.gate_up, w.gate_up_b)
        return _residual_linear(x, F.silu(gu[:, :c.inter]) * gu[:, c.inter:], w.down, w.down_b)


# ---- counting what a step launches -----------------------------------------------------------------

# ops that launch nothing: views (is_view) and these allocations / aliases
_FREE = {"aten._unsafe_view", "aten.scalar_tensor", "aten.empty", "aten.empty_strided", "aten.lift_fresh",
         "aten.detach", "aten.alias"}
_HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal")


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it: `ops` all, `compute` those that do work (each is at
    least one kernel on a GPU), `host_reads` those that read a device value back to the host (a sync
    on CUDA, impossible inside a captured graph)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.compute: Counter = Counter()
        self.host_reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops += 1
        if name.startswith(_HOST_READS):
            self.host_reads.append(str(func))
        out = func(*args, **(kwargs or {}))
        if not (name in _FREE or func.is_view and _aliases(out, args[0])):  # a reshape may copy
            self.compute[name] += 1
        return out


def _aliases(out, inp) -> bool:
    first = out[0] if isinstance(out, (tuple, list)) else out
    return (isinstance(first, torch.Tensor) and isinstance(inp, torch.Tensor)
            and first.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr())


def _cuda_kernels(fwd, ids, n_logits) -> tuple[int, int]:
    """(kernels, memcpy + memset) the profiler records on the device for one fwd(ids, n_logits)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fwd(ids, n_logits)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = sum(e.name.startswith(("Memcpy", "Memset")) for e in events)
    return len(events) - copies, copies


def step_launches(lm, n: int = 1, n_logits: int = 1) -> dict:
    """What one forward of n tokens costs `lm` in launches at its current length; the runner and its counters
    are put back after. aten ops are counted on the eager step; cuda_kernels / cuda_copies (None off CUDA) are
    what the profiler records for a forward as the runner runs it (graph replay or compiled call)."""
    fwd = lm.forward
    ids = torch.zeros(n, dtype=torch.long, device=lm.device)
    length, saved = lm.length, lm.counters.saved()
    counter = OpCounter()
    kernels = copies = None
    try:
        with getattr(lm, "eager", contextlib.nullcontext)(), counter:
            fwd(ids, n_logits)
        lm.rollback(length)
        if torch.device(lm.device).type == "cuda":
            kernels, copies = _cuda_kernels(fwd, ids, n_logits)
            lm.rollback(length)
    finally:
        lm.counters.restore(saved)
    return {"aten_ops": counter.ops, "compute_ops": sum(counter.compute.values()), "by_op": dict(counter.compute),
            "host_reads": len(counter.host_reads), "cuda_kernels": kernels, "cuda_copies": copies}
