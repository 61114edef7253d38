"""A request's life in the master: admission, dispatch to a (P, D) pair, token relay, settlement.

State changes happen in plain (non-async) methods, so each one is atomic on the event loop:
node frames, node departures, timers and the HTTP handler never interleave inside one.
The HTTP handler only waits on a request's ``wakeup`` event and reads its buffer.

Each dispatch of a request is an *attempt* with its own id on the wire (the request id, then
``<id>-r1``, ``<id>-r2``...), so frames and aborts of an abandoned attempt can never touch the
next one. An attempt belongs to its P until the handover (P's KVTransferred or D's first tokens),
and to its D until it ends; the master knows both all along. When a node is lost (removed,
evicted, or it reports the request failed, e.g. D's lease ran out) or the handover misses its
deadline, the attempt is re-run on another pair:

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
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from master.auth import ClientSlot
from master.config import MasterSettings
from master.errors import APIError, internal_error, unavailable
from master.metrics import MasterMetrics
from master.registry import NodeRecord, Registry
from master.routing import Plan, RouteRequest, RoutingPolicy, admissible_decodes
from pd_cluster.aio import wait_for
from pd_cluster import protocol
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RequestState = Literal["new", "queued", "running", "finished", "failed"]
Outcome = Literal["ok", "error", "aborted", "timeout", "unavailable", "rate_limited"]

#: Frames a D may send before P's FirstToken arrives (they are held back to keep order).
MAX_EARLY_DELTAS = 4096
#: How often a waiting non-streaming handler checks whether its client left.
DISCONNECT_POLL_S = 0.5
#: After its deadline, how long a request waits for its handler before the relay releases it.
ORPHAN_GRACE_S = 30.0
#: Ended attempt ids remembered, so a node that still reports one is told to abort it.
ENDED_MEMORY = 65536
#: Least time between two aborts of the same stale attempt to one node.
STALE_ABORT_EVERY_S = 2.0


@dataclass
class TokenChunk:
    """New output of a request, in order."""

    token_ids: list[int]
    text: str
    logprobs: list[protocol.TokenLogprob] | None
    finish_reason: str | None


class StreamFailed(Exception):
    """The request failed after tokens reached the client."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class ClientDisconnected(Exception):
    pass


_DONE = object()


@dataclass(eq=False)
class RelayRequest:
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    stream: bool
    arrival: float
    deadline: float
    route: RouteRequest
    #: Which choice of its HTTP request this is (n > 1): only choice 0 counts the request and its prompt.
    choice_index: int = 0
    state: RequestState = "new"
    outcome: Outcome | None = None
    failure: APIError | None = None
    released: bool = False
    # current attempt
    attempt: int = 0
    attempt_id: str | None = None
    prefill_id: str | None = None
    decode_id: str | None = None
    first_token_seen: bool = False
    #: The attempt's KV reached its D (P's KVTransferred or D's first tokens): P is out of it.
    handed_over: bool = False
    handoff_timer: asyncio.TimerHandle | None = None
    #: Why the last attempt was given up (told to the client if the request fails for good).
    last_failure: str | None = None
    #: P's first token, withheld until D's first tokens when ``first_token_via`` is "decode".
    withheld_first: protocol.FirstToken | None = None
    early_deltas: list[protocol.TokenDelta] = field(default_factory=list)
    excluded: set[str] = field(default_factory=set)
    preferred_decode: str | None = None
    #: How the current (or last) attempt was routed: its path, reason and D's prefix hit.
    plan: Plan | None = None
    # output
    output_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[protocol.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    #: The current attempt's FirstToken (D's prefix hit, bytes moved), for the request log.
    first_token: protocol.FirstToken | None = None
    client_request_id: str | None = None
    sent: bool = False
    dispatched: bool = False
    first_token_at: float | None = None
    finished_at: float | None = None
    #: When the current attempt was sent to its node(s) (monotonic).
    dispatched_at: float | None = None
    #: The node's own share of the TTFT: from taking the job to sending the first token.
    node_ttft_s: float | None = None
    # delivery to the HTTP handler
    buffer: list[object] = field(default_factory=list)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    queue_timer: asyncio.TimerHandle | None = None
    #: The client's place under its API key's concurrency limit, given back on release.
    client_slot: ClientSlot | None = None

    @property
    def kv_need(self) -> int:
        return len(self.token_ids) + self.sampling.max_tokens

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def terminal(self) -> bool:
        return self.state in ("finished", "failed")

    def reset_output(self) -> None:
        self.output_ids.clear()
        self.text_parts.clear()
        self.logprobs.clear()
        self.cached_tokens = 0
        self.first_token_at = None
        self.buffer = [item for item in self.buffer if not isinstance(item, TokenChunk)]


class Relay:
    def __init__(
        self, registry: Registry, policy: RoutingPolicy, metrics: MasterMetrics, settings: MasterSettings
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.settings = settings
        self.requests: dict[str, RelayRequest] = {}
        self.attempts: dict[str, RelayRequest] = {}
        self.queue: deque[RelayRequest] = deque()
        #: Attempt id -> when it ended here (oldest first), to abort it on nodes that still hold it.
        self.ended: OrderedDict[str, float] = OrderedDict()
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
        self._enqueue(r)
        while r.state == "queued":
            r.wakeup.clear()
            try:
                await wait_for(r.wakeup.wait(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass
            if r.state == "queued" and is_disconnected is not None and await is_disconnected():
                raise ClientDisconnected()
        if r.state == "failed":
            assert r.failure is not None
            raise r.failure

    async def events(self, r: RelayRequest) -> AsyncIterator[TokenChunk]:
        """Output chunks of a streaming request until it finishes; raises StreamFailed.

        The wait for the next chunk has no timeout of its own: the request's deadline timer
        (set in :meth:`create`, cancelled only by :meth:`release`) fails it and wakes this loop,
        so a token costs no timer here."""
        while True:
            items, r.buffer = r.buffer, []
            for item in items:
                if item is _DONE:
                    return
                if isinstance(item, APIError):
                    raise StreamFailed(item)
                yield item  # type: ignore[misc]
            if items:
                continue
            r.wakeup.clear()
            await r.wakeup.wait()

    async def wait(self, r: RelayRequest, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Wait until a non-streaming request is done; raises APIError or ClientDisconnected."""
        while not r.terminal:
            r.wakeup.clear()
            try:
                await wait_for(r.wakeup.wait(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if time.monotonic() > r.deadline + 1.0:
                    self._deadline_expired(r)
            if not r.terminal and is_disconnected is not None and await is_disconnected():
                raise ClientDisconnected()
        if r.state == "failed":
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
        self._cancel_queue_timer(r)
        if not r.terminal:
            self._remove_from_queue(r)
            self._end_attempt(r, abort=True)
            r.state = "failed"
            r.outcome = "aborted"
            logger.info("request %s aborted by its client", r.request_id)
        self.requests.pop(r.request_id, None)
        self._record(r)

    # ---- node events -------------------------------------------------------------------

    def on_first_token(self, node: NodeRecord, msg: protocol.FirstToken) -> None:
        r = self.attempts.get(msg.request_id)
        if r is None or r.prefill_id != node.node_id or r.first_token_seen:
            logger.debug("first token for unknown attempt %s from %s", msg.request_id, node.node_id)
            return
        r.first_token_seen = True
        node.pending_prefill.pop(msg.request_id, None)  # P still owns the attempt until the handover
        decode = self.registry.get(r.decode_id)
        if decode is not None:
            decode.reported_kv.add(msg.request_id)
            self.metrics.prefix_hit_tokens.inc(msg.hit_blocks_decode * decode.info.kv_spec.block_size)
        self.metrics.kv_transfer_bytes.inc(msg.transfer_bytes)
        # Of the client's prompt (a migrated attempt's prompt also holds the output so far).
        r.cached_tokens = min(msg.cached_tokens_prefill, len(r.token_ids))
        r.first_token = msg
        r.node_ttft_s = msg.node_ttft_s
        if self.settings.first_token_via == "decode" and msg.finish_reason is None and not r.early_deltas:
            r.withheld_first = msg
        else:
            self._emit_first(r, msg)
        if msg.finish_reason is not None:
            self._finish(r, msg.finish_reason, abort_decode=True)
            return
        if r.early_deltas:
            self._handed_over(r)  # D already decodes it
        elif not r.handed_over:
            loop = asyncio.get_running_loop()
            r.handoff_timer = loop.call_later(self.settings.handoff_timeout_s, self._handoff_expired, r, r.attempt_id)
        early, r.early_deltas = r.early_deltas, []
        for delta in early:
            if r.terminal:
                break
            self._apply_delta(r, delta)

    def _emit_first(self, r: RelayRequest, msg: protocol.FirstToken) -> None:
        logprobs = [msg.logprob] if msg.logprob is not None else None
        self._emit(r, [msg.token_id], msg.text, logprobs, msg.finish_reason)

    def on_kv_transferred(self, node: NodeRecord, msg: protocol.KVTransferred) -> None:
        """P finished moving a request's KV (the bytes were counted with its FirstToken)."""
        self.metrics.kv_transfer_seconds.observe(msg.seconds)
        self.policy.link.observe(msg.bytes, msg.seconds)
        r = self.attempts.get(msg.request_id)
        if r is not None and r.prefill_id == node.node_id:
            self._handed_over(r)

    def _handed_over(self, r: RelayRequest) -> None:
        """The attempt's KV is on its D: P's loss no longer touches it."""
        if r.handed_over:
            return
        r.handed_over = True
        self._cancel_handoff_timer(r)
        prefill = self.registry.get(r.prefill_id)
        if prefill is not None and r.attempt_id is not None:
            prefill.inflight.discard(r.attempt_id)

    def _handoff_expired(self, r: RelayRequest, attempt_id: str | None) -> None:
        r.handoff_timer = None
        if r.terminal or r.attempt_id != attempt_id or r.handed_over:
            return
        reason = f"prefill node {r.prefill_id} did not hand the request over within {self.settings.handoff_timeout_s:g} s"
        logger.warning("re-running %s: %s", r.request_id, reason)
        self._reroute(r, r.prefill_id, reason, keep_decode=False)

    def on_token_delta(self, node: NodeRecord, msg: protocol.TokenDelta) -> None:
        r = self.attempts.get(msg.request_id)
        if r is None or r.decode_id != node.node_id:
            logger.debug("tokens for unknown attempt %s from %s", msg.request_id, node.node_id)
            return
        if not r.first_token_seen:
            if len(r.early_deltas) >= MAX_EARLY_DELTAS:
                self._fail(r, internal_error(), "error")
                return
            r.early_deltas.append(msg)
            return
        if r.prefill_id is None and msg.cached_tokens is not None:
            self._local_first_tokens(r, node, msg)
        self._handed_over(r)  # D decodes it, so the KV arrived
        if r.withheld_first is not None:
            first, r.withheld_first = r.withheld_first, None
            self._emit_first(r, first)
        self._apply_delta(r, msg)

    def _local_first_tokens(self, r: RelayRequest, node: NodeRecord, msg: protocol.TokenDelta) -> None:
        """A node that prefilled the request itself sent its first tokens: its prefill is done."""
        assert r.attempt_id is not None and msg.cached_tokens is not None
        node.pending_prefill.pop(r.attempt_id, None)
        node.reported_kv.add(r.attempt_id)
        r.cached_tokens = min(msg.cached_tokens, len(r.token_ids))
        r.node_ttft_s = msg.node_ttft_s
        self.metrics.prefix_hit_tokens.inc(msg.cached_tokens)

    def on_request_failed(self, node: NodeRecord, msg: protocol.RequestFailed) -> None:
        r = self.attempts.get(msg.request_id)
        if r is None or node.node_id not in (r.prefill_id, r.decode_id):
            return
        logger.warning(
            "node %s failed attempt %s (retryable=%s): %s", node.node_id, msg.request_id, msg.retryable, msg.message
        )
        why = f"{node.role} node {node.node_id} failed it: {msg.message}"
        if not msg.retryable:
            self._fail(r, internal_error(), "error")  # the node's words stay in the log
        elif node.node_id == r.prefill_id and not r.first_token_seen:
            self._reroute(r, node.node_id, why, keep_decode=True)
        else:
            self._reroute(r, node.node_id, why, keep_decode=False)

    def on_node_removed(self, node: NodeRecord, reason: str) -> None:
        for attempt_id in sorted(node.inflight):
            r = self.attempts.get(attempt_id)
            if r is None or r.attempt_id != attempt_id:
                continue
            why = f"{node.role} node {node.node_id} was lost ({reason})"
            if node.node_id == r.decode_id:
                logger.info("re-running %s: %s", r.request_id, why)
                self._reroute(r, node.node_id, why, keep_decode=False)
            elif node.node_id == r.prefill_id and not r.handed_over:
                logger.info("re-running %s: %s before the handover", r.request_id, why)
                self._reroute(r, node.node_id, why, keep_decode=not r.first_token_seen)

    def on_status(self, node: NodeRecord, msg: protocol.NodeStatus) -> None:
        """Abort what a node still holds of attempts that ended here (it was cut off, or missed
        the abort): its KV and batch slots go back to live requests."""
        if not msg.request_ids:
            return
        now = time.monotonic()
        for attempt_id in msg.request_ids:
            ended_at = self.ended.get(attempt_id)
            if attempt_id in node.inflight or ended_at is None or now - ended_at < self.settings.stale_after_s:
                continue
            last = node.stale_aborts.get(attempt_id)
            if last is not None and now - last < STALE_ABORT_EVERY_S:
                continue
            logger.info("node %s still holds ended attempt %s: aborting it", node.node_id, attempt_id)
            node.stale_aborts[attempt_id] = now
            node.send(protocol.Abort(request_id=attempt_id))
        if len(node.stale_aborts) > 4 * len(msg.request_ids) + 64:
            held = set(msg.request_ids)
            node.stale_aborts = {k: v for k, v in node.stale_aborts.items() if k in held}

    def pump(self) -> None:
        """Dispatch queued requests, oldest first, while capacity lasts."""
        if self._pumping:
            return
        self._pumping = True
        try:
            while self.queue:
                r = self.queue[0]
                if r.state != "queued":
                    self.queue.popleft()
                    continue
                if not self._dispatch(r):
                    break
                self.queue.popleft()
        finally:
            self._pumping = False

    # ---- internals -----------------------------------------------------------------------

    def _dispatch(self, r: RelayRequest) -> bool:
        prefills = self.registry.active("prefill")
        decodes = admissible_decodes(self.registry.active("decode") + self.registry.active("mixed"), r.kv_need)
        if not decodes:
            return False
        prefills = [p for p in prefills if p.node_id not in r.excluded] or prefills
        decodes = [d for d in decodes if d.node_id not in r.excluded] or decodes
        preferred = next((d for d in decodes if d.node_id == r.preferred_decode), None)
        route = r.route if not r.output_ids else RouteRequest(r.token_ids + r.output_ids, r.kv_need)
        plan = self.policy.plan(route, prefills, decodes, self.settings.local_prefill_max_tokens, preferred)
        self.metrics.route_decisions.labels(path=plan.path, reason=plan.reason).inc()
        r.plan = plan
        self._start_attempt(r, plan.prefill, plan.decode, miss_tokens=route.prompt_tokens - plan.hit_tokens)
        return True

    def _start_attempt(
        self, r: RelayRequest, prefill: NodeRecord | None, decode: NodeRecord, miss_tokens: int = 0
    ) -> None:
        """Send the attempt out: a ``PrefillJob`` to P naming D, or with no P a ``GenerateJob`` to
        the node that prefills and decodes it (its tokens, the first included, come as deltas)."""
        self._cancel_queue_timer(r)
        r.attempt += 1
        attempt_id = r.request_id if r.attempt == 1 else f"{r.request_id}-r{r.attempt - 1}"
        r.attempt_id, r.decode_id = attempt_id, decode.node_id
        r.prefill_id = prefill.node_id if prefill is not None else None
        r.first_token = None
        # Prefilled where it decodes: no handover to wait for, and D's deltas start the output.
        r.first_token_seen = r.handed_over = prefill is None
        r.withheld_first = None
        r.early_deltas = []
        r.preferred_decode = None
        r.state = "running"
        r.dispatched = True
        r.dispatched_at = time.monotonic()
        r.node_ttft_s = None
        self.attempts[attempt_id] = r
        # A migrated stream goes on from what the client has: prompt + output so far, the rest to generate.
        token_ids = r.token_ids + r.output_ids if r.output_ids else r.token_ids
        sampling = r.sampling
        if r.output_ids:
            # The output carried in the prompt counts as output: the seed's stream goes on where it was.
            sampling = sampling.model_copy(update={"max_tokens": r.sampling.max_tokens - len(r.output_ids),
                                                   "output_offset": r.sampling.output_offset + len(r.output_ids)})
        decode.pending_kv[attempt_id] = r.kv_need
        decode.inflight.add(attempt_id)
        deadline_s = max(r.deadline - time.monotonic(), 0.001)
        if prefill is None:
            decode.pending_prefill[attempt_id] = miss_tokens
            logger.debug("dispatch %s -> %s %s (prefilled there)", attempt_id, decode.role, decode.node_id)
            local = protocol.GenerateJob(request_id=attempt_id, token_ids=token_ids, sampling=sampling,
                                         deadline_s=deadline_s)
            if not decode.send(local):
                asyncio.get_running_loop().call_soon(self.registry.remove, decode.node_id, "not reading its socket")
            r.wakeup.set()
            return
        prefill.pending_prefill[attempt_id] = len(token_ids)
        prefill.inflight.add(attempt_id)
        job = protocol.PrefillJob(
            request_id=attempt_id,
            token_ids=token_ids,
            sampling=sampling,
            decode_node_id=decode.node_id,
            decode_address=decode.info.data_address or "",
            deadline_s=deadline_s,
        )
        logger.debug("dispatch %s -> P %s, D %s", attempt_id, prefill.node_id, decode.node_id)
        if not prefill.send(job):
            # Settled through the normal node-loss path, outside this state change.
            asyncio.get_running_loop().call_soon(self.registry.remove, prefill.node_id, "not reading its socket")
        r.wakeup.set()

    def _end_attempt(self, r: RelayRequest, abort: bool, abort_decode_only: bool = False) -> None:
        attempt_id = r.attempt_id
        if attempt_id is None:
            return
        self.attempts.pop(attempt_id, None)
        r.attempt_id = None
        self._cancel_handoff_timer(r)
        self.ended[attempt_id] = time.monotonic()
        while len(self.ended) > ENDED_MEMORY:
            self.ended.popitem(last=False)
        for node_id in (r.prefill_id, r.decode_id):
            node = self.registry.get(node_id)
            if node is None:
                continue
            node.pending_prefill.pop(attempt_id, None)
            if node_id == r.decode_id:
                node.ended_attempts.add(attempt_id)  # its last status may still count it
            node.pending_kv.pop(attempt_id, None)
            node.reported_kv.discard(attempt_id)
            node.inflight.discard(attempt_id)
            if abort and (not abort_decode_only or node_id == r.decode_id):
                node.send(protocol.Abort(request_id=attempt_id))

    def _apply_delta(self, r: RelayRequest, msg: protocol.TokenDelta) -> None:
        self._emit(r, list(msg.token_ids), msg.text, msg.logprobs, msg.finish_reason)
        if msg.finish_reason is not None:
            self._finish(r, msg.finish_reason)

    def _emit(
        self,
        r: RelayRequest,
        token_ids: list[int],
        text: str,
        logprobs: list[protocol.TokenLogprob] | None,
        finish_reason: str | None,
    ) -> None:
        if r.first_token_at is None:
            r.first_token_at = time.monotonic()
        r.output_ids.extend(token_ids)
        r.text_parts.append(text)
        if logprobs:
            r.logprobs.extend(logprobs)
        if r.stream:
            r.buffer.append(TokenChunk(token_ids, text, logprobs, finish_reason))
            r.sent = True
        r.wakeup.set()

    def _finish(self, r: RelayRequest, finish_reason: str, abort_decode: bool = False) -> None:
        r.finish_reason = finish_reason
        r.finished_at = time.monotonic()
        self._end_attempt(r, abort=abort_decode, abort_decode_only=True)
        r.state = "finished"
        r.outcome = "ok" if finish_reason != "error" else "error"
        r.buffer.append(_DONE)
        r.wakeup.set()

    def _fail(self, r: RelayRequest, error: APIError, outcome: Outcome) -> None:
        if r.terminal:
            return
        self._remove_from_queue(r)
        self._cancel_queue_timer(r)
        self._end_attempt(r, abort=True)
        r.state = "failed"
        r.outcome = outcome
        r.failure = error
        r.finish_reason = "error"
        r.finished_at = time.monotonic()
        r.buffer.append(error)
        r.wakeup.set()

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
            self._enqueue(r, front=True)

    def _enqueue(self, r: RelayRequest, front: bool = False) -> None:
        r.state = "queued"
        if front:
            self.queue.appendleft(r)
        else:
            self.queue.append(r)
        self._cancel_queue_timer(r)
        r.queue_timer = asyncio.get_running_loop().call_later(self.settings.queue_timeout_s, self._queue_expired, r)

    def _queue_expired(self, r: RelayRequest) -> None:
        r.queue_timer = None
        if r.state != "queued":
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

    def _remove_from_queue(self, r: RelayRequest) -> None:
        if r.state == "queued":
            try:
                self.queue.remove(r)
            except ValueError:
                pass

    @staticmethod
    def _cancel_handoff_timer(r: RelayRequest) -> None:
        if r.handoff_timer is not None:
            r.handoff_timer.cancel()
            r.handoff_timer = None

    def _cancel_queue_timer(self, r: RelayRequest) -> None:
        if r.queue_timer is not None:
            r.queue_timer.cancel()
            r.queue_timer = None

    @staticmethod
    def _loop_time(monotonic_deadline: float) -> float:
        loop = asyncio.get_running_loop()
        return loop.time() + (monotonic_deadline - time.monotonic())

    def _record(self, r: RelayRequest) -> None:
        for hook in self.on_end:
            hook(r)
        m = self.metrics
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
