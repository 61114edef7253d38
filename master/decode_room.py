"""Whether a decode (or mixed) node has room for one more request, by its last report and what
the master routed to it since: a row of its batch (``max_running_requests``) and the request's KV.

A full node is backpressure, not a fault: the master holds the request in its admission queue
until a node reports room, rather than sending it where the node would refuse it. Reports lag, so
a node may still refuse a lease (its last report, or another master's requests, hid how full it
was): :class:`HeldOff` keeps such a node out of routing until its next report shows what it holds.
So it does a node that a prefill node could not reach for a handover: the master may not have seen
its connection close yet, and a re-run sent back to it would only fail again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from master.registry import NodeRecord
from pd_cluster import protocol

#: Why a request waits in the admission queue (the label of ``pdc_queue_wait_seconds``):
#: every decode node's batch is full, or none has the KV it needs, or the node it was sent to
#: refused it (a race between reports), or it re-runs after a fault and no pair could take it yet,
#: or it arrived behind requests already waiting (first come, first served).
WaitReason = Literal["decode_full", "kv_full", "decode_refused", "rerun", "behind_queue"]
WAIT_REASONS: tuple[WaitReason, ...] = ("decode_full", "kv_full", "decode_refused", "rerun", "behind_queue")


def busy_rows(node: NodeRecord) -> int:
    """Rows of ``node``'s batch taken or promised: the requests its last report lists (running,
    waiting for a step, or reserved for a handover), less those that ended here since, plus those
    routed to it that the report does not list yet."""
    listed = set(node.status.request_ids)
    ended = len(listed.intersection(node.ended_attempts)) if node.ended_attempts else 0
    unseen = sum(1 for attempt_id in node.pending_kv if attempt_id not in listed)
    return max(len(listed) - ended, 0) + unseen


def has_row(node: NodeRecord) -> bool:
    """``node``'s batch has a free row for one more request."""
    return busy_rows(node) < node.info.capacity.max_running_requests


def has_kv(node: NodeRecord, kv_need: int) -> bool:
    """``node`` can take ``kv_need`` KV tokens now without evicting running work."""
    return node.kv_available >= kv_need


class HeldOff:
    """Decode nodes held off routing until their next status report: one refused a lease, or a
    prefill node lost its connection to it.

    The node's report at the mark is kept: the node is admissible again once a newer one arrived
    (the registry replaces ``NodeRecord.status`` with every report); a dead node never reports
    again and is removed."""

    def __init__(self) -> None:
        self._at_report: dict[str, protocol.NodeStatus] = {}

    def mark(self, node: NodeRecord) -> None:
        self._at_report[node.node_id] = node.status

    def holds_off(self, node: NodeRecord) -> bool:
        seen = self._at_report.get(node.node_id)
        if seen is None:
            return False
        if node.status is not seen or node.removed:
            del self._at_report[node.node_id]
            return False
        return True


def has_room(node: NodeRecord, kv_need: int, held_off: HeldOff | None = None) -> bool:
    """Active, a free row, ``kv_need`` KV tokens, and not held off since its last report."""
    return (node.active and has_row(node) and has_kv(node, kv_need)
            and (held_off is None or not held_off.holds_off(node)))


def why_full(decodes: Sequence[NodeRecord], kv_need: int, held_off: HeldOff | None = None) -> WaitReason:
    """Why no node of ``decodes`` (the active decode and mixed nodes) takes a request now."""
    if any(has_room(d, kv_need, held_off) for d in decodes):
        return "behind_queue"
    with_rows = [d for d in decodes if has_row(d)]
    if not with_rows:
        return "decode_full"
    if held_off is not None and any(has_kv(d, kv_need) for d in with_rows):
        return "decode_refused"
    return "kv_full"
