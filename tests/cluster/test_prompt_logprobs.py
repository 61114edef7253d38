"""Prompt logprobs through the master, with the official client and the default model: equal to
transformers' log-softmax (float32, within 1e-4) served cold and over a cached prefix, prefilled
on a prefill node (P -> D) and where it decodes (a mixed node); OpenAI's legacy ``echo`` shape,
``max_tokens: 0``, vLLM's ``prompt_logprobs`` on both APIs; and a multiple-choice task scored by
the very requests lm-eval's ``local-completions`` makes gives transformers' per-choice
loglikelihoods."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.cluster_harness import Cluster, wait_until
from tests.reference import CHAT_MESSAGES, GreedyReference, prompt_logprobs

MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-4
TASK = Path(__file__).parent / "data" / "tiny_choice.jsonl"


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    return GreedyReference(default_model_dir).model


@pytest.fixture(scope="module")
def mixed(default_model_dir, tmp_path_factory):
    """A master and one mixed node: every prompt prefilled where it decodes."""
    c = Cluster(default_model_dir, tmp_path_factory.mktemp("prompt-logprobs-mixed"), local_prefill_max_tokens=4096)
    try:
        c.start_master()
        c.start_node("mixed", "m0")
        wait_until(lambda: c.health()[0] == 200, 60, "the mixed node")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module", params=["pd", "local"])
def cluster(request, served_cluster, mixed) -> Cluster:
    return served_cluster if request.param == "pd" else mixed


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    worst = max((abs(a - b) for a, b in zip(got, want)), default=0.0)
    assert worst < TOLERANCE, worst


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_echo_logprobs_equal_transformers_cold_then_over_a_cached_prefix(cluster, client, tokenizer, hf_model):
    prompt = encode(tokenizer, f"{cluster.port} " + CHAT_MESSAGES[6])[:120]  # a prompt no earlier test cached
    want, _, _ = prompt_logprobs(hf_model, prompt)
    cold = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    choice = cold.choices[0]
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.token_logprobs) == len(prompt) + 1  # the prompt's, then the generated token's
    assert_close(lp.token_logprobs[1:-1], want)
    assert lp.tokens[:len(prompt)] == [tokenizer.decode([t]) for t in prompt]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert choice.text.startswith(tokenizer.decode(prompt)) and cold.usage.completion_tokens == 1
    # The top alternative at each position: the best of the vocabulary, so never below the token's own.
    assert all(max(top.values()) >= chosen - 1e-6 for top, chosen in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))

    # Served again, the prompt's blocks are cached on the nodes now: a longer prompt over that prefix
    # is scored whole, its cached part recomputed.
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0
    longer = prompt + encode(tokenizer, " And then some more words follow here.")
    warm = client.completions.create(model=MODEL, prompt=longer, echo=True, logprobs=0, max_tokens=0)
    assert warm.usage.completion_tokens == 0 and warm.choices[0].finish_reason == "length"
    assert warm.choices[0].text == tokenizer.decode(longer)  # max_tokens 0: the prompt alone
    assert_close(warm.choices[0].logprobs.token_logprobs[1:], prompt_logprobs(hf_model, longer)[0])


def test_streamed_echo_with_logprobs_starts_with_the_prompts(client, tokenizer, hf_model):
    prompt = encode(tokenizer, "The capital of France is Paris, and the capital of Italy is")
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=3,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith(tokenizer.decode(prompt))
    assert first.logprobs.token_logprobs[0] is None
    assert_close(first.logprobs.token_logprobs[1:len(prompt)], prompt_logprobs(hf_model, prompt)[0])
    entries = sum((c.choices[0].logprobs.token_logprobs for c in chunks if c.choices), [])
    assert len(entries) == len(prompt) + 3


def test_vllm_prompt_logprobs_on_both_apis(client, tokenizer, hf_model):
    prompt = encode(tokenizer, "One, two, three, four, five")
    want, ids, tops = prompt_logprobs(hf_model, prompt, top=2)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 2})
    entries = reply.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    assert_close([entries[i + 1][str(t)]["logprob"] for i, t in enumerate(prompt[1:])], want)
    for entry, best in zip(entries[1:], ids):
        assert {str(t) for t in best} <= set(entry)
        assert [entry[str(t)]["rank"] for t in best] == [1, 2]
    assert reply.choices[0].logprobs is None  # not asked for

    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    chat_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    entries = chat.model_extra["prompt_logprobs"]
    got = [entries[i + 1][str(t)]["logprob"] for i, t in enumerate(chat_prompt[1:])]
    assert_close(got, prompt_logprobs(hf_model, chat_prompt)[0])


def test_max_tokens_zero_needs_echo(cluster):
    response = httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0},
                          timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_a_multiple_choice_task_scored_like_lm_eval_gives_transformers_loglikelihoods(client, tokenizer, hf_model):
    """lm-eval's local-completions scores a choice with one prompt of context + continuation token
    ids, ``echo``, ``logprobs: 1``, ``max_tokens: 1``, several prompts a request, and sums the
    continuation's ``token_logprobs[ctxlen:-1]``."""
    docs = [json.loads(line) for line in TASK.read_text().splitlines() if line.strip()]
    requests = []  # (context ids, continuation ids)
    for doc in docs:
        context = encode(tokenizer, f"Question: {doc['question']}\nAnswer:")
        requests += [(context, encode(tokenizer, f" {c}")) for c in doc["choices"]]
    reply = client.completions.create(
        model=MODEL, prompt=[ctx + cont for ctx, cont in requests], temperature=0, max_tokens=1, logprobs=1,
        seed=1234, echo=True,
    )
    choices = sorted(reply.choices, key=lambda c: c.index)
    assert len(choices) == len(requests)
    start = 0
    for doc in docs:
        for j in range(len(doc["choices"])):
            (ctx, cont), c = requests[start + j], choices[start + j]
            served = c.logprobs.token_logprobs[len(ctx):-1]
            want = prompt_logprobs(hf_model, ctx + cont)[0][len(ctx) - 1:]
            assert_close(served, want)
        start += len(doc["choices"])
