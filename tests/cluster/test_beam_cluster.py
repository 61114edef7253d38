"""Beam search through the master with the official client: on a P -> D cluster (P prefills the
prompt once and hands its KV over; D runs the search) and on a mixed node, the beams and their
scores equal transformers' ``generate(num_beams=4)``, in order; every KV slot goes back; a
streamed search of several beams is a 400 and the server keeps serving."""

from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest

from tests.beam_reference import BEAM_MESSAGES
from tests.cluster_harness import Cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"
WIDTH = 4
NEW_TOKENS = 12
#: Prompts each cluster answers (the offline test covers all sixteen).
PROMPTS = 8


@pytest.fixture(scope="module", params=["p-d", "mixed"])
def cluster(request, default_model_dir, tmp_path_factory):
    mixed = request.param == "mixed"
    c = Cluster(default_model_dir, tmp_path_factory.mktemp(f"beam-{request.param}-logs"),
                local_prefill_max_tokens=64 if mixed else 0)
    try:
        c.start_master()
        if mixed:
            c.start_node("mixed", "m0")
        else:
            c.start_node("prefill", "p0")
            c.start_node("decode", "d0", "--data-port", "0")
        wait_until(lambda: c.health()[0] == 200, 90, "the cluster to be ready")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _kv_idle(cluster: Cluster) -> bool:
    for n in cluster.nodes():
        kv, load = n["kv"], n["load"]
        if load["running"] or load["waiting"] or load["routed_in_flight"]:
            return False
        if kv["free_tokens"] + kv["evictable_tokens"] != kv["total_tokens"]:
            return False
    return True


def test_beams_and_scores_equal_transformers(cluster, client, beam_reference, tokenizer):
    for message in BEAM_MESSAGES[:PROMPTS]:
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                    add_generation_prompt=True, tokenize=True, return_dict=False))
        expected = beam_reference.beams(prompt, WIDTH, NEW_TOKENS)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": message}], n=WIDTH, max_tokens=NEW_TOKENS,
            temperature=0, extra_body={"use_beam_search": True, "length_penalty": 1.0, "early_stopping": True})
        assert [c.index for c in reply.choices] == list(range(WIDTH))
        texts = [tokenizer.decode(b.token_ids, skip_special_tokens=True) for b in expected]
        assert [c.message.content for c in reply.choices] == texts, message
        assert reply.usage.completion_tokens == sum(len(b.token_ids) for b in expected)
        assert reply.usage.prompt_tokens == len(prompt)
        finish = ["length" if len(b.token_ids) == NEW_TOKENS and b.token_ids[-1] not in tokenizer.all_special_ids
                  else "stop" for b in expected]
        assert [c.finish_reason for c in reply.choices] == finish
    wait_until(lambda: _kv_idle(cluster), 30, "every node idle with all its KV back")


def test_completions_with_logprobs_score_each_beam(client, beam_reference, tokenizer):
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": BEAM_MESSAGES[1]}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False))
    expected = beam_reference.beams(prompt, WIDTH, NEW_TOKENS)
    reply = client.completions.create(model=MODEL, prompt=prompt, n=2, best_of=WIDTH, max_tokens=NEW_TOKENS,
                                      logprobs=2, extra_body={"use_beam_search": True, "early_stopping": True})
    assert len(reply.choices) == 2
    for choice, beam in zip(reply.choices, expected):
        assert choice.text == tokenizer.decode(beam.token_ids, skip_special_tokens=True)
        total = sum(choice.logprobs.token_logprobs)
        assert total / len(beam.token_ids) == pytest.approx(beam.score, abs=1e-4)


def test_streaming_several_beams_is_a_400_and_the_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                       max_tokens=4, stream=True, extra_body={"use_beam_search": True})
    assert err.value.body["param"] == "stream"
    pieces = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, stream=True,
                                       extra_body={"use_beam_search": True})
    chunks = list(pieces)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert reply.choices[0].text


def test_a_decode_node_lost_mid_search_reruns_it_elsewhere(default_model_dir, tmp_path_factory, tokenizer):
    """D is killed while the search runs: the master runs it again from the prompt on the other D,
    which answers the beams an undisturbed search answers, and leaks nothing."""
    c = Cluster(default_model_dir, tmp_path_factory.mktemp("beam-fault-logs"))
    try:
        c.start_master()
        c.start_node("prefill", "p0")
        c.start_node("decode", "d0", "--data-port", "0")
        c.start_node("decode", "d1", "--data-port", "0")
        wait_until(lambda: c.health()[0] == 200 and len(c.nodes()) == 3, 90, "the cluster to be ready")
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        body = {"model": MODEL, "prompt": BEAM_MESSAGES[6], "n": WIDTH, "max_tokens": 32,
                "extra_body": {"use_beam_search": True, "ignore_eos": True}}

        def searching() -> str | None:
            busy = [n["id"] for n in c.nodes() if n["role"] == "decode" and n["load"]["running"] >= WIDTH]
            return busy[0] if busy else None

        with cf.ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.completions.create, **body)
            victim = wait_until(searching, 60, "a decode node to run the search")
            c.kill(victim)
            faulted = future.result(timeout=120)
        undisturbed = client.completions.create(**body)
        assert [ch.text for ch in faulted.choices] == [ch.text for ch in undisturbed.choices]
        assert all(len(tokenizer.encode(ch.text)) > 0 for ch in faulted.choices)
        logged = next(line for line in c.log("master").splitlines() if f"request_id={faulted.id} " in line)
        assert "attempts=2" in logged and f"after {victim}" in logged
        wait_until(lambda: len(c.nodes()) == 2 and _kv_idle(c), 60, "the nodes left idle with all their KV back")
    finally:
        c.stop()
