"""Reading Llama-3 JSON tool calls back as OpenAI tool_calls, whole and streamed ("auto" parses
whatever the model wrote); the grammar of a strict function's call."""

from __future__ import annotations

import json

from master.tool_calls import ToolCallStream, call_schema, parse_tool_calls

NAMES = {"get_weather", "get_time"}
CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": {"x": 1}}}'


def _stream(text: str, size: int = 3) -> tuple[list[dict], ToolCallStream]:
    s = ToolCallStream(NAMES)
    deltas = [d for i in range(0, len(text), size) for d in s.feed(text[i:i + size])]
    return deltas + s.finish(), s


def test_whole_answers_parse_into_calls_or_stay_content():
    [call] = parse_tool_calls(CALL, NAMES)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "unit": {"x": 1}}
    calls = parse_tool_calls('<|python_tag|>[{"name": "get_time", "arguments": {"city": "Oslo"}}, ' + CALL + "]", NAMES)
    assert [c.name for c in calls] == ["get_time", "get_weather"]
    for text in ("The weather is fine.", '{"name": "unknown", "parameters": {}}', '{"name": "get_time"', "{}"):
        assert parse_tool_calls(text, NAMES) is None


def test_streamed_call_opens_with_id_and_name_then_arguments_in_pieces():
    deltas, s = _stream(CALL)
    assert s.state == "call"
    head = deltas[0]["tool_calls"][0]
    assert head["id"].startswith("call_") and head["function"] == {"name": "get_weather", "arguments": ""}
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]]
    assert len(pieces) > 2 and all(d["tool_calls"][0]["index"] == 0 for d in deltas)
    assert json.loads("".join(pieces)) == {"city": "Paris", "unit": {"x": 1}}


def test_streamed_text_that_is_not_a_call_is_content():
    deltas, s = _stream("Sunny, 21 degrees.")
    assert s.state == "content" and "".join(d["content"] for d in deltas) == "Sunny, 21 degrees."
    deltas, s = _stream('{"answer": 42}')
    assert s.state == "content" and "".join(d["content"] for d in deltas) == '{"answer": 42}'


def test_a_strict_function_call_holds_only_the_arguments_its_parameters_list():
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    strict = call_schema({"name": "get_weather", "parameters": parameters, "strict": True})
    lax = call_schema({"name": "get_weather", "parameters": parameters})
    assert strict["properties"]["parameters"] == {**parameters, "additionalProperties": False}
    assert lax["properties"]["parameters"] == parameters
    assert "additionalProperties" not in parameters
