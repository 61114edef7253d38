"""The master's HTTP surface: validation and errors in OpenAI's shape, health, models, metrics,
and requests served end to end through fake P/D nodes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from master.server import ConfigError, create_app
from pd_cluster import protocol
from tests.master_fakes import (
    ADMIN_HEADERS,
    CHAT_MESSAGES,
    CONTEXT,
    MODEL,
    FakeNode,
    LiveMaster,
    make_settings,
    serve_one,
    tiny_tokenizer,
    wait_until,
    wait_warm,
    write_model_dir,
)

CHAT = {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    model_dir = write_model_dir(tmp_path_factory.mktemp("model"))
    app = create_app(make_settings(model_dir, max_body_bytes=64 * 1024), tokenizer=tiny_tokenizer())
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _assert_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_malformed_json_is_400_and_the_server_keeps_serving(client):
    response = client.post("/v1/chat/completions", content=b'{"model": "tiny', headers={"content-type": "application/json"})
    error = _assert_error(response, 400)
    assert error["type"] == "invalid_request_error"
    _assert_error(client.post("/v1/completions", content=b"[1, 2]"), 400)
    _assert_error(client.post("/v1/completions", content=b""), 400)
    # Still serving: a valid request reaches admission (503: no nodes yet).
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 503


def test_missing_messages_is_400_naming_messages(client):
    _assert_error(client.post("/v1/chat/completions", json={"model": MODEL}), 400, param="messages")
    _assert_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400, param="messages")
    bad_role = {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}
    _assert_error(client.post("/v1/chat/completions", json=bad_role), 400, param="messages")


def test_max_tokens_below_one_is_400(client):
    _assert_error(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 0}), 400, param="max_tokens")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": -3}
    _assert_error(client.post("/v1/completions", json=body), 400, param="max_tokens")


def test_invalid_sampling_values_are_400_naming_the_field(client):
    _assert_error(client.post("/v1/chat/completions", json={**CHAT, "temperature": -1}), 400, param="temperature")
    _assert_error(client.post("/v1/chat/completions", json={**CHAT, "top_p": 0}), 400, param="top_p")
    _assert_error(client.post("/v1/chat/completions", json={**CHAT, "stop": [""]}), 400, param="stop")
    _assert_error(client.post("/v1/chat/completions", json={**CHAT, "stream": "maybe"}), 400, param="stream")
    _assert_error(client.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 2}), 400, param="top_logprobs")


def test_prompt_longer_than_the_context_is_400(client):
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "a" * CONTEXT}]}
    error = _assert_error(client.post("/v1/chat/completions", json=long_chat), 400, param="messages")
    assert str(CONTEXT) in error["message"]
    fits_but_too_much_output = {**CHAT, "max_tokens": CONTEXT}
    _assert_error(client.post("/v1/chat/completions", json=fits_but_too_much_output), 400, param="messages")
    _assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * (CONTEXT + 1)}), 400, param="prompt")


def test_completion_prompt_forms(client):
    # One prompt in a list or a batch of them (served, so 503 without nodes); at most 64 prompts;
    # ids must be in the vocabulary.
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": ["hi"]}).status_code == 503
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": [[5, 6]]}).status_code == 503
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}).status_code == 503
    _assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 65}), 400, param="prompt")
    _assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 10**6]}), 400, param="prompt")
    _assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": []}), 400, param="prompt")


def test_unsupported_options_are_400(client):
    _assert_error(client.post("/v1/chat/completions", json={**CHAT, "n": 17}), 400, param="n")
    no_tokens = {"model": MODEL, "prompt": "x", "max_tokens": 0}  # 0 only with echo: the prompt alone
    _assert_error(client.post("/v1/completions", json=no_tokens), 400, param="max_tokens")
    _assert_error(client.post("/v1/completions", json={**no_tokens, "max_tokens": 1, "prompt_logprobs": 21}), 400,
                  param="prompt_logprobs")
    image = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    _assert_error(client.post("/v1/chat/completions", json=image), 400, param="messages")


def test_unknown_model_is_404_model_not_found(client):
    _assert_error(client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404, param="model", code="model_not_found")
    _assert_error(client.get("/v1/models/gpt-9"), 404, code="model_not_found")


def test_unknown_route_and_method_are_openai_shaped(client):
    _assert_error(client.get("/v1/nothing"), 404)
    _assert_error(client.get("/v1/chat/completions"), 405)


def test_body_over_the_limit_is_413(client):
    body = json.dumps({**CHAT, "padding": "x" * (70 * 1024)})
    _assert_error(client.post("/v1/chat/completions", content=body), 413, code="request_too_large")

    def chunks():
        for _ in range(70):
            yield b" " * 1024

    _assert_error(client.post("/v1/chat/completions", content=chunks()), 413)
    assert client.get("/livez").status_code == 200


def test_valid_request_without_nodes_is_503_with_retry_after(client):
    response = client.post("/v1/chat/completions", json=CHAT)
    _assert_error(response, 503)
    assert response.headers["Retry-After"] == "1"


def test_health_needs_prefill_and_decode_nodes_while_livez_is_always_up(client):
    response = client.get("/health")
    assert response.status_code == 503 and response.json()["prefill_nodes"] == 0
    assert client.get("/livez").status_code == 200


def test_models_lists_the_configured_model(client):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL] and data[0]["max_model_len"] == CONTEXT
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


def test_admin_api_needs_the_admin_token(client):
    _assert_error(client.get("/admin/nodes"), 401)
    _assert_error(client.get("/admin/nodes", headers={"Authorization": "Bearer wrong"}), 401)
    _assert_error(client.post("/admin/nodes/x/drain", headers={"Authorization": "Basic abc"}), 401)
    _assert_error(client.delete("/admin/nodes/x"), 401)
    assert client.get("/admin/nodes", headers=ADMIN_HEADERS).json()["data"] == []
    _assert_error(client.post("/admin/nodes/x/drain", headers=ADMIN_HEADERS), 404)
    _assert_error(client.delete("/admin/nodes/x", headers=ADMIN_HEADERS), 404)


def test_admin_api_is_closed_without_an_admin_token(tmp_path: Path):
    app = create_app(make_settings(admin_token=None), tokenizer=tiny_tokenizer())
    with TestClient(app) as c:
        _assert_error(c.get("/admin/nodes", headers={"Authorization": "Bearer "}), 401)


def test_chat_template_errors_are_400_naming_messages():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    app = create_app(make_settings(served_model_name=MODEL), tokenizer=tokenizer)
    with TestClient(app) as c:
        error = _assert_error(c.post("/v1/chat/completions", json=CHAT), 400, param="messages")
        assert "alternate" in error["message"]


def test_internal_errors_are_500_without_details():
    class BrokenTokenizer:
        def __init__(self) -> None:
            self.inner = tiny_tokenizer()

        def __len__(self) -> int:
            return len(self.inner)

        def apply_chat_template(self, *args, **kwargs):
            raise MemoryError("secret internal detail")

    app = create_app(make_settings(served_model_name=MODEL), tokenizer=BrokenTokenizer())
    with TestClient(app, raise_server_exceptions=False) as c:
        response = c.post("/v1/chat/completions", json=CHAT)
        error = _assert_error(response, 500)
        assert "secret" not in response.text and error["type"] == "server_error"
        assert c.get("/livez").status_code == 200


def test_master_refuses_to_start_without_a_cluster_token():
    with pytest.raises(ConfigError):
        create_app(make_settings(cluster_token=None), tokenizer=tiny_tokenizer())


def test_metrics_exposes_the_pdc_series(client):
    client.post("/v1/chat/completions", json={"model": MODEL})
    text = client.get("/metrics").text
    for name in (
        "pdc_requests_total", "pdc_time_to_first_token_seconds", "pdc_time_per_output_token_seconds",
        "pdc_e2e_request_latency_seconds", "pdc_prompt_tokens_total", "pdc_generation_tokens_total",
        "pdc_prefix_hit_tokens_total", "pdc_kv_transfer_bytes_total", "pdc_kv_transfer_seconds",
        'pdc_nodes{role="decode",state="active"}',
    ):
        assert name in text, name
    assert 'pdc_requests_total{status="invalid"}' in text


def test_a_streamed_piece_from_the_template_is_the_event_serialised_whole():
    from master.answer_shapes import PIECE, sse, text_template

    def event(text: str) -> str:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        return sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                    "choices": [choice], "usage": None})

    head, tail = text_template(event(PIECE))
    for text in ["a", 'say "hi"\n', "é 中文 \\ \u2028 \t", PIECE]:
        assert head + json.dumps(text, ensure_ascii=False) + tail == event(text)


# ---- served through fake nodes --------------------------------------------------------------


@pytest.fixture
async def cluster(tmp_path: Path):
    async with LiveMaster(make_settings(write_model_dir(tmp_path))) as master:
        prefill = FakeNode(master, "p0", "prefill")
        decode = FakeNode(master, "d0", "decode")
        assert isinstance(await prefill.join(), protocol.Registered)
        assert isinstance(await decode.join(), protocol.Registered)
        await wait_warm(master)
        yield master, prefill, decode
        await prefill.close()
        await decode.close()


def _sse_payloads(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_streaming_chat_relays_first_token_from_p_and_the_rest_from_d(cluster):
    master, prefill, decode = cluster
    assert (await master.http.get("/health")).status_code == 200
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    call = asyncio.create_task(master.http.post("/v1/chat/completions", json=body))
    job = await serve_one(prefill, decode, [(10, "He"), (11, "l"), (12, "lo")], cached_tokens_prefill=4)
    assert job.decode_node_id == "d0" and job.decode_address == decode.register.data_address
    assert job.sampling.max_tokens == 4
    response = await call
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    chunks = _sse_payloads(response.text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] == len(job.token_ids)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 4


async def test_non_streaming_completion_returns_text_and_usage(cluster):
    master, prefill, decode = cluster
    call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "abc"}))
    job = await serve_one(prefill, decode, [(20, "x"), (21, "y")], finish_reason="length", hit_blocks_decode=1,
                          transfer_bytes=1024)
    assert job.sampling.max_tokens == 16  # OpenAI's legacy default
    response = await call
    assert response.status_code == 200, response.text
    doc = response.json()
    assert doc["object"] == "text_completion" and doc["model"] == MODEL
    assert doc["choices"][0]["text"] == "xy" and doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0},
    }
    metrics = (await master.http.get("/metrics")).text
    assert "pdc_kv_transfer_bytes_total 1024.0" in metrics
    assert "pdc_prefix_hit_tokens_total 4.0" in metrics  # one block of 4 tokens
    assert 'pdc_requests_total{status="ok"} 1.0' in metrics
    assert "pdc_time_to_first_token_seconds_count 1.0" in metrics


async def test_chat_default_max_tokens_is_the_remaining_context(cluster):
    master, prefill, decode = cluster
    call = asyncio.create_task(master.http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT["messages"]}))
    job = await serve_one(prefill, decode, [(5, "a")])
    assert job.sampling.max_tokens == CONTEXT - len(job.token_ids)
    assert (await call).json()["choices"][0]["message"] == {"role": "assistant", "content": "a"}


async def test_sampling_fields_reach_the_prefill_job(cluster):
    master, prefill, decode = cluster
    body = {
        **CHAT, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 7, "stop": "\n",
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25, "ignore_eos": True,
        "stop_token_ids": [2], "logprobs": True, "top_logprobs": 2, "user": "someone", "max_completion_tokens": 3,
    }
    call = asyncio.create_task(master.http.post("/v1/chat/completions", json=body))
    job = await prefill.next_job()
    s = job.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.stop) == (0.5, 0.9, 5, 0.1, 7, ["\n"])
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.1, 0.5, 0.25)
    assert s.ignore_eos and s.stop_token_ids == [2] and s.logprobs == 2 and s.max_tokens == 3
    logprob = protocol.TokenLogprob(token_id=10, logprob=-0.5, top={10: -0.5, 11: -1.5})
    await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=10, text="h", logprob=logprob,
                                           finish_reason="stop"))
    doc = (await call).json()
    content = doc["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "h" and content[0]["logprob"] == -0.5  # id 10 is "h" in the tiny vocab
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["h", "i"]
    assert content[0]["bytes"] == [ord("h")]


async def test_tokens_from_d_that_overtake_the_first_token_are_held_back(cluster):
    master, prefill, decode = cluster
    call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "q", "stream": True}))
    job = await prefill.next_job()
    await decode.send(protocol.TokenDelta(request_id=job.request_id, token_ids=[7], text="B"))
    await decode.send(protocol.TokenDelta(request_id=job.request_id, token_ids=[8], text="C", finish_reason="stop"))
    await asyncio.sleep(0.05)
    await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=6, text="A"))
    chunks = _sse_payloads((await call).text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ABC"


async def test_client_disconnect_aborts_the_request_on_both_nodes(cluster):
    master, prefill, decode = cluster
    async with master.http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        job = await prefill.next_job()
        await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=10, text="x"))
        lines = response.aiter_lines()
        while "x" not in (await asyncio.wait_for(lines.__anext__(), 5.0)):
            pass
    await wait_until(lambda: job.request_id in prefill.aborts and job.request_id in decode.aborts, what="aborts")
    await wait_until(lambda: not master.ctx.relay.requests, what="request released")
    metrics = (await master.http.get("/metrics")).text
    assert 'pdc_requests_total{status="aborted"} 1.0' in metrics


async def test_official_openai_client_works_unchanged(cluster):
    master, prefill, decode = cluster
    client = openai.AsyncOpenAI(base_url=f"{master.base_url}/v1", api_key="unused", max_retries=0)
    answer = asyncio.create_task(serve_one(prefill, decode, [(10, "o"), (11, "k")]))
    stream = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"], stream=True, max_tokens=2)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    await answer
    assert text == "ok"
    answer = asyncio.create_task(serve_one(prefill, decode, [(10, "o")]))
    completion = await client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    await answer
    assert completion.choices[0].text == "o" and completion.usage.total_tokens == 3
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="hi")
    await client.close()


async def test_the_clients_x_request_id_is_echoed_logged_and_sent_to_the_node(cluster):
    master, prefill, decode = cluster
    client = openai.AsyncOpenAI(base_url=f"{master.base_url}/v1", api_key="unused", max_retries=0)
    answer = asyncio.create_task(serve_one(prefill, decode, [(10, "o"), (11, "k")]))
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT_MESSAGES, max_tokens=2, extra_headers={"X-Request-Id": "proxy-7f3a:1"})
    job = await answer
    assert raw.headers["x-request-id"] == "proxy-7f3a:1" and job.client_request_id == "proxy-7f3a:1"
    reply = raw.parse()
    assert reply.id == job.request_id  # the body keeps the master's id
    recent = master.ctx.request_log.recent
    record = await wait_until(lambda: next((r for r in recent if r.request_id == reply.id), None),
                              what="the request's log record")
    assert record.client_request_id == "proxy-7f3a:1"

    answer = asyncio.create_task(serve_one(prefill, decode, [(10, "o"), (11, "k")]))
    async with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=CHAT_MESSAGES, max_tokens=2, stream=True,
        extra_headers={"X-Request-Id": "stream-42"}) as response:
        assert response.headers["x-request-id"] == "stream-42"
        text = "".join([c.choices[0].delta.content or "" async for c in await response.parse() if c.choices])
    assert text == "ok" and (await answer).client_request_id == "stream-42"

    # Without one: the master's own id, in the header and the job; none travels as the client's.
    answer = asyncio.create_task(serve_one(prefill, decode, [(10, "o")]))
    raw = await client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=1)
    job = await answer
    assert raw.headers["x-request-id"] == raw.parse().id == job.request_id
    assert job.client_request_id is None

    # One that would garble a log line or a header is refused, saying what may be sent.
    for bad in ("two words", "x" * 129, 'quote"d', "tab\tbed"):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                            extra_headers={"X-Request-Id": bad})
        assert refused.value.code == "invalid_request_id" and "X-Request-Id must be" in refused.value.message
    await client.close()


async def test_first_token_via_decode_holds_p_token_until_d_speaks(tmp_path: Path):
    """The measured alternative output path: the client's first chunk waits for D's tokens."""
    async with LiveMaster(make_settings(write_model_dir(tmp_path), first_token_via="decode")) as master:
        prefill = FakeNode(master, "p0", "prefill")
        decode = FakeNode(master, "d0", "decode")
        await prefill.join()
        await decode.join()
        await wait_warm(master)
        body = {"model": MODEL, "prompt": "q", "stream": True}
        async with master.http.stream("POST", "/v1/completions", json=body) as response:
            job = await prefill.next_job()
            await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=6, text="A"))
            lines = response.aiter_lines()
            r = master.ctx.relay.requests[job.request_id]
            await wait_until(lambda: r.current.withheld_first is not None, 5.0, "P's first token to be withheld")
            assert r.output_ids == []  # nothing reached the client yet
            await decode.send(protocol.TokenDelta(request_id=job.request_id, token_ids=[7], text="B"))
            first = ""
            async for line in lines:
                if line.startswith("data: "):
                    first = json.loads(line[len("data: "):])["choices"][0]["text"]
                    break
            await decode.send(protocol.TokenDelta(request_id=job.request_id, token_ids=[8], text="C", finish_reason="stop"))
            rest = [json.loads(line[6:]) for line in [x async for x in lines] if line.startswith("data: {")]
        assert first == "A"
        assert first + "".join(c["choices"][0]["text"] for c in rest) == "ABC"
        await prefill.close()
        await decode.close()
