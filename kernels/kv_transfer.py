"""Gather KV slots into one contiguous buffer for transfer, and scatter it back."""

from __future__ import annotations

import torch


def gather_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Copy the slots of every layer into ``[2, L, N, Hkv, D]`` (keys, then values).

    Caches: ``[L, S, Hkv, D]``; slots: ``[N]`` int64.
    """
    return torch.stack((k_cache[:, slots], v_cache[:, slots]))


def scatter_kv_ref(
    buffer: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Inverse of :func:`gather_kv_ref`: write ``buffer`` into the slots, in place."""
    k_cache[:, slots] = buffer[0]
    v_cache[:, slots] = buffer[1]


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return gather_kv_ref(k_cache, v_cache, slots)


def scatter_kv(buffer: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    scatter_kv_ref(buffer, k_cache, v_cache, slots)
