"""The streamed answer's SSE bytes: a plain piece's event is written from a cached template and a
fast string escape; every event must be the bytes ``json.dumps`` of the whole chunk gives, and
read back by the official client's models as the text that went in."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from master import openai_schemas as oa
from master.answer_shapes import SHAPES, StreamHead, choice, sse
from master.answers import _StreamWriter
from master.errors import APIError
from master.prompt_logprobs import Echo
from master.relay_request import TokenChunk
from pd_cluster import protocol

TRICKY = [
    'say "hi"', "back\\slash \\n not a newline", "new\nline\ttab\rreturn", "nul\x00 and \x1f and \x7f",
    "unicode é ü ß 中文 العربية", "emoji 😀🎉👩‍👩‍👧", "line sep \u2028 para sep \u2029", "</script><!--",
    "\ufeffbom", "{\"json\": [1, 2]}", " ", "a" * 300,
]


def reference(payload: dict[str, Any]) -> str:
    """How the master wrote every event before it had templates."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def writer(kind: str, choices: int = 1, logprobs: Any = None, tools: set[str] | None = None,
           include_usage: bool = False, echo: list[str] | None = None) -> _StreamWriter:
    shape = SHAPES[kind]  # type: ignore[index]
    req = SimpleNamespace(logprobs=logprobs, parses_tool_calls=tools is not None, tool_names=tools or set(),
                          include_usage=include_usage, prompt_logprobs=None)
    relays = [SimpleNamespace(token_ids=[1, 2])] * choices
    fan = SimpleNamespace(relays=relays, prompts=[SimpleNamespace(relays=relays)])
    ctx = SimpleNamespace(tokenizer=SimpleNamespace(token_text=lambda token_id: f"t\"{token_id}\u00e9"))
    head = StreamHead("chatcmpl-x1", shape, 1_764_000_000, "smol \"model\"", include_usage)
    return _StreamWriter(ctx, fan, req, head, Echo(echo) if echo else None)  # type: ignore[arg-type]


def read_text(kind: str, payload: dict[str, Any]) -> list[str | None]:
    """The choices' text as the official client reads a chunk (a completion chunk's unfinished
    choice has finish_reason null, which its Completion model does not take: read as the client
    does, without validation)."""
    if kind == "chat":
        return [c.delta.content for c in ChatCompletionChunk.model_validate(payload).choices]
    return [c.text for c in Completion.model_construct(**payload).choices]  # type: ignore[attr-defined]


def canonical(event: str) -> dict[str, Any]:
    """The event's payload, after checking its bytes are json.dumps' of it."""
    assert event.startswith("data: ") and event.endswith("\n\n")
    payload = json.loads(event[6:])
    assert event == reference(payload)
    return payload


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_plain_piece_is_the_bytes_of_the_whole_chunk(kind: str, include_usage: bool):
    w = writer(kind, choices=2, include_usage=include_usage)
    for index in (0, 1):
        for text in TRICKY:
            (event,) = w.piece(index, TokenChunk([7], text, None, None))
            body = {**choice(SHAPES[kind].delta(text)), "index": index}  # type: ignore[index]
            assert event == reference(w.head.chunk([body]))
            payload = canonical(event)
            assert read_text(kind, payload) == [text]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_finish_reasons_logprobs_echo_and_usage_read_back_as_sent(kind: str, finish_reason: str):
    logprobs = 2 if kind == "completion" else True
    w = writer(kind, logprobs=logprobs, include_usage=True, echo=["echoed \"prompt\" 😀 "])
    entries = [protocol.TokenLogprob(token_id=5, logprob=-0.25, top={5: -0.25, 9: -1.5})]
    events = w.piece(0, TokenChunk([5], "first \"piece\"\n", entries, None))
    events += w.piece(0, TokenChunk([6], "last \\ piece 中", None, finish_reason))
    events.append(sse(w.head.chunk([], usage=oa.usage(12, 2, 4))))
    payloads = [canonical(e) for e in events]
    texts = [t for p in payloads for t in read_text(kind, p)]
    assert texts == ["echoed \"prompt\" 😀 first \"piece\"\n", "last \\ piece 中"]
    assert payloads[0]["choices"][0]["logprobs"]
    assert [c["finish_reason"] for p in payloads for c in p["choices"]] == [None, finish_reason]
    assert payloads[-1]["usage"]["completion_tokens"] == 2 and payloads[-1]["choices"] == []
    assert all(p["usage"] is None for p in payloads[:-1])
    if kind == "chat":
        first = ChatCompletionChunk.model_validate(payloads[0]).choices[0]
        assert first.logprobs is not None and first.logprobs.content[0].token == "t\"5\u00e9"


def test_tool_call_deltas_and_an_error_event_are_the_bytes_of_the_whole_chunk():
    w = writer("chat", tools={"get_weather"})
    events = []
    pieces = ['{"name": "get_', 'weather", "arguments": {"city": "Z\\u00fcrich \\"old', ' town\\"", "n": 1}}']
    for i, text in enumerate(pieces):
        events += w.piece(0, TokenChunk([i], text, None, "stop" if i == len(pieces) - 1 else None))
    payloads = [canonical(e) for e in events]
    chunks = [ChatCompletionChunk.model_validate(p) for p in payloads]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function is not None and calls[0].function.name == "get_weather"
    arguments = "".join(tc.function.arguments or "" for tc in calls if tc.function is not None)
    assert json.loads(arguments) == {"city": "Zürich \"old town\"", "n": 1}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    failed = w.failed(0, APIError(502, "node \"d0\" lost\n", "server_error", None, "node_lost"))
    assert canonical(failed[1]) == {"error": {"message": "node \"d0\" lost\n", "type": "server_error", "param": None,
                                              "code": "node_lost"}}
    assert canonical(failed[0])["choices"][0]["finish_reason"] == "error"
