"""Prefill on a second CUDA stream, beside the pipelined step in flight.

A request a node asks to prefill at once (``prefill_now``) joins the batch two steps later: the
step in flight, then its own. A short miss (a later turn prefilled where it decodes) need not wait
for any decode step: prefilled now on the side stream, its first token is read back with the step
in flight's and it joins the next batch. Requests with penalties or a grammar, whose state the
batch's sampling updates, and misses above ``side_prefill_max_tokens`` join the batch as usual.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pd_cluster.config import EngineConfig
from pd_cluster.engine.model_runner import ModelRunner
from pd_cluster.engine.penalties import PenaltyBook, has_penalties
from pd_cluster.engine.postprocess import Postprocessor
from pd_cluster.engine.radix_cache import RadixCache
from pd_cluster.engine.req_table import ReqSlotTable
from pd_cluster.engine.request import Request, RequestStatus
from pd_cluster.engine.sampler import DeviceSample, fetch, sample_on_device
from pd_cluster.engine.scheduler import ScheduledStep, Scheduler

#: Requests prefilled on the side stream at once, at most.
MAX_ASIDE = 4


@dataclass
class _Aside:
    """A request prefilled on the side stream beside the step in flight, its first token not read
    back yet; it joins the decode batch once it is."""

    request: Request
    result: DeviceSample
    #: KV slots it took, counted against admission until it joins the batch.
    held: int


class SidePrefills:
    """The side stream (on a GPU with ``side_prefill_max_tokens``) and the requests prefilled on it."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, cache: RadixCache, table: ReqSlotTable,
                 runner: ModelRunner, penalties: PenaltyBook, postprocessor: Postprocessor,
                 device: torch.device) -> None:
        self.config = config
        self.scheduler = scheduler
        self.cache = cache
        self.table = table
        self.runner = runner
        self.penalties = penalties
        self.postprocessor = postprocessor
        self.stream = (torch.cuda.Stream(device, priority=-1)
                       if device.type == "cuda" and config.side_prefill_max_tokens > 0 else None)
        self._aside: list[_Aside] = []

    @property
    def pending(self) -> bool:
        """Whether a side prefill is not read back yet."""
        return bool(self._aside)

    def holds(self, req: Request) -> bool:
        """Whether ``req``'s prefill runs on the side stream (not read back yet)."""
        return any(entry.request is req for entry in self._aside)

    def _has_room(self, req: Request) -> bool:
        sched = self.scheduler
        return (self.stream is not None and len(self._aside) < MAX_ASIDE
                and req.grammar is None and not has_penalties(req.sampling.params)
                and len(sched.running) + len(self._aside) < self.config.max_running_requests
                and self.table.num_free_rows > 0)

    def start(self, req: Request) -> int | None:
        """Prefill a new request now on the side stream; the tokens it computes, or None where it
        may not (then it joins the batch as usual). The caller makes sure the step in flight
        uses none of the free KV slots and request rows."""
        if not self._has_room(req):
            return None
        config, sched = self.config, self.scheduler
        n = req.num_tokens
        match = self.cache.match_prefix(req.token_ids(0, n))
        block = self.cache.block_size
        usable = min(match.num_tokens, ((n - 1) // block) * block)
        miss = n - usable
        if miss > min(config.side_prefill_max_tokens, config.max_num_batched_tokens):
            return None
        if sched.running and not sched.fits(n, sched.predicted_left(req.sampling.params, 0)):
            return None
        self.cache.inc_ref(match.node)
        slots = sched.alloc_slots(miss)
        if slots is None:
            self.cache.dec_ref(match.node)
            return None
        row = self.table.alloc_row()
        assert row is not None  # checked above
        req.row, req.prefix_node, req.num_computed = row, match.node, usable
        req.num_cached_tokens, req.admitted_once = usable, True
        req.status = RequestStatus.RUNNING
        step = ScheduledStep()
        step.add(req, miss, slots, sample=True)
        with torch.cuda.stream(self.stream):
            if usable:
                self.table.write(row, 0, match.slots[:usable])
            logits = self.runner.run(step, side=True)
            result = sample_on_device(logits, [req.sampling], self.penalties)
        req.num_computed = n
        sched.external_held += miss
        self._aside.append(_Aside(req, result, miss))
        return miss

    def collect(self) -> None:
        """Read back every side prefill (launched beside the step in flight, they end about when it
        does), take their first tokens and join them to the batch; free those aborted meanwhile."""
        if not self._aside:
            return
        now = time.monotonic()
        for entry in self._aside:
            [tok] = fetch(entry.result, [entry.request.sampling])
            self.scheduler.external_held -= entry.held
            req = entry.request
            if req.finished:  # aborted while its prefill ran: its KV is free to go now
                self.scheduler.release_kv(req)
                continue
            self.scheduler.add_running(req)
            self.postprocessor.accept(req, tok, now)
        self._aside = []
