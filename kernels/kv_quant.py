"""Quantized KV rows: int8 or fp8 (e4m3) values with one float32 scale per token and KV head.

A quantized cache is a ``uint8`` tensor ``[..., slots, kv_heads, row_bytes]``: each (slot, head)
row holds ``head_dim`` one-byte values, zero padding to a multiple of four, the row's scale
(float32, ``amax / 127`` for int8, ``amax / 448`` for fp8), then zero padding to a multiple of
16 bytes (:data:`ROW_ALIGN`; 144 bytes for head_dim 128). The last padding lets the attention
kernels read rows in 16-byte loads: a row of 132 bytes starts only 4-byte aligned, and its codes
load four bytes at a time.

The scale lives in the row it scales, so every path that moves slot rows (gather and scatter of
a handover, pool-to-pool copies, a pool shared with another process, a tensor-parallel rank's
slice of the heads) moves the scales with them unchanged. A handover moves a row's first
:func:`packed_row_bytes` (values and scale, 132 for head_dim 128), never the alignment padding.
A slot is one token, so storing a new token never requantizes another.
"""

from __future__ import annotations

import torch

from kernels.kv_rows import (  # noqa: F401  # re-exported: the layout's numbers live there, torch-free
    QUANT_CODES,
    QUANT_MAX,
    ROW_ALIGN,
    SCALE_BYTES,
    is_quantized,
    packed_row_bytes,
    row_bytes,
    scale_offset,
)

_VALUE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def quantize_rows(x: torch.Tensor, kind: str, width: int | None = None) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` (any float dtype) as quantized rows ``[..., width]`` uint8:
    ``width`` :func:`row_bytes` (stored rows, the default) or :func:`packed_row_bytes` (moved)."""
    head_dim = x.shape[-1]
    width = row_bytes(head_dim) if width is None else width
    if width < packed_row_bytes(head_dim):
        raise ValueError(f"rows of head_dim {head_dim} need {packed_row_bytes(head_dim)} bytes, not {width}")
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # Divided by a tensor, not a Python number: CUDA divides by a number as a product with its
    # reciprocal, which rounds differently from the division the CPU and the Triton store do.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, QUANT_MAX[kind]), torch.ones_like(amax))
    scaled = xf / scale
    if kind == "int8":
        values = scaled.round().clamp(-127.0, 127.0).to(torch.int8)
    else:
        values = scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    out = torch.zeros((*x.shape[:-1], width), dtype=torch.uint8, device=x.device)
    out[..., :head_dim] = values.view(torch.uint8)
    at = scale_offset(head_dim)
    out[..., at : at + SCALE_BYTES] = scale.view(torch.uint8)
    return out


def row_scales(packed: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The float32 scales of quantized rows ``[..., width]`` (stored or moved), ``[..., 1]``
    (a view when it can be)."""
    at = scale_offset(head_dim)
    tail = packed[..., at : at + SCALE_BYTES]
    try:
        return tail.view(torch.float32)
    except RuntimeError:
        return tail.contiguous().view(torch.float32)


def dequantize_rows(packed: torch.Tensor, kind: str, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Quantized rows ``[..., width]`` (stored or moved) back to ``[..., head_dim]`` in ``dtype``
    (computed in float32)."""
    values = packed[..., :head_dim].view(_VALUE_DTYPES[kind])
    return (values.float() * row_scales(packed, head_dim)).to(dtype)


def convert_rows(rows: torch.Tensor, src_kind: str, dst_kind: str, head_dim: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """Rows in one KV kind as another: quantized (as moved rows, :func:`packed_row_bytes`) or
    dequantized (``dtype``: the model's) as needed; the rows themselves when both kinds are the same."""
    if src_kind == dst_kind:
        return rows
    if is_quantized(src_kind):
        rows = dequantize_rows(rows, src_kind, head_dim, dtype)
    if is_quantized(dst_kind):
        return quantize_rows(rows, dst_kind, packed_row_bytes(head_dim))
    return rows.to(dtype)
