"""The decode node: a DecodeService joined to the master (:class:`DecodeNode`), and the mixed node
(:class:`MixedNode`): the same engine taking whole requests only.

A decode node decodes what prefill nodes hand over, and also takes whole requests the master
chose to prefill here (``GenerateJob``: a short miss, or no prefill node ready): its engine
prefills them in chunks between decode steps. A mixed node is that engine on its own: the master
routes whole requests to it and never pairs it with a prefill node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

from pydantic import BaseModel

from decode_node.service import DecodeService
from pd_cluster import protocol
from pd_cluster.engine.beam_search import BeamResult
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import TokenUpdate
from pd_cluster.node.config import NodeSettings
from pd_cluster.node.runtime import NodeRuntime
from pd_cluster.node.status import StatusReporter

logger = logging.getLogger(__name__)


class DecodeNode(NodeRuntime):
    role = "decode"

    def __init__(self, settings: NodeSettings, engine: LLMEngine | None = None) -> None:
        """``engine``: the engine of this process's previous role (a role change keeps its KV pool and
        prefix cache); None: a new one."""
        super().__init__(settings)
        self._loop: asyncio.AbstractEventLoop | None = None
        if engine is not None:  # it served another role: its cache reports here now, no layer hooks
            engine.cache.event_sink = self._on_kv_events
            engine.set_layer_hook_factory(None)
        self.service = DecodeService(
            settings.engine, node_id=settings.node_id, cluster_token=settings.cluster_token.get_secret_value(),
            data_host=settings.data_bind or settings.data_host, data_port=settings.data_port,
            on_tokens=self._on_tokens, kv_event_sink=self._on_kv_events, engine=engine,
            share_kv_pool=settings.kv_ipc, share_kv_across_gpus=settings.kv_ipc_across_gpus,
            data_tls=settings.data_listener_tls(),
        )
        self.reporter = StatusReporter(self.service.engine, self.service.worker.rates)
        self.service.on_lease_expired = self._on_lease_expired
        self.service.on_beams = self._on_beams

    def _on_lease_expired(self, request_ids: list[str]) -> None:
        # Engine thread: the master must hear it, or a request whose P died after its first token
        # would wait for its deadline.
        if self._loop is None:
            return
        for request_id in request_ids:
            failed = protocol.RequestFailed(
                request_id=request_id, retryable=True, peer_lost=True,
                message="the KV lease ran out before the prefill node handed the request over",
            )
            self._loop.call_soon_threadsafe(self.send, failed)

    def _on_kv_events(self, stored: list[int], evicted: list[int]) -> None:
        # Called on the engine thread: hop to the event loop.
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.send, protocol.KVEvents(stored=stored, evicted=evicted))

    def _on_tokens(self, updates: list[TokenUpdate]) -> None:
        """One step's tokens: a ``TokenDelta`` a request (its tokens in order), all in one frame."""
        by_request: dict[str, list[TokenUpdate]] = defaultdict(list)
        for update in updates:
            by_request[update.request_id].append(update)
        # Built without validation: every field comes from the engine, which made it to these types
        # (validating cost the node's event loop a few microseconds a request every step).
        deltas: list[protocol.TokenDelta] = []
        for request_id, items in by_request.items():
            logprobs = [u.logprob for u in items if u.logprob is not None]
            first = self.service.first_token_out(request_id) if items[0].first_token else None
            deltas.append(
                protocol.TokenDelta.model_construct(
                    request_id=request_id,
                    token_ids=[u.token_id for u in items],
                    text="".join(u.text_delta for u in items),
                    logprobs=logprobs or None,
                    prompt_logprobs=items[0].prompt_logprobs,
                    finish_reason=items[-1].finish_reason,
                    cached_tokens=first.cached_tokens if first is not None else None,
                    node_ttft_s=first.node_ttft_s if first is not None else None,
                )
            )
        if deltas:
            self.send(protocol.TokenDeltas.model_construct(deltas=deltas))

    def _on_beams(self, results: list[BeamResult]) -> None:
        # Engine thread: hop to the event loop.
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._send_beams, results)

    def _send_beams(self, results: list[BeamResult]) -> None:
        """Each ended beam search as its one delta: the best beam's tokens and every beam."""
        deltas = []
        for result in results:
            started = self.service.beam_started.pop(result.request_id, None)
            wants_logprobs = result.params is not None and result.params.logprobs is not None
            beams = [protocol.BeamOutput(token_ids=b.token_ids, text=b.text, cum_logprob=b.cum_logprob, score=b.score,
                                         finish_reason=b.finish_reason, logprobs=b.logprobs if wants_logprobs else None)
                     for b in result.beams]
            best = beams[0] if beams else None
            deltas.append(protocol.TokenDelta(
                request_id=result.request_id, token_ids=best.token_ids if best else [], text=best.text if best else "",
                logprobs=best.logprobs if best else None, finish_reason=best.finish_reason if best else "abort",
                beams=beams, cached_tokens=0 if started is not None else None,
                node_ttft_s=time.monotonic() - started if started is not None else None,
            ))
        if deltas:
            self.send(protocol.TokenDeltas(deltas=deltas))

    def register_message(self) -> protocol.Register:
        engine = self.service.engine
        return protocol.Register(
            node_id=self.settings.node_id, role=self.role, model=engine.kv_spec.model, kv_spec=engine.kv_spec,
            data_address=f"{self.settings.data_host}:{self.service.server.port}",
            capacity=self.capacity(engine), device=str(engine.device),
        )

    def status(self) -> protocol.NodeStatus:
        return self.reporter.report(draining=self.lifecycle.draining, warm_peers=self.service.warmed_peers,
                                    queued_prefill_tokens=self.service.queued_prefill_tokens(),
                                    request_ids=self.service.request_ids())

    async def on_message(self, message: BaseModel) -> None:
        if isinstance(message, protocol.Abort):
            await self.service.abort(message.request_id)
        elif isinstance(message, protocol.Drain):
            self.lifecycle.request_drain("the master asked")
        elif isinstance(message, protocol.GenerateJob):
            await self._generate(message)
        elif isinstance(message, protocol.PrefillJob):
            self.send(protocol.RequestFailed(request_id=message.request_id, retryable=True,
                                             message=f"a {self.role} node does not run prefill jobs for other nodes"))

    async def _generate(self, job: protocol.GenerateJob) -> None:
        if self.lifecycle.draining:
            self.send(protocol.RequestFailed(request_id=job.request_id, retryable=True,
                                             message=f"{self.role} node is draining"))
            return
        try:
            await self.service.generate(job.request_id, job.token_ids, job.sampling)
        except ValueError as e:  # this engine cannot run it (context, pool); another node may
            self.send(protocol.RequestFailed(request_id=job.request_id, retryable=True, message=str(e)))

    async def start_service(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.service.start()

    async def stop_service(self) -> None:
        await self.service.stop()

    def _busy(self) -> bool:
        return bool(self.service.engine.has_unfinished() or self.service.reservations.pending)

    async def wait_idle(self, timeout: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout
        while await self.service.worker.call(self._busy):
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.1)  # requests end at their own pace; check ten times a second
        return True


class MixedNode(DecodeNode):
    """Prefill and decode in one engine: takes whole requests (``GenerateJob``) only; prefill
    nodes are never told about it. Its data-plane listener stays up but no P dials it."""

    role = "mixed"
