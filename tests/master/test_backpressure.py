"""A full decode node is backpressure, not a failure: the master holds requests in its queue
until a node reports a free row, and a lease D refuses for want of room puts the request back in
its place without counting an attempt."""

from __future__ import annotations

import asyncio
import time

from master.metrics import MasterMetrics
from master.registry import NodeRecord, Registry
from master.relay import Relay
from master.relay_request import RelayRequest
from master.relay_state import RequestState
from master.routing import make_policy
from pd_cluster import protocol
from pd_cluster.sampling_params import SamplingParams
from tests.master_fakes import make_settings, register_msg, wait_until


def _cluster(rows: int, **settings) -> tuple[Relay, Registry, NodeRecord, NodeRecord]:
    registry = Registry(MasterMetrics(), model=None)
    relay = Relay(registry, make_policy("cache_aware"), registry.metrics, make_settings(**settings))
    prefill = registry.add(register_msg("p0", "prefill"))
    capacity = protocol.NodeCapacity(max_total_tokens=4096, max_running_requests=rows, max_model_len=2048)
    decode = registry.add(register_msg("d0", "decode", capacity=capacity))
    return relay, registry, prefill, decode


def _report(registry: Registry, decode: NodeRecord, *held: str) -> None:
    """D's periodic status: it holds ``held`` (running or reserved)."""
    registry.handle_status(decode, protocol.NodeStatus(free_kv_tokens=4000, total_kv_tokens=4096,
                                                       running=len(held), request_ids=list(held)))


def _jobs(node: NodeRecord) -> list[str]:
    ids = []
    while not node.outbox.empty():
        item = node.outbox.get_nowait()
        if isinstance(item, str):
            frame = protocol.parse_master_message(item)
            if isinstance(frame, protocol.PrefillJob):
                ids.append(frame.request_id)
    return ids


def _request(relay: Relay, request_id: str) -> RelayRequest:
    return relay.create(request_id, [5] * 12, SamplingParams(max_tokens=4), True, time.monotonic())


def _finish(relay: Relay, prefill: NodeRecord, decode: NodeRecord, attempt_id: str) -> None:
    relay.on_first_token(prefill, protocol.FirstToken(request_id=attempt_id, token_id=7, text="a"))
    relay.on_token_delta(decode, protocol.TokenDelta(request_id=attempt_id, token_ids=[7, 7, 7], text="aaa",
                                                     finish_reason="length"))


async def test_a_decode_node_with_no_free_row_is_not_dispatched_to_and_the_request_waits():
    relay, registry, prefill, decode = _cluster(rows=1, queue_timeout_s=10.0)
    first, second = _request(relay, "a"), _request(relay, "b")
    await relay.admit(first)
    waiting = asyncio.create_task(relay.admit(second))
    await wait_until(lambda: second.state == RequestState.QUEUED, what="b to queue")
    assert _jobs(prefill) == ["a"] and second.wait_reason == "decode_full"
    _report(registry, decode, "a")  # still full: nothing moves
    await asyncio.sleep(0)
    assert second.state == RequestState.QUEUED and _jobs(prefill) == []
    _finish(relay, prefill, decode, "a")  # its row is free once the request ends here
    await asyncio.wait_for(waiting, 2.0)
    assert _jobs(prefill) == ["b"] and second.attempt == 1 and second.queue_wait_s > 0
    assert registry.metrics.queue_wait.labels(reason="decode_full")._sum.get() > 0
    relay.release(first)
    relay.release(second)


async def test_a_refused_lease_requeues_the_request_in_its_place_without_counting_an_attempt():
    relay, registry, prefill, decode = _cluster(rows=2, queue_timeout_s=10.0, max_attempts=1)
    early = _request(relay, "early")
    await relay.admit(early)
    assert _jobs(prefill) == ["early"]
    # Another master's request took D's last row: D refuses the lease its report did not warn of.
    relay.on_request_failed(prefill, protocol.RequestFailed(
        request_id="early", message="decode node d0: decode node is full", retryable=True, busy=True))
    assert early.state == RequestState.QUEUED and early.attempt == 0 and early.refused == 1
    assert early.wait_reason == "decode_refused" and early.current is not None and early.current.ended
    late = _request(relay, "late")
    waiting = asyncio.create_task(relay.admit(late))
    await wait_until(lambda: late.state == RequestState.QUEUED, what="late to queue")
    assert relay.queue.head() is early and _jobs(prefill) == []  # D is held off until its next report
    _report(registry, decode, "other-master-request")  # one row free again
    await wait_until(lambda: early.state == RequestState.RUNNING, what="early to be dispatched again")
    assert _jobs(prefill) == ["early-r1"]  # the refused one keeps its turn, under a fresh attempt id
    assert early.attempt == 1 and late.state == RequestState.QUEUED
    _finish(relay, prefill, decode, "early-r1")  # with max_attempts=1, a counted refusal would have failed it
    assert early.outcome == "ok"
    await asyncio.wait_for(waiting, 2.0)
    assert _jobs(prefill) == ["late"] and registry.metrics.decode_refusals._value.get() == 1
    relay.release(early)
    relay.release(late)
    assert not relay.requests and not decode.pending_kv


async def test_refusals_never_fail_a_request_however_many():
    relay, registry, prefill, decode = _cluster(rows=1, queue_timeout_s=10.0, max_attempts=2)
    r = _request(relay, "x")
    await relay.admit(r)
    for n in range(5):
        attempt_id = r.current.attempt_id
        relay.on_request_failed(prefill, protocol.RequestFailed(request_id=attempt_id, message="full", busy=True))
        assert r.state == RequestState.QUEUED and r.attempt == 0
        _report(registry, decode)
        await wait_until(lambda: r.state == RequestState.RUNNING, what="a dispatch after the report")
    assert r.current.attempt_id == "x-r5" and r.refused == 5
    _finish(relay, prefill, decode, "x-r5")
    assert r.outcome == "ok" and r.attempt == 1
    relay.release(r)
