"""Load-aware routing: where a decode node's own prefill pays against P -> D, priced in seconds
from P's queue, the transfer, and the slowdown of D's running streams against their TPOT SLO."""

from __future__ import annotations

import math

import pytest

from master.config import MasterSettings
from master.metrics import MasterMetrics
from master.registry import NodeRecord, Registry
from master.route_cost import CostModel, LinkRate, Rates, Slo
from master.routing import SHORT_MISS_TOKENS, CacheAwarePolicy, RouteRequest, make_policy
from pd_cluster import protocol
from tests.master_fakes import register_msg

#: Every node measured alike: 8000 prompt tokens/s, 10 ms + 1 ms a row per decode step.
RATE = 8000.0
MEASURED = {"prefill_tokens_per_s": RATE, "decode_step_base_s": 0.010, "decode_step_per_request_s": 0.001}
#: The master's cap by default (what an operator gets without setting it).
CAP = MasterSettings(cluster_token="x").local_prefill_max_tokens


def _node(registry: Registry, node_id: str, role: str, **status: float) -> NodeRecord:
    node = registry.add(register_msg(node_id, role))
    node.status = protocol.NodeStatus(free_kv_tokens=node.kv_total, total_kv_tokens=node.kv_total,
                                      **{**MEASURED, **status})
    return node


def _pair(p_queue: int = 0, d_running: int = 0, **d_status: float) -> tuple[NodeRecord, NodeRecord]:
    registry = Registry(MasterMetrics(), model=None)
    p = _node(registry, "p0", "prefill", queued_prefill_tokens=p_queue, warm_peers=["d0"])
    d = _node(registry, "d0", "decode", running=d_running, **d_status)
    return p, d


def _request(prompt_tokens: int, max_tokens: int = 64) -> RouteRequest:
    return RouteRequest(list(range(7, 7 + prompt_tokens)), kv_need=prompt_tokens + max_tokens)


def test_the_default_cap_lets_decode_nodes_take_misses_past_the_old_short_threshold():
    assert CAP > SHORT_MISS_TOKENS


def test_a_long_prefill_queue_sends_a_long_miss_to_the_busy_decode_node():
    # P has 4 s of prompts queued; D runs 4 streams: its 2000-token prefill costs them 4 x 0.25 s.
    p, d = _pair(p_queue=32000, d_running=4)
    plan = CacheAwarePolicy().plan(_request(2000), [p], [d], CAP)
    assert (plan.path, plan.reason) == ("local", "short_miss")


def test_an_idle_prefill_node_takes_the_miss_a_busy_decode_node_would_stall_its_streams_for():
    p, d = _pair(p_queue=0, d_running=4)
    plan = CacheAwarePolicy().plan(_request(2000), [p], [d], CAP)
    assert (plan.path, plan.reason, plan.prefill) == ("pd", "pd_faster", p)


def test_an_idle_decode_node_prefills_itself_when_nothing_runs_there():
    p, d = _pair(p_queue=0, d_running=0)
    plan = CacheAwarePolicy().plan(_request(2000), [p], [d], CAP)
    assert (plan.path, plan.reason) == ("local", "short_miss")


def test_streams_near_their_tpot_slo_send_the_work_to_p_however_long_its_queue():
    # D's step at 8 rows is 18 ms; with a 20 ms TPOT SLO its 8 streams have 2 ms a token of headroom
    # (~0.13 s over 64 tokens): a 2000-token prefill (0.25 s) would break the SLO.
    p, d = _pair(p_queue=32000, d_running=7)
    tight = CacheAwarePolicy(Slo(tpot_s=0.020)).plan(_request(2000), [p], [d], CAP)
    assert (tight.path, tight.reason) == ("pd", "tpot_slo")
    # A short follow-up turn still fits the headroom: D takes it.
    short = CacheAwarePolicy(Slo(tpot_s=0.020)).plan(_request(200), [p], [d], CAP)
    assert (short.path, short.reason) == ("local", "short_miss")
    # A looser SLO leaves room for the long one too, and P's queue makes it worth it.
    loose = CacheAwarePolicy(Slo(tpot_s=0.050)).plan(_request(2000), [p], [d], CAP)
    assert (loose.path, loose.reason) == ("local", "short_miss")


def test_slowdown_counts_by_the_headroom_the_streams_have_left_under_the_slo():
    _, d = _pair(d_running=4)
    rates = Rates.of([d])
    without = CostModel(rates, LinkRate()).local_slowdown_s(d, 800, 64)
    assert without == pytest.approx(4 * 800 / RATE)
    roomy = CostModel(rates, LinkRate(), Slo(tpot_s=1.0)).local_slowdown_s(d, 800, 64)
    tight = CostModel(rates, LinkRate(), Slo(tpot_s=0.017)).local_slowdown_s(d, 800, 64)
    assert 0 < roomy < tight < without
    assert CostModel(rates, LinkRate(), Slo(tpot_s=0.015)).local_slowdown_s(d, 800, 64) == math.inf
    # No streams, nothing to slow down.
    _, idle = _pair(d_running=0)
    assert CostModel(rates, LinkRate(), Slo(tpot_s=0.011)).local_slowdown_s(idle, 800, 64) == 0.0


def test_misses_over_the_cap_always_go_to_p():
    p, d = _pair(p_queue=10 ** 6, d_running=0)
    plan = CacheAwarePolicy().plan(_request(CAP + 1), [p], [d], CAP)
    assert (plan.path, plan.reason) == ("pd", "long_miss")


@pytest.mark.parametrize("name", ["least_load", "round_robin"])
def test_policies_that_do_not_price_keep_local_prefill_to_short_misses(name):
    p, d = _pair(p_queue=10 ** 6)
    policy = make_policy(name, Slo(tpot_s=0.05))
    assert policy.plan(_request(SHORT_MISS_TOKENS), [p], [d], CAP).path == "local"
    assert policy.plan(_request(SHORT_MISS_TOKENS + 1), [p], [d], CAP).path == "pd"


def test_the_master_takes_its_slos_in_milliseconds():
    settings = MasterSettings(cluster_token="x", slo_tpot_ms=25, slo_ttft_ms=800)
    assert settings.slo == Slo(ttft_s=0.8, tpot_s=0.025)
    assert MasterSettings(cluster_token="x").slo == Slo()
