"""The activations of a many-row FP8 product written as float8 e4m3 codes by the kernel that makes
them: RMSNorm (before qkv and gate/up) and the SiLU gate (before down) quantize each row by its
own amax as they write it.

Unfused, each of them wrote its 16-bit rows and a quantization kernel (:mod:`kernels.quant_matmul`)
read them back to write the codes: on a 4096-token prefill of an 8B shape about 400 MB of traffic a
layer. The codes and scales here are those of ``act_quant_fp8(rms_norm(...))`` and
``act_quant_fp8(silu_mul(...))``, bit for bit: every rounding of the 16-bit outputs is repeated
before the row's amax is taken.
"""

from __future__ import annotations

import torch

from kernels._triton import (
    cdiv,
    last_dim_contiguous,
    next_pow2,
    pdl_options,
    pdl_wait,
    require_triton,
    tl,
    triton,
    use_pdl,
)
from kernels.quant_matmul import AMAX_FLOOR, FP8_MAX, act_quant_fp8_ref
from kernels.rms_norm import rms_norm_ref
from kernels.silu_mul import silu_mul_ref

FP8 = torch.float8_e4m3fn


def rms_norm_quant_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scales, new_residual)``: the per-row e4m3 codes of :func:`rms_norm_ref`'s output."""
    out, new_residual = rms_norm_ref(x, weight, eps, residual)
    codes, scale = act_quant_fp8_ref(out.reshape(-1, out.shape[-1]))
    return codes, scale, new_residual


def silu_mul_quant_fp8_ref(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)``: the per-row e4m3 codes of :func:`silu_mul_ref`'s output."""
    out = silu_mul_ref(gate_up)
    return act_quant_fp8_ref(out.reshape(-1, out.shape[-1]))


@triton.jit
def _quantize_row(y, q_ptrs, scale_ptr, mask, AMAX_MIN: tl.constexpr, QMAX: tl.constexpr):
    """Store one row's codes (``y`` float32, already rounded as its 16-bit value) and its scale."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), AMAX_MIN) / QMAX
    tl.store(scale_ptr, scale)
    q = tl.minimum(tl.maximum(y * tl.math.div_rn(1.0, scale), -QMAX), QMAX)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, sum_ptr, n_cols, stride_x, stride_res, stride_q,
                           stride_sum, eps, HAS_RESIDUAL: tl.constexpr, AMAX_MIN: tl.constexpr, QMAX: tl.constexpr,
                           BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # One row per program: kernels.rms_norm's roundings, then the row's amax and codes.
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = sum_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(dtype)
        tl.store(sum_ptr + row * stride_sum + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(var + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(dtype).to(tl.float32)
    _quantize_row(y, q_ptr + row * stride_q + cols, scale_ptr + row, mask, AMAX_MIN, QMAX)


def rms_norm_quant_fp8_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rms_norm_quant_fp8_ref` (the same codes, scales and residual),
    one launch; ``x``, ``weight`` and ``residual`` of one 16-bit dtype."""
    require_triton()
    if weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        raise ValueError("x, weight and residual must share one dtype")
    n_cols = x.shape[-1]
    x2 = last_dim_contiguous(x.reshape(-1, n_cols))
    rows = x2.shape[0]
    codes = torch.empty((rows, n_cols), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if residual is not None:
        res2 = last_dim_contiguous(residual.reshape(-1, n_cols))
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        sum2 = new_residual.view(-1, n_cols)
    else:
        res2, sum2, new_residual = x2, x2, x
    if rows == 0:
        return codes, scale, new_residual
    block = next_pow2(n_cols)
    pdl = use_pdl(x2)
    _rms_norm_quant_kernel[(rows,)](
        x2, res2, weight.contiguous(), codes, scale, sum2, n_cols, x2.stride(0), res2.stride(0), codes.stride(0),
        sum2.stride(0), eps, HAS_RESIDUAL=residual is not None, AMAX_MIN=AMAX_FLOOR, QMAX=FP8_MAX, BLOCK=block,
        USE_PDL=pdl, num_warps=min(16, max(1, block // 256)), **pdl_options(pdl),
    )
    return codes, scale, new_residual


@triton.jit
def _gated(gate_up_ptr, cols, mask, n_cols):
    """``silu(gate) * up`` at ``cols`` of a row, rounded as :mod:`kernels.silu_mul` writes it."""
    dtype = gate_up_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype).to(tl.float32)


@triton.jit
def _silu_mul_quant_kernel(gate_up_ptr, q_ptr, scale_ptr, n_cols, stride_in, stride_q, AMAX_MIN: tl.constexpr,
                           QMAX: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # One row per program. A row that fits one block is read once; a longer one twice (its amax,
    # then its codes: the second read mostly finds the row in L2).
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = gate_up_ptr + row * stride_in
    q_row = q_ptr + row * stride_q
    if ONE_BLOCK:
        mask = cols < n_cols
        _quantize_row(_gated(in_row, cols, mask, n_cols), q_row + cols, scale_ptr + row, mask, AMAX_MIN, QMAX)
    else:
        run = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            run = tl.maximum(run, tl.abs(_gated(in_row, c0 + cols, c0 + cols < n_cols, n_cols)))
        scale = tl.maximum(tl.max(run, axis=0), AMAX_MIN) / QMAX
        tl.store(scale_ptr + row, scale)
        inv = tl.math.div_rn(1.0, scale)
        for c0 in range(0, n_cols, BLOCK):
            y = _gated(in_row, c0 + cols, c0 + cols < n_cols, n_cols)
            q = tl.minimum(tl.maximum(y * inv, -QMAX), QMAX)
            tl.store(q_row + c0 + cols, q.to(q_ptr.dtype.element_ty), mask=c0 + cols < n_cols)


@triton.jit
def _silu_mul_parts_kernel(gate_up_ptr, y_ptr, amax_ptr, n_cols, stride_in, stride_y, PARTS: tl.constexpr,
                           BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # A program per (row, part of BLOCK columns): the gated values, written as the unfused kernel
    # writes them, and their amax.
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = _gated(gate_up_ptr + row * stride_in, cols, mask, n_cols)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(amax_ptr + row * PARTS + part, tl.max(tl.abs(y), axis=0))


@triton.jit
def _quantize_parts_kernel(y_ptr, amax_ptr, q_ptr, scale_ptr, n_cols, stride_y, stride_q, AMAX_MIN: tl.constexpr,
                           QMAX: tl.constexpr, PARTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr,
                           USE_PDL: tl.constexpr):
    # A program per (row, BLOCK columns): the row's scale from its PARTS amaxes, the columns' codes.
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    amax = tl.max(tl.load(amax_ptr + row * PARTS + p, mask=p < PARTS, other=0.0), axis=0)
    scale = tl.maximum(amax, AMAX_MIN) / QMAX
    if part == 0:
        tl.store(scale_ptr + row, scale)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(y * tl.math.div_rn(1.0, scale), -QMAX), QMAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_parts(values: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 codes and float32 scales ``[rows, 1]`` of ``values`` ``[rows, n]`` (contiguous
    rows) whose amax a row is the largest of its ``amax`` ``[rows, parts]`` entries: each the amax
    of a part of the row, found by the kernel that wrote it (:func:`silu_mul_quant_fp8_triton`'s
    parts, :mod:`kernels.fp8_gated`'s tiles). One launch, a program per row and
    :data:`PART_COLUMNS` columns."""
    rows, n_cols = values.shape
    codes = torch.empty((rows, n_cols), dtype=FP8, device=values.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=values.device)
    if rows == 0 or n_cols == 0:
        return codes, scale.fill_(AMAX_FLOOR / FP8_MAX)
    parts = amax.shape[1]
    pdl = use_pdl(values)
    _quantize_parts_kernel[(rows, cdiv(n_cols, PART_COLUMNS))](
        values, amax, codes, scale, n_cols, values.stride(0), codes.stride(0), AMAX_MIN=AMAX_FLOOR, QMAX=FP8_MAX,
        PARTS=parts, BLOCK_P=next_pow2(parts), BLOCK=PART_COLUMNS, USE_PDL=pdl, num_warps=4, **pdl_options(pdl))
    return codes, scale


#: Rows up to which the SiLU gate quantizes in two launches over parts of rows (a decode batch:
#: one program a row would leave most multiprocessors idle, each gating a whole row), columns a
#: part. Measured on an H200 (64 rows of 14336): see :func:`silu_mul_quant_fp8_triton`.
PARTS_MAX_ROWS = 64
PART_COLUMNS = 1024


def silu_quant_block(n_cols: int) -> tuple[int, int]:
    """(BLOCK, warps): a row of up to 16384 outputs in one block (read once), longer ones in blocks
    of 2048. On an H200, 4096 rows of 14336 (an 8B shape's down input): one block of 16384 with 16
    warps 0.150 ms, blocks of 1024-4096 (two passes) 0.167-0.188, unfused 0.209."""
    if n_cols <= 16384:
        block = next_pow2(n_cols)
        return block, 16 if block >= 16384 else 8 if block >= 4096 else 4
    return 2048, 4


def silu_mul_quant_fp8_triton(gate_up: torch.Tensor, block: int | None = None, num_warps: int | None = None,
                              parts: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`silu_mul_quant_fp8_ref` (the same codes and scales): one launch a
    program a row (in blocks of ``block``), or (``parts``; by default up to :data:`PARTS_MAX_ROWS`
    rows, no ``block`` given) two over parts of :data:`PART_COLUMNS` columns: the gated values and
    each part's amax, then the codes."""
    require_triton()
    n_cols = gate_up.shape[-1] // 2
    if gate_up.shape[-1] != 2 * n_cols:
        raise ValueError("gate_up's last dimension must be even")
    rows_in = last_dim_contiguous(gate_up.reshape(-1, 2 * n_cols))
    rows = rows_in.shape[0]
    pdl = use_pdl(rows_in)
    if rows and n_cols and (parts if parts is not None else block is None and rows <= PARTS_MAX_ROWS):
        count = cdiv(n_cols, PART_COLUMNS)
        gated = torch.empty((rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
        amax = torch.empty((rows, count), dtype=torch.float32, device=gate_up.device)
        _silu_mul_parts_kernel[(rows, count)](rows_in, gated, amax, n_cols, rows_in.stride(0), gated.stride(0),
                                              PARTS=count, BLOCK=PART_COLUMNS, USE_PDL=pdl, num_warps=4,
                                              **pdl_options(pdl))
        return quantize_parts(gated, amax)
    codes = torch.empty((rows, n_cols), dtype=FP8, device=gate_up.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=gate_up.device)
    if rows == 0 or n_cols == 0:
        return codes, scale.fill_(AMAX_FLOOR / FP8_MAX)
    default_block, default_warps = silu_quant_block(n_cols)
    block = block or default_block
    _silu_mul_quant_kernel[(rows,)](
        rows_in, codes, scale, n_cols, rows_in.stride(0), codes.stride(0), AMAX_MIN=AMAX_FLOOR, QMAX=FP8_MAX,
        BLOCK=block, ONE_BLOCK=n_cols <= block, USE_PDL=pdl, num_warps=num_warps or default_warps,
        **pdl_options(pdl),
    )
    return codes, scale
