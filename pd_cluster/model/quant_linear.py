"""8-bit linear projections: weights stored as int8 or float8 (e4m3) with one float32 scale per
output channel (symmetric), the weight being ``qweight * scale[:, None]``.

Decode reads every weight byte each step, so halving the bytes (against bfloat16) is what the
quantized weights buy. Decode's few-row projections read the 8-bit weights directly
(:mod:`kernels.gemv`); larger products run ``torch._scaled_mm`` on a GPU with FP8 tensor cores
(dynamic per-token activation scales, quantized by one kernel). Decode batches on Hopper GPUs
take Triton GEMMs made for reading the weight: up to 128 rows of int8 (8 of fp8) the weight-only
GEMM of :mod:`kernels.quant_matmul`, fp8 batches of up to 64 rows the scaled product's own
numbers by :mod:`kernels.fp8_gemm`. Elsewhere the input multiplies the 8-bit weight in the
input's dtype (exact there) and the product is scaled per channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kernels._triton import use_triton
from kernels.fp8_gemm import FP8_GEMM_MAX_ROWS, fp8_gemm_triton
from kernels.gemv import scaled_linear_ref
from kernels.quant_matmul import (
    FP8_WEIGHT_ONLY_MAX_ROWS,
    WEIGHT_ONLY_MAX_ROWS,
    act_quant_fp8_ref,
    act_quant_fp8_triton,
    weight_only_linear_triton,
)

#: ``--quantization``: none, or the 8-bit format(s) the projections' weights are held in.
Quantization = Literal["none", "int8", "fp8", "fp8_mixed"]
QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "fp8", "fp8_mixed")
#: The projection kinds a layer holds (an expert's gate/up and down count as gate_up and down).
PROJECTIONS: tuple[str, ...] = ("qkv", "o", "gate_up", "down")
#: ``fp8_mixed``: e4m3 except the MLP's gate/up, held int8. e4m3's 3 mantissa bits round every
#: weight by up to 1/16 of itself, whatever the scale (per-group scales do not help); gate/up is
#: where that costs the default model most (see docs/benchmarks), and int8's error there is a
#: third of e4m3's at the same bytes.
MIXED: dict[str, str] = {"qkv": "fp8", "o": "fp8", "gate_up": "int8", "down": "fp8"}
FP8 = torch.float8_e4m3fn
#: The largest magnitude each format holds: a channel's amax maps onto it.
QMAX = {"int8": 127.0, "fp8": 448.0}
QDTYPE = {"int8": torch.int8, "fp8": FP8}


@dataclass
class QuantLinear:
    """One projection's (or a stack of experts') 8-bit weight and per-output-channel scale."""

    qweight: torch.Tensor  # [..., out, in] int8 or float8_e4m3fn
    scale: torch.Tensor  # [..., out] float32

    @property
    def method(self) -> str:
        return "fp8" if self.qweight.dtype == FP8 else "int8"

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scale]

    def __getitem__(self, index: int) -> QuantLinear:
        """Expert ``index`` of a stack."""
        return QuantLinear(self.qweight[index], self.scale[index])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight.float() * self.scale[..., None]).to(dtype)

    def columns(self, start: int, stop: int) -> QuantLinear:
        """Input columns ``[start, stop)`` (a row-parallel rank's part): every output channel
        keeps its whole row's scale."""
        return QuantLinear(self.qweight[..., start:stop].contiguous(), self.scale)


#: A projection's weight as the model holds it: a float matrix, or an 8-bit one with its scales.
Weight = torch.Tensor | QuantLinear


def projection_format(quantization: str, projection: str) -> str:
    """The 8-bit format ``--quantization`` holds a ``projection`` kind (of :data:`PROJECTIONS`) in."""
    if projection not in PROJECTIONS:
        raise ValueError(f"projection {projection!r}; expected one of {PROJECTIONS}")
    return MIXED[projection] if quantization == "fp8_mixed" else quantization


def quantize(weight: torch.Tensor, method: str) -> QuantLinear:
    """Symmetric per-output-channel quantization: scale = the channel's amax / the format's
    largest value (a zero channel gets scale 1 and zero codes)."""
    if method not in QMAX:
        raise ValueError(f"quantization {method!r}; expected one of {tuple(QMAX)}")
    w = weight.float()
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX[method], torch.ones_like(amax))
    scaled = w / scale[..., None]
    if method == "int8":
        return QuantLinear(scaled.round().clamp(-127, 127).to(torch.int8), scale.contiguous())
    return QuantLinear(scaled.clamp(-448.0, 448.0).to(FP8), scale.contiguous())


def fuse(parts: list[Weight], dtype: torch.dtype) -> Weight:
    """Row-concatenation of projections that share an input (q/k/v, gate/up): 8-bit when every
    part is, else all in ``dtype``."""
    if all(isinstance(p, QuantLinear) for p in parts) and len({p.qweight.dtype for p in parts}) == 1:
        return QuantLinear(torch.cat([p.qweight for p in parts]).contiguous(), torch.cat([p.scale for p in parts]))
    return torch.cat([p.dequantize(dtype) if isinstance(p, QuantLinear) else p for p in parts]).contiguous()


def stack(parts: list[Weight], dtype: torch.dtype) -> Weight:
    """Experts' projections stacked (expert ``e`` is index ``e``), 8-bit when every one is."""
    if all(isinstance(p, QuantLinear) for p in parts) and len({p.qweight.dtype for p in parts}) == 1:
        return QuantLinear(torch.stack([p.qweight for p in parts]), torch.stack([p.scale for p in parts]))
    return torch.stack([p.dequantize(dtype) if isinstance(p, QuantLinear) else p for p in parts])


def weight_args(weight: Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The matrix and scale (None for a float one) the kernels take."""
    if isinstance(weight, QuantLinear):
        return weight.qweight, weight.scale
    return weight, None


def scaled_mm_supported(x: torch.Tensor, weight: QuantLinear) -> bool:
    """``torch._scaled_mm`` with per-row and per-column scales: float8 weights on a CUDA GPU of
    compute capability 9.0 or later, dimensions multiples of 16, a 16-bit input."""
    if weight.qweight.dtype != FP8 or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    out_features, in_features = weight.qweight.shape[-2:]
    if out_features % 16 or in_features % 16 or x.shape[-1] != in_features:
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


def weight_only_supported(x: torch.Tensor, weight: QuantLinear) -> bool:
    """The weight-only GEMM (:mod:`kernels.quant_matmul`) for up to ``WEIGHT_ONLY_MAX_ROWS`` rows
    (FP8 weights: ``FP8_WEIGHT_ONLY_MAX_ROWS``, past which the scaled product is faster) of a
    16-bit input on CUDA: there the step reads weights, and 8-bit tiles converted in
    registers read half the bytes without the activations' quantization. Its tiles are sized for
    a Hopper SM's shared memory (compute capability 9.0 or later)."""
    if not use_triton(x) or x.dtype not in (torch.bfloat16, torch.float16) or weight.qweight.dim() != 2:
        return False
    limit = FP8_WEIGHT_ONLY_MAX_ROWS if weight.qweight.dtype == FP8 else WEIGHT_ONLY_MAX_ROWS
    if x.numel() // max(1, x.shape[-1]) > limit:
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


def fp8_scaled_mm(x: torch.Tensor, weight: QuantLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (qweight * scale).T`` on FP8 tensor cores: each input row quantized to float8 by its
    own amax (dynamic per-token scales), the product scaled by the rows' and channels' scales."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, x_scale = act_quant_fp8_triton(x2) if use_triton(x2) else act_quant_fp8_ref(x2)
    out = torch._scaled_mm(xq, weight.qweight.t(), scale_a=x_scale, scale_b=weight.scale[None, :],
                           out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], out.shape[-1])


def fp8_gemm_supported(x: torch.Tensor, weight: QuantLinear) -> bool:
    """The Triton FP8 GEMM (:mod:`kernels.fp8_gemm`) for decode batches past the weight-only GEMM's
    rows, up to ``FP8_GEMM_MAX_ROWS``: there ``_scaled_mm``'s tiles, made for large products, read
    the weight at well below the copy rate. Where the scaled product runs, on Triton."""
    rows = x.numel() // max(1, x.shape[-1])
    return rows <= FP8_GEMM_MAX_ROWS and use_triton(x) and scaled_mm_supported(x, weight) \
        and weight.qweight.dim() == 2


def fp8_gemm(x: torch.Tensor, weight: QuantLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fp8_scaled_mm`'s product (the same per-token codes and scales) by the Triton GEMM."""
    shape = x.shape
    xq, x_scale = act_quant_fp8_triton(x.reshape(-1, shape[-1]))
    out = fp8_gemm_triton(xq, x_scale, weight.qweight, weight.scale, x.dtype, bias)
    return out.reshape(*shape[:-1], out.shape[-1])


def fp8_codes_product(codes: torch.Tensor, scale: torch.Tensor, weight: QuantLinear, out_dtype: torch.dtype,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(codes * scale) @ (qweight * weight.scale).T (+ bias)`` for activations a kernel before
    already quantized per row (e4m3 ``codes`` ``[M, K]``, float32 ``scale`` ``[M, 1]``): the Triton
    GEMM up to ``FP8_GEMM_MAX_ROWS`` rows, ``torch._scaled_mm`` beyond."""
    if codes.shape[0] <= FP8_GEMM_MAX_ROWS and use_triton(codes) and weight.qweight.dim() == 2:
        return fp8_gemm_triton(codes, scale, weight.qweight, weight.scale, out_dtype, bias)
    out = torch._scaled_mm(codes, weight.qweight.t(), scale_a=scale, scale_b=weight.scale[None, :],
                           out_dtype=out_dtype)
    return out if bias is None else out + bias


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over a float or 8-bit weight (see the module's docstring for which path)."""
    if not isinstance(weight, QuantLinear):
        return F.linear(x, weight, bias)
    if weight_only_supported(x, weight):
        return weight_only_linear_triton(x, weight.qweight, weight.scale, bias)
    if fp8_gemm_supported(x, weight):
        return fp8_gemm(x, weight, bias)
    if scaled_mm_supported(x, weight):
        return fp8_scaled_mm(x, weight, bias)
    return scaled_linear_ref(x, weight.qweight, weight.scale, bias)
