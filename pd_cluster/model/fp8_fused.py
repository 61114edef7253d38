"""RMSNorm or the SiLU gate, then a projection: where the projection is an FP8 scaled product
(float8 weights, more rows than the weight-only kernels take), the kernel before it writes the
activations' e4m3 codes and row scales directly (:mod:`kernels.fp8_act`), so its 16-bit output is
never written and read back by a separate quantization. Elsewhere the plain ops, as unfused.

The codes are those the unfused path quantizes, so the products are the same.

The qkv projection of a decode step that the FP8 GEMM serves also finishes its output there
(:func:`norm_qkv_rotary_fp8`): rotary embedding and the KV store in the GEMM's epilogue, not a
kernel of their own after it. The decode attention's merge writes the o projection's codes
(:func:`decode_attention_o_fp8`), and the gate/up GEMM gates its own output
(:func:`norm_gate_up_silu_down_fp8`).
"""

from __future__ import annotations

import torch

import kernels
from kernels._triton import use_triton
from kernels.fp8_act import rms_norm_quant_fp8_triton, silu_mul_quant_fp8_triton
from kernels.fp8_gated import GATED_MIN_ROWS, fp8_gate_up_silu_triton
from kernels.fp8_gemm import FP8_GEMM_MAX_ROWS, fp8_gemm_triton, rotary_epilogue_fits
from kernels.qkv_epilogue import QkvRotary
from pd_cluster.model.quant_linear import (FP8, QuantLinear, Weight, fp8_codes_product, linear, scaled_mm_supported,
                                           weight_only_supported)


def fused_fp8(x: torch.Tensor, weight: Weight) -> bool:
    """Whether ``linear(x, weight)`` would quantize ``x`` for ``torch._scaled_mm`` (an input
    shaped and typed as ``x``), which the kernel making ``x`` can do instead."""
    return (isinstance(weight, QuantLinear) and weight.qweight.dtype == FP8 and weight.qweight.dim() == 2
            and use_triton(x) and not weight_only_supported(x, weight) and scaled_mm_supported(x, weight))


def scaled_product(codes: torch.Tensor, scale: torch.Tensor, weight: QuantLinear, out_dtype: torch.dtype,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(codes * scale) @ (qweight * weight.scale).T`` on FP8 tensor cores, in ``out_dtype``: the
    FP8 GEMM for the few rows of a decode batch, ``torch._scaled_mm`` for more."""
    return fp8_codes_product(codes, scale, weight, out_dtype, bias)


def norm_then_linear(hidden: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: Weight, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear(rms_norm(hidden + residual), weight, bias)`` and the new residual stream."""
    same_dtype = norm_weight.dtype == hidden.dtype and (residual is None or residual.dtype == hidden.dtype)
    if same_dtype and fused_fp8(hidden, weight):
        codes, scale, residual = rms_norm_quant_fp8_triton(hidden, norm_weight, eps, residual)
        out = scaled_product(codes, scale, weight, hidden.dtype, bias)
        return out.reshape(*hidden.shape[:-1], out.shape[-1]), residual
    x, residual = kernels.rms_norm(hidden, norm_weight, eps, residual)
    return linear(x, weight, bias), residual


def silu_then_linear(gate_up: torch.Tensor, weight: Weight) -> torch.Tensor:
    """``linear(silu_mul(gate_up), weight)``."""
    half = gate_up[..., : gate_up.shape[-1] // 2]
    if fused_fp8(half, weight):
        codes, scale = silu_mul_quant_fp8_triton(gate_up)
        out = scaled_product(codes, scale, weight, gate_up.dtype)
        return out.reshape(*gate_up.shape[:-1], out.shape[-1])
    return linear(kernels.silu_mul(gate_up), weight)


def _shaped(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A tensor of ``x``'s dtype and device shaped ``[rows, cols]`` (one element's storage): what
    the support checks read of a projection's input before it exists."""
    return x.new_empty((1, 1)).expand(rows, cols)


def norm_gate_up_silu_down_fp8(hidden: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                               eps: float, gate_up: Weight, down: Weight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``silu_then_linear(norm_then_linear(...gate_up), down)`` and the new residual stream, where
    the FP8 GEMM serves both products and the rows are :data:`~kernels.fp8_gated.GATED_MIN_ROWS` or
    more (a decode batch): the gate/up GEMM gates its output and the down projection's codes follow
    in one launch (:mod:`kernels.fp8_gated`), no gate/up output written and read back. None where it
    does not serve (the caller runs the ops)."""
    same_dtype = norm_weight.dtype == hidden.dtype and (residual is None or residual.dtype == hidden.dtype)
    rows = hidden.numel() // max(1, hidden.shape[-1])
    if not (same_dtype and GATED_MIN_ROWS <= rows <= FP8_GEMM_MAX_ROWS and isinstance(gate_up, QuantLinear)
            and isinstance(down, QuantLinear) and gate_up.qweight.shape[0] == 2 * down.qweight.shape[-1]
            and fused_fp8(hidden, gate_up) and fused_fp8(_shaped(hidden, rows, down.qweight.shape[-1]), down)):
        return None
    codes, scale, residual = rms_norm_quant_fp8_triton(hidden, norm_weight, eps, residual)
    gated, gated_scale = fp8_gate_up_silu_triton(codes, scale, gate_up.qweight, gate_up.scale, hidden.dtype)
    out = scaled_product(gated, gated_scale, down, hidden.dtype)
    return out.reshape(*hidden.shape[:-1], out.shape[-1]), residual


def norm_qkv_rotary_fp8(hidden: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: Weight, bias: torch.Tensor | None, rotary: QkvRotary,
                        quant: str | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``norm_then_linear`` into the qkv projection, then ``rotary_store_kv``, where the FP8 GEMM
    serves the projection: the rotated q ``[T, heads, head_dim]`` and the new residual stream, k and
    v stored to ``rotary``'s caches at its slots. The GEMM rotates q and k and stores k and v
    itself; into quantized caches (``quant``) it writes k and v rotated to its output, and the
    quantizing store follows. None where the GEMM does not serve (the caller runs the ops)."""
    same_dtype = norm_weight.dtype == hidden.dtype and (residual is None or residual.dtype == hidden.dtype)
    rows = hidden.numel() // max(1, hidden.shape[-1])
    if not (same_dtype and 0 < rows <= FP8_GEMM_MAX_ROWS and fused_fp8(hidden, weight)):
        return None
    n, k = weight.qweight.shape
    if not rotary_epilogue_fits(rows, n, k, rotary.head_dim):
        return None
    codes, scale, residual = rms_norm_quant_fp8_triton(hidden, norm_weight, eps, residual)
    heads, head_dim = rotary.num_heads, rotary.head_dim
    if quant is None:
        q = fp8_gemm_triton(codes, scale, weight.qweight, weight.scale, hidden.dtype, bias, rotary=rotary)
        return q.view(rows, heads, head_dim), residual
    apart = QkvRotary(rotary.positions, rotary.cos, rotary.sin, heads, rotary.num_kv_heads, head_dim)
    qkv = fp8_gemm_triton(codes, scale, weight.qweight, weight.scale, hidden.dtype, bias, rotary=apart)
    q, k_new, v_new = qkv.split((heads * head_dim, rotary.num_kv_heads * head_dim, rotary.num_kv_heads * head_dim), -1)
    kernels.store_kv(k_new.view(rows, -1, head_dim), v_new.view(rows, -1, head_dim), rotary.k_cache, rotary.v_cache,
                     rotary.slots, quant)
    return q.view(rows, heads, head_dim), residual


def decode_attention_o_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_table: torch.Tensor,
                           ctx_lens: torch.Tensor, sm_scale: float, table_rows: torch.Tensor | None,
                           quant: str | None, weight: Weight) -> torch.Tensor | None:
    """``linear(decode_attention(q, ...), weight)`` of a decode step's rows ``q`` ``[T, heads,
    head_dim]``, where the projection is an FP8 scaled product: the attention's split merge writes
    the codes (:func:`kernels.decode_attention_codes`). None where it is not (the caller runs the
    ops)."""
    if not fused_fp8(q.reshape(q.shape[0], -1), weight):
        return None
    codes, scale = kernels.decode_attention_codes(q, k_cache, v_cache, slot_table, ctx_lens, sm_scale,
                                                  table_rows=table_rows, quant=quant)
    return scaled_product(codes, scale, weight, q.dtype)
