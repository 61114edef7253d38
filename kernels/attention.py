"""Attention over KV slots addressed through per-sequence slot tables.

A batch is ragged: sequence ``b`` owns the slots ``slot_table[b, :ctx_lens[b]]`` (its whole
context, cached prefix included, with this step's new keys already stored) and contributes
``q_lens[b]`` query tokens, which sit at the last ``q_lens[b]`` positions of that context.

The Triton kernels and their launchers live in :mod:`kernels.attention_context` (prefill) and
:mod:`kernels.attention_decode` (split-K decode); this module holds the torch references, the
CPU paths and the dispatch between them. It re-exports the launchers and their defaults; the
launchers read their defaults (``PREFETCH_MAX_HEADS``, ...) from their own modules, so a change
to one is made there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._attention_common import _LOG2E, _output_for, _q_float16, _quant_code  # noqa: F401 (re-exported)
from kernels.attention_context import (  # noqa: F401 (re-exported)
    MAX_CONTEXT_SPLITS,
    MIN_BLOCK_B,
    _context_attention_kernel,
    _context_config,
    _context_merge_kernel,
    _context_num_splits,
    _context_tile_rows,
    _context_tile_seq,
    context_attention_triton,
)
from kernels.attention_decode import (  # noqa: F401 (re-exported)
    MAX_SPLITS,
    PREFETCH_MAX_HEADS,
    _decode_config,
    _decode_heads_together,
    _decode_merge_kernel,
    _decode_num_splits,
    _decode_quant_code,
    _decode_split_kernel,
    _decode_stages,
    _decode_values_in_shift,
    decode_attention_codes_triton,
    decode_attention_triton,
)
from kernels.kv_quant import dequantize_rows
from kernels.quant_matmul import act_quant_fp8_ref
from kernels._triton import use_triton_kv


def _kv_rows(cache: torch.Tensor, index: torch.Tensor, quant: str | None, head_dim: int,
             dtype: torch.dtype) -> torch.Tensor:
    """``cache[index]``; from a quantized cache (``quant``), dequantized into ``dtype``."""
    rows = cache[index]
    return rows if quant is None else dequantize_rows(rows, quant, head_dim, dtype)


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


def decode_attention_codes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float,
    table_rows: torch.Tensor | None = None,
    quant: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_attention`'s output as an FP8 projection's input: per-sequence e4m3 codes
    ``[B, Hq * D]`` and float32 scales ``[B, 1]`` (:func:`kernels.quant_matmul.act_quant_fp8_ref`
    of the output); on Triton, the splits' merge writes them (:func:`decode_attention_codes_triton`)."""
    if use_triton_kv(quant, q, k_cache, v_cache):
        return decode_attention_codes_triton(q, k_cache, v_cache, slot_table, ctx_lens, sm_scale,
                                             table_rows=table_rows, quant=quant)
    out = decode_attention(q, k_cache, v_cache, slot_table, ctx_lens, sm_scale, table_rows=table_rows, quant=quant)
    return act_quant_fp8_ref(out.reshape(out.shape[0], -1))
