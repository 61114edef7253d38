"""Device helpers that finish a qkv projection's output in the GEMM that computes it: rotary
embedding of the q and k columns, and the keys and values stored to their KV slots
(:mod:`kernels.fp8_gemm`). ``@triton.jit`` functions that Triton inlines into each caller.

A tile of rotary columns holds ``P`` pairs of one head: its first half the columns ``d`` of the
pairs, its second half their partners ``d + head_dim / 2`` (:func:`pair_columns` gives the
weight rows to load for that), so a tile rotates without its neighbours. The values it gets are
the projection's output already rounded to the model's dtype, as the unfused ops store it; the
rotation runs in float32 and is rounded again when stored, as ``rotary_store_kv`` does.
"""

from __future__ import annotations

from kernels._triton import INTERPRETED, tl, triton


@triton.jit
def pair_columns(pid_n, QK_HEADS, HEAD_DIM: tl.constexpr, BN: tl.constexpr):
    """The output columns of tile ``pid_n``: below the q and k heads' ``QK_HEADS * HEAD_DIM / BN``
    tiles, ``BN / 2`` rotary pairs (the pairs' first columns, then their partners); past them, ``BN``
    value columns in order."""
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIRS: tl.constexpr = BN // 2
    rot_tiles = QK_HEADS * HALF // PAIRS
    i = tl.arange(0, BN)
    pair = pid_n * PAIRS + i % PAIRS
    rot_col = (pair // HALF) * HEAD_DIM + pair % HALF + (i // PAIRS) * HALF
    return tl.where((i * 0 + pid_n) < rot_tiles, rot_col, QK_HEADS * HEAD_DIM + (pid_n - rot_tiles) * BN + i)


@triton.jit
def rotate_pair(x1, x2, pos, m_mask, d, cos_ptr, sin_ptr, stride_cos, stride_sin, HALF: tl.constexpr):
    """Rotate-half of pairs ``(x1, x2)`` ``[BM, P]`` (columns ``d`` and ``d + HALF`` of a head) at each
    row's position ``pos``, in float32: the rotated first and second halves."""
    mask = m_mask[:, None] & (d < HALF)[None, :]
    cs = pos[:, None] * stride_cos + d[None, :]
    sn = pos[:, None] * stride_sin + d[None, :]
    c1 = tl.load(cos_ptr + cs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + sn, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + sn + HALF, mask=mask, other=0.0).to(tl.float32)
    if INTERPRETED:  # numpy rounds every product, as the rotary kernel interpreted does
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    else:
        # The products fused as the compiler fuses ``rotate_heads``' (the rotary kernel's, sm_90):
        # x1's products in the FMAs, x2's rounded first. Left to it, this code's contraction differs
        # (the second half's other product fused), and a bfloat16 rounding near a tie lands an ulp away.
        return tl.fma(x1, c1, -(x2 * s1)), tl.fma(x1, s2, x2 * c2)


@triton.jit
def store_head_part(o1, o2, rm, m_mask, d, head, slot, out_ptr, k_cache_ptr, v_cache_ptr, stride_out, stride_ks,
                    stride_kh, stride_vs, stride_vh, NUM_Q_HEADS, QK_HEADS, HEAD_DIM: tl.constexpr,
                    STORE_KV: tl.constexpr):
    """Store columns ``d`` (``o1``) and ``d + HEAD_DIM / 2`` (``o2``), ``[BM, P]`` float32, of head
    ``head`` (q heads, then k, then v) for rows ``rm``: q to ``out`` (``[M, q columns]`` with
    ``STORE_KV``, else the whole ``[M, N]`` output, where k and v go too), k and v with ``STORE_KV``
    to their rows' KV slots ``slot``."""
    HALF: tl.constexpr = HEAD_DIM // 2
    mask = m_mask[:, None] & (d < HALF)[None, :]
    if STORE_KV:
        if head >= NUM_Q_HEADS:
            if head < QK_HEADS:
                dst = k_cache_ptr + slot[:, None] * stride_ks + (head - NUM_Q_HEADS) * stride_kh + d[None, :]
            else:
                dst = v_cache_ptr + slot[:, None] * stride_vs + (head - QK_HEADS) * stride_vh + d[None, :]
            tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            _store_halves(o1, o2, rm, mask, d, head, out_ptr, stride_out, HEAD_DIM)
    else:
        _store_halves(o1, o2, rm, mask, d, head, out_ptr, stride_out, HEAD_DIM)


@triton.jit
def _store_halves(o1, o2, rm, mask, d, head, out_ptr, stride_out, HEAD_DIM: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    dst = out_ptr + rm[:, None].to(tl.int64) * stride_out + head * HEAD_DIM + d[None, :]
    tl.store(dst, o1.to(dtype), mask=mask)
    tl.store(dst + HEAD_DIM // 2, o2.to(dtype), mask=mask)


@triton.jit
def store_qkv_tile(val, rm, m_mask, pid_n, out_ptr, pos_ptr, slots_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                   stride_out, stride_cos, stride_sin, stride_ks, stride_kh, stride_vs, stride_vh, NUM_Q_HEADS,
                   QK_HEADS, V_COLS, HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   STORE_KV: tl.constexpr):
    """Finish tile ``pid_n`` of :func:`pair_columns`' columns: ``val`` ``[BM, BN]`` the projection's
    float32 output, rounded here to ``out``'s dtype first; pairs rotated and stored (q, k), values
    stored as they are (to their slots with ``STORE_KV``)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIRS: tl.constexpr = BN // 2
    dtype = out_ptr.dtype.element_ty
    val = val.to(dtype).to(tl.float32)  # the projection's output, as the unfused op stores it
    rot_tiles = QK_HEADS * HALF // PAIRS
    if STORE_KV:
        slot = tl.load(slots_ptr + rm, mask=m_mask, other=0).to(tl.int64)
    else:
        slot = rm.to(tl.int64)
    if pid_n < rot_tiles:
        head = pid_n * PAIRS // HALF
        d = (pid_n * PAIRS) % HALF + tl.arange(0, PAIRS)
        pos = tl.load(pos_ptr + rm, mask=m_mask, other=0).to(tl.int64)
        x1, x2 = tl.split(tl.permute(tl.reshape(val, (BM, 2, PAIRS)), (0, 2, 1)))
        o1, o2 = rotate_pair(x1, x2, pos, m_mask, d, cos_ptr, sin_ptr, stride_cos, stride_sin, HALF)
        store_head_part(o1, o2, rm, m_mask, d, head, slot, out_ptr, k_cache_ptr, v_cache_ptr, stride_out, stride_ks,
                        stride_kh, stride_vs, stride_vh, NUM_Q_HEADS, QK_HEADS, HEAD_DIM, STORE_KV)
    else:
        col = (pid_n - rot_tiles) * BN + tl.arange(0, BN)
        mask = m_mask[:, None] & (col < V_COLS)[None, :]
        if STORE_KV:
            dst = v_cache_ptr + slot[:, None] * stride_vs + (col // HEAD_DIM * stride_vh + col % HEAD_DIM)[None, :]
        else:
            dst = out_ptr + rm[:, None].to(tl.int64) * stride_out + QK_HEADS * HEAD_DIM + col[None, :]
        tl.store(dst, val.to(dtype), mask=mask)
