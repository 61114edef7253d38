"""D's side of the KV move: answer P's handover messages (:mod:`.messages`).

``MatchPrefix`` reserves slots (:mod:`.reservations`); the KV then lands whole (``PushKV``) or
layer by layer (``StreamKV`` then ``CommitKV``) and is scattered into the reserved slots, or a P
on this host that was handed the pool writes it in place and sends ``CommitKV`` alone; the commit
joins the request to the decode batch. Leases of a P that disconnects end after a short grace
(its writes in flight die with its process). P's side: one sender per path (:mod:`.sender`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import torch

import kernels
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.worker import EngineWorker
from pd_cluster.handover.messages import (
    CommitKV,
    MatchPrefix,
    MatchResult,
    PushAck,
    PushKV,
    Released,
    ReleaseLease,
    StreamKV,
)
from pd_cluster.handover.reservations import NoCapacity, Reservation, Reservations
from pd_cluster.transfer import DataMessage, ErrorReply, PeerConnection, encode_slots

logger = logging.getLogger(__name__)

#: Seconds a disconnected P's leases live on: long enough for its process (and any write it
#: had queued on a shared GPU) to be gone before the slots can be handed out again.
DISCONNECT_GRACE_S = 2.0


@dataclass(slots=True)
class DecodeCounters:
    """What a decode node's receiver counted since it started (its status and metrics)."""

    #: KV bytes that reached this node's pool, sent or written in place.
    kv_bytes_received: int = 0
    #: Handovers committed.
    kv_transfers: int = 0
    #: Prompt tokens found in the prefix cache at the prefix query.
    hit_tokens: int = 0
    expired_leases: int = 0


class KVReceiver:
    """Receives prompts' KV from prefill nodes into one decode engine's reserved slots."""

    def __init__(
        self, engine: LLMEngine, worker: EngineWorker, reservations: Reservations, counters: DecodeCounters,
        transfer_timeout_s: float,
    ) -> None:
        self.engine = engine
        self.worker = worker
        self.reservations = reservations
        self.counters = counters
        self.transfer_timeout_s = transfer_timeout_s
        #: Leases whose KV is landing layer by layer; an abort waits for the last layer.
        self._streaming: set[str] = set()
        self._aborted_streams: set[str] = set()
        #: Lease id -> the connection that took it (leases end with their P's connection).
        self._owners: dict[str, PeerConnection] = {}
        #: Leases whose KV the owner writes into the pool in place.
        self._direct: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    async def handle(self, conn: PeerConnection, msg: DataMessage) -> DataMessage | None:
        if isinstance(msg, MatchPrefix):
            return await self.match(conn, msg)
        if isinstance(msg, PushKV):
            return await self.push(conn, msg)
        if isinstance(msg, StreamKV):
            return await self.stream(conn, msg)
        if isinstance(msg, CommitKV):
            return await self.commit(msg)
        if isinstance(msg, ReleaseLease):
            return Released(existed=await self.worker.call(self.reservations.cancel, msg.lease_id))
        return ErrorReply(message=f"unexpected message {msg.type!r}")

    def abort_reserved(self, request_id: str) -> bool | None:
        """Engine thread: free a request still reserved (not yet committed); None if it is not."""
        for res in list(self.reservations.pending.values()):
            if res.request_id == request_id:
                if res.lease_id in self._streaming:
                    # Its slots are being written from the loop: freed after the last layer.
                    self._aborted_streams.add(res.lease_id)
                    return True
                return self.reservations.cancel(res.lease_id)
        return None

    async def match(self, conn: PeerConnection, msg: MatchPrefix) -> MatchResult:
        if msg.direct and not conn.shares_kv:
            return MatchResult(error="this connection was not handed the KV pool", retryable=False)
        try:
            res = await self.worker.call(
                self.reservations.reserve, msg.request_id, msg.token_ids, msg.sampling, msg.lease_s
            )
        except NoCapacity as e:
            return MatchResult(error=str(e), retryable=True, busy=True)
        except ValueError as e:
            return MatchResult(error=str(e), retryable=False)
        self.counters.hit_tokens += res.hit_tokens
        self._forget_settled()
        self._owners[res.lease_id] = conn
        slots = None
        if msg.direct:
            self._direct.add(res.lease_id)
            slots = encode_slots(res.new_slots)
        return MatchResult(lease_id=res.lease_id, hit_blocks=res.hit_tokens // self.reservations.block_size, slots=slots)

    def _forget_settled(self) -> None:
        """Drop ownership records of leases that were committed, cancelled or expired."""
        if len(self._owners) > 2 * len(self.reservations.pending) + 64:
            for lease_id in [k for k in self._owners if k not in self.reservations.pending]:
                self._owners.pop(lease_id, None)
                self._direct.discard(lease_id)

    def peer_gone(self, conn: PeerConnection) -> None:
        """A P's connection ended: its leases end after :data:`DISCONNECT_GRACE_S`."""
        leases = [lease for lease, owner in self._owners.items() if owner is conn]
        for lease in leases:
            self._owners.pop(lease, None)
        if not leases:
            return

        def shorten() -> int:
            until = time.monotonic() + DISCONNECT_GRACE_S
            shortened = 0
            for lease in leases:
                res = self.reservations.pending.get(lease)
                if res is not None and res.expires_at > until:
                    res.expires_at = until
                    shortened += 1
            return shortened

        async def run() -> None:
            try:
                n = await self.worker.call(shorten)
            except Exception as e:  # the engine is stopping
                logger.debug("could not shorten leases of %r: %s", conn.peer_node_id, e)
                return
            if n:
                logger.warning("prefill node %r disconnected holding %d lease(s); they end in %.0f s",
                               conn.peer_node_id, n, DISCONNECT_GRACE_S)

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _hold(self, lease_id: str, until: float, streaming: bool) -> Reservation | None:
        """Engine thread: keep a lease alive while its KV arrives (None: it is gone); ``streaming``:
        an abort meanwhile waits for the last layer."""
        res = self.reservations.pending.get(lease_id)
        if res is None:
            return None
        res.expires_at = max(res.expires_at, until)  # no expiry while the bytes arrive
        if streaming:
            self._streaming.add(lease_id)
        return res

    # ---- whole push --------------------------------------------------------------------------

    async def push(self, conn: PeerConnection, msg: PushKV) -> PushAck:
        deadline = time.monotonic() + self.transfer_timeout_s
        res = await self.worker.call(self._hold, msg.lease_id, deadline, False)
        held = None if res is None else res.held
        # Receive even when the lease is gone: the tensor is on the wire and must be drained.
        buffer = await conn.recv_tensor(msg.shape, msg.dtype, max(deadline - time.monotonic(), 0.1))
        self.counters.kv_bytes_received += buffer.numel() * buffer.element_size()
        if held is None:
            return PushAck(ok=False, error=f"lease {msg.lease_id} expired before the KV arrived")
        pool = self.engine.pool
        if buffer.dtype != pool.k_cache.dtype or msg.shape[-1] != pool.spec.row_width:
            await self.worker.call(self.reservations.cancel, msg.lease_id)
            return PushAck(ok=False, error=f"KV rows of {msg.shape[-1]} {msg.dtype} do not fit this node's "
                                           f"{self.engine.kv_spec.kv_dtype} cache")
        if msg.shape[2] < held:
            await self.worker.call(self.reservations.cancel, msg.lease_id)
            return PushAck(ok=False, error=f"KV for {msg.shape[2]} tokens cannot fill {held} reserved slots")

        def _commit() -> None:
            res = self.reservations.pending.get(msg.lease_id)
            if res is None:
                raise KeyError(f"lease {msg.lease_id} expired")
            if held:
                self.engine.node_kv.scatter(buffer[:, :, :held], res.new_slots.to(self.engine.device))
            self.reservations.commit(msg.lease_id, msg.first_token)

        try:
            await self.worker.call(_commit)
        except (KeyError, NoCapacity, ValueError) as e:
            return PushAck(ok=False, error=str(e))
        self.counters.kv_transfers += 1
        return PushAck(ok=True)

    # ---- layer-wise stream -------------------------------------------------------------------

    def _on_device(self) -> contextlib.AbstractContextManager:
        device = self.engine.device
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    async def stream(self, conn: PeerConnection, msg: StreamKV) -> PushAck:
        """Receive one tensor per group of layers and scatter each into the reserved slots as it
        lands; a tensor-parallel node (whose pools hold part of the heads each) keeps them all
        and scatters them to its ranks at once after the last, on the engine thread."""
        deadline = time.monotonic() + self.transfer_timeout_s
        spec = self.engine.kv_spec
        tokens = msg.layer_shape[1]
        expected = [2, tokens, spec.num_kv_heads, spec.row_width]
        if msg.num_layers != spec.num_layers or msg.layer_shape != expected or msg.dtype != spec.dtype:
            raise ValueError(f"KV stream of {msg.num_layers} x {msg.layer_shape} {msg.dtype} does not fit "
                             f"{spec.num_layers} x {expected} {spec.dtype}")

        res = await self.worker.call(self._hold, msg.lease_id, deadline, True)
        new_slots = None if res is None else res.new_slots
        held = 0 if new_slots is None else new_slots.numel()
        scatter = new_slots is not None and 0 < held <= tokens
        pool = self.engine.pool
        whole = self.engine.node_kv.whole
        group = min(msg.layers_per_send, spec.num_layers)
        try:
            # Receive even when the lease is gone: the tensors are on the wire and must be drained.
            with self._on_device():
                buffer = torch.empty([group if whole else spec.num_layers, *expected], dtype=pool.k_cache.dtype,
                                     device=pool.device)
                slots = new_slots.to(pool.device) if scatter else None
            for first in range(0, spec.num_layers, group):
                last = min(first + group, spec.num_layers)
                part = buffer[: last - first] if whole else buffer[first:last]
                # One buffer serves every group: the next receive is ordered after this scatter.
                await conn.recv_into(part, max(deadline - time.monotonic(), 0.1))
                self.counters.kv_bytes_received += part.numel() * part.element_size()
                if slots is not None and whole:
                    with self._on_device():
                        kernels.scatter_kv(part[:, :, :held].transpose(0, 1), pool.k_cache[first:last],
                                           pool.v_cache[first:last], slots)
            if slots is not None and not whole:
                await self.worker.call(self._scatter_held, msg.lease_id, buffer[:, :, :held].transpose(0, 1), slots)
        finally:
            self._streaming.discard(msg.lease_id)
            if msg.lease_id in self._aborted_streams:
                self._aborted_streams.discard(msg.lease_id)
                await self.worker.call(self.reservations.cancel, msg.lease_id)
        if new_slots is None or msg.lease_id not in self.reservations.pending:
            return PushAck(ok=False, error=f"lease {msg.lease_id} expired or was aborted before the KV arrived")
        if tokens < held:
            await self.worker.call(self.reservations.cancel, msg.lease_id)
            return PushAck(ok=False, error=f"KV for {tokens} tokens cannot fill {held} reserved slots")
        return PushAck(ok=True)

    def _scatter_held(self, lease_id: str, buffer: torch.Tensor, slots: torch.Tensor) -> None:
        """Engine thread: every head of ``buffer`` into the slots of a lease still held (on every rank)."""
        if lease_id in self.reservations.pending and lease_id not in self._aborted_streams:
            self.engine.node_kv.scatter(buffer, slots)

    async def commit(self, msg: CommitKV) -> PushAck:
        direct = msg.lease_id in self._direct
        if direct != (msg.written_tokens is not None):
            return PushAck(ok=False, error=f"lease {msg.lease_id}: a commit {'without' if direct else 'with'} "
                                           "written_tokens does not fit how its KV moves")

        def _commit() -> int:
            res = self.reservations.pending.get(msg.lease_id)
            held = res.held if res is not None else 0
            if direct and res is not None and msg.written_tokens != held:
                self.reservations.cancel(msg.lease_id)
                raise ValueError(f"{msg.written_tokens} tokens written into {held} reserved slots")
            self.reservations.commit(msg.lease_id, msg.first_token)
            return held

        try:
            held = await self.worker.call(_commit)
        except (KeyError, NoCapacity, ValueError) as e:
            return PushAck(ok=False, error=str(e))
        finally:
            self._direct.discard(msg.lease_id)
            self._owners.pop(msg.lease_id, None)
        if direct:
            self.counters.kv_bytes_received += held * self.engine.kv_spec.bytes_per_token
        self.counters.kv_transfers += 1
        return PushAck(ok=True)
