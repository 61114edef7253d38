"""Gather KV slots into one contiguous buffer for transfer, and scatter it back."""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require_triton, tl, triton, use_triton


def gather_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Copy the slots of every layer into ``[2, L, N, Hkv, D]`` (keys, then values).

    Caches: ``[L, S, Hkv, D]``; slots: ``[N]`` int64.
    """
    return torch.stack((k_cache[:, slots], v_cache[:, slots]))


def scatter_kv_ref(
    buffer: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Inverse of :func:`gather_kv_ref`: write ``buffer`` into the slots, in place."""
    k_cache[:, slots] = buffer[0]
    v_cache[:, slots] = buffer[1]


@triton.jit
def _copy_kv_kernel(
    k_cache_ptr,
    v_cache_ptr,
    buf_ptr,
    slots_ptr,
    num_heads,
    head_dim,
    stride_cl,
    stride_cs,
    stride_ch,
    stride_vl,
    stride_vs,
    stride_vh,
    stride_bkv,
    stride_bl,
    stride_bn,
    stride_bh,
    TO_BUFFER: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program (slot index, layer): keys and values of one slot in one layer, both ways.
    i = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    k_row = k_cache_ptr + layer * stride_cl + slot * stride_cs
    v_row = v_cache_ptr + layer * stride_vl + slot * stride_vs
    bk_row = buf_ptr + layer * stride_bl + i * stride_bn
    bv_row = bk_row + stride_bkv
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = (h < num_heads)[:, None] & (d < head_dim)[None, :]
        k_off = h[:, None] * stride_ch + d[None, :]
        v_off = h[:, None] * stride_vh + d[None, :]
        b_off = h[:, None] * stride_bh + d[None, :]
        if TO_BUFFER:
            tl.store(bk_row + b_off, tl.load(k_row + k_off, mask=m), mask=m)
            tl.store(bv_row + b_off, tl.load(v_row + v_off, mask=m), mask=m)
        else:
            tl.store(k_row + k_off, tl.load(bk_row + b_off, mask=m), mask=m)
            tl.store(v_row + v_off, tl.load(bv_row + b_off, mask=m), mask=m)


def _launch_copy(
    buffer: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, to_buffer: bool
) -> None:
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or buffer.stride(-1) != 1:
        raise ValueError("caches and buffer must be contiguous in head_dim")
    num_layers, _, num_heads, head_dim = k_cache.shape
    num_slots = slots.shape[0]
    if num_slots == 0 or num_layers == 0:
        return
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_heads), max(1, 4096 // block_d))
    _copy_kv_kernel[(num_slots, num_layers)](
        k_cache,
        v_cache,
        buffer,
        slots,
        num_heads,
        head_dim,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        buffer.stride(0),
        buffer.stride(1),
        buffer.stride(2),
        buffer.stride(3),
        TO_BUFFER=to_buffer,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )


def gather_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`gather_kv_ref`."""
    require_triton()
    num_layers, _, num_heads, head_dim = k_cache.shape
    buffer = torch.empty(
        (2, num_layers, slots.shape[0], num_heads, head_dim), dtype=k_cache.dtype, device=k_cache.device
    )
    _launch_copy(buffer, k_cache, v_cache, slots, to_buffer=True)
    return buffer


def scatter_kv_triton(
    buffer: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Triton version of :func:`scatter_kv_ref` (the buffer is cast to the caches' dtype)."""
    require_triton()
    _launch_copy(buffer, k_cache, v_cache, slots, to_buffer=False)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Triton on CUDA tensors when Triton is installed, else :func:`gather_kv_ref`."""
    if use_triton(k_cache, v_cache):
        return gather_kv_triton(k_cache, v_cache, slots)
    return gather_kv_ref(k_cache, v_cache, slots)


def scatter_kv(buffer: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Triton on CUDA tensors when Triton is installed, else :func:`scatter_kv_ref`."""
    if use_triton(buffer, k_cache, v_cache):
        scatter_kv_triton(buffer, k_cache, v_cache, slots)
    else:
        scatter_kv_ref(buffer, k_cache, v_cache, slots)

