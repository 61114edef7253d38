"""How a handover fails, so a prefill node can tell D whether another attempt may succeed."""

from __future__ import annotations


class HandoverFailed(RuntimeError):
    """The KV did not reach D; ``retryable``: another attempt (another pair) may succeed; ``busy``:
    D refused the lease for want of room (backpressure: the request waits, no fault is counted)."""

    def __init__(self, message: str, retryable: bool = True, busy: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.busy = busy
