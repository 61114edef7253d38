"""How many generations each API key runs, counted where the limit must hold.

One master process counts in a dict. A master of several workers (:mod:`master.workers`) counts
in a table every worker maps from one file, so a key's limit holds across the kernel's spread
of its connections: a row of counts per worker, a column per key. A worker adds to its own row
only and checks the sum of the column under an exclusive ``flock`` of the file (the kernel drops
the lock of a process that dies holding it); when a worker dies its requests die with it, so the
supervisor zeroes its row and nothing it held stays counted. Columns are claimed by a hash of
the key, not by its place in the keys file, so a worker restarted after the file changed still
finds the columns its siblings use.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import numpy as np

#: The environment variable that names the shared table to the workers the supervisor spawns.
KEY_COUNTS_ENV = "PD_MASTER_KEY_COUNTS"
#: Keys the shared table has columns for (an API keys file with more is refused at start).
MAX_KEYS = 4096


class KeyCounts(Protocol):
    def try_add(self, key: str, generations: int, limit: int | None) -> int | None:
        """Add ``generations`` to ``key`` unless that would pass ``limit`` (None: no bound);
        returns the key's count before the add, or None when refused."""

    def sub(self, key: str, generations: int) -> None: ...

    def running(self, key: str) -> int: ...


class LocalKeyCounts:
    """One process's counts."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}

    def try_add(self, key: str, generations: int, limit: int | None) -> int | None:
        running = self.open.get(key, 0)
        if limit is not None and running + generations > limit:
            return None
        self.open[key] = running + generations
        return running

    def sub(self, key: str, generations: int) -> None:
        count = self.open.get(key, 0) - generations
        if count > 0:
            self.open[key] = count
        else:
            self.open.pop(key, None)

    def running(self, key: str) -> int:
        return self.open.get(key, 0)


def key_id(key: str) -> int:
    """A column's name in the table: 63 bits of the key's SHA-256 (never 0, the free mark)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1 or 1


class SharedKeyCounts:
    """The table of ``workers`` rows in ``path`` (see the module's docstring); ``row``: this
    process's row (None in the supervisor, which only zeroes rows)."""

    def __init__(self, path: Path, workers: int, row: int | None) -> None:
        self.path, self.workers, self.row = path, workers, row
        self._fd = os.open(path, os.O_RDWR)
        size = 8 * MAX_KEYS * (workers + 1)
        if os.fstat(self._fd).st_size != size:
            os.close(self._fd)
            raise ValueError(f"{path} is not a key-count table for {workers} workers")
        self._map = mmap.mmap(self._fd, size)
        table = np.frombuffer(self._map, dtype=np.int64)
        self._ids = table[:MAX_KEYS]
        self._counts = table[MAX_KEYS:].reshape(workers, MAX_KEYS)
        self._columns: dict[str, int] = {}

    @classmethod
    def create(cls, path: Path, workers: int) -> "SharedKeyCounts":
        """A zeroed table at ``path`` (the supervisor's, before it spawns the workers)."""
        with open(path, "wb") as f:
            f.truncate(8 * MAX_KEYS * (workers + 1))
        return cls(path, workers, None)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _column(self, key: str) -> int:
        """The key's column, claimed on first use (call with the lock held)."""
        column = self._columns.get(key)
        if column is not None:
            return column
        wanted = key_id(key)
        found = np.flatnonzero(self._ids == wanted)
        if found.size:
            column = int(found[0])
        else:
            free = np.flatnonzero(self._ids == 0)
            if not free.size:
                raise RuntimeError(f"more than {MAX_KEYS} API keys share the workers' count table")
            column = int(free[0])
            self._ids[column] = wanted
        self._columns[key] = column
        return column

    def try_add(self, key: str, generations: int, limit: int | None) -> int | None:
        assert self.row is not None, "the supervisor's view counts nothing"
        with self._locked():
            column = self._column(key)
            running = int(self._counts[:, column].sum())
            if limit is not None and running + generations > limit:
                return None
            self._counts[self.row, column] += generations
            return running

    def sub(self, key: str, generations: int) -> None:
        assert self.row is not None, "the supervisor's view counts nothing"
        with self._locked():
            column = self._column(key)
            self._counts[self.row, column] = max(0, int(self._counts[self.row, column]) - generations)

    def running(self, key: str) -> int:
        with self._locked():
            return int(self._counts[:, self._column(key)].sum())

    def forget_row(self, row: int) -> None:
        """A dead worker's generations: none of them runs any more."""
        with self._locked():
            self._counts[row, :] = 0

    def close(self) -> None:
        del self._ids, self._counts  # views of the map: it cannot close while they hold it
        self._map.close()
        os.close(self._fd)
