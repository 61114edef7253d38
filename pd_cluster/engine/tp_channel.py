"""Rank 0's messages to the other ranks of its node: each step's plan, keep-alives, the stop.

Every rank of a node is on one host, so a message is one write into a shared-memory ring
(:mod:`pd_cluster.engine.shm_ring`) that the ranks see within microseconds, instead of a TCP
round trip per collective of the gloo control group. A message is a header (a few ints) and a
payload (int64 words), together in one slot; a payload too large for a slot (a long prompt's
eager step) follows over the control group, after its header in the ring, so the order holds.
Rank 0 makes the ring and puts its name in the node's store; the others attach to it there.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from pd_cluster.engine.shm_ring import ShmRing

#: The store's key of the ring's shared-memory name.
RING_KEY = "plan-ring"
#: Slots of the ring: how many messages rank 0 may be ahead of the slowest rank.
SLOTS = 8
#: A slot's bytes: a decode step's plan at batch 256 is ~30 KiB, a graph's prefill of 8k tokens
#: ~260 KiB; beyond, the step's compute dwarfs a TCP round trip.
SLOT_BYTES = 512 << 10


class PlanChannel:
    """Rank 0's side (:meth:`send`) or another rank's (:meth:`receive`) of the node's messages."""

    def __init__(self, ring: ShmRing, control: dist.ProcessGroup, rank: int) -> None:
        self.ring = ring
        self.control = control
        self.rank = rank

    @classmethod
    def open(cls, store: dist.Store, control: dist.ProcessGroup, rank: int, size: int,
             slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> PlanChannel:
        """Rank 0 makes the ring (``size - 1`` readers) and names it in ``store``; rank ``r``
        attaches as reader ``r - 1`` (waiting for the name up to the store's timeout)."""
        if rank == 0:
            ring = ShmRing.create(size - 1, slots, slot_bytes)
            store.set(RING_KEY, ring.name)
        else:
            ring = ShmRing.attach(store.get(RING_KEY).decode(), rank - 1)
        return cls(ring, control, rank)

    def send(self, head: Sequence[int], parts: Sequence[np.ndarray] = (), timeout_s: float = 60.0,
             alive: Callable[[], bool] | None = None) -> None:
        """``head`` and the concatenation of ``parts`` (int64 arrays) to every other rank, in one
        slot where they fit. ``alive``: whether the readers still run (checked while the ring is full)."""
        n = sum(p.size for p in parts)
        words = np.array([len(head), n, *head], dtype=np.int64)
        if self.ring.write([words, *parts], timeout_s, alive):
            return
        if not self.ring.write([words], timeout_s, alive):
            raise ValueError(f"a header of {len(head)} words exceeds the ring's slot")
        payload = torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts]).astype(np.int64, copy=False))
        self._broadcast(payload, timeout_s)

    def receive(self, timeout_s: float, alive: Callable[[], bool] | None = None) -> tuple[list[int], torch.Tensor]:
        """The next message: (its header, its payload as a host int64 tensor). Raises
        TimeoutError when none comes within ``timeout_s``, ConnectionError when ``alive()``
        turns false, :class:`~pd_cluster.engine.shm_ring.RingClosed` when rank 0 closed the ring."""
        words = self.ring.read(timeout_s, alive)
        h, n = int(words[0]), int(words[1])
        head = words[2:2 + h].tolist()
        if words.size == 2 + h + n:
            return head, torch.from_numpy(words[2 + h:])
        payload = torch.empty(n, dtype=torch.int64)
        self._broadcast(payload, timeout_s)
        return head, payload

    def _broadcast(self, tensor: torch.Tensor, timeout_s: float) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.control.broadcast(tensor, 0, timeout).wait(timeout)

    def close(self) -> None:
        """Rank 0 unlinks the ring's name (the readers see it closed once they read the rest)."""
        self.ring.close()
