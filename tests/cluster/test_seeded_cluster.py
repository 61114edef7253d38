"""Seeded sampling and several choices through the whole cluster (master + P + two D's as real
processes, the official openai client), checked against the offline engine with the same seeds."""

from __future__ import annotations

import httpx
import openai
import pytest

from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams
from tests.cluster_harness import Cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "frequency_penalty": 0.3}


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    c = Cluster(default_model_dir, tmp_path_factory.mktemp("seeded-cluster-logs"))
    try:
        c.start_master()
        c.start_node("prefill", "p0")
        c.start_node("decode", "d0", "--data-port", "0")
        c.start_node("decode", "d1", "--data-port", "0")
        wait_until(lambda: httpx.get(c.url + "/health", timeout=5).status_code == 200, 60, "health")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def offline(default_model_dir) -> LLM:
    return LLM(model=str(default_model_dir), device="cpu", dtype="float32", max_total_tokens=4096)


def offline_text(llm: LLM, prompt: list[int], seed: int, max_tokens: int) -> str:
    params = SamplingParams(seed=seed, max_tokens=max_tokens, ignore_eos=True, **SAMPLING)
    return llm.generate([prompt], params)[0].text


def test_n4_returns_each_choice_as_n1_with_seed_plus_index(client, chat_prompts, offline):
    prompt, seed, max_tokens = chat_prompts[2], 2024, 12
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "seed": seed, **SAMPLING,
            "extra_body": {"ignore_eos": True}}
    reply = client.completions.create(n=4, **body)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    texts = [c.text for c in reply.choices]
    assert len(set(texts)) == 4, texts
    assert reply.usage.prompt_tokens == len(prompt)  # the prompt counts once
    assert reply.usage.completion_tokens == 4 * max_tokens
    for i, text in enumerate(texts):
        alone = client.completions.create(**{**body, "seed": seed + i})
        assert alone.choices[0].text == text
        # The same stream as the offline engine: P samples the first token, D the rest.
        assert offline_text(offline, prompt, seed + i, max_tokens) == text


def test_streamed_chat_choices_carry_their_index_and_match_the_whole_answer(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8,
            "seed": 7, "n": 3, **SAMPLING, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**body)
    streamed = {0: "", 1: "", 2: ""}
    finishes = {}
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert streamed == {c.index: c.message.content for c in whole.choices}
    assert finishes == {0: "length", 1: "length", 2: "length"}


def test_logit_bias_forces_a_token_through_the_cluster(client, tokenizer):
    token = tokenizer.encode(" blue", add_special_tokens=False)[0]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=5, temperature=0.7,
        logit_bias={str(token): 100}, seed=3, extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].message.content == " blue" * 5
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       logit_bias={str(len(tokenizer) + 5): 1})
    assert bad.value.body["param"] == "logit_bias"


def test_a_restart_on_another_decode_node_draws_the_same_stream(cluster, client, chat_prompts, offline):
    """Kill the D that decodes a seeded request: the master restarts it on the other pair,
    which draws the same tokens from the seed alone."""
    prompt, seed, max_tokens = chat_prompts[3], 99, 64
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "seed": seed, **SAMPLING,
            "extra_body": {"ignore_eos": True}}
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(1) as pool:
        future = pool.submit(client.completions.create, **body)
        busy = wait_until(lambda: next((n["id"] for n in cluster.nodes()
                                        if n["role"] == "decode" and n["load"]["running"]
                                        and n["load"]["routed_in_flight"]), None),
                          120, "a decode node to run the request")
        cluster.kill(busy)
        reply = future.result(timeout=300)
    assert reply.choices[0].text == offline_text(offline, prompt, seed, max_tokens)
    wait_until(lambda: f"request_id={reply.id} outcome=ok" in cluster.log("master"), 30, "the request's log line")
    line = next(l for l in cluster.log("master").splitlines() if f"request_id={reply.id} outcome=ok" in l)
    assert "attempts=2" in line, line
