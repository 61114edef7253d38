"""ASGI middleware that caps request bodies in size (413) and upload time (408), in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

from master.errors import error_body
from pd_cluster.aio import wait_for

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimitMiddleware:
    """Read an HTTP body up to ``max_bytes`` before the app sees it; answer 413 past that.

    The body is replayed to the app as one message, after which ``receive`` is the server's own,
    so disconnect detection keeps working.
    """

    def __init__(
        self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int, timeout_s: float = 60.0,
        on_refused: Callable[[str, int], None] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        #: Told (path, status) of every body this middleware refuses, so the app can count it.
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._reply(scope, send, 413, f"Request body exceeds {self.max_bytes} bytes.", "request_too_large")
            return
        chunks: list[bytes] = []
        size = 0
        first: Message | None = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            try:
                message = await wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                await self._reply(scope, send, 408, "Timed out reading the request body.", "request_timeout")
                return
            if message["type"] != "http.request":
                first = message  # a disconnect: hand it on
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reply(scope, send, 413, f"Request body exceeds {self.max_bytes} bytes.", "request_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay: Message = first or {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replaying_receive() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return replay
            return await receive()

        await self.app(scope, replaying_receive, send)

    async def _reply(self, scope: Scope, send: Send, status: int, message: str, code: str) -> None:
        if self.on_refused is not None:
            self.on_refused(scope.get("path", ""), status)
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
