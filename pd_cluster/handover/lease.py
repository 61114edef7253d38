"""The first step of every handover: ask D which leading blocks of the prompt it holds.

D pins those blocks, leases slots for the rest and answers ``MatchResult``; P keeps the answer
as a :class:`DecodeLease` for the sender that moves the missing blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pd_cluster.handover.errors import HandoverFailed
from pd_cluster.handover.messages import MatchPrefix, MatchResult
from pd_cluster.protocol import PrefillJob
from pd_cluster.transfer import PeerChannel


@dataclass(frozen=True)
class DecodeLease:
    """D's answer to a prefix query: its hit, and the lease on slots for the missing tokens."""

    lease_id: str
    hit_blocks: int
    decode_node_id: str
    #: When P asked (monotonic) and how long the lease runs from then, as P counts it.
    asked_at: float
    lease_s: float
    query_seconds: float
    #: Base64 slots D reserved for the missing tokens (asked with ``direct``), else None.
    slots: str | None = None

    @property
    def ends_at(self) -> float:
        """Monotonic time by which D may hand the slots to someone else (P's conservative view)."""
        return self.asked_at + self.lease_s


async def reserve(channel: PeerChannel, job: PrefillJob, lease_s: float, left: Callable[[], float]) -> DecodeLease:
    """Send ``MatchPrefix`` for ``job`` and return D's lease; :class:`HandoverFailed` when D
    refuses (``busy`` when for want of room). ``direct`` (D's reserved slots in the answer) when
    the channel writes into D's pools."""
    asked = time.monotonic()
    match = await channel.request(
        MatchPrefix(request_id=job.request_id, token_ids=job.token_ids, sampling=job.sampling, lease_s=lease_s,
                    direct=bool(channel.shared_pools)),
        left(),
    )
    query_seconds = time.monotonic() - asked
    if not isinstance(match, MatchResult):
        raise HandoverFailed(f"decode node answered {match.type!r} to a prefix query")
    if match.error is not None or match.lease_id is None:
        raise HandoverFailed(f"decode node {job.decode_node_id}: {match.error}", retryable=match.retryable,
                             busy=match.busy)
    return DecodeLease(lease_id=match.lease_id, hit_blocks=match.hit_blocks, decode_node_id=job.decode_node_id,
                       asked_at=asked, lease_s=lease_s, query_seconds=query_seconds, slots=match.slots)
