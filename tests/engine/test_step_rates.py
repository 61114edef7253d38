"""The rates a node reports for routing, fitted from its own steps."""

from __future__ import annotations

import random

import pytest

from master.route_cost import CostModel, LinkRate, Rates
from master.registry import Registry
from master.metrics import MasterMetrics
from pd_cluster import protocol
from pd_cluster.engine.step_rates import StepRates
from tests.master_fakes import register_msg


def test_decode_line_and_prefill_rate_are_recovered_from_mixed_steps():
    rng = random.Random(0)
    rates = StepRates()
    base, per_row, per_token, overhead = 0.008, 0.0003, 1 / 20000, 0.004
    for _ in range(400):
        rows = rng.randint(1, 64)
        if rng.random() < 0.3:  # a step with a prefill chunk beside the decode rows
            tokens = rng.randint(64, 2048)
            seconds = base + per_row * rows + overhead + tokens * per_token
            rates.record([1] * rows + [tokens], rows, seconds * rng.uniform(0.98, 1.02))
        else:
            rates.record([1] * rows, rows, (base + per_row * rows) * rng.uniform(0.98, 1.02))
    a, b = rates.decode_line()
    assert a == pytest.approx(base, rel=0.1) and b == pytest.approx(per_row, rel=0.1)
    assert rates.prefill_tokens_per_s() == pytest.approx(20000, rel=0.1)


def test_nothing_measured_reports_zero_and_one_batch_size_is_priced_per_row():
    rates = StepRates()
    assert rates.decode_line() is None and rates.prefill_tokens_per_s() == 0.0
    for _ in range(10):
        rates.record([1] * 8, 8, 0.016)
    assert rates.decode_step_s(8) == pytest.approx(0.016)


def test_cost_model_uses_a_node_own_rates_then_the_cluster_mean_then_defaults():
    registry = Registry(MasterMetrics(), model=None)
    measured = registry.add(register_msg("d0", "decode"))
    fresh = registry.add(register_msg("d1", "decode"))
    measured.status = protocol.NodeStatus(prefill_tokens_per_s=1000.0, decode_step_base_s=0.02,
                                          decode_step_per_request_s=0.001, total_kv_tokens=4096, free_kv_tokens=4096)
    costs = CostModel(Rates.of([measured, fresh]), LinkRate())
    assert costs.prefill_rate(fresh) == costs.prefill_rate(measured) == 1000.0
    assert costs.local_prefill_s(measured, 500) == pytest.approx(0.5)
    # Ten output tokens at a batch of one: ten steps of base + one request.
    assert costs.decode_s(measured, 10) == pytest.approx(10 * 0.021)
    link = LinkRate()
    link.observe(10**9, 0.5)
    assert link.value == pytest.approx(2e9)
