"""Beam searches as rows of the engine: one row a live beam, every row's prefix KV shared.

A search starts from its prompt in one row: computed here (:meth:`BeamSearches.add`), or handed
over by a prefill node (:meth:`BeamSearches.start_from_kv`: the row lists the prompt's KV but for
its last token, which the first step computes again, so that step has the logits every first
continuation is drawn from; P sends KV only, never logits). Each step runs every live beam of every
search as one decode row of one forward and ranks every search's continuations on the device
(:mod:`pd_cluster.engine.beam_select`), which also keeps the next beams there: the next step's
rows list their parents' slots by a gather on the device (:mod:`pd_cluster.engine.beam_rows`:
nothing is copied but the row of slot numbers) and read their tokens there. So, as the engine's
greedy steps are, the steps are pipelined where the engine pipelines (a GPU): a call launches the
next step before it reads the last one back, and
:class:`~pd_cluster.engine.beam_scorer.BeamScorer` picks among that step's continuations, and the
books follow, while the device runs. A search found ended then has launched one step too many,
whose result is dropped. A search reserves the KV it may need at its peak (``width`` rows of
prompt + max_tokens, the prompt counted once), so the scheduler never admits past it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pd_cluster.engine.beam_rows import BeamRows
from pd_cluster.engine.beam_scorer import BeamScorer, FinishedBeam
from pd_cluster.engine.beam_select import DeviceSelection, KeptBeams, SelectionAsk, select_on_device
from pd_cluster.engine.device_copy import tensor_on
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
    """One beam search: its scorer, its rows and where its steps stand."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    scorer: BeamScorer
    #: Its rows and slots, from admission on (None while it waits).
    books: BeamRows | None = None
    #: KV slots counted against the scheduler's admission while it runs.
    reserved: int = 0
    #: Steps launched so far.
    steps: int = 0
    #: The beams the last step launched keeps, on the device (None: no step launched yet).
    kept: KeptBeams | None = None
    #: Its last step (at the length limit) is launched: it takes no more.
    last_launched: bool = False
    #: The ids that end a beam, on the device (None: none).
    stop_ids: torch.Tensor | None = None
    #: Ended or aborted: a step in flight drops its part.
    closed: bool = False

    @property
    def peak_kv(self) -> int:
        width, prompt = self.params.beam_width, len(self.prompt_token_ids)
        return width * (prompt + self.params.max_tokens) - (width - 1) * prompt

    @property
    def rows(self) -> list[Request]:
        """The rows of its live beams (as of the last step launched)."""
        return self.books.requests[: self.books.running] if self.books is not None else []


@dataclass
class _Launched:
    """A beam step whose forward and selection are queued: its searches, in step order."""

    groups: list[BeamGroup]
    selection: DeviceSelection


class BeamSearches:
    """The engine's beam searches: waiting for room, then one step each per :meth:`step`."""

    def __init__(self, pool: KVPool, table: ReqSlotTable, scheduler: Scheduler, runner: ModelRunner,
                 make_row: RowFactory, pipelined: bool = False) -> None:
        """``pipelined``: leave each step in flight until the next call (the engine's overlap
        scheduling, where no other copy of the table follows this one's host writes)."""
        self.pool = pool
        self.table = table
        self.scheduler = scheduler
        self.runner = runner
        self.make_row = make_row
        self.pipelined = pipelined
        self.waiting: list[BeamGroup] = []
        self.running: list[BeamGroup] = []
        self.vocab = runner.model.config.vocab_size
        self._in_flight: _Launched | None = None
        self._no_sum = torch.zeros(1, dtype=torch.float32, device=runner.device)
        #: (KV frees, row frees) when the step in flight was launched (None: none in flight): a
        #: free since may be of a slot it still writes (a search found ended as it ran).
        self.frees_at_launch: tuple[int, int] | None = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight)

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
        self._start(group)
        assert group.books is not None
        group.books.start_from(slots[: n - 1])
        self.pool.free(slots[n - 1 :])

    def step(self) -> list[BeamResult]:
        """Admit what fits, launch one step of every running search, and read back the step
        before (pipelined) or this one; the searches that ended."""
        self._admit()
        launched = self._launch()
        ended = self._read_back(self._in_flight) if self._in_flight is not None else []
        self._in_flight = launched
        if launched is not None and not self.pipelined:
            self._in_flight = None
            ended += self._read_back(launched)
        if self._in_flight is None:
            self.frees_at_launch = None
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
            self._start(group)

    def _start(self, group: BeamGroup) -> None:
        """Give a search its rows and its reservation, and run it from the next step."""
        requests = [self.make_row(group.request_id, group.prompt_token_ids) for _ in range(group.params.beam_width)]
        group.books = BeamRows.allocate(self.table, self.pool, requests)
        stop_ids = sorted(group.scorer.stop_ids)
        group.stop_ids = tensor_on(stop_ids, torch.int64, self.runner.device) if stop_ids else None
        group.reserved = group.peak_kv
        self.scheduler.external_held += group.reserved
        self.running.append(group)

    def _launch(self) -> _Launched | None:
        """Queue one step of every search that takes one: its forward, then its selection."""
        groups = [g for g in self.running if not g.last_launched]
        if not groups:
            return None
        step = ScheduledStep()
        asks: list[SelectionAsk] = []
        sums: list[torch.Tensor] = []
        tokens: list[torch.Tensor] = []
        for group in groups:
            rows = self._add_rows(group, step, tokens)
            sums.append(group.kept.cum_logprobs if group.kept is not None else self._no_sum)
            group.steps += 1
            scorer = group.scorer
            keep = 0 if group.steps >= group.params.max_tokens else min(scorer.width, scorer.k, rows * self.vocab)
            group.last_launched = keep == 0
            asks.append(SelectionAsk(rows, scorer.k, scorer.top_logprobs or 0, keep, group.stop_ids))
        device_tokens = (tokens[0] if len(tokens) == 1 else torch.cat(tokens)) if tokens else None
        logits = self.runner.run(step, None, device_tokens)
        for row, q_len in zip(step.requests, step.q_lens):
            row.num_computed += q_len
        selection = select_on_device(logits, sums[0] if len(sums) == 1 else torch.cat(sums), asks)
        for group, kept in zip(groups, selection.kept):
            group.kept = kept
        if self.pipelined:
            self.frees_at_launch = (self.pool.frees, self.table.frees)
        return _Launched(groups, selection)

    def _add_rows(self, group: BeamGroup, step: ScheduledStep, tokens: list[torch.Tensor]) -> int:
        """Add a search's rows to ``step``: its prompt's row first, then its beams, each row
        listing its parent's slots (forked on the device) and reading its token there, from
        ``tokens`` (the device tokens of the rows before it); how many rows."""
        books = group.books
        assert books is not None
        if group.kept is None:
            row = books.requests[0]
            q_len = row.num_tokens - row.num_computed
            slots = books.take_step(1, q_len)
            if slots is None:  # reserved at admission: cannot happen unless the books are wrong
                raise RuntimeError("beam search ran out of its reserved KV slots")
            step.add(row, q_len, slots[0], True)
            return 1
        rows = group.kept.tokens.numel()
        computed = books.requests[0].num_computed
        books.fork_on_device(group.kept.parents, computed)
        books.pend(rows, computed)
        slots = books.take_step(rows, 1)
        if slots is None:
            raise RuntimeError("beam search ran out of its reserved KV slots")
        first = sum(t.numel() for t in tokens)
        for i, row in enumerate(books.requests[:rows]):
            row.pending_index = first + i
            step.add(row, 1, slots[i], True)
        tokens.append(group.kept.tokens)
        return rows

    def _read_back(self, launched: _Launched) -> list[BeamResult]:
        """Take a launched step's continuations: each search's scorer picks its beams and its
        books follow (or it ends: its rows and slots go back)."""
        ended: list[BeamResult] = []
        for group, candidates in zip(launched.groups, launched.selection.fetch()):
            if group.closed:
                continue
            beams = group.scorer.advance(candidates)
            if group.scorer.done:
                self.running.remove(group)
                self._finish(group)
                ended.append(BeamResult(group.request_id, group.prompt_token_ids,
                                        group.scorer.best(group.params.beam_outputs), params=group.params))
            else:
                assert group.books is not None
                group.books.fork([beam.parent for beam in beams])
        return ended

    def _finish(self, group: BeamGroup) -> None:
        """Free the search's slots (those no other holder keeps), its rows and its reservation."""
        group.closed = True
        if group.books is not None:
            group.books.release()
        self.scheduler.external_held -= group.reserved
        group.reserved = 0
