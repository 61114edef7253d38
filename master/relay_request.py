"""A client's request as the relay holds it: what to generate, where it stands (its state and its
latest attempt), what it produced so far, and how its HTTP handler is woken.

The handler only waits on ``wakeup`` and reads ``buffer``: output chunks in order, then
:data:`DONE` or the request's :class:`~master.errors.APIError`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from master.auth import ClientSlot
from master.decode_room import WaitReason
from master.errors import APIError
from master.relay_attempt import Attempt
from master.relay_state import Outcome, RequestState, check_move
from master.routing import Plan, RouteRequest
from pd_cluster import protocol
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenChunk:
    """New output of a request, in order."""

    token_ids: list[int]
    text: str
    logprobs: list[protocol.TokenLogprob] | None
    finish_reason: str | None
    #: With a request's first token, when it asked for them: its prompt's logprobs.
    prompt_logprobs: protocol.PromptLogprobs | None = None


class ChunkSink(Protocol):
    """Takes a stream's output as it arrives, outside its handler's task: no wake-up a token."""

    def offer(self, chunk: TokenChunk) -> bool:
        """Write ``chunk`` to the client now; False: not now (it goes to the handler instead)."""
        ...

    def offer_plain(self, token_ids: list[int], text: str) -> bool:
        """:meth:`offer` of a chunk of text alone (no logprobs, no finish), built only if needed."""
        ...

    @property
    def busy(self) -> bool:
        """A write it took is unfinished: the handler must :meth:`settle` it (it is woken)."""
        ...

    async def settle(self) -> None:
        """Finish the unfinished write, in the handler's task."""
        ...


class StreamFailed(Exception):
    """The request failed after tokens reached the client."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class ClientDisconnected(Exception):
    pass


#: The last item of a finished request's buffer.
DONE = object()

T = TypeVar("T")


class _OfLatestAttempt(Generic[T]):
    """A field of a request's latest attempt, read through the request (None before its first
    dispatch): what the request log and the routes ask of a request."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, r: RelayRequest | None, owner: type | None = None) -> T | None:
        if r is None or r.current is None:
            return None
        return getattr(r.current, self.name)

    def __set__(self, r: RelayRequest, value: object) -> None:
        raise AttributeError(f"{self.name} belongs to the request's attempt (RelayRequest.current)")


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
    client_request_id: str | None = None
    #: The client's API key by name (never the key itself), for the request log.
    key_name: str | None = None
    #: The client's place under its API key's concurrency limit, given back on release.
    client_slot: ClientSlot | None = None
    # where it stands
    outcome: Outcome | None = None
    failure: APIError | None = None
    released: bool = False
    #: The live attempt, or the last one once it ended (None before the first dispatch).
    current: Attempt | None = None
    #: Why the last attempt was given up (told to the client if the request fails for good).
    last_failure: str | None = None
    #: Nodes that lost or failed one of its attempts (avoided while others can take it).
    excluded: set[str] = field(default_factory=set)
    #: The D its next dispatch prefers (its prompt is cached there).
    preferred_decode: str | None = None
    #: Attempts a decode node refused for want of room: backpressure, not counted in ``attempt``.
    refused: int = 0
    #: Seconds it waited in the admission queue (all its waits), and why it waited last.
    queue_wait_s: float = 0.0
    wait_reason: WaitReason | None = None
    #: When its current wait in the queue began (monotonic; None while it does not wait).
    queued_at: float | None = None
    # output
    output_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[protocol.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: protocol.PromptLogprobs | None = None
    finish_reason: str | None = None
    #: A beam search's beams, best first (its output is the best one's).
    beams: list[protocol.BeamOutput] = field(default_factory=list)
    #: Of the client's prompt, found in the prefix cache by the attempt that produced the output.
    cached_tokens: int = 0
    #: Output reached the client (a stream): a re-run migrates instead of restarting.
    sent: bool = False
    first_token_at: float | None = None
    finished_at: float | None = None
    # delivery to the HTTP handler
    buffer: list[object] = field(default_factory=list)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    #: While a stream's handler waits with its buffer empty: takes output before it is buffered.
    sink: ChunkSink | None = None
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    _state: RequestState = field(default=RequestState.NEW, init=False, repr=False)

    # ---- its state ---------------------------------------------------------------------------

    @property
    def state(self) -> RequestState:
        return self._state

    @property
    def terminal(self) -> bool:
        return self._state.terminal

    def move_to(self, state: RequestState) -> None:
        """The one place a request changes state: raises IllegalMove on a move the machine forbids."""
        check_move(self.request_id, self._state, state)
        logger.debug("request %s: %s -> %s", self.request_id, self._state, state)
        self._state = state

    # ---- its latest attempt, as the request log reads it ---------------------------------------

    @property
    def attempt(self) -> int:
        """How many attempts count against ``max_attempts``: those dispatched, less those a decode
        node refused for want of room (the request only waited)."""
        return self.dispatches - self.refused

    @property
    def dispatches(self) -> int:
        """How many attempts were dispatched (each with its own id on the wire)."""
        return self.current.number if self.current is not None else 0

    @property
    def dispatched(self) -> bool:
        return self.current is not None

    prefill_id = _OfLatestAttempt[str]()
    decode_id = _OfLatestAttempt[str]()
    plan = _OfLatestAttempt[Plan]()
    first_token = _OfLatestAttempt[protocol.FirstToken]()
    node_ttft_s = _OfLatestAttempt[float]()
    dispatched_at = _OfLatestAttempt[float]()

    @property
    def handed_over(self) -> bool:
        return self.current is not None and self.current.handed_over

    # ---- what it asks for and what it produced -------------------------------------------------

    @property
    def kv_need(self) -> int:
        """KV at its peak: a beam search's beams share the prompt and hold their own output."""
        width = self.sampling.beam_width if self.sampling.use_beam_search else 1
        return len(self.token_ids) + width * self.sampling.max_tokens

    @property
    def completion_tokens(self) -> int:
        """Its output's tokens; a beam search's, those of the beams it returns (as vLLM counts)."""
        if self.beams:
            return sum(len(b.token_ids) for b in self.beams)
        return len(self.output_ids)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def next_route(self) -> RouteRequest:
        """What routing prices for the next attempt: a migrating stream's prompt holds its output."""
        return self.route if not self.output_ids else RouteRequest(self.token_ids + self.output_ids, self.kv_need)

    def next_inputs(self) -> tuple[list[int], SamplingParams]:
        """The next attempt's prompt and sampling: a migrated stream goes on from what the client
        has (prompt + output so far), and the output it carries counts as output, so the seed's
        stream goes on where it was."""
        if not self.output_ids:
            return self.token_ids, self.sampling
        done = len(self.output_ids)
        # The prompt's logprobs came with the first attempt's first token: a moved stream's prompt
        # holds its own output, which is not scored.
        sampling = self.sampling.model_copy(update={"max_tokens": self.sampling.max_tokens - done,
                                                    "output_offset": self.sampling.output_offset + done,
                                                    "prompt_logprobs": None})
        return self.token_ids + self.output_ids, sampling

    def add_output(self, chunk: TokenChunk, now: float) -> None:
        """Append new output; a stream's handler gets it as it comes."""
        if self.first_token_at is None:
            self.first_token_at = now
        self.output_ids.extend(chunk.token_ids)
        self.text_parts.append(chunk.text)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if self.stream:
            self.sent = True
            sink = self.sink
            if sink is not None and not self.buffer and sink.offer(chunk):
                if sink.busy:
                    self.wakeup.set()
                return
            self.buffer.append(chunk)
        self.wakeup.set()

    def add_plain(self, token_ids: list[int], text: str, finish_reason: str | None, now: float) -> None:
        """:meth:`add_output` of a chunk with no logprobs: what a decode node sends a step, most of
        the time. The sink writes its text without a chunk built for it (one a token, otherwise)."""
        if self.first_token_at is None:
            self.first_token_at = now
        self.output_ids.extend(token_ids)
        self.text_parts.append(text)
        if self.stream:
            self.sent = True
            sink = self.sink
            if sink is not None and not self.buffer and finish_reason is None and sink.offer_plain(token_ids, text):
                if sink.busy:
                    self.wakeup.set()
                return
            self.buffer.append(TokenChunk(token_ids, text, None, finish_reason))
        self.wakeup.set()

    def reset_output(self) -> None:
        """Forget the output the client never saw (a re-run restarts from the prompt)."""
        self.output_ids.clear()
        self.beams = []
        self.text_parts.clear()
        self.logprobs.clear()
        self.prompt_logprobs = None
        self.cached_tokens = 0
        self.first_token_at = None
        self.buffer = [item for item in self.buffer if not isinstance(item, TokenChunk)]

    def take(self) -> tuple[list[TokenChunk], object | None]:
        """The output chunks delivered since the last take, in order, and how the stream ended
        (:data:`DONE` or the request's APIError; None while it goes on)."""
        items, self.buffer = self.buffer, []
        for i, item in enumerate(items):  # the end, when it came, is the last item
            if not isinstance(item, TokenChunk):
                return items[:i], item  # type: ignore[return-value]
        return items, None  # type: ignore[return-value]

    async def next_wakeup(self) -> None:
        """Wait for more output or the end (at once when some is delivered already)."""
        if not self.buffer:
            self.wakeup.clear()
            await self.wakeup.wait()

    def deliver(self, item: object) -> None:
        """Hand the handler its last item (:data:`DONE` or the error) and wake it."""
        self.buffer.append(item)
        self.wakeup.set()
