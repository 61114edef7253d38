"""A node's links to its masters: dial each one's websocket, register, report status, relay messages.

A node registers with every master it is given (a list of URLs, or a DNS name that resolves to
several addresses), so any master can route to it. Each link reconnects when its master restarts
or the socket drops, with a short first delay and a capped, jittered backoff (a restarted master
is found again within about a second), and re-registers; a refusal that cannot change (wrong
model, wrong token, a master that cannot prove it holds the cluster token) stops the node.
Before registering, both ends prove they hold the cluster token (:mod:`.master_proof`); the
token itself is never sent. A ``https://`` master is dialed over ``wss://``, its certificate
checked against the CA the node was given.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel

from pd_cluster.aio import wait_for
from pd_cluster import protocol
from pd_cluster.node.master_proof import MasterRefusedProof, prove_to_master

logger = logging.getLogger(__name__)

_CLOSE_POLICY_VIOLATION = 1008

MessageHandler = Callable[[BaseModel], Awaitable[None]]
StatusSource = Callable[[], protocol.NodeStatus]


def log_request_frame(direction: str, message: BaseModel) -> None:
    """A line in the node's log where a request starts or ends here, with the request id the
    master's request log carries (a retry's id ends in ``-rN``) and, where a job starts, the
    client's own ``X-Request-Id`` when it sent one: a request can be followed through a proxy."""
    if isinstance(message, protocol.TokenDeltas):
        for delta in message.deltas:
            if delta.finish_reason is not None:
                log_request_frame(direction, delta)
        return
    if isinstance(message, (protocol.PrefillJob, protocol.GenerateJob)):
        what = _job_words(message)
    elif isinstance(message, (protocol.FirstToken, protocol.TokenDelta)) and message.finish_reason is not None:
        what = f"finished ({message.finish_reason})"
    elif isinstance(message, protocol.RequestFailed):
        what = f"failed ({message.message})"
    elif isinstance(message, protocol.Abort):
        what = "abort"
    else:
        return
    logger.info("request %s: %s, %s", message.request_id, what, direction)


def _job_words(job: protocol.PrefillJob | protocol.GenerateJob) -> str:
    parts = [f"{len(job.token_ids)} prompt tokens"]
    if isinstance(job, protocol.PrefillJob):
        parts.append(f"decode node {job.decode_node_id}")
    if job.client_request_id:
        parts.append(f"client request id {job.client_request_id}")
    return f"{'prefill' if isinstance(job, protocol.PrefillJob) else 'generate'} job ({', '.join(parts)})"


#: A master's public address is dialled again when none of the workers it named was linked this long.
WORKERS_STALE_S = 15.0

#: Longest a frame may take to go out before the link is dropped (and dialled again).
SEND_TIMEOUT_S = 10.0


def coalesced(messages: list[BaseModel]) -> list[BaseModel]:
    """``messages`` in order, each run of adjacent ``TokenDeltas`` made one (its deltas in order):
    what queued while a frame went out leaves in fewer frames, each a socket write and a parse on
    the master. :func:`protocol.encode_frames` splits one that outgrows a frame again."""
    out: list[BaseModel] = []
    for message in messages:
        last = out[-1] if out else None
        if isinstance(message, protocol.TokenDeltas) and isinstance(last, protocol.TokenDeltas):
            out[-1] = protocol.TokenDeltas.model_construct(deltas=[*last.deltas, *message.deltas])
        else:
            out.append(message)
    return out


class RegistrationRefused(RuntimeError):
    """The master will never take this node as configured."""


def node_ws_url(master: str) -> str:
    parts = urlsplit(master if "://" in master else f"http://{master}")
    scheme = {"https": "wss", "wss": "wss"}.get(parts.scheme, "ws")
    return urlunsplit((scheme, parts.netloc, protocol.NODE_WS_PATH, "", ""))


class NodeAgent:
    def __init__(
        self,
        master: str,
        token: str,
        register: protocol.Register,
        status: StatusSource,
        on_message: MessageHandler,
        *,
        reconnect_s: float = 0.1,
        max_backoff_s: float = 1.0,
        outbox_size: int = 65536,
        on_link_change: Callable[[], None] | None = None,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> None:
        self.url = node_ws_url(master)
        #: Verifies a ``wss://`` master's certificate (None: the system's CAs), for the host name
        #: ``server_name`` when the URL holds one of that name's addresses.
        self._tls = tls
        self._server_name = server_name
        #: Told when the link registers or drops (the node's view over all its masters).
        self._on_link_change = on_link_change
        #: The id of the master this link last registered with.
        self.master_id: str | None = None
        #: Told that id when a registered link drops: the master has settled that node's requests.
        self.on_link_lost: Callable[[str], None] | None = None
        #: Told the workers' URLs when this link reached a master of several workers on its public
        #: address (the link then ends: the node links to each worker instead). None: stay linked.
        self.on_redirect: Callable[[list[str]], None] | None = None
        self._token = token
        self.register_msg = register
        self._status = status
        self._on_message = on_message
        self._reconnect_s = reconnect_s
        self._max_backoff_s = max_backoff_s
        self._outbox: asyncio.Queue[BaseModel] = asyncio.Queue(maxsize=outbox_size)
        self.registered = asyncio.Event()
        self.stopped = asyncio.Event()
        self._closing = False
        #: When the frame going out now began to (loop time), None between frames: the reporter
        #: drops a link whose send stalls past SEND_TIMEOUT_S (a timer armed per frame cost the
        #: node's event loop about a tenth of its time at a small model's step rate).
        self._sending_since: float | None = None

    def send_nowait(self, message: BaseModel) -> None:
        """Queue a frame for the master; dropped (logged) only when the link is down for long."""
        log_request_frame("to the master", message)
        try:
            self._outbox.put_nowait(message)
        except asyncio.QueueFull:
            logger.error("outbox to the master is full; dropping a %s frame", getattr(message, "type", "?"))

    async def send(self, message: BaseModel) -> None:
        self.send_nowait(message)

    async def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, close the link, and stop reconnecting."""
        self.stop()

    def stop(self) -> None:
        """Close the link and stop reconnecting."""
        self._closing = True
        self.stopped.set()

    async def run(self) -> None:
        """Stay connected until :meth:`close`; raises RegistrationRefused on a final refusal."""
        backoff = self._reconnect_s
        while not self._closing:
            try:
                await self._session()
                backoff = self._reconnect_s
            except RegistrationRefused:
                raise
            except (OSError, asyncio.TimeoutError) as e:
                logger.warning("master at %s unreachable: %s", self.url, e or type(e).__name__)
            except Exception as e:  # websockets' own errors: closed, invalid status...
                logger.warning("link to the master dropped: %s", e or type(e).__name__)
            if self.registered.is_set():
                self.registered.clear()
                self._link_changed()
                if not self._closing and self.master_id is not None and self.on_link_lost is not None:
                    self.on_link_lost(self.master_id)
            if self._closing:
                break
            try:
                # Jitter: many nodes that lost one master do not knock on it in step.
                await wait_for(self.stopped.wait(), backoff * random.uniform(0.5, 1.0))
            except asyncio.TimeoutError:
                pass
            backoff = min(backoff * 2, self._max_backoff_s)

    def _link_changed(self) -> None:
        if self._on_link_change is not None:
            self._on_link_change()

    async def _session(self) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed

        # wss:// without a context of ours: websockets checks the certificate against the system's CAs.
        tls: dict[str, object] = {}
        if self.url.startswith("wss://"):
            if self._tls is not None:
                tls["ssl"] = self._tls
            if self._server_name is not None:
                tls["server_hostname"] = self._server_name
        async with connect(
            self.url, max_size=protocol.MAX_MESSAGE_BYTES + 65536, **tls,
            open_timeout=5, ping_interval=20, ping_timeout=20, close_timeout=5,
            compression=None,  # frames stay on the cluster's network: deflate would cost both ends CPU a frame
        ) as ws:
            try:
                await prove_to_master(ws, self._token, self.register_msg.node_id)
                await ws.send(protocol.encode(self.register_msg))
                answer = protocol.parse_master_message(await wait_for(ws.recv(), 10))
            except MasterRefusedProof as e:
                raise RegistrationRefused(str(e)) from None
            except ConnectionClosed as e:
                if e.rcvd is not None and e.rcvd.code == _CLOSE_POLICY_VIOLATION:
                    # A wrong cluster token or a refusal: retrying cannot help.
                    raise RegistrationRefused(e.rcvd.reason or "refused by the master") from None
                raise
            if isinstance(answer, protocol.Refused):
                if getattr(answer, "retryable", False):
                    raise OSError(f"master asked to retry registration: {answer.reason}")
                raise RegistrationRefused(answer.reason)
            if not isinstance(answer, protocol.Registered):
                raise OSError(f"master answered registration with {answer.type!r}")
            if self._redirected(answer):
                return
            logger.info("registered with the master at %s as %s (%s)", self.url, self.register_msg.node_id,
                        self.register_msg.role)
            self.master_id = answer.master_id
            self.registered.set()
            self._link_changed()
            tasks = [asyncio.create_task(self._sender(ws)), asyncio.create_task(self._receiver(ws)),
                     asyncio.create_task(self._reporter())]
            stop = asyncio.create_task(self.stopped.wait())
            try:
                done, _ = await asyncio.wait([*tasks, stop], return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is not stop and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
            finally:
                for task in [*tasks, stop]:
                    task.cancel()
                await asyncio.gather(*tasks, stop, return_exceptions=True)
            if self._closing:
                await self._flush(ws)

    def _redirected(self, answer: protocol.Registered) -> bool:
        """True when the master listed its workers and this link is none of them: it is handed the list."""
        if not answer.masters or self.on_redirect is None:
            return False
        if self.url in {node_ws_url(url) for url in answer.masters}:
            return False
        logger.info("the master at %s runs %d workers; linking to each", self.url, len(answer.masters))
        self.on_redirect(answer.masters)
        return True

    async def _flush(self, ws) -> None:
        """Send what is still queued (a drained node's last frames) before closing."""
        while not self._outbox.empty():
            for frame in protocol.encode_frames(self._outbox.get_nowait()):
                async with asyncio.timeout(5):
                    await ws.send(frame)

    async def _sender(self, ws) -> None:
        loop = asyncio.get_running_loop()
        queue = self._outbox
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            for message in coalesced(batch):
                for frame in protocol.encode_frames(message):
                    self._sending_since = loop.time()
                    await ws.send(frame)
            self._sending_since = None

    async def _reporter(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            since = self._sending_since
            if since is not None and loop.time() - since > SEND_TIMEOUT_S:
                raise TimeoutError(f"a frame to the master took over {SEND_TIMEOUT_S:.0f}s to go out")
            self.send_nowait(self._status())
            await asyncio.sleep(protocol.STATUS_INTERVAL_S)

    async def _receiver(self, ws) -> None:
        """Hand each frame from the master to the node, in order."""
        async for frame in ws:
            try:
                message = protocol.parse_master_message(frame)
            except ValueError as e:
                logger.error("malformed frame from the master dropped: %s", str(e)[:300])
                continue
            log_request_frame("from the master", message)
            try:
                await self._on_message(message)
            except Exception:
                logger.exception("handling %s from the master failed", message.type)


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
