"""The prefill node's work: for each job, ask D for prefix hits, prefill, send only missing KV."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

import kernels
from pd_cluster.aio import wait_for
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import TokenUpdate
from pd_cluster.engine.request import Request
from pd_cluster.engine.scheduler import ScheduledStep
from pd_cluster.engine.worker import EngineWorker
from pd_cluster.handover import CommitKV, MatchPrefix, MatchResult, PushAck, PushKV, Released, ReleaseLease, StreamKV
from pd_cluster.model.llama import LayerHook
from pd_cluster.protocol import FirstToken, PrefillJob
from pd_cluster.transfer import ChannelKeeper, ChannelPool, HandshakeRefused, PeerChannel, TransferError, decode_slots
from prefill_node.admission import TokenAdmission
from prefill_node.layer_stream import DirectWrite, LayerStream

logger = logging.getLogger(__name__)

FirstTokenSink = Callable[[FirstToken], Awaitable[None]]
#: A direct write stops being queued this long before D's lease on the slots ends.
LEASE_MARGIN_S = 5.0
#: Longest wait for queued direct writes to land (they take milliseconds).
SETTLE_S = 10.0


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
    #: Seconds from the first token to the KV being in D's memory (in place) or sent (layer-wise):
    #: the transfer time not hidden behind the prefill; None for a whole push.
    visible_seconds: float | None = None


@dataclass
class PrefillCounters:
    jobs: int = 0
    failed: int = 0
    kv_bytes_sent: int = 0
    queued_prefill_tokens: int = 0


class PrefillService:
    """A prefill engine on its own thread plus the pool of channels to decode nodes.

    :meth:`start` warms the engine up (kernels compiled before the node joins) and starts the
    :class:`ChannelKeeper`, which forms and warms channels to the decode nodes that
    :meth:`set_decode_peers` lists (the master's ``DecodePeers``), so a request finds its channel
    ready; ``on_warm_change`` hears of every change of :attr:`warm_peers`.

    A decode node on this host may share its KV pool (``kv_ipc``, :mod:`pd_cluster.transfer.ipc`):
    then the missing KV is written straight into its reserved slots (:class:`DirectWrite`),
    layer by layer during the prefill from ``direct_layerwise_min_tokens`` missing tokens on,
    else in one launch after it, and nothing goes through the tensor channel.

    ``layerwise`` (default: on CUDA devices) streams each layer's KV to D while the prefill
    forward runs (``StreamKV`` of :mod:`pd_cluster.handover`, sent by :mod:`prefill_node.layer_stream`);
    otherwise the whole KV goes in one push after the first token. On a GPU the engine thread computes on its own stream, so that
    what the event loop queues for the network never waits behind later layers.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        node_id: str,
        cluster_token: str,
        lease_s: float = 30.0,
        max_channels: int = 8,
        engine: LLMEngine | None = None,
        layerwise: bool | None = None,
        layerwise_min_tokens: int = 8192,
        on_warm_change: Callable[[list[str]], None] | None = None,
        warm_up: bool = True,
        admission_tokens: int | None = None,
        kv_ipc: bool = True,
        direct_layerwise_min_tokens: int = 2048,
        layers_per_send: int = 4,
    ) -> None:
        self.engine = engine or LLMEngine(config)
        self.worker = EngineWorker(self.engine, self._on_updates)
        self.pool = ChannelPool(cluster_token, self.engine.kv_spec, node_id, self.engine.device, max_channels,
                                kv_ipc=kv_ipc)
        #: Decode address -> jobs in flight to it (the keeper never closes those channels).
        self._jobs_per_address: Counter[str] = Counter()
        self.keeper = ChannelKeeper(self.pool, on_change=on_warm_change,
                                    in_use=lambda address: self._jobs_per_address[address] > 0)
        self._warm_up_engine = warm_up
        # Jobs lease KV on D only once admitted: see prefill_node.admission.
        self.admission = TokenAdmission(admission_tokens or 2 * self.engine.config.max_num_batched_tokens)
        self.lease_s = lease_s
        self.counters = PrefillCounters()
        self._first_tokens: dict[str, asyncio.Future[TokenUpdate]] = {}
        #: When each job in flight was taken (monotonic), for the node's share of its TTFT.
        self._received: dict[str, float] = {}
        #: Parts of that share, per job in flight: the prefix query's seconds, and when the prompt
        #: was queued on the engine (monotonic).
        self._query_s: dict[str, float] = {}
        self._queued: dict[str, float] = {}
        on_gpu = self.engine.device.type == "cuda"
        self.layerwise = on_gpu if layerwise is None else layerwise
        # Over NCCL the layer groups' sends do not yet run beside the prefill (two H200s, 4k
        # tokens: 4.6 ms of sending left after the first token for a 3.7 ms transfer; commit
        # 9.0 ms after the first token layer-wise, 6.5 ms whole; at 1k whole wins too): one push
        # after the prefill unless the prompt is long.
        self.layerwise_min_tokens = layerwise_min_tokens
        # In place on one GPU (H100, 8B shape): layer by layer hides the write (0.04 ms of 0.45 ms
        # left after the first token at 4k) but its per-layer launches cost the first token ~6 ms
        # at 1k, where the whole write after the prefill costs 0.9 ms: whole below ~2k tokens.
        self.direct_layerwise_min_tokens = direct_layerwise_min_tokens
        # Layer-wise over the network, layers go in groups: a send per group, not per layer.
        self.layers_per_send = layers_per_send
        self._compute_stream = torch.cuda.Stream(self.engine.device) if on_gpu else None
        # KV copies out of the pool run at high priority: queued behind a long prefill's kernels
        # at equal priority, they (and the sends that wait for them) would start only at its end.
        self._side_stream = torch.cuda.Stream(self.engine.device, priority=-1) if on_gpu else None
        self._streams: dict[str, LayerStream | DirectWrite] = {}
        self._held: dict[str, Request] = {}
        self.engine.set_layer_hook_factory(self._layer_hook_for)

    @property
    def block_size(self) -> int:
        return self.engine.kv_spec.block_size

    async def start(self) -> None:
        self.worker.start()
        if self._compute_stream is not None:
            await self.worker.call(self._adopt_device)
        if self._warm_up_engine:
            await self.worker.call(self.engine.warm_up, 16, 0, timeout=600.0)
        self.keeper.start()

    def _adopt_device(self) -> None:
        """Engine thread: its device, and a compute stream of its own."""
        torch.cuda.set_device(self.engine.device)
        torch.cuda.set_stream(self._compute_stream)

    async def stop(self) -> None:
        await self.keeper.close()
        await self.pool.close()
        await self.worker.stop()

    def set_decode_peers(self, peers: dict[str, str]) -> None:
        """The decode nodes that take work now (node id -> data address): keep their channels warm."""
        self.keeper.set_peers(peers)

    @property
    def warm_peers(self) -> list[str]:
        """Listed decode nodes this node holds a live, warmed channel to."""
        return self.keeper.warm_peers

    def _on_updates(self, updates: list[TokenUpdate]) -> None:
        for update in updates:
            future = self._first_tokens.pop(update.request_id, None)
            if future is not None and not future.done():
                future.set_result(update)

    async def run_job(self, job: PrefillJob, report_first_token: FirstTokenSink) -> PrefillResult:
        """Prefill ``job`` and hand it to its decode node; raises PrefillFailed with a reason."""
        received = time.monotonic()
        deadline = received + job.deadline_s

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PrefillFailed(f"prefill of {job.request_id} ran past its deadline")
            return remaining

        self.counters.jobs += 1
        self.counters.queued_prefill_tokens += len(job.token_ids)
        self._received[job.request_id] = received
        self._jobs_per_address[job.decode_address] += 1
        try:
            try:
                held = await wait_for(self.admission.acquire(len(job.token_ids)), left())
            except asyncio.TimeoutError:
                raise PrefillFailed(f"prefill of {job.request_id} waited past its deadline for admission") from None
            try:
                return await self._run(job, report_first_token, left)
            finally:
                self.admission.release(held)
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
            self._received.pop(job.request_id, None)
            self._query_s.pop(job.request_id, None)
            self._queued.pop(job.request_id, None)
            self.counters.queued_prefill_tokens -= len(job.token_ids)
            self._jobs_per_address[job.decode_address] -= 1
            if self._jobs_per_address[job.decode_address] <= 0:
                del self._jobs_per_address[job.decode_address]

    async def _run(self, job: PrefillJob, report_first_token: FirstTokenSink, left) -> PrefillResult:
        channel = await wait_for(self.pool.get(job.decode_address), left())
        direct = channel.shared_pool is not None
        asked = time.monotonic()
        write_until = asked + self.lease_s - LEASE_MARGIN_S
        match = await channel.request(
            MatchPrefix(request_id=job.request_id, token_ids=job.token_ids, sampling=job.sampling, lease_s=self.lease_s,
                        direct=direct),
            left(),
        )
        self._query_s[job.request_id] = time.monotonic() - asked
        if not isinstance(match, MatchResult):
            raise PrefillFailed(f"decode node answered {match.type!r} to a prefix query")
        if match.error is not None or match.lease_id is None:
            raise PrefillFailed(f"decode node {job.decode_node_id}: {match.error}", retryable=match.retryable)
        lease_id = match.lease_id
        if direct:
            return await self._run_direct(job, channel, match, report_first_token, left, write_until)
        n = len(job.token_ids)
        send_blocks = math.ceil(n / self.block_size) - match.hit_blocks
        req: Request | None = None
        stream: LayerStream | None = None
        lease_settled = False
        try:
            if self.layerwise and send_blocks > 0 and send_blocks * self.block_size >= self.layerwise_min_tokens:
                stream = LayerStream(
                    job.request_id, match.hit_blocks * self.block_size, n, send_blocks * self.block_size,
                    self.engine.pool, asyncio.get_running_loop(), self._side_stream, self.layers_per_send,
                )
                result = await self._run_streaming(job, channel, match, stream, report_first_token, left)
                lease_settled = True
                return result
            req = await self._add(job)
            first = await self._first_token(job, left)
            finished = first.finish_reason is not None
            transfer_bytes = 0 if finished else send_blocks * self.engine.kv_spec.bytes_per_block
            report = self._report(job, req, first, match.hit_blocks, transfer_bytes)
            await report_first_token(report)  # TTFT does not wait for the transfer
            if finished:
                lease_settled = True
                await channel.request(ReleaseLease(lease_id=lease_id), left())
                return PrefillResult(report, match.hit_blocks, 0, 0.0, committed=False)
            started = time.monotonic()
            buffer, ready = await self.worker.call(self._gather, req, match.hit_blocks, send_blocks)
            if ready is not None:
                torch.cuda.current_stream(self.engine.device).wait_event(ready)
            ack = await channel.request(
                PushKV(lease_id=lease_id, shape=list(buffer.shape), dtype=str(buffer.dtype).removeprefix("torch."),
                       first_token=first.token_id),
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
            if stream is not None:
                self._streams.pop(job.request_id, None)
                req = self._held.pop(job.request_id, None)
            if req is not None:
                await self._release(req)
            else:
                await self._abort_engine(job.request_id)
            if not lease_settled and channel.alive:
                await self._release_lease(channel, lease_id)

    async def _run_streaming(
        self, job: PrefillJob, channel: PeerChannel, match: MatchResult, stream: LayerStream,
        report_first_token: FirstTokenSink, left,
    ) -> PrefillResult:
        """One exchange on the channel: announce, stream layers as they compute, commit."""
        lease_id = match.lease_id
        assert lease_id is not None
        try:
            await wait_for(channel.exclusive().acquire(), left())
        except asyncio.TimeoutError:
            raise PrefillFailed(f"channel to {job.decode_node_id} stayed busy") from None
        sender: asyncio.Future[int] | None = None
        try:
            await channel.send(StreamKV(lease_id=lease_id, num_layers=stream.num_layers,
                                        layers_per_send=stream.layers_per_send,
                                        layer_shape=stream.layer_shape, dtype=stream.dtype), left())
            self._streams[job.request_id] = stream
            req = await self._add(job, whole=True)
            self._held[job.request_id] = req
            sender = asyncio.ensure_future(stream.send(channel, left))
            first = await self._first_token(job, left)
            finished = first.finish_reason is not None
            report = self._report(job, req, first, match.hit_blocks, 0 if finished else stream.nbytes)
            await report_first_token(report)  # TTFT does not wait for the transfer
            reported = time.monotonic()
            sent = await sender
            visible = time.monotonic() - reported
            if finished:
                await channel.send(ReleaseLease(lease_id=lease_id), left())
            else:
                await channel.send(CommitKV(lease_id=lease_id, first_token=first.token_id), left())
            stream_ack = await channel.receive(left())
            final = await channel.receive(left())
        except BaseException:
            # Half an exchange leaves the two ends out of step: never reuse the channel.
            if sender is not None and not sender.done():
                sender.cancel()
            channel.close()
            raise
        finally:
            channel.exclusive().release()
        seconds = time.monotonic() - (stream.first_layer_at or time.monotonic())
        for reply in (stream_ack, final):
            if isinstance(reply, Released):
                continue
            if not isinstance(reply, PushAck) or not reply.ok:
                raise PrefillFailed(f"decode node {job.decode_node_id} did not take the KV: "
                                    f"{getattr(reply, 'error', reply.type)}")
        if sent != stream.nbytes:
            raise PrefillFailed(f"sent {sent} KV bytes of {stream.nbytes}", retryable=False)
        self.counters.kv_bytes_sent += sent
        if finished:
            return PrefillResult(report, match.hit_blocks, 0, seconds, committed=False)
        return PrefillResult(report, match.hit_blocks, sent, seconds, committed=True, visible_seconds=visible)

    async def _run_direct(
        self, job: PrefillJob, channel: PeerChannel, match: MatchResult, report_first_token: FirstTokenSink, left,
        write_until: float,
    ) -> PrefillResult:
        """D shares its pool: write the missing KV into its reserved slots, then commit."""
        lease_id = match.lease_id
        assert lease_id is not None
        if match.slots is None:
            await self._release_lease(channel, lease_id)
            raise PrefillFailed(f"decode node {job.decode_node_id} reserved no slots for an in-place write")
        pool = self.engine.pool
        assert channel.shared_pool is not None
        start = match.hit_blocks * self.block_size
        n = len(job.token_ids)
        try:
            writer = DirectWrite(job.request_id, start, n, pool, channel.shared_pool,
                                 decode_slots(match.slots).to(channel.shared_pool.device), self._side_stream, write_until)
        except ValueError as e:
            await self._release_lease(channel, lease_id)
            raise PrefillFailed(f"decode node {job.decode_node_id}: {e}", retryable=False) from e
        layerwise = self._compute_stream is not None and writer.tokens >= self.direct_layerwise_min_tokens
        if layerwise and writer.tokens:
            self._streams[job.request_id] = writer
        req: Request | None = None
        lease_settled = False
        try:
            req = await self._add(job, whole=job.request_id in self._streams)
            first = await self._first_token(job, left)
            finished = first.finish_reason is not None
            report = self._report(job, req, first, match.hit_blocks, 0 if finished else writer.nbytes)
            await report_first_token(report)  # TTFT does not wait for the write
            if finished:
                lease_settled = True
                await channel.request(ReleaseLease(lease_id=lease_id), left())
                return PrefillResult(report, match.hit_blocks, 0, 0.0, committed=False)
            started = time.monotonic()
            if not layerwise and writer.tokens:
                await self.worker.call(self._write_whole, req, writer)
            elif not writer.tokens:
                writer.layers_written = writer.num_layers
            if not await writer.settle(left()):
                raise PrefillFailed(f"the KV write into {job.decode_node_id} did not finish in time")
            visible = time.monotonic() - started
            if not writer.complete:
                raise PrefillFailed(f"the KV lease on {job.decode_node_id} ran short before the write")
            ack = await channel.request(
                CommitKV(lease_id=lease_id, first_token=first.token_id, written_tokens=writer.tokens),
                left(),
            )
            seconds = time.monotonic() - started
            if not isinstance(ack, PushAck) or not ack.ok:
                raise PrefillFailed(f"decode node {job.decode_node_id} did not take the KV: "
                                    f"{getattr(ack, 'error', ack.type)}")
            lease_settled = True
            channel.bytes_written += writer.nbytes
            self.counters.kv_bytes_sent += writer.nbytes
            return PrefillResult(report, match.hit_blocks, writer.nbytes, seconds, committed=True, visible_seconds=visible)
        finally:
            self._streams.pop(job.request_id, None)
            self._held.pop(job.request_id, None)
            if req is not None:
                await self._release(req)
            else:
                await self._abort_engine(job.request_id)
            if not lease_settled:
                # Nothing may land in D's slots once it can hand them out again.
                if not await writer.settle(SETTLE_S):
                    logger.error("a KV write into %s did not land in %.0f s; its lease runs out instead",
                                 job.decode_node_id, SETTLE_S)
                elif channel.alive:
                    await self._release_lease(channel, lease_id)

    def _write_whole(self, req: Request, writer: DirectWrite) -> None:
        """Engine thread: the prompt's missing KV into D's slots in one launch."""
        slots = self.engine.held_slots(req)[writer.start : writer.n_tokens].to(self.engine.device)
        writer.write_all(slots)

    def _report(self, job: PrefillJob, req: Request, first: TokenUpdate, hit_blocks: int, transfer_bytes: int) -> FirstToken:
        now = time.monotonic()
        received = self._received.get(job.request_id)
        queued = self._queued.get(job.request_id)
        return FirstToken(
            request_id=job.request_id,
            token_id=first.token_id,
            text=first.text_delta,
            logprob=first.logprob,
            finish_reason=first.finish_reason,
            cached_tokens_prefill=req.num_cached_tokens,
            hit_blocks_decode=hit_blocks,
            transfer_bytes=transfer_bytes,
            node_ttft_s=None if received is None else now - received,
            prefix_query_s=self._query_s.get(job.request_id),
            prefill_s=None if queued is None else now - queued,
        )

    def _layer_hook_for(self, step: ScheduledStep) -> LayerHook | None:
        """Engine thread: a hook for the steps that complete a streamed prompt."""
        if not self._streams:
            return None
        streams = []
        for req, sample in zip(step.requests, step.samples):
            stream = self._streams.get(req.request_id)
            if stream is not None and sample:
                stream.begin(self.engine.table.table[req.row, stream.start : stream.n_tokens])
                streams.append(stream)
        if not streams:
            return None

        def hook(layer: int) -> None:
            for stream in streams:
                stream.capture(layer)

        return hook

    async def _add(self, job: PrefillJob, whole: bool = False) -> Request:
        """Queue the prompt; its first token arrives through :meth:`_first_token`. ``whole``: its
        KV is streamed layer by layer as the step that completes it runs, so it is prefilled in as
        few steps as the budget allows (graph-sized chunks would leave the stream too little
        compute to hide behind)."""
        self._first_tokens[job.request_id] = asyncio.get_running_loop().create_future()
        self._queued[job.request_id] = time.monotonic()
        try:
            return await self.worker.call(
                lambda: self.engine.add_request(job.request_id, job.token_ids, job.sampling, hold_kv=True,
                                                prefill_only=True, whole_prefill=whole)
            )
        except ValueError as e:
            self._first_tokens.pop(job.request_id, None)
            raise PrefillFailed(str(e), retryable=False) from e

    async def _first_token(self, job: PrefillJob, left) -> TokenUpdate:
        future = self._first_tokens[job.request_id]
        try:
            return await wait_for(future, left())
        except BaseException:
            self._first_tokens.pop(job.request_id, None)
            await self._abort_engine(job.request_id)
            raise

    def _gather(self, req: Request, hit_blocks: int, send_blocks: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """KV of blocks [hit_blocks, n_blocks) as ``[2, L, send_blocks*block, H, D]``, zero-padded,
        and on a GPU the event after which it is complete."""
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
        buffer = buffer.contiguous()
        ready = None
        if buffer.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return buffer, ready

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
