"""Several relay requests answered as one: a prompt's choices (``n``, ``best_of``) and a list of
prompts, each with its choices. One relay request per prompt x choice; choice ``index`` is
``prompt * n + choice``.

A prompt's choice 0 is admitted first; the others once it streams from its decode node (its
prompt then sits in that D's prefix cache and in its P's), preferring that D, so their prompt is
neither recomputed beyond its last partial block nor moved again. The prompts of a list are
admitted at once. Nothing here knows HTTP: the routes turn :meth:`FanOut.batches` (streamed) or
the finished requests (not) into an answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from master import openai_schemas as oa
from master.errors import APIError, internal_error
from master.metrics import status_of_http
from master.relay import Relay
from master.relay_request import DONE, ChunkSink, ClientDisconnected, RelayRequest, StreamFailed, TokenChunk
from master.relay_state import RequestState
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: How often a prompt with several choices checks whether choice 0 has reached its decode node.
FOLLOW_POLL_S = 0.01

IsDisconnected = Callable[[], Awaitable[bool]]


def choice_sampling(sampling: SamplingParams, index: int, for_ranking: bool) -> SamplingParams:
    """Choice ``index`` samples with seed ``(seed + index) mod 2**63`` and so returns exactly what
    the same request with n=1 and that seed returns. Ranking by best_of needs each token's logprob."""
    assert sampling.seed is not None
    update: dict[str, object] = {"seed": (sampling.seed + index) % oa.SEED_MODULUS}
    if for_ranking and sampling.logprobs is None:
        update["logprobs"] = 0
    return sampling.model_copy(update=update)


def mean_logprob(r: RelayRequest) -> float:
    return sum(entry.logprob for entry in r.logprobs) / len(r.logprobs) if r.logprobs else float("-inf")


@dataclass
class PromptChoices:
    """One prompt's choices: relay requests ``<id>``, ``<id>-c1``, ``<id>-c2``...; the best
    ``returned`` of them (by mean token logprob when more were generated) make the answer."""

    relays: list[RelayRequest]
    returned: int
    #: Admits choices 1.. once choice 0 streams (None until choice 0 is admitted).
    follow: asyncio.Task | None = field(default=None, repr=False)

    @property
    def first(self) -> RelayRequest:
        return self.relays[0]

    def answer_choices(self) -> list[RelayRequest]:
        """The choices the answer lists, in order."""
        if len(self.relays) > self.returned:
            return sorted(self.relays, key=mean_logprob, reverse=True)[: self.returned]
        return self.relays


def create_choices(
    relay: Relay, request_id: str, token_ids: list[int], sampling: SamplingParams, stream: bool, arrival: float,
    count: int, returned: int,
) -> PromptChoices:
    """One relay request per choice of a prompt (not admitted yet); a beam search is one
    relay request whose answer holds its ``returned`` best beams."""
    if sampling.use_beam_search:
        return PromptChoices([relay.create(request_id, token_ids, sampling, stream, arrival)], returned)
    relays = []
    for index in range(count):
        choice = choice_sampling(sampling, index, for_ranking=count > returned)
        r = relay.create(request_id if index == 0 else f"{request_id}-c{index}", token_ids, choice, stream, arrival)
        r.choice_index = index
        relays.append(r)
    return PromptChoices(relays, returned)


@dataclass
class FanOut:
    """Every prompt's choices of one HTTP request; the first relay request holds the client's
    place under its key's limit and is released last."""

    relay: Relay
    prompts: list[PromptChoices]
    is_disconnected: IsDisconnected | None = None
    #: Every choice, by its index in the answer.
    relays: list[RelayRequest] = field(init=False)
    #: The client left (:meth:`hang_up`).
    hung_up: bool = field(default=False, init=False)
    _merged: asyncio.Queue | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.relays = [r for prompt in self.prompts for r in prompt.relays]

    @property
    def request_id(self) -> str:
        """The answer's id: the first prompt's."""
        return self.prompts[0].first.request_id

    def usage(self) -> dict[str, Any]:
        """Every prompt once, every generated choice's tokens (the best_of ones not returned too)."""
        return oa.usage(sum(len(p.first.token_ids) for p in self.prompts),
                        sum(r.completion_tokens for r in self.relays),
                        sum(p.first.cached_tokens for p in self.prompts))

    async def admit(self) -> None:
        """Admit every prompt's choice 0 (at once), then its other choices as it streams.
        Raises the first prompt's error (an APIError, or ClientDisconnected) when any could not
        be admitted; the caller then releases the fan-out."""
        if len(self.prompts) == 1:  # in this task: a task of its own would start a loop round later
            await self._admit_prompt(self.prompts[0])
            return
        results = await asyncio.gather(*(self._admit_prompt(p) for p in self.prompts), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _admit_prompt(self, prompt: PromptChoices) -> None:
        first = prompt.first
        try:
            await self.relay.admit(first, self.is_disconnected)
        except APIError as exc:
            self.relay.fail(first, exc, status_of_http(exc.status))  # no-op when the relay already failed it
            raise
        except ClientDisconnected:
            raise
        except Exception:
            logger.exception("admitting request %s failed", first.request_id)
            self.relay.fail(first, internal_error(), "error")
            raise internal_error() from None
        if len(prompt.relays) > 1:
            prompt.follow = asyncio.create_task(self._admit_followers(first, prompt.relays[1:]))

    async def _admit_followers(self, first: RelayRequest, followers: list[RelayRequest]) -> None:
        try:
            while not first.terminal and len(first.output_ids) < 2 and time.monotonic() < first.deadline:
                await asyncio.sleep(FOLLOW_POLL_S)
            if first.state == RequestState.FAILED:
                for r in followers:
                    self.relay.fail(r, first.failure or internal_error(), "error")
                return

            async def admit(r: RelayRequest) -> None:
                r.preferred_decode = first.decode_id
                try:
                    await self.relay.admit(r, self.is_disconnected)
                except (APIError, ClientDisconnected):
                    pass  # the relay holds the failure; the answer reports it

            await asyncio.gather(*(admit(r) for r in followers))
        except Exception:
            logger.exception("admitting the choices of %s failed", first.request_id)
            for r in followers:
                self.relay.fail(r, internal_error(), "error")

    async def wait(self) -> None:
        """Wait until every choice is done, in order; raises the first one's APIError, or
        ClientDisconnected."""
        for r in self.relays:
            await self.relay.wait(r, self.is_disconnected)

    def hang_up(self) -> None:
        """The client left: :meth:`batches` raises ClientDisconnected at its next wake-up, which
        this gives it at once."""
        self.hung_up = True
        for r in self.relays:
            r.wakeup.set()
        if self._merged is not None:
            self._merged.put_nowait((-1, None))

    async def batches(self, sink: ChunkSink | None = None) -> AsyncIterator[list[tuple[int, TokenChunk | StreamFailed]]]:
        """Every choice's chunks as its tokens arrive, with its index, all that arrived since the
        last wake-up in one list; a choice that fails gives its StreamFailed. Each relay stream
        ends by its request's deadline, so this does too; raises ClientDisconnected once
        :meth:`hang_up` was called. ``sink``: takes a single choice's chunks while this waits
        (those it takes are not yielded); settled after each wake-up, before anything is yielded."""
        relays = self.relays
        if len(relays) == 1:  # one choice: read straight from its request (Relay.batches, inlined)
            r = relays[0]
            while True:
                chunks, end = r.take()
                if end is None or chunks:
                    if self.hung_up:
                        raise ClientDisconnected()
                    if chunks:
                        yield [(0, c) for c in chunks]
                if end is DONE:
                    return
                if end is not None:
                    yield [(0, StreamFailed(end))]  # type: ignore[arg-type]
                    return
                r.sink = sink
                try:
                    await r.next_wakeup()
                finally:
                    r.sink = None
                if sink is not None:
                    await sink.settle()
        async for batch in self._merged_batches():
            yield batch

    async def _merged_batches(self) -> AsyncIterator[list[tuple[int, TokenChunk | StreamFailed]]]:
        queue: asyncio.Queue[tuple[int, TokenChunk | StreamFailed | None]] = asyncio.Queue()
        self._merged = queue

        async def pump(index: int, r: RelayRequest) -> None:
            try:
                async for chunks in self.relay.batches(r):
                    for c in chunks:
                        queue.put_nowait((index, c))
                queue.put_nowait((index, None))
            except StreamFailed as exc:
                queue.put_nowait((index, exc))

        pumps = [asyncio.create_task(pump(index, r)) for index, r in enumerate(self.relays)]
        try:
            open_choices = len(pumps)
            while open_choices:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                if self.hung_up:
                    raise ClientDisconnected()
                batch: list[tuple[int, TokenChunk | StreamFailed]] = []
                for index, item in items:
                    if item is None or isinstance(item, StreamFailed):
                        open_choices -= 1
                    if item is not None:
                        batch.append((index, item))
                yield batch
        finally:
            for task in pumps:
                task.cancel()

    def release(self) -> None:
        """Stop admitting and release every choice (the first last: it holds the client's slot)."""
        for prompt in self.prompts:
            if prompt.follow is not None:
                prompt.follow.cancel()
        for r in reversed(self.relays):
            self.relay.release(r)
