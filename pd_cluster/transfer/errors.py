"""Exceptions of the data plane, so callers can tell a dead peer from a refusal or a bug."""

from __future__ import annotations


class TransferError(Exception):
    """Base of every data-plane error."""


class FrameError(TransferError):
    """A frame that is malformed, of an unknown type, or too large; the connection is dropped."""


class FrameTooLarge(FrameError):
    pass


class ConnectionClosed(TransferError):
    """The peer closed the control connection."""


class HandshakeRefused(TransferError):
    """The decode node refused the dial (bad token, KV spec or device mismatch); not retryable."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ChannelError(TransferError):
    """The channel timed out or its peer died; it was torn down and a new dial may succeed."""


class RemoteError(TransferError):
    """The peer's handler failed on a request; the peer closed the connection after replying."""
