"""Under uvicorn's httptools server a directly written token goes to the connection's transport
as that server's ``send`` would write it: the client reads the same chunked bytes. Where ``send``
would wait or do something else (a paused or closed connection, a response not started or
ended), the write is left to ``send``."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from types import SimpleNamespace
from unittest import mock

import httpx
import uvicorn

from master.direct_send import DirectSend, _ChunkedWrite
from master.event_stream import EventStreamResponse
from master.server_send import MasterApp
from tests.master_fakes import wait_until


async def test_direct_writes_reach_the_client_as_chunks_of_the_servers_own_encoding(monkeypatch):
    bound: list[bool] = []
    taken: list[bool] = []
    write = _ChunkedWrite.write

    def counted(self: _ChunkedWrite, body: bytes) -> bool:
        taken.append(write(self, body))
        return taken[-1]

    monkeypatch.setattr(_ChunkedWrite, "write", counted)

    def answer() -> EventStreamResponse:
        direct = DirectSend()

        async def events() -> AsyncIterator[str]:
            yield "data: opening\n\n"  # through the server's send
            bound.append(direct._chunked is not None)
            for i in range(3):
                assert direct.ready
                direct.write(f"data: {i}\n\n".encode())
                await direct.settle()
            yield "data: [DONE]\n\n"

        return EventStreamResponse(events(), lambda: None, direct=direct)

    app = MasterApp()
    app.add_api_route("/stream", answer, methods=["GET"])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http="httptools", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await wait_until(lambda: server.started, 10.0, "uvicorn to start")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(2):  # a kept-alive connection's next answer too
                answer_ = await client.get("/stream")
                assert answer_.status_code == 200
                assert answer_.text == "data: opening\n\ndata: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10.0)
        sock.close()
    assert bound == [True, True] and taken == [True] * 6


def _cycle(**state: object) -> SimpleNamespace:
    fields = dict(disconnected=False, flow=SimpleNamespace(write_paused=False), response_started=True,
                  response_complete=False, chunked_encoding=True, scope={"method": "GET"}, transport=mock.Mock())
    return SimpleNamespace(**{**fields, **state})


def test_only_a_write_send_would_make_at_once_is_taken():
    cycle = _cycle()
    assert _ChunkedWrite(cycle).write(b"data: x\n\n")
    cycle.transport.write.assert_called_once_with(b"9\r\ndata: x\n\n\r\n")
    for state in (dict(disconnected=True), dict(flow=SimpleNamespace(write_paused=True)),
                  dict(response_started=False), dict(response_complete=True), dict(chunked_encoding=False),
                  dict(scope={"method": "HEAD"})):
        other = _cycle(**state)
        assert not _ChunkedWrite(other).write(b"data: x\n\n"), state
        other.transport.write.assert_not_called()
    assert not _ChunkedWrite(_cycle()).write(b"")


def test_another_servers_send_keeps_the_send():
    async def send(message: dict) -> None:
        pass

    assert _ChunkedWrite.of(send) is None
    assert _ChunkedWrite.of(SimpleNamespace(send=print).send) is None
