"""The HTTP response of a streamed answer: SSE text written straight to the ASGI ``send``.

Each item of the answer's iterator is every event ready at one wake-up, sent as one body
message (one socket write, however many tokens it holds). A watcher task reads ``receive``
and, when the client leaves, calls ``on_disconnect`` so the answer stops and releases its
requests at once. Starlette's ``StreamingResponse`` does the same with a task group and an
iterator step per event. A single choice's plain tokens take a shorter path: the node's frame
handler writes them through :class:`~master.direct_send.DirectSend`, with no wake-up of this task.
Body messages go to the server's own ``send`` (:mod:`master.server_send`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from master.direct_send import DirectSend
from master.relay_request import ClientDisconnected
from master.server_send import body_send


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_disconnect: Callable[[], None],
                 headers: Mapping[str, str] | None = None, direct: DirectSend | None = None) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        #: Bound to ``send`` once the head is sent: writes from outside this task (the events'
        #: iterator settles them before it yields again).
        self.direct = direct
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(self._watch(receive))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            body = body_send(scope, send)  # past the middleware: they read a 200 answer's start only
            if self.direct is not None:
                self.direct.bind(body)
            async with contextlib.aclosing(self.events) as events:
                async for text in events:
                    await body({"type": "http.response.body", "body": text.encode(), "more_body": True})
            await body({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientDisconnected:
            pass  # the answer was released; there is nobody to tell
        finally:
            watcher.cancel()
            if self.direct is not None:
                self.direct.discard()

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.on_disconnect()
