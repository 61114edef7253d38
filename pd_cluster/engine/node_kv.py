"""A node's KV as a handover sees it: every KV head at the slots asked for, whatever the node's TP.

At TP 1 the node's pool holds every head and :class:`NodeKV` reads and writes it directly. A
tensor-parallel node's pools hold one part of the heads each (:mod:`pd_cluster.engine.tp_kv`),
so reading every head is one plan op that gathers the ranks' heads to rank 0, and writing is one
that hands the ranks theirs: KV crosses the ranks per handover, never per step. Call both on
the engine thread (between steps), so that the ranks' collectives run in the plan's order.

A P on the node's host skips both: :meth:`NodeKV.pool_offer` offers it every rank's pool, each
with the heads it holds (:mod:`pd_cluster.engine.tp_pools`), and P writes each rank's heads there.
"""

from __future__ import annotations

import torch

import kernels
from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.engine.tp_kv import KVHeads
from pd_cluster.engine.tp_leader import TPLeader
from pd_cluster.engine.tp_pools import NodePools, RankPools
from pd_cluster.kv_spec import KVSpec
from pd_cluster.transfer.ipc import PoolOffer, one_pool


class NodeKV:
    """The node's whole KV (``spec``, every head) over rank 0's ``pool`` (its own heads)."""

    def __init__(self, spec: KVSpec, pool: KVPool, tp: TPLeader | None = None, heads: KVHeads | None = None) -> None:
        if (tp is None) != (heads is None):
            raise ValueError("a tensor-parallel node's KV needs both its leader and its heads")
        self.spec = spec
        self.pool = pool
        self._tp = tp
        self._heads = heads
        #: The other ranks' exported pools, by the kinds asked for (exported once).
        self._rank_pools: dict[tuple[str, ...], list[RankPools]] = {}

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def whole(self) -> bool:
        """Whether the pool holds every head (TP 1): a layer at a time may be read or written
        there directly (the layer-wise paths)."""
        return self._tp is None

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Every head's KV at ``slots`` (int64 on the device), ``[2, L, n, heads, row_width]``
        (rows as a handover moves them, :attr:`KVSpec.row_width`)."""
        if self._tp is None or self._heads is None:
            return kernels.gather_kv(self.pool.k_cache, self.pool.v_cache, slots, self.spec.row_width)
        if not slots.numel():
            spec = self.spec
            return self.pool.k_cache.new_empty((2, spec.num_layers, 0, spec.num_kv_heads, spec.row_width))
        self._tp.gather_kv(slots)
        return self._heads.gather(slots)

    def scatter(self, buffer: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``buffer`` (every head, ``[2, L, n, heads, row_width]``) into ``slots`` on every
        rank, before any step reads them."""
        if self._tp is None or self._heads is None:
            kernels.scatter_kv(buffer, self.pool.k_cache, self.pool.v_cache, slots)
            return
        if not slots.numel():
            return
        buffer = buffer.to(self.device).contiguous()
        self._tp.put_kv(slots, buffer)
        self._heads.take(buffer, slots)

    def pool_offer(self, kinds: list[str]) -> PoolOffer:
        """The pools this node offers a P on its host, one a rank; at TP > 1 the other ranks export
        theirs in ``kinds`` on the first call (a plan op: call it before the engine thread runs
        steps, or on it). Raises TimeoutError when a rank does not answer, RuntimeError when the
        ranks cannot offer their pools in a common kind."""
        if self._tp is None or self._heads is None:
            return one_pool(self.pool.k_cache, self.pool.v_cache)
        key = tuple(kinds)
        if key not in self._rank_pools:
            self._rank_pools[key] = self._tp.export_pools(kinds)
        offer = NodePools(self.pool, self._heads.mine.start, self._rank_pools[key])
        missing = offer.missing()
        if missing is not None:
            raise RuntimeError(missing)
        return offer
