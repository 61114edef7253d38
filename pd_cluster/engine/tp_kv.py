"""Where a tensor-parallel node's KV lives, and how rank 0 keeps every head of it.

Each rank attends with its own KV heads in its own pool. Rank 0's pool holds every head (the
node's :class:`~pd_cluster.kv_spec.KVSpec`, as at TP 1), its model reading and writing its own
heads through :class:`HeadView`; so the prefix cache, the handover to and from other nodes
(whatever their TP) and the KV events work on rank 0 alone, unchanged:

- after each layer of each step, every rank's new KV reaches rank 0 (:meth:`KVShare.layer_done`,
  an all-gather of the step's new tokens: a layer streamed to a decode node has all its heads);
- KV written into rank 0's pool from outside (a handover received, a prefix shared before) is
  sent to the other ranks before the first step that reads it (:meth:`KVShare.put`).

Simple before fast: the gathers cost one all-gather of the new tokens' KV a layer, and rank 0's
pool is a TP-1 pool.
"""

from __future__ import annotations

import torch

from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.engine.tp_group import TPGroup
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.shard import HeadRange, Shard


class HeadView:
    """Rank 0's own KV heads of a pool that holds every head (the model's ``KVLayers``)."""

    def __init__(self, pool: KVPool, heads: HeadRange) -> None:
        self.pool = pool
        self.heads = heads

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.heads
        return self.pool.k_cache[index][:, h.start:h.stop], self.pool.v_cache[index][:, h.start:h.stop]


class KVShare:
    """The KV traffic between the ranks of one node (see the module's docstring)."""

    def __init__(self, group: TPGroup, config: ModelConfig, own: HeadView | KVPool, full: KVPool | None) -> None:
        self.group = group
        self.own = own
        #: Rank 0's pool of every head; None on the other ranks.
        self.full = full
        self.heads = [Shard(r, group.size).kv_heads(config) for r in range(group.size)]
        self.mine = self.heads[group.rank]
        self.max_heads = max(h.count for h in self.heads)

    def layer_done(self, out_slots: torch.Tensor, layer: int) -> None:
        """Every rank's KV of layer ``layer`` at ``out_slots`` into rank 0's pool (all ranks call it)."""
        k_cache, v_cache = self.own.layer(layer)
        n = out_slots.numel()
        mine = torch.zeros((2, n, self.max_heads, k_cache.shape[-1]), dtype=k_cache.dtype, device=k_cache.device)
        mine[0, :, : self.mine.count] = k_cache[out_slots]
        mine[1, :, : self.mine.count] = v_cache[out_slots]
        gathered = [torch.empty_like(mine) for _ in range(self.group.size)]
        self.group.all_gather(gathered, mine)
        if self.full is None:
            return
        k_full, v_full = self.full.layer(layer)
        for rank in range(1, self.group.size):
            h = self.heads[rank]
            k_full[out_slots, h.start:h.stop] = gathered[rank][0, :, : h.count]
            v_full[out_slots, h.start:h.stop] = gathered[rank][1, :, : h.count]

    def full_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """Rank 0: every head's KV at ``slots``, ``[layers, 2, n, heads, head_dim]`` on the host."""
        assert self.full is not None
        return torch.stack((self.full.k_cache[:, slots], self.full.v_cache[:, slots]), dim=1).cpu()

    def take(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Another rank: its heads of ``kv`` (from :meth:`full_kv`) into its pool at ``slots``."""
        assert isinstance(self.own, KVPool)
        h = self.mine
        part = kv[:, :, :, h.start:h.stop].to(self.own.device)
        slots = slots.to(self.own.device)
        self.own.k_cache[:, slots] = part[:, 0]
        self.own.v_cache[:, slots] = part[:, 1]
