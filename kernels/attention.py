"""Attention over KV slots addressed through per-sequence slot tables.

A batch is ragged: sequence ``b`` owns the slots ``slot_table[b, :ctx_lens[b]]`` (its whole
context, cached prefix included, with this step's new keys already stored) and contributes
``q_lens[b]`` query tokens, which sit at the last ``q_lens[b]`` positions of that context.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels import _tiles
from kernels.kv_quant import QUANT_CODES, ROW_ALIGN, dequantize_rows
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
    use_triton_kv,
)

_LOG2E = math.log2(math.e)


def _kv_rows(cache: torch.Tensor, index: torch.Tensor, quant: str | None, head_dim: int,
             dtype: torch.dtype) -> torch.Tensor:
    """``cache[index]``; from a quantized cache (``quant``), dequantized into ``dtype``."""
    rows = cache[index]
    return rows if quant is None else dequantize_rows(rows, quant, head_dim, dtype)


def _quant_code(quant: str | None, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The kernels' ``QUANT`` for caches holding ``quant`` rows: uint8, their slot and head strides
    multiples of 16 bytes (the kernels read rows in 16-byte units, :mod:`kernels.kv_quant`)."""
    if quant not in QUANT_CODES:
        raise ValueError(f"unknown quantized KV kind {quant!r}")
    if quant is not None and (k_cache.dtype != torch.uint8 or v_cache.dtype != torch.uint8):
        raise ValueError(f"{quant} KV caches hold uint8 rows, got {k_cache.dtype}")
    if quant is not None and any(c.stride(i) % ROW_ALIGN for c in (k_cache, v_cache) for i in (0, 1)):
        raise ValueError(f"{quant} KV rows must start at multiples of {ROW_ALIGN} bytes, got strides "
                         f"{k_cache.stride()[:2]} and {v_cache.stride()[:2]}")
    return QUANT_CODES[quant]


def _q_float16(quant: str | None, q: torch.Tensor, float16_codes: bool | None) -> bool:
    """Whether a kernel takes bfloat16 q as float16 (:func:`kernels._tiles.float16_rows`) for its
    products with quantized codes: by default for fp8 e4m3, whose codes convert to float16 in one
    instruction and to bfloat16 in two. ``float16_codes`` overrides it (for measuring)."""
    if quant is None or q.dtype != torch.bfloat16:
        return False
    return quant == "fp8_e4m3" if float16_codes is None else float16_codes


def _decode_quant_code(quant: str | None, q_float16: bool, values_float16: bool | None) -> int:
    """The decode kernel's ``QUANT``: for a quantized cache met by a float16 q (``q_float16``),
    3 (fp8) or 4 (int8): values converted to float16 as they load
    (:func:`kernels._tiles.code_words_f16`), unless ``values_float16`` is False (for measuring);
    else the cache kind's code."""
    if quant is not None and q_float16 and values_float16 is not False:
        return 3 if quant == "fp8_e4m3" else 4
    return QUANT_CODES[quant]


def _output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The tensor a kernel writes: ``out`` when given (q's shape and dtype, head_dim contiguous)."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"attention output {tuple(out.shape)} {out.dtype} does not fit q {tuple(q.shape)} {q.dtype}")
    return out


def context_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    sm_scale: float,
    quant: str | None = None,
) -> torch.Tensor:
    """Causal attention for new tokens of every sequence against its whole context.

    q: ``[T, Hq, D]`` (all sequences' new tokens, concatenated); caches: ``[S, Hkv, D]``;
    slot_table: ``[B, max_ctx]`` int64; ctx_lens, q_lens, q_start_loc: ``[B]`` int.
    Returns ``[T, Hq, D]`` in q's dtype. ``quant``: the caches hold packed quantized rows
    (:mod:`kernels.kv_quant`), dequantized as they are read (the math stays in float32).
    """
    out = torch.empty_like(q)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    for b in range(slot_table.shape[0]):
        ctx, n_new, start = int(ctx_lens[b]), int(q_lens[b]), int(q_start_loc[b])
        if n_new == 0:
            continue
        slots = slot_table[b, :ctx]
        k = _kv_rows(k_cache, slots, quant, q.shape[-1], torch.float32).float().repeat_interleave(group, dim=1)
        v = _kv_rows(v_cache, slots, quant, q.shape[-1], torch.float32).float().repeat_interleave(group, dim=1)
        qb = q[start : start + n_new].float()  # [n_new, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale
        q_pos = torch.arange(ctx - n_new, ctx, device=q.device).unsqueeze(1)
        k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)
        scores = scores.masked_fill((k_pos > q_pos).unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + n_new] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float,
    quant: str | None = None,
) -> torch.Tensor:
    """One query token per sequence (the last position of its context).

    q: ``[B, Hq, D]``; returns ``[B, Hq, D]``.
    """
    batch = q.shape[0]
    ones = torch.ones(batch, dtype=torch.int64, device=q.device)
    return context_attention_ref(
        q, k_cache, v_cache, slot_table, ctx_lens, ones, torch.arange(batch, device=q.device), sm_scale, quant
    )


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
    """Triton version of :func:`context_attention_ref`; ``out`` (shaped like ``q``, any row stride)
    receives the result when given. ``table_rows``: ``slot_table`` is a request table read in
    place, sequence ``b``'s slots its row ``table_rows[b]`` (no per-step copy of the rows).
    ``num_splits``: programs sharing each tile's keys (a power of two; None: from the launch's
    size, :func:`_context_num_splits`), their parts then merged by a second kernel.

    ``block_m`` rows of a tile hold ``block_m // group`` query tokens times the ``group`` q heads
    of one kv head. Unset tile sizes come from :func:`_context_config`. Rows of ``q`` that belong
    to no sequence are left unwritten. ``quant``: the caches hold packed rows of that kind
    (:mod:`kernels.kv_quant`), read as codes and scaled in the kernel; ``float16_codes`` as in
    :func:`_q_float16`. ``heavy_first``: programs take the tiles in reverse order, the
    sequences' last (longest) tiles first.
    """
    require_triton()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV caches must be contiguous in head_dim")
    quant_code = _quant_code(quant, k_cache, v_cache)
    q = last_dim_contiguous(q)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = _output_for(q, out)
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
        QUANT=quant_code,
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


# --------------------------------------------------------------------------------------------
# Decode: split-K flash-decoding. Stage 1 gives each (sequence, kv head, split) program a slice
# of the context and all q heads of that kv head; it writes a normalised partial output and its
# log-sum-exp. Stage 2 merges the splits per (sequence, q head). The split count depends only on
# shapes, so the launch is the same every step (CUDA-graph friendly).
# --------------------------------------------------------------------------------------------


@triton.jit
def _decode_split_kernel(
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
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
    QUANT: tl.constexpr,
    Q_F16: tl.constexpr,
    AHEAD: tl.constexpr,
    HEADS_TOGETHER: tl.constexpr,
    V_IN_SHIFT: tl.constexpr,
):
    if HEADS_TOGETHER:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1).to(tl.int64)
    else:
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(ctx_lens_ptr + seq).to(tl.int32)
    # Per-sequence split length, a whole number of tiles, so short contexts get short splits.
    split_len = tl.cdiv(tl.cdiv(ctx_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, ctx_len)

    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # The request table is read in place (``HAS_ROWS``: sequence -> its row) or a per-sequence copy.
    row = tl.load(rows_ptr + seq).to(tl.int64) if HAS_ROWS else seq
    table_row = slot_table_ptr + row * stride_table
    n_offs = tl.arange(0, BLOCK_N)

    # PREFETCH: the split's first tile is read before waiting on the kernel before (a dependent
    # launch), all but the newest key, which that kernel stores: the inputs and the older keys
    # were written before this step. At batch 1 a split is one tile, so the wait hides all of
    # its reads.
    if PREFETCH:
        n = lo + n_offs
        n_ok = n < hi
        slots = tl.load(table_row + n, mask=n_ok, other=0).to(tl.int64)
        newest = n_ok & (n == ctx_len - 1)
        k, v, k_scale, v_scale = _tiles.load_kv_raw(k_cache_ptr, v_cache_ptr, slots, kv_head, d,
                                                    (n_ok & ~newest)[:, None] & d_ok[None, :], stride_ks, stride_kh,
                                                    stride_vs, stride_vh, n_ok & ~newest, HEAD_DIM, QUANT)
    pdl_wait(USE_PDL)
    q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if Q_F16:
        q, q_unit = _tiles.float16_rows(q)
        scale_log2 = scale_log2 * q_unit[:, None]
    if PREFETCH:
        k_new, v_new, k_new_scale, v_new_scale = _tiles.load_kv_raw(
            k_cache_ptr, v_cache_ptr, slots, kv_head, d, newest[:, None] & d_ok[None, :], stride_ks, stride_kh,
            stride_vs, stride_vh, newest, HEAD_DIM, QUANT)
        k = tl.where(newest[:, None], k_new, k)
        v = _tiles.tile_values(tl.where(newest[:, None], v_new, v), d, QUANT)
        if QUANT:
            k_scale = tl.where(newest, k_new_scale, k_scale)
            v_scale = tl.where(newest, v_new_scale, v_scale)
        if lo < hi:
            acc, m_i, l_i = _tiles.attend_tile(q, k, v, acc, m_i, l_i, scale_log2, n, n_ok, None, DOT_PRECISION,
                                               k_scale, v_scale, V_IN_SHIFT)
        # The rest of the split only where there is one: at batch 1 up to 2k tokens of context a
        # split is its prefetched tile, and a pipelined loop's prologue costs even when the loop
        # runs no iteration (the default model's layer at batch 1, H100: 11.72 -> 11.20 us). The
        # unprefetched path keeps its loop unguarded (a guard there cost 1% at batch 64).
        if lo + BLOCK_N < hi:
            acc, m_i, l_i = _tiles.attend_keys(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head, d, d_ok,
                                               lo + BLOCK_N, hi, scale_log2, stride_ks, stride_kh, stride_vs,
                                               stride_vh, BLOCK_N, DOT_PRECISION, HEAD_DIM, QUANT, V_IN_SHIFT)
    elif AHEAD:
        acc, m_i, l_i = _tiles.attend_keys_ahead(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head, d,
                                                 d_ok, lo, hi, scale_log2, stride_ks, stride_kh, stride_vs,
                                                 stride_vh, BLOCK_N, DOT_PRECISION, HEAD_DIM, QUANT, V_IN_SHIFT)
    else:
        acc, m_i, l_i = _tiles.attend_keys(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row, kv_head, d, d_ok,
                                           lo, hi, scale_log2, stride_ks, stride_kh, stride_vs, stride_vh,
                                           BLOCK_N, DOT_PRECISION, HEAD_DIM, QUANT, V_IN_SHIFT)

    # An empty split reports lse = -inf and weighs nothing in the merge.
    has_keys = l_i > 0.0
    part = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(part_out_ptr + seq * stride_pb + head[:, None] * stride_ph + split * stride_ps + d[None, :],
             part, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(part_lse_ptr + seq * stride_lb + head * stride_lh + split, lse, mask=g_ok)


@triton.jit
def _decode_merge_kernel(
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
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq * stride_lb + head * stride_lh + sp, mask=sp_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(sp_ok & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
    # Every split stores its partial (zero where it had no keys), so the partials are read
    # beside the log-sum-exps rather than after them.
    part = tl.load(part_out_ptr + seq * stride_pb + head * stride_ph + sp[:, None] * stride_ps + d[None, :],
                   mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out, mask=d_ok)


def _decode_config(dtype: torch.dtype, pairs: int, head_dim: int) -> tuple[int, int]:
    """(block_n, num_warps) for ``pairs`` (sequence, kv head) programs a split.

    A split whose keys fit one tile is read before the kernel's wait (see ``PREFETCH``), so at
    few pairs wider tiles pay; many pairs want wide tiles only with small heads. Measured on an
    H200 in bf16, 30 launches in a graph, random slots (the default model's heads 9/3x64, 8B's
    32/8x128), at 1.1k tokens of context: 9/3x64 at batch 1 4.47 -> 3.69 us (64 keys a tile
    against 32), batch 16 10.1 -> 9.1, batch 64 31.3 -> 20.3 (128); 32/8x128 at batch 1 8.0 ->
    6.8 (64), batch 64 73.7 -> 68.7 (128), batches 4 to 16 best at 32. Float32 keeps 32 (its
    tiles are twice the bytes)."""
    if dtype == torch.float32:
        return 32, 4
    if head_dim <= 64:
        return (64 if pairs <= 48 else 128), 4
    return (64 if pairs <= 16 else 32 if pairs < 512 else 128), 4


def _decode_stages(quant: str | None) -> int:
    """Pipeline depth of the decode kernel's key loop: 2 for every cache kind. Measured on an H200
    over 16-byte aligned quantized rows (8B heads, batch 64 x 4k context, fp8 met by q as float16,
    128 keys a tile, ``kv_attn_sweep``): 357 us at depth 2 against 385 at 1 and 442 at 3 (over
    132-byte rows, which no load could read 16 bytes at a time, depth 1 had measured best)."""
    return 2


def _decode_heads_together(quant: str | None) -> bool:
    """Whether the split kernel's grid walks kv heads before sequences, so that the programs
    running at once read every head's row of the same slots. A slot's rows of all heads lie
    side by side (``[slots, heads, row]``); one head's row alone is an isolated 144 bytes of a
    quantized cache (256 in bfloat16), the sectors it shares with its neighbours fetched twice
    when their programs run apart. Quantized caches: measured on an H200 (8B heads, batch 64 x 4k
    context, shuffled slots, fp8, 128 keys a tile) 347 / 337 us at one / two splits against
    406 / 400 sequences first (one run each); bfloat16 312 against 316, kept as it was."""
    return quant is not None


def _decode_values_in_shift(quant: str | None) -> bool:
    """Whether a quantized cache's value scales enter the decode scores as logs (where q meets the
    codes as float16; ``V_IN_SHIFT`` of :func:`kernels._tiles.attend_tile`): measured on an H200,
    8B heads, batch 64 x 4k context over shuffled slots, fp8 values as float16, 128 keys a tile,
    one split: 328 us against 406-421 with the tile-wide maximum of the scales (one run each)."""
    return quant is not None


#: Most splits of one sequence's context. The count is fixed by shapes (the slot table is as wide
#: as the longest context), so at batch 1 a typical context leaves most splits empty; measured on
#: an H100 with the default model's heads at batch 1 and 1k tokens of context: 64 splits 4.75 us
#: a launch pair, 32 splits 4.03 us.
MAX_SPLITS = 32


#: Most (sequence, kv head) pairs for which the split kernel reads its first tile before waiting
#: on the kernel before. Measured on an H100, 8B heads at 1k context, a chain of launches: 38.0 ->
#: 33.4 us at batch 16 (128 pairs); at batch 64 it cost 99 -> 120 us (the tile peeled off the loop
#: holds registers the pipelined loop needs, and other programs hide the loads anyway).
PREFETCH_MAX_HEADS = 128


def _decode_num_splits(batch: int, num_kv_heads: int, max_ctx: int, block_n: int, device: torch.device,
                       per_sm: int = 4) -> int:
    """Enough splits for ~``per_sm`` programs per multiprocessor, never a split shorter than one
    tile, at most :data:`MAX_SPLITS`. Quantized caches ask for 2: their programs read half the
    bytes a tile, and the merge's pass costs more than a second program an SM gains (an H200,
    8B heads, batch 64 x 4k context, fp8: one split 328 us against 357 with two)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 4
    wanted = cdiv(per_sm * sms, max(1, batch * num_kv_heads))
    return max(1, min(wanted, cdiv(max_ctx, block_n), MAX_SPLITS))


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float,
    *,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    table_rows: torch.Tensor | None = None,
    quant: str | None = None,
    float16_codes: bool | None = None,
    values_float16: bool | None = None,
    ahead: bool | None = None,
    heads_together: bool | None = None,
    values_in_shift: bool | None = None,
) -> torch.Tensor:
    """Triton version of :func:`decode_attention_ref` (split-K: two launches, one at one split); ``out``,
    ``table_rows``, ``quant`` and ``float16_codes`` as in :func:`context_attention_triton`;
    ``values_float16`` as in :func:`_decode_quant_code`; ``ahead``: each program reads its next
    tile while computing one (:func:`kernels._tiles.attend_keys_ahead`; with ``num_stages`` 1),
    where no tile is read before the wait; ``heads_together``: the programs of one sequence's kv
    heads launch next to each other (:func:`_decode_heads_together`); ``values_in_shift``: value
    scales enter the scores as logs (``V_IN_SHIFT`` of :func:`kernels._tiles.attend_tile`).

    Each sequence's keys but its newest (the last of its context) must have been stored before
    the kernel launched before this one: with dependent launches they are read while that kernel
    (the one storing the newest key) still runs.

    ``num_splits`` defaults to a count picked from the batch, the kv heads, the slot table's
    width and the GPU's multiprocessors; it depends on shapes only. Unset tile sizes come from
    :func:`_decode_config`, an unset ``num_stages`` from :func:`_decode_stages`.
    """
    require_triton()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV caches must be contiguous in head_dim")
    quant_code = _quant_code(quant, k_cache, v_cache)
    q = last_dim_contiguous(q)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = _output_for(q, out)
    if batch == 0:
        return out
    default_n, default_warps = _decode_config(q.dtype, batch * num_kv_heads, head_dim)
    block_n, num_warps = block_n or default_n, num_warps or default_warps
    num_stages = num_stages or _decode_stages(quant)
    if num_splits is None:
        num_splits = _decode_num_splits(batch, num_kv_heads, slot_table.shape[1], block_n, q.device,
                                        per_sm=4 if quant is None else 2)
    block_d = next_pow2(head_dim)
    if num_splits == 1:
        # One split's normalised partial is the output: stored there, no merge launch (which,
        # launched as a dependent, also held multiprocessor slots while it waited).
        part_out = out.unsqueeze(2)
    else:
        part_out = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    pdl = use_pdl(q)
    q_f16 = _q_float16(quant, q, float16_codes)
    if heads_together is None:
        heads_together = _decode_heads_together(quant)
    grid = (num_kv_heads, batch, num_splits) if heads_together else (batch, num_kv_heads, num_splits)
    _decode_split_kernel[grid](
        q,
        k_cache,
        v_cache,
        slot_table,
        ctx_lens,
        table_rows if table_rows is not None else ctx_lens,
        part_out,
        part_lse,
        sm_scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        slot_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype),
        PREFETCH=batch * num_kv_heads <= PREFETCH_MAX_HEADS,
        HAS_ROWS=table_rows is not None,
        USE_PDL=pdl,
        QUANT=_decode_quant_code(quant, q_f16 or q.dtype == torch.float16, values_float16),
        Q_F16=q_f16,
        AHEAD=bool(ahead),
        HEADS_TOGETHER=heads_together,
        V_IN_SHIFT=_decode_values_in_shift(quant) if values_in_shift is None else values_in_shift,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_options(pdl),
    )
    if num_splits == 1:
        return out
    _decode_merge_kernel[(batch, num_q_heads)](
        part_out,
        part_lse,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        BLOCK_S=next_pow2(num_splits),
        BLOCK_D=block_d,
        USE_PDL=pdl,
        num_warps=4,
        **pdl_options(pdl),
    )
    return out


def context_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    sm_scale: float,
    quant: str | None = None,
) -> torch.Tensor:
    """The CPU path: per sequence, torch's fused attention with GQA (same math as the reference);
    quantized caches (``quant``) dequantized into q's dtype as they are read."""
    out = torch.empty_like(q)
    ctx_list, q_list, start_list = ctx_lens.tolist(), q_lens.tolist(), q_start_loc.tolist()
    for b, (ctx, n_new, start) in enumerate(zip(ctx_list, q_list, start_list)):
        if n_new == 0:
            continue
        slots = slot_table[b, :ctx]
        k = _kv_rows(k_cache, slots, quant, q.shape[-1], q.dtype).transpose(0, 1)  # [Hkv, ctx, D]
        v = _kv_rows(v_cache, slots, quant, q.shape[-1], q.dtype).transpose(0, 1)
        qb = q[start : start + n_new].transpose(0, 1)  # [Hq, n_new, D]
        mask = None
        if n_new > 1:
            q_pos = torch.arange(ctx - n_new, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= q_pos
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True)
        out[start : start + n_new] = o.transpose(0, 1)
    return out


def decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float,
    quant: str | None = None,
) -> torch.Tensor:
    """The CPU path. Contexts of similar length: one fused-attention call over the padded batch;
    very ragged ones (padding would more than double the work): one call per sequence.
    ``quant`` as in :func:`context_attention_cpu`."""
    batch = q.shape[0]
    max_ctx = int(slot_table.shape[1])
    if batch * max_ctx > 2 * int(ctx_lens.sum()):
        ones = torch.ones(batch, dtype=torch.int64, device=q.device)
        return context_attention_cpu(q, k_cache, v_cache, slot_table, ctx_lens, ones,
                                     torch.arange(batch, device=q.device), sm_scale, quant)
    k = _kv_rows(k_cache, slot_table, quant, q.shape[-1], q.dtype).transpose(1, 2)  # [B, Hkv, ctx, D]
    v = _kv_rows(v_cache, slot_table, quant, q.shape[-1], q.dtype).transpose(1, 2)
    valid = torch.arange(max_ctx, device=q.device).unsqueeze(0) < ctx_lens.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], scale=sm_scale, enable_gqa=True
    )
    return out.squeeze(2)


def context_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
    table_rows: torch.Tensor | None = None,
    quant: str | None = None,
) -> torch.Tensor:
    """Triton on CUDA tensors when Triton is installed, else :func:`context_attention_cpu`;
    written into ``out`` when given; ``table_rows`` and ``quant`` as in :func:`context_attention_triton`."""
    if use_triton_kv(quant, q, k_cache, v_cache):
        return context_attention_triton(q, k_cache, v_cache, slot_table, ctx_lens, q_lens, q_start_loc, sm_scale,
                                        out=out, table_rows=table_rows, quant=quant)
    if table_rows is not None:
        slot_table = slot_table.index_select(0, table_rows)
    result = context_attention_cpu(q, k_cache, v_cache, slot_table, ctx_lens, q_lens, q_start_loc, sm_scale, quant)
    return result if out is None else out.copy_(result)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
    table_rows: torch.Tensor | None = None,
    quant: str | None = None,
) -> torch.Tensor:
    """Triton on CUDA tensors when Triton is installed, else :func:`decode_attention_cpu`;
    written into ``out`` when given; ``table_rows`` and ``quant`` as in :func:`context_attention_triton`."""
    if use_triton_kv(quant, q, k_cache, v_cache):
        return decode_attention_triton(q, k_cache, v_cache, slot_table, ctx_lens, sm_scale, out=out,
                                       table_rows=table_rows, quant=quant)
    if table_rows is not None:
        slot_table = slot_table.index_select(0, table_rows)
    result = decode_attention_cpu(q, k_cache, v_cache, slot_table, ctx_lens, sm_scale, quant)
    return result if out is None else out.copy_(result)
