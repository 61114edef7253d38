"""Gather KV slots into one contiguous buffer for transfer, and scatter it back.

A buffer's rows may be narrower than the caches': a quantized cache's rows are padded to 16
bytes for the attention kernels (:mod:`kernels.kv_quant`), and a handover moves only their
first bytes (values and scale). Gathering takes the width to read; scattering writes each
buffer row into the first bytes of its cache row, leaving the padding as it is.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require_triton, tl, triton, use_triton
from kernels.kv_quant import convert_rows, is_quantized

_MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert_kv(buffer: torch.Tensor, src_kind: str, dst_kind: str, head_dim: int) -> torch.Tensor:
    """Gathered KV ``[2, L, N, Hkv, row]`` stored as ``src_kind`` (a model dtype, int8 or
    fp8_e4m3) in ``dst_kind``'s rows: what a P sends a D whose cache stores another KV dtype.
    Between a model dtype and a quantized kind the values pass through float32, so a quantized
    D's scales are the ones its own store would have computed."""
    if src_kind == dst_kind:
        return buffer
    model_dtype = _MODEL_DTYPES.get(dst_kind) or _MODEL_DTYPES.get(src_kind) or torch.float32
    if is_quantized(src_kind) and is_quantized(dst_kind):
        model_dtype = torch.float32
    return convert_rows(buffer, src_kind, dst_kind, head_dim, model_dtype).contiguous()


def _narrow(cache: torch.Tensor, width: int | None) -> torch.Tensor:
    """The first ``width`` elements of each row of ``cache`` (a view; all of them for None)."""
    if width is None or width == cache.shape[-1]:
        return cache
    if width > cache.shape[-1]:
        raise ValueError(f"rows of {width} elements do not fit a cache's rows of {cache.shape[-1]}")
    return cache[..., :width]


def gather_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  width: int | None = None) -> torch.Tensor:
    """Copy the slots of every layer into ``[2, L, N, Hkv, W]`` (keys, then values).

    Caches: ``[L, S, Hkv, D]``; slots: ``[N]`` int64; ``width``: the first ``W`` elements of
    each row (None: all ``D``).
    """
    k_cache, v_cache = _narrow(k_cache, width), _narrow(v_cache, width)
    return torch.stack((k_cache[:, slots], v_cache[:, slots]))


def scatter_kv_ref(
    buffer: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Inverse of :func:`gather_kv_ref`: write ``buffer`` into the slots (the first
    ``buffer.shape[-1]`` elements of their rows), in place."""
    width = buffer.shape[-1]
    _narrow(k_cache, width)[:, slots] = buffer[0]
    _narrow(v_cache, width)[:, slots] = buffer[1]


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


def gather_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     width: int | None = None) -> torch.Tensor:
    """Triton version of :func:`gather_kv_ref`."""
    require_triton()
    k_cache, v_cache = _narrow(k_cache, width), _narrow(v_cache, width)
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
    width = buffer.shape[-1]
    _launch_copy(buffer, _narrow(k_cache, width), _narrow(v_cache, width), slots, to_buffer=False)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              width: int | None = None) -> torch.Tensor:
    """Triton on CUDA tensors when Triton is installed, else :func:`gather_kv_ref`."""
    if use_triton(k_cache, v_cache):
        return gather_kv_triton(k_cache, v_cache, slots, width)
    return gather_kv_ref(k_cache, v_cache, slots, width)


def scatter_kv(buffer: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Triton on CUDA tensors when Triton is installed, else :func:`scatter_kv_ref`."""
    if use_triton(buffer, k_cache, v_cache):
        scatter_kv_triton(buffer, k_cache, v_cache, slots)
    else:
        scatter_kv_ref(buffer, k_cache, v_cache, slots)



# ---- pool to pool ------------------------------------------------------------------------------


def copy_kv_slots_ref(
    src_k: torch.Tensor, src_v: torch.Tensor, src_slots: torch.Tensor,
    dst_k: torch.Tensor, dst_v: torch.Tensor, dst_slots: torch.Tensor,
) -> None:
    """Copy every layer's keys and values of ``src_slots`` into ``dst_slots`` of other caches.

    Caches: ``[L, S, Hkv, D]`` (the two pools may differ in S); slots: ``[N]`` int64 each. The
    direct move of a prompt's KV into the slots another process reserved for it, with no
    buffer in between. Across devices the rows pass through a buffer on the source device.
    """
    if src_k.device == dst_k.device:
        dst_k[:, dst_slots] = src_k[:, src_slots]
        dst_v[:, dst_slots] = src_v[:, src_slots]
        return
    rows = gather_kv_ref(src_k, src_v, src_slots).to(dst_k.device, non_blocking=True)
    scatter_kv_ref(rows, dst_k, dst_v, dst_slots.to(dst_k.device, non_blocking=True))


@triton.jit
def _copy_slots_kernel(
    src_k_ptr, src_v_ptr, src_slots_ptr, dst_k_ptr, dst_v_ptr, dst_slots_ptr,
    num_heads, head_dim,
    s_kl, s_ks, s_kh, s_vl, s_vs, s_vh,
    d_kl, d_ks, d_kh, d_vl, d_vs, d_vh,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Program (token, layer): one slot's keys and values of one layer, source pool to target pool.
    i = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    src = tl.load(src_slots_ptr + i).to(tl.int64)
    dst = tl.load(dst_slots_ptr + i).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = (h < num_heads)[:, None] & (d < head_dim)[None, :]
        k = tl.load(src_k_ptr + layer * s_kl + src * s_ks + h[:, None] * s_kh + d[None, :], mask=m)
        tl.store(dst_k_ptr + layer * d_kl + dst * d_ks + h[:, None] * d_kh + d[None, :], k, mask=m)
        v = tl.load(src_v_ptr + layer * s_vl + src * s_vs + h[:, None] * s_vh + d[None, :], mask=m)
        tl.store(dst_v_ptr + layer * d_vl + dst * d_vs + h[:, None] * d_vh + d[None, :], v, mask=m)


def copy_kv_slots_triton(
    src_k: torch.Tensor, src_v: torch.Tensor, src_slots: torch.Tensor,
    dst_k: torch.Tensor, dst_v: torch.Tensor, dst_slots: torch.Tensor,
) -> None:
    """Triton version of :func:`copy_kv_slots_ref` for two pools on one device: one launch."""
    require_triton()
    if src_k.device != dst_k.device:
        copy_kv_slots_ref(src_k, src_v, src_slots, dst_k, dst_v, dst_slots)
        return
    for t in (src_k, src_v, dst_k, dst_v):
        if t.stride(-1) != 1:
            raise ValueError("caches must be contiguous in head_dim")
    num_layers, _, num_heads, head_dim = src_k.shape
    n = src_slots.shape[0]
    if n != dst_slots.shape[0]:
        raise ValueError(f"{n} source slots for {dst_slots.shape[0]} target slots")
    if n == 0 or num_layers == 0:
        return
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_heads), max(1, 4096 // block_d))
    _copy_slots_kernel[(n, num_layers)](
        src_k, src_v, src_slots, dst_k, dst_v, dst_slots, num_heads, head_dim,
        src_k.stride(0), src_k.stride(1), src_k.stride(2), src_v.stride(0), src_v.stride(1), src_v.stride(2),
        dst_k.stride(0), dst_k.stride(1), dst_k.stride(2), dst_v.stride(0), dst_v.stride(1), dst_v.stride(2),
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )


def copy_kv_slots(
    src_k: torch.Tensor, src_v: torch.Tensor, src_slots: torch.Tensor,
    dst_k: torch.Tensor, dst_v: torch.Tensor, dst_slots: torch.Tensor,
) -> None:
    """Triton on CUDA tensors when Triton is installed, else :func:`copy_kv_slots_ref`."""
    if use_triton(src_k, dst_k):
        copy_kv_slots_triton(src_k, src_v, src_slots, dst_k, dst_v, dst_slots)
    else:
        copy_kv_slots_ref(src_k, src_v, src_slots, dst_k, dst_v, dst_slots)
