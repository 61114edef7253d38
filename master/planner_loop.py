"""The planner at work (``--planner slo``): every ``planner_interval_s`` it takes a snapshot of the
active nodes and the load mix, asks :func:`master.planner.decide` for a role change, and makes
it through the registry (as ``POST /admin/nodes/{id}/role`` would), logged with its reason and
counted in ``pdc_planner_decisions_total``. In a master of several workers only the first plans
(the others learn of a change from the node's status)."""

from __future__ import annotations

import asyncio
import logging
import time

from master.config import MasterSettings
from master.load_mix import LoadMix
from master.metrics import MasterMetrics
from master.planner import NodeView, PlannerConfig, decide
from master.registry import NodeRecord, Registry

logger = logging.getLogger(__name__)


def node_view(node: NodeRecord, now: float) -> NodeView:
    s = node.status
    return NodeView(
        node_id=node.node_id, role=node.role, in_role_s=now - node.role_since,
        max_running_requests=node.info.capacity.max_running_requests,
        prefill_tokens_per_s=s.prefill_tokens_per_s, step_base_s=s.decode_step_base_s,
        step_per_request_s=s.decode_step_per_request_s, running=s.running,
        queued_prefill_tokens=node.queued_prefill_tokens,
    )


class PlannerLoop:
    def __init__(self, registry: Registry, metrics: MasterMetrics, settings: MasterSettings, mix: LoadMix) -> None:
        self.registry = registry
        self.metrics = metrics
        self.mix = mix
        self.interval_s = settings.planner_interval_s
        self.config = PlannerConfig(high=settings.planner_high, low=settings.planner_low,
                                    dwell_s=settings.planner_dwell_s, tpot_s=settings.slo.tpot_s)

    def tick(self) -> None:
        """One round: at most one role change."""
        now = time.monotonic()
        if any(n.state == "switching" for n in self.registry.nodes.values()):
            return  # one change at a time: the last one's effect is not measured yet
        nodes = [node_view(n, now) for n in self.registry.nodes.values() if n.active]
        move = decide(nodes, self.mix.view(now), self.config)
        if move is None:
            return
        logger.info("planner: node %s %s -> %s (%s: prefill side used %.2f, decode side %.2f)", move.node_id,
                    move.from_role, move.to_role, move.reason, move.prefill_use, move.decode_use)
        self.metrics.planner_decisions.labels(from_role=move.from_role, to_role=move.to_role,
                                              reason=move.reason).inc()
        self.registry.set_role(move.node_id, move.to_role)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick()
            except Exception:
                logger.exception("planner round failed")
