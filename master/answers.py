"""The answer to a generation request: its relay requests (one per prompt x choice, see
:mod:`master.fanout`) streamed as their tokens arrive, each chunk naming its choice's ``index``,
or one body listing the choices in index order (each prompt's best ``n`` by mean token logprob
when best_of > n; a beam search's request gives one choice a beam, best first). Usage counts each prompt once and every generated choice's tokens. With
``echo`` each prompt's text goes before its choices' text (streamed: before each choice's first
piece).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from master import openai_schemas as oa
from master import prompt_logprobs, tool_calls
from master.answer_shapes import (
    CLIENT_CLOSED, PIECE, SHAPES, SSE_HEADERS, Shape, StreamHead, answer, choice, json_string, sse, text_template,
)
from master.context import MasterContext
from master.direct_send import DirectSend
from master.errors import APIError
from master.event_stream import EventStreamResponse
from master.fanout import FanOut, PromptChoices, create_choices
from master.prepare import Kind, Prepared
from master.rejections import KEY_NAME_STATE, RELAYED_STATE
from master.prompt_logprobs import Echo
from master.relay_request import ClientDisconnected, RelayRequest, StreamFailed, TokenChunk


def _fan_out(request: Request, ctx: MasterContext, kind: Kind, prepared: list[Prepared], arrival: float) -> FanOut:
    """One relay request per prompt x choice, the client's slot on the first."""
    req = prepared[0].req
    client_request_id: str | None = getattr(request.state, "client_request_id", None)
    key_name: str | None = getattr(request.state, KEY_NAME_STATE, None)
    prompts: list[PromptChoices] = []
    for p in prepared:
        request_id = ctx.relay.new_request_id(SHAPES[kind].id_prefix)
        choices = create_choices(ctx.relay, request_id, p.token_ids, p.sampling, req.stream, arrival,
                                 req.choice_count, req.choices_returned)
        for r in choices.relays:
            r.client_request_id = client_request_id
            r.key_name = key_name
            p.route(r)
        prompts.append(choices)
    fan = FanOut(ctx.relay, prompts, request.is_disconnected)
    setattr(request.state, RELAYED_STATE, True)  # each relay request logs its own line when it ends
    slot = request.state.client_slot
    prompts[0].first.client_slot = slot
    slot.handed = True
    # Answered in the X-Request-Id header (RequestIdMiddleware): the client's own id, or the master's.
    request.state.request_id = client_request_id or fan.request_id
    return fan


async def admitted(request: Request, ctx: MasterContext, kind: Kind, prepared: list[Prepared],
                   arrival: float) -> FanOut | Response:
    """The relay requests of ``prepared``, admitted (the caller then owns the fan-out and releases
    it), or the answer when they could not be (the client left, or an error)."""
    fan = _fan_out(request, ctx, kind, prepared, arrival)
    try:
        await fan.admit()
    except ClientDisconnected:
        fan.release()
        return Response(status_code=CLIENT_CLOSED)
    except APIError as exc:
        fan.release()
        return exc.response()
    except BaseException:
        fan.release()
        raise
    return fan


async def waited(fan: FanOut) -> Response | None:
    """Wait for every choice, then release the fan-out; the answer to a client that left meanwhile
    (None: every choice ended; an error raises its APIError)."""
    try:
        await fan.wait()
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        fan.release()
    return None


async def serve(
    request: Request, ctx: MasterContext, kind: Kind, prepared: list[Prepared], arrival: float,
    echo: Echo | None = None,
) -> Response:
    """Answer ``prepared`` (one per prompt, alike but for the prompt); ``echo``: each prompt's
    text (and logprobs), put before its choices'."""
    fan = await admitted(request, ctx, kind, prepared, arrival)
    if isinstance(fan, Response):
        return fan
    req, shape = prepared[0].req, SHAPES[kind]
    created = oa.now()
    model = ctx.model_name or req.model
    if req.stream:
        head = StreamHead(fan.request_id, shape, created, model, req.include_usage)
        return streamed(fan, _StreamWriter(ctx, fan, req, head, echo))
    left = await waited(fan)
    if left is not None:
        return left
    doc = {"id": fan.request_id, "object": shape.object, "created": created, "model": model,
           "choices": _choices(ctx, fan, req, shape, echo), "usage": _usage(fan, echo)}
    if kind == "chat" and req.prompt_logprobs is not None:  # vLLM puts a chat prompt's at the top
        first = fan.prompts[0].first
        doc["prompt_logprobs"] = _vllm_prompt_logprobs(ctx, req, first)
    return JSONResponse(doc)


def _usage(fan: FanOut, echo: Echo | None) -> dict[str, Any]:
    usage = fan.usage()
    if echo is not None and echo.prompt_only:  # the token drawn was dropped
        usage = {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
    return usage


def token_namer(ctx: MasterContext, req: Any) -> Callable[[int], str]:
    """How the logprobs name a token: its text, or ``token_id:N`` when the request asks for ids."""
    if getattr(req, "return_tokens_as_token_ids", False):
        return lambda token_id: f"token_id:{token_id}"
    return ctx.tokenizer.token_text


def _vllm_prompt_logprobs(ctx: MasterContext, req: Any, r: RelayRequest) -> list[dict[str, Any] | None] | None:
    if r.prompt_logprobs is None:
        return None
    return prompt_logprobs.vllm(r.token_ids, r.prompt_logprobs, token_namer(ctx, req))


def _choices(ctx: MasterContext, fan: FanOut, req: Any, shape: Shape, echo: Echo | None) -> list[dict[str, Any]]:
    choices = []
    token_text = token_namer(ctx, req)
    for p_index, prompt in enumerate(fan.prompts):
        before = echo.texts[p_index] if echo else ""
        for c_index, (r, text, finish_reason, entries) in enumerate(_outputs(prompt)):
            text = before + text
            if echo is not None and echo.prompt_only:
                text, finish_reason, entries = before, "length", []
            logprobs = shape.logprobs(entries, token_text, len(before)) if shape.wants_logprobs(req) else None
            if echo is not None and echo.logprobs and r.prompt_logprobs is not None:
                top = req.logprobs or 0
                logprobs = prompt_logprobs.joined(prompt_logprobs.legacy(r.token_ids, r.prompt_logprobs, token_text, top),
                                                  logprobs)
            body, finish_reason = answer(shape, req, text, finish_reason)
            item = {**choice(body, finish_reason, logprobs), "index": p_index * prompt.returned + c_index}
            if shape.object == "text_completion" and req.prompt_logprobs is not None:
                item["prompt_logprobs"] = _vllm_prompt_logprobs(ctx, req, r)
            choices.append(item)
    return choices


def _outputs(prompt: PromptChoices) -> list[tuple[RelayRequest, str, str | None, list[Any]]]:
    """Each answer choice of a prompt: its request, text, finish reason and logprobs (a beam
    search's request gives one a beam, best first)."""
    outputs = []
    for r in prompt.answer_choices():
        if r.beams:
            outputs += [(r, b.text, b.finish_reason, b.logprobs or []) for b in r.beams]
        else:
            outputs.append((r, r.text, r.finish_reason, r.logprobs))
    return outputs


def streamed(fan: FanOut, writer: _StreamWriter) -> EventStreamResponse:
    """The streamed answer of an admitted fan-out."""
    direct = DirectSend()
    return EventStreamResponse(_stream(fan, writer, direct), fan.hang_up, headers=SSE_HEADERS, direct=direct)


async def _stream(fan: FanOut, writer: _StreamWriter, direct: DirectSend | None = None) -> AsyncIterator[str]:
    """The choices' events interleaved as their tokens arrive, every event ready at one wake-up
    in one string; ends by every request's deadline. With ``direct`` (bound to the response's
    send), a single choice's pieces but its last are written as they arrive (:class:`_DirectPieces`)."""
    try:
        openings = writer.openings()
        if openings:
            yield "".join(openings)
        sink = _DirectPieces(fan, writer, direct) if direct is not None and len(fan.relays) == 1 else None
        async with contextlib.aclosing(fan.batches(sink)) as batches:
            async for batch in batches:
                events: list[str] = []
                for index, item in batch:
                    events += writer.failed(index, item.error) if isinstance(item, StreamFailed) else writer.piece(index, item)
                if events:
                    yield "".join(events)
        tail = sse(writer.head.chunk([], usage=_usage(fan, writer.echo))) if writer.head.include_usage else ""
        yield tail + "data: [DONE]\n\n"
    finally:
        fan.release()


class _DirectPieces:
    """A single choice's pieces written to its client by whoever delivers them (the node's frame
    handler), with no wake-up of the stream's task: the same events :meth:`_StreamWriter.piece`
    gives the task. The last piece (its finish reason), a client that left, and a write the
    connection did not finish at once are left to the task."""

    def __init__(self, fan: FanOut, writer: _StreamWriter, direct: DirectSend) -> None:
        self.fan = fan
        self.writer = writer
        self.direct = direct
        #: Every piece is text only (what :meth:`_StreamWriter.piece` writes from its template).
        self.plain = (writer.echo is None and not writer.vllm_field and writer.calls is None
                      and not writer.wants_logprobs)

    def offer(self, chunk: TokenChunk) -> bool:
        if chunk.finish_reason is not None or self.fan.hung_up or not self.direct.ready:
            return False
        if self.plain:
            if chunk.text:
                self.writer.offsets[0] += len(chunk.text)
                self.direct.write(self.writer.plain(0, chunk.text).encode())
            return True
        events = self.writer.piece(0, chunk)
        if events:
            self.direct.write("".join(events).encode())
        return True

    def offer_plain(self, token_ids: list[int], text: str) -> bool:
        if not self.plain:
            return self.offer(TokenChunk(token_ids, text, None, None))
        if self.fan.hung_up or not self.direct.ready:
            return False
        if text:
            writer = self.writer
            writer.offsets[0] += len(text)
            self.direct.write(writer.plain(0, text).encode())
        return True

    @property
    def busy(self) -> bool:
        return self.direct.busy

    async def settle(self) -> None:
        await self.direct.settle()


class _StreamWriter:
    """The SSE events of one streamed answer, choice by choice: its text offset (completion
    logprobs count from it), its echo (put before its first piece), its tool-call parser (a chat
    answer that may be a call), and the template its plain pieces are written from."""

    def __init__(self, ctx: MasterContext, fan: FanOut, req: Any, head: StreamHead, echo: Echo | None) -> None:
        self.head = head
        self.shape = head.shape
        self.token_text = token_namer(ctx, req)
        self.wants_logprobs = self.shape.wants_logprobs(req)
        count = len(fan.relays)
        self.before = [echo.texts[p] for p, prompt in enumerate(fan.prompts) for _ in prompt.relays] if echo else None
        # Completion logprobs count their text offsets from the start of the answer's text.
        self.offsets = [len(text) for text in self.before] if self.before else [0] * count
        self.echo = echo
        #: Answered with the prompt's logprobs (echo, or vLLM's field): each choice's prompt ids.
        self.prompt_ids = [r.token_ids for r in fan.relays]
        self.top = req.logprobs or 0 if self.shape.object == "text_completion" else 0
        self.vllm_field = self.shape.object == "text_completion" and req.prompt_logprobs is not None
        self.calls = None
        if self.shape.object == "chat.completion" and req.parses_tool_calls:
            self.calls = [tool_calls.ToolCallStream(req.tool_names) for _ in range(count)]
        #: Choice index -> its plain piece's event, split where the text goes (most events are one).
        self.templates: dict[int, tuple[str, str]] = {}

    def openings(self) -> list[str]:
        if self.shape.opening is None:
            return []
        return [self._event(index, choice(self.shape.opening)) for index in range(len(self.offsets))]

    def piece(self, index: int, piece: TokenChunk) -> list[str]:
        if self.echo is not None and (self.echo.logprobs or self.echo.prompt_only) or self.vllm_field:
            return [self._event(index, self._scored(index, piece))]
        logprobs = None
        if self.wants_logprobs and piece.logprobs:
            logprobs = self.shape.logprobs(piece.logprobs, self.token_text, self.offsets[index])
        if self.calls is not None:
            return [self._event(index, body) for body in _tool_call_deltas(self.calls[index], piece, logprobs)]
        text = piece.text
        if logprobs is None and piece.finish_reason is None:
            if not text:
                return []
            self.offsets[index] += len(text)
            return [self.plain(index, self._echoed(index, text))]
        self.offsets[index] += len(text)
        body = choice(self.shape.delta(self._echoed(index, text)), piece.finish_reason, logprobs)
        return [self._event(index, body)]

    def _scored(self, index: int, piece: TokenChunk) -> dict[str, Any]:
        """A completion's piece with its prompt's logprobs (on its first piece: echoed before its
        own, or in vLLM's field); the prompt alone with ``max_tokens: 0``."""
        echo = self.echo
        prompt_only = echo is not None and echo.prompt_only
        text, finish, entries = piece.text, piece.finish_reason, piece.logprobs
        if prompt_only:
            text, finish, entries = "", "length", None
        logprobs = None
        if self.wants_logprobs and entries:
            logprobs = self.shape.logprobs(entries, self.token_text, self.offsets[index])
        scored = piece.prompt_logprobs
        if scored is not None and echo is not None and echo.logprobs:
            prompt = prompt_logprobs.legacy(self.prompt_ids[index], scored, self.token_text, self.top)
            logprobs = prompt_logprobs.joined(prompt, logprobs)
        self.offsets[index] += len(text)
        body = choice(self.shape.delta(self._echoed(index, text)), finish, logprobs)
        if self.vllm_field and scored is not None:
            body["prompt_logprobs"] = prompt_logprobs.vllm(self.prompt_ids[index], scored, self.token_text)
        return body

    def failed(self, index: int, error: APIError) -> list[str]:
        """The choice's last event, then the error's."""
        body = choice(self.shape.delta(self._echoed(index, "")), "error")
        return [self._event(index, body), sse(oa.error_event(error))]

    def _echoed(self, index: int, text: str) -> str:
        if self.before is None or not self.before[index]:
            return text
        text, self.before[index] = self.before[index] + text, ""
        return text

    def _event(self, index: int, body: dict[str, Any]) -> str:
        """The event of one choice's ``body`` (see :func:`choice`), under its ``index``."""
        return sse(self.head.chunk([{**body, "index": index}]))

    def plain(self, index: int, text: str) -> str:
        """The event of a piece of text alone."""
        template = self.templates.get(index)
        if template is None:
            template = self.templates[index] = text_template(self._event(index, choice(self.shape.delta(PIECE))))
        return template[0] + json_string(text) + template[1]


def _tool_call_deltas(calls: tool_calls.ToolCallStream, piece: TokenChunk, logprobs: Any) -> list[dict[str, Any]]:
    """The streamed choices of one piece of an answer that may be a tool call; the last piece's
    finish reason is "tool_calls" when the answer was one."""
    deltas = calls.feed(piece.text)
    finish = piece.finish_reason
    if finish is not None:
        deltas += calls.finish()
        if calls.state == "call" and finish == "stop":
            finish = "tool_calls"
    bodies = [choice({"delta": d}, None, logprobs if i == 0 else None) for i, d in enumerate(deltas)]
    if finish is not None:
        bodies.append(choice({"delta": {}}, finish, None))
    elif not bodies and logprobs is not None:
        bodies.append(choice({"delta": {}}, None, logprobs))
    return bodies
