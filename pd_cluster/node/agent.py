"""A node's link to one master: dial its websocket, register, report status, relay messages.

A node registers with every master it is given, a link each (:mod:`.master_links`), so any
master can route to it. Each link reconnects when its master restarts
or the socket drops, with a short first delay and a capped, jittered backoff (a restarted master
is found again within about a second), and re-registers; a refusal that cannot change (wrong
model, wrong token, a master that cannot prove it holds the cluster token) stops the node.
Before registering, both ends prove they hold the cluster token (:mod:`.master_proof`); the
token itself is never sent. A ``https://`` master is dialed over ``wss://``, its certificate
checked against the CA the node was given.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
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
