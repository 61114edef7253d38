"""Device helpers of the few-row projections (:mod:`kernels.gemv`): the first weight tile read
before a dependent launch's wait, and one row's products of 8-bit codes in float16 pairs.
``@triton.jit`` functions that Triton inlines into each caller."""

from __future__ import annotations

from kernels._triton import INTERPRETED, tl, triton


@triton.jit
def first_weight_tile(w_ptr, rn, n_mask, K, stride_w, BK: tl.constexpr, VEC: tl.constexpr = 16):
    """Weight rows ``rn``'s first ``BK`` inputs, in float32: read before waiting on the kernel
    before (a dependent launch), as weights are never written. Weights are read once a step, and a
    step reads more of them than L2 holds, so they leave L2 first: what a step does reuse there (the
    KV cache, the activations) stays (the default model's layers at batch 1, H100: 2-6 us a step)."""
    rk = tl.max_contiguous(tl.arange(0, BK), VEC)
    return tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=n_mask[:, None] & (rk[None, :] < K),
                   other=0.0, eviction_policy="evict_first").to(tl.float32)


@triton.jit
def first_weight_raw(w_ptr, rn, n_mask, K, stride_w, BK: tl.constexpr, VEC: tl.constexpr = 16):
    """:func:`first_weight_tile` as stored (8-bit codes): a tile carried from one block of inputs
    to the next (``STREAM``) holds a quarter of the registers it would as float32."""
    rk = tl.max_contiguous(tl.arange(0, BK), VEC)
    return tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=n_mask[:, None] & (rk[None, :] < K),
                   other=0.0, eviction_policy="evict_first")


@triton.jit
def first_norm_tile(norm_w_ptr, K, PROLOGUE: tl.constexpr, BK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """The norm's weight where a row fits one tile (else unused: ones), read before the wait like
    the weight tile."""
    rk = tl.arange(0, BK)
    if PROLOGUE == 1 and ONE_BLOCK:
        return tl.load(norm_w_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
    return tl.full((BK,), 1.0, tl.float32)


@triton.jit
def weight_words(w_ptr, rn, n_mask, k0, K, stride_w, BK: tl.constexpr, VEC: tl.constexpr = 8):
    """Weight rows ``rn``'s codes ``[k0, k0 + BK)`` as 32-bit words of four ``[BN, BK // 4]``
    (``k0``, ``K`` and the rows' stride multiples of 4), as :func:`dot_words_f16` multiplies them;
    past ``K``: 0."""
    rw = tl.max_contiguous(tl.multiple_of(tl.arange(0, BK // 4), VEC // 4), VEC // 4)
    words = w_ptr.to(tl.pointer_type(tl.int32))
    kw = k0 // 4 + rw
    return tl.load(words + (rn * (stride_w // 4))[:, None] + kw[None, :], mask=n_mask[:, None] & (kw < K // 4)[None, :],
                   other=0, eviction_policy="evict_first")


@triton.jit
def input_quads(a):
    """Inputs ``a`` ``[BK]`` as the four ``[BK // 4]`` that meet bytes 0-3 of each code word."""
    BK: tl.constexpr = a.shape[0]
    even, odd = tl.split(tl.reshape(a, (BK // 4, 2, 2)))
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    return a0, a1, a2, a3


@triton.jit
def f16_pair(lo, hi):
    """Two float32 tensors as float16x2 words (``lo`` in the low half), rounded to nearest."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def fp8_dot8_f16(w, a01, a23):
    """Two words of e4m3 codes (pack 2: eight codes) times their inputs' float16 pairs: converted a
    pair an instruction, multiplied and summed in float16 pairs (four products a lane), the two
    lanes' sums out as float32."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 c0, c1, c2, c3; .reg .b32 h0, h1, h2, h3, acc; .reg .f16 l, h; "
        "mov.b32 {c0, c1}, $2; mov.b32 {c2, c3}, $3; "
        "cvt.rn.f16x2.e4m3x2 h0, c0; cvt.rn.f16x2.e4m3x2 h1, c1; cvt.rn.f16x2.e4m3x2 h2, c2; "
        "cvt.rn.f16x2.e4m3x2 h3, c3; "
        "mul.rn.f16x2 acc, h0, $4; fma.rn.f16x2 acc, h1, $6, acc; fma.rn.f16x2 acc, h2, $5, acc; "
        "fma.rn.f16x2 acc, h3, $7, acc; mov.b32 {l, h}, acc; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
        "=f,=f,r,r,r,r,r,r", [w, a01, a23], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def int8_dot8_f16(w, a01, a23):
    """:func:`fp8_dot8_f16` for int8 codes: each code's bits flipped into 128 + code under float16's
    exponent of 1024 (two byte permutes a word), 1152 subtracted a pair at a time."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, u, a, b, c, d, m, acc; .reg .f16 l, h; mov.b32 m, 0x64806480; "
        "xor.b32 t, $2, 0x80808080; xor.b32 u, $3, 0x80808080; "
        "prmt.b32 a, t, 0x64646464, 0x4140; prmt.b32 b, t, 0x64646464, 0x4342; "
        "prmt.b32 c, u, 0x64646464, 0x4140; prmt.b32 d, u, 0x64646464, 0x4342; "
        "sub.f16x2 a, a, m; sub.f16x2 b, b, m; sub.f16x2 c, c, m; sub.f16x2 d, d, m; "
        "mul.rn.f16x2 acc, a, $4; fma.rn.f16x2 acc, b, $6, acc; fma.rn.f16x2 acc, c, $5, acc; "
        "fma.rn.f16x2 acc, d, $7, acc; mov.b32 {l, h}, acc; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
        "=f,=f,r,r,r,r,r,r", [w, a01, a23], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def word_code(w, i: tl.constexpr, IS_FP8: tl.constexpr):
    """Byte ``i`` of code words ``w`` as float32 (Triton's conversion: the interpreter's path)."""
    c = ((w >> (8 * i)) & 0xFF).to(tl.uint8)
    if IS_FP8:
        return c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return c.to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def f16_units(mag):
    """Powers of two that put ``mag`` (> 0) in [1, 2) (a zero, a denormal: 2**-126; at most
    2**126), and their inverses."""
    exp = tl.minimum(tl.maximum((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF, 1), 253)
    return (exp << 23).to(tl.float32, bitcast=True), ((254 - exp) << 23).to(tl.float32, bitcast=True)


@triton.jit
def dot_words_f16(w, a, IS_FP8: tl.constexpr):
    """Products of code words ``w`` ``[BN, BK // 4]`` (e4m3 or int8 codes, by ``IS_FP8``) with the
    inputs ``a`` ``[BK]`` (float32 holding 16-bit values), partly summed, and the unit of each
    word's sums: ``([BN, BK // 4]``, ``[BK // 4])`` float32, their product the partial sums.

    Why: converting each code to float32 and an FFMA a code issued 2.5 instructions a code (a
    pair's conversion to float16, each half's to float32, the FFMA); in float16 pairs it is one
    (the pair's conversion, one HFMA2 a pair) and a conversion of each lane's sum every eight codes.
    Exact where float32 is: each run of eight inputs (two words, one product call) is scaled by
    the power of two that puts its largest in [1, 2), so bfloat16 values fit float16's 11 bits
    (down to 2**-14 of the run's largest), a product is below 896 and a lane's four below 3584;
    what float16 rounds is each partial sum, to 11 bits (2**-12 of it, against the output's one
    bfloat16 rounding of 2**-9). A run is one thread's: its scale needs no reduction across the
    program (one for the whole row, or the norm's bound for it, issued more: 544 and 600
    instructions a thread against 536 on norm + gate/up's tile). Interpreted, the same products
    in float32 of the float16-rounded inputs."""
    BK: tl.constexpr = a.shape[0]
    unit, inv = f16_units(tl.max(tl.reshape(tl.abs(a), (BK // 8, 8)), axis=1))
    unit = tl.reshape(tl.join(unit, unit), (BK // 4,))
    inv = tl.reshape(tl.join(inv, inv), (BK // 4,))
    a0, a1, a2, a3 = input_quads(a)
    a0, a1, a2, a3 = a0 * inv, a1 * inv, a2 * inv, a3 * inv
    if INTERPRETED:
        out = word_code(w, 0, IS_FP8) * a0.to(tl.float16).to(tl.float32)[None, :]
        out += word_code(w, 1, IS_FP8) * a1.to(tl.float16).to(tl.float32)[None, :]
        out += word_code(w, 2, IS_FP8) * a2.to(tl.float16).to(tl.float32)[None, :]
        out += word_code(w, 3, IS_FP8) * a3.to(tl.float16).to(tl.float32)[None, :]
    else:
        a01 = f16_pair(a0, a1)[None, :]
        a23 = f16_pair(a2, a3)[None, :]
        if IS_FP8:
            out = fp8_dot8_f16(w, a01, a23)
        else:
            out = int8_dot8_f16(w, a01, a23)
    return out, unit

