"""Nodes joining and leaving over the websocket, and the settlement of their requests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import websockets

from pd_cluster import protocol
from pd_cluster.block_hash import block_hashes
from pd_cluster.cluster_proof import new_nonce
from tests.master_fakes import (
    ADMIN_HEADERS,
    CHAT_MESSAGES,
    CLUSTER_TOKEN,
    MODEL,
    FakeNode,
    LiveMaster,
    kv_spec,
    make_settings,
    register_msg,
    serve_one,
    wait_until,
    wait_warm,
    write_model_dir,
)


@pytest.fixture
async def master(tmp_path: Path):
    async with LiveMaster(make_settings(write_model_dir(tmp_path))) as m:
        yield m


@pytest.fixture
async def bare_master():
    """A master that does not know the model: the first node sets it."""
    async with LiveMaster(make_settings(None)) as m:
        yield m


async def _join(master: LiveMaster, node_id: str, role: str, **register) -> FakeNode:
    node = FakeNode(master, node_id, role, **register)
    reply = await node.join()
    assert isinstance(reply, protocol.Registered) and reply.node_id == node_id
    return node


async def _close_code(node: FakeNode) -> int | None:
    assert node.ws is not None
    await asyncio.wait_for(node.ws.wait_closed(), 5.0)
    return node.ws.close_code


# ---- joining ------------------------------------------------------------------------------


async def _challenged(master: LiveMaster, node_id: str, nonce: str | None = None):
    """A bare socket that said hello: (socket, hello, the master's challenge)."""
    ws = await websockets.connect(master.ws_url)
    hello = protocol.LinkHello(node_id=node_id, nonce=nonce or new_nonce())
    await ws.send(protocol.encode(hello))
    challenge = protocol.LinkChallenge.model_validate_json(await asyncio.wait_for(ws.recv(), 5.0))
    return ws, hello, challenge


async def _refused_with_1008(ws, *frames: str) -> None:
    with pytest.raises(websockets.ConnectionClosed):
        for frame in frames:
            await ws.send(frame)
        while True:  # a Refused frame may come before the close
            await asyncio.wait_for(ws.recv(), 5.0)
    assert ws.close_code == 1008


async def test_node_that_sends_the_token_instead_of_a_proof_is_closed_with_1008(master):
    ws = await websockets.connect(master.ws_url, additional_headers={"Authorization": f"Bearer {CLUSTER_TOKEN}"})
    await _refused_with_1008(ws, protocol.encode(register_msg("old-node", "decode")))
    assert await master.nodes() == {}


async def test_master_proves_itself_first_and_refuses_a_wrong_proof(master):
    ws, hello, challenge = await _challenged(master, "intruder")
    proofs = protocol.link_transcript(hello, challenge.master_id, challenge.nonce)
    assert proofs.verify(CLUSTER_TOKEN, "listener", challenge.proof)  # the master holds our token
    wrong = protocol.LinkProof(proof=proofs.prove("wrong-token", "dialer"))
    await _refused_with_1008(ws, protocol.encode(wrong), protocol.encode(register_msg("intruder", "decode")))
    assert await master.nodes() == {}


async def test_a_replayed_or_reflected_node_proof_is_refused(master):
    ws, hello, challenge = await _challenged(master, "d0")
    proof = protocol.link_transcript(hello, challenge.master_id, challenge.nonce).prove(CLUSTER_TOKEN, "dialer")
    await ws.send(protocol.encode(protocol.LinkProof(proof=proof)))
    await ws.send(protocol.encode(register_msg("d0", "decode")))
    assert isinstance(protocol.parse_master_message(await asyncio.wait_for(ws.recv(), 5.0)), protocol.Registered)
    await ws.close()
    await wait_until(lambda: "d0" not in master.ctx.registry.nodes, what="d0 to leave")

    # The same hello and proof again: the master's nonce is new, the old proof worthless.
    replay, _, again = await _challenged(master, "d0", hello.nonce)
    assert again.nonce != challenge.nonce
    await _refused_with_1008(replay, protocol.encode(protocol.LinkProof(proof=proof)),
                             protocol.encode(register_msg("d0", "decode")))
    # The master's own proof sent back as the node's.
    reflect, _, challenge = await _challenged(master, "d1")
    await _refused_with_1008(reflect, protocol.encode(protocol.LinkProof(proof=challenge.proof)),
                             protocol.encode(register_msg("d1", "decode")))
    assert await master.nodes() == {}


async def test_a_node_registers_only_under_the_id_it_proved(master):
    ws, hello, challenge = await _challenged(master, "d0")
    proof = protocol.link_transcript(hello, challenge.master_id, challenge.nonce).prove(CLUSTER_TOKEN, "dialer")
    await ws.send(protocol.encode(protocol.LinkProof(proof=proof)))
    await ws.send(protocol.encode(register_msg("someone-else", "decode")))
    reply = protocol.parse_master_message(await asyncio.wait_for(ws.recv(), 5.0))
    assert isinstance(reply, protocol.Refused) and "proved the cluster token as 'd0'" in reply.reason
    assert await master.nodes() == {}


async def test_model_mismatch_is_refused_and_never_listed(master):
    node = FakeNode(master, "other", "decode", model="another-model", kv_spec=kv_spec(model="another-model"))
    reply = await node.join()
    assert isinstance(reply, protocol.Refused) and "model" in reply.reason and not reply.retryable
    assert await _close_code(node) == 1008
    assert await master.nodes() == {}


async def test_kv_shape_that_differs_from_the_model_config_is_refused(master):
    node = FakeNode(master, "wrong-shape", "prefill", kv_spec=kv_spec(num_layers=3))
    reply = await node.join()
    assert isinstance(reply, protocol.Refused) and "num_layers" in reply.reason
    assert await master.nodes() == {}


async def test_first_node_sets_the_cluster_kv_spec_for_the_rest(bare_master):
    first = await _join(bare_master, "p0", "prefill")
    for node_id, overrides in [("d-dtype", {"dtype": "bfloat16"}), ("d-block", {"block_size": 8})]:
        node = FakeNode(bare_master, node_id, "decode", kv_spec=kv_spec(**overrides))
        reply = await node.join()
        assert isinstance(reply, protocol.Refused), node_id
        assert next(iter(overrides)) in reply.reason
    other = FakeNode(bare_master, "d-model", "decode", model="m2", kv_spec=kv_spec(model="m2"))
    assert isinstance(await other.join(), protocol.Refused)
    assert list(await bare_master.nodes()) == ["p0"]
    models = (await bare_master.http.get("/v1/models")).json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    await first.close()


async def test_duplicate_node_id_is_refused(master):
    node = await _join(master, "p0", "prefill")
    twin = FakeNode(master, "p0", "prefill")
    reply = await twin.join()
    assert isinstance(reply, protocol.Refused) and "already" in reply.reason and reply.retryable
    assert list(await master.nodes()) == ["p0"]
    await node.close()


async def test_first_frame_must_be_a_valid_register(master):
    node = FakeNode(master, "n", "prefill")
    ws = await node.open()
    await ws.send(protocol.encode(protocol.NodeStatus()))
    assert isinstance(protocol.parse_master_message(await asyncio.wait_for(ws.recv(), 5.0)), protocol.Refused)
    node2 = FakeNode(master, "n2", "prefill")
    ws2 = await node2.open()
    await ws2.send("{not json")
    assert isinstance(protocol.parse_master_message(await asyncio.wait_for(ws2.recv(), 5.0)), protocol.Refused)
    assert await master.nodes() == {}


async def test_registered_nodes_are_listed_and_make_the_cluster_healthy(master):
    prefill = await _join(master, "p0", "prefill", auto_warm=False)
    assert (await master.http.get("/health")).status_code == 503
    decode = await _join(master, "d0", "decode")
    decode.status = protocol.NodeStatus(
        running=2, free_kv_tokens=1000, total_kv_tokens=4096, prefix_hit_tokens=30, prompt_tokens=120
    )
    await wait_until(lambda: master.ctx.registry.nodes["d0"].status.running == 2, what="status")
    # Both roles are here, but no channel is warm yet: not ready.
    health = await master.http.get("/health")
    assert health.status_code == 503 and health.json()["warm_pairs"] == 0
    prefill.warm_peers = ["d0"]
    await wait_warm(master)
    health = await master.http.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "prefill_nodes": 1, "decode_nodes": 1, "mixed_nodes": 0, "warm_pairs": 1}
    nodes = await master.nodes()
    assert nodes["d0"]["role"] == "decode" and nodes["d0"]["state"] == "active"
    assert nodes["d0"]["load"]["running"] == 2
    assert nodes["d0"]["kv"]["free_tokens"] == 1000 and nodes["d0"]["kv"]["total_tokens"] == 4096
    assert nodes["d0"]["prefix"]["hit_rate"] == 0.25
    metrics = (await master.http.get("/metrics")).text
    assert 'pdc_nodes{role="decode",state="active"} 1.0' in metrics
    assert "pdc_warm_channels 1.0" in metrics
    await prefill.close()
    await decode.close()


async def test_prefill_nodes_hear_of_every_change_in_the_decode_nodes(master):
    d0 = await _join(master, "d0", "decode")
    prefill = await _join(master, "p0", "prefill")
    # At registration: the decode nodes already there.
    await wait_until(lambda: prefill.decode_peers == {"d0": d0.register.data_address}, what="peers at join")
    d1 = await _join(master, "d1", "decode")
    await wait_until(lambda: prefill.decode_peers is not None and set(prefill.decode_peers) == {"d0", "d1"},
                     what="peers after a join")
    assert prefill.decode_peers["d1"] == d1.register.data_address
    await wait_warm(master, 2)
    nodes = await master.nodes()
    assert nodes["p0"]["data_plane"]["warm_peers"] == ["d0", "d1"]
    assert (await master.http.get("/admin/nodes", headers=ADMIN_HEADERS)).json()["warm_pairs"] == 2

    # A draining decode node is no longer listed, nor counted warm.
    assert (await master.http.post("/admin/nodes/d0/drain", headers=ADMIN_HEADERS)).status_code == 200
    await wait_until(lambda: prefill.decode_peers is not None and set(prefill.decode_peers) == {"d1"},
                     what="peers after a drain")
    assert master.ctx.registry.warm_pairs() == 1
    # Nor a decode node that left.
    await d1.close()
    await wait_until(lambda: prefill.decode_peers == {}, what="peers after a leave")
    assert master.ctx.registry.warm_pairs() == 0
    assert "pdc_warm_channels 0.0" in (await master.http.get("/metrics")).text
    assert d0.decode_peers is None  # decode nodes get no list
    await prefill.close()
    await d0.close()


async def test_requests_go_to_the_warm_pair_and_still_to_a_cold_one_when_none_is_warm(master):
    cold = await _join(master, "p0", "prefill", auto_warm=False)
    warm = await _join(master, "p1", "prefill", auto_warm=False)
    decode = await _join(master, "d0", "decode")
    # Nothing warm yet: still served (by the first P in id order), not queued.
    call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "a"}))
    await serve_one(cold, decode, [(5, "a")])
    assert (await call).status_code == 200
    # p1 warms its channel to d0: p0, although idle and first by id, gets no more work.
    warm.warm_peers = ["d0"]
    await wait_warm(master)
    for _ in range(3):
        call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "b"}))
        await serve_one(warm, decode, [(5, "a")])
        assert (await call).status_code == 200
    assert cold.jobs.empty()
    for node in (cold, warm, decode):
        await node.close()


async def test_malformed_and_oversized_frames_are_dropped_and_the_node_stays(master):
    node = await _join(master, "p0", "prefill")
    await node.send("{broken")
    await node.send(json.dumps({"type": "no_such_message"}))
    await node.send(json.dumps({"type": "status", "running": "many"}))
    await node.send(protocol.encode(protocol.Register(**node.register.model_dump())))
    await node.send("x" * (protocol.MAX_MESSAGE_BYTES + 1))
    await node.send(protocol.encode(protocol.KVEvents(stored=[1, 2, 3])))
    await wait_until(lambda: len(master.ctx.registry.nodes["p0"].prefix) == 3, what="kv events applied")
    assert "p0" in await master.nodes()
    await node.close()


# ---- leaving ------------------------------------------------------------------------------


async def test_missed_heartbeats_remove_the_node(master):
    node = await _join(master, "d0", "decode")
    node.heartbeat = False
    await wait_until(lambda: "d0" not in master.ctx.registry.nodes, timeout=6.0, what="heartbeat removal")
    await asyncio.wait_for(node.closed.wait(), 5.0)
    await node.close()


async def test_admin_drain_stops_routing_and_the_node_leaves_when_drained(master):
    p0 = await _join(master, "p0", "prefill")
    p1 = await _join(master, "p1", "prefill")
    decode = await _join(master, "d0", "decode")
    response = await master.http.post("/admin/nodes/p0/drain", headers=ADMIN_HEADERS)
    assert response.status_code == 200 and response.json()["state"] == "draining"
    await wait_until(lambda: p0.drains == 1, what="drain frame")
    metrics = (await master.http.get("/metrics")).text
    assert 'pdc_nodes{role="prefill",state="draining"} 1.0' in metrics
    call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "z"}))
    await serve_one(p1, decode, [(5, "a")])
    assert (await call).status_code == 200
    assert p0.jobs.empty()
    await p0.send(protocol.Drained())
    assert await _close_code(p0) == 1000
    assert "p0" not in await master.nodes()
    for node in (p0, p1, decode):
        await node.close()


async def test_admin_delete_closes_the_socket_and_forgets_the_node(master):
    node = await _join(master, "d0", "decode")
    response = await master.http.delete("/admin/nodes/d0", headers=ADMIN_HEADERS)
    assert response.status_code == 200
    await _close_code(node)
    assert await master.nodes() == {}
    await node.close()


# ---- settling requests of lost nodes --------------------------------------------------------


async def test_prefill_lost_before_its_first_token_is_retried_on_another_prefill(master):
    p0 = await _join(master, "p0", "prefill")
    decode = await _join(master, "d0", "decode")
    body = {"model": MODEL, "messages": CHAT_MESSAGES, "stream": True, "max_tokens": 3}
    call = asyncio.create_task(master.http.post("/v1/chat/completions", json=body))
    first = await p0.next_job()
    p1 = await _join(master, "p1", "prefill")
    await p0.close()
    retry = await p1.next_job()
    assert retry.request_id != first.request_id and retry.token_ids == first.token_ids
    assert retry.decode_node_id == "d0"  # the same D, which was still alive
    await wait_until(lambda: first.request_id in decode.aborts, what="abort of the old attempt on D")
    await serve_one(p1, decode, [(10, "a"), (11, "b")], job=retry)
    response = await call
    text = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content", "")
        for line in response.text.split("\n\n") if line.startswith("data: {")
    )
    assert text == "ab"
    await p1.close()
    await decode.close()


async def test_decode_lost_before_any_token_restarts_a_non_streaming_request(master):
    prefill = await _join(master, "p0", "prefill")
    d0 = await _join(master, "d0", "decode")
    call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}))
    first = await prefill.next_job()
    await prefill.send(protocol.FirstToken(request_id=first.request_id, token_id=5, text="a"))
    await d0.send(protocol.TokenDelta(request_id=first.request_id, token_ids=[6], text="b"))
    d1 = await _join(master, "d1", "decode")
    await d0.close()
    retry = await prefill.next_job()
    assert retry.decode_node_id == "d1"
    await serve_one(prefill, d1, [(7, "x"), (8, "y"), (9, "z")], job=retry, finish_reason="length")
    doc = (await call).json()
    assert doc["choices"][0]["text"] == "xyz" and doc["usage"]["completion_tokens"] == 3
    await prefill.close()
    await d1.close()


async def test_decode_lost_mid_stream_with_no_other_decode_ends_the_stream_with_its_cause(master):
    prefill = await _join(master, "p0", "prefill")
    decode = await _join(master, "d0", "decode")
    body = {"model": MODEL, "messages": CHAT_MESSAGES, "stream": True, "max_tokens": 5}
    call = asyncio.create_task(master.http.post("/v1/chat/completions", json=body))
    job = await prefill.next_job()
    await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=5, text="a"))
    await wait_until(lambda: master.ctx.relay.attempts[job.request_id].sent, what="first token sent")
    await decode.close()
    response = await call
    payloads = [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: {")]
    assert payloads[-2]["choices"][0]["finish_reason"] == "error"
    assert payloads[-1]["error"]["code"] == "node_lost"
    assert "decode node d0 was lost" in payloads[-1]["error"]["message"]
    assert response.text.rstrip().endswith("data: [DONE]")
    metrics = (await master.http.get("/metrics")).text
    assert 'pdc_requests_total{status="error"} 1.0' in metrics
    await prefill.close()


async def test_retryable_failure_is_retried_and_attempts_are_bounded(master):
    prefill = await _join(master, "p0", "prefill")
    decode = await _join(master, "d0", "decode")
    call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}))
    for _ in range(master.ctx.settings.max_attempts):
        job = await prefill.next_job()
        await prefill.send(protocol.RequestFailed(request_id=job.request_id, message="out of memory"))
    response = await call
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}))
    job = await prefill.next_job()
    await decode.send(protocol.RequestFailed(request_id=job.request_id, message="bad", retryable=False))
    response = await call
    assert response.status_code == 500 and "bad" not in response.json()["error"]["message"]
    await prefill.close()
    await decode.close()


async def test_cache_aware_routing_follows_kv_events_to_the_decode_node(master):
    prefill = await _join(master, "p0", "prefill")
    d0 = await _join(master, "d0", "decode")
    d1 = await _join(master, "d1", "decode")
    history = list(range(3, 43))
    await d1.send(protocol.KVEvents(stored=block_hashes(history, 4)))
    await wait_until(lambda: len(master.ctx.registry.nodes["d1"].prefix) == 10, what="kv events")
    await wait_warm(master, 2)
    for prompt in (history + [50, 51], list(range(43, 3, -1))):
        call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt}))
        job = await serve_one(prefill, d1, [(5, "a")])
        assert (await call).status_code == 200
        expected = "d1" if prompt[:40] == history else "d0"
        assert job.decode_node_id == expected
    for node in (prefill, d0, d1):
        await node.close()


async def test_a_chat_request_goes_to_the_decode_node_holding_its_rendered_prefix(master):
    """A chat prompt's blocks (hashed with its encoding, on the tokenizer thread) are looked up in
    the decode nodes' prefix indexes: the conversation whose rendered prefix a node announced goes
    there."""
    prefill = await _join(master, "p0", "prefill")
    d0 = await _join(master, "d0", "decode")
    d1 = await _join(master, "d1", "decode")
    history = [{"role": "user", "content": "a long first question, " * 4}, {"role": "assistant", "content": "ok"}]
    held = (await master.ctx.tokenizer.encode_chat(history)).ids
    await d1.send(protocol.KVEvents(stored=block_hashes(held, 4)))
    # d0 holds the template's opening (every prompt's first two blocks): a prompt that shares no
    # more with the history ties, and goes to d0.
    await d0.send(protocol.KVEvents(stored=block_hashes(held[:8], 4)))
    await wait_until(lambda: len(master.ctx.registry.nodes["d1"].prefix) == len(held) // 4
                     and len(master.ctx.registry.nodes["d0"].prefix) == 2, what="kv events")
    await wait_warm(master, 2)
    for messages, expected in ((history + [{"role": "user", "content": "and then?"}], "d1"),
                               ([{"role": "user", "content": "something else entirely, " * 4}], "d0")):
        call = asyncio.create_task(master.http.post("/v1/chat/completions",
                                                    json={"model": MODEL, "messages": messages, "max_tokens": 4}))
        job = await serve_one(prefill, d1 if expected == "d1" else d0, [(5, "a")])
        assert (await call).status_code == 200
        assert job.decode_node_id == expected
    for node in (prefill, d0, d1):
        await node.close()


async def test_request_past_its_deadline_is_aborted_with_504(tmp_path: Path):
    async with LiveMaster(make_settings(write_model_dir(tmp_path), request_timeout_s=0.5)) as master:
        prefill = await _join(master, "p0", "prefill")
        decode = await _join(master, "d0", "decode")
        call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}))
        job = await prefill.next_job()
        assert 0 < job.deadline_s <= 0.5
        response = await call
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        await wait_until(lambda: job.request_id in prefill.aborts and job.request_id in decode.aborts, what="aborts")
        await prefill.close()
        await decode.close()


async def test_a_stream_past_its_deadline_ends_with_a_timeout_error(tmp_path: Path):
    async with LiveMaster(make_settings(write_model_dir(tmp_path), request_timeout_s=0.5)) as master:
        prefill = await _join(master, "p0", "prefill")
        decode = await _join(master, "d0", "decode")
        body = {"model": MODEL, "prompt": "hi", "stream": True}
        call = asyncio.create_task(master.http.post("/v1/completions", json=body))
        job = await prefill.next_job()
        await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=5, text="a"))
        response = await asyncio.wait_for(call, 5.0)  # the stream waits on no timer of its own
        events = [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "timeout"
        await wait_until(lambda: job.request_id in decode.aborts, what="abort")
        await prefill.close()
        await decode.close()


async def test_node_reporting_draining_gets_no_new_work(master):
    p0 = await _join(master, "p0", "prefill")
    p1 = await _join(master, "p1", "prefill")
    decode = await _join(master, "d0", "decode")
    p0.status = protocol.NodeStatus(draining=True, free_kv_tokens=4096, total_kv_tokens=4096)
    await wait_until(lambda: master.ctx.registry.nodes["p0"].state == "draining", what="draining state")
    for _ in range(2):
        call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "z"}))
        await serve_one(p1, decode, [(5, "a")])
        assert (await call).status_code == 200
    assert p0.jobs.empty()
    assert (await master.nodes())["p0"]["state"] == "draining"
    for node in (p0, p1, decode):
        await node.close()


async def test_non_streaming_client_that_leaves_gets_its_request_aborted(master):
    prefill = await _join(master, "p0", "prefill")
    decode = await _join(master, "d0", "decode")
    async with httpx.AsyncClient(base_url=master.base_url) as client:
        call = asyncio.create_task(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}))
        job = await prefill.next_job()
        call.cancel()
    await wait_until(lambda: job.request_id in prefill.aborts and job.request_id in decode.aborts, what="aborts")
    await wait_until(lambda: not master.ctx.relay.requests, what="request released")
    await prefill.close()
    await decode.close()
