"""A broadcast ring in shared memory: one writer, N readers, all on one host.

A tensor-parallel node's rank 0 tells its other ranks each step's plan. Over a gloo group that
is a TCP round trip through the store's sockets per collective, and the ranks launch their
step only once it arrives, so rank 0's first all-reduce waits for them. Here a message is one
copy into a slot of a segment every rank maps, and a reader sees it as soon as it looks.

The segment holds a small geometry header, one counter per reader (its own cache line: the
messages it has finished reading) and ``slots`` fixed-size slots, each with a sequence number
and a length before its int64 words. Message ``k`` goes to slot ``k % slots``; the writer fills
it only once every reader has finished message ``k - slots``, then publishes the sequence number
``k + 1`` last. A reader waits for its next message's number, copies the words out and counts
the message read. Waits spin briefly, then yield the core, then sleep in growing naps (an idle
node does not burn cores), and every wait has a deadline. A message larger than a slot does not
go here (:meth:`ShmRing.write` says so): the caller sends it another way.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import numpy as np

logger = logging.getLogger(__name__)

#: int64 words of a cache line: each counter has its own, so readers never share one.
LINE = 8
MAGIC = 0x70645F72696E67  # "pd_ring"
#: Geometry header words: magic, readers, slots, words a slot holds, writer closed.
_MAGIC, _READERS, _SLOTS, _SLOT_WORDS, _CLOSED = range(5)
#: A slot's header words (one line): the sequence number of the message in it, its length.
_SEQ, _LEN = 0, 1

#: Waits first spin this long (the next step's plan is usually a few milliseconds away) ...
SPIN_S = 200e-6
#: ... then yield the core until this long ...
YIELD_S = 20e-3
#: ... then sleep, from the first nap doubling up to the last (an idle reader wakes within it).
FIRST_NAP_S = 50e-6
LAST_NAP_S = 1e-3

_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier (a lock's acquire and release): the words of a slot are visible
    before its sequence number, on hosts whose stores may be reordered (ARM) too."""
    with _fence_lock:
        pass


_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))


class RingClosed(EOFError):
    """The writer closed the ring and every message it wrote was read."""


def wait_for(ready: Callable[[], bool], timeout_s: float, what: str, alive: Callable[[], bool] | None = None,
             closed: Callable[[], bool] | None = None) -> None:
    """Return once ``ready()``: spin, then yield, then nap (see the module's docstring). Raises
    TimeoutError past ``timeout_s``, ConnectionError when ``alive()`` turns false and RingClosed
    when ``closed()`` turns true (both checked only once the spin is over: they cost a call)."""
    if ready():
        return
    start = time.perf_counter()
    spin_until, yield_until, deadline = start + SPIN_S, start + YIELD_S, start + timeout_s
    nap = FIRST_NAP_S
    while not ready():
        now = time.perf_counter()
        if now < spin_until:
            continue
        if closed is not None and closed():
            if ready():
                return
            raise RingClosed(f"{what}: the writer closed the ring")
        if now >= deadline:
            raise TimeoutError(f"{what}: nothing within {timeout_s:.3g} s")
        if alive is not None and not alive():
            raise ConnectionError(f"{what}: the other side is gone")
        if now < yield_until:
            _yield()
        else:
            time.sleep(nap)
            nap = min(2 * nap, LAST_NAP_S)


_tracker_lock = threading.Lock()


def _open_untracked(name: str) -> shared_memory.SharedMemory:
    """Map the segment ``name`` without telling this process's resource tracker: the writer owns
    the name and unlinks it; a reader's tracker (one a process, or its parent's) would unlink it
    or forget the writer's claim when the reader exits."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    with _tracker_lock:
        register = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None  # type: ignore[assignment]
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register  # type: ignore[assignment]


class ShmRing:
    """One side of a ring: the writer (:meth:`create`) or reader ``i`` (:meth:`attach`)."""

    def __init__(self, shm: shared_memory.SharedMemory, reader: int | None) -> None:
        self._shm = shm
        words = np.ndarray((shm.size // 8,), dtype=np.int64, buffer=shm.buf)
        if int(words[_MAGIC]) != MAGIC:
            raise ValueError(f"shared memory {shm.name} is not a broadcast ring")
        self.readers, self.slots, self.slot_words = (int(w) for w in words[_READERS:_SLOT_WORDS + 1])
        self._meta = words[:LINE]
        #: Messages each reader has finished, one line apart.
        self._done = words[LINE:LINE * (1 + self.readers):LINE]
        stride = LINE + self.slot_words
        body = words[LINE * (1 + self.readers):LINE * (1 + self.readers) + self.slots * stride]
        slots = body.reshape(self.slots, stride)
        self._seq = slots[:, _SEQ]
        self._len = slots[:, _LEN]
        self._data = slots[:, LINE:]
        self._words = words
        self.reader = reader
        #: Messages written (the writer) or read (a reader) so far.
        self.count = 0
        self._unlinked = False

    @classmethod
    def create(cls, readers: int, slots: int = 8, slot_bytes: int = 256 << 10) -> ShmRing:
        """A new ring (its :attr:`name` is for the readers to :meth:`attach`), the writer's side."""
        slot_words = -(-slot_bytes // 8)
        size = 8 * (LINE * (1 + readers) + slots * (LINE + slot_words))
        shm = shared_memory.SharedMemory(create=True, size=size)
        words = np.ndarray((size // 8,), dtype=np.int64, buffer=shm.buf)
        words[:] = 0
        words[_READERS], words[_SLOTS], words[_SLOT_WORDS] = readers, slots, slot_words
        _fence()
        words[_MAGIC] = MAGIC
        return cls(shm, None)

    @classmethod
    def attach(cls, name: str, reader: int) -> ShmRing:
        """Reader ``reader`` (0 .. readers-1) of the ring the writer made as ``name``."""
        shm = _open_untracked(name)
        ring = cls(shm, reader)
        if not 0 <= reader < ring.readers:
            shm.close()
            raise ValueError(f"reader {reader} of a ring of {ring.readers}")
        return ring

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def capacity(self) -> int:
        """The most int64 words a message holds."""
        return self.slot_words

    def write(self, parts: list[np.ndarray], timeout_s: float, alive: Callable[[], bool] | None = None) -> bool:
        """Send the concatenation of ``parts`` (int64 arrays) to every reader; False (nothing
        sent) when it exceeds :attr:`capacity`. Waits (up to ``timeout_s``) while the slot it
        takes still holds a message some reader has not finished."""
        assert self.reader is None, "a reader does not write"
        n = sum(p.size for p in parts)
        if n > self.slot_words:
            return False
        k = self.count
        slot = k % self.slots
        oldest = k + 1 - self.slots  # every reader must have finished message k - slots
        if oldest > 0:
            done = self._done
            wait_for(lambda: int(done.min()) >= oldest, timeout_s, "the ring's readers", alive)
        data = self._data[slot]
        at = 0
        for part in parts:
            data[at:at + part.size] = part.reshape(-1)
            at += part.size
        self._len[slot] = n
        _fence()
        self._seq[slot] = k + 1
        self.count = k + 1
        return True

    def read(self, timeout_s: float, alive: Callable[[], bool] | None = None) -> np.ndarray:
        """The next message's words (a copy). Raises TimeoutError when none comes within
        ``timeout_s``, ConnectionError when ``alive()`` turns false, RingClosed after the last."""
        assert self.reader is not None, "the writer does not read"
        k = self.count
        slot = k % self.slots
        seq, meta = self._seq, self._meta
        wait_for(lambda: int(seq[slot]) == k + 1, timeout_s, "the ring's writer", alive,
                 lambda: bool(meta[_CLOSED]))
        _fence()
        words = self._data[slot, :int(self._len[slot])].copy()
        _fence()
        self._done[self.reader] = k + 1
        self.count = k + 1
        return words

    def close(self) -> None:
        """Unmap the segment; the writer also marks it closed and unlinks its name."""
        if self.reader is None and not self._unlinked:
            self._meta[_CLOSED] = 1
            self._unlinked = True
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
        # Views into the mapping must go before it can close.
        self._meta = self._done = self._seq = self._len = self._data = self._words = None  # type: ignore[assignment]
        try:
            self._shm.close()
        except BufferError as e:  # a view still held by a caller: the mapping goes with the process
            logger.debug("shared memory %s stays mapped: %s", self._shm.name, e)
