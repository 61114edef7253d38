"""Admission of prefill jobs by tokens: a job leases KV on its decode node only once admitted.

A decode node's lease runs from the prefix query until the KV is committed. If every job queried
D on arrival, a burst deeper than P's prefill rate would hold leases while it waits in P's own
queue, and the last jobs' leases would expire before their KV was sent (seen on a 2-core CPU
at 16 requests/s: a third of the requests failed). So jobs first wait here, holding nothing on
D, and at most ``budget`` prompt tokens (about two prefill batches: one running, one ready) are
between the prefix query and the commit at once. A job larger than the budget enters alone.
"""

from __future__ import annotations

import asyncio
from collections import deque


class TokenAdmission:
    """First come, first served admission of jobs by their prompt tokens (one event loop)."""

    def __init__(self, budget: int) -> None:
        if budget < 1:
            raise ValueError("budget must be at least 1 token")
        self.budget = budget
        self.admitted_tokens = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, tokens: int) -> int:
        """Wait in arrival order until ``tokens`` fit; returns what to :meth:`release` later.

        Cancelled (a deadline, an abort) while waiting, it holds nothing.
        """
        need = min(max(tokens, 1), self.budget)
        if not self._waiters and self.admitted_tokens + need <= self.budget:
            self.admitted_tokens += need
            return need
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (need, future)
        self._waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(need)  # admitted just as it was cancelled: give the tokens back
            else:
                if entry in self._waiters:
                    self._waiters.remove(entry)
                self._wake()
            raise
        return need

    def release(self, tokens: int) -> None:
        self.admitted_tokens -= tokens
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.admitted_tokens + self._waiters[0][0] <= self.budget:
            need, future = self._waiters.popleft()
            if future.done():
                continue
            self.admitted_tokens += need
            future.set_result(None)
