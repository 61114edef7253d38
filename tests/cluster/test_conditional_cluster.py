"""Disaggregation only where it pays, with real processes on loopback and the official client:
a short miss is prefilled on its decode node and a long one on a prefill node (read from the
master's decision counters), greedy output is the reference's on both paths, requests spread
over two decode nodes although they share the chat template, and with every prefill node gone
the decode nodes serve whole requests with none failed."""

from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest

from master.request_log import parse_text_line
from tests.cluster_harness import Cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"
#: The master's local_prefill_max_tokens in this cluster: chat prompts of a few words are short
#: misses, the long prompts below are long ones.
LOCAL_MAX = 64
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    c = Cluster(default_model_dir, tmp_path_factory.mktemp("conditional-logs"), local_prefill_max_tokens=LOCAL_MAX)
    try:
        c.start_master()
        c.start_node("prefill", "p0")
        c.start_node("decode", "d0", "--data-port", "0")
        # d1 pipelines its steps, as decode nodes on a GPU do by default (on CPU they run in
        # order): every path below then runs both ways.
        c.start_node("decode", "d1", "--data-port", "0", "--overlap-schedule")
        wait_until(lambda: c.health()[0] == 200, 60, "a warm pair")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def decisions(cluster: Cluster, path: str, reason: str) -> float:
    return cluster.metric(f'pdc_route_decisions_total{{path="{path}",reason="{reason}"}}')


def request_lines(cluster: Cluster) -> list[dict[str, str]]:
    """The master's request log lines (text form: ``request key=value ...``)."""
    return [fields for line in cluster.log("master").splitlines() if (fields := parse_text_line(line)) is not None]


def expected(tokenizer, hf_reference, prompt: list[int], n: int = NEW_TOKENS) -> str:
    return tokenizer.decode(hf_reference.greedy(prompt, n), skip_special_tokens=True)


def test_short_miss_is_prefilled_on_d_and_long_one_on_p_with_the_reference_output(
    cluster, client, tokenizer, hf_reference
):
    long_prompt = tokenizer.encode(" ".join(f"item {i} is {i * 7 % 11}." for i in range(40)))
    assert len(long_prompt) > 4 * LOCAL_MAX
    short_prompt = tokenizer.encode("The capital of France is")
    assert len(short_prompt) < LOCAL_MAX

    before = {key: decisions(cluster, *key) for key in (("local", "short_miss"), ("pd", "long_miss"))}
    for prompt in (short_prompt, long_prompt):
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].text == expected(tokenizer, hf_reference, prompt)
    assert decisions(cluster, "local", "short_miss") == before[("local", "short_miss")] + 1
    assert decisions(cluster, "pd", "long_miss") == before[("pd", "long_miss")] + 1

    # The next turn of the long prompt: the D that holds it misses only the new part, so it
    # prefills that itself, from its cache, streaming.
    follow_up = long_prompt + tokenizer.encode(" What is item 3?")
    assert len(follow_up) - len(long_prompt) < LOCAL_MAX
    stream = client.completions.create(model=MODEL, prompt=follow_up, max_tokens=NEW_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected(tokenizer, hf_reference, follow_up)
    assert decisions(cluster, "local", "short_miss") == before[("local", "short_miss")] + 2
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(follow_up)
    assert usage.prompt_tokens_details.cached_tokens >= len(long_prompt) - 64  # whole blocks of the first turn
    last = request_lines(cluster)[-1]
    assert (last["path"], last["route_reason"]) == ("local", "short_miss")
    assert "prefill" not in last  # no P took part
    assert int(last["decode_hit_tokens"]) == usage.prompt_tokens_details.cached_tokens
    # D's own share of the TTFT came with its first delta, and fits in it beside the master's.
    assert 0 < float(last["node_ttft_s"]) and 0 < float(last["dispatch_s"])
    assert float(last["dispatch_s"]) + float(last["node_ttft_s"]) < float(last["ttft_s"])


def test_requests_sharing_only_the_chat_template_spread_over_both_decode_nodes(cluster, client):
    topics = ["rivers", "bread", "clocks", "owls", "glass", "chess", "tides", "maps", "salt", "kites", "moss", "bells",
              "ink", "bees", "rope", "snow", "wheels", "lamps", "ferns", "coins", "dunes", "sails", "keys", "wool"]
    seen = len(request_lines(cluster))

    def ask(topic: str) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me about {topic}."}], max_tokens=24,
            temperature=0, extra_body={"ignore_eos": True})
        return reply.choices[0].finish_reason

    with cf.ThreadPoolExecutor(len(topics)) as pool:
        assert list(pool.map(ask, topics)) == ["length"] * len(topics)
    lines = request_lines(cluster)[seen:]
    assert len(lines) == len(topics)
    per_decode = {d: sum(1 for line in lines if line["decode"] == d) for d in ("d0", "d1")}
    assert max(per_decode.values()) <= 0.65 * len(topics), per_decode


def test_with_every_prefill_node_gone_decode_nodes_serve_whole_requests(cluster, client, tokenizer, hf_reference):
    prompts = [tokenizer.encode(" ".join(f"row {i} {word}" for i in range(30))) for word in ("alpha", "beta", "gamma",
                                                                                              "delta", "omega", "sigma")]
    assert all(len(p) > LOCAL_MAX for p in prompts)  # long misses: they go to the P while it lives
    before = decisions(cluster, "local", "no_prefill")

    def run(prompt: list[int]) -> str:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
        return reply.choices[0].text

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(run, p) for p in prompts[:3]]
        wait_until(lambda: (cluster.node("p0") or {}).get("load", {}).get("routed_in_flight", 0) > 0, 30,
                   "the prefill node to take work")
        cluster.kill("p0")
        futures += [pool.submit(run, p) for p in prompts[3:]]
        texts = [f.result(timeout=120) for f in futures]
    assert texts == [tokenizer.decode(hf_reference.greedy(p, 24), skip_special_tokens=True) for p in prompts]
    assert decisions(cluster, "local", "no_prefill") >= before + 3
    # Nothing leaked: both decode nodes end idle with every KV slot free or evictable.
    def idle() -> bool:
        nodes = [cluster.node(d) for d in ("d0", "d1")]
        return all(n is not None and n["load"]["running"] == 0 and n["load"]["routed_in_flight"] == 0
                   and n["kv"]["free_tokens"] + n["kv"]["evictable_tokens"] == n["kv"]["total_tokens"] for n in nodes)

    wait_until(idle, 30, "the decode nodes to be idle with all KV back")
