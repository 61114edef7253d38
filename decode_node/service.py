"""The decode node's work: answer prefix queries, receive KV, decode, and emit tokens."""

from __future__ import annotations

import logging
import ssl
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pd_cluster.config import EngineConfig
from pd_cluster.engine.beam_search import BeamResult
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import TokenUpdate
from pd_cluster.engine.request import Request
from pd_cluster.engine.worker import EngineWorker
from pd_cluster.handover import DecodeCounters, HandoverFailed, KVReceiver, Reservations, rehearse_handover
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.transfer import DataMessage, DataPlaneServer, PeerConnection, TransferError
from pd_cluster.transfer.ipc import PoolOffer, openable_kinds

logger = logging.getLogger(__name__)

TokenSink = Callable[[list[TokenUpdate]], None]
#: Told (on the engine thread) the beam searches that ended, each beam's text decoded.
BeamSink = Callable[[list[BeamResult]], None]


@dataclass
class LocalPrefill:
    """A request this node prefills itself, until its first token is out."""

    request: Request
    #: When the node took the job (monotonic): its own share of the request's TTFT starts here.
    received_at: float


@dataclass
class LocalPrefillTimings:
    """Where a local request's time to its first token goes, logged as p50s every
    :attr:`every` requests: the hop to the engine thread, the wait for a step to take it, that
    step's run to its token being read back, and the way out to the event loop."""

    every: int = 64
    _parts: list[tuple[float, float, float, float]] = field(default_factory=list)

    def add(self, received_at: float, request: Request, sent_at: float) -> None:
        admitted, first = request.admitted_time, request.first_token_time
        if admitted is None or first is None:
            return
        self._parts.append((request.arrival_time - received_at, admitted - request.arrival_time,
                            first - admitted, sent_at - first))
        if len(self._parts) >= self.every:
            p50 = [1e3 * statistics.median(part) for part in zip(*self._parts)]
            logger.info("local prefills' first tokens, p50 of the last %d: to the engine %.2f ms, to a step %.2f ms, "
                        "its run and read-back %.2f ms, out to the loop %.2f ms", len(self._parts), *p50)
            self._parts.clear()


@dataclass
class FirstTokenOut:
    """What a local request's first delta tells the master."""

    cached_tokens: int
    node_ttft_s: float


class DecodeService:
    """A decode engine on its own thread plus the data-plane listener prefill nodes dial.

    The listener answers prefill nodes' channel warm-ups itself (:attr:`warmed_peers`); the
    :class:`KVReceiver` answers the handover messages. ``share_kv_pool`` hands the KV pools to
    prefill nodes on this GPU (``share_kv_across_gpus``: on any GPU of this host), which then
    write KV in place instead of sending it; at TP > 1 one pool a rank, each holding its own KV
    heads (the GPU compared is rank 0's). ``listen=False``: no listener; prefill services in
    this process reach :attr:`receiver` over loopback links (:mod:`pd_cluster.handover.loopback`)."""

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
        share_kv_pool: bool = True,
        share_kv_across_gpus: bool = False,
        listen: bool = True,
        data_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.engine = engine or LLMEngine(config, kv_event_sink=kv_event_sink)
        self.reservations = Reservations(self.engine)
        self.worker = EngineWorker(self.engine, on_tokens)
        self.worker.after_step.append(self._expire_leases)
        self.worker.after_step.append(self._deliver_beams)
        #: Hears of the beam searches that ended (None: they are dropped).
        self.on_beams: BeamSink | None = None
        self.counters = DecodeCounters()
        self.receiver = KVReceiver(self.engine, self.worker, self.reservations, self.counters, transfer_timeout_s)
        self.server = DataPlaneServer(
            data_host, data_port, cluster_token, self.engine.kv_spec, node_id, self.engine.device, self._handle,
            kv_pools=self._pool_offer() if share_kv_pool else None, share_across_gpus=share_kv_across_gpus,
            on_disconnect=self.receiver.peer_gone, tls=data_tls,
        )
        self._listen = listen
        self._warm_up_engine = warm_up
        #: Told (on the engine thread) the requests whose lease ran out before P handed them over.
        self.on_lease_expired: Callable[[list[str]], None] | None = None
        #: Requests this node prefills itself (GenerateJob), until their first token is out.
        self.local_prefills: dict[str, LocalPrefill] = {}
        self.local_timings = LocalPrefillTimings()
        #: Beam searches this node prefills itself, by id: when the node took the job (monotonic).
        self.beam_started: dict[str, float] = {}

    def _pool_offer(self) -> PoolOffer | None:
        """The KV pools offered to prefill nodes on this host: at TP > 1 each rank exports its own
        now, once (None, and P sends through the channel, when a rank cannot)."""
        kinds = openable_kinds(self.engine.device)
        if not kinds:
            return None
        try:
            return self.engine.node_kv.pool_offer(kinds)
        except (TimeoutError, RuntimeError) as e:
            logger.warning("tp %d: the KV pools are not offered to prefill nodes on this host (%s); they send KV "
                           "through the channel", self.engine.config.tp, e)
            return None

    @property
    def data_address(self) -> str:
        return self.server.address

    @property
    def warmed_peers(self) -> list[str]:
        """Prefill nodes with a live channel to this node that they warmed."""
        return self.server.warmed_peers

    async def start(self) -> None:
        """Warm the engine up (a tiny prefill and decode steps, and a handover rehearsed through
        the loopback: kernels compile now, not on the first request), then listen for prefill nodes."""
        self.worker.start()
        if self.engine.device.type == "cuda":
            await self.worker.call(torch.cuda.set_device, self.engine.device)
        if self._warm_up_engine:
            await self.worker.call(self.engine.warm_up, 16, 2, timeout=600.0)
            try:
                await rehearse_handover(self.engine, self.worker, self.reservations)
            except (HandoverFailed, TransferError) as e:  # the node still serves; its first handover compiles
                logger.warning("could not rehearse a handover: %s", e)
        if self._listen:
            await self.server.start()

    async def stop(self) -> None:
        if self._listen:
            await self.server.stop()
        await self.worker.stop()

    def request_ids(self) -> list[str]:
        """Requests this node holds (decoding or reserved), read from the event loop: the engine
        thread may change the dicts meanwhile, so a torn read is retried and at worst skipped."""
        for _ in range(3):
            try:
                reserved = [res.request_id for res in list(self.reservations.pending.values())]
                return list(self.engine.requests) + reserved + self.engine.beam_request_ids()
            except RuntimeError:  # changed size during the copy
                continue
        return []

    def _expire_leases(self) -> None:
        if self.reservations.pending:
            expired = self.reservations.expire()
            self.counters.expired_leases += len(expired)
            if expired and self.on_lease_expired is not None:
                self.on_lease_expired([res.request_id for res in expired])

    def _deliver_beams(self) -> None:
        """Engine thread: the beam searches that ended since the last step, their beams' text decoded."""
        if not self.engine.beam_results:
            return
        results = self.engine.take_beam_results()
        for result in results:
            skip = result.params.skip_special_tokens if result.params is not None else True
            for beam in result.beams:
                beam.text = self.engine.tokenizer.decode(beam.token_ids, skip_special_tokens=skip)
        if self.on_beams is not None:
            self.on_beams(results)

    async def generate(self, request_id: str, token_ids: list[int], sampling: SamplingParams) -> None:
        """Take a whole request: the engine prefills what its prefix cache lacks, in chunks that
        share steps with the running decode batch (its token budget), then decodes it. Raises
        ValueError when this engine can never run it."""
        received_at = time.monotonic()

        if sampling.use_beam_search:
            await self.worker.call(self.engine.add_beam_request, request_id, token_ids, sampling)
            self.beam_started[request_id] = received_at
            return

        def _add() -> Request:
            return self.engine.add_request(request_id, token_ids, sampling, prefill_now=True)

        self.local_prefills[request_id] = LocalPrefill(await self.worker.call(_add), received_at)

    def first_token_out(self, request_id: str) -> FirstTokenOut | None:
        """A local request's first token was delivered: stop counting it as queued prefill and
        say what its prefix cache held and how long the node took (None: not a local request)."""
        local = self.local_prefills.pop(request_id, None)
        if local is None:
            return None
        now = time.monotonic()
        self.local_timings.add(local.received_at, local.request, now)
        return FirstTokenOut(local.request.num_cached_tokens, now - local.received_at)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens of local requests not prefilled yet (read from the event loop: plain ints)."""
        total = 0
        for local in list(self.local_prefills.values()):
            req = local.request
            total += max(len(req.prompt_token_ids) - req.num_computed, 0)
        return total

    async def abort(self, request_id: str) -> bool:
        """Stop a request (client gone): free its KV whether it is decoding or still reserved."""

        self.local_prefills.pop(request_id, None)
        self.beam_started.pop(request_id, None)

        def _abort() -> bool:
            reserved = self.receiver.abort_reserved(request_id)
            return self.engine.abort(request_id) if reserved is None else reserved

        return await self.worker.call(_abort)

    async def _handle(self, conn: PeerConnection, msg: DataMessage) -> DataMessage | None:
        return await self.receiver.handle(conn, msg)
