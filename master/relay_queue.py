"""Requests waiting for capacity, oldest first, each with its own timeout.

A request leaves the queue (:meth:`AdmissionQueue.discard`) when it is dispatched or ends; when
its wait times out first, the queue's ``on_expired`` tells the relay, which fails it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from master.relay_request import RelayRequest


class AdmissionQueue:
    def __init__(self, timeout_s: float, on_expired: Callable[[RelayRequest], None]) -> None:
        self.timeout_s = timeout_s
        self.on_expired = on_expired
        self._waiting: deque[RelayRequest] = deque()
        #: Every queued request's timeout (and only theirs).
        self._timers: dict[RelayRequest, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, r: RelayRequest, front: bool = False) -> None:
        """Queue ``r`` (a re-run goes first: it waited before) and start its wait's timeout."""
        self.discard(r)
        if front:
            self._waiting.appendleft(r)
        else:
            self._waiting.append(r)
        self._timers[r] = asyncio.get_running_loop().call_later(self.timeout_s, self._expired, r)

    def head(self) -> RelayRequest | None:
        return self._waiting[0] if self._waiting else None

    def discard(self, r: RelayRequest) -> None:
        """``r`` no longer waits (dispatched, or ended); a request that is not queued costs nothing."""
        timer = self._timers.pop(r, None)
        if timer is None:
            return
        timer.cancel()
        self._waiting.remove(r)

    def _expired(self, r: RelayRequest) -> None:
        self.on_expired(r)  # its (spent) timer stays listed while it is queued
