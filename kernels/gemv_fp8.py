"""One row's projection over float8 e4m3 weights, the codes read four to a 32-bit word and turned
into float32 by integer shifts instead of conversion instructions.

A one-row projection must read its weight at the copy rate, some 17 bytes a clock an SM on an
H200. Converting each e4m3 code the usual way (to a half pair, then each half to float32) takes
one and a half conversion instructions a code, and an SM runs 16 of those a clock: about 11 codes
a clock, which is what the 8-bit GEMV reached (qkv at 2.7 TB/s). An e4m3 code's bits, moved into
a float32's (sign to bit 31, exponent and mantissa to bits 20-26), are the float32 of its value
times 2**-120, exactly, subnormal codes included (they land on float32 subnormals of the same
value times 2**-120). Two shifts and a logical op a code, on the integer pipes: the product then
multiplies an input pre-scaled by 2**100, and the float32 sum comes out 2**-20 of the true one,
which the channel's scale takes back. Every product and sum rounds as the unscaled ones would
(powers of two commute with rounding) unless it falls below 2**-106 of the unscaled units or an
input exceeds 2**27, neither of which a model's activations do.

The program layout is :mod:`kernels.gemv`'s streaming one-row case (``STREAM``): ``BN`` channels,
blocks of ``BW`` words (``4 * BW`` inputs), the next block's load issued before the current one's
products, products added elementwise and summed across the tile once at the end. The prologues
are the same (:func:`kernels._tiles.prologue_input`: the norm with its residual add, the SiLU gate), each
input row normalised from one read of it before the blocks.
"""

from __future__ import annotations

import torch

from kernels._tiles import normed_input, prologue_input
from kernels._triton import cdiv, next_pow2, pdl_options, pdl_wait, tl, triton, use_pdl

#: The inputs are scaled by 2**100, the sums by 2**20 (see the module's docstring).
INPUT_SCALE = tl.constexpr(2.0**100)
SUM_SCALE = tl.constexpr(2.0**20)

#: ((BN, BW), warps) by (prologue, out features, in features) where this kernel is measured
#: faster than the 8-bit GEMV (``pd_cluster.bench.gpu.fp8_decode_sweep``); only those shapes take
#: it by default. On an H200 it was not (the 8B shape, ``fp8-decode-sweep-nvidia-h200-x1-2026-11-29``):
#: at its best tiles 1-4% faster alone on down and gate/up, slower on qkv, and a whole step's
#: projections 4347 against 3792 us at its default tiles; the one-row GEMV is not bound by its
#: conversions alone.
FP8_WORD_TILES: dict[tuple[int, int, int], tuple[tuple[int, int], int]] = {}


def fp8_word_heuristic(prologue: int, n: int, k: int) -> tuple[tuple[int, int], int]:
    """Eight channels a program over blocks of 256 words (1024 inputs) on eight warps: the tiles
    best on three of the 8B shape's four projections."""
    return (8, 256), 8


def fp8_word_config(prologue: int, n: int, k: int) -> tuple[tuple[int, int], int]:
    return FP8_WORD_TILES.get((prologue, n, k)) or fp8_word_heuristic(prologue, n, k)


def words_by_default(prologue: int, n: int, k: int) -> bool:
    """Whether a shape takes this kernel without being asked: where :data:`FP8_WORD_TILES` has it."""
    return (prologue, n, k) in FP8_WORD_TILES


def fits_words(weight: torch.Tensor, rows: int, k: int) -> bool:
    """True where this kernel serves: one row over float8 e4m3 weights whose rows are whole
    16-byte words (``k`` a multiple of 16)."""
    return rows == 1 and weight.dtype == torch.float8_e4m3fn and k % 16 == 0 and weight.stride(0) % 16 == 0


@triton.jit
def _codes_f32(words, J: tl.constexpr):
    """Code ``J`` (byte ``J``) of each 32-bit word as float32, times 2**-120 (exact)."""
    if J == 3:
        mag = (words >> 4) & 0x07F00000
        sign = words & 0x80000000
    else:
        mag = (words << (20 - 8 * J)) & 0x07F00000
        sign = (words << (24 - 8 * J)) & 0x80000000
    return (mag | sign).to(tl.float32, bitcast=True)


@triton.jit
def project_words(
    x_ptr, res_ptr, rows_ptr, norm_w_ptr, sum_ptr, w_ptr, rn, n_mask, pid, K, stride_x, stride_res,
    stride_w_words, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_ROWS: tl.constexpr,
    BN: tl.constexpr, BW: tl.constexpr, NORM_BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """The float32 sums ``[BN]`` of weight rows ``rn`` (any set of them) with the one (prologued)
    input row, before the channels' scales: the first weight block read, the wait on the kernel
    before, the norm's sum over the row, then the blocks (see the module's docstring). Program 0
    stores the residual sum."""
    dtype = sum_ptr.dtype.element_ty
    rw = tl.arange(0, BW)
    k_words = K // 4
    words = w_ptr.to(tl.pointer_type(tl.uint32)) + rn[:, None].to(tl.int64) * stride_w_words
    w = tl.load(words + rw[None, :], mask=n_mask[:, None] & (rw[None, :] < k_words), other=0,
                eviction_policy="evict_first")
    pdl_wait(USE_PDL)
    row = tl.load(rows_ptr).to(tl.int64) if HAS_ROWS else 0
    rstd = 1.0
    if PROLOGUE == 1:  # the norm's sum over the whole row first, one read a block of NORM_BLOCK
        sq = tl.zeros((NORM_BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            rk = k0 + tl.arange(0, NORM_BLOCK)
            xs = tl.load(x_ptr + row * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + row * stride_res + rk, mask=rk < K, other=0.0).to(tl.float32)
                xs = (xs + r).to(dtype).to(tl.float32)
            sq += xs * xs
        rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    wide = tl.zeros((BN, BW), dtype=tl.float32)
    for w0 in range(0, k_words, BW):
        nxt = w0 + BW + rw
        w_next = tl.load(words + nxt[None, :], mask=n_mask[:, None] & (nxt[None, :] < k_words), other=0,
                         eviction_policy="evict_first")
        for j in tl.static_range(4):
            rk = 4 * (w0 + rw) + j
            k_mask = rk < K
            a = prologue_input(x_ptr, res_ptr, sum_ptr, row, 0, rk, k_mask, stride_x, stride_res, 0, K,
                               (rk * 0 + pid) == 0, PROLOGUE, HAS_RESIDUAL)
            if PROLOGUE == 1:
                g = tl.load(norm_w_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
                a = normed_input(a, rstd, g, dtype)
            wide += _codes_f32(w, j) * (a * INPUT_SCALE)[None, :]
        w = w_next
    return tl.sum(wide, axis=1) * SUM_SCALE


@triton.jit
def _fp8_words_kernel(
    x_ptr, res_ptr, rows_ptr, norm_w_ptr, sum_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    N, K, stride_x, stride_res, stride_w_words, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BN: tl.constexpr, BW: tl.constexpr, NORM_BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program: BN output channels of the one row.
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    n_mask = rn < N
    acc = project_words(x_ptr, res_ptr, rows_ptr, norm_w_ptr, sum_ptr, w_ptr, rn, n_mask, pid, K, stride_x,
                        stride_res, stride_w_words, eps, PROLOGUE, HAS_RESIDUAL, HAS_ROWS, BN, BW, NORM_BLOCK,
                        USE_PDL)
    acc *= tl.load(scale_ptr + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    out = acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rn, out, mask=n_mask)


def fp8_words_launch(prologue: int, x2: torch.Tensor, res2: torch.Tensor, rows: torch.Tensor | None,
                     norm_weight: torch.Tensor | None, new_residual: torch.Tensor | None, weight: torch.Tensor,
                     weight_scale: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, k: int, eps: float,
                     config: tuple[tuple[int, int], int] | None = None) -> None:
    """One launch over one row (``kernels.gemv._launch`` checked the arguments and made the
    outputs); ``config`` ((BN, BW), warps) replaces the measured or default choice."""
    n = weight.shape[0]
    (bn, bw), warps = config or fp8_word_config(prologue, n, k)
    pdl = use_pdl(x2)
    # The residual sum is one row: program 0 stores it where the row is read (row offset 0).
    _fp8_words_kernel[(cdiv(n, bn),)](
        x2, res2, rows if rows is not None else x2, norm_weight if norm_weight is not None else weight,
        new_residual if new_residual is not None else out, weight, weight_scale,
        bias if bias is not None else weight_scale, out, n, k, x2.stride(0), res2.stride(0), weight.stride(0) // 4,
        eps, PROLOGUE=prologue, HAS_RESIDUAL=new_residual is not None, HAS_ROWS=rows is not None,
        HAS_BIAS=bias is not None, BN=bn, BW=bw, NORM_BLOCK=min(4096, next_pow2(k)), USE_PDL=pdl,
        num_warps=warps, **pdl_options(pdl))
