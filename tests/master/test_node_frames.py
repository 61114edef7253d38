"""A registered node's frames are applied as the socket reads them, outside any task, in the order
the node sent them: those before the handler asked for them, and those behind frames still
queued, take the connection's queue as before."""

from __future__ import annotations

import asyncio
import socket
from typing import Any
from unittest import mock

import uvicorn
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect

from master.node_frames import NodeFrameProtocol, frame_reader
from tests.master_fakes import wait_until


async def test_frames_after_the_hook_are_applied_in_the_read_outside_any_task():
    queued: list[str] = []
    inline: list[tuple[str, bool]] = []
    done = asyncio.Event()

    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        reader = frame_reader(ws.scope)
        assert reader is not None
        queued.append(await ws.receive_text())  # before the hook: through the queue
        reader.on_frame = lambda text: inline.append((text, asyncio.current_task() is None))
        await ws.send_text("hooked")
        message = await ws.receive()  # only the close comes this way now
        assert message["type"] == "websocket.disconnect"
        reader.on_frame = None
        done.set()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[WebSocketRoute("/ws", endpoint)]), log_level="warning",
                                           ws=NodeFrameProtocol, lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await wait_until(lambda: server.started, 10.0, "uvicorn to start")
        async with connect(f"ws://127.0.0.1:{port}/ws") as client:
            await client.send("first")
            assert await asyncio.wait_for(client.recv(), 5.0) == "hooked"
            for i in range(50):
                await client.send(f"frame {i}")
            await wait_until(lambda: len(inline) == 50, 5.0, "the frames")
        await asyncio.wait_for(done.wait(), 5.0)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10.0)
        sock.close()
    assert queued == ["first"]
    assert inline == [(f"frame {i}", True) for i in range(50)]


def _protocol(on_frame: Any, queued: int) -> NodeFrameProtocol:
    proto = NodeFrameProtocol.__new__(NodeFrameProtocol)  # just the state the hand-over reads
    proto.queue = asyncio.Queue()
    for i in range(queued):
        proto.queue.put_nowait({"type": "websocket.receive", "text": f"queued {i}"})
    proto.on_frame, proto.close_sent, proto.read_paused = on_frame, False, True
    proto.transport = mock.Mock()
    return proto


def _read(proto: NodeFrameProtocol, text: str, kind: str = "text") -> None:
    proto.frames, proto.curr_msg_data_type = [text.encode()], kind  # type: ignore[assignment]
    proto.send_receive_event_to_app()


async def test_a_frame_behind_queued_ones_waits_its_turn_in_the_queue():
    seen: list[str] = []
    proto = _protocol(seen.append, queued=1)
    _read(proto, "behind")
    assert seen == [] and proto.queue.qsize() == 2  # behind the queued frame
    proto.queue.get_nowait()
    proto.queue.get_nowait()
    _read(proto, "next")
    assert seen == ["next"] and proto.queue.empty()
    _read(proto, "binary", kind="bytes")  # not a text frame: the queue's
    assert seen == ["next"] and proto.queue.get_nowait() == {"type": "websocket.receive", "bytes": b"binary"}
    proto.on_frame = None
    _read(proto, "unhooked")
    assert seen == ["next"] and proto.queue.get_nowait()["text"] == "unhooked"
