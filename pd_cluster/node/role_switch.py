"""A node process that can change role while it serves (``SetRole`` from the master).

The process holds one engine for its whole life; a role (:class:`NodeRuntime` of the prefill,
decode or mixed node) is a service wrapped around it. A change lets the old role finish what it
holds (no new work reaches it: the master routes none to a switching node, and a job that was
already on its way is handed back as retryable), stops that role's service (its engine thread,
data-plane listener or channels) without touching the engine, starts the new role's service on
the same engine (so its KV pool and prefix cache stay warm), and answers ``RoleChanged`` with
the new registration. A stream still decoding when ``drain_timeout_s`` runs out is handed back to
the master, which moves it to another node with the tokens it already has.

The roles' classes live in their own packages, which this one may not import: the command that
starts a node (:mod:`pd_cluster.cli`) passes a factory per role.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from pydantic import BaseModel

from pd_cluster import protocol
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.node.master_links import MasterLinks
from pd_cluster.node.config import NodeSettings
from pd_cluster.node.runtime import NodeRuntime

logger = logging.getLogger(__name__)

#: Builds a role's runtime, on the engine of the role before it (None: a new engine).
RoleFactory = Callable[[NodeSettings, LLMEngine | None], NodeRuntime]


class RoleSwitchingNode(NodeRuntime):
    """One node process whose role is :attr:`part`, changed in place on the master's ``SetRole``."""

    def __init__(self, settings: NodeSettings, role: str, factories: Mapping[str, RoleFactory]) -> None:
        self._factories = factories
        self.part = factories[role](settings, None)
        super().__init__(settings)
        self.part.lifecycle = self.lifecycle
        self.switching_to: str | None = None
        self._switch: asyncio.Task | None = None

    @property  # type: ignore[override]
    def role(self) -> str:
        return self.part.role

    @property
    def agent(self) -> MasterLinks | None:
        return self._agent

    @agent.setter
    def agent(self, agent: MasterLinks | None) -> None:
        self._agent = agent
        self.part.agent = agent

    # ---- the current role's --------------------------------------------------------------------

    def register_message(self) -> protocol.Register:
        return self.part.register_message()

    def status(self) -> protocol.NodeStatus:
        status = self.part.status()
        if self.switching_to is not None:
            status = status.model_copy(update={"switching_to": self.switching_to})
        return status

    async def on_message(self, message: BaseModel) -> None:
        if isinstance(message, protocol.SetRole):
            if self._switch is None or self._switch.done():
                self._switch = asyncio.create_task(self.change_role(message.role))
            else:
                logger.warning("asked to become %s while changing role to %s: answered when this change ends",
                               message.role, self.switching_to)
        elif self.switching_to is not None and isinstance(message, (protocol.PrefillJob, protocol.GenerateJob)):
            self.send(protocol.RequestFailed(request_id=message.request_id, retryable=True,
                                             message=f"the node is changing role to {self.switching_to}"))
        else:
            await self.part.on_message(message)

    async def start_service(self) -> None:
        await self.part.start_service()

    async def stop_service(self) -> None:
        """The process's end (a change of role stops only the old role's service): the service,
        then the engine, whose tensor-parallel ranks take the stop and exit 0 (left to notice
        rank 0's exit, each would log a failure)."""
        if self._switch is not None and not self._switch.done():
            self._switch.cancel()
        await self.part.stop_service()
        self.part.service.engine.close()  # type: ignore[attr-defined]

    async def wait_idle(self, timeout: float) -> bool:
        return await self.part.wait_idle(timeout)

    # ---- the change ----------------------------------------------------------------------------

    async def change_role(self, role: str) -> None:
        """Finish the old role's work, move the engine to ``role``'s service, tell the masters."""
        old = self.part
        if role == old.role:
            self.send(protocol.RoleChanged(info=old.register_message()))
            return
        self.switching_to = role
        logger.info("changing role %s -> %s: finishing what the %s role holds", old.role, role, old.role)
        try:
            await self._hand_back_left_over(old)
            engine: LLMEngine = old.service.engine  # type: ignore[attr-defined]
            await old.stop_service()
            failed = None
            try:
                self._adopt(self._factories[role](self.settings, engine))
                await self.part.start_service()
            except Exception as e:  # the node stays what it was
                logger.exception("could not become %s; staying %s", role, old.role)
                failed = f"{type(e).__name__}: {e}"
                self._adopt(self._factories[old.role](self.settings, engine))
                await self.part.start_service()
        finally:
            self.switching_to = None
        info = self.part.register_message()
        if self.agent is not None:
            self.agent.set_registration(info)
        self.send(protocol.RoleChanged(info=info, failed=failed))
        logger.info("serving as %s (was %s)", self.part.role, old.role)

    async def _hand_back_left_over(self, old: NodeRuntime) -> None:
        """Wait for the old role's requests to end; past the drain deadline, hand what is left back
        to the master (it moves each elsewhere with the tokens already out) and drop it here."""
        if await old.wait_idle(self.settings.drain_timeout_s):
            return
        left = old.status().request_ids
        logger.warning("changing role: %d requests still running after %.0f s, handed back to the master",
                       len(left), self.settings.drain_timeout_s)
        for request_id in left:
            self.send(protocol.RequestFailed(request_id=request_id, retryable=True,
                                             message="the node changed role before the request ended"))
            await old.on_message(protocol.Abort(request_id=request_id))
        await old.wait_idle(self.settings.drain_timeout_s)

    def _adopt(self, part: NodeRuntime) -> None:
        part.lifecycle = self.lifecycle
        part.agent = self._agent
        self.part = part
