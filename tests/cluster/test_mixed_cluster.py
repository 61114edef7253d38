"""Mixed nodes (prefill and decode in one engine) with real processes on loopback and the official
client: a cluster of mixed nodes only serves, token-identical to transformers; then prefill and
decode nodes join it and the three roles serve together."""

from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest

from tests.cluster_harness import Cluster, wait_until
from tests.reference import CHAT_MESSAGES

MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    c = Cluster(default_model_dir, tmp_path_factory.mktemp("mixed-logs"), local_prefill_max_tokens=64)
    try:
        c.start_master()
        c.start_node("mixed", "m0")
        wait_until(lambda: c.health()[0] == 200, 60, "the mixed node to make the cluster ready")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(n: int = NEW_TOKENS) -> dict:
    return {"temperature": 0, "max_tokens": n, "extra_body": {"ignore_eos": True}}


def expected(tokenizer, hf_reference, prompt: list[int], n: int = NEW_TOKENS) -> str:
    return tokenizer.decode(hf_reference.greedy(prompt, n), skip_special_tokens=True)


def served_by(cluster: Cluster, node_id: str) -> int:
    return sum(1 for line in cluster.log("master").splitlines() if " request request_id=" in line
               and f" decode={node_id} " in line)


def test_a_cluster_of_mixed_nodes_only_serves_token_identical(cluster, client, chat_prompts, tokenizer,
                                                                 hf_reference):
    health = cluster.health()[1]
    assert (health["prefill_nodes"], health["decode_nodes"], health["mixed_nodes"]) == (0, 0, 1)
    assert [n["role"] for n in cluster.nodes()] == ["mixed"]
    for message, prompt in list(zip(CHAT_MESSAGES, chat_prompts))[:3]:
        want = expected(tokenizer, hf_reference, prompt)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": message}],
                                               **greedy())
        assert reply.choices[0].message.content == want
        assert reply.usage.prompt_tokens == len(prompt)
        stream = client.completions.create(model=MODEL, prompt=prompt, stream=True, **greedy())
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
    assert cluster.metric('pdc_route_decisions_total{path="local",reason="mixed"}') == 6
    assert cluster.metric("pdc_kv_transfer_bytes") == 0


def test_mixed_prefill_and_decode_nodes_serve_together(cluster, client, chat_prompts, tokenizer, hf_reference):
    # What the module's earlier tests sent counts apart: this test runs alone as well.
    m0_before, routed_before = served_by(cluster, "m0"), cluster.metric("pdc_route_decisions_total")
    cluster.start_node("prefill", "p0")
    cluster.start_node("decode", "d0", "--data-port", "0")
    wait_until(lambda: cluster.health()[1].get("warm_pairs") == 1, 60, "a warm pair")
    long_prompt = tokenizer.encode(" ".join(f"line {i} says {i * 5 % 9}." for i in range(40)))
    prompts = [long_prompt + tokenizer.encode(f" Question {i}?") for i in range(8)] + chat_prompts[:4]

    def run(prompt: list[int]) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, **greedy()).choices[0].text

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(run, prompts))
    assert texts == [expected(tokenizer, hf_reference, p) for p in prompts]
    # Concurrent requests filled both the mixed node and the P -> D pair.
    assert served_by(cluster, "m0") - m0_before >= 1 and served_by(cluster, "d0") >= 1
    assert cluster.metric("pdc_route_decisions_total") == routed_before + len(prompts)
