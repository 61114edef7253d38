"""Routed experts as two grouped GEMM launches, with sizes fixed by the token count alone.

The torch reference loops over the experts on the host (each one's token count read back), so a
sparse step cannot be captured in a CUDA graph. Here :func:`align` sorts the (token, expert) pairs
by expert on the device and pads each expert's run to the GEMM's row tile, so every tile of rows
belongs to one expert; the buffers have their static upper bound (``pairs + min(experts, pairs) *
(BLOCK_M - 1)`` rows) and tiles past the used ones return at once. One launch computes every
pair's ``silu(gate) * up`` (gate and up columns in the same program, fused in the epilogue), a
second the down projection times the router weight; a third sums a token's ``top_k`` outputs in
float32 in k order (no atomics: the same numbers every run). Weights are float (``[experts, out, in]``) or 8-bit codes with one float32 scale an
output channel (converted to the activations' dtype in the tile, exact, and scaled in the epilogue).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import (
    _INTERPRETED,
    HAS_TRITON,
    cdiv,
    dot_precision,
    last_dim_contiguous,
    next_pow2,
    require_triton,
    tl,
    triton,
)


@dataclass(frozen=True)
class Alignment:
    """(token, expert) pairs sorted by expert and padded per expert to ``block_m`` rows."""

    #: ``[max_padded]`` int32: each row's pair index ``token * top_k + k``, ``num_pairs`` on padding.
    pairs: torch.Tensor
    #: ``[max_padded // block_m]`` int32: each row tile's expert (-1 past the used tiles).
    block_experts: torch.Tensor
    #: ``[1]`` int32: the rows in use (a multiple of ``block_m``); later tiles do nothing.
    num_padded: torch.Tensor
    block_m: int


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows an alignment of ``num_pairs`` pairs can use: every expert that gets a pair
    (at most ``min(experts, pairs)``) pads its run by fewer than ``block_m`` rows."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return cdiv(bound, block_m) * block_m


#: Pairs up to which :func:`align` is one Triton program (a decode step's: one launch where the
#: torch ops take a dozen, each a few microseconds in a graph, on every sparse layer).
ALIGN_ONE_PROGRAM_PAIRS = 1024
#: Pairs a step of the one-program alignment takes (its one-hot tile: 64 by the experts).
ALIGN_CHUNK = 64


def align(experts: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the pairs of ``experts`` ``[T, top_k]`` by expert (a token's pairs in token order
    within each expert) and pad each expert's run to ``block_m`` rows, all on the device: no value
    is read on the host, so the step that calls it can be captured in a CUDA graph. Few pairs on
    Triton's device: :func:`align_triton` (the same layout)."""
    if (experts.is_cuda or _INTERPRETED) and HAS_TRITON and 0 < experts.numel() <= ALIGN_ONE_PROGRAM_PAIRS:
        return align_triton(experts, num_experts, block_m)
    return align_ref(experts, num_experts, block_m)


def align_ref(experts: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """:func:`align` in torch ops (a dozen launches)."""
    flat = experts.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    rows = max_padded_rows(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    dest = pad_start[sorted_experts] + torch.arange(num_pairs, device=device) - start[sorted_experts]
    pairs = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    pairs.scatter_(0, dest, order.to(torch.int32))
    tile_starts = torch.arange(0, rows, block_m, device=device)
    block_experts = torch.searchsorted(pad_end, tile_starts, right=True)
    used = pad_end[-1:]
    block_experts = torch.where(tile_starts < used, block_experts, -1).to(torch.int32)
    return Alignment(pairs, block_experts, used.to(torch.int32), block_m)


@triton.jit
def _align_kernel(experts_ptr, pairs_ptr, block_experts_ptr, num_padded_ptr, num_pairs, num_experts, rows,
                  BM: tl.constexpr, E_BLOCK: tl.constexpr, CHUNK: tl.constexpr, R_BLOCK: tl.constexpr):
    # One program, over the pairs in chunks of a [CHUNK, experts] one-hot matrix: first each
    # expert's count, then each pair's rank among its expert's pairs (the count before its chunk
    # plus a cumulative sum down the chunk) and its row.
    e = tl.arange(0, E_BLOCK)
    c = tl.arange(0, CHUNK)
    counts = tl.zeros((E_BLOCK,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        flat = tl.load(experts_ptr + p0 + c, mask=p0 + c < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((flat[:, None] == e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BM - 1) // BM * BM
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    for r0 in range(0, rows, R_BLOCK):
        r = r0 + tl.arange(0, R_BLOCK)
        tl.store(pairs_ptr + r, tl.zeros((R_BLOCK,), dtype=tl.int32) + num_pairs, mask=r < rows)
    tl.debug_barrier()  # the padding first, then the pairs over it
    before = tl.zeros((E_BLOCK,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        flat = tl.load(experts_ptr + p0 + c, mask=p0 + c < num_pairs, other=-1).to(tl.int32)
        hot = (flat[:, None] == e[None, :]).to(tl.int32)
        row = (pad_start + before)[None, :] + tl.cumsum(hot, axis=0) - 1
        tl.store(pairs_ptr + tl.sum(hot * row, axis=1), p0 + c, mask=p0 + c < num_pairs)
        before += tl.sum(hot, axis=0)
    used = tl.sum(padded, axis=0)
    for t0 in range(0, rows // BM, CHUNK):
        starts = (t0 + c) * BM
        owner = tl.sum(((pad_end[None, :] <= starts[:, None]) & (e[None, :] < num_experts)).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + t0 + c, tl.where(starts < used, owner, -1), mask=starts < rows)
    tl.store(num_padded_ptr, used)


def align_triton(experts: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """:func:`align` as one program (up to :data:`ALIGN_ONE_PROGRAM_PAIRS` pairs)."""
    require_triton()
    flat = experts.reshape(-1).contiguous()
    num_pairs = flat.numel()
    if num_pairs > ALIGN_ONE_PROGRAM_PAIRS:
        raise ValueError(f"{num_pairs} pairs: one program aligns at most {ALIGN_ONE_PROGRAM_PAIRS}")
    rows = max_padded_rows(num_pairs, num_experts, block_m)
    pairs = torch.empty(rows, dtype=torch.int32, device=flat.device)
    block_experts = torch.empty(rows // block_m, dtype=torch.int32, device=flat.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](flat, pairs, block_experts, num_padded, num_pairs, num_experts, rows, BM=block_m,
                        E_BLOCK=next_pow2(max(num_experts, 16)), CHUNK=ALIGN_CHUNK, R_BLOCK=1024, num_warps=4)
    return Alignment(pairs, block_experts, num_padded, block_m)


@dataclass(frozen=True)
class MoeGemmConfig:
    """Tiles and launch options of the grouped GEMM (``block_n``: a gated launch computes that many
    gate and as many up columns)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


#: Pairs up to which a step counts as decode-sized: tiles of 16 rows (a decode batch spreads its
#: pairs thinly over the experts, so larger tiles would be mostly padding).
FEW_PAIRS = 1024


def moe_config(num_pairs: int, gated: bool) -> MoeGemmConfig:
    """Few pairs: 16-row tiles, long K steps (weight-bound, like the dense weight-only GEMM);
    many: 64-row tiles by 128 columns (64 + 64 gated), three stages in flight (under 130 KiB of
    shared memory)."""
    if num_pairs <= FEW_PAIRS:
        return MoeGemmConfig(16, 64, 128, num_warps=4, num_stages=4)
    return MoeGemmConfig(64, 64 if gated else 128, 64, num_warps=4 if gated else 8, num_stages=3)


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, scale_ptr, out_ptr, pairs_ptr, block_experts_ptr, num_padded_ptr, route_ptr,
                     num_pairs, N, K, stride_a, stride_we, stride_wn, stride_se, stride_out,
                     A_DIV: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr, SCALED: tl.constexpr,
                     EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # Program (row tile, column tile): one expert's BM sorted pairs by BN output columns (and the
    # matching up columns N further on when GATED), over all of K. Input row of a pair: pair // A_DIV.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    pairs = tl.load(pairs_ptr + pid_m * BM + tl.arange(0, BM))
    valid = pairs < num_pairs
    a_rows = tl.where(valid, pairs // A_DIV, 0).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    n_mask = rn < N
    dtype = a_ptr.dtype.element_ty
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + rk[None, :]
    w_ptrs = w_ptr + expert * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    up_ptrs = w_ptrs + N * stride_wn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_mask[None, :], other=0.0, eviction_policy="evict_first")
        else:
            k_mask = (k0 + rk) < K
            a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0, eviction_policy="evict_first")
        acc = tl.dot(a, w.to(dtype), acc, input_precision=DOT_PRECISION)
        if GATED:
            if EVEN_K:
                u = tl.load(up_ptrs + k0, mask=n_mask[None, :], other=0.0, eviction_policy="evict_first")
            else:
                u = tl.load(up_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0,
                            eviction_policy="evict_first")
            acc_up = tl.dot(a, u.to(dtype), acc_up, input_precision=DOT_PRECISION)
    out_ty = out_ptr.dtype.element_ty
    if SCALED:
        scales = scale_ptr + expert * stride_se + rn
        acc *= tl.load(scales, mask=n_mask, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(scales + N, mask=n_mask, other=0.0)[None, :]
    # Rounded where the reference's separate ops round: the projection, silu, the product.
    res = acc.to(out_ty).to(tl.float32)
    if GATED:
        up = acc_up.to(out_ty).to(tl.float32)
        res = (res / (1.0 + tl.exp(-res))).to(out_ty).to(tl.float32) * up
    if WEIGHTED:
        res *= tl.load(route_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_out + rn[None, :]
    tl.store(out_ptrs, res.to(out_ty), mask=valid[:, None] & n_mask[None, :])


def _weight(w) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float stack ``[E, out, in]`` or an 8-bit one (anything with ``qweight`` and ``scale``)."""
    if isinstance(w, torch.Tensor):
        return last_dim_contiguous(w), None
    return last_dim_contiguous(w.qweight), w.scale.contiguous()


def moe_gemm(a: torch.Tensor, weight, alignment: Alignment, num_pairs: int, a_div: int, gated: bool,
             route: torch.Tensor | None = None, config: MoeGemmConfig | None = None) -> torch.Tensor:
    """Every pair's row of ``a[pair // a_div] @ weight[expert].T`` (``gated``: ``silu(gate) * up``
    of the two halves of the output; ``route``: times the pair's router weight), ``[pairs, N]``."""
    require_triton()
    w, scale = _weight(weight)
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    if a.shape[-1] != k:
        raise ValueError(f"the experts take {k} inputs, the activations have {a.shape[-1]}")
    cfg = config or moe_config(num_pairs, gated)
    if cfg.block_m != alignment.block_m:
        raise ValueError(f"the alignment pads to {alignment.block_m} rows, the tiles take {cfg.block_m}")
    out = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    if num_pairs == 0 or n == 0:
        return out
    grid = (alignment.block_experts.numel(), cdiv(n, cfg.block_n))
    _moe_gemm_kernel[grid](
        a, w, scale if scale is not None else a, out, alignment.pairs, alignment.block_experts,
        alignment.num_padded, route if route is not None else a, num_pairs, n, k, a.stride(0), w.stride(0),
        w.stride(1), scale.stride(0) if scale is not None else 0, out.stride(0),
        A_DIV=a_div, GATED=gated, WEIGHTED=route is not None, SCALED=scale is not None, EVEN_K=k % cfg.block_k == 0,
        DOT_PRECISION=dot_precision(a.dtype), BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
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
    hidden = moe_gemm(x, gate_up, alignment, num_pairs, top_k, True, config=up_cfg)
    route = weights.reshape(-1).contiguous()
    outs = moe_gemm(hidden, down, alignment, num_pairs, 1, False, route=route, config=down_cfg)
    return sum_top_k(outs, top_k)
