"""The planner's decision (a pure function of the nodes' measured rates and the load mix) and its
loop in the master (a role change made through the registry, counted by reason)."""

from __future__ import annotations

import pytest

from master.load_mix import LoadMix
from master.metrics import MasterMetrics
from master.planner import LoadView, Move, NodeView, PlannerConfig, decide, decode_capacity
from master.planner_loop import PlannerLoop
from master.registry import Registry
from pd_cluster import protocol
from tests.master_fakes import make_settings, register_msg

#: Every node measured alike: 10k prompt tokens/s; a decode step of 10 ms + 0.1 ms a row, 100 rows at most.
RATES = {"prefill_tokens_per_s": 10000.0, "step_base_s": 0.010, "step_per_request_s": 0.0001,
         "max_running_requests": 100}
#: At 100 rows: 100 / 0.02 s = 5000 output tokens/s a node.
DECODE_TOKENS_PER_S = 5000.0
CONFIG = PlannerConfig(high=0.8, low=0.3, dwell_s=60.0)


def node(node_id: str, role: str, in_role_s: float = 600.0, **extra) -> NodeView:
    return NodeView(node_id=node_id, role=role, in_role_s=in_role_s, **{**RATES, **extra})


def load(prompt_per_s: float, output_per_s: float) -> LoadView:
    return LoadView(prompt_tokens_per_s=prompt_per_s, output_tokens_per_s=output_per_s)


def test_decode_capacity_is_the_batch_that_keeps_to_the_tpot_slo():
    n = node("d", "decode")
    assert decode_capacity(n, None) == pytest.approx(DECODE_TOKENS_PER_S)
    # 15 ms a token: 50 rows (10 + 0.1 x 50 ms), 50 / 0.015 s.
    assert decode_capacity(n, 0.015) == pytest.approx(50 / 0.015)


def test_long_prompts_keep_the_prefill_node_and_short_ones_give_it_to_the_decode_side():
    nodes = [node("p0", "prefill"), node("d0", "decode")]
    # Long prompts, short answers: P is the busy side.
    assert decide(nodes, load(7000, 500), CONFIG) is None
    # Short prompts, long answers: P idles while D works.
    move = decide(nodes, load(500, 3000), CONFIG)
    assert move == Move("p0", "prefill", "mixed", "prefill_idle", 0.05, 0.6)


def test_a_decode_side_past_high_takes_a_prefill_node_that_is_not_needed():
    nodes = [node("p0", "prefill"), node("p1", "prefill", queued_prefill_tokens=900), node("d0", "decode")]
    # The decode side is at 0.9, but one P would carry 12k prompt tokens/s at 1.2: both stay.
    assert decide(nodes, load(12000, 4500), CONFIG) is None
    # At 6k one P is at 0.6: the one with nothing queued goes (a decode node: a P remains).
    move = decide(nodes, load(6000, 4500), CONFIG)
    assert move is not None and (move.node_id, move.to_role, move.reason) == ("p0", "decode", "decode_short")


def test_a_prefill_side_past_high_takes_a_mixed_node_the_decode_side_can_spare():
    nodes = [node("p0", "prefill"), node("m0", "mixed", running=3), node("d0", "decode", running=1)]
    move = decide(nodes, load(9000, 2000), CONFIG)
    assert move is not None and (move.node_id, move.from_role, move.to_role, move.reason) == (
        "m0", "mixed", "prefill", "prefill_short")
    # Without room on the decode side for one node less, nothing moves.
    assert decide(nodes, load(9000, 4500), CONFIG) is None


def test_with_no_prefill_node_long_prompts_make_one():
    nodes = [node("m0", "mixed"), node("m1", "mixed")]
    move = decide(nodes, load(9000, 1000), CONFIG)
    assert move is not None and (move.from_role, move.to_role, move.reason) == ("mixed", "prefill", "prefill_short")
    assert decide(nodes, load(2000, 1000), CONFIG) is None  # a P would idle


def test_nodes_keep_a_role_for_the_dwell_time_and_the_decode_side_keeps_a_node():
    assert decide([node("p0", "prefill", in_role_s=5.0), node("d0", "decode")], load(10, 3000), CONFIG) is None
    assert decide([node("p0", "prefill")], load(10, 3000), CONFIG) is None
    assert decide([node("m0", "mixed")], load(90000, 10), CONFIG) is None


def test_the_band_between_low_and_high_holds_still():
    nodes = [node("p0", "prefill"), node("d0", "decode")]
    assert decide(nodes, load(5000, 2500), CONFIG) is None  # both sides at 0.5


def test_load_mix_counts_the_window_only():
    mix = LoadMix(window_s=10.0)
    mix._started = 0.0
    mix.add(1000, 10, now=1.0)
    mix.add(3000, 30, now=12.0)
    assert mix.view(now=15.0) == LoadView(prompt_tokens_per_s=300.0, output_tokens_per_s=3.0)


def test_the_loop_moves_the_node_through_the_registry_and_counts_the_decision():
    metrics = MasterMetrics()
    registry = Registry(metrics, model=None)
    p0 = registry.add(register_msg("p0", "prefill"))
    d0 = registry.add(register_msg("d0", "decode"))
    for n in (p0, d0):
        n.role_since -= 600
        n.status = protocol.NodeStatus(free_kv_tokens=4096, total_kv_tokens=4096, prefill_tokens_per_s=10000.0,
                                       decode_step_base_s=0.01, decode_step_per_request_s=0.001)
    mix = LoadMix(window_s=10.0)
    mix._started -= 10
    mix.add(100, 60)  # 10 prompt tokens/s against 10k: P idles; 6 output tokens/s: D works more
    loop = PlannerLoop(registry, metrics, make_settings(planner="slo"), mix)
    loop.tick()
    assert (p0.state, p0.pending_role) == ("switching", "mixed")
    text = metrics.render().decode()
    assert 'pdc_planner_decisions_total{from_role="prefill",reason="prefill_idle",to_role="mixed"} 1.0' in text
    loop.tick()  # nothing more while a change is under way
    assert 'reason="prefill_idle",to_role="mixed"} 1.0' in metrics.render().decode()
