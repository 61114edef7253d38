"""What a prefill node's job asks of a path that moves a prompt's KV to D: :class:`KVSender`.

Every path is driven the same way (``prefill_node.service`` runs that one lifecycle):

1. :func:`~pd_cluster.handover.lease.reserve`: D pins its hit and leases slots for the rest;
   :func:`~pd_cluster.handover.choose.choose_sender` picks the path for the pair and the prompt.
2. :meth:`KVSender.begin` before the prefill; a sender with a :attr:`~KVSender.layer_sink` is
   fed each layer's KV as the forward stores it.
3. At the first token, :meth:`KVSender.commit` (move what is left, hand the request over) or
   :meth:`KVSender.release` (the request ended there).
4. Whatever happened, :meth:`KVSender.abandon` at once (what is still in flight stops: an open
   exchange on the channel), then :meth:`KVSender.close` once P's engine let go of the request
   (D's lease, if still held, is given back), so no KV slot outlives the job on either side.

A new way to move KV (a tensor-parallel re-shard, a quantized copy) is one more subclass.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pd_cluster.handover.errors import HandoverFailed
from pd_cluster.handover.lease import DecodeLease
from pd_cluster.handover.messages import PushAck, ReleaseLease
from pd_cluster.transfer import DataMessage, PeerChannel

logger = logging.getLogger(__name__)

#: Seconds left before the job's deadline (raises once it has passed).
Deadline = Callable[[], float]
#: Runs ``fn(slots)`` on P's engine thread and returns its result; ``slots`` are the KV slots
#: (CPU int64) of the prompt's computed tokens, held by P until the job ends.
WithHeldSlots = Callable[[Callable[[torch.Tensor], Any]], Awaitable[Any]]


@dataclass(frozen=True)
class Handed:
    """What moving (or giving up) one prompt's KV took."""

    #: KV bytes this path moved to D (counted in the node's bytes sent).
    bytes_sent: int
    #: Seconds of the move, as each path measures it (see ``PrefillResult.transfer_seconds``).
    seconds: float
    #: Seconds from the first token to the KV being in D's memory or sent (None: not measured).
    visible_seconds: float | None = None


class ChannelSource(Protocol):
    """Where a job finds its channel to a decode node, by the node's data-plane address: the
    pool that dials them, or loopback links (:mod:`.loopback`)."""

    async def get(self, address: str) -> PeerChannel: ...

    async def close(self) -> None: ...


class LayerSink(Protocol):
    """Takes a prompt's KV layer by layer on P's engine thread, as the forward stores it."""

    start: int
    n_tokens: int

    def begin(self, slots: torch.Tensor) -> None:
        """The step that completes the prompt is about to run; ``slots`` (a device view of its
        table row) hold tokens [start, n_tokens) once the step's inputs are written."""

    def capture(self, layer: int) -> None:
        """Layer ``layer``'s KV is stored (in stream order)."""


class KVSender(ABC):
    """One prompt's KV on its way to the decode node that leased slots for it, by one path."""

    #: Fed by the forward when the KV leaves layer by layer; then the prompt is prefilled in as
    #: few steps as the budget allows (graph-sized chunks would leave little compute to hide behind).
    layer_sink: LayerSink | None = None

    def __init__(self, channel: PeerChannel, lease: DecodeLease) -> None:
        self.channel = channel
        self.lease = lease
        #: D's lease was committed or given back: nothing is left to release.
        self.settled = False

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """KV bytes this path moves for the prompt (reported with the first token)."""

    async def begin(self, left: Deadline) -> None:
        """Before the prefill (nothing to do by default)."""

    @abstractmethod
    async def commit(self, first_token: int, with_held_slots: WithHeldSlots, left: Deadline) -> Handed:
        """After the first token: move what is still missing on D, then hand the request over."""

    async def release(self, left: Deadline) -> Handed:
        """The request ended at its first token: D's lease goes back, nothing moves."""
        self.settled = True
        await self.channel.request(ReleaseLease(lease_id=self.lease.lease_id), left())
        return Handed(bytes_sent=0, seconds=0.0)

    def abandon(self) -> None:
        """The job is ending: stop at once what is still in flight (nothing by default). It does
        not wait, so it runs even for a job cancelled again while it cleans up."""

    async def close(self) -> None:
        """After the job, whatever happened: a lease neither committed nor released goes back."""
        if not self.settled and self.channel.alive:
            await give_back(self.channel, self.lease.lease_id)

    def check_taken(self, reply: DataMessage) -> None:
        """Raise unless D acknowledged taking the KV."""
        if not isinstance(reply, PushAck) or not reply.ok:
            raise HandoverFailed(f"decode node {self.lease.decode_node_id} did not take the KV: "
                                 f"{getattr(reply, 'error', reply.type)}")


async def give_back(channel: PeerChannel, lease_id: str) -> None:
    """Release a lease early, quietly: D frees it when the lease runs out anyway."""
    try:
        await channel.request(ReleaseLease(lease_id=lease_id), 5.0)
    except Exception as e:
        logger.info("could not release lease %s early: %s", lease_id, e)
