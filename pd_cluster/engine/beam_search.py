"""Beam searches as rows of the engine: one row a live beam, every row's prefix KV shared.

A search starts from its prompt in one row: computed here (:meth:`BeamSearches.add`), or handed
over by a prefill node (:meth:`BeamSearches.start_from_kv`: the row lists the prompt's KV but for
its last token, which the first step computes again, so that step has the logits every first
continuation is drawn from; P sends KV only, never logits). Each step runs every live beam of every
search as one decode row of one forward, ranks every search's continuations on the device
(:mod:`pd_cluster.engine.beam_select`: one small read-back a step) and lets
:class:`~pd_cluster.engine.beam_scorer.BeamScorer` pick among them. A continuation gets a row of
its own whose table lists its parent's slots (the pool counts one more holder of each,
:meth:`KVPool.share`): nothing is copied. The parents' rows are then freed, which returns only the
slots no other beam holds. A search reserves the KV it may need at its peak (``width`` rows of
prompt + max_tokens, the prompt counted once), so the scheduler never admits past it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pd_cluster.engine.beam_scorer import Beam, BeamScorer, FinishedBeam
from pd_cluster.engine.beam_select import select
from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.engine.model_runner import ModelRunner
from pd_cluster.engine.req_table import ReqSlotTable
from pd_cluster.engine.request import Request
from pd_cluster.engine.scheduler import ScheduledStep, Scheduler
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: Builds the engine request that one beam's row runs as (its id, its token ids so far).
RowFactory = Callable[[str, list[int]], Request]


@dataclass
class BeamResult:
    """A finished beam search: its best ``beam_outputs`` beams, best first."""

    request_id: str
    prompt_token_ids: list[int]
    beams: list[FinishedBeam]
    finish_reason: str | None = None
    #: The search's settings (how its text is decoded).
    params: SamplingParams | None = None


@dataclass(eq=False)
class BeamGroup:
    """One beam search: its scorer and the rows of its live beams (in the scorer's order)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    scorer: BeamScorer
    rows: list[Request] = field(default_factory=list)
    #: Request-table rows it holds and no beam uses now.
    spare_rows: list[int] = field(default_factory=list)
    #: KV slots counted against the scheduler's admission while it runs.
    reserved: int = 0

    @property
    def peak_kv(self) -> int:
        width, prompt = self.params.beam_width, len(self.prompt_token_ids)
        return width * (prompt + self.params.max_tokens) - (width - 1) * prompt


class BeamSearches:
    """The engine's beam searches: waiting for room, then one step each per :meth:`step`."""

    def __init__(self, pool: KVPool, table: ReqSlotTable, scheduler: Scheduler, runner: ModelRunner,
                 make_row: RowFactory) -> None:
        self.pool = pool
        self.table = table
        self.scheduler = scheduler
        self.runner = runner
        self.make_row = make_row
        self.waiting: list[BeamGroup] = []
        self.running: list[BeamGroup] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, group: BeamGroup) -> None:
        """Queue a search (its prompt is computed when it is admitted)."""
        self.waiting.append(group)

    def abort(self, request_id: str) -> bool:
        for queue in (self.waiting, self.running):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    self._finish(group)
                    return True
        return False

    def start_from_kv(self, group: BeamGroup, slots: torch.Tensor) -> None:
        """Start a search at once from its prompt's KV (``slots``, one a prompt token, each held
        by this search from now on): its first row lists all but the last, whose slot is
        given back (the first step writes that token's KV again, into a slot of its own).
        Raises ValueError, holding nothing, when its rows or peak KV do not fit now."""
        n, width = len(group.prompt_token_ids), group.params.beam_width
        need = group.peak_kv
        if need - (n - 1) > self.pool.num_free or self.table.num_free_rows < width:
            self.pool.free(slots)
            raise ValueError(f"no room for a beam search of width {width} ({need} KV slots at its peak, "
                             f"{self.pool.num_free} free)")
        group.spare_rows = [self.table.alloc_row() for _ in range(width)]
        row = self.make_row(group.request_id, group.prompt_token_ids)
        row.row = group.spare_rows.pop()
        self.table.write(row.row, 0, slots[: n - 1])
        self.pool.free(slots[n - 1 :])
        row.num_computed = n - 1
        group.rows = [row]
        group.reserved = need
        self.scheduler.external_held += need
        self.running.append(group)

    def step(self) -> list[BeamResult]:
        """Admit what fits, run one step of every running search; the searches that ended."""
        self._admit()
        if not self.running:
            return []
        step = ScheduledStep()
        for group in self.running:
            for row in group.rows:
                q_len = row.num_tokens - row.num_computed
                slots = self.pool.take(q_len)
                if slots is None:  # reserved at admission: cannot happen unless the books are wrong
                    raise RuntimeError("beam search ran out of its reserved KV slots")
                step.add(row, q_len, slots, True)
        logits = self.runner.run(step)
        for row, q_len in zip(step.requests, step.q_lens):
            row.num_computed += q_len
        running = list(self.running)
        chosen = select(logits, [group.scorer.ask() for group in running])
        ended: list[BeamResult] = []
        for group, candidates in zip(running, chosen):
            beams = group.scorer.advance(candidates)
            self._fork(group, beams)
            if group.scorer.done:
                self.running.remove(group)
                self._finish(group)
                ended.append(BeamResult(group.request_id, group.prompt_token_ids,
                                        group.scorer.best(group.params.beam_outputs), params=group.params))
        return ended

    def _admit(self) -> None:
        """Start waiting searches, oldest first, while their peak KV and ``width`` rows fit (each
        search holds its rows from start to end, so a fork always finds one)."""
        while self.waiting:
            group = self.waiting[0]
            need = group.peak_kv
            width = group.params.beam_width
            if need > self.pool.num_free or not self.scheduler.fits(need, 0) or self.table.num_free_rows < width:
                return
            self.waiting.pop(0)
            group.spare_rows = [self.table.alloc_row() for _ in range(width)]
            row = self.make_row(group.request_id, group.prompt_token_ids)
            row.row = group.spare_rows.pop()
            group.rows = [row]
            group.reserved = need
            self.scheduler.external_held += need
            self.running.append(group)

    def _fork(self, group: BeamGroup, beams: list[Beam]) -> None:
        """A parent's first child goes on in its row; each other child gets a row listing the
        parent's slots (shared, not copied). A parent with no child frees its row first, and with
        it the slots no other beam holds."""
        parents = group.rows
        children_of: dict[int, list[int]] = {}
        for i, beam in enumerate(beams):
            children_of.setdefault(beam.parent, []).append(i)
        for index, parent in enumerate(parents):
            if index not in children_of:
                self._free_row(group, parent)
        rows: list[Request | None] = [None] * len(beams)
        for index, kids in children_of.items():
            parent = parents[index]
            for i in kids[1:]:
                rows[i] = self._share_row(group, parent, beams[i])
            parent.sampling.output_token_ids[:] = beams[kids[0]].token_ids
            rows[kids[0]] = parent
        group.rows = [row for row in rows if row is not None]

    def _share_row(self, group: BeamGroup, parent: Request, beam: Beam) -> Request:
        slots = self.table.read(parent.row, parent.num_computed)
        child = self.make_row(group.request_id, group.prompt_token_ids)
        child.sampling.output_token_ids.extend(beam.token_ids)
        child.row = group.spare_rows.pop()
        self.pool.share(slots)
        self.table.write(child.row, 0, slots)
        child.num_computed = parent.num_computed
        return child

    def _free_row(self, group: BeamGroup, row: Request) -> None:
        self.pool.free(self.table.read(row.row, row.num_computed))
        group.spare_rows.append(row.row)
        row.row = -1

    def _finish(self, group: BeamGroup) -> None:
        """Free the search's slots (those no other holder keeps), its rows and its reservation."""
        for row in group.rows:
            if row.row >= 0:
                self._free_row(group, row)
        for index in group.spare_rows:
            self.table.free_row(index)
        group.rows, group.spare_rows = [], []
        self.scheduler.external_held -= group.reserved
        group.reserved = 0
