"""Pinned host rows that a captured greedy step's argmax writes its ids into, from inside the graph.

A step's sampled ids otherwise reach the host by a device-to-host copy queued behind the step's
graph. At batch 1 the default model's step is about 0.4 ms of graph, and that copy added about
9 us to it on an H100, where the kernel's own store into mapped host memory adds under 1 us.

A row is held by one step's result from the replay until the host has read it, so no later graph
writes a row that is still to be read. When all rows are held, the step takes the spare row,
which nobody reads, and its ids come back by the copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class MappedIds:
    """One step's ids in a held row of a :class:`MappedIdRing`: ``host`` (a view of the row's
    first ids) is valid once ``ready``, an event recorded behind the step, is reached (on CPU,
    where the row is written synchronously, ``ready`` is None). :meth:`release` gives the row back;
    dropping the object does too (``__del__``: cheaper on the step's path than a finalizer)."""

    __slots__ = ("host", "ready", "_give_back")

    def __init__(self, host: torch.Tensor, ready: torch.cuda.Event | None, give_back: Callable[[], None]) -> None:
        self.host = host
        self.ready = ready
        self._give_back: Callable[[], None] | None = give_back

    def release(self) -> None:
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()

    def __del__(self) -> None:
        self.release()


class MappedIdRing:
    """:data:`DEPTH` rows a step's graph may write its ids to, and one spare row."""

    #: Rows that results may hold at once. A pipelined engine holds at most two; the rest are slack.
    DEPTH = 8

    def __init__(self, max_rows: int, device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        self.buffer = torch.zeros((self.DEPTH + 1, max(1, max_rows)), dtype=torch.int64, pin_memory=on_gpu)
        #: The row written when every other one is held: never read.
        self.spare = self.DEPTH
        self._free = list(range(self.DEPTH - 1, -1, -1))
        self._events: list[torch.cuda.Event | None] = [torch.cuda.Event() if on_gpu else None
                                                       for _ in range(self.DEPTH)]
        #: Each (row, ids) view made once: indexing the buffer anew cost each step about 2 us.
        self._views: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free row to write a step's ids to (now held), or :attr:`spare` when none is free."""
        return self._free.pop() if self._free else self.spare

    def hold(self, row: int, n: int) -> MappedIds | None:
        """The ids of a step that wrote ``n`` ids to ``row`` (taken with :meth:`take`), held
        until released; None for the spare row."""
        if row == self.spare:
            return None
        view = self._views.get((row, n))
        if view is None:
            view = self._views[row, n] = self.buffer[row, :n]
        return MappedIds(view, self._events[row], lambda: self.give_back(row))

    def give_back(self, row: int) -> None:
        """``row`` free again (the spare: nothing to do)."""
        if row != self.spare:
            self._free.append(row)
