"""The decode node's work: answer prefix queries, receive KV, decode, and emit tokens."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
import contextlib
from dataclasses import dataclass

import torch

import kernels
from pd_cluster.config import EngineConfig
from pd_cluster.engine.handover import Handover, NoCapacity
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import TokenUpdate
from pd_cluster.engine.worker import EngineWorker
from pd_cluster.handover_layers import CommitKV, StreamKV
from pd_cluster.handover_messages import MatchPrefix, MatchResult, PushAck, PushKV, Released, ReleaseLease
from pd_cluster.transfer import DataMessage, DataPlaneServer, ErrorReply, PeerConnection

logger = logging.getLogger(__name__)

TokenSink = Callable[[list[TokenUpdate]], None]


@dataclass
class DecodeCounters:
    kv_bytes_received: int = 0
    kv_transfers: int = 0
    hit_tokens: int = 0
    expired_leases: int = 0


class DecodeService:
    """A decode engine on its own thread plus the data-plane listener prefill nodes dial.

    The listener answers prefill nodes' channel warm-ups itself (:attr:`warmed_peers`); this
    service handles the handover messages."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        node_id: str,
        cluster_token: str,
        data_host: str = "127.0.0.1",
        data_port: int = 0,
        on_tokens: TokenSink,
        transfer_timeout_s: float = 60.0,
        engine: LLMEngine | None = None,
        kv_event_sink=None,
        warm_up: bool = True,
    ) -> None:
        self.engine = engine or LLMEngine(config, kv_event_sink=kv_event_sink)
        self.handover = Handover(self.engine)
        self.worker = EngineWorker(self.engine, on_tokens)
        self.worker.after_step.append(self._expire_leases)
        self.counters = DecodeCounters()
        self.transfer_timeout_s = transfer_timeout_s
        self.server = DataPlaneServer(
            data_host, data_port, cluster_token, self.engine.kv_spec, node_id, self.engine.device, self._handle
        )
        #: Leases whose KV is landing layer by layer; an abort waits for the last layer.
        self._streaming: set[str] = set()
        self._aborted_streams: set[str] = set()
        self._warm_up_engine = warm_up

    @property
    def data_address(self) -> str:
        return self.server.address

    @property
    def warmed_peers(self) -> list[str]:
        """Prefill nodes with a live channel to this node that they warmed."""
        return self.server.warmed_peers

    async def start(self) -> None:
        """Warm the engine up (a tiny prefill and decode steps: kernels compile now, not on the
        first request), then listen for prefill nodes."""
        self.worker.start()
        if self.engine.device.type == "cuda":
            await self.worker.call(torch.cuda.set_device, self.engine.device)
        if self._warm_up_engine:
            await self.worker.call(self.engine.warm_up, 16, 2, timeout=600.0)
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()
        await self.worker.stop()

    def _expire_leases(self) -> None:
        if self.handover.reservations:
            self.counters.expired_leases += len(self.handover.expire())

    async def abort(self, request_id: str) -> bool:
        """Stop a request (client gone): free its KV whether it is decoding or still reserved."""

        def _abort() -> bool:
            for res in list(self.handover.reservations.values()):
                if res.request_id == request_id:
                    if res.lease_id in self._streaming:
                        # Its slots are being written from the loop: freed after the last layer.
                        self._aborted_streams.add(res.lease_id)
                        return True
                    return self.handover.cancel(res.lease_id)
            return self.engine.abort(request_id)

        return await self.worker.call(_abort)

    # ---- data plane ------------------------------------------------------------------------

    async def _handle(self, conn: PeerConnection, msg: DataMessage) -> DataMessage | None:
        if isinstance(msg, MatchPrefix):
            return await self._match(msg)
        if isinstance(msg, PushKV):
            return await self._push(conn, msg)
        if isinstance(msg, StreamKV):
            return await self._stream(conn, msg)
        if isinstance(msg, CommitKV):
            return await self._commit_stream(msg)
        if isinstance(msg, ReleaseLease):
            return Released(existed=await self.worker.call(self.handover.cancel, msg.lease_id))
        return ErrorReply(message=f"unexpected message {msg.type!r}")

    async def _match(self, msg: MatchPrefix) -> MatchResult:
        try:
            res = await self.worker.call(
                self.handover.reserve, msg.request_id, msg.token_ids, msg.sampling, msg.lease_s
            )
        except NoCapacity as e:
            return MatchResult(error=str(e), retryable=True)
        except ValueError as e:
            return MatchResult(error=str(e), retryable=False)
        self.counters.hit_tokens += res.hit_tokens
        return MatchResult(lease_id=res.lease_id, hit_blocks=res.hit_tokens // self.handover.block_size)

    async def _push(self, conn: PeerConnection, msg: PushKV) -> PushAck:
        deadline = time.monotonic() + self.transfer_timeout_s

        def _extend() -> int | None:
            res = self.handover.reservations.get(msg.lease_id)
            if res is None:
                return None
            res.expires_at = max(res.expires_at, deadline)  # no expiry while the bytes arrive
            return res.held

        held = await self.worker.call(_extend)
        # Receive even when the lease is gone: the tensor is on the wire and must be drained.
        buffer = await conn.recv_tensor(msg.shape, msg.dtype, max(deadline - time.monotonic(), 0.1))
        self.counters.kv_bytes_received += buffer.numel() * buffer.element_size()
        if held is None:
            return PushAck(ok=False, error=f"lease {msg.lease_id} expired before the KV arrived")
        if msg.shape[2] < held:
            await self.worker.call(self.handover.cancel, msg.lease_id)
            return PushAck(ok=False, error=f"KV for {msg.shape[2]} tokens cannot fill {held} reserved slots")

        def _commit() -> None:
            res = self.handover.reservations.get(msg.lease_id)
            if res is None:
                raise KeyError(f"lease {msg.lease_id} expired")
            if held:
                kernels.scatter_kv(buffer[:, :, :held], self.engine.pool.k_cache, self.engine.pool.v_cache,
                                   res.new_slots.to(self.engine.device))
            self.handover.commit(msg.lease_id, msg.first_token, msg.rng_state)

        try:
            await self.worker.call(_commit)
        except (KeyError, NoCapacity, ValueError) as e:
            return PushAck(ok=False, error=str(e))
        self.counters.kv_transfers += 1
        return PushAck(ok=True)

    # ---- layer-wise handover -----------------------------------------------------------------

    def _on_device(self) -> contextlib.AbstractContextManager:
        device = self.engine.device
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    async def _stream(self, conn: PeerConnection, msg: StreamKV) -> PushAck:
        """Receive one tensor per layer and scatter each into the reserved slots as it lands."""
        deadline = time.monotonic() + self.transfer_timeout_s
        spec = self.engine.kv_spec
        tokens = msg.layer_shape[1]
        expected = [2, tokens, spec.num_kv_heads, spec.head_dim]
        if msg.num_layers != spec.num_layers or msg.layer_shape != expected or msg.dtype != spec.dtype:
            raise ValueError(f"KV stream of {msg.num_layers} x {msg.layer_shape} {msg.dtype} does not fit "
                             f"{spec.num_layers} x {expected} {spec.dtype}")

        def _extend() -> torch.Tensor | None:
            res = self.handover.reservations.get(msg.lease_id)
            if res is None:
                return None
            res.expires_at = max(res.expires_at, deadline)  # no expiry while the bytes arrive
            self._streaming.add(msg.lease_id)
            return res.new_slots

        new_slots = await self.worker.call(_extend)
        held = 0 if new_slots is None else new_slots.numel()
        scatter = new_slots is not None and 0 < held <= tokens
        pool = self.engine.pool
        try:
            # Receive even when the lease is gone: the tensors are on the wire and must be drained.
            with self._on_device():
                buffer = torch.empty(expected, dtype=pool.k_cache.dtype, device=pool.device)
                slots = new_slots.to(pool.device) if scatter else None
            for layer in range(spec.num_layers):
                # One buffer serves every layer: the next receive is ordered after this scatter.
                await conn.recv_into(buffer, max(deadline - time.monotonic(), 0.1))
                self.counters.kv_bytes_received += buffer.numel() * buffer.element_size()
                if slots is not None:
                    with self._on_device():
                        kernels.scatter_kv(buffer[:, :held].unsqueeze(1), pool.k_cache[layer : layer + 1],
                                           pool.v_cache[layer : layer + 1], slots)
        finally:
            self._streaming.discard(msg.lease_id)
            if msg.lease_id in self._aborted_streams:
                self._aborted_streams.discard(msg.lease_id)
                await self.worker.call(self.handover.cancel, msg.lease_id)
        if new_slots is None or msg.lease_id not in self.handover.reservations:
            return PushAck(ok=False, error=f"lease {msg.lease_id} expired or was aborted before the KV arrived")
        if tokens < held:
            await self.worker.call(self.handover.cancel, msg.lease_id)
            return PushAck(ok=False, error=f"KV for {tokens} tokens cannot fill {held} reserved slots")
        return PushAck(ok=True)

    async def _commit_stream(self, msg: CommitKV) -> PushAck:
        try:
            await self.worker.call(self.handover.commit, msg.lease_id, msg.first_token, msg.rng_state)
        except (KeyError, NoCapacity, ValueError) as e:
            return PushAck(ok=False, error=str(e))
        self.counters.kv_transfers += 1
        return PushAck(ok=True)
