"""The prefill node: a PrefillService joined to the master (:class:`PrefillNode`)."""

from __future__ import annotations

import asyncio
import logging

from pydantic import BaseModel

from pd_cluster import protocol
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.node.config import NodeSettings
from pd_cluster.node.runtime import NodeRuntime
from pd_cluster.node.status import StatusReporter
from prefill_node.failures import PrefillFailed
from prefill_node.service import PrefillService

logger = logging.getLogger(__name__)


class PrefillNode(NodeRuntime):
    role = "prefill"

    def __init__(self, settings: NodeSettings, engine: LLMEngine | None = None) -> None:
        """``engine``: the engine of this process's previous role (a role change keeps its KV pool and
        prefix cache); None: a new one."""
        super().__init__(settings)
        if engine is not None:  # a prefill node's cache reports no KV events (the master indexes D's)
            engine.cache.event_sink = None
        self.service = PrefillService(
            settings.engine, node_id=settings.node_id, cluster_token=settings.cluster_token.get_secret_value(),
            lease_s=settings.lease_s, max_channels=settings.max_channels, on_warm_change=self._on_warm_change,
            kv_ipc=settings.kv_ipc, data_tls=settings.data_dialer_tls(), data_tls_name=settings.data_tls_name,
            engine=engine,
        )
        self.reporter = StatusReporter(self.service.engine, self.service.worker.rates)
        self.jobs: dict[str, asyncio.Task] = {}

    def register_message(self) -> protocol.Register:
        engine = self.service.engine
        return protocol.Register(
            node_id=self.settings.node_id, role="prefill", model=engine.kv_spec.model, kv_spec=engine.kv_spec,
            capacity=self.capacity(engine), device=str(engine.device),
        )

    def status(self) -> protocol.NodeStatus:
        return self.reporter.report(
            draining=self.lifecycle.draining, queued_prefill_tokens=self.service.counters.queued_prefill_tokens,
            warm_peers=self.service.warm_peers, channel_setup_s=self.service.keeper.setup_seconds,
            request_ids=list(self.jobs),
        )

    def _on_warm_change(self, warm_peers: list[str]) -> None:
        # Tell the master at once (not at the next periodic report): it routes to warm pairs.
        logger.info("warm data-plane channels to decode nodes: %s", ", ".join(warm_peers) or "none")
        if self.agent is not None and self.agent.registered.is_set():
            self.send(self.status())

    async def on_message(self, message: BaseModel) -> None:
        if isinstance(message, protocol.PrefillJob):
            if self.lifecycle.draining:
                self.send(protocol.RequestFailed(request_id=message.request_id, retryable=True,
                                                 message="prefill node is draining"))
                return
            task = asyncio.create_task(self._run_job(message))
            self.jobs[message.request_id] = task
            task.add_done_callback(lambda _t, rid=message.request_id: self.jobs.pop(rid, None))
        elif isinstance(message, protocol.Abort):
            task = self.jobs.get(message.request_id)
            if task is not None:
                task.cancel()
        elif isinstance(message, protocol.Drain):
            self.lifecycle.request_drain("the master asked")
        elif isinstance(message, protocol.DecodePeers):
            self.service.set_decode_peers({peer.node_id: peer.data_address for peer in message.peers})

    async def _run_job(self, job: protocol.PrefillJob) -> None:
        try:
            result = await self.service.run_job(job, self._report_first_token)
            if result.committed and result.transfer_bytes:
                self.send(protocol.KVTransferred(request_id=job.request_id, bytes=result.transfer_bytes,
                                                 seconds=result.transfer_seconds))
        except PrefillFailed as e:
            if e.busy:  # backpressure, not a fault: the master queues the request again
                logger.info("prefill of %s waits: %s", job.request_id, e)
            else:
                logger.warning("prefill of %s failed: %s", job.request_id, e)
            self.send(protocol.RequestFailed(request_id=job.request_id, message=str(e), retryable=e.retryable,
                                             busy=e.busy, peer_lost=e.decode_lost))
        except asyncio.CancelledError:
            logger.info("prefill of %s aborted", job.request_id)
        except Exception as e:
            logger.exception("prefill of %s failed unexpectedly", job.request_id)
            self.send(protocol.RequestFailed(request_id=job.request_id, retryable=True,
                                             message=f"internal error: {type(e).__name__}"))

    async def _report_first_token(self, first: protocol.FirstToken) -> None:
        self.send(first)

    async def start_service(self) -> None:
        await self.service.start()

    async def stop_service(self) -> None:
        for task in list(self.jobs.values()):
            task.cancel()
        await self.service.stop()

    async def wait_idle(self, timeout: float) -> bool:
        if not self.jobs:
            return True
        _, pending = await asyncio.wait(list(self.jobs.values()), timeout=timeout)
        return not pending
