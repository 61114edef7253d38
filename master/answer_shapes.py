"""What a chat and a completion answer look like: their objects, where a choice's text goes, how
its logprobs read, and the SSE events a streamed answer is made of."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from master import openai_schemas as oa
from master import tool_calls
from master.prepare import Kind

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: Status for a client that left before its answer (nginx's convention; nobody reads it).
CLIENT_CLOSED = 499
#: Stands for a piece's text in a chunk template (no client text holds a NUL).
PIECE = "\x00piece\x00"


#: ``json.dumps(payload, separators=(",", ":"), ensure_ascii=False)`` without building an
#: encoder a call (json.dumps does, for any argument but the defaults).
_compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
#: ``json.dumps(text, ensure_ascii=False)`` of a string: the C escape json.dumps calls in the end.
json_string: Callable[[str], str] = json.encoder.encode_basestring  # type: ignore[attr-defined]


def sse(payload: dict[str, Any]) -> str:
    return f"data: {_compact(payload)}\n\n"


def text_template(event: str) -> tuple[str, str]:
    """An SSE event built around ``PIECE``, split where the piece's JSON string goes: a token's
    event is then ``head + json_string(text) + tail``, the same bytes as serialising it whole."""
    head, _, tail = event.rpartition(json_string(PIECE))  # the choices come last
    return head, tail


@dataclass(frozen=True)
class Shape:
    """What differs between a chat and a completion answer: where the text goes and how its
    logprobs read. Both routes share everything else."""

    id_prefix: str
    object: str
    chunk_object: str
    #: The choice's text field for the whole answer (non-streaming).
    content: Callable[[str], dict[str, Any]]
    #: The choice's text field for one streamed piece.
    delta: Callable[[str], dict[str, Any]]
    #: A first streamed choice, sent before any token (chat announces the role); None: none.
    opening: dict[str, Any] | None
    wants_logprobs: Callable[[Any], bool]
    #: (entries, token id -> text, offset in the answer's text they start at) -> OpenAI's logprobs.
    logprobs: Callable[[list[Any], Callable[[int], str], int], Any]


SHAPES: dict[Kind, Shape] = {
    "chat": Shape(
        id_prefix="chatcmpl",
        object="chat.completion",
        chunk_object="chat.completion.chunk",
        content=lambda text: {"message": {"role": "assistant", "content": text}},
        delta=lambda text: {"delta": {"content": text} if text else {}},
        opening={"delta": {"role": "assistant", "content": ""}},
        wants_logprobs=lambda req: bool(req.logprobs),
        logprobs=lambda entries, token_text, _offset: oa.chat_logprobs(entries, token_text),
    ),
    "completion": Shape(
        id_prefix="cmpl",
        object="text_completion",
        chunk_object="text_completion",
        content=lambda text: {"text": text},
        delta=lambda text: {"text": text},
        opening=None,
        wants_logprobs=lambda req: req.logprobs is not None,
        logprobs=oa.completion_logprobs,
    ),
}


def choice(body: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
    return {"index": 0, **body, "logprobs": logprobs, "finish_reason": finish_reason}


def answer(shape: Shape, req: Any, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole answer's choice body and finish reason: a chat answer that is a complete tool call
    becomes ``tool_calls`` (content null, finish reason "tool_calls")."""
    if shape.object == "chat.completion" and req.parses_tool_calls and finish_reason == "stop":
        calls = tool_calls.parse_tool_calls(text, req.tool_names)
        if calls is not None:
            message = {"role": "assistant", "content": None,
                       "tool_calls": [c.openai(tool_calls.new_call_id()) for c in calls]}
            return {"message": message}, "tool_calls"
    return shape.content(text), finish_reason


@dataclass(frozen=True)
class StreamHead:
    """What every chunk of one streamed answer repeats."""

    answer_id: str
    shape: Shape
    created: int
    model: str
    include_usage: bool

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        doc = {"id": self.answer_id, "object": self.shape.chunk_object, "created": self.created, "model": self.model,
               "choices": choices}
        if self.include_usage:
            doc["usage"] = None
        doc.update(extra)
        return doc
