"""After a step: its sampled ids into their requests, ended requests out of the batch, text out.

A token is taken in two stages, as vLLM's scheduler update and its output processor take it. By
id, as soon as it is read back (:meth:`Postprocessor.accept`): EOS, a stop id, the length limit, a
complete grammar or a prefill-only request's first token end the request at once, so no later
step runs it. Then as text (:meth:`Postprocessor.detokenize`, through the request's
:class:`~pd_cluster.engine.output_processor.OutputProcessor`): a stop string may end it there,
and its :class:`TokenUpdate` is made. Without overlap scheduling a token's text is made as soon
as it is taken; with it, one call later while the device runs the next step.

Ids still on the device hold their place in the request's output as :data:`PENDING` until they
are read back (:class:`InFlight`), so the next step can be scheduled around them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pd_cluster.engine.launch_timing import StepMarks
from pd_cluster.engine.length_predictor import OutputLengthPredictor
from pd_cluster.engine.outputs import EngineStats, TokenUpdate
from pd_cluster.engine.penalties import PenaltyBook
from pd_cluster.engine.request import PENDING, Request, RequestStatus
from pd_cluster.engine.sampler import DeviceSample, SampledToken, SamplingState, fetch
from pd_cluster.engine.scheduler import Scheduler


@dataclass
class InFlight:
    """A step's sampled ids still on the device, and where each goes: request ``i``'s output
    holds :data:`PENDING` at ``positions[i]`` until they are read back."""

    requests: list[Request]
    positions: list[int]
    #: Each request's row in ``result`` (rows of requests that ended meanwhile are skipped).
    rows: list[int]
    result: DeviceSample
    #: The sampling states of all of ``result``'s rows, in row order.
    states: list[SamplingState]
    #: Events around the step's kernels (late launch's timing), if kept.
    marks: StepMarks | None = None


@dataclass
class _Taken:
    """A token taken by id, its text not made yet."""

    request: Request
    token: SampledToken
    #: The request's first output token (its update says so).
    first: bool


class Postprocessor:
    """Takes a step's sampled ids into their requests, then their text out as updates, ending
    requests on the way (one place for what ends a request and what that frees)."""

    def __init__(self, scheduler: Scheduler, penalties: PenaltyBook, predictor: OutputLengthPredictor,
                 requests: dict[str, Request], stats: EngineStats) -> None:
        self.scheduler = scheduler
        self.penalties = penalties
        self.predictor = predictor
        #: The engine's running requests by id (a finished one leaves it).
        self.requests = requests
        self.stats = stats
        #: Tokens taken by id, their text not made yet.
        self.deferred: list[_Taken] = []

    def hold_places(self, reqs: list[Request], result: DeviceSample, marks: StepMarks | None) -> InFlight | None:
        """The sampling of ``reqs`` (row ``i`` of ``result`` for ``reqs[i]``) is queued: hold each
        request's place for its id. A request that ended since the step was scheduled (its
        previous token, read back meanwhile, ended it) gets none: its id is dropped."""
        live, positions, rows = [], [], []
        for i, req in enumerate(reqs):
            if req.finished or req.row < 0:
                self.stats.dropped_tokens += 1
                continue
            out = req.sampling.output_token_ids
            live.append(req)
            rows.append(i)
            positions.append(len(out))
            out.append(PENDING)
            req.pending_index = i
            req.last_token_pending = len(out) >= req.sampling.params.max_tokens
        if not live:
            return None
        return InFlight(live, positions, rows, result, [r.sampling for r in reqs], marks)

    def read_back(self, launched: InFlight, text_now: bool = False) -> list[TokenUpdate]:
        """Copy a step's ids to the host (waiting for its sampling, not for what was queued after
        it) and take each into its place. ``text_now``: make each token's text as soon as it is
        taken (the updates returned), before the next token is; else :meth:`detokenize` does later."""
        tokens = fetch(launched.result, launched.states)
        now = time.monotonic()
        updates: list[TokenUpdate] = []
        for req, position, row in zip(launched.requests, launched.positions, launched.rows):
            tok = tokens[row]
            out = req.sampling.output_token_ids
            if req.finished or position >= len(out) or out[position] != PENDING:
                self.stats.dropped_tokens += 1  # drawn after a stop string had ended its request
                continue
            out[position] = tok.token_id
            if req.pending_index is not None and position == len(out) - 1:
                req.pending_index = None
            self.accept(req, tok, now, count=position + 1)
            if text_now:
                updates += self.detokenize()
        return updates

    def accept(self, req: Request, tok: SampledToken, now: float, count: int | None = None) -> None:
        """Take a token into the request by id (the next step can use it); its text comes later.
        ``count``: the output's length up to the token, which already holds its place there (a
        read-back id); None: it is appended."""
        if count is None:
            req.sampling.output_token_ids.append(tok.token_id)
            count = len(req.output_token_ids)
        first = count == 1
        if first and req.num_cached_tokens:
            self.stats.cached_prompt_tokens += req.num_cached_tokens
        if tok.logprob is not None:
            req.logprobs.append(tok.logprob)
        if req.first_token_time is None:
            req.first_token_time = now
        self.stats.generation_tokens += 1
        self.deferred.append(_Taken(req, tok, first))
        grammar_done = req.advance_grammar()
        if req.prefill_only or grammar_done or req.output.ends_with_token(tok.token_id, count):
            self.scheduler.remove(req)  # never scheduled again; finished once its text is out

    def detokenize(self) -> list[TokenUpdate]:
        """The text of the tokens taken since the last call, one update each; a request whose
        output ends at its token (a stop string, or what ended it by id) finishes here."""
        taken, self.deferred = self.deferred, []
        updates: list[TokenUpdate] = []
        for item in taken:
            req, tok = item.request, item.token
            if req.finished:  # aborted meanwhile
                continue
            update = req.output.append(tok.token_id, grammar_done=req.grammar is not None and req.grammar.terminated)
            if update.finish_reason is not None:
                self._finish(req, update.finish_reason)
            elif req.prefill_only:
                self._finish(req, None)
            updates.append(TokenUpdate(
                request_id=req.request_id, token_id=tok.token_id, text_delta=update.text_delta,
                logprob=tok.logprob, finish_reason=update.finish_reason, first_token=item.first,
                prompt_logprobs=req.prompt_logprobs.result() if item.first and req.prompt_logprobs else None,
            ))
        return updates

    def _finish(self, req: Request, reason: str | None) -> None:
        """Take a request out of the batch; ``reason`` None: its prefill-only part is done."""
        req.finish_reason = reason
        self.scheduler.remove(req)
        self.penalties.release(req.sampling)
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)
        self.stats.finished_requests += 1
        if reason is not None and not req.sampling.params.ignore_eos:
            self.predictor.observe(len(req.output_token_ids))
        self.stats.preemptions = self.scheduler.num_preemptions
