"""Requests waiting for capacity, oldest first, each with its own timeout and the reason it waits.

A request leaves the queue (:meth:`AdmissionQueue.discard`) when it is dispatched or ends; when
its wait times out first, the queue's ``on_expired`` tells the relay, which fails it. Each wait
is added to the request's ``queue_wait_s`` and told to ``on_waited`` (the metrics) with its reason.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from master.decode_room import WaitReason
from master.relay_request import RelayRequest


class AdmissionQueue:
    def __init__(
        self, timeout_s: float, on_expired: Callable[[RelayRequest], None],
        on_waited: Callable[[WaitReason, float], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.on_expired = on_expired
        self.on_waited = on_waited
        self._waiting: deque[RelayRequest] = deque()
        #: Every queued request's timeout (and only theirs).
        self._timers: dict[RelayRequest, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, r: RelayRequest, reason: WaitReason, front: bool = False) -> None:
        """Queue ``r`` (a re-run goes first: it waited before) and start its wait's timeout."""
        self.discard(r)
        if front:
            self._waiting.appendleft(r)
        else:
            self._waiting.append(r)
        self._start(r, reason)

    def put_back(self, r: RelayRequest, reason: WaitReason) -> None:
        """Queue ``r`` again at its place by arrival (a decode node refused it: it keeps its turn)."""
        self.discard(r)
        place = next((i for i, other in enumerate(self._waiting) if other.arrival > r.arrival), len(self._waiting))
        self._waiting.insert(place, r)
        self._start(r, reason)

    def _start(self, r: RelayRequest, reason: WaitReason) -> None:
        r.queued_at = time.monotonic()
        r.wait_reason = reason
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
        if r.queued_at is not None:
            waited = time.monotonic() - r.queued_at
            r.queue_wait_s += waited
            r.queued_at = None
            if self.on_waited is not None and r.wait_reason is not None:
                self.on_waited(r.wait_reason, waited)

    def _expired(self, r: RelayRequest) -> None:
        self.on_expired(r)  # its (spent) timer stays listed while it is queued
