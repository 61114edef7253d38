"""Request-to-slot table: row ``r`` lists the KV slots of one running request's tokens.

The attention kernels read the table on the device. The host reads rows too, whenever a request
ends (its slots go to the prefix cache) or hands its KV over; a read of the device table would
wait for the step in flight, stalling the pipelined engine once for every request that ends. Every
slot written comes from the host, so on a GPU the host keeps a mirror of the table and reads that.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pd_cluster.engine.device_copy import to_device

#: Writes recorded one by one up to this many (a few streams' decode step: 0.5 us for one, where
#: numpy's indexed assignment costs about 3 us whatever the count).
_LOOP_RECORD = 16


class ReqSlotTable:
    """A ``[max_requests, max_len]`` int64 table on the device, so a step's slot table is one gather."""

    def __init__(self, max_requests: int, max_len: int, device: torch.device, host_mirror: bool | None = None) -> None:
        """``host_mirror``: keep the host copy that reads come from; None: on any device but the CPU."""
        self.table = torch.zeros((max_requests, max_len), dtype=torch.int64, device=device)
        if host_mirror is None:
            host_mirror = self.table.device.type != "cpu"
        self._host: np.ndarray | None = np.zeros((max_requests, max_len), dtype=np.int64) if host_mirror else None
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self.max_len = max_len
        #: Rows freed so far: an engine compares it across a step's launch.
        self.frees = 0
        #: Writes since :meth:`take_journal`, each ``[3, n]`` (rows, positions, slots), kept where
        #: another copy of the table follows this one (a tensor-parallel rank's, for its CUDA
        #: graphs); None: not kept.
        self.journal: list[np.ndarray] | None = None

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free_row(self, row: int) -> None:
        if row in self._free_rows:
            raise RuntimeError(f"request row {row} freed twice")
        self.frees += 1
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Slots ``[start, start + len(slots))`` of a row (``slots`` on the host)."""
        self.table[row, start : start + slots.numel()] = to_device(slots, self.table.device)
        if self._host is not None:
            self._host[row, start : start + slots.numel()] = slots.cpu().numpy()
        if self.journal is not None and slots.numel():
            n = slots.numel()
            self.journal.append(np.stack((np.full(n, row, dtype=np.int64), np.arange(start, start + n, dtype=np.int64),
                                          slots.cpu().numpy().astype(np.int64, copy=False))))

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        """Rows ``dst`` list the first ``length`` slots of rows ``src`` (index tensors on the
        table's device; a beam forked from its parent), on the device only: queued, nothing read
        back. The host's mirror learns them by :meth:`mirror_rows`."""
        if length:
            view = self.table[:, :length]
            view.index_copy_(0, dst, view.index_select(0, src))

    def mirror_rows(self, rows: Sequence[int], slots: np.ndarray) -> None:
        """Rows ``rows`` list ``slots`` ``[len(rows), n]`` from position 0, as the device table
        already does (:meth:`copy_rows`): the host's mirror and the journal take them."""
        n = slots.shape[1]
        if self._host is not None:
            self._host[list(rows), :n] = slots
        if self.journal is not None and n and len(rows):
            self.journal.append(np.stack((np.repeat(np.asarray(rows, dtype=np.int64), n),
                                          np.tile(np.arange(n, dtype=np.int64), len(rows)),
                                          slots.astype(np.int64, copy=False).reshape(-1))))

    def take_journal(self) -> torch.Tensor:
        """The writes kept since the last call, ``[3, n]`` int64 on the host (rows, positions,
        slots); the journal starts again empty."""
        entries, self.journal = self.journal or [], [] if self.journal is not None else None
        if not entries:
            return torch.zeros((3, 0), dtype=torch.int64)
        return torch.from_numpy(np.concatenate(entries, axis=1))

    def apply_journal(self, writes: torch.Tensor) -> None:
        """Writes another table kept (:meth:`take_journal`), into the device table."""
        if writes.shape[1]:
            writes = writes.to(self.table.device)
            self.table[writes[0], writes[1]] = writes[2]

    def record(self, rows: Sequence[int], positions: Sequence[int], slots: Sequence[int]) -> None:
        """Slots written to the device table elsewhere (a captured step's inputs scattered into it):
        ``table[rows[i], positions[i]] = slots[i]`` on the host mirror."""
        host = self._host
        if host is None:
            return
        if len(rows) <= _LOOP_RECORD:
            for row, position, slot in zip(rows, positions, slots):
                host[row, position] = slot
        else:
            host[rows, positions] = slots

    def read(self, row: int, length: int) -> torch.Tensor:
        """The first ``length`` slots of a row, on the CPU (from the mirror: no wait on the device)."""
        if self._host is None:
            return self.table[row, :length].cpu()
        return torch.from_numpy(self._host[row, :length].copy())
