"""The answer of ``POST /v1/responses``: one Response document, or the ``response.*`` events of
a stream, as OpenAI's client parses them (``client.responses.create`` and ``.stream``).

Text streams as it arrives: ``response.created``, ``response.in_progress``, the message's
``output_item.added`` and ``content_part.added``, one ``output_text.delta`` a piece, then the
``done`` events and ``response.completed`` (``response.incomplete`` when ``max_output_tokens``
ended it) carrying the whole Response and its usage. An answer that may be a function call (the
request has tools) is read whole first: its events then come at its end, as function calls
(``function_call_arguments.delta`` / ``.done``) or as one message.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from master import answers, tool_calls
from master import openai_schemas as oa
from master.answer_shapes import SSE_HEADERS
from master.context import MasterContext
from master.errors import APIError
from master.event_stream import EventStreamResponse
from master.fanout import FanOut
from master.prepare import Prepared
from master.relay_request import StreamFailed
from master.responses_request import ResponsesRequest


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """A chat answer's usage in the Responses API's names."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                                 "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
        else []
    return {"type": "message", "id": item_id or _item_id("msg"), "status": status, "role": "assistant",
            "content": content}


def call_items(call: tool_calls.ParsedCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": _item_id("fc"), "call_id": tool_calls.new_call_id(), "name": call.name,
            "arguments": call.arguments, "status": status}


def output_items(req: ResponsesRequest, chat_req: Any, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
    """The answer's output: its function calls when it is one, else one message."""
    status = "incomplete" if finish_reason == "length" else "completed"
    if chat_req.parses_tool_calls and finish_reason == "stop":
        calls = tool_calls.parse_tool_calls(text, chat_req.tool_names)
        if calls is not None:
            return [call_items(c) for c in calls]
    return [message_item(text, status)]


@dataclass
class ResponseDoc:
    """What every Response document of one answer repeats, and its state."""

    req: ResponsesRequest
    response_id: str
    created_at: int
    model: str
    status: str = "in_progress"
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    def end(self, finish_reason: str | None, chat_usage: dict[str, Any]) -> None:
        self.status = "incomplete" if finish_reason == "length" else "completed"
        self.usage = usage(chat_usage)

    def body(self) -> dict[str, Any]:
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": self.status,
            "background": False, "error": self.error, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": self.output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": req.temperature, "top_p": req.top_p, "text": {"format": req.format()},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "truncation": "disabled", "usage": self.usage, "user": req.user, "metadata": req.metadata or {},
        }


class ResponseEvents:
    """The ``response.*`` events of one streamed answer, numbered in order."""

    def __init__(self, doc: ResponseDoc, chat_req: Any) -> None:
        self.doc = doc
        self.chat_req = chat_req
        self.sequence = 0
        self.text = ""
        self.message_id: str | None = None
        #: Read whole before any output event: the answer may be a function call.
        self.held = bool(chat_req.parses_tool_calls)

    def event(self, kind: str, **fields: Any) -> str:
        doc = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(doc, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def opening(self) -> str:
        return (self.event("response.created", response=self.doc.body())
                + self.event("response.in_progress", response=self.doc.body()))

    def piece(self, text: str) -> str:
        self.text += text
        if self.held or not text:
            return ""
        return self._open_message() + self.event("response.output_text.delta", item_id=self.message_id,
                                                 output_index=0, content_index=0, delta=text, logprobs=[])

    def _open_message(self) -> str:
        if self.message_id is not None:
            return ""
        self.message_id = _item_id("msg")
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return (self.event("response.output_item.added", output_index=0,
                           item=message_item("", "in_progress", self.message_id))
                + self.event("response.content_part.added", item_id=self.message_id, output_index=0,
                             content_index=0, part=part))

    def closing(self, finish_reason: str | None, chat_usage: dict[str, Any]) -> str:
        items = output_items(self.doc.req, self.chat_req, self.text, finish_reason)
        events = []
        for index, item in enumerate(items):
            events.append(self._call(index, item) if item["type"] == "function_call" else self._message(item))
        self.doc.output = items
        self.doc.end(finish_reason, chat_usage)
        kind = "response.incomplete" if self.doc.status == "incomplete" else "response.completed"
        return "".join(events) + self.event(kind, response=self.doc.body())

    def _message(self, item: dict[str, Any]) -> str:
        opening = self._open_message()
        if self.held and self.text:
            opening += self.event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                  content_index=0, delta=self.text, logprobs=[])
        item["id"] = self.message_id
        part = item["content"][0]
        return (opening
                + self.event("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                             text=self.text, logprobs=[])
                + self.event("response.content_part.done", item_id=self.message_id, output_index=0,
                             content_index=0, part=part)
                + self.event("response.output_item.done", output_index=0, item=item))

    def _call(self, index: int, item: dict[str, Any]) -> str:
        added = {**item, "arguments": "", "status": "in_progress"}
        return (self.event("response.output_item.added", output_index=index, item=added)
                + self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=item["arguments"])
                + self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             name=item["name"], arguments=item["arguments"])
                + self.event("response.output_item.done", output_index=index, item=item))

    def failed(self, error: APIError) -> str:
        self.doc.status = "failed"
        self.doc.error = {"code": error.code or "server_error", "message": error.message}
        return (self.event("error", code=error.code, message=error.message, param=error.param)
                + self.event("response.failed", response=self.doc.body()))


async def stream(fan: FanOut, events: ResponseEvents) -> AsyncIterator[str]:
    """The answer's events as its tokens arrive; ends by the request's deadline."""
    try:
        yield events.opening()
        finish_reason = None
        async with contextlib.aclosing(fan.batches()) as batches:
            async for batch in batches:
                out = []
                for _, item in batch:
                    if isinstance(item, StreamFailed):
                        yield "".join(out) + events.failed(item.error)
                        return
                    out.append(events.piece(item.text))
                    finish_reason = item.finish_reason or finish_reason
                if any(out):
                    yield "".join(out)
        yield events.closing(finish_reason, fan.usage())
    finally:
        fan.release()


#: Chat fields a Responses request's error names by its own.
_PARAMS = {"messages": "input", "response_format": "text", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens"}


def in_responses_terms(error: APIError) -> APIError:
    """An error of the chat request a Responses request became, naming the Responses field."""
    param = _PARAMS.get(error.param or "", error.param)
    message = error.message
    for chat, own in _PARAMS.items():
        message = message.replace(f"{chat}:", f"{own}:").replace(f"The {chat} ", f"The {own} ")
    return APIError(error.status, message, error.type, param, error.code, error.retry_after)


async def serve(request: Request, ctx: MasterContext, req: ResponsesRequest, prepared: Prepared,
                arrival: float) -> Response:
    """Answer ``req`` (prepared as its chat request): streamed events, or one Response."""
    fan = await answers.admitted(request, ctx, "chat", [prepared], arrival)
    if isinstance(fan, Response):
        return fan
    doc = ResponseDoc(req, "resp_" + fan.request_id.split("-", 1)[-1], oa.now(), ctx.model_name or req.model)
    if req.stream:
        return EventStreamResponse(stream(fan, ResponseEvents(doc, prepared.req)), fan.hang_up, headers=SSE_HEADERS)
    left = await answers.waited(fan)
    if left is not None:
        return left
    r = fan.prompts[0].answer_choices()[0]
    doc.output = output_items(req, prepared.req, r.text, r.finish_reason)
    doc.end(r.finish_reason, fan.usage())
    return JSONResponse(doc.body())
