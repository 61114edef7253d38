"""The master process's heap, settled once it has started, so that garbage collection never
stalls the relay.

A full collection walks every object the process holds. After start-up that is over 100k of
them (the tokenizer, the app's routes, pydantic's schemas): one walk held the event loop ~100 ms
and more, and every stream's next token waited for it, which made the tail of the master's
added inter-token latency. Frozen (:func:`gc.freeze`), they are never walked again.

A node's frame brings a token for each of its streams, and each token allocates a few objects
(a chunk, a future, a handle) that live until its stream's task has written it. At CPython's
700 allocations a young collection ran inside nearly every frame and walked those objects, then
the middle one walked them again (10-20% of the CPU a token, measured on the relay path alone). At 2000 a frame's objects are
mostly gone before a collection looks; the middle generation, which holds what outlives them
(the live requests), is walked every 5 young collections, so that no walk of it is long (a
token waits for it). Full collections walk every live request: at most once every
``OLD_THRESHOLD`` middle ones instead of every 10.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from master.metrics import MasterMetrics

logger = logging.getLogger(__name__)

#: Allocations (less deallocations) between two young collections (CPython's default is 700),
#: and young collections between two middle ones (10).
YOUNG_THRESHOLD = 2000
MIDDLE_THRESHOLD = 5
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
