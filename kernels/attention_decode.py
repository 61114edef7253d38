"""Decode attention on Triton: one query token per sequence against its context, split-K
(flash-decoding): split programs and a merge, their defaults measured on an H100 / H200. The
batch's layout is :mod:`kernels.attention`'s; its reference is
:func:`kernels.attention.decode_attention_ref`.
"""

from __future__ import annotations

import torch

from kernels import _tiles
from kernels._attention_common import _LOG2E, AttentionLaunch, _q_float16, attention_launch
from kernels.attention_decode_direct import decode_split_direct, direct_decode_fits, direct_num_splits
from kernels.kv_quant import QUANT_CODES
from kernels.quant_matmul import AMAX_FLOOR, FP8_MAX, act_quant_fp8_triton
from kernels._triton import (_capability, cdiv, device_index, dot_precision, next_pow2, pdl_options, pdl_wait, tl,
                             triton, use_pdl)


def _decode_quant_code(quant: str | None, q_float16: bool, values_float16: bool | None) -> int:
    """The decode kernel's ``QUANT``: for a quantized cache met by a float16 q (``q_float16``),
    3 (fp8) or 4 (int8): values converted to float16 as they load
    (:func:`kernels._tiles.code_words_f16`), unless ``values_float16`` is False (for measuring);
    else the cache kind's code."""
    if quant is not None and q_float16 and values_float16 is not False:
        return 3 if quant == "fp8_e4m3" else 4
    return QUANT_CODES[quant]


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
    SLOTS_AHEAD: tl.constexpr,
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
                                           BLOCK_N, DOT_PRECISION, HEAD_DIM, QUANT, V_IN_SHIFT, SLOTS_AHEAD)

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


@triton.jit
def _decode_merge_codes_kernel(
    part_out_ptr,
    part_lse_ptr,
    codes_ptr,
    scale_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_cb,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND_TO: tl.constexpr,
    AMAX_MIN: tl.constexpr,
    QMAX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Program: one sequence, all its q heads merged as _decode_merge_kernel merges each, each value
    # rounded to the model dtype as that kernel stores it (ROUND_TO 1: bfloat16, 2: float16, 0:
    # float32), then the row (heads x head_dim) written as e4m3 codes by its amax, as
    # act_quant_fp8 quantizes the merged output.
    pdl_wait(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    h_ok = h < NUM_HEADS
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    hs_ok = h_ok[:, None] & sp_ok[None, :]
    lse = tl.load(part_lse_ptr + seq * stride_lb + h[:, None] * stride_lh + sp[None, :], mask=hs_ok,
                  other=float("-inf"))
    m = tl.max(lse, axis=1)
    w = tl.where(hs_ok & (lse > float("-inf")), tl.exp2(lse - m[:, None]), 0.0)  # [H, S]
    part = tl.load(part_out_ptr + seq * stride_pb + h[:, None, None] * stride_ph + sp[None, :, None] * stride_ps
                   + d[None, None, :], mask=hs_ok[:, :, None] & d_ok[None, None, :], other=0.0)
    total = tl.sum(w, axis=1)
    out = tl.sum(part * w[:, :, None], axis=1) / tl.where(total > 0.0, total, 1.0)[:, None]  # [H, D]
    if ROUND_TO == 1:
        y = out.to(tl.bfloat16).to(tl.float32)
    elif ROUND_TO == 2:
        y = out.to(tl.float16).to(tl.float32)
    else:
        y = out
    ok = h_ok[:, None] & d_ok[None, :]
    y = tl.where(ok, y, 0.0)
    scale = tl.maximum(tl.max(tl.max(tl.abs(y), axis=1), axis=0), AMAX_MIN) / QMAX
    tl.store(scale_ptr + seq, scale)
    q = tl.minimum(tl.maximum(y * tl.math.div_rn(1.0, scale), -QMAX), QMAX)
    tl.store(codes_ptr + seq * stride_cb + h[:, None] * HEAD_DIM + d[None, :], q.to(codes_ptr.dtype.element_ty),
             mask=ok)


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


def _decode_slots_ahead(quant: str | None, device: torch.device) -> bool:
    """Whether the key loop reads each next tile's slots a tile ahead (``SLOTS_AHEAD`` of
    :func:`kernels._tiles.attend_keys`), its KV loads double-buffered at depth 3: fp8 e4m3 on
    Hopper and later (two programs an SM of 108 KB of shared memory each), where no tile is read
    before the wait (more than :data:`PREFETCH_MAX_HEADS` pairs). Measured on an H200,
    the engine's step (8B shape, batch 64, graphs, three interleaved repeats): fp8 KV at 4k
    context 13.51 against 13.68 ms (1k: 7.66 / 7.67); depth 4 (one program an SM) 16.46; bf16 at
    depth 3 15.26 against 13.01, so bf16 and int8 (not measured) keep the loop as it was."""
    return quant == "fp8_e4m3" and device.type == "cuda" and _capability(device_index(device))[0] >= 9


def _decode_stages(quant: str | None, slots_ahead: bool) -> int:
    """Pipeline depth of the decode kernel's key loop: 3 with the slots a tile ahead (above), else
    2. Measured on an H200 over 16-byte aligned quantized rows (8B heads, batch 64 x 4k context,
    fp8 met by q as float16, 128 keys a tile, ``kv_attn_sweep``): 357 us at depth 2 against 385
    at 1 and 442 at 3 (over 132-byte rows, which no load could read 16 bytes at a time, depth 1
    had measured best); deeper, each tile's slots read in its own iteration left the loads one
    buffer."""
    return 3 if slots_ahead else 2


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


def _split_outputs(out: torch.Tensor, batch: int, num_q_heads: int, num_splits: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the splits write: their normalised partials and log-sum-exps. One split's partial is
    the output itself: stored there, no merge launch (which, launched as a dependent, also held
    multiprocessor slots while it waited)."""
    if num_splits == 1:
        part_out = out.unsqueeze(2)
    else:
        part_out = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=out.device)
    part_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=out.device)
    return part_out, part_lse


def _decode_splits_triton(launch: AttentionLaunch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_table: torch.Tensor, ctx_lens: torch.Tensor, sm_scale: float, *,
                          block_n: int | None, num_splits: int | None, num_warps: int | None,
                          num_stages: int | None, table_rows: torch.Tensor | None,
                          quant: str | None, float16_codes: bool | None, values_float16: bool | None,
                          ahead: bool | None, heads_together: bool | None,
                          values_in_shift: bool | None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The split stage by :func:`_decode_split_kernel`: (split count, partials, log-sum-exps)."""
    q, out, num_kv_heads, group = launch.q, launch.out, launch.num_kv_heads, launch.group
    batch, num_q_heads, head_dim = q.shape
    default_n, default_warps = _decode_config(q.dtype, batch * num_kv_heads, head_dim)
    block_n, num_warps = block_n or default_n, num_warps or default_warps
    prefetch = batch * num_kv_heads <= PREFETCH_MAX_HEADS
    slots_ahead = _decode_slots_ahead(quant, q.device) and not ahead and not prefetch
    num_stages = num_stages or _decode_stages(quant, slots_ahead)
    if num_splits is None:
        num_splits = _decode_num_splits(batch, num_kv_heads, slot_table.shape[1], block_n, q.device,
                                        per_sm=4 if quant is None else 2)
    part_out, part_lse = _split_outputs(out, batch, num_q_heads, num_splits, head_dim)
    pdl = use_pdl(q)
    q_f16 = _q_float16(quant, q, float16_codes)
    if heads_together is None:
        heads_together = _decode_heads_together(quant)
    grid = (num_kv_heads, batch, num_splits) if heads_together else (batch, num_kv_heads, num_splits)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, slot_table, ctx_lens, table_rows if table_rows is not None else ctx_lens, part_out,
        part_lse, sm_scale * _LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), slot_table.stride(0), part_out.stride(0), part_out.stride(1),
        part_out.stride(2), part_lse.stride(0), part_lse.stride(1), GROUP=group, HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits, BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=next_pow2(head_dim),
        DOT_PRECISION=dot_precision(q.dtype), PREFETCH=prefetch,
        HAS_ROWS=table_rows is not None, USE_PDL=pdl,
        QUANT=_decode_quant_code(quant, q_f16 or q.dtype == torch.float16, values_float16), Q_F16=q_f16,
        AHEAD=bool(ahead), HEADS_TOGETHER=heads_together,
        V_IN_SHIFT=_decode_values_in_shift(quant) if values_in_shift is None else values_in_shift,
        SLOTS_AHEAD=slots_ahead, num_warps=num_warps, num_stages=num_stages, **pdl_options(pdl),
    )
    return num_splits, part_out, part_lse


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
    merged_codes: tuple[torch.Tensor, torch.Tensor] | None = None,
    direct: bool | None = None,
) -> torch.Tensor | None:
    """Triton version of :func:`kernels.attention.decode_attention_ref` (split-K: two launches, one
    at one split); ``out``, ``table_rows``, ``quant`` and ``float16_codes`` as in
    :func:`kernels.attention_context.context_attention_triton`;
    ``values_float16`` as in :func:`_decode_quant_code`; ``ahead``: each program reads its next
    tile while computing one (:func:`kernels._tiles.attend_keys_ahead`; with ``num_stages`` 1),
    where no tile is read before the wait; ``heads_together``: the programs of one sequence's kv
    heads launch next to each other (:func:`_decode_heads_together`); ``values_in_shift``: value
    scales enter the scores as logs (``V_IN_SHIFT`` of :func:`kernels._tiles.attend_tile`);
    ``merged_codes``: see :func:`decode_attention_codes_triton` (None returned where it took them);
    ``direct``: the splits by :mod:`kernels.attention_decode_direct` (default: where it fits an
    fp8 cache, :func:`~kernels.attention_decode_direct.direct_decode_fits`, and no option of the
    Triton kernel's tiling or conversions is given; those do not apply to it).

    Each sequence's keys but its newest (the last of its context) must have been stored before
    the kernel launched before this one: with dependent launches they are read while that kernel
    (the one storing the newest key) still runs.

    ``num_splits`` defaults to a count picked from the batch, the kv heads, the slot table's
    width and the GPU's multiprocessors; it depends on shapes only. Unset tile sizes come from
    :func:`_decode_config`, an unset ``num_stages`` from :func:`_decode_stages`.
    """
    launch = attention_launch(q, k_cache, v_cache, out, quant)
    q, out, num_kv_heads = launch.q, launch.out, launch.num_kv_heads
    batch, num_q_heads, head_dim = q.shape
    if batch == 0:
        return out
    if direct is None:
        triton_options = (block_n, num_warps, num_stages, float16_codes, values_float16, ahead, heads_together,
                          values_in_shift)
        direct = all(o is None for o in triton_options) and direct_decode_fits(quant, q, k_cache, v_cache)
    if direct:
        if num_splits is None:
            num_splits = direct_num_splits(batch, num_kv_heads, slot_table.shape[1], q.device, MAX_SPLITS)
        part_out, part_lse = _split_outputs(out, batch, num_q_heads, num_splits, head_dim)
        decode_split_direct(q, k_cache, v_cache, slot_table, ctx_lens, sm_scale * _LOG2E, part_out, part_lse,
                            table_rows, num_splits)
    else:
        num_splits, part_out, part_lse = _decode_splits_triton(
            launch, k_cache, v_cache, slot_table, ctx_lens, sm_scale, block_n=block_n, num_splits=num_splits,
            num_warps=num_warps, num_stages=num_stages, table_rows=table_rows, quant=quant,
            float16_codes=float16_codes, values_float16=values_float16, ahead=ahead, heads_together=heads_together,
            values_in_shift=values_in_shift)
    pdl = use_pdl(q)
    block_d = next_pow2(head_dim)
    if num_splits == 1:
        return out
    if merged_codes is not None and _merge_codes_fits(num_q_heads, num_splits, block_d):
        codes, scale = merged_codes
        _decode_merge_codes_kernel[(batch,)](
            part_out, part_lse, codes, scale, part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), codes.stride(0), NUM_HEADS=num_q_heads, HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits, BLOCK_H=next_pow2(num_q_heads), BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d,
            ROUND_TO={torch.bfloat16: 1, torch.float16: 2}.get(out.dtype, 0), AMAX_MIN=AMAX_FLOOR, QMAX=FP8_MAX,
            USE_PDL=pdl, num_warps=8, **pdl_options(pdl),
        )
        return None
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


#: Most values (q heads x splits x head_dim, padded) one program of the merge into codes holds:
#: 32 heads of 128 over 4 splits in 8 warps, 64 floats a thread.
MERGE_CODES_MAX_VALUES = 32 * 4 * 128


def _merge_codes_fits(num_q_heads: int, num_splits: int, block_d: int) -> bool:
    return next_pow2(num_q_heads) * next_pow2(num_splits) * block_d <= MERGE_CODES_MAX_VALUES


def decode_attention_codes_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float,
    *,
    table_rows: torch.Tensor | None = None,
    quant: str | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_attention_triton`'s output ``[B, Hq, D]`` as the input of an FP8 projection:
    per-sequence e4m3 codes ``[B, Hq * D]`` and float32 scales ``[B, 1]``, those of
    :func:`kernels.quant_matmul.act_quant_fp8_triton` over the output in q's dtype. Where the
    context splits, the merge writes them (one program a sequence, :func:`_decode_merge_codes_kernel`):
    a launch and a write and read of the output fewer than quantizing it after; else the output is
    quantized after."""
    batch, num_q_heads, head_dim = q.shape
    codes = torch.empty((batch, num_q_heads * head_dim), dtype=torch.float8_e4m3fn, device=q.device)
    scale = torch.empty((batch, 1), dtype=torch.float32, device=q.device)
    out = decode_attention_triton(q, k_cache, v_cache, slot_table, ctx_lens, sm_scale, table_rows=table_rows,
                                  quant=quant, num_splits=num_splits, merged_codes=(codes, scale))
    if out is None:
        return codes, scale
    return act_quant_fp8_triton(out.reshape(batch, num_q_heads * head_dim))
