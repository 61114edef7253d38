"""Where a tensor-parallel node's KV lives: each rank's pool holds only its own KV heads.

Every rank's pool has the same slots, and rank 0 (its radix cache, request table and
allocator) decides them for all, so the same slot holds the same token's KV on every rank and
a prefix shared from the cache needs no traffic. KV crosses the ranks only when it crosses the
node's boundary, once per handover, never per step:

- sending (a prefill node): rank 0 asks the ranks for their heads at the request's slots
  (:meth:`KVHeads.gather`, one all-gather over the model group) and sends every head;
- receiving (a decode node): rank 0 gets every head and hands each rank the buffer
  (:meth:`KVHeads.take`, after a broadcast over the model group), each keeping its own heads.

Buffers have the layout of :func:`kernels.gather_kv`: ``[2, layers, n, heads, row_width]``
(:attr:`~pd_cluster.kv_spec.KVSpec.row_width`: ``head_dim`` values, or a quantized pool's rows as a
handover moves them, codes and scale); every rank's pool stores the node's KV dtype.
"""

from __future__ import annotations

import torch

import kernels
from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.engine.tp_group import TPGroup
from pd_cluster.kv_spec import KVSpec
from pd_cluster.model.config import ModelConfig
from pd_cluster.model.shard import HeadRange, Shard


def rank_kv_spec(config: ModelConfig, shard: Shard, dtype: str, block_size: int = 1, kv_dtype: str = "") -> KVSpec:
    """The KV one rank stores: its own heads (every head at TP 1)."""
    return KVSpec(model=config.name, num_layers=config.num_layers, num_kv_heads=shard.kv_heads(config).count,
                  head_dim=config.head_dim, dtype=dtype, block_size=block_size, kv_dtype=kv_dtype)


class KVHeads:
    """One rank's part in moving a node's KV between its ranks (every rank calls each method
    together, in the order rank 0's plan gives)."""

    def __init__(self, group: TPGroup, config: ModelConfig, pool: KVPool) -> None:
        self.group = group
        self.pool = pool
        self.num_heads = config.num_kv_heads
        self.heads: list[HeadRange] = [Shard(r, group.size).kv_heads(config) for r in range(group.size)]
        self.mine = self.heads[group.rank]
        self.max_heads = max(h.count for h in self.heads)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Every head's KV at ``slots`` (device int64), ``[2, L, n, heads, head_dim]``; the
        result is rank 0's to use (the others take part in the all-gather)."""
        own = kernels.gather_kv(self.pool.k_cache, self.pool.v_cache, slots, self.pool.spec.row_width)
        if own.shape[3] < self.max_heads:
            pad = list(own.shape)
            pad[3] = self.max_heads - own.shape[3]
            own = torch.cat((own, own.new_zeros(pad)), dim=3)
        own = own.contiguous()
        parts = [torch.empty_like(own) for _ in range(self.group.size)]
        self.group.all_gather(parts, own)
        shape = list(own.shape)
        shape[3] = self.num_heads
        whole = own.new_empty(shape)
        for h, part in zip(self.heads, parts):
            # Ranks that share a head (more ranks than KV heads) hold the same KV for it.
            whole[:, :, :, h.start:h.stop] = part[:, :, :, : h.count]
        return whole

    def take(self, buffer: torch.Tensor, slots: torch.Tensor) -> None:
        """This rank's heads of ``buffer`` (every head) into its pool at ``slots``."""
        h = self.mine
        kernels.scatter_kv(buffer[:, :, :, h.start:h.stop], self.pool.k_cache, self.pool.v_cache, slots)
