"""Device helpers of the few-row projections (:mod:`kernels.gemv`): the first weight tile read
before a dependent launch's wait, and one row's products over blocks pipelined through shared
memory. ``@triton.jit`` functions that Triton inlines into each caller."""

from __future__ import annotations

from kernels._tiles import normed_input, prologue_input
from kernels._triton import tl, triton


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
def row_block_product(x_ptr, res_ptr, rows_ptr, norm_w_ptr, sum_ptr, w, k0, pid, K, stride_x, stride_res, stride_sum,
                      rstd, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_ROWS: tl.constexpr,
                      BK: tl.constexpr):
    """One row's products with the weight block ``w`` at inputs ``k0`` on: its prologued (and, by
    ``rstd``, normalised) inputs read, each weight row's sum of products."""
    rk = k0 + tl.arange(0, BK)
    row = tl.load(rows_ptr).to(tl.int64) if HAS_ROWS else 0
    a = prologue_input(x_ptr, res_ptr, sum_ptr, row, 0, rk, rk < K, stride_x, stride_res, stride_sum, K,
                       (rk * 0 + pid) == 0, PROLOGUE, HAS_RESIDUAL)
    if PROLOGUE == 1:
        g = tl.load(norm_w_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        a = normed_input(a, rstd, g, sum_ptr.dtype.element_ty)
    return tl.sum(w.to(tl.float32) * a[None, :], axis=1)


@triton.jit
def project_row_piped(x_ptr, res_ptr, rows_ptr, norm_w_ptr, sum_ptr, w_ptr, w, rn, n_mask, pid, K, stride_x,
                      stride_res, stride_sum, stride_w, rstd, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                      HAS_ROWS: tl.constexpr, BK: tl.constexpr, VEC: tl.constexpr, PIPE: tl.constexpr):
    """One row over blocks (``PIPE`` > 1): the first block ``w`` (read before the wait), then the
    rest in a loop Triton pipelines ``PIPE`` deep: each block's codes and inputs copied to shared
    memory (``cp.async``) ``PIPE - 1`` blocks ahead, bytes in flight that hold no registers."""
    out = row_block_product(x_ptr, res_ptr, rows_ptr, norm_w_ptr, sum_ptr, w, 0, pid, K, stride_x, stride_res,
                            stride_sum, rstd, PROLOGUE, HAS_RESIDUAL, HAS_ROWS, BK)
    for k0 in tl.range(BK, K, BK, num_stages=PIPE):
        rkw = tl.max_contiguous(k0 + tl.arange(0, BK), VEC)
        wk = tl.load(w_ptr + rn[:, None] * stride_w + rkw[None, :], mask=n_mask[:, None] & (rkw[None, :] < K),
                     other=0.0, eviction_policy="evict_first")
        out += row_block_product(x_ptr, res_ptr, rows_ptr, norm_w_ptr, sum_ptr, wk, k0, pid, K, stride_x, stride_res,
                                 stride_sum, rstd, PROLOGUE, HAS_RESIDUAL, HAS_ROWS, BK)
    return out
