"""The prefill node's work: for each job, ask D for prefix hits, prefill, send only missing KV."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pd_cluster.aio import wait_for
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import TokenUpdate
from pd_cluster.engine.request import Request
from pd_cluster.engine.worker import EngineWorker
from pd_cluster.handover import ChannelSource, HandoverFailed, KVSender, SendOptions, choose_sender, reserve
from pd_cluster.handover.layer_capture import LayerCaptures
from pd_cluster.handover.sender import WithHeldSlots
from pd_cluster.protocol import FirstToken, PrefillJob
from pd_cluster.transfer import ChannelKeeper, ChannelPool, TransferError
from prefill_node.admission import TokenAdmission
from prefill_node.failures import PrefillFailed, prefill_failure

logger = logging.getLogger(__name__)

FirstTokenSink = Callable[[FirstToken], Awaitable[None]]


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
    """What a prefill node counted since it started (its status and metrics)."""

    jobs: int = 0
    failed: int = 0
    #: Jobs whose decode node had no room for them (handed back to the master to wait).
    refused: int = 0
    #: KV bytes moved to decode nodes, sent or written in place.
    kv_bytes_sent: int = 0
    #: Prompt tokens of the jobs in flight.
    queued_prefill_tokens: int = 0


@dataclass
class Admitted:
    """The prompt tokens a job holds of the node's admission (0: not admitted yet)."""

    tokens: int = 0


@dataclass
class JobTimes:
    """Where a job's share of its TTFT went: when the node took it, the prefix query's seconds,
    and when the prompt was queued on the engine (monotonic)."""

    received: float
    query_s: float | None = None
    queued: float | None = None


class PrefillService:
    """A prefill engine on its own thread plus the pool of channels to decode nodes.

    :meth:`start` warms the engine up (kernels compiled before the node joins) and starts the
    :class:`ChannelKeeper`, which forms and warms channels to the decode nodes that
    :meth:`set_decode_peers` lists (the master's ``DecodePeers``), so a request finds its channel
    ready; ``on_warm_change`` hears of every change of :attr:`warm_peers`. ``channels``: where
    jobs find their channel instead of that pool (loopback links: :mod:`pd_cluster.handover.loopback`).

    Each job runs one lifecycle and asks :func:`~pd_cluster.handover.choose_sender` how its KV
    goes to D. A decode node on this host may share its KV pool (``kv_ipc``,
    :mod:`pd_cluster.transfer.ipc`): then the missing KV is written straight into its reserved
    slots, layer by layer during the prefill from ``direct_layerwise_min_tokens`` missing tokens
    on, else in one launch after it, and nothing goes through the tensor channel.

    ``layerwise`` (default: on CUDA devices) streams each layer's KV to D while the prefill
    forward runs (from ``layerwise_min_tokens`` tokens to send on, in groups of
    ``layers_per_send`` layers); otherwise the whole KV goes in one push after the first token.
    On a GPU the engine thread computes on its own stream, so that what the event loop queues for
    the network never waits behind later layers.
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
        channels: ChannelSource | None = None,
        data_tls: ssl.SSLContext | None = None,
        data_tls_name: str | None = None,
    ) -> None:
        self.engine = engine or LLMEngine(config)
        self.worker = EngineWorker(self.engine, self._on_updates)
        self.pool = ChannelPool(cluster_token, self.engine.kv_spec, node_id, self.engine.device, max_channels,
                                kv_ipc=kv_ipc, tls=data_tls, server_name=data_tls_name)
        self.channels: ChannelSource = self.pool if channels is None else channels
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
        if not self.engine.node_kv.whole and (self.layerwise or direct_layerwise_min_tokens is not None):
            logger.info("tp %d: KV goes to decode nodes whole after the prefill (no layer-wise sends: each rank "
                        "holds part of the heads)", self.engine.config.tp)
        self._compute_stream = torch.cuda.Stream(self.engine.device) if on_gpu else None
        # KV copies out of the pool run at high priority: queued behind a long prefill's kernels
        # at equal priority, they (and the sends that wait for them) would start only at its end.
        self._side_stream = torch.cuda.Stream(self.engine.device, priority=-1) if on_gpu else None
        self.captures = LayerCaptures(self.engine.table.table)
        self.engine.set_layer_hook_factory(self.captures.hook_for)

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
        if self.channels is not self.pool:
            await self.channels.close()
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

    def send_options(self) -> SendOptions:
        """How KV goes to D now (the thresholds above; a layer-wise write in place needs the
        engine's own compute stream)."""
        direct_min = self.direct_layerwise_min_tokens if self._compute_stream is not None else None
        return SendOptions(layerwise=self.layerwise, layerwise_min_tokens=self.layerwise_min_tokens,
                           layers_per_send=self.layers_per_send, direct_layerwise_min_tokens=direct_min)

    async def run_job(self, job: PrefillJob, report_first_token: FirstTokenSink) -> PrefillResult:
        """Prefill ``job`` and hand it to its decode node; raises PrefillFailed with a reason.

        One lifecycle whatever the path (:func:`~pd_cluster.handover.choose_sender` picks it):
        admission, D's lease, the prefill, the first token out, then the KV committed to D or the
        lease released; whatever the job held is given back on every path and failure."""
        times = JobTimes(received=time.monotonic())
        left = self._deadline(job, times.received)
        with self._in_flight(job) as admitted:
            return await self._run(job, report_first_token, times, left, admitted)

    async def _run(
        self, job: PrefillJob, report_first_token: FirstTokenSink, times: JobTimes, left: Callable[[], float],
        admitted: Admitted,
    ) -> PrefillResult:
        """The lifecycle itself. Its finally first stops what the sender has in flight (at once:
        a cancelled job may be cancelled again while it awaits), then ends the request on the
        engine, then gives back what the sender still holds."""
        sender: KVSender | None = None
        req: Request | None = None
        try:
            admitted.tokens = await self._admit(job, left)
            channel = await wait_for(self.channels.get(job.decode_address), left())
            lease = await reserve(channel, job, self.lease_s, left)
            times.query_s = lease.query_seconds
            sender = choose_sender(channel, lease, job.request_id, len(job.token_ids), self.engine.node_kv,
                                   self._side_stream, self.send_options())
            await sender.begin(left)
            if sender.layer_sink is not None:
                self.captures.add(job.request_id, sender.layer_sink)
            req = await self._add(job, times, whole=sender.layer_sink is not None)
            first = await self._first_token(job, left)
            return await self._hand_over(job, report_first_token, sender, req, first, times, left)
        except (PrefillFailed, HandoverFailed, TransferError, asyncio.TimeoutError) as e:
            failure = prefill_failure(job, e)
            if isinstance(failure, PrefillFailed) and failure.busy:
                self.counters.refused += 1
            else:
                self.counters.failed += 1
            if failure is e:
                raise
            raise failure from e
        finally:
            self.captures.discard(job.request_id)
            if sender is not None:
                sender.abandon()
                if req is not None:
                    await self._release(req)
                else:
                    await self._abort_engine(job.request_id)
                await sender.close()

    async def _hand_over(
        self, job: PrefillJob, report_first_token: FirstTokenSink, sender: KVSender, req: Request,
        first: TokenUpdate, times: JobTimes, left: Callable[[], float],
    ) -> PrefillResult:
        """The first token goes out at once (TTFT does not wait for the transfer); then the KV is
        committed to D, or D's lease released when the request ended at its first token."""
        finished = first.finish_reason is not None
        hit_blocks = sender.lease.hit_blocks
        report = self._report(job, req, first, hit_blocks, 0 if finished else sender.nbytes, times)
        await report_first_token(report)
        if finished:
            handed = await sender.release(left)
        else:
            handed = await sender.commit(first.token_id, self._with_held_slots(req), left)
        self.counters.kv_bytes_sent += handed.bytes_sent
        if finished:
            return PrefillResult(report, hit_blocks, 0, handed.seconds, committed=False)
        return PrefillResult(report, hit_blocks, handed.bytes_sent, handed.seconds, committed=True,
                             visible_seconds=handed.visible_seconds)

    @staticmethod
    def _deadline(job: PrefillJob, received: float) -> Callable[[], float]:
        """Seconds left of ``job``'s deadline; raises PrefillFailed once it has passed."""
        deadline = received + job.deadline_s

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PrefillFailed(f"prefill of {job.request_id} ran past its deadline")
            return remaining

        return left

    @contextlib.contextmanager
    def _in_flight(self, job: PrefillJob) -> Iterator[Admitted]:
        """Count ``job`` in flight (its queued tokens, its decode node's jobs) while it runs, and
        give back its admission, however it ends: nothing here awaits, so a cancellation that
        cuts the lifecycle's cleanup short cannot skip it."""
        self.counters.jobs += 1
        self.counters.queued_prefill_tokens += len(job.token_ids)
        self._jobs_per_address[job.decode_address] += 1
        admitted = Admitted()
        try:
            yield admitted
        finally:
            if admitted.tokens:
                self.admission.release(admitted.tokens)
            self.counters.queued_prefill_tokens -= len(job.token_ids)
            self._jobs_per_address[job.decode_address] -= 1
            if self._jobs_per_address[job.decode_address] <= 0:
                del self._jobs_per_address[job.decode_address]

    async def _admit(self, job: PrefillJob, left: Callable[[], float]) -> int:
        """Wait for admission (:mod:`prefill_node.admission`); returns the tokens to release."""
        try:
            return await wait_for(self.admission.acquire(len(job.token_ids)), left())
        except asyncio.TimeoutError:
            raise PrefillFailed(f"prefill of {job.request_id} waited past its deadline for admission") from None

    def _with_held_slots(self, req: Request) -> WithHeldSlots:
        """How a sender reads the prompt's KV slots: on the engine thread, while P holds them."""

        async def call(fn: Callable[[torch.Tensor], Any]) -> Any:
            return await self.worker.call(lambda: fn(self.engine.held_slots(req)))

        return call

    def _report(
        self, job: PrefillJob, req: Request, first: TokenUpdate, hit_blocks: int, transfer_bytes: int, times: JobTimes,
    ) -> FirstToken:
        now = time.monotonic()
        return FirstToken(
            request_id=job.request_id,
            token_id=first.token_id,
            text=first.text_delta,
            logprob=first.logprob,
            prompt_logprobs=first.prompt_logprobs,
            finish_reason=first.finish_reason,
            cached_tokens_prefill=req.num_cached_tokens,
            hit_blocks_decode=hit_blocks,
            transfer_bytes=transfer_bytes,
            node_ttft_s=now - times.received,
            prefix_query_s=times.query_s,
            prefill_s=None if times.queued is None else now - times.queued,
        )

    async def _add(self, job: PrefillJob, times: JobTimes, whole: bool = False) -> Request:
        """Queue the prompt; its first token arrives through :meth:`_first_token`. ``whole``: its
        KV is sent layer by layer as the step that completes it runs, so it is prefilled in as
        few steps as the budget allows (graph-sized chunks would leave the sends too little
        compute to hide behind)."""
        self._first_tokens[job.request_id] = asyncio.get_running_loop().create_future()
        times.queued = time.monotonic()
        try:
            return await self.worker.call(
                lambda: self.engine.add_request(job.request_id, job.token_ids, job.sampling.for_prefill(), hold_kv=True,
                                                prefill_only=True, whole_prefill=whole)
            )
        except ValueError as e:
            self._first_tokens.pop(job.request_id, None)
            raise PrefillFailed(str(e), retryable=False) from e

    async def _first_token(self, job: PrefillJob, left: Callable[[], float]) -> TokenUpdate:
        future = self._first_tokens[job.request_id]
        try:
            return await wait_for(future, left())
        except BaseException:
            self._first_tokens.pop(job.request_id, None)
            await self._abort_engine(job.request_id)
            raise

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
