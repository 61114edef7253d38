"""Build a node's periodic status report from its engine's counters."""

from __future__ import annotations

import time

from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.step_rates import StepRates
from pd_cluster.protocol import NodeStatus


class StatusReporter:
    """Reads engine counters from the event loop thread (plain ints: a torn read is harmless)."""

    def __init__(self, engine: LLMEngine, rates: StepRates | None = None) -> None:
        self.engine = engine
        self.rates = rates
        self._last_tokens = 0
        self._last_time = time.monotonic()
        self._rate = 0.0

    def report(
        self, *, draining: bool, queued_prefill_tokens: int = 0, extra_running: int = 0,
        warm_peers: list[str] | None = None, channel_setup_s: float | None = None,
        request_ids: list[str] | None = None,
    ) -> NodeStatus:
        engine = self.engine
        now = time.monotonic()
        generated = engine.stats.generation_tokens
        if now - self._last_time >= 1.0:
            self._rate = (generated - self._last_tokens) / (now - self._last_time)
            self._last_tokens, self._last_time = generated, now
        sched = engine.scheduler
        line = self.rates.decode_line() if self.rates is not None else None
        prefill_rate = self.rates.prefill_tokens_per_s() if self.rates is not None else 0.0
        return NodeStatus(
            running=len(sched.running) + sum(len(g.rows) for g in list(engine.beams.running)) + extra_running,
            waiting=len(sched.waiting) + len(engine.beams.waiting),
            free_kv_tokens=engine.pool.num_free,
            total_kv_tokens=engine.pool.capacity,
            evictable_kv_tokens=engine.cache.evictable_tokens,
            queued_prefill_tokens=queued_prefill_tokens,
            generation_tokens_per_s=round(self._rate, 2),
            prefill_tokens_per_s=round(prefill_rate, 1),
            decode_step_base_s=round(line[0], 6) if line else 0.0,
            decode_step_per_request_s=round(line[1], 7) if line else 0.0,
            prefix_hit_tokens=engine.stats.cached_prompt_tokens,
            prompt_tokens=engine.stats.prompt_tokens,
            draining=draining,
            warm_peers=warm_peers or [],
            channel_setup_s=None if channel_setup_s is None else round(channel_setup_s, 4),
            request_ids=request_ids or [],
        )
