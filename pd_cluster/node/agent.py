"""A node's link to the master: dial the websocket, register, report status, relay messages.

The link reconnects (with backoff) when the master restarts or the socket drops, and
re-registers; a refusal that cannot change (wrong model, wrong token) stops the node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel

from pd_cluster.aio import wait_for
from pd_cluster import protocol

logger = logging.getLogger(__name__)

_CLOSE_POLICY_VIOLATION = 1008

MessageHandler = Callable[[BaseModel], Awaitable[None]]
StatusSource = Callable[[], protocol.NodeStatus]


def log_request_frame(direction: str, message: BaseModel) -> None:
    """A line in the node's log where a request starts or ends here, with the request id the
    master's request log and its ``X-Request-Id`` answer carry (a retry's id ends in ``-rN``)."""
    if isinstance(message, protocol.PrefillJob):
        what = f"prefill job ({len(message.token_ids)} prompt tokens, decode node {message.decode_node_id})"
    elif isinstance(message, (protocol.FirstToken, protocol.TokenDelta)) and message.finish_reason is not None:
        what = f"finished ({message.finish_reason})"
    elif isinstance(message, protocol.RequestFailed):
        what = f"failed ({message.message})"
    elif isinstance(message, protocol.Abort):
        what = "abort"
    else:
        return
    logger.info("request %s: %s, %s", message.request_id, what, direction)


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
        reconnect_s: float = 1.0,
        max_backoff_s: float = 10.0,
        outbox_size: int = 65536,
    ) -> None:
        self.url = node_ws_url(master)
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
            self.registered.clear()
            if self._closing:
                break
            try:
                await wait_for(self.stopped.wait(), backoff)
            except asyncio.TimeoutError:
                pass
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _session(self) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed

        headers = {"Authorization": f"Bearer {self._token}"}
        async with connect(
            self.url, additional_headers=headers, max_size=protocol.MAX_MESSAGE_BYTES + 65536,
            open_timeout=10, ping_interval=20, ping_timeout=20, close_timeout=5,
        ) as ws:
            try:
                await ws.send(protocol.encode(self.register_msg))
                answer = protocol.parse_master_message(await wait_for(ws.recv(), 10))
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
            logger.info("registered with the master at %s as %s (%s)", self.url, self.register_msg.node_id,
                        self.register_msg.role)
            self.registered.set()
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

    async def _flush(self, ws) -> None:
        """Send what is still queued (a drained node's last frames) before closing."""
        while not self._outbox.empty():
            async with asyncio.timeout(5):
                await ws.send(protocol.encode(self._outbox.get_nowait()))

    async def _sender(self, ws) -> None:
        while True:
            message = await self._outbox.get()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # arrives as the send completes, and this task would never stop.
            async with asyncio.timeout(10):
                await ws.send(protocol.encode(message))

    async def _reporter(self) -> None:
        while True:
            self.send_nowait(self._status())
            await asyncio.sleep(protocol.STATUS_INTERVAL_S)

    async def _receiver(self, ws) -> None:
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
