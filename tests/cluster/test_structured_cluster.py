"""Structured outputs and tools through the official openai client against the real cluster on CPU
(the default model, every request prefilled on P and decoded on D): JSON-schema answers validate
against their schema, a tool call round trip works streaming and not, and the text format leaves
greedy output unchanged."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
#: Enough for every schema below: bounded strings, arrays and numbers keep answers short.
MAX_TOKENS = 120


def _s(maxlen: int = 24) -> dict:
    return {"type": "string", "maxLength": maxlen}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


#: (what to ask for, schema): objects, nesting, arrays, enums, bounded numbers, booleans,
#: optional properties, bounded strings, top-level non-objects.
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", _obj({"name": _s(), "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city", _obj({"city": _s(), "country": _s(), "population": {"type": "integer", "minimum": 0, "maximum": 10**8}})),
    ("a book", _obj({"title": _s(30), "author": _s(), "year": {"type": "integer", "minimum": 1400, "maximum": 2030}})),
    ("a yes/no verdict", _obj({"answer": {"type": "boolean"}, "reason": _s(40)})),
    ("a colour", _obj({"color": {"enum": ["red", "green", "blue", "yellow"]}})),
    ("a temperature reading", _obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("three fruits", _obj({"fruits": {"type": "array", "items": _s(12), "minItems": 1, "maxItems": 3}})),
    ("a user with an address",
     _obj({"user": _obj({"name": _s(), "address": _obj({"street": _s(), "zip": _s(10)})})})),
    ("a product", _obj({"sku": _s(12), "price": {"type": "number", "minimum": 0, "maximum": 1000},
                        "in_stock": {"type": "boolean"}})),
    ("a task", _obj({"title": _s(), "priority": {"enum": ["low", "medium", "high"]}, "done": {"type": "boolean"}})),
    ("a point", _obj({"x": {"type": "integer", "minimum": -100, "maximum": 100},
                      "y": {"type": "integer", "minimum": -100, "maximum": 100}})),
    ("a movie with an optional rating",
     _obj({"title": _s(), "rating": {"type": "integer", "minimum": 1, "maximum": 5}}, required=["title"])),
    ("a list of scores", _obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                                          "maxItems": 4}})),
    ("a pet", _obj({"species": {"enum": ["cat", "dog", "fish"]}, "name": _s(16), "age": {"type": "integer",
                                                                                      "minimum": 0, "maximum": 30}})),
    ("a greeting", {"type": "string", "maxLength": 30}),
    ("a number between 1 and 10", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("two tags", {"type": "array", "items": {"enum": ["news", "sport", "tech", "art"]}, "minItems": 2, "maxItems": 2}),
    ("a team of people", _obj({"team": _s(), "members": {"type": "array", "maxItems": 2,
                                                         "items": _obj({"name": _s(16), "role": _s(16)})}})),
    ("an event", _obj({"name": _s(), "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                       "online": {"type": "boolean"}, "notes": _s(20)}, required=["name", "day"])),
    ("a coordinate with a label",
     _obj({"label": _s(16), "lat": {"type": "number", "minimum": -90, "maximum": 90},
           "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": _obj({"city": _s(20), "unit": {"enum": ["celsius", "fahrenheit"]}}),
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "Get the local time in a city",
                 "parameters": _obj({"city": _s(20)})},
}


@pytest.fixture
async def client(served_cluster):
    """One per test: an async client belongs to its test's event loop."""
    async with openai.AsyncOpenAI(base_url=served_cluster.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=300) as c:
        yield c


async def _failing_answers(client, schemas: list[tuple[str, dict]], max_tokens: int) -> list[tuple[str, str, str]]:
    """Ask for each (what, schema) greedily under a strict ``json_schema``: the answers that do not
    end ("stop"), parse, validate against their schema and hold only keys it lists."""
    async def ask(what: str, schema: dict, i: int):
        return await client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=max_tokens,
            messages=[{"role": "user", "content": f"Give me {what} as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
        )

    answers = await asyncio.gather(*(ask(what, schema, i) for i, (what, schema) in enumerate(schemas)))
    failing = []
    for (what, schema), answer in zip(schemas, answers):
        choice = answer.choices[0]
        try:
            assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
            value = json.loads(choice.message.content)
            jsonschema.validate(value, schema)
            assert _unlisted_keys(value, schema) == [], f"unlisted keys {_unlisted_keys(value, schema)}"
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failing.append((what, choice.message.content, str(exc)[:200]))
    return failing


def _unlisted_keys(value: object, schema: dict) -> list[str]:
    """Keys of ``value`` that no ``properties`` of ``schema`` lists, at any depth."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return [k for k in value if k not in props] + [u for k, v in value.items() if k in props
                                                       for u in _unlisted_keys(v, props[k])]
    if isinstance(value, list):
        return [u for v in value for u in _unlisted_keys(v, schema.get("items", {}))]
    return []


async def test_json_schema_answers_validate_against_their_schemas(client):
    assert await _failing_answers(client, SCHEMAS, MAX_TOKENS) == []


def _open_obj(props: dict) -> dict:
    """An object schema that says nothing of additionalProperties, as users often write them."""
    return {"type": "object", "properties": props, "required": list(props)}


#: Simple schemas that leave additionalProperties out: without strict the default model wanders
#: into keys of its own and runs out of tokens mid-JSON.
OPEN_SCHEMAS: list[tuple[str, dict]] = [
    ("a person", _open_obj({"name": {"type": "string"}, "age": {"type": "integer"}})),
    ("a book", _open_obj({"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
                          "available": {"type": "boolean"}})),
    ("a user with an address",
     _open_obj({"name": {"type": "string"}, "address": _open_obj({"street": {"type": "string"},
                                                                   "city": {"type": "string"}})})),
    ("a team of people", _open_obj({"team": _s(20), "members": {
        "type": "array", "maxItems": 3, "items": _open_obj({"name": _s(20), "role": _s(20)})}})),
    ("a task", _open_obj({"title": {"type": "string"}, "priority": {"enum": ["low", "medium", "high"]}})),
]


async def test_strict_schemas_hold_only_their_listed_keys(client):
    """``strict`` reads a missing additionalProperties as false (OpenAI's strict mode): each answer
    ends within 96 tokens, parses, validates and holds no key its schema does not list."""
    assert await _failing_answers(client, OPEN_SCHEMAS, 96) == []


async def test_json_object_answer_parses_as_an_object(client):
    answer = await client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=MAX_TOKENS, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object with a name of at most two words."}],
    )
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


async def test_text_response_format_leaves_greedy_output_unchanged(client):
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    plain = await client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=messages)
    text = await client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=messages,
                                                response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content
    assert plain.choices[0].message.content


async def test_a_bad_schema_is_a_400_naming_response_format(client):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "wrong"}}},
        )
    assert caught.value.body["param"] == "response_format"
    assert "wrong" in caught.value.body["message"]


def _weather_turns(call_id: str, arguments: str) -> list[dict]:
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_tool_call_round_trip(client, tool_choice):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    answer = await client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=MAX_TOKENS, messages=question, tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=tool_choice,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])

    final = await client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=40, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="none",
        messages=[*question, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}],
    )
    assert final.choices[0].message.content
    assert final.choices[0].message.tool_calls is None


async def test_tool_call_round_trip_streaming(client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    stream = await client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=MAX_TOKENS, messages=question, tools=[WEATHER_TOOL],
        tool_choice="required", stream=True,
    )
    heads, pieces, finishes = [], [], []
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or ():
                assert delta.index == 0
                if delta.id is not None:
                    heads.append((delta.id, delta.function.name))
                if delta.function and delta.function.arguments:
                    pieces.append(delta.function.arguments)
            assert not choice.delta.content
    assert finishes == ["tool_calls"]
    [(call_id, name)] = heads
    assert name == "get_weather" and call_id.startswith("call_")
    assert len(pieces) > 1, "the arguments come in pieces as they are generated"
    arguments = "".join(pieces)
    jsonschema.validate(json.loads(arguments), WEATHER_TOOL["function"]["parameters"])

    # The same call as the non-streamed request makes (greedy), and the conversation goes on.
    whole = await client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=MAX_TOKENS, messages=question, tools=[WEATHER_TOOL],
        tool_choice="required",
    )
    assert json.loads(whole.choices[0].message.tool_calls[0].function.arguments) == json.loads(arguments)
    final = await client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=40, messages=_weather_turns(call_id, arguments), stream=True,
    )
    text = "".join([c.choices[0].delta.content or "" async for c in final if c.choices])
    assert text
