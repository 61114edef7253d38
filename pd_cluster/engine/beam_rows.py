"""A beam search's request rows and the KV slots its beams list: forked on the device, booked on the host.

Beam ``i`` of a search runs in the search's ``i``-th request row. Each step's kept beams are known
first on the device (:mod:`pd_cluster.engine.beam_select`): :meth:`BeamRows.fork_on_device` makes
each row list its parent's slots there, a gather of the parents' rows with nothing read back, so
the next step runs at once. The host learns the parents when it reads that step back and then
keeps the books (:meth:`BeamRows.fork`): which slots each beam lists, the pool's holder counts (a
slot several beams list is shared, never copied: :meth:`KVPool.share`) and the table's host
mirror. Its lists are the search's own, so the books never read the table, which the device may
have forked again by then.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from pd_cluster.engine.device_copy import tensor_on
from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.engine.req_table import ReqSlotTable
from pd_cluster.engine.request import PENDING, Request


@dataclass(eq=False)
class BeamRows:
    """A search's rows (one request each, ``width`` in all) and its beams' slots."""

    table: ReqSlotTable
    pool: KVPool
    requests: list[Request]
    table_rows: list[int]
    #: :attr:`table_rows` on the table's device.
    device_rows: torch.Tensor
    #: ``[beams, n]``: each beam's slots as of the last step read back, each held in the pool.
    slots: np.ndarray = field(default_factory=lambda: np.zeros((1, 0), dtype=np.int64))
    #: The new slots ``[rows, tokens]`` of each step launched and not yet read back, oldest first.
    launched: deque[np.ndarray] = field(default_factory=deque)
    #: Rows the last step launched ran (1 before the first).
    running: int = 1

    @classmethod
    def allocate(cls, table: ReqSlotTable, pool: KVPool, requests: list[Request]) -> BeamRows:
        """One table row for each request (the caller checked they are free)."""
        rows = [table.alloc_row() for _ in requests]
        for request, row in zip(requests, rows):
            request.row = row
        return cls(table, pool, requests, rows, tensor_on(rows, torch.int64, table.table.device))

    def start_from(self, slots: torch.Tensor) -> None:
        """The first beam lists ``slots`` (the prompt's KV, held by the search from now on)."""
        self.table.write(self.table_rows[0], 0, slots)
        self.slots = slots.numpy().astype(np.int64, copy=True)[None, :]
        self.requests[0].num_computed = slots.numel()

    def take_step(self, rows: int, tokens: int) -> np.ndarray | None:
        """New slots ``[rows, tokens]`` for a step of the first ``rows`` beams (None: none free)."""
        slots = self.pool.take(rows * tokens)
        if slots is None:
            return None
        step = slots.reshape(rows, tokens)
        self.launched.append(step)
        self.running = rows
        return step

    def fork_on_device(self, parents: torch.Tensor, length: int) -> None:
        """Row ``i`` lists the first ``length`` slots of row ``parents[i]`` (a device tensor of the
        beams' parents, as the selection kept them): queued on the device only."""
        rows = parents.numel()
        self.table.copy_rows(self.device_rows[:rows], self.device_rows.index_select(0, parents), length)

    def pend(self, rows: int, computed: int) -> None:
        """The first ``rows`` requests stand at ``computed`` tokens, their input the token still on
        the device (their outputs hold only :data:`PENDING`: the scorer has the beams' tokens)."""
        for request in self.requests[:rows]:
            out = request.sampling.output_token_ids
            out.extend([PENDING] * (computed + 1 - len(request.prompt_token_ids) - len(out)))
            request.num_computed = computed

    def fork(self, parents: list[int]) -> None:
        """The books of the oldest step launched, read back: beam ``i`` now lists its parent's
        slots (those of ``parents[i]``, that step's new one among them). A parent's slots gain a
        holder for each child past its first, and lose one without a child (freed where no other
        beam lists them)."""
        held = np.concatenate([self.slots, self.launched.popleft()], axis=1)
        children = np.bincount(np.asarray(parents, dtype=np.int64), minlength=held.shape[0])
        shared = [held[j] for j in range(held.shape[0]) for _ in range(int(children[j]) - 1)]
        if shared:
            self.pool.share(torch.from_numpy(np.concatenate(shared)))
        for j in np.flatnonzero(children == 0):
            self.pool.free(torch.from_numpy(held[j]))
        self.slots = held[parents]
        self.table.mirror_rows(self.table_rows[: len(parents)], self.slots)

    def release(self) -> None:
        """Give back every slot the beams list (a holder each) or a launched step took, and the rows."""
        for beam in self.slots:
            self.pool.free(torch.from_numpy(beam))
        while self.launched:
            self.pool.free(torch.from_numpy(self.launched.popleft().reshape(-1)))
        self.slots = self.slots[:0]
        for request in self.requests:
            request.row = -1
        for row in self.table_rows:
            self.table.free_row(row)
        self.table_rows = []
