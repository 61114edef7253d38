"""A decode step's qkv projection with rotary embedding and the KV store folded into it.

At batch 1 the default model's layer ran a kernel between the qkv projection and attention only
to rotate q and k and write k and v to their slots: a launch whose work is a few hundred bytes.
Here each program of the projection computes its output columns and finishes them itself:

- q and k columns go in rotary pairs: a program owns columns ``j`` and ``j + head_dim / 2`` of a
  head (the two halves rotate-half mixes), so it can rotate them without its neighbours; q is
  written rotated, k rotated to its KV slot;
- v columns go to their KV slot as they are.

Every rounding is the unfused ops': the projection's output is rounded to the model's dtype, the
rotation runs in float32 on it (as ``rotary_store_kv`` does) and is rounded again when stored.
"""

from __future__ import annotations

import torch

from kernels._triton import cdiv, last_dim_contiguous, pdl_options, pdl_wait, require_triton, tl, triton, use_pdl
from kernels.gemv import (
    MAX_ROWS,
    first_norm_tile,
    first_weight_tile,
    fits,
    norm_linear,
    norm_linear_ref,
    project_loaded,
    projection_tiles,
)
from kernels.rotary import rotary_store_kv, rotary_store_kv_ref


def _split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1)
    return (q.reshape(-1, num_heads, head_dim), k.reshape(-1, num_kv_heads, head_dim),
            v.reshape(-1, num_kv_heads, head_dim))


def norm_qkv_rotary_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_linear`` into the qkv projection, then ``rotary_store_kv``: the rotated q
    ``[T, heads, head_dim]`` and the new residual stream; k and v land in their slots.
    ``weight_scale``: 8-bit ``weight``'s per-channel scale."""
    qkv, new_residual = norm_linear_ref(x, residual, norm_weight, eps, weight, bias, weight_scale=weight_scale)
    q, k, v = _split_heads(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
    return rotary_store_kv_ref(q, k, v, positions, cos, sin, k_cache, v_cache, slots), new_residual


@triton.jit
def _qkv_rotary_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    sum_ptr,
    w_ptr,
    bias_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    pos_ptr,
    slots_ptr,
    cos_ptr,
    sin_ptr,
    M,
    K,
    NUM_Q_HEADS,
    QK_HEADS,
    V_COLS,
    stride_x,
    stride_res,
    stride_sum,
    stride_w,
    stride_q,
    stride_cos,
    stride_sin,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Programs below ``rot_programs`` own BN // 2 rotary pairs of the q and k heads, their columns
    # interleaved (j, j + HALF, j + 1, j + 1 + HALF, ...); the rest own BN value columns each.
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    rot_programs = QK_HEADS * HALF // (BN // 2)
    rm = tl.arange(0, BM)
    i = tl.arange(0, BN)
    which = i % 2
    pair = pid * (BN // 2) + i // 2
    head = pair // HALF
    d = pair % HALF + which * HALF
    v_col = (pid - rot_programs) * BN + i
    rotary = (i * 0 + pid) < rot_programs
    rn = tl.where(rotary, head * HEAD_DIM + d, QK_HEADS * HEAD_DIM + v_col)
    n_mask = tl.where(rotary, head < QK_HEADS, v_col < V_COLS)
    # Before the wait (a dependent launch): the weights, and the step's positions, slots and their
    # rotation, which the host wrote before the step's first kernel; none of them is written by
    # the kernels before this one.
    w = first_weight_tile(w_ptr, rn, n_mask, K, stride_w, BK)
    g = first_norm_tile(norm_w_ptr, K, 1, BK, ONE_BLOCK)
    row_ok = rm < M
    slot = tl.load(slots_ptr + rm, mask=row_ok, other=0).to(tl.int64)
    rot_ok = row_ok[None, :] & ((i * 0 + pid) < rot_programs)[:, None]
    pos = tl.load(pos_ptr + rm, mask=row_ok, other=0).to(tl.int64)
    c = tl.load(cos_ptr + pos[None, :] * stride_cos + d[:, None], mask=rot_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos[None, :] * stride_sin + d[:, None], mask=rot_ok, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    acc = project_loaded(x_ptr, res_ptr, x_ptr, norm_w_ptr, sum_ptr, w_ptr, w, g, rn, n_mask, pid, M, K,
                         stride_x, stride_res, stride_sum, stride_w, eps,
                         1, HAS_RESIDUAL, False, BM, BN, BK, ONE_BLOCK)  # prologue 1: the RMSNorm
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    dtype = q_ptr.dtype.element_ty
    val = acc.to(dtype).to(tl.float32)  # the projection's output, as the unfused op stores it
    if pid < rot_programs:
        # Each column's partner in its pair (the neighbouring column of the tile).
        partner = tl.sum(tl.where(((i[:, None] ^ 1) == i[None, :])[:, :, None], val[None, :, :], 0.0), axis=1)
        out = tl.where(which[:, None] == 0, val * c - partner * s, val * c + partner * s)
        is_q = head < NUM_Q_HEADS
        tl.store(q_ptr + rm[None, :] * stride_q + (head * HEAD_DIM + d)[:, None], out.to(dtype),
                 mask=is_q[:, None] & row_ok[None, :])
        k_head = tl.maximum(head - NUM_Q_HEADS, 0)
        tl.store(k_cache_ptr + slot[None, :] * stride_ks + (k_head * stride_kh + d)[:, None], out.to(dtype),
                 mask=(~is_q & (head < QK_HEADS))[:, None] & row_ok[None, :])
    else:
        v_head = v_col // HEAD_DIM
        tl.store(v_cache_ptr + slot[None, :] * stride_vs + (v_head * stride_vh + v_col % HEAD_DIM)[:, None],
                 val.to(dtype), mask=(v_col < V_COLS)[:, None] & row_ok[None, :])


def _columns_per_program(rows: int, n: int, k: int, head_dim: int) -> int:
    """The projection's tile width, kept even and a divisor of a head (whole rotary pairs)."""
    bn = max(2, projection_tiles(rows, n, k)[1])
    while (head_dim // 2) % (bn // 2):
        bn //= 2
    return max(2, bn)


def norm_qkv_rotary_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`norm_qkv_rotary_ref`, for at most :data:`MAX_ROWS` rows: one launch
    over float weights."""
    require_triton()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV caches must be contiguous in head_dim")
    k = x.shape[-1]
    x2 = last_dim_contiguous(x.reshape(-1, k))
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows: this kernel serves at most {MAX_ROWS}")
    head_dim = k_cache.shape[-1]
    if head_dim % 2:
        raise ValueError("rotary needs an even head_dim")
    weight = last_dim_contiguous(weight)
    n = weight.shape[0]
    if n != (num_heads + 2 * num_kv_heads) * head_dim or weight.shape[1] != k:
        raise ValueError(f"qkv weight of shape {tuple(weight.shape)} for {num_heads}+2x{num_kv_heads} heads of "
                         f"{head_dim} over {k} inputs")
    if any(t is not None and t.dtype != x.dtype for t in (weight, residual, norm_weight, bias, k_cache)):
        raise ValueError("input, residual, weights and caches must share one dtype")
    cos, sin = last_dim_contiguous(cos), last_dim_contiguous(sin)
    q = torch.empty((m, num_heads, head_dim), dtype=x.dtype, device=x.device)
    res2 = last_dim_contiguous(residual.reshape(-1, k)) if residual is not None else x2
    new_residual = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else None
    if m == 0:
        return q, new_residual if new_residual is not None else x2
    bm, _, bk = projection_tiles(m, n, k)
    bn = _columns_per_program(m, n, k, head_dim)
    qk_heads, v_cols = num_heads + num_kv_heads, num_kv_heads * head_dim
    grid = (qk_heads * (head_dim // 2) // (bn // 2) + cdiv(v_cols, bn),)
    pdl = use_pdl(x)
    _qkv_rotary_kernel[grid](
        x2,
        res2,
        norm_weight,
        new_residual if new_residual is not None else q,
        weight,
        bias if bias is not None else weight,
        q,
        k_cache,
        v_cache,
        positions,
        slots,
        cos,
        sin,
        m,
        k,
        num_heads,
        qk_heads,
        v_cols,
        x2.stride(0),
        res2.stride(0),
        new_residual.stride(0) if new_residual is not None else 0,
        weight.stride(0),
        q.stride(0),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        eps,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        HEAD_DIM=head_dim,
        BM=bm,
        BN=bn,
        BK=bk,
        ONE_BLOCK=k <= bk,
        USE_PDL=pdl,
        num_warps=4,
        **pdl_options(pdl),
    )
    return q, new_residual if new_residual is not None else x2


def norm_qkv_rotary(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton in one launch where :func:`fits_qkv_rotary`, else the ops it fuses (``norm_linear``
    and ``rotary_store_kv``, each Triton on CUDA, torch elsewhere; 8-bit weights always so)."""
    rows = x.numel() // max(1, x.shape[-1])
    if fits_qkv_rotary(x, rows, weight, weight_scale) and fits(k_cache, rows):
        return norm_qkv_rotary_triton(x, residual, norm_weight, eps, weight, bias, positions, cos, sin,
                                      k_cache, v_cache, slots, num_heads, num_kv_heads)
    qkv, new_residual = norm_linear(x, residual, norm_weight, eps, weight, bias, weight_scale=weight_scale)
    q, k, v = _split_heads(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
    return rotary_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots), new_residual


def fits_qkv_rotary(x: torch.Tensor, rows: int, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> bool:
    """Whether one launch serves these rows: float weights where the few-row projections do (8-bit
    ones take the projection, then the rotation and the store)."""
    return weight_scale is None and fits(x, rows)
