"""Clients of the OpenAI API: API keys (401 in OpenAI's shape), a per-key bound on running
generations and a bounded admission queue (429 with Retry-After), every answer counted by status."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import openai
import pytest

from master.app import ConfigError
from master.auth import ApiKeys
from master.server import create_app
from pd_cluster import protocol
from tests.master_fakes import (
    CHAT_MESSAGES,
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

CHAT = {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 2}


def _counts(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'pdc_requests_total\{status="(\w+)"\} (\S+)', text)}


async def _pair(master: LiveMaster) -> tuple[FakeNode, FakeNode]:
    prefill, decode = FakeNode(master, "p0", "prefill"), FakeNode(master, "d0", "decode")
    assert isinstance(await prefill.join(), protocol.Registered)
    assert isinstance(await decode.join(), protocol.Registered)
    await wait_warm(master)
    return prefill, decode


@pytest.fixture
async def keyed(tmp_path: Path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nsk-file-one 1\nsk-file-two\nsk-pair 2\n\n")
    settings = make_settings(write_model_dir(tmp_path), api_keys=["sk-flag"], api_keys_file=keys_file,
                             max_concurrent_per_key=3)
    async with LiveMaster(settings) as master:
        prefill, decode = await _pair(master)
        yield master, prefill, decode
        await prefill.close()
        await decode.close()


async def test_missing_or_wrong_api_key_is_401_in_openai_shape(keyed):
    master, _, _ = keyed
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic sk-flag"}):
        response = await master.http.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status_code == 401
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    assert (await master.http.get("/v1/models")).status_code == 401
    assert (await master.http.get("/health")).status_code == 200  # probes need no key
    assert _counts((await master.http.get("/metrics")).text)["unauthorized"] == 3.0  # generation requests
    client = openai.AsyncOpenAI(base_url=f"{master.base_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await client.models.list()
    await client.close()


async def test_keys_from_the_flag_and_the_file_are_accepted_by_the_openai_client(keyed):
    master, prefill, decode = keyed
    for key in ("sk-flag", "sk-file-one", "sk-file-two"):
        client = openai.AsyncOpenAI(base_url=f"{master.base_url}/v1", api_key=key, max_retries=0)
        answer = asyncio.create_task(serve_one(prefill, decode, [(10, "o"), (11, "k")]))
        reply = await client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=2)
        await answer
        assert reply.choices[0].message.content == "ok"
        assert [m.id for m in (await client.models.list()).data] == [MODEL]
        await client.close()


async def test_a_key_past_its_concurrency_limit_gets_429_with_retry_after(keyed):
    master, prefill, decode = keyed
    one = {"Authorization": "Bearer sk-file-one"}  # its own limit: 1 open request
    first = asyncio.create_task(master.http.post("/v1/chat/completions", json=CHAT, headers=one))
    job = await prefill.next_job()
    response = await master.http.post("/v1/chat/completions", json=CHAT, headers=one)
    assert response.status_code == 429 and response.headers["Retry-After"] == "1"
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    # Another key is not held back by it.
    other = asyncio.create_task(master.http.post("/v1/chat/completions", json=CHAT,
                                                 headers={"Authorization": "Bearer sk-flag"}))
    other_job = await prefill.next_job()
    await serve_one(prefill, decode, [(10, "o"), (11, "k")], job=job)
    await serve_one(prefill, decode, [(10, "o"), (11, "k")], job=other_job)
    assert (await first).status_code == 200 and (await other).status_code == 200
    # The place is given back when the request ends, streaming or not.
    keys = master.app.state.api_keys
    await wait_until(lambda: not keys.open_generations, what="open requests to be released")
    streamed = asyncio.create_task(master.http.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=one))
    await serve_one(prefill, decode, [(10, "o")])
    assert (await streamed).status_code == 200
    await wait_until(lambda: not keys.open_generations, what="the stream's place to be released")
    assert _counts((await master.http.get("/metrics")).text)["rate_limited"] == 1.0


async def _answer_every_job(prefill: FakeNode, decode: FakeNode) -> None:
    while True:
        try:
            await serve_one(prefill, decode, [(10, "o"), (11, "k")])
        except asyncio.TimeoutError:
            continue


async def test_a_key_limit_counts_generations_and_refuses_a_request_larger_than_it(keyed):
    master, prefill, decode = keyed
    client = openai.AsyncOpenAI(base_url=f"{master.base_url}/v1", api_key="sk-pair", max_retries=0, timeout=10)
    answering = asyncio.create_task(_answer_every_job(prefill, decode))
    try:
        # Larger than the key's whole limit (2 generations): it can never pass, so 400, saying so.
        with pytest.raises(openai.BadRequestError) as prompts:
            await client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=2)
        with pytest.raises(openai.BadRequestError) as choices:
            await client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=2, n=2,
                                                 extra_body={"best_of": 3})
        for refused in (prompts.value, choices.value):
            assert refused.code == "generations_over_key_limit"
            assert "3 generations" in refused.message and "(2)" in refused.message
        # Two prompts fit the limit exactly.
        both = await client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2)
        assert [c.text for c in both.choices] == ["ok", "ok"]
    finally:
        answering.cancel()
    # While n=2 runs, the key has nothing free: one more generation gets 429 with Retry-After.
    pair = asyncio.create_task(client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=2, n=2))
    job = await prefill.next_job()
    with pytest.raises(openai.RateLimitError) as limited:
        await client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=2)
    assert limited.value.code == "rate_limit_exceeded" and limited.value.response.headers["Retry-After"] == "1"
    assert "2 running, this request needs 1, the limit is 2" in limited.value.message
    await serve_one(prefill, decode, [(10, "o"), (11, "k")], job=job)
    await serve_one(prefill, decode, [(10, "o"), (11, "k")])  # choice 1, admitted once choice 0 answered
    assert [c.message.content for c in (await pair).choices] == ["ok", "ok"]
    keys = master.app.state.api_keys
    await wait_until(lambda: not keys.open_generations, what="the generations to be released")
    await client.close()


async def test_a_full_admission_queue_answers_429_with_retry_after(tmp_path: Path):
    settings = make_settings(write_model_dir(tmp_path), queue_size=1, queue_timeout_s=10.0)
    async with LiveMaster(settings) as master:
        prefill, decode = await _pair(master)
        decode.status = decode.status.model_copy(update={"free_kv_tokens": 0})  # no room: requests wait
        await wait_until(lambda: master.ctx.registry.nodes["d0"].status.free_kv_tokens == 0, what="a full D")
        waiting = asyncio.create_task(master.http.post("/v1/chat/completions", json=CHAT))
        await wait_until(lambda: len(master.ctx.relay.queue) == 1, what="one request in the queue")
        response = await master.http.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 429 and response.headers["Retry-After"] == "1"
        assert response.json()["error"]["code"] == "queue_full"
        decode.status = decode.status.model_copy(update={"free_kv_tokens": 4096})
        await serve_one(prefill, decode, [(10, "o"), (11, "k")])
        assert (await waiting).status_code == 200
        counts = _counts((await master.http.get("/metrics")).text)
        assert counts["rate_limited"] == 1.0 and counts["ok"] == 1.0
        await prefill.close()
        await decode.close()


def test_an_unreadable_keys_file_stops_the_master(tmp_path: Path):
    bad = tmp_path / "keys"
    bad.write_text("sk-a lots of words\n")
    with pytest.raises(ConfigError):
        create_app(make_settings(api_keys_file=bad), tokenizer=tiny_tokenizer())
    with pytest.raises(ConfigError):
        create_app(make_settings(api_keys_file=tmp_path / "missing"), tokenizer=tiny_tokenizer())


async def test_a_rejected_request_is_logged_by_its_key_name_never_the_key(keyed, caplog):
    master, _, _ = keyed
    client = openai.AsyncOpenAI(base_url=f"{master.base_url}/v1", api_key="sk-pair", max_retries=0)
    with caplog.at_level(logging.INFO, logger="master.requests"):
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=f"{master.base_url}/v1", api_key="sk-wrong", max_retries=0
                                     ).completions.create(model=MODEL, prompt="a", max_tokens=2)
    await client.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rejected ")]
    assert len(lines) == 2, lines
    name = ApiKeys.name_of("sk-pair")
    assert re.fullmatch(r"key-[0-9a-f]{8}", name)
    assert "status=400 reason=generations_over_key_limit" in lines[0] and f"key={name}" in lines[0]
    assert "status=401 reason=invalid_api_key" in lines[1] and "key=" not in lines[1]
    assert not any("sk-pair" in line or "sk-wrong" in line for line in caplog.messages)
    counts = (await master.http.get("/metrics")).text
    assert 'pdc_rejected_requests_total{reason="generations_over_key_limit",status="400"} 1.0' in counts
