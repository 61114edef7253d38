"""A prefill node that loses its connection to the attempt's decode node says so, and the fault is
the decode node's: the re-run goes to another decode node (the prefill node stays eligible), and
no request is routed to the unreachable one until it reports again. Without this, a killed D
whose connection had not closed at the master yet took every re-run of its requests back to it,
until they ran out of attempts. The other way round, a decode node whose lease ran out waiting
for the prefill node blames that prefill node."""

from __future__ import annotations

import time

from master.metrics import MasterMetrics
from master.registry import NodeRecord, Registry
from master.relay import Relay
from master.relay_request import RelayRequest
from master.relay_state import RequestState
from master.routing import make_policy
from pd_cluster import protocol
from pd_cluster.sampling_params import SamplingParams
from tests.master_fakes import make_settings, register_msg


def _cluster() -> tuple[Relay, Registry, list[NodeRecord], list[NodeRecord]]:
    registry = Registry(MasterMetrics(), model=None)
    relay = Relay(registry, make_policy("cache_aware"), registry.metrics, make_settings(max_attempts=3))
    prefills = [registry.add(register_msg(f"p{i}", "prefill")) for i in range(2)]
    decodes = [registry.add(register_msg(f"d{i}", "decode")) for i in range(2)]
    return relay, registry, prefills, decodes


def _jobs(prefills: list[NodeRecord]) -> list[tuple[str, str, str]]:
    """(prefill node, attempt id, decode node) of every prefill job sent since the last call."""
    jobs = []
    for node in prefills:
        while not node.outbox.empty():
            item = node.outbox.get_nowait()
            if isinstance(item, str):
                frame = protocol.parse_master_message(item)
                if isinstance(frame, protocol.PrefillJob):
                    jobs.append((node.node_id, frame.request_id, frame.decode_node_id))
    return jobs


def _request(relay: Relay, request_id: str, prompt_token: int) -> RelayRequest:
    return relay.create(request_id, [prompt_token] * 40, SamplingParams(max_tokens=4), True, time.monotonic())


async def _first_dispatch(relay: Relay, prefills: list[NodeRecord]) -> tuple[RelayRequest, tuple[str, str, str]]:
    """A request admitted and dispatched: it and its one prefill job (P, attempt id, D)."""
    r = _request(relay, "a", 5)
    await relay.admit(r)
    (job,) = _jobs(prefills)
    return r, job


def _status(registry: Registry, node: NodeRecord) -> None:
    registry.handle_status(node, protocol.NodeStatus(free_kv_tokens=4000, total_kv_tokens=4096))


async def test_a_decode_node_the_prefill_node_lost_is_avoided_by_the_rerun_and_by_new_requests():
    relay, registry, prefills, decodes = _cluster()
    by_id = {n.node_id: n for n in prefills + decodes}
    r, (p_first, attempt_id, d_first) = await _first_dispatch(relay, prefills)
    d_other = next(d.node_id for d in decodes if d.node_id != d_first)

    relay.on_request_failed(by_id[p_first], protocol.RequestFailed(
        request_id=attempt_id, message=f"lost decode node {d_first}: channel closed", peer_lost=True))

    ((_, rerun_id, d_rerun),) = _jobs(prefills)
    assert r.state == RequestState.RUNNING and rerun_id != attempt_id and r.attempt == 2
    assert d_rerun == d_other  # not back to the node P could not reach
    assert d_first in r.excluded and p_first not in r.excluded  # the fault was D's, not P's

    # Every other request keeps off it too, while its connection to the master is still up...
    for i in range(3):
        await relay.admit(_request(relay, f"b{i}", 100 + i))
    assert {d for _, _, d in _jobs(prefills)} == {d_other}
    # ...until it reports again: a node that only blinked is routed to once more.
    _status(registry, by_id[d_first])
    seen: set[str] = set()
    for i in range(8):
        await relay.admit(_request(relay, f"c{i}", 200 + i))
        seen.update(d for _, _, d in _jobs(prefills))
    assert d_first in seen


async def test_a_prefill_nodes_own_failure_still_keeps_the_decode_node_and_avoids_the_prefill_node():
    relay, _, prefills, decodes = _cluster()
    by_id = {n.node_id: n for n in prefills + decodes}
    r, (p_first, attempt_id, d_first) = await _first_dispatch(relay, prefills)
    relay.on_request_failed(by_id[p_first], protocol.RequestFailed(request_id=attempt_id, message="out of memory"))
    ((p_rerun, _, d_rerun),) = _jobs(prefills)
    assert p_rerun != p_first and d_rerun == d_first and r.excluded == {p_first}


async def test_a_lease_that_ran_out_on_the_decode_node_blames_the_prefill_node():
    """D's lease ran out before P handed the request over: P went quiet (frozen, or its connection
    to the master not closed yet), so the re-run avoids P and may go back to the same D."""
    relay, _, prefills, decodes = _cluster()
    by_id = {n.node_id: n for n in prefills + decodes}
    r, (p_first, attempt_id, d_first) = await _first_dispatch(relay, prefills)
    relay.on_request_failed(by_id[d_first], protocol.RequestFailed(
        request_id=attempt_id, message="the KV lease ran out before the prefill node handed the request over",
        peer_lost=True))
    ((p_rerun, _, d_rerun),) = _jobs(prefills)
    assert p_rerun != p_first and d_rerun == d_first and r.excluded == {p_first}
