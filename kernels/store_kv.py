"""Write a step's new keys and values into their KV slots."""

from __future__ import annotations

import torch

from kernels import _tiles
from kernels.kv_quant import QUANT_CODES, is_quantized, packed_row_bytes, quantize_rows, row_bytes, scale_offset
from kernels._triton import cdiv, last_dim_contiguous, next_pow2, require_triton, tl, triton, use_triton_kv


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    quant: str | None = None,
) -> None:
    """``k_cache[slots[i]] = k[i]`` (same for v), in place.

    k, v: ``[T, kv_heads, head_dim]``; caches: ``[num_slots, kv_heads, head_dim]``;
    slots: ``[T]`` int64. ``quant`` (int8, fp8_e4m3): the caches hold quantized rows
    (:mod:`kernels.kv_quant`) and each new row is quantized with its own scale; as the Triton
    store, it writes a row's values and scale, never its alignment padding.
    """
    if quant is not None:
        width = packed_row_bytes(k.shape[-1])
        k_cache[slots, :, :width] = quantize_rows(k, quant, width)
        v_cache[slots, :, :width] = quantize_rows(v, quant, width)
        return
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    num_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    SCALE_AT: tl.constexpr,
):
    # Program (token, head block): one slot's rows of keys and values.
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (h < num_heads)[:, None] & (d < head_dim)[None, :]
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if QUANT:
        # Quantized rows (strides in bytes): the codes and the zero padding up to the scale, then
        # the scale; the row's alignment padding after it is never written (it stays zero).
        k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=m, other=0.0)
        v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=m, other=0.0)
        h_ok = h < num_heads
        _tiles.store_quant_rows(k_cache_ptr + slot * stride_kcs + h * stride_kch, k.to(tl.float32), h_ok, d, QUANT,
                                SCALE_AT)
        _tiles.store_quant_rows(v_cache_ptr + slot * stride_vcs + h * stride_vch, v.to(tl.float32), h_ok, d, QUANT,
                                SCALE_AT)
    else:
        k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=m)
        v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=m)
        tl.store(k_cache_ptr + slot * stride_kcs + h[:, None] * stride_kch + d[None, :], k, mask=m)
        tl.store(v_cache_ptr + slot * stride_vcs + h[:, None] * stride_vch + d[None, :], v, mask=m)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    quant: str | None = None,
) -> None:
    """Triton version of :func:`store_kv_ref`; k and v may be strided views (a split qkv).
    ``quant``: each new (token, head) row quantized in the kernel into packed rows
    (:mod:`kernels.kv_quant`), the same bytes as :func:`kernels.kv_quant.quantize_rows` writes."""
    require_triton()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV caches must be contiguous in head_dim")
    if quant is not None and not is_quantized(quant):
        raise ValueError(f"unknown quantized KV kind {quant!r}")
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    num_tokens, num_heads, head_dim = k.shape
    if quant is not None and k_cache.shape[-1] != row_bytes(head_dim):
        raise ValueError(f"{quant} KV rows of head_dim {head_dim} are {row_bytes(head_dim)} bytes, "
                         f"the cache's {k_cache.shape[-1]}")
    if num_tokens == 0:
        return
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_heads), max(1, 2048 // block_d))
    _store_kv_kernel[(num_tokens, cdiv(num_heads, block_h))](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        num_heads,
        head_dim,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        QUANT=QUANT_CODES[quant],
        SCALE_AT=scale_offset(head_dim) if quant is not None else 0,
        num_warps=4,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    quant: str | None = None,
) -> None:
    """Triton on CUDA tensors when Triton is installed, else :func:`store_kv_ref`; ``quant`` as in
    :func:`store_kv_ref`."""
    if use_triton_kv(quant, k, k_cache):
        store_kv_triton(k, v, k_cache, v_cache, slots, quant)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slots, quant)
