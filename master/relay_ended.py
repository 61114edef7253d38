"""Attempts that ended here, remembered for a while: a node that still reports holding one (it
was cut off, or missed the abort) is told to drop it, so its KV and batch slots go back to live
requests."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from master.registry import NodeRecord
from pd_cluster import protocol

logger = logging.getLogger(__name__)

#: Ended attempt ids remembered, so a node that still reports one is told to abort it.
ENDED_MEMORY = 65536
#: Least time between two aborts of the same stale attempt to one node.
STALE_ABORT_EVERY_S = 2.0


class EndedAttempts:
    def __init__(self, limit: int = ENDED_MEMORY) -> None:
        self.limit = limit
        #: Attempt id -> when it ended here (monotonic), oldest first.
        self._ended: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ended)

    def add(self, attempt_id: str) -> None:
        self._ended[attempt_id] = time.monotonic()
        while len(self._ended) > self.limit:
            self._ended.popitem(last=False)

    def abort_stale(self, node: NodeRecord, held: list[str], stale_after_s: float) -> None:
        """Abort on ``node`` each attempt of ``held`` (its status) that ended here over
        ``stale_after_s`` ago, at most once every :data:`STALE_ABORT_EVERY_S` per attempt."""
        now = time.monotonic()
        for attempt_id in held:
            ended_at = self._ended.get(attempt_id)
            if attempt_id in node.inflight or ended_at is None or now - ended_at < stale_after_s:
                continue
            last = node.stale_aborts.get(attempt_id)
            if last is not None and now - last < STALE_ABORT_EVERY_S:
                continue
            logger.info("node %s still holds ended attempt %s: aborting it", node.node_id, attempt_id)
            node.stale_aborts[attempt_id] = now
            node.send(protocol.Abort(request_id=attempt_id))
        if len(node.stale_aborts) > 4 * len(held) + 64:
            kept = set(held)
            node.stale_aborts = {k: v for k, v in node.stale_aborts.items() if k in kept}
