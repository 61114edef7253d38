"""The whole cluster on loopback: master + nodes as real processes, the official openai client."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import openai
import pytest

from tests.cluster_harness import ADMIN_TOKEN, Cluster, wait_until
from tests.reference import CHAT_MESSAGES

MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    c = Cluster(default_model_dir, tmp_path_factory.mktemp("cluster-logs"))
    try:
        c.start_master()
        c.start_node("prefill", "p0")
        c.start_node("decode", "d0", "--data-port", "0")
        wait_until(lambda: httpx.get(c.url + "/health", timeout=5).status_code == 200, 30, "health")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_body() -> dict:
    return {"temperature": 0, "max_tokens": NEW_TOKENS, "extra_body": {"ignore_eos": True}}


def expected_text(tokenizer, hf_reference, prompt_ids: list[int]) -> str:
    return tokenizer.decode(hf_reference.greedy(prompt_ids, NEW_TOKENS), skip_special_tokens=True)


def test_openai_chat_and_completions_match_the_engine(client, chat_prompts, tokenizer, hf_reference):
    for message, prompt_ids in list(zip(CHAT_MESSAGES, chat_prompts))[:3]:
        want = expected_text(tokenizer, hf_reference, prompt_ids)
        messages = [{"role": "user", "content": message}]

        reply = client.chat.completions.create(model=MODEL, messages=messages, **greedy_body())
        assert reply.choices[0].message.content == want
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.prompt_tokens == len(prompt_ids)
        assert reply.usage.completion_tokens == NEW_TOKENS

        stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True, **greedy_body())
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

        completion = client.completions.create(model=MODEL, prompt=prompt_ids, **greedy_body())
        assert completion.choices[0].text == want
        streamed = client.completions.create(model=MODEL, prompt=prompt_ids, stream=True, **greedy_body())
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(cluster, client):
    url = cluster.url + "/v1/chat/completions"
    cases = [
        (b"{not json", 400),
        (json.dumps({"model": MODEL}).encode(), 400),  # no messages
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(), 400),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}).encode(), 400),
        (json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404),
    ]
    for body, status in cases:
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.choices[0].message.content is not None


def test_admin_api_needs_the_admin_token(cluster):
    assert httpx.get(cluster.url + "/admin/nodes", timeout=5).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.get(cluster.url + "/admin/nodes", headers=wrong, timeout=5).status_code == 401
    assert httpx.post(cluster.url + "/admin/nodes/d0/drain", headers=wrong, timeout=5).status_code == 401
    ok = httpx.get(cluster.url + "/admin/nodes", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5)
    assert {n["id"] for n in ok.json()["data"]} >= {"p0", "d0"}


def test_wrong_token_and_mismatched_model_are_refused(cluster, tmp_path, default_model_dir):
    intruder = cluster.start_node("decode", "intruder", token="not-the-token", wait=False)
    assert intruder.wait(120) == 2
    assert cluster.node("intruder") is None

    tiny = make_tiny_model(tmp_path / "tiny-llama", default_model_dir)
    other = cluster.start_node("prefill", "other-model", model=tiny, wait=False)
    assert other.wait(120) == 2
    assert "model" in cluster.log("other-model").lower()
    assert cluster.node("other-model") is None


def make_tiny_model(path, default_model_dir):
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, path / name)
    return path


def test_four_turn_chat_moves_less_kv_and_stays_on_the_d_with_the_history(cluster, client):
    cluster.start_node("decode", "d1", "--data-port", "0")
    messages = [{"role": "user", "content": "Let's plan a trip to the mountains. Where should we start?"}]
    spec = cluster.node("d0")["kv_spec"]
    per_token = 2 * spec["num_layers"] * spec["num_kv_heads"] * spec["head_dim"] * 4
    hits_before = {n["id"]: n["prefix"]["hit_tokens"] for n in cluster.nodes() if n["role"] == "decode"}
    holder = None
    for turn in range(4):
        moved_before = cluster.metric("pdc_kv_transfer_bytes_total")
        reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
        moved = cluster.metric("pdc_kv_transfer_bytes_total") - moved_before
        full = reply.usage.prompt_tokens * per_token
        if turn == 0:
            assert 0 < moved <= full  # the system prompt may already be cached from earlier requests
        else:
            assert 0 < moved < full / 2, (turn, moved, full)
            assert reply.usage.prompt_tokens_details.cached_tokens > 0
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": ["And then?", "What should we pack?", "How long?"][turn % 3]}]
        # The D that served turn 1 gains the prefix hits of turns 2..4: cache-aware routing kept them there.
        decode_hits = wait_until(lambda: _hits_if_reported(cluster, hits_before, turn), 10, "status reports")
        if turn:
            gained = [node for node, gain in decode_hits.items() if gain > 0]
            assert len(gained) == 1
            holder = holder or gained[0]
            assert gained[0] == holder
    assert cluster.metric("pdc_kv_transfer_seconds_count") >= 4


def test_client_disconnect_aborts_the_request_on_the_nodes(cluster):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to one thousand."}],
            "max_tokens": 2000, "stream": True, "extra_body": None}
    body.pop("extra_body")
    body["ignore_eos"] = True
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert any(line.startswith("data: ") for line in lines)  # streaming has started
    # The connection is closed: the decode nodes drop the request and their running count returns to 0.
    wait_until(lambda: all(n["load"]["running"] == 0 for n in cluster.nodes() if n["role"] == "decode"),
               30, "the aborted request to leave the decode batch")


def _hits_if_reported(cluster, before, turn):
    now = {n["id"]: n["prefix"]["hit_tokens"] for n in cluster.nodes() if n["role"] == "decode"}
    gains = {k: v - before.get(k, 0) for k, v in now.items()}
    if turn == 0 or any(g > 0 for g in gains.values()):
        return gains
    return None


def test_nodes_join_and_leave_under_load_without_failures(cluster, client, chat_prompts):
    """A new D joins and gets traffic; draining the old D and killing a busy P fail nothing."""
    if cluster.node("d1") is None:
        cluster.start_node("decode", "d1", "--data-port", "0")
    cluster.start_node("prefill", "p1")

    def ask(i: int) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": CHAT_MESSAGES[i % len(CHAT_MESSAGES)] + f" (#{i})"}],
            temperature=0, max_tokens=12,
        )
        return reply.choices[0].finish_reason

    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, i) for i in range(8)]
        wait_until(lambda: any(n["load"]["running"] or n["load"]["routed_in_flight"] for n in cluster.nodes()
                               if n["role"] == "decode"), 60, "requests in flight")
        assert cluster.admin("POST", "/admin/nodes/d0/drain").status_code in (200, 202)
        futures += [pool.submit(ask, i) for i in range(8, 16)]
        # Kill a prefill node while it is busy: its requests are retried on the other one.
        busy = wait_until(lambda: next((n["id"] for n in cluster.nodes() if n["role"] == "prefill"
                                        and (n["load"]["queued_prefill_tokens"] or n["load"]["routed_in_flight"])), None),
                          60, "a busy prefill node")
        cluster.kill(busy)
        futures += [pool.submit(ask, i) for i in range(16, 20)]
        results = [f.result(timeout=300) for f in futures]
    assert all(r in ("stop", "length") for r in results), results
    wait_until(lambda: cluster.node("d0") is None, 60, "the drained D to leave")
    assert cluster.procs["d0"].wait(60) == 0
    d1 = cluster.node("d1")
    assert d1["prefix"]["prompt_tokens"] > 0  # the new D served traffic
    assert cluster.metric('pdc_requests_total{status="error"}') == 0
