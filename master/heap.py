"""The master process's heap, settled once it has started, so that garbage collection never
stalls the relay.

A full collection walks every object the process holds. After start-up that is over 100k of
them (the tokenizer, the app's routes, pydantic's schemas): one walk held the event loop ~100 ms
and more, and every stream's next token waited for it, which made the tail of the master's
added inter-token latency. Frozen (:func:`gc.freeze`), they are never walked again. The young
generations keep CPython's thresholds: their walks are short (a fraction of a millisecond), so
a token waits little when one runs. Full collections, which walk every live request, run at
most once every ``OLD_THRESHOLD`` middle ones instead of every 10.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from master.metrics import MasterMetrics

logger = logging.getLogger(__name__)

#: Allocations between two young collections, and young collections between two middle ones
#: (CPython's defaults).
YOUNG_THRESHOLD = 700
MIDDLE_THRESHOLD = 10
#: Middle collections between two full ones (CPython's default is 10).
OLD_THRESHOLD = 100


def settle(metrics: MasterMetrics) -> None:
    """Collect what start-up left behind, freeze the rest out of every later collection, run
    full collections less often, and time every collection from now on into ``metrics``."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, OLD_THRESHOLD)
    metrics.gc_frozen_objects.set(gc.get_freeze_count())
    gc.callbacks.append(PauseClock(metrics).on_collection)
    logger.info("heap settled: %d objects frozen out of garbage collection", gc.get_freeze_count())


class PauseClock:
    """Times each garbage collection (a :data:`gc.callbacks` entry) into ``pdc_gc_pause_seconds``:
    a pause there is a pause of every stream the process relays."""

    def __init__(self, metrics: MasterMetrics) -> None:
        self._by_generation = [metrics.gc_pause.labels(generation=str(g)) for g in range(3)]
        self._started = 0.0

    def on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._by_generation[info["generation"]].observe(time.perf_counter() - self._started)
