"""Routed experts as two grouped GEMM launches, with sizes fixed by the token count alone.

The torch reference loops over the experts on the host (each one's token count read back), so a
sparse step cannot be captured in a CUDA graph. Here :func:`align` sorts the (token, expert) pairs
by expert on the device and pads each expert's run to the GEMM's row tile, so every tile of rows
belongs to one expert (:mod:`kernels.moe_align`); tiles past the used ones return at once. One
launch computes every pair's ``silu(gate) * up`` (gate and up columns in the same program, fused in
the epilogue), a second the down projection times the router weight; a third sums a token's
``top_k`` outputs in float32 in k order (no atomics: the same numbers every run). Weights are float
(``[experts, out, in]``) or 8-bit codes with one float32 scale an output channel (converted to the
activations' dtype in the tile, exact, and scaled in the epilogue).

Many pairs (a prompt's) keep the gated output in the sorted, padded row order, so the down
projection reads whole contiguous row tiles instead of gathering them again, and take larger tiles
walked in groups of row tiles (each group's weight columns and rows stay in L2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import cdiv, dot_precision, last_dim_contiguous, next_pow2, require_triton, tl, triton

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # no Triton, or one without host-side tensor descriptors: the pointer loads
    TensorDescriptor = None
from kernels.moe_align import (  # noqa: F401  (re-exported: the alignment is part of this API)
    Alignment,
    align,
    align_chunked,
    align_ref,
    max_padded_rows,
)


@dataclass(frozen=True)
class MoeGemmConfig:
    """Tiles and launch options of the grouped GEMM (``block_n``: a gated launch computes that many
    gate and as many up columns). ``group_m``: row tiles walked together over every column tile
    (0: each column tile over all the row tiles, the decode order); ``interleaved``: a gated
    launch's gate and up columns as one product of ``2 * block_n`` columns (one wide MMA) split in
    the epilogue; ``sorted_rows`` (read from the gated launch's config): the gated output kept in
    padded sorted order for the down projection; ``tma``: the weight tiles (not interleaved ones)
    and sorted input rows loaded by the tensor memory accelerator."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 0
    interleaved: bool = False
    sorted_rows: bool = False
    tma: bool = False


#: Pairs up to which a step counts as decode-sized: tiles of 16 rows (a decode batch spreads its
#: pairs thinly over the experts, so larger tiles would be mostly padding).
FEW_PAIRS = 1024
#: Pairs from which a step takes the long-prompt tiles (:data:`PROMPT_CONFIGS`): 1024 tokens of
#: top-8 routing, 64 rows an expert on average (measured there and at 4096 tokens).
PROMPT_PAIRS = 8192
#: (gated, down) tiles of long prompts: 128-row tiles (vLLM's H200 choice for E=128, N=768 at
#: these sizes too), weight tiles by descriptor, the gated output kept in sorted order and read
#: back by descriptor, 16 row tiles walked together. One layer of the Qwen3-30B-A3B shape on an
#: H200 at 4096 tokens: gated 0.534 -> 0.486 ms, down 0.385 -> 0.250 ms (the 64-row tiles before);
#: 1024 tokens: 0.370 -> 0.354 ms together.
PROMPT_CONFIGS = (MoeGemmConfig(128, 128, 64, num_warps=8, num_stages=4, group_m=16, sorted_rows=True, tma=True),
                  MoeGemmConfig(128, 256, 64, num_warps=8, num_stages=4, group_m=16, sorted_rows=True, tma=True))


def moe_config(num_pairs: int, gated: bool) -> MoeGemmConfig:
    """Few pairs: 16-row tiles, long K steps (weight-bound, like the dense weight-only GEMM);
    long prompts: :data:`PROMPT_CONFIGS`; between: 64-row tiles by 128 columns (64 + 64 gated),
    three stages in flight."""
    if num_pairs <= FEW_PAIRS:
        return MoeGemmConfig(16, 64, 128, num_warps=4, num_stages=4)
    if num_pairs >= PROMPT_PAIRS:
        return PROMPT_CONFIGS[0 if gated else 1]
    return MoeGemmConfig(64, 64 if gated else 128, 64, num_warps=4 if gated else 8, num_stages=3)


@triton.jit
def _tile(num_m_tiles, num_n_tiles, GROUP_M: tl.constexpr):
    # The program's (row tile, column tile): GROUP_M row tiles over all the column tiles, then the
    # next group; 0: each column tile over every row tile.
    pid = tl.program_id(0)
    if GROUP_M == 0:
        return pid % num_m_tiles, pid // num_m_tiles
    width = GROUP_M * num_n_tiles
    first_m = (pid // width) * GROUP_M
    size = tl.minimum(num_m_tiles - first_m, GROUP_M)
    return first_m + (pid % width) % size, (pid % width) // size


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, scale_ptr, out_ptr, pairs_ptr, block_experts_ptr, num_padded_ptr, route_ptr,
                     num_pairs, N, K, num_m_tiles, stride_a, stride_we, stride_wn, stride_se, stride_out,
                     A_DIV: tl.constexpr, A_SORTED: tl.constexpr, OUT_SORTED: tl.constexpr, GATED: tl.constexpr,
                     INTERLEAVED: tl.constexpr, WEIGHTED: tl.constexpr, SCALED: tl.constexpr,
                     TMA_A: tl.constexpr, TMA_W: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     GROUP_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # Program: one expert's BM sorted pairs by BN output columns (and the matching up columns N
    # further on when GATED), over all of K. Input row of a pair: pair // A_DIV, or the sorted row
    # itself (A_SORTED); output row: the pair, or the sorted row (OUT_SORTED). TMA_A / TMA_W: a_ptr
    # / w_ptr are tensor descriptors (sorted rows ``[rows, K]``; weights ``[experts * out, K]``).
    pid_m, pid_n = _tile(num_m_tiles, tl.cdiv(N, BN), GROUP_M)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    pairs = tl.load(pairs_ptr + rows)
    valid = pairs < num_pairs
    rk = tl.arange(0, BK)
    dtype = out_ptr.dtype.element_ty
    if not TMA_A:
        if A_SORTED:
            a_rows = rows.to(tl.int64)
        else:
            a_rows = tl.where(valid, pairs // A_DIV, 0).to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * stride_a + rk[None, :]
    if INTERLEAVED:
        # Column j of the product: gate column j // 2 (even j) or its up column (odd j).
        j = tl.arange(0, 2 * BN)
        rn = pid_n * BN + j // 2
        n_mask = rn < N
        w_rows = rn + (j % 2) * N
    else:
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
        w_rows = rn
    if TMA_W:
        w_row = (expert * (stride_we // stride_wn) + pid_n * BN).to(tl.int32)
    else:
        w_ptrs = w_ptr + expert * stride_we + w_rows[None, :].to(tl.int64) * stride_wn + rk[:, None]
        up_ptrs = w_ptrs + N * stride_wn
    acc = tl.zeros((BM, 2 * BN if INTERLEAVED else BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_mask = (k0 + rk) < K
        if TMA_A:
            a = a_ptr.load([pid_m * BM, k0])
        elif EVEN_K:
            a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_mask[None, :], other=0.0)
        if TMA_W:
            w = w_ptr.load([w_row, k0]).T
        elif EVEN_K:
            w = tl.load(w_ptrs + k0, mask=n_mask[None, :], other=0.0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0, eviction_policy="evict_first")
        acc = tl.dot(a, w.to(dtype), acc, input_precision=DOT_PRECISION)
        if GATED and not INTERLEAVED:
            if TMA_W:
                u = w_ptr.load([w_row + N, k0]).T
            elif EVEN_K:
                u = tl.load(up_ptrs + k0, mask=n_mask[None, :], other=0.0, eviction_policy="evict_first")
            else:
                u = tl.load(up_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0,
                            eviction_policy="evict_first")
            acc_up = tl.dot(a, u.to(dtype), acc_up, input_precision=DOT_PRECISION)
    out_ty = out_ptr.dtype.element_ty
    if SCALED:
        scales = scale_ptr + expert * stride_se + w_rows
        acc *= tl.load(scales, mask=n_mask, other=0.0)[None, :]
        if GATED and not INTERLEAVED:
            acc_up *= tl.load(scales + N, mask=n_mask, other=0.0)[None, :]
    if INTERLEAVED:
        acc, acc_up = tl.split(tl.reshape(acc, (BM, BN, 2)))
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
    # Rounded where the reference's separate ops round: the projection, silu, the product.
    res = acc.to(out_ty).to(tl.float32)
    if GATED:
        up = acc_up.to(out_ty).to(tl.float32)
        res = (res / (1.0 + tl.exp(-res))).to(out_ty).to(tl.float32) * up
    if WEIGHTED:
        res *= tl.load(route_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_rows = rows.to(tl.int64) if OUT_SORTED else pairs.to(tl.int64)
    out_ptrs = out_ptr + out_rows[:, None] * stride_out + rn[None, :]
    tl.store(out_ptrs, res.to(out_ty), mask=valid[:, None] & n_mask[None, :])


def _describable(t: torch.Tensor) -> bool:
    """Whether ``t``'s rows (all but its last dimension flattened) can be a tensor descriptor's."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0


def _weight(w) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float stack ``[E, out, in]`` or an 8-bit one (anything with ``qweight`` and ``scale``)."""
    if isinstance(w, torch.Tensor):
        return last_dim_contiguous(w), None
    return last_dim_contiguous(w.qweight), w.scale.contiguous()


def moe_gemm(a: torch.Tensor, weight, alignment: Alignment, num_pairs: int, a_div: int, gated: bool,
             route: torch.Tensor | None = None, config: MoeGemmConfig | None = None, a_sorted: bool = False,
             out_sorted: bool = False) -> torch.Tensor:
    """Every pair's row of ``a[pair // a_div] @ weight[expert].T`` (``gated``: ``silu(gate) * up``
    of the two halves of the output; ``route``: times the pair's router weight), ``[pairs, N]``.
    ``a_sorted``: ``a``'s rows are already in the alignment's padded order (row i: the pair
    ``alignment.pairs[i]``); ``out_sorted``: the result is too (``[padded rows, N]``, padding
    rows unwritten)."""
    require_triton()
    w, scale = _weight(weight)
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    if a.shape[-1] != k:
        raise ValueError(f"the experts take {k} inputs, the activations have {a.shape[-1]}")
    cfg = config or moe_config(num_pairs, gated)
    if cfg.block_m != alignment.block_m:
        raise ValueError(f"the alignment pads to {alignment.block_m} rows, the tiles take {cfg.block_m}")
    rows = alignment.pairs.numel() if out_sorted else num_pairs
    out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    if num_pairs == 0 or n == 0:
        return out
    num_m_tiles = alignment.block_experts.numel()
    grid = (num_m_tiles * cdiv(n, cfg.block_n),)
    tma = cfg.tma and TensorDescriptor is not None
    tma_a = tma and a_sorted and _describable(a)
    tma_w = tma and not (gated and cfg.interleaved) and _describable(w)
    a_arg = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k]) if tma_a else a
    w_arg = TensorDescriptor.from_tensor(w.reshape(-1, k), [cfg.block_n, cfg.block_k]) if tma_w else w
    _moe_gemm_kernel[grid](
        a_arg, w_arg, scale if scale is not None else a, out, alignment.pairs, alignment.block_experts,
        alignment.num_padded, route if route is not None else a, num_pairs, n, k, num_m_tiles, a.stride(0),
        w.stride(0), w.stride(1), scale.stride(0) if scale is not None else 0, out.stride(0),
        A_DIV=a_div, A_SORTED=a_sorted, OUT_SORTED=out_sorted, GATED=gated, INTERLEAVED=gated and cfg.interleaved,
        WEIGHTED=route is not None, SCALED=scale is not None, TMA_A=tma_a, TMA_W=tma_w, EVEN_K=k % cfg.block_k == 0,
        DOT_PRECISION=dot_precision(a.dtype), GROUP_M=cfg.group_m, BM=cfg.block_m, BN=cfg.block_n,
        BK=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


@triton.jit
def _sum_top_k_kernel(outs_ptr, out_ptr, N, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    # Program (token, column block): the token's TOP_K rows summed in float32, in k order.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(TOP_K):
        acc += tl.load(outs_ptr + (token * TOP_K + k) * N + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * N + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_top_k(outs: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[T * top_k, N]`` contiguous rows -> each token's ``top_k`` rows summed, ``[T, N]``."""
    tokens, n = outs.shape[0] // top_k, outs.shape[1]
    out = torch.empty((tokens, n), dtype=outs.dtype, device=outs.device)
    if tokens and n:
        block = min(1024, next_pow2(n))
        _sum_top_k_kernel[(tokens, cdiv(n, block))](outs, out, n, TOP_K=top_k, BLOCK=block, num_warps=4)
    return out


def fused_moe_triton(x: torch.Tensor, gate_up, down, experts: torch.Tensor, weights: torch.Tensor,
                     num_experts: int, configs: tuple[MoeGemmConfig, MoeGemmConfig] | None = None) -> torch.Tensor:
    """The routed experts' output ``[T, hidden]`` for ``x`` ``[T, hidden]``, each token's
    ``experts`` ``[T, top_k]`` weighted by ``weights`` (in ``x``'s dtype); ``gate_up``
    ``[E, 2 * inter, hidden]`` (gate then up) and ``down`` ``[E, hidden, inter]``, float or 8-bit."""
    require_triton()
    x = last_dim_contiguous(x)
    tokens, top_k = experts.shape
    num_pairs = tokens * top_k
    up_cfg, down_cfg = configs or (moe_config(num_pairs, True), moe_config(num_pairs, False))
    if up_cfg.block_m != down_cfg.block_m:
        raise ValueError("both projections must take the same row tiles (one alignment)")
    alignment = align(experts, num_experts, up_cfg.block_m)
    hidden = moe_gemm(x, gate_up, alignment, num_pairs, top_k, True, config=up_cfg, out_sorted=up_cfg.sorted_rows)
    route = weights.reshape(-1).contiguous()
    outs = moe_gemm(hidden, down, alignment, num_pairs, 1, False, route=route, config=down_cfg,
                    a_sorted=up_cfg.sorted_rows)
    return sum_top_k(outs, top_k)
