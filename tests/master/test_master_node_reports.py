"""A node's report that the master cannot apply never leaves a gap in an answer: the request it was
about ends at once with an error event in OpenAI's shape that names the cause, and is aborted on
its nodes, while other requests go on. The same when running a lost node's request again fails.

Real sockets and the official openai client; the nodes are test nodes that speak the protocol and
send reports that look valid but cannot be applied.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from pd_cluster import protocol
from tests.master_fakes import (
    CHAT_MESSAGES, MODEL, FakeNode, LiveMaster, make_settings, serve_one, wait_until, wait_warm, write_model_dir,
)

#: A token id that fits the protocol's integers but no int32 vocabulary: hashing a prompt that holds
#: it (routing a migrated stream by its prefix) raises.
OUT_OF_RANGE_TOKEN = 2**31


async def _stream(client: openai.AsyncOpenAI) -> tuple[str, openai.APIError | None]:
    """A streamed chat answer's text, and the error its stream ended with (None: it finished)."""
    stream = await client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=8, stream=True)
    text = ""
    try:
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
    except openai.APIError as exc:
        return text, exc
    return text, None


async def _started(
    master: LiveMaster, client: openai.AsyncOpenAI, prefill: FakeNode
) -> tuple[asyncio.Task, protocol.PrefillJob, Any]:
    """A streamed request under way: the task reading it, its job on ``prefill``, and the master's request."""
    reading = asyncio.create_task(_stream(client))
    job = await prefill.next_job()
    return reading, job, master.ctx.relay.attempts[job.request_id]


async def _join(master: LiveMaster, *names: str) -> list[FakeNode]:
    nodes = [FakeNode(master, name, "prefill" if name.startswith("p") else "decode") for name in names]
    for node in nodes:
        assert isinstance(await node.join(), protocol.Registered)
    return nodes


@pytest.fixture
async def master(tmp_path: Path):
    # A deadline far past the test's waits: a request left waiting fails the test instead of timing out.
    async with LiveMaster(make_settings(write_model_dir(tmp_path), request_timeout_s=120.0)) as live:
        yield live


@pytest.fixture
async def client(master):
    c = openai.AsyncOpenAI(base_url=f"{master.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    yield c
    await c.close()


async def test_a_report_whose_handling_raises_ends_its_stream_with_an_error_and_aborts_it(master, client):
    prefill, decode = await _join(master, "p0", "d0")
    await wait_warm(master)
    other, other_job, _ = await _started(master, client, prefill)
    broken, job, r = await _started(master, client, prefill)
    # A negative byte count parses, but no counter can go down: applying the first token raises.
    await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=10, text="o", transfer_bytes=-1))
    await wait_until(lambda: r.current.first_token_seen, what="the first token to be taken up")
    # D goes on as a real one would; none of it may reach the client after the gap.
    await decode.send(protocol.TokenDelta(request_id=job.request_id, token_ids=[11], text="k", finish_reason="stop"))
    text, error = await asyncio.wait_for(broken, 10)
    assert text == "" and error is not None
    assert error.code == "node_report_failed"
    assert "could not apply prefill node p0's first_token report" in error.message and "ValueError" in error.message
    await wait_until(lambda: job.request_id in prefill.aborts and job.request_id in decode.aborts,
                     what="the request to be aborted on both nodes")
    # The other request is untouched.
    await serve_one(prefill, decode, [(10, "o"), (11, "k")], job=other_job)
    assert await asyncio.wait_for(other, 10) == ("ok", None)
    await prefill.close()
    await decode.close()


async def test_a_malformed_token_report_ends_its_stream_with_an_error(master, client):
    prefill, decode = await _join(master, "p0", "d0")
    await wait_warm(master)
    broken, job, r = await _started(master, client, prefill)
    await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=10, text="o"))
    await wait_until(lambda: r.output_ids, what="the first token to reach the stream")
    malformed = {"type": "token_delta", "request_id": job.request_id, "token_ids": ["eleven"], "text": "k"}
    await decode.send(json.dumps(malformed))
    await decode.send(protocol.TokenDelta(request_id=job.request_id, token_ids=[12], text="!", finish_reason="stop"))
    text, error = await asyncio.wait_for(broken, 10)
    assert text == "o" and error is not None  # never "o!": the token in between was lost
    assert error.code == "node_report_failed" and "decode node d0 sent a malformed token_delta report" in error.message
    await wait_until(lambda: job.request_id in prefill.aborts and job.request_id in decode.aborts,
                     what="the request to be aborted on both nodes")
    await prefill.close()
    await decode.close()


async def test_a_request_that_cannot_be_run_again_after_its_node_is_lost_ends_at_once(master, client):
    prefill, d0 = await _join(master, "p0", "d0")
    await wait_warm(master)
    good, good_job, _ = await _started(master, client, prefill)
    broken, job, r = await _started(master, client, prefill)
    await serve_one(prefill, d0, [(10, "o"), (11, "k")], job=good_job, finish_reason=None)  # streams on, on d0
    await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=10, text="o"))
    await wait_until(lambda: r.output_ids, what="the first token")
    await d0.send(protocol.TokenDelta(request_id=job.request_id, token_ids=[OUT_OF_RANGE_TOKEN, 11, 11, 11, 11],
                                      text="kkkkk"))
    await wait_until(lambda: len(r.output_ids) == 6, what="D's tokens to reach the stream")
    # Another D, whose prefix index makes routing hash the migrated stream's blocks.
    (d1,) = await _join(master, "d1")
    await wait_warm(master, pairs=2)
    await d1.send(protocol.KVEvents(stored=[12345]))
    await wait_until(lambda: len(master.ctx.registry.nodes["d1"].prefix), what="d1's prefix index")

    await d0.close()  # lost: both streams must move to d1
    text, error = await asyncio.wait_for(broken, 10)  # at once, not at its deadline
    assert text == "okkkkk" and error is not None and error.code == "rerun_failed"
    assert "decode node d0 was lost" in error.message
    moved = await prefill.next_job()  # the other stream still moves, and goes on where it was
    assert moved.request_id.startswith(good_job.request_id) and moved.decode_node_id == "d1"
    assert moved.token_ids == good_job.token_ids + [10, 11]
    await serve_one(prefill, d1, [(12, "!"), (13, "?")], job=moved)
    assert await asyncio.wait_for(good, 10) == ("ok!?", None)
    await prefill.close()
    await d1.close()
