"""/v1/completions with a list of prompts and with echo, and /v1/models as vLLM lists models:
the official openai client against a real cluster on CPU with the default model."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.cluster_harness import Cluster

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Water boils at"]
GREEDY = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def cluster(served_cluster) -> Cluster:
    return served_cluster


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def singles(client) -> list[str]:
    """Each prompt's greedy completion, asked alone."""
    return [client.completions.create(model=MODEL, prompt=p, **GREEDY).choices[0].text for p in PROMPTS]


def test_a_list_of_prompts_answers_each_in_order(client, singles, tokenizer, hf_reference):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPTS, **GREEDY)
    reply = raw.parse()
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == singles
    assert all(c.finish_reason == "length" for c in reply.choices)
    prompt_tokens = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS)
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.usage.completion_tokens == 3 * 6
    assert raw.headers["x-request-id"] == reply.id
    ids = tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    assert singles[1] == tokenizer.decode(hf_reference.greedy(ids, 6), skip_special_tokens=True)


def test_token_id_prompts_and_several_choices_per_prompt(client, singles, tokenizer):
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
    reply = client.completions.create(model=MODEL, prompt=ids, n=2, **GREEDY)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]  # prompt * n + choice
    assert [c.text for c in reply.choices] == [singles[0], singles[0], singles[1], singles[1]]


def test_a_list_of_prompts_streams_each_choice_by_index(client, singles):
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    ids = set()
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY):
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == singles
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert len(ids) == 1
    assert usage is not None and usage.completion_tokens == 18


def test_echo_puts_the_prompt_before_the_completion(client, singles):
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, **GREEDY)
    assert reply.choices[0].text == PROMPTS[0] + singles[0]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[:2], echo=True, stream=True, **GREEDY) if c.choices and c.choices[0].index == 1)
    assert streamed == PROMPTS[1] + singles[1]


def test_what_cannot_be_served_is_a_400(client, cluster):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # 0 only with echo: the prompt alone
        client.completions.create(model=MODEL, prompt=["Hi", "Yo"], max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=["Hi", "word " * 9000], max_tokens=2)
    response = httpx.post(cluster.url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": ["a"] * 65, "max_tokens": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert client.completions.create(model=MODEL, prompt="Still serving", max_tokens=2).choices[0].text


def test_models_are_listed_as_vllm_lists_them(client, cluster):
    [card] = client.models.list().data
    assert card.id == MODEL and card.object == "model" and card.owned_by == "pd-cluster"
    doc = httpx.get(cluster.url + "/v1/models/" + MODEL, timeout=10).json()
    assert doc["root"] == MODEL and doc["parent"] is None and doc["max_model_len"] > 0
    assert doc["created"] > 1_700_000_000
    [permission] = doc["permission"]
    assert permission["object"] == "model_permission" and permission["allow_sampling"] is True
    assert permission["id"].startswith("modelperm-")
