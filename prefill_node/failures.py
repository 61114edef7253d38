"""Why a prefill job failed, in the terms the master acts on: whether another attempt may succeed,
whether the decode node only had no room (backpressure), and whether P lost the decode node (the
fault is D's, so the re-run goes elsewhere)."""

from __future__ import annotations

from pd_cluster.handover import HandoverFailed
from pd_cluster.protocol import PrefillJob
from pd_cluster.transfer import HandshakeRefused, RemoteError, TransferError


class PrefillFailed(RuntimeError):
    """A job P could not finish; ``busy``: its decode node had no room (the master queues the
    request again without counting a fault); ``decode_lost``: P lost its connection to the
    decode node (the master re-runs the request on another one)."""

    def __init__(self, message: str, retryable: bool = True, busy: bool = False, decode_lost: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.busy = busy
        self.decode_lost = decode_lost


def prefill_failure(job: PrefillJob, error: Exception) -> Exception:
    """What a failed job raises: a PrefillFailed that says why and whether to retry."""
    if isinstance(error, PrefillFailed):
        return error
    if isinstance(error, HandoverFailed):
        return PrefillFailed(str(error), retryable=error.retryable, busy=error.busy)
    if isinstance(error, HandshakeRefused):
        return PrefillFailed(f"decode node {job.decode_node_id} refused the data plane: {error}", retryable=False)
    if isinstance(error, RemoteError):  # D is up and answered with an error
        return PrefillFailed(f"decode node {job.decode_node_id} failed the handover: {error}")
    if isinstance(error, TransferError):
        return PrefillFailed(f"lost decode node {job.decode_node_id}: {error or type(error).__name__}",
                             decode_lost=True)
    return PrefillFailed(f"prefill of {job.request_id} for decode node {job.decode_node_id} ran out of time")

