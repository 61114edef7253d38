"""How a handover fails, so a prefill node can tell D whether another attempt may succeed."""

from __future__ import annotations


class HandoverFailed(RuntimeError):
    """The KV did not reach D; ``retryable``: another attempt (another pair) may succeed."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable
