"""The master owns each request until it ends: it knows its P and its D all along, re-runs it when
either is lost (or the handover stalls), migrates streams that already reached the client, and
makes a removed node drop what it held. Nodes here are protocol-level fakes; the same faults
with real processes are in tests/cluster/test_faults_cluster.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from pd_cluster import protocol
from tests.master_fakes import (
    ADMIN_HEADERS,
    CHAT_MESSAGES,
    MODEL,
    FakeNode,
    LiveMaster,
    make_settings,
    wait_until,
    wait_warm,
    write_model_dir,
)


@pytest.fixture
async def master(tmp_path: Path):
    async with LiveMaster(make_settings(write_model_dir(tmp_path), handoff_timeout_s=1.0, stale_after_s=0.2)) as m:
        yield m


async def _join(master: LiveMaster, node_id: str, role: str) -> FakeNode:
    node = FakeNode(master, node_id, role)
    reply = await node.join()
    assert isinstance(reply, protocol.Registered), reply
    return node


def _stream_text(text: str) -> tuple[str, list[dict]]:
    payloads = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    pieces = "".join(p["choices"][0].get("text", "") for p in payloads if p.get("choices"))
    return pieces, payloads


async def _stream_call(master: LiveMaster, max_tokens: int = 5) -> asyncio.Task:
    body = {"model": MODEL, "prompt": "hi", "stream": True, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True}}
    return asyncio.create_task(master.http.post("/v1/completions", json=body))


async def test_prefill_lost_between_first_token_and_handover_reruns_the_request(master):
    p0 = await _join(master, "p0", "prefill")
    d0 = await _join(master, "d0", "decode")
    await wait_warm(master)
    call = await _stream_call(master)
    job = await p0.next_job()
    await p0.send(protocol.FirstToken(request_id=job.request_id, token_id=20, text="A"))
    relay = master.ctx.relay
    await wait_until(lambda: relay.attempts[job.request_id].sent, what="the first token to reach the client")
    assert job.request_id in master.ctx.registry.nodes["p0"].inflight  # P still owns it
    p1 = await _join(master, "p1", "prefill")
    await wait_warm(master, 2)
    await p0.close()
    retry = await p1.next_job()
    # The first token already reached the client: it is part of the prompt now.
    assert retry.token_ids == job.token_ids + [20] and retry.sampling.max_tokens == 4
    await wait_until(lambda: job.request_id in d0.aborts, what="D to be told to drop the dead attempt")
    await p1.send(protocol.FirstToken(request_id=retry.request_id, token_id=21, text="B"))
    await d0.send(protocol.TokenDelta(request_id=retry.request_id, token_ids=[22, 23, 24], text="CDE",
                                      finish_reason="length"))
    response = await call
    text, payloads = _stream_text(response.text)
    assert text == "ABCDE" and not any("error" in p for p in payloads)
    await p1.close()
    await d0.close()


async def test_a_stalled_handover_is_rerun_after_the_handoff_deadline(master):
    p0 = await _join(master, "p0", "prefill")
    d0 = await _join(master, "d0", "decode")
    await wait_warm(master)
    call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}))
    job = await p0.next_job()
    await p0.send(protocol.FirstToken(request_id=job.request_id, token_id=20, text="A"))
    # Neither KVTransferred nor a token from D: after handoff_timeout_s the request runs again.
    retry = await p0.next_job(timeout=5.0)
    assert retry.request_id != job.request_id and retry.token_ids == job.token_ids  # nothing was shown yet
    assert job.request_id in p0.aborts and job.request_id in d0.aborts
    await p0.send(protocol.FirstToken(request_id=retry.request_id, token_id=21, text="B"))
    await p0.send(protocol.KVTransferred(request_id=retry.request_id, bytes=10, seconds=0.01))
    await d0.send(protocol.TokenDelta(request_id=retry.request_id, token_ids=[22], text="C", finish_reason="length"))
    assert (await call).json()["choices"][0]["text"] == "BC"
    await p0.close()
    await d0.close()


async def test_decode_lease_expiry_reported_as_failure_reruns_the_request(master):
    p0 = await _join(master, "p0", "prefill")
    d0 = await _join(master, "d0", "decode")
    await wait_warm(master)
    call = await _stream_call(master, max_tokens=3)
    job = await p0.next_job()
    await p0.send(protocol.FirstToken(request_id=job.request_id, token_id=20, text="A"))
    await d0.send(protocol.RequestFailed(request_id=job.request_id, message="the KV lease ran out"))
    retry = await p0.next_job()
    assert retry.token_ids == job.token_ids + [20] and retry.sampling.max_tokens == 2
    await p0.send(protocol.FirstToken(request_id=retry.request_id, token_id=21, text="B"))
    await d0.send(protocol.TokenDelta(request_id=retry.request_id, token_ids=[22], text="C", finish_reason="length"))
    text, _ = _stream_text((await call).text)
    assert text == "ABC"
    await p0.close()
    await d0.close()


async def test_decode_lost_mid_stream_migrates_the_stream_to_another_decode(master):
    p0 = await _join(master, "p0", "prefill")
    d0 = await _join(master, "d0", "decode")
    d1 = await _join(master, "d1", "decode")
    await wait_warm(master, 2)
    call = await _stream_call(master, max_tokens=6)
    job = await p0.next_job()
    first_decode = d0 if job.decode_node_id == "d0" else d1
    other = d1 if first_decode is d0 else d0
    await p0.send(protocol.FirstToken(request_id=job.request_id, token_id=20, text="A"))
    await first_decode.send(protocol.TokenDelta(request_id=job.request_id, token_ids=[21, 22], text="BC"))
    relay = master.ctx.relay
    await wait_until(lambda: len(relay.requests[job.request_id.split("-r")[0]].output_ids) == 3, what="3 tokens")
    await first_decode.close()
    retry = await p0.next_job()
    assert retry.decode_node_id == other.node_id
    assert retry.token_ids == job.token_ids + [20, 21, 22] and retry.sampling.max_tokens == 3
    # The new P had the whole moved prompt cached; usage still counts cached tokens of the client's prompt.
    await p0.send(protocol.FirstToken(request_id=retry.request_id, token_id=23, text="D",
                                      cached_tokens_prefill=len(retry.token_ids)))
    await other.send(protocol.TokenDelta(request_id=retry.request_id, token_ids=[24, 25], text="EF",
                                         finish_reason="length"))
    response = await call
    text, payloads = _stream_text(response.text)
    assert text == "ABCDEF" and not any("error" in p for p in payloads)
    usage = payloads[-1]["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] == len(job.token_ids)
    metrics = (await master.http.get("/metrics")).text
    assert "pdc_stream_migrations_total 1.0" in metrics and 'pdc_requests_total{status="ok"} 1.0' in metrics
    await p0.close()
    await other.close()


async def test_the_last_failed_attempt_ends_the_stream_with_an_error_that_says_why(tmp_path: Path):
    settings = make_settings(write_model_dir(tmp_path), max_attempts=2)
    async with LiveMaster(settings) as master:
        p0 = await _join(master, "p0", "prefill")
        d0 = await _join(master, "d0", "decode")
        await wait_warm(master)
        call = await _stream_call(master)
        job = await p0.next_job()
        await p0.send(protocol.FirstToken(request_id=job.request_id, token_id=20, text="A"))
        # Two sockets: D's failure must not overtake P's first token on its way into the master.
        relay = master.ctx.relay
        await wait_until(lambda: relay.attempts[job.request_id].sent, what="the first token to reach the client")
        await d0.send(protocol.RequestFailed(request_id=job.request_id, message="engine fell over"))
        retry = await p0.next_job()
        await d0.send(protocol.RequestFailed(request_id=retry.request_id, message="engine fell over again"))
        text, payloads = _stream_text((await call).text)
        assert text == "A"
        error = next(p["error"] for p in payloads if "error" in p)
        assert error["code"] == "node_lost" and "2 attempts" in error["message"]
        assert "engine fell over again" in error["message"]
        await p0.close()
        await d0.close()


async def test_removed_node_is_told_to_abort_and_cannot_rejoin_until_allowed(master):
    p0 = await _join(master, "p0", "prefill")
    d0 = await _join(master, "d0", "decode")
    await wait_warm(master)
    call = await _stream_call(master)
    job = await p0.next_job()
    await p0.send(protocol.FirstToken(request_id=job.request_id, token_id=20, text="A"))
    await p0.send(protocol.KVTransferred(request_id=job.request_id, bytes=10, seconds=0.01))
    relay = master.ctx.relay
    await wait_until(lambda: relay.attempts[job.request_id].handed_over, what="the handover")
    assert job.request_id not in master.ctx.registry.nodes["p0"].inflight  # P is out of it now
    response = await master.http.delete("/admin/nodes/d0", headers=ADMIN_HEADERS)
    assert response.status_code == 200
    await wait_until(lambda: job.request_id in d0.aborts, what="the removed D to be told to abort")
    await asyncio.wait_for(d0.closed.wait(), 5.0)
    # The same id is refused (retryable: it may be allowed again) ...
    again = FakeNode(master, "d0", "decode")
    refused = await again.join()
    assert isinstance(refused, protocol.Refused) and refused.retryable and "allow" in refused.reason
    # ... until an operator allows it.
    allowed = await master.http.post("/admin/nodes/d0/allow", headers=ADMIN_HEADERS)
    assert allowed.status_code == 200 and allowed.json()["allowed"] is True
    assert (await master.http.post("/admin/nodes/d0/allow", headers=ADMIN_HEADERS)).status_code == 404
    back = await _join(master, "d0", "decode")
    # Nowhere to migrate but back to d0 once it has rejoined, under a new attempt id.
    retry = await p0.next_job()
    assert retry.request_id != job.request_id and retry.token_ids == job.token_ids + [20]
    await p0.send(protocol.FirstToken(request_id=retry.request_id, token_id=21, text="B"))
    await back.send(protocol.TokenDelta(request_id=retry.request_id, token_ids=[22, 23, 24], text="CDE",
                                        finish_reason="length"))
    text, _ = _stream_text((await call).text)
    assert text == "ABCDE"
    await p0.close()
    await back.close()


async def test_a_node_reporting_an_ended_attempt_is_told_to_abort_it(master):
    p0 = await _join(master, "p0", "prefill")
    d0 = await _join(master, "d0", "decode")
    await wait_warm(master)
    call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}))
    job = await p0.next_job()
    await p0.send(protocol.FirstToken(request_id=job.request_id, token_id=20, text="A", finish_reason="length"))
    assert (await call).status_code == 200
    d0.aborts.clear()
    # D comes back from a freeze still holding the ended attempt, and something the master never ran.
    d0.status = d0.status.model_copy(update={"request_ids": [job.request_id, "other-masters-request"]})
    await wait_until(lambda: job.request_id in d0.aborts, what="an abort of the stale attempt")
    await asyncio.sleep(0.3)  # a few more status reports: aborts are not repeated every report
    assert d0.aborts.count(job.request_id) == 1 and "other-masters-request" not in d0.aborts
    await p0.close()
    await d0.close()
