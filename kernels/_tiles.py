"""Device helpers the kernels call: ``@triton.jit`` functions that Triton inlines into each caller,
so a kernel built from them compiles to the same code as one written out in full.

They live apart from the kernel modules, which name only launchable kernels (the interpreter tests
count those).
"""

from __future__ import annotations

from kernels._triton import tl, triton


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, slots, kv_head, d, mask, stride_ks, stride_kh, stride_vs, stride_vh,
                 row_ok, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """Keys and values ``[BLOCK_N, BLOCK_D]`` of one kv head at ``slots``; masked elements read 0.

    Returns ``(k, v, k_scale, v_scale)``. ``QUANT`` 0: the caches hold the model dtype, the scales
    are placeholders (1.0: a jitted function cannot return None) that :func:`attend_tile` ignores
    for keys of the model dtype. ``QUANT`` 1 (int8) or 2 (fp8 e4m3): the caches hold packed rows
    (:mod:`kernels.kv_quant`, strides in bytes); ``k`` and ``v`` are the one-byte codes as int8 or
    float8 and the scales ``[BLOCK_N]`` float32, 0 where ``row_ok`` (None: every row) is false.
    """
    if QUANT:
        # Offsets in 16-byte units times 16 (the strides are multiples of 16, kernels.kv_quant):
        # the compiler sees every row start 16-byte aligned and loads the codes 16 at a time.
        k_rows = (slots * (stride_ks // 16) + kv_head * (stride_kh // 16)) * 16
        v_rows = (slots * (stride_vs // 16) + kv_head * (stride_vh // 16)) * 16
        k, k_scale = load_quant_rows(k_cache_ptr, k_rows, d, mask, row_ok, HEAD_DIM, QUANT)
        v, v_scale = load_quant_rows(v_cache_ptr, v_rows, d, mask, row_ok, HEAD_DIM, QUANT)
        return k, v, k_scale, v_scale
    else:
        k = tl.load(k_cache_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=mask, other=0.0)
        return k, v, 1.0, 1.0


@triton.jit
def load_quant_rows(cache_ptr, rows, d, mask, row_ok, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """Packed rows starting at byte offsets ``rows`` of ``cache_ptr`` (uint8): their codes
    ``[N, BLOCK_D]`` (int8 for ``QUANT`` 1, float8 e4m3 for 2) and float32 scales ``[N]``.

    Rows start at multiples of 16 bytes (``row_bytes`` is one), so the codes load sixteen at a
    time; a row's scale is the float32 word after its codes padded to 4 bytes."""
    codes = tl.load(cache_ptr + rows[:, None] + d[None, :], mask=mask, other=0)
    scale_ptrs = (cache_ptr + rows + ((HEAD_DIM + 3) // 4) * 4).to(tl.pointer_type(tl.float32))
    if row_ok is not None:
        scale = tl.load(scale_ptrs, mask=row_ok, other=0.0)
    else:
        scale = tl.load(scale_ptrs)
    if QUANT == 1:
        return codes.to(tl.int8, bitcast=True), scale
    else:
        return codes.to(tl.float8e4nv, bitcast=True), scale


@triton.jit
def round_half_even(x):
    """``x`` rounded to an integer, ties to even as ``torch.round`` does; exact in float32."""
    f = tl.floor(x)
    frac = x - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    return tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, f + odd))


@triton.jit
def round_to_e4m3(x):
    """``x`` (``|x| <= 448``) rounded to the nearest float8 e4m3 value (ties to even, the sign kept
    for zeros), as float32. Exact, so the cast to float8 after it rounds nothing: the codes equal
    torch's cast on every backend, whatever rounding its conversion instruction does."""
    bits = x.to(tl.int32, bitcast=True)
    # The spacing of e4m3 values around |x|: 2**(e - 3) for a normal exponent e, 2**-9 below 2**-6.
    ulp_exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    ulp = ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)
    mag = round_half_even(tl.abs(x) * inv_ulp) * ulp
    sign = (bits >> 31) << 31
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def quantize_rows(x, QUANT: tl.constexpr):
    """Rows ``x`` ``[R, BLOCK_D]`` (float32, zero past head_dim) as one-byte codes (uint8) and a
    float32 scale per row, as :func:`kernels.kv_quant.quantize_rows`: ``amax / 127`` (int8,
    rounded half to even) or ``amax / 448`` (fp8 e4m3), correctly rounded divisions as torch's."""
    amax = tl.max(tl.abs(x), axis=1)
    if QUANT == 1:
        qmax = tl.full(amax.shape, 127.0, tl.float32)
    else:
        qmax = tl.full(amax.shape, 448.0, tl.float32)
    scale = tl.where(amax > 0.0, tl.math.div_rn(amax, qmax), 1.0)
    scaled = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    if QUANT == 1:
        codes = tl.clamp(round_half_even(scaled), -127.0, 127.0).to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        codes = round_to_e4m3(tl.clamp(scaled, -448.0, 448.0)).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return codes, scale


@triton.jit
def attend_tile(q, k, v, acc, m_i, l_i, scale_log2, n, n_ok, q_pos, DOT_PRECISION: tl.constexpr, k_scale,
                v_scale):
    """One online-softmax step of flash attention (base 2): the rows of ``q`` attend to the K/V
    tile of key positions ``n``; returns the updated ``(acc, m_i, l_i)``.

    Masks: ``n_ok`` (keys that exist) None: every key counts; ``q_pos`` (each row's position)
    None: no causal mask. With one, a row sees keys up to its own position, so a row can have
    seen no key yet; its max stays -inf and the shift is 0 there, to avoid inf - inf.

    ``k_scale`` / ``v_scale`` (``[BLOCK_N]``, where ``k`` and ``v`` are a quantized cache's codes,
    int8 or float8; ignored where they are of the model dtype): each
    key's scale multiplies its column of scores, each value's scale its column of weights. The
    codes convert to q's dtype exactly (int8 and e4m3 values fit bfloat16 and float16), so the
    products run on the tensor cores as in the model dtype, and the tile is never dequantized.
    With codes, ``scale_log2`` may be a column ``[M, 1]``: the unit of each row of a ``q`` that
    :func:`float16_rows` made float16 times the softmax scale.
    """
    if k.dtype == tl.int8 or k.dtype == tl.float8e4nv:
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * k_scale[None, :] * scale_log2
    else:
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
    if v.dtype != tl.int8 and v.dtype != tl.float8e4nv:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    elif q.dtype == tl.float16:
        # Weights times small scales would fall below float16's normal range (6e-5): each weight
        # takes its value's scale relative to the tile's largest, the product that one.
        v_max = tl.max(v_scale, axis=0)
        v_max = tl.where(v_max > 0.0, v_max, 1.0)
        pv = tl.dot((p * (v_scale / v_max)[None, :]).to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv * v_max
    else:
        pv = tl.dot((p * v_scale[None, :]).to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def float16_rows(q):
    """Rows ``q`` ``[M, D]`` (bfloat16) as float16 in units of a power of two per row, and those
    units ``[M]`` (float32). Exact: bfloat16's 8 significant bits fit float16's 11, and each row's
    largest value lands in [1, 2), far from float16's overflow, so only values below 2**-14 of it
    (nothing that moves a score) lose bits. e4m3 codes convert to float16 in one instruction a
    pair on sm_89+, to bfloat16 only through float16 (a second conversion per element): with q
    in float16 a quantized tile costs half the conversions."""
    qf = q.to(tl.float32)
    amax_exp = (tl.max(tl.abs(qf), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    amax_exp = tl.minimum(tl.maximum(amax_exp, 1), 253)  # a zero row (padding) keeps unit 2**-126
    unit = (amax_exp << 23).to(tl.float32, bitcast=True)
    inv_unit = ((254 - amax_exp) << 23).to(tl.float32, bitcast=True)
    return (qf * inv_unit[:, None]).to(tl.float16), unit


@triton.jit
def attend_keys(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head, d, d_ok, start, end, scale_log2,
                stride_ks, stride_kh, stride_vs, stride_vh, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """:func:`attend_tile` over key positions ``[start, end)`` of one sequence, ``BLOCK_N`` at a
    time, each tile's slots read from its request-table row ``table_row``; ``QUANT`` as in
    :func:`load_kv_tile`."""
    n_offs = tl.arange(0, BLOCK_N)
    for first in range(start, end, BLOCK_N):
        n = first + n_offs
        n_ok = n < end
        slots = tl.load(table_row + n, mask=n_ok, other=0).to(tl.int64)
        k, v, k_scale, v_scale = load_kv_tile(k_cache_ptr, v_cache_ptr, slots, kv_head, d,
                                              n_ok[:, None] & d_ok[None, :], stride_ks, stride_kh, stride_vs,
                                              stride_vh, n_ok, HEAD_DIM, QUANT)
        acc, m_i, l_i = attend_tile(q, k, v, acc, m_i, l_i, scale_log2, n, n_ok, None, DOT_PRECISION,
                                    k_scale, v_scale)
    return acc, m_i, l_i


@triton.jit
def store_quant_rows(row_ptrs, x, h_ok, d, QUANT: tl.constexpr, SCALE_AT: tl.constexpr):
    """Rows ``x`` ``[BLOCK_H, BLOCK_D]`` (float32, zero past head_dim) quantized into the rows at
    ``row_ptrs``: codes and padding in bytes ``[0, SCALE_AT)``, the float32 scale after them."""
    codes, scale = quantize_rows(x, QUANT)
    tl.store(row_ptrs[:, None] + d[None, :], codes, mask=h_ok[:, None] & (d < SCALE_AT)[None, :])
    tl.store((row_ptrs + SCALE_AT).to(tl.pointer_type(tl.float32)), scale, mask=h_ok)


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


@triton.jit
def prologue_input(
    x_ptr, res_ptr, sum_ptr, row, m, rk, mask, stride_x, stride_res, stride_sum, K, store,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """Input rows ``row`` at columns ``rk`` before the norm, in float32: the SiLU product (prologue
    2), the residual sum, stored to row ``m`` of ``sum_ptr`` where ``store`` (prologue 1), or as
    read. The offsets broadcast: one row, or a tile of rows (``row`` and ``m`` columns of them)."""
    dtype = sum_ptr.dtype.element_ty
    if PROLOGUE == 2:
        gate = tl.load(x_ptr + row * stride_x + rk, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + K + rk, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        return (act * up).to(dtype).to(tl.float32)
    a = tl.load(x_ptr + row * stride_x + rk, mask=mask, other=0.0).to(tl.float32)
    if PROLOGUE == 1 and HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + rk, mask=mask, other=0.0).to(tl.float32)
        s = (a + r).to(dtype)
        tl.store(sum_ptr + m * stride_sum + rk, s, mask=mask & store)
        a = s.to(tl.float32)
    return a


@triton.jit
def normed_input(a, rstd, g, dtype: tl.constexpr):
    """The RMSNorm of ``a`` (float32) by its rows' ``rstd`` and the norm's weight ``g``, rounded
    as the unfused op rounds it."""
    return ((a * rstd).to(dtype).to(tl.float32) * g).to(dtype).to(tl.float32)
