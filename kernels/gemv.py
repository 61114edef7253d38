"""Projections of a few rows with the op before them folded in: RMSNorm (with its residual add)
before the qkv, gate/up and vocabulary projections, the SiLU gate before the down projection.

A decode step of a small model is bound by its number of kernels, not by its bytes: at batch 1
the default model's 30 layers ran 10 kernels each, every one too short to amortise its launch.
Folding the norm and the gate into the projection that reads their output takes three kernels out
of each layer. The math and every rounding are the unfused ops' (``rms_norm``, ``silu_mul`` and a
float32-accumulated ``F.linear``), so the result differs from them only by the order of the sums.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels._triton import (
    cdiv,
    last_dim_contiguous,
    pdl_options,
    pdl_wait,
    require_triton,
    tl,
    triton,
    use_pdl,
    use_triton,
)
from kernels.gemv_tiles import (  # noqa: F401  # the tiles' choice, re-exported
    MAX_ROWS,
    ONE_BLOCK_ROWS,
    QUANT_TILES,
    projection_tiles,
    quant_projection_config,
    quant_projection_heuristic,
    quant_projection_loads,
)
from kernels._tiles import normed_input, prologue_input
from kernels._gemv_blocks import (  # noqa: F401  # first_weight_tile: also kernels.qkv_rotary's
    dot_words_f16,
    first_norm_tile,
    first_weight_raw,
    first_weight_tile,
    weight_words,
)
from kernels.rms_norm import rms_norm, rms_norm_ref
from kernels.silu_mul import silu_mul, silu_mul_ref


_PLAIN, _NORM, _SILU = 0, 1, 2


#: The 8-bit weight dtypes the projections read (with a float32 scale an output channel).
QUANT_WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def check_weight_scale(weight: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Raise ValueError unless ``weight`` is a float matrix without a scale, or an 8-bit one with
    a float32 scale per output row."""
    if scale is None:
        if weight.dtype in QUANT_WEIGHT_DTYPES:
            raise ValueError(f"{weight.dtype} weights need their per-channel scale")
        return
    if weight.dtype not in QUANT_WEIGHT_DTYPES:
        raise ValueError(f"a scale goes with 8-bit weights, not {weight.dtype}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (weight.shape[0],) or not scale.is_contiguous():
        raise ValueError(f"the scale must be contiguous float32 [{weight.shape[0]}], not {scale.dtype} "
                         f"{tuple(scale.shape)}")


def scaled_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight * scale[:, None], bias)``: 8-bit weights (exact in ``x``'s dtype)
    multiply the input, each output channel's scale multiplies their product in float32 (a
    dequantized matrix is never made); without a scale, ``F.linear``."""
    if scale is None:
        return F.linear(x, weight, bias)
    out = (F.linear(x, weight.to(x.dtype)).float() * scale).to(x.dtype)
    return out + bias if bias is not None else out


def norm_linear_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.linear(rms_norm(x, norm_weight, eps, residual)[0], weight, bias)`` (then converted to
    ``out_dtype``) and the new residual stream, both of the ``rows`` picked (all rows by default).
    ``weight_scale``: 8-bit ``weight``'s per-channel scale (:func:`scaled_linear_ref`)."""
    if rows is not None:
        x = x[rows]
        residual = residual[rows] if residual is not None else None
    normed, new_residual = rms_norm_ref(x, norm_weight, eps, residual)
    out = scaled_linear_ref(normed, weight, weight_scale, bias)
    return (out.to(out_dtype) if out_dtype is not None else out), new_residual


def silu_linear_ref(gate_up: torch.Tensor, weight: torch.Tensor,
                    weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(silu_mul(gate_up), weight)``."""
    return scaled_linear_ref(silu_mul_ref(gate_up), weight, weight_scale)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    return scaled_linear_ref(x, weight, weight_scale)


@triton.jit
def project_rows(
    x_ptr, res_ptr, rows_ptr, norm_w_ptr, sum_ptr, w_ptr, rn, n_mask, pid, M, K,
    stride_x, stride_res, stride_sum, stride_w, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_ROWS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ONE_BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    STREAM: tl.constexpr = False, VEC: tl.constexpr = 16, F16_DOT: tl.constexpr = False,
):
    """The float32 products ``[BN, BM]`` of weight rows ``rn`` with the (prologued) input rows:
    the first weight tile (and the norm's weight) read, the wait on the kernel before, then
    :func:`project_loaded`. Any set of weight rows works: ``rn`` need not be a range."""
    if F16_DOT:  # code words, converted where multiplied (dot_words_f16)
        w = weight_words(w_ptr, rn, n_mask, 0, K, stride_w, BK, VEC)
    elif STREAM or (w_ptr.dtype.element_ty.primitive_bitwidth == 8 and not ONE_BLOCK):  # carried as codes: a
        # quarter of float32's registers
        w = first_weight_raw(w_ptr, rn, n_mask, K, stride_w, BK, VEC)
    else:
        w = first_weight_tile(w_ptr, rn, n_mask, K, stride_w, BK, VEC)
    g = first_norm_tile(norm_w_ptr, K, PROLOGUE, BK, ONE_BLOCK)
    pdl_wait(USE_PDL)
    return project_loaded(x_ptr, res_ptr, rows_ptr, norm_w_ptr, sum_ptr, w_ptr, w, g, rn, n_mask, pid, M, K,
                          stride_x, stride_res, stride_sum, stride_w, eps,
                          PROLOGUE, HAS_RESIDUAL, HAS_ROWS, BM, BN, BK, ONE_BLOCK, STREAM, VEC, F16_DOT)


@triton.jit
def project_loaded(
    x_ptr, res_ptr, rows_ptr, norm_w_ptr, sum_ptr, w_ptr, w, g, rn, n_mask, pid, M, K,
    stride_x, stride_res, stride_sum, stride_w, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_ROWS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ONE_BLOCK: tl.constexpr,
    STREAM: tl.constexpr = False, VEC: tl.constexpr = 16, F16_DOT: tl.constexpr = False,
):
    """:func:`project_rows` after its wait, given the first weight tile ``w`` and norm tile ``g``.

    Where a row fits one tile (``ONE_BLOCK``: ``K <= BK``), the rows' inputs are read at once as
    one tile (one round trip after the wait, not one a row; the norms' sums in one reduction),
    then each row is picked from it and multiplied by the weight tile (the default model's step
    at 3-4 rows, H100: 0.64 against 0.76 ms with a read a row). One such row is normalised in
    registers, and a lone row without a norm takes the path of longer rows. Longer rows go in
    blocks of ``BK``, the norm's sum taken over all of them first, so they are read twice. The
    rows' inputs are read by every program, cheap next to the weight for the few rows this serves.
    Program 0 alone stores the residual sum (``sum_ptr``).

    ``STREAM`` (one row over blocks, 8-bit weights): ``w`` holds the codes; each block's load of
    the next weight block is issued before its own products, and the products add up elementwise,
    summed across the tile once at the end, so that no reduction (a barrier) between blocks holds
    back the next block's load: two blocks a program stay in flight.

    ``F16_DOT`` (one row of 16-bit inputs, 8-bit weights; ``K`` and the weight's row stride
    multiples of 4): ``w`` holds the codes as 32-bit words, multiplied in float16 pairs
    (:func:`dot_words_f16`), each run of eight inputs scaled by its own power of two."""
    IS_FP8: tl.constexpr = w_ptr.dtype.element_ty == tl.float8e4nv
    dtype = sum_ptr.dtype.element_ty
    rm = tl.arange(0, BM)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if ONE_BLOCK and BM > 1:
        rk = tl.arange(0, BK)
        store = ((rk * 0 + pid) == 0)[None, :]
        rows = tl.load(rows_ptr + tl.minimum(rm, M - 1)).to(tl.int64) if HAS_ROWS else rm.to(tl.int64)
        mask = (rk[None, :] < K) & (rm[:, None] < M)
        a = prologue_input(x_ptr, res_ptr, sum_ptr, rows[:, None], rm[:, None], rk[None, :], mask, stride_x,
                           stride_res, stride_sum, K, store, PROLOGUE, HAS_RESIDUAL)
        if PROLOGUE == 1:
            rstd = tl.rsqrt(tl.sum(a * a, axis=1) / K + eps)
            a = normed_input(a, rstd[:, None], g[None, :], dtype)
        for m in tl.static_range(BM):
            row_input = tl.sum(tl.where(rm[:, None] == m, a, 0.0), axis=0)  # row m exactly: the rest add zeros
            part = tl.sum(w.to(tl.float32) * row_input[None, :], axis=1)
            acc += tl.where(rm[None, :] == m, part[:, None], 0.0)
    elif PROLOGUE == 1 and ONE_BLOCK:  # one row (as a tile of one it costs a step 2%)
        rk = tl.arange(0, BK)
        row = tl.load(rows_ptr).to(tl.int64) if HAS_ROWS else 0
        a = prologue_input(x_ptr, res_ptr, sum_ptr, row, 0, rk, rk < K, stride_x, stride_res, stride_sum, K,
                           (rk * 0 + pid) == 0, PROLOGUE, HAS_RESIDUAL)
        a = normed_input(a, tl.rsqrt(tl.sum(a * a, axis=0) / K + eps), g, dtype)
        if F16_DOT:
            prods, unit = dot_words_f16(w, a, IS_FP8)
            part = tl.sum(prods * unit[None, :], axis=1)
        else:
            part = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        acc += tl.where(rm[None, :] == 0, part[:, None], 0.0)
    else:
        rstd = tl.zeros((BM,), dtype=tl.float32)
        if PROLOGUE == 1:
            for m in tl.static_range(BM):
                row = tl.load(rows_ptr + tl.minimum(m, M - 1)).to(tl.int64) if HAS_ROWS else m
                sq = tl.zeros((BK,), dtype=tl.float32)
                for k0 in range(0, K, BK):
                    rk = k0 + tl.arange(0, BK)
                    k_mask = (rk < K) & ((rk * 0 + m) < M)
                    xs = tl.load(x_ptr + row * stride_x + rk, mask=k_mask, other=0.0).to(tl.float32)
                    if HAS_RESIDUAL:
                        r = tl.load(res_ptr + row * stride_res + rk, mask=k_mask, other=0.0).to(tl.float32)
                        xs = (xs + r).to(dtype).to(tl.float32)
                    sq += xs * xs
                rstd = tl.where(rm == m, tl.rsqrt(tl.sum(sq, axis=0) / K + eps), rstd)
        WIDE_K: tl.constexpr = BK // 4 if F16_DOT else BK
        wide = tl.zeros((BN, WIDE_K), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            rkw = tl.max_contiguous(rk, VEC)  # the codes a thread loads at once (see _launch's vec)
            if F16_DOT:
                if STREAM:
                    w_next = weight_words(w_ptr, rn, n_mask, k0 + BK, K, stride_w, BK, VEC)
                elif k0 > 0:
                    w = weight_words(w_ptr, rn, n_mask, k0, K, stride_w, BK, VEC)
            elif STREAM:
                w_next = tl.load(w_ptr + rn[:, None] * stride_w + BK + rkw[None, :],
                                 mask=n_mask[:, None] & (rkw[None, :] + BK < K), other=0.0,
                                 eviction_policy="evict_first")
            elif k0 > 0:
                w = tl.load(w_ptr + rn[:, None] * stride_w + rkw[None, :],
                            mask=n_mask[:, None] & (rkw[None, :] < K), other=0.0,
                            eviction_policy="evict_first").to(w.dtype)  # as carried: codes or float32
            store = (rk * 0 + pid) == 0
            if PROLOGUE == 1:
                g = tl.load(norm_w_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            for m in tl.static_range(BM):
                row = tl.load(rows_ptr + tl.minimum(m, M - 1)).to(tl.int64) if HAS_ROWS else m
                a = prologue_input(x_ptr, res_ptr, sum_ptr, row, m, rk, (rk < K) & ((rk * 0 + m) < M), stride_x,
                                   stride_res, stride_sum, K, store, PROLOGUE, HAS_RESIDUAL)
                if PROLOGUE == 1:
                    a = normed_input(a, tl.sum(tl.where(rm == m, rstd, 0.0), axis=0), g, dtype)
                if F16_DOT:  # one row
                    prods, unit = dot_words_f16(w, a, IS_FP8)
                    if STREAM:
                        wide += prods * unit[None, :]
                    else:
                        acc += tl.where(rm[None, :] == 0, tl.sum(prods * unit[None, :], axis=1)[:, None], 0.0)
                elif STREAM:
                    wide += w.to(tl.float32) * a[None, :]
                else:
                    part = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
                    acc += tl.where(rm[None, :] == m, part[:, None], 0.0)
            if STREAM:
                w = w_next
        if STREAM:
            acc += tl.where(rm[None, :] == 0, tl.sum(wide, axis=1)[:, None], 0.0)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,
    res_ptr,
    rows_ptr,
    norm_w_ptr,
    sum_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_res,
    stride_sum,
    stride_w,
    stride_out,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    STREAM: tl.constexpr,
    VEC: tl.constexpr,
    F16_DOT: tl.constexpr,
):
    # Program: BN output columns of all M rows (see ``project_rows``).
    pid = tl.program_id(0)
    rm = tl.arange(0, BM)
    rn = pid * BN + tl.arange(0, BN)
    n_mask = rn < N
    acc = project_rows(x_ptr, res_ptr, rows_ptr, norm_w_ptr, sum_ptr, w_ptr, rn, n_mask, pid, M, K,
                       stride_x, stride_res, stride_sum, stride_w, eps,
                       PROLOGUE, HAS_RESIDUAL, HAS_ROWS, BM, BN, BK, ONE_BLOCK, USE_PDL, STREAM, VEC, F16_DOT)
    if HAS_SCALE:  # 8-bit weights: each output channel's scale
        acc *= tl.load(scale_ptr + rn, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    # Rounded to the input's dtype first, as the unfused product is, also into a wider output.
    out = acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[None, :] * stride_out + rn[:, None], out, mask=n_mask[:, None] & (rm[None, :] < M))


def _f16_products(x: torch.Tensor, weight: torch.Tensor, tiles: tuple[int, int, int], vec: int) -> bool:
    """Whether a launch of these tiles can take its products in float16 pairs (:func:`dot_words_f16`):
    one row of a 16-bit input, whole code words (inputs and the weight's rows in fours, aligned),
    runs of eight a thread (blocks and loads of eight codes or more)."""
    return (tiles[0] == 1 and x.dtype in (torch.bfloat16, torch.float16) and weight.shape[1] % 4 == 0
            and weight.stride(0) % 4 == 0 and weight.data_ptr() % 4 == 0 and tiles[2] >= 8 and vec >= 8)


def _launch(
    prologue: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    residual: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    weight_scale: torch.Tensor | None = None,
    tiles: tuple[int, int, int] | None = None,
    num_warps: int = 4,
    stream: bool | None = None,
    vec: int = 16,
    f16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch of :func:`_gemv_kernel`; ``tiles`` and ``num_warps`` replace the default choice
    (:func:`projection_tiles`, or :func:`quant_projection_config` for 8-bit weights, with its
    :func:`quant_projection_loads`). How one row's 8-bit codes load, over blocks: ``stream`` (the
    default; False: not) the next block's load issued before this block's products; ``vec`` the
    codes a thread loads at once: 16, or 8 in the bf16 input's own layout (no shared-memory
    round trip of the input a block); ``f16`` products in float16 pairs (:func:`dot_words_f16`:
    one row of a 16-bit input, four inputs' codes a word; else ignored)."""
    require_triton()
    x2 = last_dim_contiguous(x.reshape(-1, x.shape[-1]))
    m = int(rows.shape[0]) if rows is not None else x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows: this kernel serves at most {MAX_ROWS}")
    weight = last_dim_contiguous(weight)
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} input features, the input {k}")
    check_weight_scale(weight, weight_scale)
    plain_weight = weight if weight_scale is None else None
    if any(t is not None and t.dtype != x.dtype for t in (plain_weight, residual, norm_weight, bias)):
        raise ValueError("input, residual and weights must share one dtype")
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    res2 = last_dim_contiguous(residual.reshape(-1, k)) if residual is not None else x2
    new_residual = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else None
    if m == 0 or n == 0:
        return out, new_residual
    if tiles is None and weight_scale is not None:
        tiles, num_warps = quant_projection_config(m, n, k, prologue)
        loads = quant_projection_loads(m, n, k, prologue)
        if loads.get("f16") and not _f16_products(x, weight, tiles, loads.get("vec", vec)):
            # Wide tiles measured with float16 products (codes carried as words) would spill as
            # float32 ones.
            (tiles, num_warps), loads = quant_projection_heuristic(m, n, k), {}
        stream, vec, f16 = loads.get("stream", stream), loads.get("vec", vec), loads.get("f16", f16)
    bm, bn, bk = tiles or projection_tiles(m, n, k)
    if bm < m:
        raise ValueError(f"tiles of {bm} rows for {m}")
    stream = stream is not False and weight_scale is not None and bm == 1 and k > bk  # project_loaded
    f16 = bool(f16) and weight_scale is not None and _f16_products(x, weight, (bm, bn, bk), vec)
    pdl = use_pdl(x)
    _gemv_kernel[(cdiv(n, bn),)](
        x2,
        res2,
        rows if rows is not None else x2,
        norm_weight if norm_weight is not None else weight,
        new_residual if new_residual is not None else out,
        weight,
        weight_scale if weight_scale is not None else weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x2.stride(0),
        res2.stride(0),
        new_residual.stride(0) if new_residual is not None else 0,
        weight.stride(0),
        out.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        HAS_ROWS=rows is not None,
        HAS_BIAS=bias is not None,
        HAS_SCALE=weight_scale is not None,
        BM=bm,
        BN=bn,
        BK=bk,
        ONE_BLOCK=k <= bk,
        USE_PDL=pdl,
        STREAM=stream,
        VEC=vec,
        F16_DOT=f16,
        num_warps=num_warps,
        **pdl_options(pdl),
    )
    return out, new_residual


def norm_linear_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    weight_scale: torch.Tensor | None = None,
    **config: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`norm_linear_ref`, for at most :data:`MAX_ROWS` rows; ``config``:
    ``tiles``, ``num_warps``, ``stream``, ``vec`` and ``f16`` as :func:`linear_triton` takes them."""
    k = x.shape[-1]
    out, new_residual = _launch(_NORM, x, weight, k, residual=residual, rows=rows, norm_weight=norm_weight,
                                eps=eps, bias=bias, out_dtype=out_dtype, weight_scale=weight_scale, **config)
    if new_residual is None:  # No residual to add: the stream is the input (its picked rows).
        new_residual = x.reshape(-1, k)
        new_residual = new_residual[rows] if rows is not None else new_residual
    return out, new_residual


def silu_linear_triton(gate_up: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
                       **config: Any) -> torch.Tensor:
    """Triton version of :func:`silu_linear_ref`, for at most :data:`MAX_ROWS` rows (``config``:
    as :func:`norm_linear_triton`'s)."""
    if gate_up.shape[-1] % 2:
        raise ValueError("gate_up's last dimension must be even")
    return _launch(_SILU, gate_up, weight, gate_up.shape[-1] // 2, weight_scale=weight_scale, **config)[0]


def linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
                  tiles: tuple[int, int, int] | None = None, num_warps: int = 4,
                  stream: bool | None = None, vec: int = 16, f16: bool = False) -> torch.Tensor:
    """``F.linear(x, weight)`` for at most :data:`MAX_ROWS` rows; ``tiles`` (BM, BN, BK),
    ``num_warps``, ``stream``, ``vec`` and ``f16`` replace the default choice (for a sweep of them)."""
    return _launch(_PLAIN, x, weight, x.shape[-1], weight_scale=weight_scale, tiles=tiles, num_warps=num_warps,
                   stream=stream, vec=vec, f16=f16)[0]


def fits(x: torch.Tensor, rows: int, weight: torch.Tensor | None = None) -> bool:
    """True when the fused Triton projections serve these rows (CUDA, Triton, few rows) and
    read ``weight``'s dtype (float8 needs a GPU of compute capability 8.9 or later)."""
    if not (use_triton(x) and rows <= MAX_ROWS):
        return False
    if weight is not None and weight.dtype == torch.float8_e4m3fn and weight.is_cuda:
        return torch.cuda.get_device_capability(weight.device) >= (8, 9)
    return True


def _num_rows(x: torch.Tensor, rows: torch.Tensor | None) -> int:
    return int(rows.shape[0]) if rows is not None else x.numel() // max(1, x.shape[-1])


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton where :func:`fits`, else the two ops it fuses (each Triton on CUDA, torch elsewhere).
    ``out_dtype``: the product's dtype (default the input's), after rounding to the input's: a
    float32 head's logits without a separate conversion. ``weight_scale``: 8-bit ``weight``'s
    per-channel scale."""
    if fits(x, _num_rows(x, rows), weight):
        return norm_linear_triton(x, residual, norm_weight, eps, weight, bias, rows, out_dtype, weight_scale)
    if rows is not None:
        x = x[rows]
        residual = residual[rows] if residual is not None else None
    normed, new_residual = rms_norm(x, norm_weight, eps, residual)
    out = scaled_linear_ref(normed, weight, weight_scale, bias)
    return (out.to(out_dtype) if out_dtype is not None else out), new_residual


def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton where :func:`fits`, else the two ops it fuses."""
    if fits(gate_up, _num_rows(gate_up, None), weight):
        return silu_linear_triton(gate_up, weight, weight_scale)
    return scaled_linear_ref(silu_mul(gate_up), weight, weight_scale)


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton where :func:`fits`, else ``F.linear`` (of the scaled weight)."""
    if fits(x, _num_rows(x, None), weight):
        return linear_triton(x, weight, weight_scale)
    return scaled_linear_ref(x, weight, weight_scale)
