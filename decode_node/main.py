"""Decode node process: a DecodeService joined to the master."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from pydantic import BaseModel

from decode_node.service import DecodeService
from pd_cluster import protocol
from pd_cluster.engine.outputs import TokenUpdate
from pd_cluster.node_agent import NodeAgent
from pd_cluster.node_config import NodeSettings
from pd_cluster.node_lifecycle import NodeLifecycle, serve_status
from pd_cluster.node_status import StatusReporter

logger = logging.getLogger(__name__)


class DecodeNode:
    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.lifecycle = NodeLifecycle()
        self.agent: NodeAgent | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        token = settings.cluster_token.get_secret_value()
        self.service = DecodeService(
            settings.engine, node_id=settings.node_id, cluster_token=token,
            data_host=settings.data_bind or settings.data_host, data_port=settings.data_port,
            on_tokens=self._on_tokens, transfer_timeout_s=60.0, kv_event_sink=self._on_kv_events,
        )
        self.status = StatusReporter(self.service.engine)

    def _on_kv_events(self, stored: list[int], evicted: list[int]) -> None:
        # Called on the engine thread.
        if self._loop is not None and self.agent is not None:
            message = protocol.KVEvents(stored=stored, evicted=evicted)
            self._loop.call_soon_threadsafe(self.agent.send_nowait, message)

    def _on_tokens(self, updates: list[TokenUpdate]) -> None:
        if self.agent is None:
            return
        by_request: dict[str, list[TokenUpdate]] = defaultdict(list)
        for update in updates:
            by_request[update.request_id].append(update)
        for request_id, items in by_request.items():
            logprobs = [u.logprob for u in items if u.logprob is not None]
            self.agent.send_nowait(
                protocol.TokenDelta(
                    request_id=request_id,
                    token_ids=[u.token_id for u in items],
                    text="".join(u.text_delta for u in items),
                    logprobs=logprobs or None,
                    finish_reason=items[-1].finish_reason,
                )
            )

    def _register_message(self) -> protocol.Register:
        engine = self.service.engine
        port = self.service.server.port
        return protocol.Register(
            node_id=self.settings.node_id, role="decode", model=engine.kv_spec.model, kv_spec=engine.kv_spec,
            data_address=f"{self.settings.data_host}:{port}",
            capacity=protocol.NodeCapacity(
                max_total_tokens=engine.pool.capacity, max_running_requests=engine.config.max_running_requests,
                max_model_len=engine.max_model_len,
            ),
            device=str(engine.device),
        )

    async def _on_message(self, message: BaseModel) -> None:
        if isinstance(message, protocol.Abort):
            await self.service.abort(message.request_id)
        elif isinstance(message, protocol.Drain):
            self.lifecycle.request_drain("the master asked")
        elif isinstance(message, protocol.PrefillJob):
            assert self.agent is not None
            self.agent.send_nowait(protocol.RequestFailed(request_id=message.request_id, retryable=True,
                                                          message="a decode node does not prefill"))

    def _busy(self) -> bool:
        return bool(self.service.engine.scheduler.running or self.service.handover.reservations)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.lifecycle.install_signal_handlers()
        await self.service.start()
        status_server = await serve_status(self.lifecycle, self.settings.node_id, "decode",
                                           self.settings.status_host, self.settings.status_port)
        self.agent = NodeAgent(
            self.settings.master, self.settings.cluster_token.get_secret_value(), self._register_message(),
            lambda: self.status.report(draining=self.lifecycle.draining), self._on_message,
            reconnect_s=self.settings.reconnect_s,
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
                agent_task.result()  # a final refusal propagates
            await self._drain()
        finally:
            for task in (drain, registered):
                task.cancel()
            await self.agent.close()
            try:
                await asyncio.wait_for(asyncio.shield(agent_task), 10)
            except BaseException:
                agent_task.cancel()
            if status_server is not None:
                status_server.should_exit = True
            await self.service.stop()

    async def _drain(self) -> None:
        """Wait (bounded) for running requests and pending handovers, then say goodbye."""
        deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout_s
        while await self.service.worker.call(self._busy):
            if asyncio.get_running_loop().time() > deadline:
                logger.warning("drain timed out with requests still running")
                break
            await asyncio.sleep(0.1)
        self.lifecycle.drained.set()
        assert self.agent is not None
        self.agent.send_nowait(protocol.Drained())
        logger.info("drained; leaving the cluster")


def run_decode_node(settings: NodeSettings) -> None:
    asyncio.run(DecodeNode(settings).run())
