"""Several choices (n, best_of), logit_bias and seeds at the master, served through fake P/D nodes:
validation in OpenAI's shape, each choice's seed, the order choices are dispatched in, the answer's
shape (streamed and not) and its usage."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from pd_cluster import protocol
from tests.master_fakes import (
    CHAT_MESSAGES,
    MODEL,
    FakeNode,
    LiveMaster,
    make_settings,
    serve_one,
    wait_until,
    wait_warm,
    write_model_dir,
)

CHAT = {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4}


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


def _error(response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    return error["message"]


def _sse_payloads(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": "2"}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 17}, "best_of"),
        ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
        ({"use_beam_search": True, "n": 2, "stream": True}, "stream"),
        ({"use_beam_search": True, "best_of": 2, "stream": True}, "best_of"),
        ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
        ({"use_beam_search": True, "n": 2, "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"use_beam_search": True, "length_penalty": 11.0}, "length_penalty"),
        ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "seed": 3}, "seed"),
        ({"use_beam_search": True, "stop": ["x"]}, "stop"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"5": -101}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"100": 1}}, "logit_bias"),  # past the tiny tokenizer's vocabulary
        ({"logit_bias": {"5": "1"}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ],
)
async def test_bad_choice_counts_and_logit_biases_are_400_naming_the_field(cluster, body, param):
    master, prefill, _ = cluster
    for route, base in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": MODEL, "prompt": "hi"})):
        _error(await master.http.post(route, json={**base, **body}), param)
    assert prefill.jobs.empty()


async def test_logit_bias_and_a_master_chosen_seed_reach_the_prefill_job(cluster):
    master, prefill, decode = cluster
    call = asyncio.create_task(master.http.post("/v1/completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": {"7": 3.5, "50": -100},
    }))
    job = await serve_one(prefill, decode, [(7, "d"), (7, "d")])
    assert job.sampling.logit_bias == {7: 3.5, 50: -100.0}
    # An unseeded request gets its seed at the master: a retry elsewhere draws the same stream.
    assert job.sampling.seed is not None and 0 <= job.sampling.seed < 2**63
    assert (await call).json()["choices"][0]["text"] == "dd"


async def test_a_beam_search_is_one_job_answered_with_its_beams_ranked(cluster):
    master, prefill, decode = cluster
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "n": 2, "best_of": 3, "use_beam_search": True,
            "length_penalty": 0.5, "early_stopping": True, "logprobs": 1}
    call = asyncio.create_task(master.http.post("/v1/completions", json=body))
    job = await prefill.next_job()
    sampling = job.sampling
    assert (sampling.use_beam_search, sampling.beam_width, sampling.beam_outputs) == (True, 3, 2)
    assert (sampling.length_penalty, sampling.early_stopping, sampling.temperature) == (0.5, True, 0.0)
    assert sampling.seed is None and sampling.logprobs == 1
    # P's token ends only its prefill; D answers with the beams, best first, in one delta.
    await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=10, text="h"))
    entry = protocol.TokenLogprob(token_id=11, logprob=-0.5, top={11: -0.5})
    beams = [protocol.BeamOutput(token_ids=[11], text="i", cum_logprob=-0.5, score=-0.5, finish_reason="stop",
                                 logprobs=[entry]),
             protocol.BeamOutput(token_ids=[12, 13, 14], text="abc", cum_logprob=-1.2, score=-0.69,
                                 finish_reason="length", logprobs=[entry] * 3)]
    await decode.send(protocol.TokenDelta(request_id=job.request_id, token_ids=[11], text="i", finish_reason="stop",
                                          beams=beams))
    await asyncio.sleep(0.1)
    assert prefill.jobs.empty()  # one job, however wide the search
    doc = (await call).json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in doc["choices"]] == [(0, "i", "stop"),
                                                                                    (1, "abc", "length")]
    assert [len(c["logprobs"]["token_logprobs"]) for c in doc["choices"]] == [1, 3]
    assert doc["usage"]["completion_tokens"] == 4  # every returned beam's tokens


async def test_choices_get_consecutive_seeds_and_follow_choice_zero_to_its_decode_node(cluster):
    master, prefill, decode = cluster
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 3, "seed": 2**63 - 2}
    call = asyncio.create_task(master.http.post("/v1/completions", json=body))
    first = await prefill.next_job()
    assert first.sampling.seed == 2**63 - 2
    # Nothing else is dispatched until choice 0 streams from its D (its prompt is cached there).
    await prefill.send(protocol.FirstToken(request_id=first.request_id, token_id=10, text="h"))
    await asyncio.sleep(0.1)
    assert prefill.jobs.empty()
    await decode.send(protocol.TokenDelta(request_id=first.request_id, token_ids=[11], text="i", finish_reason="length"))
    followers = [await prefill.next_job(), await prefill.next_job()]
    assert [j.sampling.seed for j in followers] == [2**63 - 1, 0]  # (seed + i) mod 2**63
    assert all(j.decode_node_id == "d0" and j.token_ids == first.token_ids for j in followers)
    for job, text in zip(followers, ("ab", "cd")):
        await serve_one(prefill, decode, [(12, text[0]), (13, text[1])], job=job, finish_reason="length")
    doc = (await call).json()
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
    assert [c["text"] for c in doc["choices"]] == ["hi", "ab", "cd"]
    assert doc["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    await wait_until(lambda: not master.ctx.relay.requests, what="every choice released")
    metrics = (await master.http.get("/metrics")).text
    assert 'pdc_requests_total{status="ok"} 1.0' in metrics  # one request, however many choices
    assert "pdc_prompt_tokens_total 2.0" in metrics
    assert "pdc_generation_tokens_total 6.0" in metrics


async def test_streamed_choices_interleave_by_index(cluster):
    master, prefill, decode = cluster
    body = {**CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    call = asyncio.create_task(master.http.post("/v1/chat/completions", json=body))
    relays = master.ctx.relay.requests

    async def send(node: FakeNode, message, tokens_then: int) -> None:
        # P and D reach the master on separate sockets: let each token land before the next.
        await node.send(message)
        await wait_until(lambda: len(relays[message.request_id].output_ids) == tokens_then, what="the token")

    first = await prefill.next_job()
    await send(prefill, protocol.FirstToken(request_id=first.request_id, token_id=10, text="A"), 1)
    await send(decode, protocol.TokenDelta(request_id=first.request_id, token_ids=[11], text="B"), 2)
    second = await prefill.next_job()
    await send(prefill, protocol.FirstToken(request_id=second.request_id, token_id=12, text="x"), 1)
    await send(decode, protocol.TokenDelta(request_id=first.request_id, token_ids=[13], text="C"), 3)
    await decode.send(protocol.TokenDelta(request_id=second.request_id, token_ids=[14], text="y", finish_reason="stop"))
    await decode.send(protocol.TokenDelta(request_id=first.request_id, token_ids=[], text="", finish_reason="stop"))
    chunks = _sse_payloads((await call).text)
    assert len({c["id"] for c in chunks}) == 1
    choices = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks if c["choices"]]
    assert choices[:2] == [(0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""})]
    texts = {i: "".join(d.get("content", "") for j, d in choices if j == i) for i in (0, 1)}
    assert texts == {0: "ABC", 1: "xy"}
    order = [i for i, d in choices[2:] if d.get("content")]
    assert order == [0, 0, 1, 0, 1]  # as the tokens arrived
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finishes == {0: "stop", 1: "stop"}
    assert chunks[-1]["usage"]["prompt_tokens"] == len(first.token_ids)
    assert chunks[-1]["usage"]["completion_tokens"] == 5


async def test_best_of_returns_the_choices_with_the_best_mean_logprob(cluster):
    master, prefill, decode = cluster
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 3, "seed": 5}
    call = asyncio.create_task(master.http.post("/v1/completions", json=body))
    means = {}
    for index, mean in enumerate((-2.0, -0.5, -1.0)):
        job = await prefill.next_job()
        assert job.sampling.seed == 5 + index and job.sampling.logprobs == 0  # asked for, to rank
        means[job.request_id] = mean
        lp = protocol.TokenLogprob(token_id=10 + index, logprob=mean, top={})
        await prefill.send(protocol.FirstToken(request_id=job.request_id, token_id=10 + index, text=str(index),
                                               logprob=lp))
        await decode.send(protocol.TokenDelta(request_id=job.request_id, token_ids=[10 + index], text=str(index),
                                              logprobs=[lp], finish_reason="length"))
    doc = (await call).json()
    assert [c["text"] for c in doc["choices"]] == ["11", "22"]  # choices 1 and 2, best first
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in doc["choices"])  # the client did not ask for them
    assert doc["usage"]["completion_tokens"] == 6  # every generated choice counts


async def test_a_failed_first_choice_fails_the_request_and_dispatches_nothing_more(cluster):
    master, prefill, decode = cluster
    call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 2}))
    job = await prefill.next_job()
    await prefill.send(protocol.RequestFailed(request_id=job.request_id, message="boom", retryable=False))
    response = await call
    assert response.status_code >= 500 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    await wait_until(lambda: not master.ctx.relay.requests, what="every choice released")
    assert prefill.jobs.empty()


async def test_a_migrated_stream_keeps_its_seed_and_counts_its_carried_output(tmp_path: Path):
    """D lost mid-stream: the re-run's prompt carries the 3 tokens the client has, and its
    sampling says so (output_offset), so the seed's stream goes on at position 3."""
    async with LiveMaster(make_settings(write_model_dir(tmp_path), handoff_timeout_s=1.0)) as master:
        p0, d0, d1 = FakeNode(master, "p0", "prefill"), FakeNode(master, "d0", "decode"), FakeNode(master, "d1", "decode")
        for node in (p0, d0, d1):
            assert isinstance(await node.join(), protocol.Registered)
        await wait_warm(master, 2)
        body = {"model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 6, "seed": 41, "temperature": 0.7}
        call = asyncio.create_task(master.http.post("/v1/completions", json=body))
        job = await p0.next_job()
        decode, other = (d0, d1) if job.decode_node_id == "d0" else (d1, d0)
        await p0.send(protocol.FirstToken(request_id=job.request_id, token_id=20, text="A"))
        await decode.send(protocol.TokenDelta(request_id=job.request_id, token_ids=[21, 22], text="BC"))
        await wait_until(lambda: len(master.ctx.relay.requests[job.request_id].output_ids) == 3, what="3 tokens")
        await decode.close()
        moved = await p0.next_job()
        assert moved.token_ids == job.token_ids + [20, 21, 22]
        assert moved.sampling.seed == 41 and moved.sampling.output_offset == 3 and moved.sampling.max_tokens == 3
        await p0.send(protocol.FirstToken(request_id=moved.request_id, token_id=23, text="D"))
        await other.send(protocol.TokenDelta(request_id=moved.request_id, token_ids=[24, 25], text="EF",
                                             finish_reason="length"))
        assert (await call).status_code == 200
        await p0.close()
        await other.close()


# ---- a list of prompts: one relay request per prompt x choice ----------------------------------


async def _serve_prompt_list(prefill: FakeNode, decode: FakeNode, jobs: int, prompt_names: str = "ab") -> None:
    """Answer ``jobs`` jobs: each choice's text names its prompt (by its first job's prompt) and
    its choice (by its seed's offset from choice 0's)."""
    prompts: list[list[int]] = []
    seeds: dict[int, int] = {}
    for _ in range(jobs):
        job = await prefill.next_job()
        if job.token_ids not in prompts:
            prompts.append(job.token_ids)
            seeds[len(prompts) - 1] = job.sampling.seed
        p = prompts.index(job.token_ids)
        text = prompt_names[p] + str(job.sampling.seed - seeds[p])
        await serve_one(prefill, decode, [(10, text[0]), (11, text[1])], job=job, finish_reason="length")


async def test_a_list_of_prompts_answers_each_prompt_and_choice_by_index(cluster):
    master, prefill, decode = cluster
    body = {"model": MODEL, "prompt": ["hi", "yo"], "max_tokens": 2, "n": 2, "seed": 7, "echo": True}
    call = asyncio.create_task(master.http.post("/v1/completions", json=body))
    await _serve_prompt_list(prefill, decode, 4)
    response = await call
    doc = response.json()
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2, 3]  # prompt * n + choice
    assert [c["text"] for c in doc["choices"]] == ["hia0", "hia1", "yob0", "yob1"]  # echo first
    assert doc["usage"]["completion_tokens"] == 8 and doc["usage"]["prompt_tokens"] == 4
    assert response.headers["x-request-id"] == doc["id"]
    await wait_until(lambda: not master.ctx.relay.requests, what="every request released")
    metrics = (await master.http.get("/metrics")).text
    assert 'pdc_requests_total{status="ok"} 2.0' in metrics  # a request per prompt


async def test_a_streamed_list_of_prompts_interleaves_every_choice_under_one_id(cluster):
    master, prefill, decode = cluster
    body = {"model": MODEL, "prompt": ["hi", "yo"], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    call = asyncio.create_task(master.http.post("/v1/completions", json=body))
    await _serve_prompt_list(prefill, decode, 2)
    chunks = _sse_payloads((await call).text)
    assert len({c["id"] for c in chunks}) == 1
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert texts == {0: "a0", 1: "b0"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_a_failed_prompt_of_a_list_is_the_answer_and_releases_every_request(cluster):
    master, prefill, decode = cluster
    call = asyncio.create_task(master.http.post("/v1/completions", json={"model": MODEL, "prompt": ["hi", "yo"]}))
    first, second = await prefill.next_job(), await prefill.next_job()
    await prefill.send(protocol.RequestFailed(request_id=second.request_id, message="boom", retryable=False))
    await serve_one(prefill, decode, [(10, "a"), (11, "b")], job=first)
    response = await call
    assert response.status_code == 500 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    await wait_until(lambda: not master.ctx.relay.requests, what="every request released")
