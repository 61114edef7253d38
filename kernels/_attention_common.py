"""What the attention launchers share: the checks and setup of a launch over KV slots (caches
contiguous in head_dim, quantized rows aligned, the output's shape), and how q meets quantized codes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.kv_quant import QUANT_CODES, ROW_ALIGN
from kernels._triton import last_dim_contiguous, require_triton

_LOG2E = math.log2(math.e)


def _quant_code(quant: str | None, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The kernels' ``QUANT`` for caches holding ``quant`` rows: uint8, their slot and head strides
    multiples of 16 bytes (the kernels read rows in 16-byte units, :mod:`kernels.kv_quant`)."""
    if quant not in QUANT_CODES:
        raise ValueError(f"unknown quantized KV kind {quant!r}")
    if quant is not None and (k_cache.dtype != torch.uint8 or v_cache.dtype != torch.uint8):
        raise ValueError(f"{quant} KV caches hold uint8 rows, got {k_cache.dtype}")
    if quant is not None and any(c.stride(i) % ROW_ALIGN for c in (k_cache, v_cache) for i in (0, 1)):
        raise ValueError(f"{quant} KV rows must start at multiples of {ROW_ALIGN} bytes, got strides "
                         f"{k_cache.stride()[:2]} and {v_cache.stride()[:2]}")
    return QUANT_CODES[quant]


def _q_float16(quant: str | None, q: torch.Tensor, float16_codes: bool | None) -> bool:
    """Whether a kernel takes bfloat16 q as float16 (:func:`kernels._tiles.float16_rows`) for its
    products with quantized codes: by default for fp8 e4m3, whose codes convert to float16 in one
    instruction and to bfloat16 in two. ``float16_codes`` overrides it (for measuring)."""
    if quant is None or q.dtype != torch.bfloat16:
        return False
    return quant == "fp8_e4m3" if float16_codes is None else float16_codes


def _output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The tensor a kernel writes: ``out`` when given (q's shape and dtype, head_dim contiguous)."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"attention output {tuple(out.shape)} {out.dtype} does not fit q {tuple(q.shape)} {q.dtype}")
    return out


@dataclass(slots=True)
class AttentionLaunch:
    """A launch's checked inputs and the shapes both launchers derive from them."""

    q: torch.Tensor  # head_dim contiguous
    out: torch.Tensor  # what the kernels write
    quant_code: int  # the cache kind's ``QUANT``
    num_kv_heads: int
    group: int  # q heads per kv head


def attention_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None,
                     quant: str | None) -> AttentionLaunch:
    """Checks a launch's caches (:func:`_quant_code`) and output (:func:`_output_for`), q made
    contiguous in head_dim; raises ValueError on caches or an output the kernels cannot take."""
    require_triton()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV caches must be contiguous in head_dim")
    quant_code = _quant_code(quant, k_cache, v_cache)
    q = last_dim_contiguous(q)
    num_kv_heads = k_cache.shape[1]
    return AttentionLaunch(q, _output_for(q, out), quant_code, num_kv_heads, q.shape[1] // num_kv_heads)
