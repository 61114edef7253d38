"""Products with 8-bit weights beyond the few-row GEMV: the per-token FP8 quantization of the
activations before an FP8 tensor-core product, and a weight-only GEMM for decode batches.

The activation quantization (row amax -> scale -> clamp -> cast) was six torch kernels before
every FP8 product, about 750 launches a decode step of an 8B model and a fifth of a long
prefill's time; one kernel reads each row once for its amax and once to write its codes.

A decode batch of a few dozen rows is bound by the weight's bytes, not by the products: the
weight-only GEMM reads the 8-bit weight tiles, converts them to the activations' dtype (exact:
int8 and e4m3 codes are bfloat16 and float16 numbers) and multiplies on the 16-bit tensor cores,
each output channel's scale applied once in the epilogue. The activations stay unquantized, so it
is also closer to the float product than the FP8 one.
"""

from __future__ import annotations

from dataclasses import dataclass

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

#: The largest float8 e4m3 magnitude: each row's amax maps onto it.
FP8_MAX = 448.0
#: A row of zeros still gets a finite scale (its codes are zeros).
AMAX_FLOOR = 1e-12


def act_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) symmetric float8 e4m3 codes of a 2-D ``x`` and their float32 scales
    ``[rows, 1]``: ``x ~= codes * scale``, the codes ``x * (1 / scale)`` rounded. The kernels take
    the reciprocal once a row: a division a value was most of a decode batch's SiLU-quantize
    (64 rows of 14336 on an H200: 7.7 against 4.5 us)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(AMAX_FLOOR)
    scale = amax / FP8_MAX
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, AMAX_MIN: tl.constexpr,
                      QMAX: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # Program: one row. A row that fits one block is read once; a longer one twice (amax, codes).
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        run = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            xs = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            run = tl.maximum(run, tl.abs(xs))
        amax = tl.max(run, axis=0)
    scale = tl.maximum(amax, AMAX_MIN) / QMAX
    tl.store(scale_ptr + row, scale)
    inv = tl.math.div_rn(1.0, scale)  # codes are x * (1 / scale): one division a row, not one a value
    if ONE_BLOCK:
        q = tl.minimum(tl.maximum(x * inv, -QMAX), QMAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
    else:
        for k0 in range(0, K, BLOCK):
            xs = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(xs * inv, -QMAX), QMAX)
            tl.store(q_ptr + row * stride_q + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=k0 + cols < K)


def act_quant_block(k: int) -> tuple[int, int]:
    """(BLOCK, warps): a row of up to 16384 inputs in one block (read once; 8B's down rows of
    14336 over 16 warps: 4.9 against 6.5 us in blocks of 4096 at 64 rows, one H200), longer rows
    in blocks of 4096."""
    if k > 16384:
        return 4096, 8
    block = next_pow2(k)
    return block, 16 if block > 8192 else 8 if block >= 4096 else 4


def act_quant_fp8_triton(x: torch.Tensor, block: int | None = None,
                         num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`act_quant_fp8_ref` (same numbers): one launch."""
    require_triton()
    x2 = last_dim_contiguous(x.reshape(-1, x.shape[-1]))
    m, k = x2.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale.fill_(AMAX_FLOOR / FP8_MAX)
    default_block, default_warps = act_quant_block(k)
    block = block or default_block
    pdl = use_pdl(x2)  # a dependent launch: it waits for the kernel before it at its start
    _act_quant_kernel[(m,)](x2, q, scale, k, x2.stride(0), q.stride(0), AMAX_MIN=AMAX_FLOOR, QMAX=FP8_MAX,
                            BLOCK=block, ONE_BLOCK=k <= block, USE_PDL=pdl, num_warps=num_warps or default_warps,
                            **pdl_options(pdl))
    return q, scale


@dataclass(frozen=True)
class GemmConfig:
    """Tiles and launch options of the weight-only GEMM."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


#: Rows the weight-only GEMM serves: beyond them the products, not the weight's bytes, bound the
#: step, and the FP8 tensor cores (or cuBLAS) win.
WEIGHT_ONLY_MAX_ROWS = 128
#: Rows up to which FP8 weights take the weight-only GEMM; past them the FP8 GEMM of
#: :mod:`kernels.fp8_gemm` (then ``torch._scaled_mm``). One H200, a layer's four 8B projections in
#: CUDA graphs over cold weights: at 16 rows the FP8 GEMM 87.2 us against the weight-only 113.2
#: (``fp8-decode-sweep-nvidia-h200-x1-2026-11-29.json``); below 16 rows the two were not compared,
#: and both run tiles of 16 rows. int8 has no FP8 product to hand over to, so it keeps the GEMM up
#: to WEIGHT_ONLY_MAX_ROWS.
FP8_WEIGHT_ONLY_MAX_ROWS = 8


def weight_only_config(rows: int, n: int, k: int) -> GemmConfig:
    """One tile of all the rows (up to 128) by 32 or 64 output channels, so that even a 4096-wide
    output spreads over about as many programs as an H200 has SMs (132); 256 inputs a step
    (256-byte rows of 8-bit weight; 128 for the larger tiles), four stages in flight to keep the
    copies streaming: at most 172 KiB of shared memory (a Hopper SM has 227)."""
    bm = min(128, max(16, next_pow2(rows)))  # more rows: more row tiles
    bn = 32 if n <= 8192 or bm >= 128 else 64
    return GemmConfig(bm, bn, 256 if bm * bn <= 2048 else 128, num_warps=4, num_stages=4)


@triton.jit
def _weight_only_gemm_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                             HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # Program: a BM x BN tile of the output, over all of K.
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_mask = rm < M
    n_mask = rn < N
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + rn[None, :].to(tl.int64) * stride_w
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_mask = (k0 + rk) < K
        a = tl.load(x_rows + k0 + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + k0 + rk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc = tl.dot(a, w.to(dtype), acc, input_precision=DOT_PRECISION)
    acc *= tl.load(scale_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_out + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def weight_only_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                              bias: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight * scale[:, None], bias)`` for an 8-bit (int8 or float8 e4m3)
    ``weight`` with one float32 ``scale`` an output channel, in ``x``'s dtype."""
    require_triton()
    x2 = last_dim_contiguous(x.reshape(-1, x.shape[-1]))
    weight = last_dim_contiguous(weight)
    m, k = x2.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} input features, the input {k}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (n,):
        raise ValueError(f"the scale must be float32 [{n}], not {scale.dtype} {tuple(scale.shape)}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        cfg = config or weight_only_config(m, n, k)
        grid = (cdiv(n, cfg.block_n), cdiv(m, cfg.block_m))
        _weight_only_gemm_kernel[grid](
            x2, weight, scale.contiguous(), bias if bias is not None else scale, out, m, n, k,
            x2.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.reshape(*x.shape[:-1], n)
