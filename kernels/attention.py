"""Attention over KV slots addressed through per-sequence slot tables.

A batch is ragged: sequence ``b`` owns the slots ``slot_table[b, :ctx_lens[b]]`` (its whole
context, cached prefix included, with this step's new keys already stored) and contributes
``q_lens[b]`` query tokens, which sit at the last ``q_lens[b]`` positions of that context.
"""

from __future__ import annotations

import torch


def context_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Causal attention for new tokens of every sequence against its whole context.

    q: ``[T, Hq, D]`` (all sequences' new tokens, concatenated); caches: ``[S, Hkv, D]``;
    slot_table: ``[B, max_ctx]`` int64; ctx_lens, q_lens, q_start_loc: ``[B]`` int.
    Returns ``[T, Hq, D]`` in q's dtype.
    """
    out = torch.empty_like(q)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    for b in range(slot_table.shape[0]):
        ctx, n_new, start = int(ctx_lens[b]), int(q_lens[b]), int(q_start_loc[b])
        if n_new == 0:
            continue
        slots = slot_table[b, :ctx]
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
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
) -> torch.Tensor:
    """One query token per sequence (the last position of its context).

    q: ``[B, Hq, D]``; returns ``[B, Hq, D]``.
    """
    batch = q.shape[0]
    ones = torch.ones(batch, dtype=torch.int64, device=q.device)
    return context_attention_ref(
        q, k_cache, v_cache, slot_table, ctx_lens, ones, torch.arange(batch, device=q.device), sm_scale
    )


def context_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    q_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    return context_attention_ref(q, k_cache, v_cache, slot_table, ctx_lens, q_lens, q_start_loc, sm_scale)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    return decode_attention_ref(q, k_cache, v_cache, slot_table, ctx_lens, sm_scale)
