"""Routing policies, the prefix index and admission (queue / 503), without sockets."""

from __future__ import annotations

import asyncio
import time

import pytest

from master.errors import APIError
from master.metrics import MasterMetrics
from master.prefix_index import PrefixIndex
from master.registry import NodeRecord, Registry
from master.relay import Relay
from master.relay_state import IllegalMove, RequestState
from master.routing import (
    CacheAwarePolicy,
    LeastLoadPolicy,
    RoundRobinPolicy,
    RouteRequest,
    admissible_decodes,
    make_policy,
)
from pd_cluster import protocol
from pd_cluster.block_hash import block_hashes
from pd_cluster.sampling_params import SamplingParams
from tests.master_fakes import make_settings, register_msg

BLOCK = 4


def _registry() -> Registry:
    return Registry(MasterMetrics(), model=None)


def _status(node: NodeRecord, **values: int) -> None:
    base = {"free_kv_tokens": node.kv_total, "total_kv_tokens": node.kv_total}
    base.update(values)
    node.status = protocol.NodeStatus(**base)


def _frames(node: NodeRecord) -> list:
    frames = []
    while not node.outbox.empty():
        item = node.outbox.get_nowait()
        if isinstance(item, str):
            frames.append(protocol.parse_master_message(item))
    return frames


# ---- prefix index -------------------------------------------------------------------------


def test_prefix_index_matches_leading_blocks_only():
    tokens = list(range(40))
    hashes = block_hashes(tokens, BLOCK)
    index = PrefixIndex(max_blocks=100)
    index.apply(stored=hashes[:5])
    assert index.match(hashes) == 5
    index.apply(evicted=[hashes[2]])
    assert index.match(hashes) == 2
    other = block_hashes([7] + tokens[1:], BLOCK)
    assert index.match(other) == 0


def test_prefix_index_clear_and_bound():
    index = PrefixIndex(max_blocks=3)
    index.apply(stored=[1, 2, 3, 4])
    assert len(index) == 3 and 1 not in index and 4 in index
    index.apply(stored=[9], cleared=True)
    assert len(index) == 1 and index.match([9, 2]) == 1


# ---- policies -----------------------------------------------------------------------------


def _decodes(registry: Registry, n: int) -> list[NodeRecord]:
    return [registry.add(register_msg(f"d{i}", "decode")) for i in range(n)]


def _prefills(registry: Registry, n: int) -> list[NodeRecord]:
    return [registry.add(register_msg(f"p{i}", "prefill")) for i in range(n)]


def test_cache_aware_prefers_the_decode_node_holding_the_prefix():
    registry = _registry()
    d0, d1 = _decodes(registry, 2)
    history = [3 + i % 1000 for i in range(1200)]
    d1.prefix.apply(stored=block_hashes(history, BLOCK))
    _status(d1, running=3)  # busier than d0, but holds the history: its prefill would take longer than the batch costs
    request = RouteRequest(history + [5, 6, 7], kv_need=1203 + 16)
    policy = CacheAwarePolicy()
    assert policy.hit_tokens(request, d1) == 1200
    assert policy.pick_decode(request, [d0, d1]) is d1
    # A short shared prefix (a chat template) saves less than one more request in the batch costs.
    template = RouteRequest(history[:8] + list(range(2000, 2040)), kv_need=48 + 64)
    assert policy.hit_tokens(template, d1) == 8
    assert policy.pick_decode(template, [d0, d1]) is d0


def test_a_conversation_stays_on_its_d_when_a_twin_measures_a_few_percent_faster():
    """Like nodes' step times jitter by a few percent; over a request's steps that must not
    outweigh the transfer its history saves (P -> D only, as with local prefill off)."""
    registry = _registry()
    p0 = registry.add(register_msg("p0", "prefill"))
    d0, d1, d2 = _decodes(registry, 3)
    history = [3 + i % 1000 for i in range(80)]
    d0.prefix.apply(stored=block_hashes(history, BLOCK))
    # d0 (holding the history) measured 0.081 s a step, d2 0.075 s; d1 has not measured yet.
    _status(d0, decode_step_per_request_s=0.081)
    _status(d2, decode_step_per_request_s=0.075)
    request = RouteRequest(history + [5, 6, 7, 8, 9, 10, 11, 12], kv_need=88 + 24)
    policy = CacheAwarePolicy()
    plan = policy.plan(request, [p0], [d0, d1, d2], local_max=0)
    assert plan.decode is d0 and plan.hit_tokens == 80
    # A node that is truly slower (twice the mean) is still priced by its own steps.
    _status(d0, decode_step_per_request_s=0.2)
    assert policy.plan(request, [p0], [d0, d1, d2], local_max=0).decode is not d0


def test_cache_aware_avoids_a_saturated_decode_node_despite_its_prefix():
    registry = _registry()
    d0, d1 = _decodes(registry, 2)
    history = list(range(3, 103))
    d1.prefix.apply(stored=block_hashes(history, BLOCK))
    _status(d1, running=8, waiting=4)  # max_running_requests is 8
    request = RouteRequest(history + [5], kv_need=150)
    assert CacheAwarePolicy().pick_decode(request, [d0, d1]) is d0


def test_cache_aware_without_hits_spreads_by_load():
    registry = _registry()
    d0, d1 = _decodes(registry, 2)
    _status(d0, running=4)
    request = RouteRequest(list(range(20)), kv_need=40)
    assert CacheAwarePolicy().pick_decode(request, [d0, d1]) is d1


def test_least_load_picks_the_least_loaded_decode_and_least_queued_prefill():
    registry = _registry()
    d0, d1, d2 = _decodes(registry, 3)
    _status(d0, running=5)
    _status(d1, running=1)
    _status(d2, running=1, free_kv_tokens=100)
    p0, p1 = _prefills(registry, 2)
    _status(p0, queued_prefill_tokens=5000)
    p1.pending_prefill["x"] = 10
    policy = LeastLoadPolicy()
    request = RouteRequest([1, 2, 3], kv_need=10)
    assert policy.pick_decode(request, [d0, d1, d2]) is d1
    assert policy.pick_prefill(request, [p0, p1]) is p1


def test_round_robin_cycles_through_nodes_in_id_order():
    registry = _registry()
    decodes = _decodes(registry, 3)
    policy = RoundRobinPolicy()
    request = RouteRequest([1], kv_need=2)
    picks = [policy.pick_decode(request, decodes).node_id for _ in range(4)]
    assert picks == ["d0", "d1", "d2", "d0"]
    # A node that left is skipped without disturbing the order.
    assert policy.pick_decode(request, [decodes[0], decodes[2]]).node_id == "d2"


def _warm(prefill: NodeRecord, *decodes: NodeRecord) -> None:
    prefill.status = prefill.status.model_copy(update={"warm_peers": [d.node_id for d in decodes]})


@pytest.mark.parametrize("name", ["cache_aware", "least_load", "round_robin"])
def test_every_policy_routes_to_the_warm_pair(name):
    registry = _registry()
    d0, d1 = _decodes(registry, 2)
    p0, p1 = _prefills(registry, 2)
    _warm(p1, d1)  # the only warm pair: p1 -> d1, although d0 and p0 come first by id
    policy = make_policy(name)
    request = RouteRequest(list(range(20)), kv_need=40)
    for _ in range(3):
        prefill, decode = policy.pick_pair(request, [p0, p1], [d0, d1])
        assert (prefill.node_id, decode.node_id) == ("p1", "d1")


@pytest.mark.parametrize("name", ["cache_aware", "least_load", "round_robin"])
def test_without_a_warm_pair_requests_still_route(name):
    registry = _registry()
    d0, d1 = _decodes(registry, 2)
    (p0,) = _prefills(registry, 1)
    policy = make_policy(name)
    request = RouteRequest(list(range(20)), kv_need=40)
    picks = {policy.pick_pair(request, [p0], [d0, d1])[1].node_id for _ in range(4)}
    assert picks <= {"d0", "d1"} and picks  # the policy's own choice, warmth aside
    if name == "round_robin":
        assert picks == {"d0", "d1"}


def test_a_cold_pair_wins_only_when_every_warm_pair_is_overloaded():
    registry = _registry()
    warm_d, cold_d = _decodes(registry, 2)
    (p0,) = _prefills(registry, 1)
    _warm(p0, warm_d)
    request = RouteRequest(list(range(20)), kv_need=40)
    for policy in (LeastLoadPolicy(), CacheAwarePolicy()):
        _status(warm_d, running=6)  # busy (6 of 8) but not queueing: still the warm one
        assert policy.pick_pair(request, [p0], [warm_d, cold_d])[1] is warm_d
        # Far past its batch: the wait for a place takes longer than forming a channel.
        _status(warm_d, running=8, waiting=200, free_kv_tokens=200)
        assert policy.pick_pair(request, [p0], [warm_d, cold_d])[1] is cold_d


def test_prefill_choice_prefers_a_warm_channel_to_the_chosen_decode_unless_it_is_swamped():
    registry = _registry()
    (d0,) = _decodes(registry, 1)
    p0, p1 = _prefills(registry, 2)
    policy = CacheAwarePolicy()
    request = RouteRequest(list(range(20)), kv_need=40)
    _status(p1, queued_prefill_tokens=4000)  # busier than p0, but warm
    _warm(p1, d0)
    assert policy.pick_pair(request, [p0, p1], [d0]) == (p1, d0)
    _status(p1, queued_prefill_tokens=100_000)
    _warm(p1, d0)
    assert policy.pick_pair(request, [p0, p1], [d0]) == (p0, d0)
    # A retry that keeps its decode node still gets the P warm with it.
    _status(p1)
    _warm(p1, d0)
    d1 = registry.add(register_msg("d1", "decode"))
    assert policy.pick_pair(request, [p0, p1], [d0, d1], d0) == (p1, d0)


def test_warm_pairs_count_only_active_nodes_and_reported_channels():
    registry = _registry()
    d0, d1 = _decodes(registry, 2)
    p0, p1 = _prefills(registry, 2)
    assert registry.warm_pairs() == 0
    registry.handle_status(p0, protocol.NodeStatus(warm_peers=["d0", "d1", "gone"]))
    registry.handle_status(p1, protocol.NodeStatus(warm_peers=["d1"]))
    assert registry.warm_pairs() == 3
    assert registry.metrics.registry.get_sample_value("pdc_warm_channels") == 3
    registry.drain("d1")
    assert registry.warm_pairs() == 1
    assert registry.metrics.registry.get_sample_value("pdc_warm_channels") == 1
    registry.remove("p0", "test")
    assert registry.warm_pairs() == 0


def test_prefill_nodes_are_told_the_active_decode_nodes():
    registry = _registry()
    (p0,) = _prefills(registry, 1)
    _frames(p0)
    d0, d1 = _decodes(registry, 2)
    peers = [f for f in _frames(p0) if isinstance(f, protocol.DecodePeers)]
    assert [[p.node_id for p in f.peers] for f in peers] == [["d0"], ["d0", "d1"]]
    assert peers[-1].peers[1].data_address == d1.info.data_address
    registry.drain("d0")
    registry.remove("d1", "test")
    peers = [f for f in _frames(p0) if isinstance(f, protocol.DecodePeers)]
    assert [[p.node_id for p in f.peers] for f in peers] == [["d1"], []]
    assert not [f for f in _frames(d0) if isinstance(f, protocol.DecodePeers)]


def test_make_policy_rejects_unknown_names():
    assert make_policy("cache_aware").name == "cache_aware"
    with pytest.raises(ValueError):
        make_policy("random")


def test_admission_counts_free_evictable_and_routed_kv():
    registry = _registry()
    d0, d1 = _decodes(registry, 2)
    _status(d0, free_kv_tokens=100, evictable_kv_tokens=50)
    _status(d1, free_kv_tokens=1000)
    assert admissible_decodes([d0, d1], 150) == [d0, d1]
    d0.pending_kv["routed-not-reported"] = 1
    assert admissible_decodes([d0, d1], 150) == [d1]
    registry.drain("d1")
    assert admissible_decodes([d0, d1], 10) == [d0]


# ---- admission through the relay ----------------------------------------------------------


def _relay(**settings) -> tuple[Relay, Registry]:
    registry = _registry()
    relay = Relay(registry, make_policy("cache_aware"), registry.metrics, make_settings(**settings))
    return relay, registry


async def test_request_waits_in_queue_until_decode_kv_frees():
    relay, registry = _relay(queue_timeout_s=5.0)
    (p,) = _prefills(registry, 1)
    (d,) = _decodes(registry, 1)
    _status(d, free_kv_tokens=50)
    r = relay.create("req-1", list(range(3, 43)), SamplingParams(max_tokens=20), False, time.monotonic())
    admitted = asyncio.create_task(relay.admit(r))
    await asyncio.sleep(0.05)
    assert r.state == "queued" and not admitted.done()
    assert not [f for f in _frames(p) if isinstance(f, protocol.PrefillJob)]
    registry.handle_status(d, protocol.NodeStatus(free_kv_tokens=1000, total_kv_tokens=4096))
    await asyncio.wait_for(admitted, 2.0)
    jobs = [f for f in _frames(p) if isinstance(f, protocol.PrefillJob)]
    assert [j.request_id for j in jobs] == ["req-1"] and jobs[0].decode_node_id == "d0"
    assert d.pending_kv == {"req-1": 60}
    relay.release(r)
    assert d.pending_kv == {} and "req-1" in [f.request_id for f in _frames(d) if isinstance(f, protocol.Abort)]


async def test_full_queue_answers_429_with_retry_after():
    relay, registry = _relay(queue_size=1, queue_timeout_s=5.0)
    _prefills(registry, 1)
    (d,) = _decodes(registry, 1)
    _status(d, free_kv_tokens=10)
    first = relay.create("a", [5] * 20, SamplingParams(max_tokens=5), False, time.monotonic())
    waiting = asyncio.create_task(relay.admit(first))
    await asyncio.sleep(0.02)
    second = relay.create("b", [5] * 20, SamplingParams(max_tokens=5), False, time.monotonic())
    with pytest.raises(APIError) as err:
        await relay.admit(second)
    assert err.value.status == 429 and err.value.headers()["Retry-After"] == "1"
    waiting.cancel()
    relay.release(first)
    relay.release(second)
    assert not relay.queue and not relay.requests


async def test_queue_wait_has_a_deadline():
    relay, registry = _relay(queue_timeout_s=0.2)
    _prefills(registry, 1)
    (d,) = _decodes(registry, 1)
    _status(d, free_kv_tokens=0)
    r = relay.create("slow", [5] * 10, SamplingParams(max_tokens=5), False, time.monotonic())
    with pytest.raises(APIError) as err:
        await asyncio.wait_for(relay.admit(r), 3.0)
    assert err.value.status == 503
    relay.release(r)
    assert registry.metrics.registry.get_sample_value("pdc_requests_total", {"status": "unavailable"}) == 1


async def test_no_decode_node_answers_503_at_once():
    relay, registry = _relay()
    _prefills(registry, 1)  # a prefill node alone cannot serve
    r = relay.create("x", [5], SamplingParams(max_tokens=1), False, time.monotonic())
    with pytest.raises(APIError) as err:
        await relay.admit(r)
    assert err.value.status == 503
    relay.release(r)


async def test_without_a_prefill_node_the_decode_node_prefills_it_whole():
    relay, registry = _relay()
    (d,) = _decodes(registry, 1)
    r = relay.create("x", [5] * 600, SamplingParams(max_tokens=3), False, time.monotonic())
    await relay.admit(r)
    (job,) = [f for f in _frames(d) if isinstance(f, protocol.GenerateJob)]
    assert job.request_id == r.current.attempt_id and len(job.token_ids) == 600
    assert (r.prefill_id, r.decode_id, r.plan.path, r.plan.reason) == (None, "d0", "local", "no_prefill")
    assert d.pending_prefill[r.current.attempt_id] == 600
    # Its tokens come from D alone, the first with the prompt tokens D's cache held.
    relay.on_token_delta(d, protocol.TokenDelta(request_id=job.request_id, token_ids=[7], cached_tokens=16))
    assert r.current.attempt_id not in d.pending_prefill and r.cached_tokens == 16
    relay.on_token_delta(d, protocol.TokenDelta(request_id=job.request_id, token_ids=[8, 9], finish_reason="length"))
    await relay.wait(r)
    assert r.output_ids == [7, 8, 9]
    relay.release(r)
    sample = registry.metrics.registry.get_sample_value
    assert sample("pdc_route_decisions_total", {"path": "local", "reason": "no_prefill"}) == 1


async def test_a_request_moves_only_along_its_state_machine():
    relay, registry = _relay()
    (p,) = _prefills(registry, 1)
    (d,) = _decodes(registry, 1)
    for node in (p, d):
        _frames(node)  # what joining sent them (the decode peers)
    r = relay.create("x", [5] * 10, SamplingParams(max_tokens=2), False, time.monotonic())
    assert r.state == RequestState.NEW
    with pytest.raises(IllegalMove):
        r.move_to(RequestState.FINISHED)  # nothing finishes before it ran
    assert r.state == RequestState.NEW
    relay.fail(r, APIError(504, "The request timed out.", "timeout_error"), "timeout")
    with pytest.raises(IllegalMove):
        r.move_to(RequestState.RUNNING)  # nothing leaves an end state
    # A request that failed before its turn came (its deadline passed) is never dispatched.
    with pytest.raises(APIError) as err:
        await relay.admit(r)
    assert err.value.status == 504 and r.current is None and not _frames(p) and not _frames(d)
    relay.release(r)
    assert r.outcome == "timeout"


async def test_each_dispatch_of_a_request_is_a_fresh_attempt():
    relay, registry = _relay()
    _prefills(registry, 1)
    d0, d1 = _decodes(registry, 2)
    r = relay.create("x", [5] * 10, SamplingParams(max_tokens=2), False, time.monotonic())
    await relay.admit(r)
    first = r.current
    lost = d0 if first.decode_id == "d0" else d1
    relay.on_request_failed(lost, protocol.RequestFailed(request_id="x", message="lease ran out", retryable=True))
    second = r.current
    assert second is not first and first.ended and not second.ended
    assert (first.number, first.attempt_id, second.number, second.attempt_id) == (1, "x", 2, "x-r1")
    assert second.decode_id != lost.node_id and r.state == RequestState.RUNNING and r.attempt == 2
    assert relay.attempts == {"x-r1": r}
    assert "x" not in lost.pending_kv and "x-r1" in registry.get(second.decode_id).pending_kv
    relay.release(r)
    assert not relay.attempts and not registry.get(second.decode_id).pending_kv


@pytest.mark.parametrize("policy", ["cache_aware", "least_load", "round_robin"])
async def test_short_misses_are_prefilled_on_d_and_long_ones_on_p(policy):
    relay, registry = _relay(local_prefill_max_tokens=64, policy=policy)
    relay.policy = make_policy(policy)
    (p,) = _prefills(registry, 1)
    (d,) = _decodes(registry, 1)
    _warm(p, d)
    history = list(range(3, 203))
    d.prefix.apply(stored=block_hashes(history, BLOCK))
    paths = {}
    for name, prompt in (("short", list(range(30))), ("hit", history + [1] * 40), ("long", list(range(500, 700)))):
        r = relay.create(name, prompt, SamplingParams(max_tokens=4), False, time.monotonic())
        await relay.admit(r)
        paths[name] = (r.plan.path, r.plan.reason)
        relay.release(r)
    assert paths == {"short": ("local", "short_miss"), "hit": ("local", "short_miss"), "long": ("pd", "long_miss")}


async def test_draining_nodes_get_no_new_work():
    relay, registry = _relay()
    p0, p1 = _prefills(registry, 2)
    _decodes(registry, 1)
    registry.drain("p0")
    _frames(p0)
    for i in range(3):
        r = relay.create(f"r{i}", [5] * 8, SamplingParams(max_tokens=4), False, time.monotonic())
        await relay.admit(r)
        assert r.prefill_id == "p1"
        relay.release(r)
    assert not [f for f in _frames(p0) if isinstance(f, protocol.PrefillJob)]
