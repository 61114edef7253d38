"""Context (prefill) attention on Triton: new tokens of every sequence against their whole
context, cached prefix included, in flash-attention tiles; a launch of few tiles splits each
tile's keys over several programs and merges their parts. The batch's layout is
:mod:`kernels.attention`'s; its reference is :func:`kernels.attention.context_attention_ref`.
"""

from __future__ import annotations

import torch

from kernels import _tiles
from kernels._attention_common import _LOG2E, _q_float16, attention_launch
from kernels._triton import cdiv, dot_precision, next_pow2, tl, triton


# --------------------------------------------------------------------------------------------
# Prefill: new tokens against their whole context (cached prefix included), flash-attention tiles.
#
# GQA: one program serves one kv head and a tile of query tokens for *all* the q heads that
# share it, packed into the rows of the tile (row r = token r // GROUP, head r % GROUP), so each
# K/V tile is loaded once per group. The grid's first axis walks every sequence's query tiles;
# a program finds its sequence from a cumulative tile count made on the device, so launching
# needs no host sync.
# --------------------------------------------------------------------------------------------


# Triton specializes integer arguments on ``== 1`` and divisibility by 16: a batch of one sequence
# and a batch of 21 would each compile their own kernel, stalling every stream for about a second
# the first time a step mixed a prefill with a decode batch (seen on an H200). The arguments that
# follow the batch are not specialized: one compiled kernel serves every step.
@triton.jit
def _context_tile_seq(tile, tile_ends_ptr, num_seqs, BLOCK_B: tl.constexpr):
    """The sequence that owns ``tile``: sequence b owns tiles [tile_ends[b-1], tile_ends[b]);
    ``num_seqs`` for a tile past the last (a program with nothing to do)."""
    b_offs = tl.arange(0, BLOCK_B)
    ends = tl.load(tile_ends_ptr + b_offs, mask=b_offs < num_seqs, other=2147483647)
    return tl.sum((ends <= tile).to(tl.int32), axis=0)


@triton.jit
def _context_tile_rows(tile, seq, kv_head, tile_ends_ptr, q_lens_ptr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_M: tl.constexpr):
    """A tile's rows: ``BLOCK_Q`` query tokens of ``seq`` times the ``GROUP`` q heads of ``kv_head``.
    Returns (the tile's index within its sequence, each row's token within the sequence's new
    tokens, each row's q head, which rows hold a token)."""
    seq_end = tl.load(tile_ends_ptr + seq)
    q_len = tl.load(q_lens_ptr + seq).to(tl.int32)
    q_tile = tile - (seq_end - tl.cdiv(q_len, BLOCK_Q))
    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    return q_tile, tok, head, row_ok


@triton.jit(do_not_specialize=["num_seqs", "stride_table"])
def _context_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    slot_table_ptr,
    ctx_lens_ptr,
    q_lens_ptr,
    q_start_ptr,
    tile_ends_ptr,
    rows_ptr,
    num_seqs,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    QUANT: tl.constexpr,
    Q_F16: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
):
    tile = tl.program_id(0)
    if HEAVY_FIRST:
        # A sequence's later tiles see more keys: launched first, the longest programs do not
        # trail the launch's last wave.
        tile = tl.num_programs(0) - 1 - tile
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _context_tile_seq(tile, tile_ends_ptr, num_seqs, BLOCK_B)
    if seq >= num_seqs:
        return
    ctx_len = tl.load(ctx_lens_ptr + seq).to(tl.int32)
    q_len = tl.load(q_lens_ptr + seq).to(tl.int32)
    q_start = tl.load(q_start_ptr + seq).to(tl.int64)
    q_tile, tok, head, row_ok = _context_tile_rows(tile, seq, kv_head, tile_ends_ptr, q_lens_ptr, GROUP, BLOCK_Q,
                                                   BLOCK_M)
    prefix_len = ctx_len - q_len  # position of the first new token
    q_pos = prefix_len + tok
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q_ptrs = q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if Q_F16:
        q, q_unit = _tiles.float16_rows(q)
        scale_log2 = scale_log2 * q_unit[:, None]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row = tl.load(rows_ptr + seq).to(tl.int64) if HAS_ROWS else seq.to(tl.int64)
    table_row = slot_table_ptr + row * stride_table
    n_offs = tl.arange(0, BLOCK_N)

    # The keys this tile sees, [0, kv_end); with splits, this program's share [lo, hi) of them,
    # whole BLOCK_N tiles but the last.
    first_pos = prefix_len + q_tile * BLOCK_Q
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(ctx_len, first_pos + BLOCK_Q)
    if NUM_SPLITS == 1:
        lo = 0
        hi = kv_end
    else:
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(kv_end, lo + per_split)

    # Keys before this tile's first query position: every row sees all of them, no mask.
    for start in range(lo, tl.minimum(hi, full_end), BLOCK_N):
        slots = tl.load(table_row + start + n_offs).to(tl.int64)
        k, v, k_scale, v_scale = _tiles.load_kv_tile(k_cache_ptr, v_cache_ptr, slots, kv_head, d, d_ok[None, :],
                                                     stride_ks, stride_kh, stride_vs, stride_vh, None, HEAD_DIM, QUANT)
        acc, m_i, l_i = _tiles.attend_tile(q, k, v, acc, m_i, l_i, scale_log2, None, None, None, DOT_PRECISION,
                                           k_scale, v_scale)

    # The diagonal: causal mask, and the end of the keys this program sees.
    for start in range(tl.maximum(lo, full_end), hi, BLOCK_N):
        n = start + n_offs
        n_ok = n < hi
        slots = tl.load(table_row + n, mask=n_ok, other=0).to(tl.int64)
        k, v, k_scale, v_scale = _tiles.load_kv_tile(k_cache_ptr, v_cache_ptr, slots, kv_head, d,
                                                     n_ok[:, None] & d_ok[None, :], stride_ks, stride_kh, stride_vs,
                                                     stride_vh, n_ok, HEAD_DIM, QUANT)
        acc, m_i, l_i = _tiles.attend_tile(q, k, v, acc, m_i, l_i, scale_log2, n, n_ok, q_pos, DOT_PRECISION,
                                           k_scale, v_scale)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Unnormalised partials, merged by _context_merge_kernel: [split, tile, kv head, row(, d)].
        rows = tl.arange(0, BLOCK_M)
        at = ((split * tl.num_programs(0) + tile) * tl.num_programs(1) + kv_head).to(tl.int64) * BLOCK_M + rows
        tl.store(part_m_ptr + at, m_i)
        tl.store(part_l_ptr + at, l_i)
        tl.store(part_acc_ptr + at[:, None] * BLOCK_D + d[None, :], acc)


@triton.jit(do_not_specialize=["num_seqs"])
def _context_merge_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    q_lens_ptr,
    q_start_ptr,
    tile_ends_ptr,
    num_seqs,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One tile's rows from the splits' partials: each split's sum rescaled to the rows' overall
    maximum (base 2), divided by the rescaled sum of weights."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_tiles = tl.num_programs(0)
    num_kv_heads = tl.num_programs(1)
    seq = _context_tile_seq(tile, tile_ends_ptr, num_seqs, BLOCK_B)
    if seq >= num_seqs:
        return
    q_start = tl.load(q_start_ptr + seq).to(tl.int64)
    q_tile, tok, head, row_ok = _context_tile_rows(tile, seq, kv_head, tile_ends_ptr, q_lens_ptr, GROUP, BLOCK_Q,
                                                   BLOCK_M)
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        at = ((s * num_tiles + tile) * num_kv_heads + kv_head).to(tl.int64) * BLOCK_M + rows
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + at))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        at = ((s * num_tiles + tile) * num_kv_heads + kv_head).to(tl.int64) * BLOCK_M + rows
        w = tl.exp2(tl.load(part_m_ptr + at) - m_max)
        l_sum += w * tl.load(part_l_ptr + at)
        acc += w[:, None] * tl.load(part_acc_ptr + at[:, None] * BLOCK_D + d[None, :])
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    o_ptrs = out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])


def _context_config(dtype: torch.dtype, quant: str | None = None) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages). 16-bit keys and values: 128 x 64 tiles, 8 warps,
    3 stages, the fastest of twelve tilings on an H200 (a fresh 4096-token prompt, 32 q / 8 kv
    heads of 128, tiles heaviest first: 0.55 ms, 248 TFLOP/s, against 0.77 ms for 64 x 32, 4
    warps, 2 stages). float32 (its split tf32 operands must fit shared memory) and quantized KV
    keep 64 x 32, 4 warps, 2 stages."""
    if quant is None and dtype in (torch.bfloat16, torch.float16):
        return 128, 64, 8, 3
    return 64, 32, 4, 2


#: Most splits of a tile's keys (see :func:`_context_num_splits`).
MAX_CONTEXT_SPLITS = 8


def _context_num_splits(programs: int, device: torch.device) -> int:
    """Splits of each tile's keys so that a launch of few tiles still fills the device: a short
    chunk after a long cached prefix (a later turn of a chat) is a few tiles, each walking the
    whole prefix alone; split, its programs share the walk and a merge adds their parts up.
    Decided by the launch's shapes only, so a CUDA graph captures one choice. One split where the
    tiles already fill every multiprocessor twice (a fresh long prompt), and off the GPU."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= target:
        return 1
    return min(MAX_CONTEXT_SPLITS, next_pow2(cdiv(target, programs)))


#: Least width of the context kernel's tile -> sequence lookup. A constexpr that followed the batch
#: (next power of two of its sequences) compiled a new kernel, for about a second with every running
#: stream stalled, the first time a step mixed a prefill with a decode batch of a new size; one
#: width up to 256 sequences is compiled by the engine's warm-up, and the masked load costs nothing.
MIN_BLOCK_B = 256


def context_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    sm_scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    table_rows: torch.Tensor | None = None,
    num_splits: int | None = None,
    quant: str | None = None,
    float16_codes: bool | None = None,
    heavy_first: bool = True,
) -> torch.Tensor:
    """Triton version of :func:`kernels.attention.context_attention_ref`; ``out`` (shaped like
    ``q``, any row stride) receives the result when given. ``table_rows``: ``slot_table`` is a request table read in
    place, sequence ``b``'s slots its row ``table_rows[b]`` (no per-step copy of the rows).
    ``num_splits``: programs sharing each tile's keys (a power of two; None: from the launch's
    size, :func:`_context_num_splits`), their parts then merged by a second kernel.

    ``block_m`` rows of a tile hold ``block_m // group`` query tokens times the ``group`` q heads
    of one kv head. Unset tile sizes come from :func:`_context_config`. Rows of ``q`` that belong
    to no sequence are left unwritten. ``quant``: the caches hold packed rows of that kind
    (:mod:`kernels.kv_quant`), read as codes and scaled in the kernel; ``float16_codes`` as in
    :func:`kernels._attention_common._q_float16`. ``heavy_first``: programs take the tiles in reverse order, the
    sequences' last (longest) tiles first.
    """
    launch = attention_launch(q, k_cache, v_cache, out, quant)
    q, out, num_kv_heads, group = launch.q, launch.out, launch.num_kv_heads, launch.group
    num_tokens, _, head_dim = q.shape
    num_seqs = ctx_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    default_m, default_n, default_warps, default_stages = _context_config(q.dtype, quant)
    block_m, block_n = block_m or default_m, block_n or default_n
    num_warps, num_stages = num_warps or default_warps, num_stages or default_stages
    block_m = max(block_m, next_pow2(group), 16)
    block_q = block_m // group
    tile_ends = torch.cumsum(torch.div(q_lens + (block_q - 1), block_q, rounding_mode="floor"), 0)
    # Sum over sequences of ceil(q_len / block_q) never exceeds this bound, so no host sync.
    max_tiles = cdiv(num_tokens, block_q) + num_seqs
    splits = num_splits or _context_num_splits(max_tiles * num_kv_heads, q.device)
    if splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {splits}")
    block_d = next_pow2(head_dim)
    block_b = max(next_pow2(num_seqs), MIN_BLOCK_B)
    if splits > 1:
        part_m = torch.empty((splits, max_tiles, num_kv_heads, block_m), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((*part_m.shape, block_d), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = ctx_lens  # unused
    _context_attention_kernel[(max_tiles, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_m,
        part_l,
        slot_table,
        ctx_lens,
        q_lens,
        q_start_loc,
        tile_ends,
        table_rows if table_rows is not None else ctx_lens,
        num_seqs,
        sm_scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        slot_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_B=block_b,
        DOT_PRECISION=dot_precision(q.dtype),
        HAS_ROWS=table_rows is not None,
        NUM_SPLITS=splits,
        QUANT=launch.quant_code,
        Q_F16=_q_float16(quant, q, float16_codes),
        HEAVY_FIRST=heavy_first,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        _context_merge_kernel[(max_tiles, num_kv_heads)](
            part_acc, part_m, part_l, out, q_lens, q_start_loc, tile_ends, num_seqs, out.stride(0), out.stride(1),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_B=block_b,
            NUM_SPLITS=splits, num_warps=4,
        )
    return out
