"""A node's links to all its masters: one :class:`~pd_cluster.node.agent.NodeAgent` per master,
behind the interface of one. The masters are a list of URLs, or a DNS name that resolves to
several addresses (a master per address, re-resolved so that a restarted master is found)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel

from pd_cluster import protocol
from pd_cluster.aio import wait_for
from pd_cluster.node.agent import MessageHandler, NodeAgent, StatusSource, node_ws_url

logger = logging.getLogger(__name__)

#: A master's public address is dialled again when none of the workers it named was linked this long.
WORKERS_STALE_S = 15.0

def master_urls(masters: str | list[str]) -> list[str]:
    """The masters a node was given: a list, or one string of comma-separated URLs."""
    items = masters.split(",") if isinstance(masters, str) else masters
    urls = list(dict.fromkeys(item.strip() for item in items if item.strip()))
    if not urls:
        raise ValueError("no master URL given")
    return urls


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class MasterLinks:
    """One :class:`NodeAgent` per master, behind the interface of one.

    Frames of a request go to the master that sent its job when the node knows it (a prefill
    node does), else to every master: a master drops frames of requests it does not own.
    Status and KV events go to every master, so each holds the whole routing view. A name that
    resolves to several addresses (a headless Kubernetes Service) is a master per address,
    re-resolved every ``resolve_every_s`` so that a master restarted on a new address is found.
    """

    def __init__(
        self,
        masters: str | list[str],
        token: str,
        register: protocol.Register,
        status: StatusSource,
        on_message: MessageHandler,
        *,
        reconnect_s: float = 0.1,
        max_backoff_s: float = 1.0,
        resolve_every_s: float = 2.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.masters = master_urls(masters)
        self._tls = tls
        #: Link URL -> the host name its address was resolved from (checked in its certificate).
        self._names: dict[str, str] = {}
        self._token = token
        self.register_msg = register
        self._status = status
        self._on_message = on_message
        self._reconnect_s = reconnect_s
        self._max_backoff_s = max_backoff_s
        self._resolve_every_s = resolve_every_s
        self.agents: dict[str, NodeAgent] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        #: Request id -> the link its job came on (bounded: a job's last frame is not always known).
        self._owner: OrderedDict[str, NodeAgent] = OrderedDict()
        self.registered = asyncio.Event()
        self.stopped = asyncio.Event()
        #: Told a master's id when the node's registered link to it drops.
        self.on_master_lost: Callable[[str], None] | None = None
        #: Link URL of a master's public address -> its workers' link URLs, linked to instead.
        self._workers: dict[str, list[str]] = {}
        #: Public link URL -> when one of its workers' links was last seen registered.
        self._workers_seen: dict[str, float] = {}

    def set_registration(self, register: protocol.Register) -> None:
        """What the node registers as from now on (a role change): every link re-registers with it."""
        self.register_msg = register
        for agent in self.agents.values():
            agent.register_msg = register

    def send_nowait(self, message: BaseModel) -> None:
        """To the request's master when known, else to every master the node is registered with.
        A master whose link is down gets nothing: it has settled this node's requests already.
        A step's ``TokenDeltas`` is split by owner the same way."""
        if isinstance(message, protocol.TokenDeltas) and self._owner:
            self._send_deltas(message)
            return
        request_id = getattr(message, "request_id", None)
        owner = self._owner.get(request_id) if request_id is not None else None
        if owner is not None and owner.url in self.agents:
            if owner.registered.is_set():
                owner.send_nowait(message)
            return
        for agent in list(self.agents.values()):
            if agent.registered.is_set():
                agent.send_nowait(message)

    async def send(self, message: BaseModel) -> None:
        self.send_nowait(message)

    def _send_deltas(self, message: protocol.TokenDeltas) -> None:
        """Each delta to its request's master when known, the rest to every registered master."""
        owned: dict[str, list[protocol.TokenDelta]] = {}
        unowned: list[protocol.TokenDelta] = []
        for delta in message.deltas:
            owner = self._owner.get(delta.request_id)
            if owner is None:
                unowned.append(delta)
            elif owner.url in self.agents and owner.registered.is_set():
                owned.setdefault(owner.url, []).append(delta)
        for agent in list(self.agents.values()):
            if not agent.registered.is_set():
                continue
            deltas = owned.get(agent.url, []) + unowned
            if len(deltas) == len(message.deltas):  # all of them (one master): the frame as it is
                agent.send_nowait(message)
            elif deltas:
                agent.send_nowait(protocol.TokenDeltas.model_construct(deltas=deltas))

    async def close(self, timeout: float = 10.0) -> None:
        self.stopped.set()
        for agent in list(self.agents.values()):
            await agent.close(timeout)

    def _link_lost(self, master_id: str) -> None:
        if self.on_master_lost is not None:
            self.on_master_lost(master_id)

    def _link_changed(self) -> None:
        if any(agent.registered.is_set() for agent in self.agents.values()):
            self.registered.set()
        else:
            self.registered.clear()

    def _redirected(self, agent: NodeAgent, masters: list[str]) -> None:
        urls = [node_ws_url(url) for url in masters]
        self._workers[agent.url] = urls
        self._workers_seen[agent.url] = time.monotonic()
        if agent.url in self._names:  # the workers' certificate names the public host too
            self._names.update({url: self._names[agent.url] for url in urls})
        agent.stop()

    def _through_workers(self, targets: set[str]) -> set[str]:
        """``targets`` with each public address that named its workers replaced by them; an address
        none of whose workers was linked for WORKERS_STALE_S is dialled again (to learn a new list)."""
        now = time.monotonic()
        out: set[str] = set()
        for url in targets:
            workers = self._workers.get(url)
            if workers is None:
                out.add(url)
                continue
            if any(u in self.agents and self.agents[u].registered.is_set() for u in workers):
                self._workers_seen[url] = now
            if now - self._workers_seen[url] > WORKERS_STALE_S:
                logger.warning("no worker of the master at %s linked for %.0f s; asking it again", url,
                               WORKERS_STALE_S)
                del self._workers[url]
                out.add(url)
                continue
            out.update(workers)
        return out

    def _handler(self, agent: NodeAgent) -> MessageHandler:
        async def handle(message: BaseModel) -> None:
            if isinstance(message, protocol.PrefillJob):
                self._owner[message.request_id] = agent
                while len(self._owner) > 65536:
                    self._owner.popitem(last=False)
            await self._on_message(message)

        return handle

    async def _targets(self) -> set[str]:
        """The master URLs to hold a link to now (names with several addresses: one per address)."""
        loop = asyncio.get_running_loop()
        targets: set[str] = set()
        for url in self.masters:
            parts = urlsplit(url if "://" in url else f"http://{url}")
            host, port = parts.hostname or "", parts.port or (443 if parts.scheme in ("https", "wss") else 80)
            if not host or _is_ip(host) or host == "localhost":
                targets.add(url)
                continue
            try:
                infos = await wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), 5.0)
            except (OSError, asyncio.TimeoutError) as e:
                logger.warning("cannot resolve master %s: %s", host, e or type(e).__name__)
                known = {u for u in self.agents if urlsplit(u).port == port}
                targets.update(known or {url})  # keep the links it had
                continue
            addresses = sorted({info[4][0] for info in infos})
            if len(addresses) <= 1:
                targets.add(url)
                continue
            for address in addresses:
                netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
                target = urlunsplit((parts.scheme or "http", netloc, "", "", ""))
                targets.add(target)
                self._names[node_ws_url(target)] = host  # its certificate names the host, not the address
        return self._through_workers({node_ws_url(t) for t in targets})

    def _start(self, url: str) -> None:
        agent = NodeAgent(url, self._token, self.register_msg, self._status, self._on_message,
                          reconnect_s=self._reconnect_s, max_backoff_s=self._max_backoff_s,
                          on_link_change=self._link_changed, tls=self._tls, server_name=self._names.get(url))
        agent._on_message = self._handler(agent)
        agent.on_link_lost = self._link_lost
        agent.on_redirect = lambda masters: self._redirected(agent, masters)
        self.agents[agent.url] = agent
        self._tasks[agent.url] = asyncio.create_task(agent.run(), name=f"master-link-{agent.url}")
        logger.info("linking to master %s", agent.url)

    async def run(self) -> None:
        """Hold a link to every master until :meth:`close`; a final refusal from one raises."""
        try:
            while not self.stopped.is_set():
                targets = await self._targets()
                for url in sorted(targets - set(self.agents)):
                    self._start(url)
                for url in sorted(set(self.agents) - targets):
                    logger.info("master %s no longer resolves; dropping its link", url)
                    await self.agents.pop(url).close()
                    self._tasks.pop(url).cancel()
                    self._link_changed()
                stop = asyncio.create_task(self.stopped.wait())
                done, _ = await asyncio.wait([stop, *self._tasks.values()], timeout=self._resolve_every_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                for url, task in list(self._tasks.items()):
                    if task in done:
                        task.result()  # a final refusal propagates
                        self._tasks.pop(url)
                        self.agents.pop(url, None)
        finally:
            for agent in list(self.agents.values()):
                await agent.close()
            tasks = list(self._tasks.values())
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=10)
                for task in pending:
                    task.cancel()
