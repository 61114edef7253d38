"""A request's life in the master: admission, dispatch to a (P, D) pair, token relay, settlement.

State changes happen in plain (non-async) methods, so each one is atomic on the event loop:
node frames, node departures, timers and the HTTP handler never interleave inside one.
The HTTP handler only waits on a request's ``wakeup`` event and reads its buffer. A request
moves between the states of :mod:`master.relay_state` through ``RelayRequest.move_to`` only.

Each dispatch of a request is an :class:`~master.relay_attempt.Attempt` with its own id on the
wire. When a node is lost (removed, evicted, or it reports the request failed, e.g. D's lease ran
out) or the handover misses its deadline, the attempt is re-run on another pair:

* nothing reached the client yet (always the case for a non-streaming request): the request
  restarts from its prompt (on the same D when only P was lost);
* tokens reached the client: the stream *migrates*: prompt + the tokens generated so far are
  prefilled on the new pair (prefix reuse makes it cheap) and its D continues the same stream, so
  a greedy stream is what an uninterrupted run would have produced. The client only sees a pause.
After ``max_attempts`` dispatches the request fails with an error that says why.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from master.config import MasterSettings
from master.decode_room import HeldOff, WaitReason, why_full
from master.delta_frames import PlainDelta, delta_model
from master.errors import APIError, internal_error, unavailable
from master.metrics import MasterMetrics
from master.registry import NodeRecord, Registry
from master.relay_attempt import Attempt, claim_nodes, job_for, release_nodes
from master.relay_ended import EndedAttempts
from master.relay_queue import AdmissionQueue
from master.relay_request import DONE, ClientDisconnected, RelayRequest, StreamFailed, TokenChunk
from master.relay_state import Outcome, RequestState
from master.routing import RouteRequest, RoutingPolicy, admissible_decodes
from pd_cluster import protocol
from pd_cluster.aio import wait_for
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["ClientDisconnected", "Relay", "RelayRequest", "StreamFailed", "TokenChunk"]

#: Frames a D may send before P's FirstToken arrives (they are held back to keep order).
MAX_EARLY_DELTAS = 4096
#: How often a waiting non-streaming handler checks whether its client left.
DISCONNECT_POLL_S = 0.5
#: After its deadline, how long a request waits for its handler before the relay releases it.
ORPHAN_GRACE_S = 30.0


class Relay:
    def __init__(
        self, registry: Registry, policy: RoutingPolicy, metrics: MasterMetrics, settings: MasterSettings
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.settings = settings
        self.requests: dict[str, RelayRequest] = {}
        #: Live attempt id -> its request.
        self.attempts: dict[str, RelayRequest] = {}
        self.queue = AdmissionQueue(settings.queue_timeout_s, self._queue_expired, self._waited)
        #: Decode nodes that refused a lease or that a prefill node could not reach, held off
        #: until their next report.
        self.held_off = HeldOff()
        self._pump_scheduled = False
        self.ended = EndedAttempts()
        #: This master process's id, inside every request id it makes (see :meth:`new_request_id`).
        self.instance_id = uuid.uuid4().hex[:12]
        self._pumping = False
        #: Called with each request as it ends (the request log).
        self.on_end: list[Callable[[RelayRequest], None]] = []
        registry.on_removed.append(self.on_node_removed)
        registry.on_capacity.append(self.pump)

    # ---- the HTTP handler's side -----------------------------------------------------------

    def new_request_id(self, prefix: str) -> str:
        """A fresh request id that names this master: a node that loses its link to this master
        aborts the requests whose ids carry its id (they are re-run or ended here)."""
        return f"{prefix}-{self.instance_id}{uuid.uuid4().hex[12:]}"

    def create(
        self, request_id: str, token_ids: list[int], sampling: SamplingParams, stream: bool, arrival: float
    ) -> RelayRequest:
        r = RelayRequest(
            request_id=request_id,
            token_ids=token_ids,
            sampling=sampling,
            stream=stream,
            arrival=arrival,
            deadline=arrival + self.settings.request_timeout_s,
            route=RouteRequest(token_ids, len(token_ids) + sampling.max_tokens),
        )
        self.requests[request_id] = r
        loop = asyncio.get_running_loop()
        r.timers.append(loop.call_at(self._loop_time(r.deadline), self._deadline_expired, r))
        return r

    async def admit(self, r: RelayRequest, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Dispatch now, or wait in the admission queue; raises APIError (503) when it cannot."""
        self._raise_failure(r)  # it already failed (its deadline passed before its turn came)
        if not self.registry.active("decode") and not self.registry.active("mixed"):
            self._fail(r, unavailable("No decode or mixed node is available.", self.settings.retry_after_s), "unavailable")
            raise r.failure  # type: ignore[misc]
        if not self.queue and self._dispatch(r):
            return
        if len(self.queue) >= self.settings.queue_size:
            message = f"The admission queue is full ({self.settings.queue_size} requests wait for capacity); try again later."
            full = APIError(429, message, "rate_limit_error", None, "queue_full", self.settings.retry_after_s)
            self._fail(r, full, "rate_limited")
            raise r.failure  # type: ignore[misc]
        self._enqueue(r, why_full(self._decodes(), r.kv_need, self.held_off))
        while r.state == RequestState.QUEUED:
            await self._wake_or_poll(r)
            if r.state == RequestState.QUEUED and is_disconnected is not None and await is_disconnected():
                raise ClientDisconnected()
        self._raise_failure(r)

    async def batches(self, r: RelayRequest) -> AsyncIterator[list[TokenChunk]]:
        """Output chunks of a streaming request until it finishes, every chunk that arrived since
        the last wake-up in one list (one write to the client for them, however many frames the
        loop took in meanwhile); a wake-up with nothing new gives an empty list, so the caller
        can look at its own state. Raises StreamFailed after the chunks before the failure.

        The wait for the next chunk has no timeout of its own: the request's deadline timer
        (set in :meth:`create`, cancelled only by :meth:`release`) fails it and wakes this loop,
        so a token costs no timer here."""
        while True:
            chunks, end = r.take()
            if end is None:
                yield chunks
                await r.next_wakeup()
                continue
            if chunks:
                yield chunks
            if end is DONE:
                return
            raise StreamFailed(end)  # type: ignore[arg-type]

    async def wait(self, r: RelayRequest, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Wait until a non-streaming request is done; raises APIError or ClientDisconnected."""
        while not r.terminal:
            if not await self._wake_or_poll(r) and time.monotonic() > r.deadline + 1.0:
                self._deadline_expired(r)
            if not r.terminal and is_disconnected is not None and await is_disconnected():
                raise ClientDisconnected()
        self._raise_failure(r)

    @staticmethod
    async def _wake_or_poll(r: RelayRequest) -> bool:
        """Wait for ``r``'s next wake-up, at most DISCONNECT_POLL_S; False when none came."""
        r.wakeup.clear()
        try:
            await wait_for(r.wakeup.wait(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            return False
        return True

    @staticmethod
    def _raise_failure(r: RelayRequest) -> None:
        if r.state == RequestState.FAILED:
            assert r.failure is not None
            raise r.failure

    def fail(self, r: RelayRequest, error: APIError, outcome: str) -> None:
        """End ``r`` with ``error`` (the handler could not go on with it); no-op once it ended."""
        self._fail(r, error, outcome)  # type: ignore[arg-type]

    def release(self, r: RelayRequest) -> None:
        """The handler is done with ``r``: abort whatever still runs and record the outcome."""
        if r.released:
            return
        r.released = True
        if r.client_slot is not None:
            r.client_slot.release()
        for timer in r.timers:
            timer.cancel()
        self.queue.discard(r)
        if not r.terminal:
            self._end_attempt(r, abort=True)
            r.move_to(RequestState.FAILED)
            r.outcome = "aborted"
            logger.info("request %s aborted by its client", r.request_id)
        self.requests.pop(r.request_id, None)
        self._record(r)

    # ---- node events -------------------------------------------------------------------

    def _live(self, attempt_id: str) -> tuple[RelayRequest, Attempt] | None:
        """The request whose live attempt is ``attempt_id``, and that attempt."""
        r = self.attempts.get(attempt_id)
        if r is None or r.current is None or r.current.attempt_id != attempt_id:
            return None
        return r, r.current

    def on_first_token(self, node: NodeRecord, msg: protocol.FirstToken) -> None:
        live = self._live(msg.request_id)
        if live is None or live[1].prefill_id != node.node_id or live[1].first_token_seen:
            logger.debug("first token for unknown attempt %s from %s", msg.request_id, node.node_id)
            return
        r, attempt = live
        attempt.first_token_seen = True
        node.pending_prefill.pop(msg.request_id, None)  # P still owns the attempt until the handover
        self._count_first_token(attempt, msg)
        # Of the client's prompt (a migrated attempt's prompt also holds the output so far).
        r.cached_tokens = min(msg.cached_tokens_prefill, len(r.token_ids))
        attempt.first_token = msg
        attempt.node_ttft_s = msg.node_ttft_s
        if r.sampling.use_beam_search:
            logger.debug("%s: P's token ends only its prefill; the search on D answers", r.request_id)
        elif self.settings.first_token_via == "decode" and msg.finish_reason is None and not attempt.early_deltas:
            attempt.withheld_first = msg
        else:
            self._emit_first(r, msg)
        if msg.finish_reason is not None:
            self._finish(r, msg.finish_reason, abort_decode=True)
            return
        if attempt.early_deltas:
            self._handed_over(attempt)  # D already decodes it
        elif not attempt.handed_over:
            loop = asyncio.get_running_loop()
            attempt.handoff_timer = loop.call_later(self.settings.handoff_timeout_s, self._handoff_expired, r, attempt)
        early, attempt.early_deltas = attempt.early_deltas, []
        for delta in early:
            if r.terminal:
                break
            self._apply_delta(r, delta)

    def _count_first_token(self, attempt: Attempt, msg: protocol.FirstToken) -> None:
        """D's prefix hit and the KV bytes P moved; D's status shows the attempt's KV from now on."""
        decode = self.registry.get(attempt.decode_id)
        if decode is not None:
            decode.reported_kv.add(msg.request_id)
            self.metrics.prefix_hit_tokens.inc(msg.hit_blocks_decode * decode.info.kv_spec.block_size)
        self.metrics.kv_transfer_bytes.inc(msg.transfer_bytes)

    def _emit_first(self, r: RelayRequest, msg: protocol.FirstToken) -> None:
        logprobs = [msg.logprob] if msg.logprob is not None else None
        r.add_output(TokenChunk([msg.token_id], msg.text, logprobs, msg.finish_reason, msg.prompt_logprobs),
                     time.monotonic())

    def on_kv_transferred(self, node: NodeRecord, msg: protocol.KVTransferred) -> None:
        """P finished moving a request's KV (the bytes were counted with its FirstToken)."""
        self.metrics.kv_transfer_seconds.observe(msg.seconds)
        self.policy.link.observe(msg.bytes, msg.seconds)
        live = self._live(msg.request_id)
        if live is not None and live[1].prefill_id == node.node_id:
            self._handed_over(live[1])

    def _handed_over(self, attempt: Attempt) -> None:
        """The attempt's KV is on its D: P's loss no longer touches it."""
        if attempt.handed_over:
            return
        attempt.handed_over = True
        attempt.cancel_handoff_timer()
        prefill = self.registry.get(attempt.prefill_id)
        if prefill is not None and not attempt.ended:
            prefill.inflight.discard(attempt.attempt_id)

    def _handoff_expired(self, r: RelayRequest, attempt: Attempt) -> None:
        attempt.handoff_timer = None
        if r.terminal or r.current is not attempt or attempt.ended or attempt.handed_over:
            return
        reason = (f"prefill node {attempt.prefill_id} did not hand the request over within "
                  f"{self.settings.handoff_timeout_s:g} s")
        logger.warning("re-running %s: %s", r.request_id, reason)
        self._rerun(r, attempt.prefill_id, reason, keep_decode=False)

    def on_token_delta(self, node: NodeRecord, msg: protocol.TokenDelta) -> None:
        live = self._live(msg.request_id)
        if live is None or live[1].decode_id != node.node_id:
            logger.debug("tokens for unknown attempt %s from %s", msg.request_id, node.node_id)
            return
        r, attempt = live
        if not attempt.first_token_seen:
            if len(attempt.early_deltas) >= MAX_EARLY_DELTAS:
                self._fail(r, internal_error(), "error")
                return
            attempt.early_deltas.append(msg)
            return
        if attempt.prefill_id is None and msg.cached_tokens is not None:
            self._local_first_tokens(r, attempt, node, msg)
        self._handed_over(attempt)  # D decodes it, so the KV arrived
        if attempt.withheld_first is not None:
            first, attempt.withheld_first = attempt.withheld_first, None
            self._emit_first(r, first)
        self._apply_delta(r, msg)

    def on_plain_delta(self, node: NodeRecord, delta: PlainDelta) -> None:
        """:meth:`on_token_delta` of a plain delta; its common case (the request's live attempt on
        this node, handed over, its first token out) without building the model."""
        request_id, token_ids, text, finish_reason = delta
        r = self.attempts.get(request_id)
        attempt = r.current if r is not None else None
        if (attempt is None or attempt.attempt_id != request_id or attempt.decode_id != node.node_id
                or not attempt.first_token_seen or not attempt.handed_over or attempt.withheld_first is not None):
            self.on_token_delta(node, delta_model(delta))
            return
        assert r is not None
        r.add_plain(token_ids, text, finish_reason, time.monotonic())
        if finish_reason is not None:
            self._finish(r, finish_reason)

    def _local_first_tokens(
        self, r: RelayRequest, attempt: Attempt, node: NodeRecord, msg: protocol.TokenDelta
    ) -> None:
        """A node that prefilled the request itself sent its first tokens: its prefill is done."""
        assert msg.cached_tokens is not None
        node.pending_prefill.pop(attempt.attempt_id, None)
        node.reported_kv.add(attempt.attempt_id)
        r.cached_tokens = min(msg.cached_tokens, len(r.token_ids))
        attempt.node_ttft_s = msg.node_ttft_s
        self.metrics.prefix_hit_tokens.inc(msg.cached_tokens)

    def on_request_failed(self, node: NodeRecord, msg: protocol.RequestFailed) -> None:
        live = self._live(msg.request_id)
        if live is None or node.node_id not in (live[1].prefill_id, live[1].decode_id):
            return
        r, attempt = live
        logger.log(
            logging.INFO if msg.busy else logging.WARNING, "node %s failed attempt %s (retryable=%s, busy=%s): %s",
            node.node_id, msg.request_id, msg.retryable, msg.busy, msg.message,
        )
        why = f"{node.role} node {node.node_id} failed it: {msg.message}"
        if msg.busy and node.node_id == attempt.prefill_id and not attempt.first_token_seen:
            self._refused(r, attempt, msg.message)
        elif msg.peer_lost and node.node_id == attempt.prefill_id and attempt.decode_id is not None:
            self._decode_unreachable(r, attempt.decode_id, why)
        elif msg.peer_lost and node.node_id == attempt.decode_id and attempt.prefill_id is not None:
            self._rerun(r, attempt.prefill_id, why, keep_decode=True)  # D's lease ran out waiting for P
        elif not msg.retryable:
            self._fail(r, internal_error(), "error")  # the node's words stay in the log
        elif node.node_id == attempt.prefill_id and not attempt.first_token_seen:
            self._rerun(r, node.node_id, why, keep_decode=True)
        else:
            self._rerun(r, node.node_id, why, keep_decode=False)

    def _decode_unreachable(self, r: RelayRequest, decode_id: str, why: str) -> None:
        """P lost its connection to the attempt's D: the fault is D's. The re-run avoids D (not P),
        and every request keeps off D until it reports again: its connection to the master may
        not have closed here yet, and a re-run sent back to it would only spend another attempt."""
        decode = self.registry.get(decode_id)
        if decode is not None:
            self.held_off.mark(decode)
        self._rerun(r, decode_id, why, keep_decode=False)

    def _refused(self, r: RelayRequest, attempt: Attempt, message: str) -> None:
        """D refused the attempt's lease for want of room (its last report did not show it full yet):
        backpressure, not a fault. Neither node holds anything of the attempt; D is held off until
        its next report, and the request waits at its place in the queue without counting an attempt."""
        decode = self.registry.get(attempt.decode_id)
        if decode is not None:
            self.held_off.mark(decode)
        logger.info("request %s waits: decode node %s had no room (%s)", r.request_id, attempt.decode_id, message)
        self._end_attempt(r, abort=False)
        r.refused += 1
        r.preferred_decode = None
        self.metrics.decode_refusals.inc()
        self._enqueue(r, "decode_refused", in_place=True)
        self.pump()

    def on_node_removed(self, node: NodeRecord, reason: str) -> None:
        for attempt_id in sorted(node.inflight):
            live = self._live(attempt_id)
            if live is None:
                continue
            r, attempt = live
            why = f"{node.role} node {node.node_id} was lost ({reason})"
            if node.node_id == attempt.decode_id:
                logger.info("re-running %s: %s", r.request_id, why)
                self._rerun(r, node.node_id, why, keep_decode=False)
            elif node.node_id == attempt.prefill_id and not attempt.handed_over:
                logger.info("re-running %s: %s before the handover", r.request_id, why)
                self._rerun(r, node.node_id, why, keep_decode=not attempt.first_token_seen)

    def fail_unapplied(self, node: NodeRecord, attempt_id: str, cause: str) -> None:
        """A report of ``node`` on one of its live attempts could not be applied (malformed, or
        applying it raised): end that request now with the cause, aborting it on its nodes, rather
        than let its output go on with a piece missing. Other requests are untouched."""
        live = self._live(attempt_id)
        if live is None or node.node_id not in (live[1].prefill_id, live[1].decode_id):
            return
        r = live[0]
        logger.error("ending request %s: %s", r.request_id, cause)
        message = f"The request was stopped because {cause}."
        self._fail(r, APIError(502, message, "server_error", None, "node_report_failed"), "error")

    def on_status(self, node: NodeRecord, msg: protocol.NodeStatus) -> None:
        """Abort what a node still holds of attempts that ended here (it was cut off, or missed
        the abort): its KV and batch slots go back to live requests."""
        if msg.request_ids:
            self.ended.abort_stale(node, msg.request_ids, self.settings.stale_after_s)

    def pump(self) -> None:
        """Dispatch queued requests, oldest first, while capacity lasts."""
        if self._pumping:
            return
        self._pumping = True
        try:
            while (r := self.queue.head()) is not None:
                if r.state != RequestState.QUEUED:
                    self.queue.discard(r)
                    continue
                if not self._dispatch(r):  # a dispatched request leaves the queue
                    break
        finally:
            self._pumping = False

    # ---- dispatch and settlement ---------------------------------------------------------------

    def _decodes(self) -> list[NodeRecord]:
        return self.registry.active("decode") + self.registry.active("mixed")

    def _dispatch(self, r: RelayRequest) -> bool:
        prefills = self.registry.active("prefill")
        decodes = admissible_decodes(self._decodes(), r.kv_need, self.held_off)
        if not decodes:
            return False
        prefills = [p for p in prefills if p.node_id not in r.excluded] or prefills
        decodes = [d for d in decodes if d.node_id not in r.excluded] or decodes
        preferred = next((d for d in decodes if d.node_id == r.preferred_decode), None)
        route = r.next_route()
        plan = self.policy.plan(route, prefills, decodes, self.settings.local_prefill_max_tokens, preferred)
        self.metrics.route_decisions.labels(path=plan.path, reason=plan.reason).inc()
        attempt = Attempt.start(r.request_id, r.dispatches + 1, plan.prefill, plan.decode, plan, time.monotonic())
        self._start_attempt(r, attempt, plan.prefill, plan.decode, miss_tokens=route.prompt_tokens - plan.hit_tokens)
        return True

    def _start_attempt(
        self, r: RelayRequest, attempt: Attempt, prefill: NodeRecord | None, decode: NodeRecord, miss_tokens: int
    ) -> None:
        """Make ``attempt`` the request's live one and send its job to its first node."""
        r.move_to(RequestState.RUNNING)
        self.queue.discard(r)
        r.current = attempt
        r.preferred_decode = None
        self.attempts[attempt.attempt_id] = r
        token_ids, sampling = r.next_inputs()
        claim_nodes(attempt, prefill, decode, r.kv_need, len(token_ids), miss_tokens)
        deadline_s = max(r.deadline - time.monotonic(), 0.001)
        first = prefill if prefill is not None else decode
        if prefill is None:
            logger.debug("dispatch %s -> %s %s (prefilled there)", attempt.attempt_id, decode.role, decode.node_id)
        else:
            logger.debug("dispatch %s -> P %s, D %s", attempt.attempt_id, prefill.node_id, decode.node_id)
        if not first.send(job_for(attempt, decode, token_ids, sampling, deadline_s, r.client_request_id)):
            # Settled through the normal node-loss path, outside this state change.
            asyncio.get_running_loop().call_soon(self.registry.remove, first.node_id, "not reading its socket")
        r.wakeup.set()

    def _end_attempt(self, r: RelayRequest, abort: bool, abort_decode_only: bool = False) -> None:
        attempt = r.current
        if attempt is None or attempt.ended:
            return
        attempt.ended = True
        self.attempts.pop(attempt.attempt_id, None)
        attempt.cancel_handoff_timer()
        self.ended.add(attempt.attempt_id)
        release_nodes(attempt, self.registry.get, abort, abort_decode_only)
        self._schedule_pump()  # its row and KV may let a queued request go

    def _schedule_pump(self) -> None:
        """Pump the queue once the current state change is done (at most one pump queued)."""
        if not self.queue or self._pump_scheduled:
            return
        self._pump_scheduled = True

        def run() -> None:
            self._pump_scheduled = False
            self.pump()

        asyncio.get_running_loop().call_soon(run)

    def _apply_delta(self, r: RelayRequest, msg: protocol.TokenDelta) -> None:
        if msg.beams is not None:
            r.beams = list(msg.beams)
        r.add_output(TokenChunk(list(msg.token_ids), msg.text, msg.logprobs, msg.finish_reason, msg.prompt_logprobs),
                     time.monotonic())
        if msg.finish_reason is not None:
            self._finish(r, msg.finish_reason)

    def _finish(self, r: RelayRequest, finish_reason: str, abort_decode: bool = False) -> None:
        r.finish_reason = finish_reason
        r.finished_at = time.monotonic()
        self._end_attempt(r, abort=abort_decode, abort_decode_only=True)
        r.move_to(RequestState.FINISHED)
        r.outcome = "ok" if finish_reason != "error" else "error"
        r.deliver(DONE)

    def _fail(self, r: RelayRequest, error: APIError, outcome: Outcome) -> None:
        if r.terminal:
            return
        self.queue.discard(r)
        self._end_attempt(r, abort=True)
        r.move_to(RequestState.FAILED)
        r.outcome = outcome
        r.failure = error
        r.finish_reason = "error"
        r.finished_at = time.monotonic()
        r.deliver(error)

    def _rerun(self, r: RelayRequest, failed_node: str | None, why: str, keep_decode: bool) -> None:
        """:meth:`_reroute`; when running it again raises, the request ends now with the cause
        instead of waiting for its deadline (and the caller goes on with the other requests)."""
        try:
            self._reroute(r, failed_node, why, keep_decode)
        except Exception as exc:
            logger.exception("re-running %s after %s failed", r.request_id, why)
            message = f"The request could not be run again after {why} ({type(exc).__name__} while routing it)."
            self._fail(r, APIError(502, message, "server_error", None, "rerun_failed"), "error")

    def _reroute(self, r: RelayRequest, failed_node: str | None, why: str, keep_decode: bool) -> None:
        """Give up the current attempt (aborting it on both nodes) and run the request again:
        from its prompt when the client has seen nothing, else from where its stream stands."""
        if r.terminal:
            return
        preferred = r.decode_id if keep_decode else None
        self._end_attempt(r, abort=True)
        r.last_failure = why
        if failed_node is not None:
            r.excluded.add(failed_node)
        if r.attempt >= self.settings.max_attempts:
            message = f"The request failed on {r.attempt} attempts; the last one because {why}."
            if r.sent:
                self._fail(r, _failed_error(message, lost=True), "error")
            else:  # nothing shown yet: the client may simply try again
                self._fail(r, unavailable(message, self.settings.retry_after_s), "error")
            return
        if not r.sent:
            r.reset_output()
        elif len(r.output_ids) >= r.sampling.max_tokens:
            self._finish(r, "length")  # the lost node had nothing left to generate
            return
        else:
            logger.info("migrating the stream of %s after %d tokens", r.request_id, len(r.output_ids))
            self.metrics.migrations.inc()
        r.preferred_decode = preferred
        if not self._dispatch(r):
            self._enqueue(r, "rerun", front=True)

    def _enqueue(self, r: RelayRequest, reason: WaitReason, front: bool = False, in_place: bool = False) -> None:
        """Make ``r`` wait: at the back, at the front (a re-run), or ``in_place`` by its arrival."""
        r.move_to(RequestState.QUEUED)
        if in_place:
            self.queue.put_back(r, reason)
        else:
            self.queue.add(r, reason, front)

    def _waited(self, reason: WaitReason, seconds: float) -> None:
        self.metrics.queue_wait.labels(reason=reason).observe(seconds)

    def _queue_expired(self, r: RelayRequest) -> None:
        if r.state != RequestState.QUEUED:
            return
        if r.sent:  # a migrating stream: say why it had to move
            message = f"No node could take the stream over within {self.settings.queue_timeout_s:g} s after {r.last_failure}."
            self._fail(r, _failed_error(message, lost=True), "error")
            return
        message = "Timed out waiting for capacity; try again later."
        self._fail(r, unavailable(message, self.settings.retry_after_s), "unavailable")

    def _deadline_expired(self, r: RelayRequest) -> None:
        if not r.terminal:
            logger.warning("request %s passed its deadline of %.0f s", r.request_id, self.settings.request_timeout_s)
            self._fail(r, APIError(504, "The request timed out.", "timeout_error", None, "timeout"), "timeout")
        if not r.released:
            # A handler that never came back for it (a response that was never sent) must not leak it.
            loop = asyncio.get_running_loop()
            r.timers.append(loop.call_later(ORPHAN_GRACE_S, self.release, r))

    @staticmethod
    def _loop_time(monotonic_deadline: float) -> float:
        loop = asyncio.get_running_loop()
        return loop.time() + (monotonic_deadline - time.monotonic())

    def _record(self, r: RelayRequest) -> None:
        for hook in self.on_end:
            hook(r)
        record_metrics(self.metrics, r)


def record_metrics(m: MasterMetrics, r: RelayRequest) -> None:
    """An ended request in the master's metrics: only choice 0 counts the request and its prompt."""
    if r.choice_index == 0:
        m.requests_total.labels(status=r.outcome or "error").inc()
    if r.dispatched:
        if r.choice_index == 0:
            m.prompt_tokens.inc(len(r.token_ids))
        m.generation_tokens.inc(r.completion_tokens)
    if r.outcome == "ok" and r.first_token_at is not None and r.finished_at is not None:
        m.time_to_first_token.observe(r.first_token_at - r.arrival)
        m.e2e_latency.observe(r.finished_at - r.arrival)
        if r.completion_tokens > 1:
            m.time_per_output_token.observe((r.finished_at - r.first_token_at) / (r.completion_tokens - 1))


def _failed_error(message: str, lost: bool = True) -> APIError:
    """A request that no node could finish: 502 with the cause in the message."""
    return APIError(502, message, "server_error", None, "node_lost" if lost else "node_failed")
