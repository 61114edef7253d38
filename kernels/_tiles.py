"""Device helpers the kernels call: ``@triton.jit`` functions that Triton inlines into each caller,
so a kernel built from them compiles to the same code as one written out in full.

They live apart from the kernel modules, which name only launchable kernels (the interpreter tests
count those).
"""

from __future__ import annotations

from kernels._triton import INTERPRETED, tl, triton


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, slots, kv_head, d, mask, stride_ks, stride_kh, stride_vs, stride_vh,
                 row_ok, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """:func:`load_kv_raw` with ``QUANT`` 3's and 4's value words converted (:func:`tile_values`)."""
    k, v, k_scale, v_scale = load_kv_raw(k_cache_ptr, v_cache_ptr, slots, kv_head, d, mask, stride_ks, stride_kh,
                                         stride_vs, stride_vh, row_ok, HEAD_DIM, QUANT)
    return k, tile_values(v, d, QUANT), k_scale, v_scale


@triton.jit
def tile_values(v, d, QUANT: tl.constexpr):
    """The values of a tile :func:`load_kv_raw` read, as :func:`attend_tile` takes them: ``QUANT``
    3's and 4's words as float16 (:func:`code_words_f16`), others as read."""
    if QUANT >= 3:
        return code_words_f16(v, d.shape[0], QUANT)
    else:
        return v


@triton.jit
def load_kv_raw(k_cache_ptr, v_cache_ptr, slots, kv_head, d, mask, stride_ks, stride_kh, stride_vs, stride_vh,
                row_ok, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """Keys and values ``[BLOCK_N, BLOCK_D]`` of one kv head at ``slots``; masked elements read 0.

    Returns ``(k, v, k_scale, v_scale)``. ``QUANT`` 0: the caches hold the model dtype, the scales
    are placeholders (1.0: a jitted function cannot return None) that :func:`attend_tile` ignores
    for keys of the model dtype. ``QUANT`` 1 (int8) or 2 (fp8 e4m3): the caches hold packed rows
    (:mod:`kernels.kv_quant`, strides in bytes); ``k`` and ``v`` are the one-byte codes as int8 or
    float8 and the scales ``[BLOCK_N]`` float32, 0 where ``row_ok`` (None: every row) is false.
    ``QUANT`` 3 and 4: fp8 e4m3 (3) or int8 (4) rows as 2 and 1, but ``v`` their codes as 32-bit
    words (:func:`load_code_words`), for a ``q`` met as float16.
    """
    if QUANT:
        # Offsets in 16-byte units times 16 (the strides are multiples of 16, kernels.kv_quant):
        # the compiler sees every row start 16-byte aligned and loads the codes 16 at a time.
        k_rows = (slots * (stride_ks // 16) + kv_head * (stride_kh // 16)) * 16
        v_rows = (slots * (stride_vs // 16) + kv_head * (stride_vh // 16)) * 16
        if QUANT == 3:
            k, k_scale = load_quant_rows(k_cache_ptr, k_rows, d, mask, row_ok, HEAD_DIM, 2)
            v, v_scale = load_code_words(v_cache_ptr, v_rows, d, row_ok, HEAD_DIM)
        elif QUANT == 4:
            k, k_scale = load_quant_rows(k_cache_ptr, k_rows, d, mask, row_ok, HEAD_DIM, 1)
            v, v_scale = load_code_words(v_cache_ptr, v_rows, d, row_ok, HEAD_DIM)
        else:
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
def load_code_words(cache_ptr, rows, d, row_ok, HEAD_DIM: tl.constexpr):
    """Packed rows (as :func:`load_quant_rows`) as 32-bit words of four codes
    ``[N, BLOCK_D // 4]`` and float32 scales ``[N]``; rows where ``row_ok`` (None: every row) is
    false read 0. :func:`code_words_f16` converts the words.

    Why: a tile whose one-byte codes meet the tensor cores as the second operand of ``p @ v``
    must be read from shared memory transposed, which Triton does one byte at a time (128 loads
    a thread for a 128 x 128 tile on sm_90, and the registers they hold). Loaded as words and
    converted where they land, the tile reaches shared memory as float16, which the transposing
    matrix loads read 16 bytes at a time."""
    words_per_row: tl.constexpr = d.shape[0] // 4
    w = tl.arange(0, words_per_row)
    w_ok = w < (HEAD_DIM + 3) // 4
    ptrs = (cache_ptr + rows).to(tl.pointer_type(tl.int32))[:, None] + w[None, :]
    scale_ptrs = (cache_ptr + rows + ((HEAD_DIM + 3) // 4) * 4).to(tl.pointer_type(tl.float32))
    if row_ok is not None:
        words = tl.load(ptrs, mask=row_ok[:, None] & w_ok[None, :], other=0)
        scale = tl.load(scale_ptrs, mask=row_ok, other=0.0)
    else:
        words = tl.load(ptrs, mask=w_ok[None, :], other=0)
        scale = tl.load(scale_ptrs)
    return words, scale


@triton.jit
def code_words_f16(words, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
    """Words of four codes ``[N, BLOCK_D // 4]``, fp8 e4m3 (``QUANT`` 3) or int8 (4), as the
    float16 tile ``[N, BLOCK_D]`` (exact). The conversion sits before a reshape, so the compiler
    cannot move it past the layout change to the product's operand (back onto the bytes)."""
    if QUANT == 3:
        c0, c1, c2, c3 = e4m3_word_to_f16(words)
    else:
        c0, c1, c2, c3 = int8_word_to_f16(words)
    # Element 4 * w + 2 * i + j of a row is code 2 * i + j of word w.
    codes = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    return tl.reshape(codes, (words.shape[0], BLOCK_D))


@triton.jit
def e4m3_word_to_f16(words):
    """The four fp8 e4m3 codes of each int32 word (lowest byte first) as four float16 tensors:
    two conversions of a code pair each, one instruction apiece on sm_89+. Interpreted, through
    Triton's own conversion of each byte."""
    if INTERPRETED:
        c0 = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c1 = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c2 = ((words >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c3 = ((words >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return c0, c1, c2, c3
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
            "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
            pack=1)


@triton.jit
def int8_word_to_f16(words):
    """The four int8 codes of each int32 word (lowest byte first) as four float16 tensors: each
    code's bits flipped into 128 + code and placed under float16's exponent of 1024 (two byte
    permutes a word), 1152 subtracted from a pair at a time. Interpreted, through Triton's own
    conversion of each byte."""
    if INTERPRETED:
        c0 = (words & 0xFF).to(tl.uint8).to(tl.int8, bitcast=True).to(tl.float16)
        c1 = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.int8, bitcast=True).to(tl.float16)
        c2 = ((words >> 16) & 0xFF).to(tl.uint8).to(tl.int8, bitcast=True).to(tl.float16)
        c3 = ((words >> 24) & 0xFF).to(tl.uint8).to(tl.int8, bitcast=True).to(tl.float16)
        return c0, c1, c2, c3
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, a, b, e, m; xor.b32 t, $4, 0x80808080; mov.b32 e, 0x64646464; "
            "mov.b32 m, 0x64806480; prmt.b32 a, t, e, 0x4140; prmt.b32 b, t, e, 0x4342; "
            "sub.f16x2 a, a, m; sub.f16x2 b, b, m; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
            pack=1)


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
                v_scale, V_IN_SHIFT: tl.constexpr = False):
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

    ``V_IN_SHIFT`` (codes met by a float16 q, no causal mask): each value's scale enters its
    key's score as its log2, so the weights the product takes are the scaled ones, normalised by
    their row's largest as the softmax normalises (no tile-wide maximum of the scales, a
    reduction across warps); the sum of weights divides each by its scale back. ``m_i`` then
    holds that shift, and ``m_i + log2(l_i)`` is still the row's log-sum-exp.
    """
    quantized: tl.constexpr = k.dtype == tl.int8 or k.dtype == tl.float8e4nv
    in_shift: tl.constexpr = quantized and V_IN_SHIFT and q.dtype == tl.float16
    if quantized:
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * k_scale[None, :] * scale_log2
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if in_shift:
        v_log = tl.log2(v_scale)  # a row not read has scale 0: -inf
        s = s + v_log[None, :]
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
    if in_shift:
        l_i = l_i * alpha + tl.sum(p * tl.where(v_scale > 0.0, tl.exp2(-v_log), 0.0)[None, :], axis=1)
    else:
        l_i = l_i * alpha + tl.sum(p, axis=1)
    if not quantized:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    elif in_shift:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
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
                HEAD_DIM: tl.constexpr, QUANT: tl.constexpr, V_IN_SHIFT: tl.constexpr = False,
                SLOTS_AHEAD: tl.constexpr = False):
    """:func:`attend_tile` over key positions ``[start, end)`` of one sequence, ``BLOCK_N`` at a
    time, each tile's slots read from its request-table row ``table_row``; ``QUANT`` as in
    :func:`load_kv_tile`.

    ``SLOTS_AHEAD``: each iteration reads the next tile's slots, so a tile's KV loads depend on a
    value the loop carries rather than on a load of the same iteration; Triton's pipeliner then
    gives them ``num_stages - 1`` buffers, and a tile's bytes stay in flight while the one before
    is computed (reading its slots in the iteration that loads it, the loads get one buffer at
    any depth, issued after the compute and waited for at the top of the next iteration)."""
    n_offs = tl.arange(0, BLOCK_N)
    if SLOTS_AHEAD:
        slots_next = tl.load(table_row + start + n_offs, mask=start + n_offs < end, other=0)
    for first in range(start, end, BLOCK_N):
        n = first + n_offs
        n_ok = n < end
        if SLOTS_AHEAD:
            slots = slots_next.to(tl.int64)
            slots_next = tl.load(table_row + n + BLOCK_N, mask=n + BLOCK_N < end, other=0)
        else:
            slots = tl.load(table_row + n, mask=n_ok, other=0).to(tl.int64)
        k, v, k_scale, v_scale = load_kv_tile(k_cache_ptr, v_cache_ptr, slots, kv_head, d,
                                              n_ok[:, None] & d_ok[None, :], stride_ks, stride_kh, stride_vs,
                                              stride_vh, n_ok, HEAD_DIM, QUANT)
        acc, m_i, l_i = attend_tile(q, k, v, acc, m_i, l_i, scale_log2, n, n_ok, None, DOT_PRECISION,
                                    k_scale, v_scale, V_IN_SHIFT)
    return acc, m_i, l_i


@triton.jit
def attend_keys_ahead(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head, d, d_ok, start, end,
                      scale_log2, stride_ks, stride_kh, stride_vs, stride_vh, BLOCK_N: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
                      V_IN_SHIFT: tl.constexpr = False):
    """:func:`attend_keys` with the loads a tile ahead, into registers: each iteration reads the
    next tile (and the slots of the one after) before computing its own, so one program keeps a
    tile's bytes in flight while it computes (a kernel compiled with one pipeline stage; Triton's
    own pipelining waits for a tile at the top of the iteration that uses it)."""
    n_offs = tl.arange(0, BLOCK_N)
    n = start + n_offs
    n_ok = n < end
    slots = tl.load(table_row + n, mask=n_ok, other=0).to(tl.int64)
    k, v, k_scale, v_scale = load_kv_raw(k_cache_ptr, v_cache_ptr, slots, kv_head, d, n_ok[:, None] & d_ok[None, :],
                                         stride_ks, stride_kh, stride_vs, stride_vh, n_ok, HEAD_DIM, QUANT)
    n_after = n + BLOCK_N
    slots_after = tl.load(table_row + n_after, mask=n_after < end, other=0).to(tl.int64)
    for first in range(start, end, BLOCK_N):
        n = first + n_offs
        n_ok = n < end
        n_next = n + BLOCK_N
        next_ok = n_next < end
        k_next, v_next, k_scale_next, v_scale_next = load_kv_raw(
            k_cache_ptr, v_cache_ptr, slots_after, kv_head, d, next_ok[:, None] & d_ok[None, :], stride_ks,
            stride_kh, stride_vs, stride_vh, next_ok, HEAD_DIM, QUANT)
        n_after = n_next + BLOCK_N
        slots_after = tl.load(table_row + n_after, mask=n_after < end, other=0).to(tl.int64)
        acc, m_i, l_i = attend_tile(q, k, tile_values(v, d, QUANT), acc, m_i, l_i, scale_log2, n, n_ok, None,
                                    DOT_PRECISION, k_scale, v_scale, V_IN_SHIFT)
        k, v, k_scale, v_scale = k_next, v_next, k_scale_next, v_scale_next
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
