"""A streamed answer's start passes every middleware (they read its status and headers), and its
body messages go straight to the server's ``send``: the client gets the same bytes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx

from master.event_stream import EventStreamResponse
from master.server_send import SERVER_SEND, MasterApp, body_send


class Watcher:
    """A middleware that records the type of every message its ``send`` sees."""

    def __init__(self, app: Any, seen: list[str]) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def watching(message: dict[str, Any]) -> None:
            self.seen.append(message["type"])
            await send(message)

        await self.app(scope, receive, watching)


async def _events() -> AsyncIterator[str]:
    for i in range(3):
        yield f"data: {i}\n\n"


async def test_a_streamed_body_skips_the_middleware_and_reaches_the_client_whole():
    seen: list[str] = []
    app = MasterApp()
    app.add_api_route("/stream", lambda: EventStreamResponse(_events(), lambda: None), methods=["GET"])
    app.add_middleware(Watcher, seen=seen)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        answer = await client.get("/stream")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
    assert answer.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert seen == ["http.response.start"]


async def test_other_answers_pass_every_middleware_and_an_app_without_the_key_sends_through_its_own():
    seen: list[str] = []
    app = MasterApp()
    app.add_api_route("/plain", lambda: {"ok": True}, methods=["GET"])
    app.add_middleware(Watcher, seen=seen)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        assert (await client.get("/plain")).json() == {"ok": True}
    assert seen == ["http.response.start", "http.response.body"]

    async def send(message: dict[str, Any]) -> None:
        pass

    assert body_send({"type": "http"}, send) is send
    assert body_send({"type": "http", SERVER_SEND: print}, send) is print
