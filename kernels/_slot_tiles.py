"""Device helpers of :mod:`kernels.decode_slots`: ``@triton.jit`` functions inlined into its
split kernel, which reads a tile of slots for several kv heads at once (``[H, D, N]`` keys,
``[H, N, D]`` values) and attends every q row of those heads to it.
"""

from __future__ import annotations

from kernels._tiles import e4m3_word_to_f16, int8_word_to_f16
from kernels._triton import tl, triton


@triton.jit
def load_raw(cache_ptr, slots, h, d, n_ok, stride_s, stride_h, TRANSPOSED: tl.constexpr, SCALE_AT: tl.constexpr,
              QUANT: tl.constexpr, WORDS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One cache's tile at ``slots`` ``[N]`` for heads ``h`` ``[H]`` as read, and its scales.

    The tile: ``[H, D, N]`` (``TRANSPOSED``, keys) or ``[H, N, D]`` (values) of the cache's
    elements; with ``WORDS`` (quantized values) ``[H, N, D // 4]`` 32-bit words of four codes.
    The scales ``[H, N]``: quantized rows' float32 scales (0 for slots past the end), 1.0
    placeholders for 16-bit rows. Slots past the end read zeros, never the cache (a stale slot's
    codes may be NaN)."""
    if QUANT:
        # Byte offsets in 16-byte units times 16: every row start is known 16-byte aligned.
        rows = (slots[None, :] * (stride_s // 16) + h[:, None] * (stride_h // 16)) * 16  # [H, N]
        scale = tl.load((cache_ptr + rows + SCALE_AT).to(tl.pointer_type(tl.float32)), mask=n_ok[None, :],
                        other=0.0)
    else:
        rows = slots[None, :] * stride_s + h[:, None] * stride_h
        scale = tl.full([h.shape[0], slots.shape[0]], 1.0, tl.float32)
    # Elements past head_dim (a head_dim short of a power of two) are not read.
    if TRANSPOSED:
        mask = n_ok[None, None, :]
        if HEAD_DIM < d.shape[0]:
            mask = mask & (d < HEAD_DIM)[None, :, None]
        raw = tl.load(cache_ptr + rows[:, None, :] + d[None, :, None], mask=mask, other=0)
    elif WORDS:
        w = tl.arange(0, d.shape[0] // 4)
        mask = n_ok[None, :, None]
        if HEAD_DIM < d.shape[0]:
            mask = mask & (w < (HEAD_DIM + 3) // 4)[None, None, :]
        raw = tl.load((cache_ptr + rows).to(tl.pointer_type(tl.int32))[:, :, None] + w[None, None, :], mask=mask,
                      other=0)
    else:
        mask = n_ok[None, :, None]
        if HEAD_DIM < d.shape[0]:
            mask = mask & (d < HEAD_DIM)[None, None, :]
        raw = tl.load(cache_ptr + rows[:, :, None] + d[None, None, :], mask=mask, other=0)
    return raw, scale


@triton.jit
def load_kv(k_cache_ptr, v_cache_ptr, slots, h, d, n_ok, stride_ks, stride_kh, stride_vs, stride_vh,
             SCALE_AT: tl.constexpr, QUANT: tl.constexpr, WORDS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Keys ``[H, D, N]`` and values ``[H, N, D]`` (words where ``WORDS``) at ``slots`` as read,
    with their scales (:func:`load_raw`)."""
    k_raw, k_scale = load_raw(k_cache_ptr, slots, h, d, n_ok, stride_ks, stride_kh, True, SCALE_AT, QUANT, False,
                               HEAD_DIM)
    v_raw, v_scale = load_raw(v_cache_ptr, slots, h, d, n_ok, stride_vs, stride_vh, False, SCALE_AT, QUANT, WORDS,
                               HEAD_DIM)
    return k_raw, k_scale, v_raw, v_scale


@triton.jit
def tile_values(raw, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, WORDS: tl.constexpr, dtype: tl.constexpr):
    """A tile :func:`load_raw` read as the products take it: codes converted to ``dtype``
    (exact), words of codes to float16 (:func:`words_f16`), 16-bit elements as read."""
    if WORDS:
        return words_f16(raw, BLOCK_D, QUANT)
    elif QUANT == 1:
        return raw.to(tl.int8, bitcast=True).to(dtype)
    elif QUANT == 2:
        return raw.to(tl.float8e4nv, bitcast=True).to(dtype)
    else:
        return raw.to(dtype)


@triton.jit
def attend(q, k, k_scale, v, v_scale, n_ok, acc, m_i, l_i, qk_scale, QUANT: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    """One online-softmax step (base 2) of every q row ``[H, G]`` over a tile: keys ``k``
    ``[H, D, N]``, values ``v`` ``[H, N, D]``. Quantized: each key's scale multiplies its scores,
    each value's scale enters its key's score as its log2 (0 for slots past the end: -inf, which
    masks them), so the weights the product takes carry it and the sum of weights divides it
    back out (``V_IN_SHIFT`` of :func:`kernels._tiles.attend_tile`)."""
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale[:, :, None]  # [H, G, N]
    if QUANT:
        v_log = tl.log2(v_scale)
        s = s * k_scale[:, None, :] + v_log[:, None, :]
    else:
        s = tl.where(n_ok[None, None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=2))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, :, None])
    if QUANT:
        l_i = l_i * alpha + tl.sum(p * tl.where(v_scale > 0.0, tl.exp2(-v_log), 0.0)[:, None, :], axis=2)
    else:
        l_i = l_i * alpha + tl.sum(p, axis=2)
    acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def words_f16(words, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
    """Words of four codes ``[H, N, BLOCK_D // 4]``, int8 (``QUANT`` 1) or fp8 e4m3 (2), as the
    float16 tile ``[H, N, BLOCK_D]`` (exact), as :func:`kernels._tiles.code_words_f16` for 2-D tiles."""
    if QUANT == 1:
        c0, c1, c2, c3 = int8_word_to_f16(words)
    else:
        c0, c1, c2, c3 = e4m3_word_to_f16(words)
    codes = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    return tl.reshape(codes, (words.shape[0], words.shape[1], BLOCK_D))
