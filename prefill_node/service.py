"""The prefill node's work: for each job, ask D for prefix hits, prefill, send only missing KV."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

import kernels
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import TokenUpdate
from pd_cluster.engine.request import Request
from pd_cluster.engine.worker import EngineWorker
from pd_cluster.handover_messages import MatchPrefix, MatchResult, PushAck, PushKV, ReleaseLease
from pd_cluster.protocol import FirstToken, PrefillJob
from pd_cluster.transfer import ChannelPool, HandshakeRefused, PeerChannel, TransferError

logger = logging.getLogger(__name__)

FirstTokenSink = Callable[[FirstToken], Awaitable[None]]


class PrefillFailed(RuntimeError):
    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass
class PrefillResult:
    first: FirstToken
    hit_blocks: int
    transfer_bytes: int
    transfer_seconds: float
    committed: bool


@dataclass
class PrefillCounters:
    jobs: int = 0
    failed: int = 0
    kv_bytes_sent: int = 0
    queued_prefill_tokens: int = 0


class PrefillService:
    """A prefill engine on its own thread plus the pool of channels to decode nodes."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        node_id: str,
        cluster_token: str,
        lease_s: float = 30.0,
        max_channels: int = 8,
        engine: LLMEngine | None = None,
    ) -> None:
        self.engine = engine or LLMEngine(config)
        self.worker = EngineWorker(self.engine, self._on_updates)
        self.pool = ChannelPool(cluster_token, self.engine.kv_spec, node_id, self.engine.device, max_channels)
        self.lease_s = lease_s
        self.counters = PrefillCounters()
        self._first_tokens: dict[str, asyncio.Future[TokenUpdate]] = {}

    @property
    def block_size(self) -> int:
        return self.engine.kv_spec.block_size

    async def start(self) -> None:
        self.worker.start()

    async def stop(self) -> None:
        await self.pool.close()
        await self.worker.stop()

    def _on_updates(self, updates: list[TokenUpdate]) -> None:
        for update in updates:
            future = self._first_tokens.pop(update.request_id, None)
            if future is not None and not future.done():
                future.set_result(update)

    async def run_job(self, job: PrefillJob, report_first_token: FirstTokenSink) -> PrefillResult:
        """Prefill ``job`` and hand it to its decode node; raises PrefillFailed with a reason."""
        deadline = time.monotonic() + job.deadline_s

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PrefillFailed(f"prefill of {job.request_id} ran past its deadline")
            return remaining

        self.counters.jobs += 1
        self.counters.queued_prefill_tokens += len(job.token_ids)
        try:
            return await self._run(job, report_first_token, left)
        except PrefillFailed:
            self.counters.failed += 1
            raise
        except HandshakeRefused as e:
            self.counters.failed += 1
            raise PrefillFailed(f"decode node {job.decode_node_id} refused the data plane: {e}", retryable=False) from e
        except (TransferError, asyncio.TimeoutError) as e:
            self.counters.failed += 1
            raise PrefillFailed(f"lost decode node {job.decode_node_id}: {e or type(e).__name__}") from e
        finally:
            self.counters.queued_prefill_tokens -= len(job.token_ids)

    async def _run(self, job: PrefillJob, report_first_token: FirstTokenSink, left) -> PrefillResult:
        channel = await asyncio.wait_for(self.pool.get(job.decode_address), left())
        match = await channel.request(
            MatchPrefix(request_id=job.request_id, token_ids=job.token_ids, sampling=job.sampling, lease_s=self.lease_s),
            left(),
        )
        if not isinstance(match, MatchResult):
            raise PrefillFailed(f"decode node answered {match.type!r} to a prefix query")
        if match.error is not None or match.lease_id is None:
            raise PrefillFailed(f"decode node {job.decode_node_id}: {match.error}", retryable=match.retryable)
        lease_id = match.lease_id
        req: Request | None = None
        lease_settled = False
        try:
            req, first = await self._prefill(job, left)
            n = len(job.token_ids)
            n_blocks = math.ceil(n / self.block_size)
            send_blocks = n_blocks - match.hit_blocks
            finished = first.finish_reason is not None
            transfer_bytes = 0 if finished else send_blocks * self.engine.kv_spec.bytes_per_block
            report = FirstToken(
                request_id=job.request_id,
                token_id=first.token_id,
                text=first.text_delta,
                logprob=first.logprob,
                finish_reason=first.finish_reason,
                prompt_tokens=n,
                cached_tokens_prefill=req.num_cached_tokens,
                hit_blocks_decode=match.hit_blocks,
                transfer_bytes=transfer_bytes,
            )
            await report_first_token(report)  # TTFT does not wait for the transfer
            if finished:
                lease_settled = True
                await channel.request(ReleaseLease(lease_id=lease_id), left())
                return PrefillResult(report, match.hit_blocks, 0, 0.0, committed=False)
            started = time.monotonic()
            buffer = await self.worker.call(self._gather, req, match.hit_blocks, send_blocks)
            ack = await channel.request(
                PushKV(lease_id=lease_id, shape=list(buffer.shape), dtype=str(buffer.dtype).removeprefix("torch."),
                       first_token=first.token_id, rng_state=req.sampling.export_rng()),
                left(),
                tensors=buffer,
            )
            seconds = time.monotonic() - started
            if not isinstance(ack, PushAck) or not ack.ok:
                raise PrefillFailed(f"decode node {job.decode_node_id} did not take the KV: "
                                    f"{getattr(ack, 'error', ack.type)}")
            lease_settled = True
            self.counters.kv_bytes_sent += transfer_bytes
            return PrefillResult(report, match.hit_blocks, transfer_bytes, seconds, committed=True)
        finally:
            if req is not None:
                await self._release(req)
            else:
                await self._abort_engine(job.request_id)
            if not lease_settled and channel.alive:
                await self._release_lease(channel, lease_id)

    async def _prefill(self, job: PrefillJob, left) -> tuple[Request, TokenUpdate]:
        future: asyncio.Future[TokenUpdate] = asyncio.get_running_loop().create_future()
        self._first_tokens[job.request_id] = future
        try:
            req = await self.worker.call(
                lambda: self.engine.add_request(job.request_id, job.token_ids, job.sampling, hold_kv=True,
                                                prefill_only=True)
            )
        except ValueError as e:
            self._first_tokens.pop(job.request_id, None)
            raise PrefillFailed(str(e), retryable=False) from e
        try:
            first = await asyncio.wait_for(future, left())
        except BaseException:
            self._first_tokens.pop(job.request_id, None)
            await self._abort_engine(job.request_id)
            raise
        return req, first

    def _gather(self, req: Request, hit_blocks: int, send_blocks: int) -> torch.Tensor:
        """KV of blocks [hit_blocks, n_blocks) as ``[2, L, send_blocks*block, H, D]``, zero-padded."""
        bs = self.block_size
        n = len(req.prompt_token_ids)
        slots = self.engine.held_slots(req)[hit_blocks * bs : n].to(self.engine.device)
        pool = self.engine.pool
        buffer = kernels.gather_kv(pool.k_cache, pool.v_cache, slots)
        pad = send_blocks * bs - slots.numel()
        if pad:
            shape = list(buffer.shape)
            shape[2] = pad
            buffer = torch.cat((buffer, buffer.new_zeros(shape)), dim=2)
        return buffer.contiguous()

    async def _release(self, req: Request) -> None:
        try:
            await self.worker.call(self.engine.release, req)
        except Exception:
            logger.exception("releasing the KV of %s failed", req.request_id)

    async def _abort_engine(self, request_id: str) -> None:
        try:
            await self.worker.call(self.engine.abort, request_id)
        except Exception:
            logger.exception("aborting %s in the engine failed", request_id)

    async def _release_lease(self, channel: PeerChannel, lease_id: str) -> None:
        try:
            await channel.request(ReleaseLease(lease_id=lease_id), 5.0)
        except Exception as e:  # D frees it when the lease runs out anyway
            logger.info("could not release lease %s early: %s", lease_id, e)
