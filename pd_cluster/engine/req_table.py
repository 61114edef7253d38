"""Request-to-slot table: row ``r`` lists the KV slots of one running request's tokens."""

from __future__ import annotations

import torch

from pd_cluster.engine.device_copy import to_device


class ReqSlotTable:
    """A ``[max_requests, max_len]`` int64 table on the device, so a step's slot table is one gather."""

    def __init__(self, max_requests: int, max_len: int, device: torch.device) -> None:
        self.table = torch.zeros((max_requests, max_len), dtype=torch.int64, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self.max_len = max_len
        #: Rows freed so far: an engine compares it across a step's launch.
        self.frees = 0

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
        self.table[row, start : start + slots.numel()] = to_device(slots, self.table.device)

    def read(self, row: int, length: int) -> torch.Tensor:
        """The first ``length`` slots of a row, on the CPU."""
        return self.table[row, :length].cpu()
