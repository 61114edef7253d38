"""What every node process does around its service: join the master, serve status, drain, leave."""

from __future__ import annotations

import abc
import asyncio
import logging

from pydantic import BaseModel

from pd_cluster.aio import wait_for
from pd_cluster import protocol
from pd_cluster.node.master_links import MasterLinks
from pd_cluster.node.config import NodeSettings
from pd_cluster.node.lifecycle import NodeLifecycle, serve_status

logger = logging.getLogger(__name__)


class NodeRuntime(abc.ABC):
    """A role's process: subclasses wire their service; :meth:`run` is the shared lifecycle."""

    role: str

    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.lifecycle = NodeLifecycle()
        self.agent: MasterLinks | None = None

    # ---- what a role provides -----------------------------------------------------------------

    @abc.abstractmethod
    def register_message(self) -> protocol.Register: ...

    @abc.abstractmethod
    def status(self) -> protocol.NodeStatus: ...

    @abc.abstractmethod
    async def on_message(self, message: BaseModel) -> None: ...

    @abc.abstractmethod
    async def start_service(self) -> None: ...

    @abc.abstractmethod
    async def stop_service(self) -> None: ...

    @abc.abstractmethod
    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False when the timeout ran out first."""

    # ---- shared ---------------------------------------------------------------------------------

    def send(self, message: BaseModel) -> None:
        if self.agent is not None:
            self.agent.send_nowait(message)

    def capacity(self, engine) -> protocol.NodeCapacity:
        return protocol.NodeCapacity(
            max_total_tokens=engine.pool.capacity, max_running_requests=engine.config.max_running_requests,
            max_model_len=engine.max_model_len,
        )

    async def run(self) -> None:
        """Serve until drained (SIGTERM, the master, or the local /drain); a final refusal raises."""
        self.lifecycle.install_signal_handlers()
        await self.start_service()
        status_server = await serve_status(self.lifecycle, self.settings.node_id, self.role,
                                           self.settings.status_host, self.settings.status_port)
        self.agent = MasterLinks(
            self.settings.master, self.settings.cluster_token.get_secret_value(), self.register_message(),
            self.status, self.on_message, reconnect_s=self.settings.reconnect_s,
            max_backoff_s=self.settings.max_reconnect_s, tls=self.settings.master_link_tls(),
        )
        self.agent.on_master_lost = self._master_lost
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
                await wait_for(asyncio.shield(agent_task), 10)
            except BaseException:
                agent_task.cancel()
            if status_server is not None:
                status_server.should_exit = True
            await self.stop_service()

    def _master_lost(self, master_id: str) -> None:
        """Drop the requests of a master this node lost: it has re-run or ended them already (or
        died with their clients), so going on would only hold KV and batch slots."""
        stale = [rid for rid in self.status().request_ids if master_id in rid]
        if stale:
            logger.warning("lost the link to master %s: aborting its %d requests here", master_id, len(stale))
        for request_id in stale:
            asyncio.get_running_loop().create_task(self.on_message(protocol.Abort(request_id=request_id)))

    async def _drain(self) -> None:
        if not await self.wait_idle(self.settings.drain_timeout_s):
            logger.warning("drain timed out with requests still in flight")
        self.lifecycle.drained.set()
        self.send(protocol.Drained())
        logger.info("drained; leaving the cluster")
