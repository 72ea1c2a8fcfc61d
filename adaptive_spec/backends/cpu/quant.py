"""Weight-only quantized linear layers for a cheaper torch draft, and the probes for their kernels. Only the
draft's proposals change; verification keeps the output exactly the target's."""
from __future__ import annotations

import torch

from ...errors import UserError, first_line
from ..quant_names import TORCH_DRAFT_QUANTS
from .machine import onednn_packed
from .packed import PackedLinear


QUANTS = ("none", *TORCH_DRAFT_QUANTS)


class QuantLinear(torch.nn.Module):
    """What the weight-only quantized draft layers share: `.weight` (dequantized), a dense GEMM for inputs of
    many rows, and densify() for batched work. Subclasses give `dequantized()` (float32 [out, in]) and
    `kernel(x2)` ([rows, in] in act_dtype -> [rows, out]). Activations enter the kernels in bf16 (the int8
    kernel's fp32-activation path is several times slower on a CPU)."""

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
        """Compute every input with a dense (oneDNN-packed where possible) copy of the dequantized weight in
        `dtype`: for batched work (datagen), where the kernels' per-row cost dominates (docs/datagen.md). The
        weights keep their quantized values; the copy is neither parameter nor buffer, so fingerprints and
        checkpoints do not see it."""
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
    """Weight-only int8 linear layer: symmetric per-output-channel scales, run by torch's `_weight_int8pack_mm`."""

    # `_weight_int8pack_mm` costs a fixed time per row: past this many a dense GEMM, dequantizing once per
    # call, wins
    dense_rows = 1024

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(self.act_dtype))
        self.bias = linear.bias
        self.weight_bytes = self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, act={self.act_dtype}"


class Int4Linear(QuantLinear):
    """Weight-only int4 linear layer: w = (q - 8) * scale + zero, q in 0..15, a scale and zero point per group of
    `group_size` input channels, run by torch's `_weight_int4pack_mm_for_cpu`."""

    group_size = 64

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        N, K, group_size = linear.out_features, linear.in_features, self.group_size
        if K % group_size or N % 16:
            raise UserError(f"int4 needs layers whose input size is a multiple of {group_size} and output size a "
                            f"multiple of 16 (the kernel's blocks); this draft has a {K} -> {N} layer; use "
                            "--draft-quant int8")
        self.in_features, self.out_features = K, N
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
    """QuantLinear.densify on every quantized layer of `model`, in the model's dtype; returns how many."""
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
        why = KERNEL_PROBES[quant](torch.device(device))  # the callers resolve "auto"
        if why:
            raise UserError(f"--draft-quant {quant} has no kernel on {device} ({why}); use --draft-quant none")
    return quant


def quantize_linears(model, quant: str = "int8") -> int:
    """Swap every nn.Linear of `model` for an Int8Linear or Int4Linear; returns how many. An embedding tied to
    the LM head keeps its own table."""
    cls, path = QUANT_LAYERS[quant]
    slots = [(mod, cname, child) for mod in model.modules() for cname, child in mod.named_children()
             if type(child) is torch.nn.Linear]
    for mod, cname, child in slots:
        setattr(mod, cname, cls(child))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    model.cpu_path = {"dtype": dtype, "linear": path, "pad_to": (), "quant": quant}
    return len(slots)
