"""Decode attention that reads every kv head of a slot in one access.

A pool stores a token's keys as ``[slots, kv_heads, row]``: all heads of one slot lie side by
side (8 x 144 bytes for fp8 rows of 128 values, 8 x 256 in bfloat16), while the slots of one
sequence are scattered. A program per (sequence, kv head) reads each slot's row of its head
alone, an isolated 144-byte access; here a program per (sequence, split, group of ``BLOCK_H``
kv heads) reads the whole run of its heads for each slot, so a tile of ``BLOCK_N`` slots is
``BLOCK_N`` contiguous runs. The products run per head as batched dots: q as
``[heads, q heads of a group (padded to 16), head_dim]`` against the tile as
``[heads, head_dim, slots]``; the online softmax keeps one row per q head.

Quantized rows (:mod:`kernels.kv_quant`) are met by q as float16 (a bfloat16 q scaled per row by
a power of two, :func:`kernels._tiles.float16_rows`): the codes convert to float16 exactly; each
key's scale multiplies its scores, each value's scale enters its key's score as its log2 and the
sum of weights divides it back out (``V_IN_SHIFT`` of :func:`kernels._tiles.attend_tile`).

The splits' partials are merged by :func:`_slots_merge_kernel`, one program per (sequence, kv
head) over its q heads and the splits.

Measured on an H200 (8B heads, batch 64 x 4k context, slots shuffled over the pool, fp8): the
runs read at the per-head kernel's rate (331 us against 350, ~12.5 billion (token, head) rows a
second either way, as bfloat16's 256-byte rows), so the rows' isolation is not what bounds it;
``python -m pd_cluster.bench.gpu.kv_read_probe`` reads the same pattern with nothing around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import _slot_tiles, _tiles
from kernels._triton import (
    cdiv,
    dot_precision,
    last_dim_contiguous,
    next_pow2,
    pdl_options,
    pdl_wait,
    require_triton,
    tl,
    triton,
    use_pdl,
)
from kernels.kv_quant import QUANT_CODES, ROW_ALIGN, scale_offset

_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class SlotsConfig:
    """A launch of the slot-run kernel: tile slots, kv heads a program, warps, pipeline depth and
    programs a multiprocessor the split count aims at."""

    block_n: int
    block_h: int
    num_warps: int
    num_stages: int
    per_sm: float
    ahead: bool = False


def slots_config(quant: str | None, num_kv_heads: int, dtype: torch.dtype) -> SlotsConfig:
    """The default launch: 4 kv heads a program, 16-slot tiles, 4 warps, the next tile read
    ahead, ~1.5 programs a multiprocessor (2 splits at batch 64 of 8 kv heads). Measured on an
    H200 (8B heads, batch 64 x 4k context, shuffled slots, fp8, one run each, kv_attn_sweep
    --set slots): 331 us against 341 at 4 splits, 488 without the tile ahead, 536 with 8 heads a
    program (8 warps, one program a multiprocessor) and the per-head kernel's 350; a program's
    tile is a chain of dependent steps (slots, rows, conversions, products), and registers for
    few programs a multiprocessor leave it exposed."""
    block_h = slots_head_block(num_kv_heads, 4)
    return SlotsConfig(block_n=16, block_h=block_h, num_warps=4, num_stages=1, per_sm=1.5, ahead=True)


@triton.jit
def _slots_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_table_ptr,
    ctx_lens_ptr,
    rows_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_table,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE_AT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
    QUANT: tl.constexpr,
    Q_F16: tl.constexpr,
    AHEAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    ctx_len = tl.load(ctx_lens_ptr + seq).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(ctx_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, ctx_len)
    row = tl.load(rows_ptr + seq).to(tl.int64) if HAS_ROWS else seq
    table_row = slot_table_ptr + row * stride_table

    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    head = h[:, None] * GROUP + g[None, :]  # [H, G] q heads
    _tiles.gdc_wait(USE_PDL)
    q = tl.load(q_ptr + seq * stride_qb + head[:, :, None] * stride_qh + d[None, None, :],
                mask=g_ok[None, :, None] & d_ok[None, None, :], other=0.0)
    qk_scale = tl.full([BLOCK_H, BLOCK_G], 1.0, tl.float32) * scale_log2
    if Q_F16:
        # Each q row in float16 units of a power of two (exact; see kernels._tiles.float16_rows).
        qf = q.to(tl.float32)
        amax_exp = (tl.max(tl.abs(qf), axis=2).to(tl.int32, bitcast=True) >> 23) & 0xFF
        amax_exp = tl.minimum(tl.maximum(amax_exp, 1), 253)
        qk_scale = qk_scale * (amax_exp << 23).to(tl.float32, bitcast=True)
        q = (qf * ((254 - amax_exp) << 23).to(tl.float32, bitcast=True)[:, :, None]).to(tl.float16)
    m_i = tl.full([BLOCK_H, BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H, BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_G, BLOCK_D], dtype=tl.float32)
    n_offs = tl.arange(0, BLOCK_N)
    words: tl.constexpr = QUANT != 0 and q.dtype == tl.float16
    if AHEAD:
        # Each iteration reads the next tile (and the slots of the one after) before computing
        # its own: a tile's bytes stay in flight while the program computes.
        n = lo + n_offs
        n_ok = n < hi
        slots = tl.load(table_row + n, mask=n_ok, other=0).to(tl.int64)
        k_raw, k_scale, v_raw, v_scale = _slot_tiles.load_kv(
            k_cache_ptr, v_cache_ptr, slots, h, d, n_ok, stride_ks, stride_kh, stride_vs, stride_vh, SCALE_AT,
            QUANT, words, HEAD_DIM)
        slots = tl.load(table_row + n + BLOCK_N, mask=n + BLOCK_N < hi, other=0).to(tl.int64)
        for start in range(lo, hi, BLOCK_N):
            n = start + n_offs
            n_ok = n < hi
            k_next, k_scale_next, v_next, v_scale_next = _slot_tiles.load_kv(
                k_cache_ptr, v_cache_ptr, slots, h, d, n + BLOCK_N < hi, stride_ks, stride_kh, stride_vs, stride_vh,
                SCALE_AT, QUANT, words, HEAD_DIM)
            slots = tl.load(table_row + n + 2 * BLOCK_N, mask=n + 2 * BLOCK_N < hi, other=0).to(tl.int64)
            k = _slot_tiles.tile_values(k_raw, BLOCK_D, QUANT, False, q.dtype)
            v = _slot_tiles.tile_values(v_raw, BLOCK_D, QUANT, words, q.dtype)
            acc, m_i, l_i = _slot_tiles.attend(q, k, k_scale, v, v_scale, n_ok, acc, m_i, l_i, qk_scale, QUANT,
                                               DOT_PRECISION)
            k_raw, k_scale, v_raw, v_scale = k_next, k_scale_next, v_next, v_scale_next
    else:
        for start in range(lo, hi, BLOCK_N):
            n = start + n_offs
            n_ok = n < hi
            slots = tl.load(table_row + n, mask=n_ok, other=0).to(tl.int64)
            k_raw, k_scale, v_raw, v_scale = _slot_tiles.load_kv(
                k_cache_ptr, v_cache_ptr, slots, h, d, n_ok, stride_ks, stride_kh, stride_vs, stride_vh, SCALE_AT,
                QUANT, words, HEAD_DIM)
            k = _slot_tiles.tile_values(k_raw, BLOCK_D, QUANT, False, q.dtype)
            v = _slot_tiles.tile_values(v_raw, BLOCK_D, QUANT, words, q.dtype)
            acc, m_i, l_i = _slot_tiles.attend(q, k, k_scale, v, v_scale, n_ok, acc, m_i, l_i, qk_scale, QUANT,
                                               DOT_PRECISION)
    _tiles.gdc_release(USE_PDL)

    # An empty split reports lse = -inf and weighs nothing in the merge.
    has_keys = l_i > 0.0
    part = acc / tl.where(has_keys, l_i, 1.0)[:, :, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(part_out_ptr + seq * stride_pb + head[:, :, None] * stride_ph + split * stride_ps + d[None, None, :],
             part, mask=g_ok[None, :, None] & d_ok[None, None, :])
    tl.store(part_lse_ptr + seq * stride_lb + head * stride_lh + split, lse, mask=g_ok[None, :])


@triton.jit
def _slots_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The output of one kv head's q heads of one sequence from the splits' partials, each
    weighed by its log-sum-exp against their largest (base 2)."""
    pdl_wait(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    head = tl.program_id(1) * GROUP + g
    g_ok = g < GROUP
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq * stride_lb + head[:, None] * stride_lh + sp[None, :],
                  mask=g_ok[:, None] & sp_ok[None, :], other=float("-inf"))
    m = tl.max(lse, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - m[:, None]), 0.0)  # [G, S]
    part = tl.load(part_out_ptr + seq * stride_pb + head[:, None, None] * stride_ph + sp[None, :, None] * stride_ps
                   + d[None, None, :], mask=(g_ok[:, None] & sp_ok[None, :])[:, :, None] & d_ok[None, None, :],
                   other=0.0)
    total = tl.sum(w, axis=1)
    out = tl.sum(part * w[:, :, None], axis=1) / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_ob + head[:, None] * stride_oh + d[None, :], out,
             mask=g_ok[:, None] & d_ok[None, :])


#: Fewest (sequence, kv head) pairs the engine's decode attention reads with this kernel: fewer
#: (small batches, latency-bound) stay on the per-head kernel, whose first tile is read before its
#: wait on the kernel before and whose programs a head each fill more multiprocessors.
SLOTS_MIN_PAIRS = 129


#: The quantized KV kinds the engine reads with this kernel: fp8 (331 us against the per-head
#: kernel's 350, above); int8 measured only without the tile ahead (521 against 345), so it stays.
SLOTS_KINDS = ("fp8_e4m3",)


def slots_applies(quant: str | None, batch: int, num_kv_heads: int) -> bool:
    """Whether the engine's decode attention takes this kernel: :data:`SLOTS_KINDS` at batches of
    at least :data:`SLOTS_MIN_PAIRS` (sequence, kv head) pairs."""
    return quant in SLOTS_KINDS and batch * num_kv_heads >= SLOTS_MIN_PAIRS


def slots_head_block(num_kv_heads: int, limit: int = 8) -> int:
    """Kv heads a program reads a slot's rows of: the largest power of two that divides the
    model's kv heads, at most ``limit``."""
    block = 1
    while block * 2 <= limit and num_kv_heads % (block * 2) == 0:
        block *= 2
    return block


def slots_num_splits(batch: int, head_groups: int, max_ctx: int, block_n: int, device: torch.device,
                     per_sm: float = 2.0) -> int:
    """Splits of each sequence's context for about ``per_sm`` programs a multiprocessor, never a
    split shorter than one tile, at most 32; decided by shapes only (CUDA graphs)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = cdiv(int(per_sm * sms), max(1, batch * head_groups))
    return max(1, min(wanted, cdiv(max_ctx, block_n), 32))


def _check_caches(quant: str | None, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The kernel's ``QUANT`` for caches of kind ``quant``; quantized rows must be uint8 and start
    at multiples of 16 bytes (the tiles are read in 16-byte units)."""
    if quant not in QUANT_CODES:
        raise ValueError(f"unknown quantized KV kind {quant!r}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV caches must be contiguous in head_dim")
    if quant is not None:
        if k_cache.dtype != torch.uint8 or v_cache.dtype != torch.uint8:
            raise ValueError(f"{quant} KV caches hold uint8 rows, got {k_cache.dtype}")
        if any(c.stride(i) % ROW_ALIGN for c in (k_cache, v_cache) for i in (0, 1)):
            raise ValueError(f"{quant} KV rows must start at multiples of {ROW_ALIGN} bytes")
    return QUANT_CODES[quant]


def decode_attention_slots(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float,
    *,
    block_n: int | None = None,
    block_h: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    ahead: bool | None = None,
    max_registers: int | None = None,
    out: torch.Tensor | None = None,
    table_rows: torch.Tensor | None = None,
    quant: str | None = None,
) -> torch.Tensor:
    """One query token per sequence against its context (as
    :func:`kernels.attention.decode_attention_ref`), each program over ``block_h`` kv heads of a
    tile of ``block_n`` slots; ``out``, ``table_rows`` and ``quant`` as in
    :func:`kernels.attention.decode_attention_triton`; ``ahead``: each program reads its next
    tile while computing one (best with ``num_stages`` 1); ``max_registers``: a thread's register
    limit (more programs a multiprocessor, some values spilled). Unset sizes come from
    :func:`slots_config`; the split count from :func:`slots_num_splits`."""
    require_triton()
    quant_code = _check_caches(quant, k_cache, v_cache)
    q = last_dim_contiguous(q)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"attention output {tuple(out.shape)} {out.dtype} does not fit q {tuple(q.shape)}")
    if batch == 0:
        return out
    config = slots_config(quant, num_kv_heads, q.dtype)
    block_h = block_h or config.block_h
    if num_kv_heads % block_h or block_h & (block_h - 1):
        raise ValueError(f"block_h {block_h} must be a power of two dividing {num_kv_heads} kv heads")
    block_n, num_warps = block_n or config.block_n, num_warps or config.num_warps
    num_stages = num_stages or config.num_stages
    ahead = config.ahead if ahead is None else ahead
    head_groups = num_kv_heads // block_h
    if num_splits is None:
        num_splits = slots_num_splits(batch, head_groups, slot_table.shape[1], block_n, q.device, config.per_sm)
    block_d = next_pow2(head_dim)
    if num_splits == 1:
        part_out = out.unsqueeze(2)  # one split's normalised partial is the output
    else:
        part_out = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    pdl = use_pdl(q)
    q_f16 = quant is not None and q.dtype == torch.bfloat16
    block_g = max(16, next_pow2(group))
    _slots_split_kernel[(batch, num_splits, head_groups)](
        q, k_cache, v_cache, slot_table, ctx_lens, table_rows if table_rows is not None else ctx_lens,
        part_out, part_lse, sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        slot_table.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_H=block_h, BLOCK_G=block_g,
        BLOCK_N=block_n, BLOCK_D=block_d, SCALE_AT=scale_offset(head_dim), DOT_PRECISION=dot_precision(q.dtype),
        HAS_ROWS=table_rows is not None, USE_PDL=pdl, QUANT=quant_code, Q_F16=q_f16, AHEAD=ahead,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(pdl),
        **({"maxnreg": max_registers} if max_registers else {}),
    )
    if num_splits > 1:
        merge_splits(part_out, part_lse, out, num_kv_heads, pdl)
    return out


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_kv_heads: int,
                 pdl: bool) -> torch.Tensor:
    """``out`` ``[B, Hq, D]`` from the splits' normalised partials ``[B, Hq, S, D]`` (float32) and
    their log-sum-exps ``[B, Hq, S]`` (base 2), a program per (sequence, kv head); launched as a
    dependent of the split kernel where ``pdl``."""
    batch, num_q_heads, num_splits, head_dim = part_out.shape
    group = num_q_heads // num_kv_heads
    _slots_merge_kernel[(batch, num_kv_heads)](
        part_out, part_lse, out, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_G=next_pow2(group),
        BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(head_dim), USE_PDL=pdl, num_warps=4, **pdl_options(pdl),
    )
    return out
