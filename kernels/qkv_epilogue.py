"""What a qkv projection's GEMM needs to finish its output itself (:mod:`kernels.fp8_gemm`): the
rows' positions and rotation tables, the heads, and where keys and values go.

A decode step of a few dozen rows on FP8 weights ran the qkv GEMM, then a kernel that only
rotated q and k and copied k and v to their slots. With :class:`QkvRotary` the GEMM's epilogue
does that (:mod:`kernels._rotary_epilogue`); where the GEMM splits its inputs, the kernel that adds
the parts does it instead (:func:`_split_sum_rotary_kernel`): either way one launch fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._rotary_epilogue import rotate_pair, store_head_part
from kernels._triton import next_pow2, pdl_options, pdl_wait, tl, triton, use_pdl


@dataclass(frozen=True)
class QkvRotary:
    """A qkv projection's rotary embedding and KV store: rows' ``positions`` ``[M]`` into the
    ``cos``/``sin`` tables ``[positions, head_dim]``; the output's columns ``num_heads`` q heads,
    then ``num_kv_heads`` k and v heads of ``head_dim``. With ``k_cache``, ``v_cache`` (of the
    output's dtype, ``[slots, kv_heads, head_dim]``) and ``slots``, k and v go to the caches and
    the product returns q alone ``[M, num_heads * head_dim]``; without, the whole output with q
    and k rotated (for a quantizing store after)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    k_cache: torch.Tensor | None = None
    v_cache: torch.Tensor | None = None
    slots: torch.Tensor | None = None

    @property
    def store_kv(self) -> bool:
        return self.k_cache is not None

    @property
    def columns(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def check(self, n: int, out_dtype: torch.dtype) -> None:
        """Raise ValueError unless this describes an output of ``n`` columns in ``out_dtype``."""
        if self.head_dim % 2 or n != self.columns:
            raise ValueError(f"{n} output columns for {self.num_heads}+2x{self.num_kv_heads} heads of {self.head_dim}")
        if self.cos.stride(-1) != 1 or self.sin.stride(-1) != 1:
            raise ValueError("rotation tables must be contiguous in head_dim")
        if self.store_kv:
            caches = (self.k_cache, self.v_cache)
            if self.slots is None or any(c is None or c.dtype != out_dtype or c.stride(-1) != 1 for c in caches):
                raise ValueError("KV caches of the output's dtype, contiguous in head_dim, and their slots")

    def out(self, m: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The tensor the product writes: q alone where k and v go to the caches, else all columns."""
        return torch.empty((m, self.num_heads * self.head_dim if self.store_kv else n), dtype=dtype, device=device)

    def kernel_args(self, out: torch.Tensor) -> tuple:
        """Pointers and strides in :func:`_split_sum_rotary_kernel`'s (and the GEMM's) order."""
        k_cache = self.k_cache if self.store_kv else out
        v_cache = self.v_cache if self.store_kv else out
        slots = self.slots if self.store_kv else self.positions
        return (self.positions, slots, self.cos, self.sin, k_cache, v_cache, self.cos.stride(0), self.sin.stride(0),
                k_cache.stride(0), k_cache.stride(1) if self.store_kv else 0, v_cache.stride(0),
                v_cache.stride(1) if self.store_kv else 0, self.num_heads, self.num_heads + self.num_kv_heads,
                self.num_kv_heads * self.head_dim)


@triton.jit
def _split_sum_rotary_kernel(part_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, N, stride_part, stride_out,
                             pos_ptr, slots_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_sin,
                             stride_ks, stride_kh, stride_vs, stride_vh, NUM_Q_HEADS, QK_HEADS, V_COLS,
                             HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_HALF: tl.constexpr, STORE_KV: tl.constexpr, USE_PDL: tl.constexpr):
    # Program: one head of one row. The parts of its two halves added in their order, scaled and
    # rounded as kernels.fp8_gemm's _split_sum_kernel does; q and k heads rotated; all stored.
    pdl_wait(USE_PDL)
    head = tl.program_id(0)
    row = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, BLOCK_HALF)
    rows = row + tl.arange(0, 1)  # a tile of one row, as the epilogue's helpers take rows
    ok = rows >= 0
    cols = head * HEAD_DIM + d
    mask = d < HALF
    x1 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
    x2 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        x1 += tl.load(part_ptr + s * stride_part + row * N + cols, mask=mask, other=0.0)
        x2 += tl.load(part_ptr + s * stride_part + row * N + cols + HALF, mask=mask, other=0.0)
    x_scale = tl.load(x_scale_ptr + row)
    x1 = x1 * x_scale * tl.load(w_scale_ptr + cols, mask=mask, other=0.0)
    x2 = x2 * x_scale * tl.load(w_scale_ptr + cols + HALF, mask=mask, other=0.0)
    if HAS_BIAS:
        x1 += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x2 += tl.load(bias_ptr + cols + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    x1 = x1.to(dtype).to(tl.float32)[None, :]  # the projection's output, as the unfused op stores it
    x2 = x2.to(dtype).to(tl.float32)[None, :]
    if STORE_KV:
        slot = tl.load(slots_ptr + rows).to(tl.int64)
    else:
        slot = rows.to(tl.int64)
    if head < QK_HEADS:
        pos = tl.load(pos_ptr + rows).to(tl.int64)
        x1, x2 = rotate_pair(x1, x2, pos, ok, d, cos_ptr, sin_ptr, stride_cos, stride_sin, HALF)
    store_head_part(x1, x2, rows, ok, d, head, slot, out_ptr, k_cache_ptr, v_cache_ptr, stride_out, stride_ks,
                    stride_kh, stride_vs, stride_vh, NUM_Q_HEADS, QK_HEADS, HEAD_DIM, STORE_KV)


def split_sum_rotary(parts: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                     out: torch.Tensor, rotary: QkvRotary) -> None:
    """Add the GEMM's float32 parts ``[splits, M, N]`` in order, scale them, add the bias and
    finish the qkv output as the GEMM's epilogue would (:class:`QkvRotary`) into ``out``."""
    splits, m, n = parts.shape
    pdl = use_pdl(parts)
    grid = (rotary.num_heads + 2 * rotary.num_kv_heads, m)
    _split_sum_rotary_kernel[grid](parts, x_scale, w_scale, bias if bias is not None else w_scale, out, n, m * n,
                                   out.stride(0), *rotary.kernel_args(out), HAS_BIAS=bias is not None, SPLITS=splits,
                                   HEAD_DIM=rotary.head_dim, BLOCK_HALF=next_pow2(rotary.head_dim // 2),
                                   STORE_KV=rotary.store_kv, USE_PDL=pdl, num_warps=1, **pdl_options(pdl))
