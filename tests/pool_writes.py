"""The KV a P wrote into a decode service's pool, measured in the pool itself.

:meth:`PoolWrites.arm` fills every free slot of D's pool with a sentinel and keeps a copy of the
pool; when a ``CommitKV`` reaches D's receiver (every write of the lease has landed, and D has
not yet decoded a token of the request), the slots that differ from the copy are counted. Slots
a lease reserves come from the free ones, so a write that repeats what a slot held before still
counts; a write into a slot D already held (a prefix hit) counts too.
"""

from __future__ import annotations

import torch

#: What an armed pool's free slots hold: no key or value a model writes equals it everywhere.
SENTINEL = 1234.5
#: The same for a quantized pool's bytes (a written row, codes and scale, is never all of it).
BYTE_SENTINEL = 0xAB


def sentinel(cache: torch.Tensor) -> float | int:
    return BYTE_SENTINEL if cache.dtype == torch.uint8 else SENTINEL


class PoolWrites:
    """Counts the slots of ``service``'s pool written between :meth:`arm` and each commit (commits
    before the first arm are not measured)."""

    def __init__(self, service) -> None:
        self.service = service
        self.engine = service.engine
        self._before: tuple[torch.Tensor, torch.Tensor] | None = None
        #: Slots found written at each commit since the last arm, in order.
        self.slots_at_commit: list[int] = []
        receiver = service.receiver
        commit = receiver.commit

        async def measured_commit(msg):
            if self._before is not None:
                self.slots_at_commit.append(await service.worker.call(self._changed_slots))
            return await commit(msg)

        receiver.commit = measured_commit

    @property
    def bytes_at_commit(self) -> list[int]:
        return [n * self.engine.kv_spec.bytes_per_token for n in self.slots_at_commit]

    async def arm(self) -> None:
        await self.service.worker.call(self._arm)
        self.slots_at_commit.clear()

    def _arm(self) -> None:
        pool = self.engine.pool
        free = torch.from_numpy(pool._is_free.copy()).to(pool.device)
        pool.k_cache[:, free] = sentinel(pool.k_cache)
        pool.v_cache[:, free] = sentinel(pool.v_cache)
        self._before = (pool.k_cache.clone(), pool.v_cache.clone())

    def _changed_slots(self) -> int:
        assert self._before is not None
        pool = self.engine.pool
        # Every row of the cache: with CUDA graphs, one slot out of service takes their padding
        # rows' writes (it no longer counts in the pool's capacity) and is left out below.
        changed = torch.zeros(pool.k_cache.shape[1], dtype=torch.bool, device=pool.device)
        for now, before in zip((pool.k_cache, pool.v_cache), self._before):
            for layer in range(now.shape[0]):  # a layer at a time: no copy of the whole pool's size
                changed |= (now[layer] != before[layer]).flatten(1).any(1)
        graphs = self.engine.runner.graphs
        if graphs is not None:
            changed[graphs.pad_slot] = False
        return int(changed.sum())


class RankWrites:
    """The KV a P wrote into each rank's pool of a tensor-parallel decode service, measured in
    the pools themselves (``pools``: every rank's pool opened in this process, rank order): at
    each commit, per rank, the bytes of the ``(layer, slot, head)`` rows of keys and values that
    changed since :meth:`arm`, and the slots they are in."""

    def __init__(self, service, pools) -> None:
        self.service = service
        self.pools = pools
        self._before: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: At each commit since the last arm: per rank, (bytes changed, slots changed).
        self.at_commit: list[list[tuple[int, frozenset[int]]]] = []
        receiver = service.receiver
        commit = receiver.commit

        async def measured_commit(msg):
            if self._before:
                self.at_commit.append(await service.worker.call(self._changed))
            return await commit(msg)

        receiver.commit = measured_commit

    async def arm(self) -> None:
        await self.service.worker.call(self._arm)
        self.at_commit.clear()

    def _arm(self) -> None:
        free = torch.from_numpy(self.service.engine.pool._is_free.copy())
        self._before = []
        for pool in self.pools:
            pool.k_cache[:, free] = sentinel(pool.k_cache)
            pool.v_cache[:, free] = sentinel(pool.v_cache)
            self._before.append((pool.k_cache.clone(), pool.v_cache.clone()))

    def _changed(self) -> list[tuple[int, frozenset[int]]]:
        out = []
        for pool, before in zip(self.pools, self._before):
            nbytes, slots = 0, torch.zeros(pool.k_cache.shape[1], dtype=torch.bool)
            for now, was in zip((pool.k_cache, pool.v_cache), before):
                rows = (now != was).any(-1)  # [layers, slots, heads]
                nbytes += int(rows.sum()) * now.shape[-1] * now.element_size()
                slots |= rows.any(-1).any(0)
            out.append((nbytes, frozenset(slots.nonzero().flatten().tolist())))
        return out
