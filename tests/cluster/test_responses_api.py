"""``POST /v1/responses`` through a real master, prefill and decode node with the official openai
client (its typed Response and stream events), and LangChain's ChatOpenAI(use_responses_api=True):
text and message inputs with instructions, streamed and not, a json_schema format, a forced
function call, and a clear 400 for what needs server-side state."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def client(served_cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=served_cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content


def test_text_input_answers_what_the_chat_route_answers(client):
    response = client.responses.create(model=MODEL, input="Name a color.", max_output_tokens=8, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.error is None
    assert response.output_text == chat_text(client, [{"role": "user", "content": "Name a color."}], 8)
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


def test_messages_and_instructions_become_the_chat_prompt(client):
    response = client.responses.create(
        model=MODEL, instructions="Answer in one word.", temperature=0, max_output_tokens=6,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]}],
    )
    want = chat_text(client, [{"role": "system", "content": "Answer in one word."},
                              {"role": "user", "content": "What is 2+2?"}], 6)
    assert response.output_text == want and response.instructions == "Answer in one word."


def test_a_stream_parses_into_the_same_answer(client):
    events = list(client.responses.create(model=MODEL, input="Count to five.", max_output_tokens=10, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == chat_text(client, [{"role": "user", "content": "Count to five."}], 10)
    assert final.usage.output_tokens > 0


def test_a_json_schema_format_is_followed(client):
    response = client.responses.create(
        model=MODEL, input="Describe a person called Ada who is 36.", temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    )
    person = json.loads(response.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert response.text.format.type == "json_schema"
    parsed = client.responses.parse(model=MODEL, input="Describe a person called Ada who is 36.", temperature=0,
                                    max_output_tokens=60, text_format=Person)
    assert isinstance(parsed.output_parsed, Person)

    # The client's stream helper accumulates the events into the same parsed answer (an answer
    # that a grammar ends is completed, which the helper needs).
    with client.responses.stream(model=MODEL, input="Describe a person called Ada who is 36.", temperature=0,
                                 max_output_tokens=60, text_format=Person) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed and final.status == "completed"


def test_a_forced_function_call_is_a_function_call_item_streamed_or_not(client):
    ask = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [WEATHER], "temperature": 0,
           "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 40}
    response = client.responses.create(**ask)
    call = response.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)

    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments
    assert events[-1].response.output[0].type == "function_call"

    # The call's output sent back (the whole conversation: nothing is stored) is answered as text.
    follow = client.responses.create(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=12, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"},
    ], tool_choice="none")
    assert follow.output[0].type == "message" and follow.output_text


def test_what_needs_server_state_is_a_clear_400(client):
    for extra in ({"previous_response_id": "resp_123"}, {"store": True}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, **extra)
        assert refused.value.param == next(iter(extra)) and "stateless" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_image",
                                                                                  "image_url": "x"}]}])
    assert refused.value.param == "input"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Hi", tools=[{"type": "web_search"}])
    assert refused.value.param == "tools"
    assert client.responses.create(model=MODEL, input="Still serving", max_output_tokens=2).output_text


def test_langchain_chat_openai_with_the_responses_api_answers(served_cluster):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=served_cluster.url + "/v1", api_key="unused", use_responses_api=True,
                     temperature=0, max_tokens=8, max_retries=0)
    reply = llm.invoke("Name a color.")
    assert reply.text and reply.usage_metadata["output_tokens"] > 0
    chunks = list(llm.stream("Name a color."))
    assert "".join(c.text for c in chunks) == reply.text
