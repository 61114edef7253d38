"""Write a step's new keys and values into their KV slots."""

from __future__ import annotations

import torch


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """``k_cache[slots[i]] = k[i]`` (same for v), in place.

    k, v: ``[T, kv_heads, head_dim]``; caches: ``[num_slots, kv_heads, head_dim]``;
    slots: ``[T]`` int64.
    """
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    store_kv_ref(k, v, k_cache, v_cache, slots)
