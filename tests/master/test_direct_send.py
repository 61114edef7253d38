"""A streamed token is written to its client by the node frame's handler, in the same pass that
applies the frame (no wake-up of the stream's task a token): the bytes are those the stream's task
writes, a client that does not read holds back only its own stream, and it then gets every byte,
in order."""

from __future__ import annotations

import asyncio
import json
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

from master.answer_shapes import SHAPES, StreamHead
from master.answers import _stream, _StreamWriter, streamed
from master.app import create_app
from master.config import MasterSettings
from master.event_stream import EventStreamResponse
from master.fanout import FanOut, PromptChoices
from master.node_ws import handle_frame
from pd_cluster.bench.master_relay_path import _register
from pd_cluster.bench.stamped_nodes import _Job, frames_of
from pd_cluster.sampling_params import SamplingParams
from tests.master.test_sse_encoding import TRICKY

STEPS = 6


class Client:
    """A stream's ASGI side: the bytes it was sent. With ``blocked_after``, the body messages after
    that many wait for :attr:`reads` (a client that stopped reading)."""

    def __init__(self, blocked_after: int | None = None) -> None:
        self.body = bytearray()
        self.bodies = 0
        self.blocked_after = blocked_after
        self.reads = asyncio.Event()
        self.never = asyncio.get_running_loop().create_future()

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            self.bodies += 1
            if self.blocked_after is not None and self.bodies > self.blocked_after:
                await self.reads.wait()
        self.body += message.get("body", b"")

    async def receive(self) -> dict[str, Any]:
        return await self.never


async def _open(ctx: Any, direct: bool, client: Client, index: int) -> tuple[asyncio.Task, str, str]:
    """A streamed chat answer through the master's response, directly written or not: its task,
    its decode node and its attempt id."""
    req = SimpleNamespace(logprobs=None, parses_tool_calls=False, tool_names=set(), include_usage=False,
                          prompt_logprobs=None)
    r = ctx.relay.create(ctx.relay.new_request_id("chatcmpl"), list(range(1, 65)),
                         SamplingParams(max_tokens=STEPS, seed=0), True, time.monotonic())
    fan = FanOut(ctx.relay, [PromptChoices([r], 1)])
    await fan.admit()
    writer = _StreamWriter(ctx, fan, req, StreamHead(f"answer-{index}", SHAPES["chat"], 0, "m", False), None)
    response = streamed(fan, writer) if direct else EventStreamResponse(_stream(fan, writer), fan.hang_up)
    task = asyncio.create_task(response({"type": "http"}, client.receive, client.send))
    assert r.current is not None
    return task, r.decode_id, r.current.attempt_id


def _delta(attempt_id: str, step: int, stream: int) -> str:
    text = TRICKY[(step + stream) % len(TRICKY)]
    finish = ',"finish_reason":"length"' if step == STEPS - 1 else ""
    extra = ',"cached_tokens":0,"node_ttft_s":0.001' if step == 0 else ""
    return (f'{{"type":"token_delta","request_id":"{attempt_id}","token_ids":[{1000 + step}],'
            f'"text":{json.dumps(text)}{finish}{extra}}}')


@pytest.fixture
async def ctx():
    os.environ.setdefault("PD_CLUSTER_TOKEN", "direct-send-test")
    context = create_app(MasterSettings()).state.ctx
    yield context


async def _run(ctx: Any, clients: list[Client], direct: list[bool], written_at_once: list[list[bool]]) -> None:
    """Every stream's tokens, a frame a node a step; ``written_at_once[s]``: whether stream s's
    bytes grew in the frame's handler, before the loop ran any task."""
    records = {record.node_id: record for record in _register(ctx, 2)}
    opened = [await _open(ctx, d, c, i) for i, (d, c) in enumerate(zip(direct, clients))]
    for _ in range(5):
        await asyncio.sleep(0)  # the openings are sent and every task waits for its tokens
    for step in range(STEPS):
        before = [len(c.body) for c in clients]
        for node_id in records:
            deltas = [_delta(a, step, s) for s, (_, d, a) in enumerate(opened) if d == node_id]
            for frame in frames_of(deltas):
                handle_frame(ctx, records[node_id], frame)
        for s, c in enumerate(clients):
            written_at_once[s].append(len(c.body) > before[s])
        for _ in range(5):
            await asyncio.sleep(0)
    await asyncio.wait_for(asyncio.gather(*(task for task, _, _ in opened if not task.done())), 5.0)


async def test_a_frame_of_many_streams_is_written_in_its_handler_as_the_stream_tasks_write_it(ctx: Any):
    count = 12
    clients = [Client() for _ in range(2 * count)]
    at_once: list[list[bool]] = [[] for _ in clients]
    await _run(ctx, clients, [True] * count + [False] * count, at_once)
    for s in range(count):
        direct, tasked = bytes(clients[s].body), bytes(clients[count + s].body)
        assert direct == tasked.replace(f"answer-{count + s}".encode(), f"answer-{s}".encode())
        assert direct.endswith(b"data: [DONE]\n\n") and direct.count(b"data: ") == STEPS + 2
        # every token but the last (its finish reason ends the stream in its task) is out at once
        assert at_once[s] == [True] * (STEPS - 1) + [False]
        assert not any(at_once[count + s])


async def test_a_client_that_does_not_read_holds_back_only_its_own_stream(ctx: Any):
    clients = [Client(blocked_after=1), Client(), Client()]  # the first reads its opening, then stops
    at_once: list[list[bool]] = [[] for _ in clients]
    run = asyncio.create_task(_run(ctx, clients, [True] * 3, at_once))
    deadline = time.monotonic() + 5.0
    while not all(len(at_once[s]) == STEPS for s in (1, 2)) and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    assert at_once[1] == at_once[2] == [True] * (STEPS - 1) + [False]
    assert clients[0].body.count(b"data: ") == 1  # its opening only
    clients[0].reads.set()
    await asyncio.wait_for(run, 5.0)
    # it then got every byte, in order: those of a stream that its task answered
    reference = [Client() for _ in clients]
    await _run(create_app(MasterSettings()).state.ctx, reference, [False] * 3, [[] for _ in reference])
    assert bytes(clients[0].body) == bytes(reference[0].body)
