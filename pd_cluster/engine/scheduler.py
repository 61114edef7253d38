"""Continuous batching: which requests run in the next step, and with how many tokens.

Each step carries every decoding request (one token each) and fills the rest of the token
budget with prefill chunks, oldest first. New requests are admitted only while the batch's
peak future KV need fits the pool; if memory still runs out, the newest request is preempted
(its KV goes to the prefix cache) and recomputed later.
"""

from __future__ import annotations

import time

import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from pd_cluster.config import EngineConfig
from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.engine.length_predictor import OutputLengthPredictor
from pd_cluster.engine.radix_cache import RadixCache
from pd_cluster.engine.req_table import ReqSlotTable
from pd_cluster.engine.request import PENDING, Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledStep:
    requests: list[Request] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)
    #: Each request's new KV slots (int64, host). Numpy rather than torch: a decode step schedules
    #: every few hundred microseconds, and each torch op costs microseconds and lets another thread
    #: take the interpreter.
    new_slots: list[np.ndarray] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    #: Rows that decode one token (the rest are prefill chunks).
    decode_rows: int = 0

    def add(self, req: Request, q_len: int, slots: np.ndarray | torch.Tensor, sample: bool) -> None:
        self.requests.append(req)
        self.q_lens.append(q_len)
        self.new_slots.append(slots.numpy() if isinstance(slots, torch.Tensor) else slots)
        self.samples.append(sample)

    def slot_list(self) -> list[int]:
        """Every request's new slots, in step order, as one list."""
        if len(self.new_slots) == 1:
            return self.new_slots[0].tolist()
        return np.concatenate(self.new_slots).tolist() if self.new_slots else []

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


def peak_kv_need(held: list[int], left: list[int]) -> int:
    """Most KV slots the batch will hold at once if each request grows by its ``left`` tokens.

    Sorted by remaining output (longest first), request ``i`` finishing means the ``i + 1``
    longest-running requests each grew by ``left[i]``: peak = max_i sum(held[:i+1]) + left[i]*(i+1).
    """
    order = sorted(range(len(held)), key=lambda i: left[i], reverse=True)
    peak = cumulative = 0
    for rank, i in enumerate(order):
        cumulative += held[i]
        peak = max(peak, cumulative + left[i] * (rank + 1))
    return peak


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        pool: KVPool,
        cache: RadixCache,
        table: ReqSlotTable,
        predictor: OutputLengthPredictor,
    ) -> None:
        self.config = config
        self.pool = pool
        self.cache = cache
        self.table = table
        self.predictor = predictor
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: Slots held outside running requests (e.g. a decode node's reservations for incoming KV).
        self.external_held = 0
        self.num_preemptions = 0
        #: The step :meth:`schedule` made last (the engine thread times it: :mod:`step_rates`).
        self.last_step: ScheduledStep | None = None
        #: Most prompt tokens a step takes (None: the step's token budget); the engine sets the
        #: largest mixed graph's size where it captured them (``EngineConfig.prefill_chunk_tokens``).
        self.prefill_chunk_tokens: int | None = config.prefill_chunk_tokens

    # ---- queue management ----------------------------------------------------------------

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """A request whose KV is already in the pool (a decode node's handed-over prefill)."""
        req.status = RequestStatus.RUNNING
        req.admitted_once = True
        self.running.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Drop a request from the queues (ended or aborted): forget its tokens still on the
        device, and release its KV unless held."""
        self._drop_pending(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if not req.hold_kv:
            self.release_kv(req)

    def _drop_pending(self, req: Request) -> None:
        """Forget the tokens still on the device for an ending request, and free the KV slots of
        the ones a later step already fed back (never cached: their tokens are gone)."""
        out = req.sampling.output_token_ids
        while out and out[-1] == PENDING:
            out.pop()
        req.pending_index = None
        n = req.num_tokens
        if req.row >= 0 and req.num_computed > n:
            self.pool.free(self.table.read(req.row, req.num_computed)[n:])
            req.num_computed = n

    def release_kv(self, req: Request) -> None:
        """Give a request's KV to the prefix cache (whole blocks) or back to the pool."""
        if req.row < 0:
            return
        n = req.num_computed
        slots = self.table.read(req.row, n)
        tokens = req.token_ids(0, n)
        self.cache.insert(tokens, slots)
        n_full = (n // self.cache.block_size) * self.cache.block_size
        self.pool.free(slots[n_full:])
        if req.prefix_node is not None:
            self.cache.dec_ref(req.prefix_node)
            req.prefix_node = None
        self.table.free_row(req.row)
        req.row = -1
        req.num_computed = 0

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        # Prompt tokens this step may still take (decode rows do not count).
        prefill_left = budget if self.prefill_chunk_tokens is None else self.prefill_chunk_tokens
        self.running.sort(key=lambda r: r.arrival_time)

        decoding = [r for r in self.running if r.remaining_to_compute == 1 and not r.last_token_pending]
        batch_slots = self.take_slots(len(decoding)) if decoding else None
        if batch_slots is not None:  # the common case: one allocation for the whole decode batch
            for i, req in enumerate(decoding):
                step.add(req, 1, batch_slots[i : i + 1], sample=True)
            budget -= len(decoding)
            decoding = []
        for req in decoding:
            if req not in self.running:
                continue
            slots = self.take_slots(1)
            while slots is None:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
                slots = self.take_slots(1)
            if slots is None:
                continue
            step.add(req, 1, slots, sample=True)
            budget -= 1

        for req in list(self.running):
            if budget <= 0:
                break
            limit = budget if req.whole_prefill else min(budget, prefill_left)
            if req.remaining_to_compute <= 1 or req not in self.running or limit <= 0:
                continue
            n = min(req.remaining_to_compute, limit)
            slots = self.take_slots(n)
            if slots is None:
                break
            step.add(req, n, slots, sample=n == req.remaining_to_compute)
            budget -= n
            prefill_left -= n

        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            limit = budget if req.whole_prefill else min(budget, prefill_left)
            if limit <= 0 or req.waits_for_token or not self._admit(req, limit, step):
                break
            self.waiting.popleft()
            budget -= step.q_lens[-1]
            prefill_left -= step.q_lens[-1]
        step.decode_rows = sum(1 for q, s in zip(step.q_lens, step.samples) if q == 1 and s)
        self.last_step = step
        return step

    def alloc_slots(self, n: int) -> torch.Tensor | None:
        """``n`` free KV slots, evicting unpinned prefix-cache entries if needed; None if impossible."""
        slots = self.take_slots(n)
        return torch.from_numpy(slots) if slots is not None else None

    def take_slots(self, n: int) -> np.ndarray | None:
        """:meth:`alloc_slots` as a numpy array, for the steps this scheduler builds."""
        slots = self.pool.take(n)
        if slots is None and self.cache.evictable_tokens > 0:
            self.cache.evict(n - self.pool.num_free)
            slots = self.pool.take(n)
        return slots

    def _left(self, req: Request) -> int:
        return self.predicted_left(req.sampling.params, len(req.output_token_ids))

    def predicted_left(self, params, generated: int) -> int:
        """Output tokens a request with these params is still expected to produce."""
        return self.predictor.remaining(generated, params.max_tokens, params.ignore_eos)

    def fits(self, extra_held: int, extra_left: int) -> bool:
        """Whether the running batch plus one more request stays within the pool at its peak."""
        held = [r.num_tokens for r in self.running] + [extra_held]
        left = [self._left(r) for r in self.running] + [extra_left]
        return peak_kv_need(held, left) <= self.pool.capacity - self.external_held

    def _admit(self, req: Request, budget: int, step: ScheduledStep) -> bool:
        if not self.fits(req.num_tokens, self._left(req)) and self.running:
            return False
        match = self.cache.match_prefix(req.token_ids(0, req.num_tokens))
        block = self.cache.block_size
        usable = min(match.num_tokens, ((req.num_tokens - 1) // block) * block)
        if req.prompt_logprobs is not None:  # cached positions have no logits: recompute those not scored
            usable = min(usable, (req.prompt_logprobs.done // block) * block)
        row = self.table.alloc_row()
        if row is None:
            return False
        self.cache.inc_ref(match.node)
        n = min(req.num_tokens - usable, budget)
        slots = self.take_slots(n)
        if slots is None:
            self.cache.dec_ref(match.node)
            self.table.free_row(row)
            return False
        req.row = row
        req.prefix_node = match.node
        req.num_computed = usable
        if usable:
            self.table.write(row, 0, match.slots[:usable])
        if not req.admitted_once:
            req.num_cached_tokens = usable
            req.admitted_once = True
            req.admitted_time = time.monotonic()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        step.add(req, n, slots, sample=n == req.num_tokens - usable)
        return True

    def _preempt(self, req: Request) -> None:
        logger.info("preempting request %s to free KV (recomputed later)", req.request_id)
        self.running.remove(req)
        self.release_kv(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
