"""Prefill node process: a PrefillService joined to the master."""

from __future__ import annotations

import asyncio
import logging

from pydantic import BaseModel

from pd_cluster import protocol
from pd_cluster.node_agent import NodeAgent
from pd_cluster.node_config import NodeSettings
from pd_cluster.node_lifecycle import NodeLifecycle, serve_status
from pd_cluster.node_status import StatusReporter
from prefill_node.service import PrefillFailed, PrefillService

logger = logging.getLogger(__name__)


class PrefillNode:
    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.lifecycle = NodeLifecycle()
        self.agent: NodeAgent | None = None
        self.service = PrefillService(
            settings.engine, node_id=settings.node_id, cluster_token=settings.cluster_token.get_secret_value(),
            lease_s=settings.lease_s, max_channels=settings.max_channels,
        )
        self.status = StatusReporter(self.service.engine)
        self.jobs: dict[str, asyncio.Task] = {}

    def _register_message(self) -> protocol.Register:
        engine = self.service.engine
        return protocol.Register(
            node_id=self.settings.node_id, role="prefill", model=engine.kv_spec.model, kv_spec=engine.kv_spec,
            capacity=protocol.NodeCapacity(
                max_total_tokens=engine.pool.capacity, max_running_requests=engine.config.max_running_requests,
                max_model_len=engine.max_model_len,
            ),
            device=str(engine.device),
        )

    async def _on_message(self, message: BaseModel) -> None:
        if isinstance(message, protocol.PrefillJob):
            if self.lifecycle.draining:
                self._send(protocol.RequestFailed(request_id=message.request_id, retryable=True,
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

    def _send(self, message: BaseModel) -> None:
        if self.agent is not None:
            self.agent.send_nowait(message)

    async def _run_job(self, job: protocol.PrefillJob) -> None:
        try:
            result = await self.service.run_job(job, self._report_first_token)
            if result.committed and result.transfer_bytes:
                self._send(protocol.KVTransferred(request_id=job.request_id, bytes=result.transfer_bytes,
                                                  seconds=result.transfer_seconds))
        except PrefillFailed as e:
            logger.warning("prefill of %s failed: %s", job.request_id, e)
            self._send(protocol.RequestFailed(request_id=job.request_id, message=str(e), retryable=e.retryable))
        except asyncio.CancelledError:
            logger.info("prefill of %s aborted", job.request_id)
        except Exception as e:
            logger.exception("prefill of %s failed unexpectedly", job.request_id)
            self._send(protocol.RequestFailed(request_id=job.request_id, message=f"internal error: {type(e).__name__}",
                                              retryable=True))

    async def _report_first_token(self, first: protocol.FirstToken) -> None:
        self._send(first)

    def _status(self) -> protocol.NodeStatus:
        return self.status.report(
            draining=self.lifecycle.draining,
            queued_prefill_tokens=self.service.counters.queued_prefill_tokens,
        )

    async def run(self) -> None:
        self.lifecycle.install_signal_handlers()
        await self.service.start()
        status_server = await serve_status(self.lifecycle, self.settings.node_id, "prefill",
                                           self.settings.status_host, self.settings.status_port)
        self.agent = NodeAgent(
            self.settings.master, self.settings.cluster_token.get_secret_value(), self._register_message(),
            self._status, self._on_message, reconnect_s=self.settings.reconnect_s,
        )
        agent_task = asyncio.create_task(self.agent.run())
        registered = asyncio.create_task(self.agent.registered.wait())
        drain = asyncio.create_task(self.lifecycle.drain_requested.wait())
        try:
            done, _ = await asyncio.wait([agent_task, drain, registered], return_when=asyncio.FIRST_COMPLETED)
            if registered in done:
                self.lifecycle.registered.set()
                done, _ = await asyncio.wait([agent_task, drain], return_when=asyncio.FIRST_COMPLETED)
            if agent_task in done:
                agent_task.result()
            await self._drain()
        finally:
            for task in (drain, registered):
                task.cancel()
            await self.agent.close()
            try:
                await asyncio.wait_for(asyncio.shield(agent_task), 10)
            except BaseException:
                agent_task.cancel()
            for task in list(self.jobs.values()):
                task.cancel()
            if status_server is not None:
                status_server.should_exit = True
            await self.service.stop()

    async def _drain(self) -> None:
        if self.jobs:
            _, pending = await asyncio.wait(list(self.jobs.values()), timeout=self.settings.drain_timeout_s)
            if pending:
                logger.warning("drain timed out with %d prefill jobs still running", len(pending))
        self.lifecycle.drained.set()
        self._send(protocol.Drained())
        logger.info("drained; leaving the cluster")


def run_prefill_node(settings: NodeSettings) -> None:
    asyncio.run(PrefillNode(settings).run())
