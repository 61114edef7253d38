"""Device helpers the kernels call: ``@triton.jit`` functions that Triton inlines into each caller,
so a kernel built from them compiles to the same code as one written out in full.

They live apart from the kernel modules, which name only launchable kernels (the interpreter tests
count those).
"""

from __future__ import annotations

from kernels._triton import tl, triton


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, slots, kv_head, d, mask, stride_ks, stride_kh, stride_vs, stride_vh):
    """Keys and values ``[BLOCK_N, BLOCK_D]`` of one kv head at ``slots``; masked elements read 0."""
    k = tl.load(k_cache_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def attend_tile(q, k, v, acc, m_i, l_i, scale_log2, n, n_ok, q_pos, DOT_PRECISION: tl.constexpr):
    """One online-softmax step of flash attention (base 2): the rows of ``q`` attend to the K/V
    tile of key positions ``n``; returns the updated ``(acc, m_i, l_i)``.

    Masks: ``n_ok`` (keys that exist) None: every key counts; ``q_pos`` (each row's position)
    None: no causal mask. With one, a row sees keys up to its own position, so a row can have
    seen no key yet; its max stays -inf and the shift is 0 there, to avoid inf - inf.
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if q_pos is not None:
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
    elif n_ok is not None:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if q_pos is not None:
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def attend_keys(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head, d, d_ok, start, end, scale_log2,
                stride_ks, stride_kh, stride_vs, stride_vh, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """:func:`attend_tile` over key positions ``[start, end)`` of one sequence, ``BLOCK_N`` at a
    time, each tile's slots read from its request-table row ``table_row``."""
    n_offs = tl.arange(0, BLOCK_N)
    for first in range(start, end, BLOCK_N):
        n = first + n_offs
        n_ok = n < end
        slots = tl.load(table_row + n, mask=n_ok, other=0).to(tl.int64)
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, slots, kv_head, d, n_ok[:, None] & d_ok[None, :],
                            stride_ks, stride_kh, stride_vs, stride_vh)
        acc, m_i, l_i = attend_tile(q, k, v, acc, m_i, l_i, scale_log2, n, n_ok, None, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def rotate_heads(src_ptr, dst_ptr, num_heads, stride_h, stride_oh, d, dmask, c1, c2, s1, s2,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate-half of one token's ``num_heads`` heads, ``BLOCK_H`` at a time, in float32; ``src_ptr``
    and ``dst_ptr`` point at the token's first head, ``c1, c2, s1, s2`` are its cos/sin halves."""
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = (h < num_heads)[:, None] & dmask[None, :]
        src = src_ptr + h[:, None] * stride_h + d[None, :]
        dst = dst_ptr + h[:, None] * stride_oh + d[None, :]
        x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        tl.store(dst, x1 * c1 - x2 * s1, mask=m)
        tl.store(dst + HALF, x2 * c2 + x1 * s2, mask=m)
