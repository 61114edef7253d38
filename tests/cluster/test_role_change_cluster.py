"""Nodes that change role while they serve, with real processes on loopback and the official client
streaming: two mixed nodes become a prefill and a mixed node, then a prefill and a decode node (the
switched prefill node hands its KV over), and back to two mixed nodes, each change under load.
Every stream ends whole and token-identical to transformers, no node restarts, and no KV slot is
held afterwards. Then the planner, on the same nodes, moves one when the load mix changes."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

import openai
import pytest

from tests.cluster_harness import Cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 16
STREAMS = 4
#: The planning master of the last test: rounds every half second over the last 4 s of requests.
PLANNER_WINDOW_S = 4.0
PLANNER_ARGS = ("--planner", "slo")
PLANNER_ENV = {"PD_PLANNER_INTERVAL_S": "0.5", "PD_PLANNER_WINDOW_S": str(PLANNER_WINDOW_S),
               "PD_PLANNER_DWELL_S": "1"}


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    # Local prefill capped at 0: once a prefill node serves, every request to a decode node goes through it.
    c = Cluster(default_model_dir, tmp_path_factory.mktemp("role-change-logs"), local_prefill_max_tokens=0,
                extra_env=PLANNER_ENV)
    try:
        c.start_master()
        c.start_node("mixed", "a", "--data-port", "0")
        c.start_node("mixed", "b", "--data-port", "0")
        wait_until(lambda: c.health()[0] == 200, 60, "the mixed nodes to make the cluster ready")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _stream(client: openai.OpenAI, prompt: list[int], started: cf.Future | None = None) -> tuple[str, int]:
    """One greedy stream's text and the output tokens its usage chunk counts."""
    texts, tokens = [], 0
    stream = client.completions.create(model=MODEL, prompt=prompt, stream=True, temperature=0, max_tokens=NEW_TOKENS,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            texts.append(chunk.choices[0].text)
            if started is not None and not started.done():
                started.set_result(True)
    return "".join(texts), tokens


def _change_role(cluster: Cluster, node_id: str, role: str) -> None:
    answer = cluster.admin("POST", f"/admin/nodes/{node_id}/role", {"role": role})
    assert answer.status_code == 200, answer.text
    wait_until(lambda: (n := cluster.node(node_id)) is not None and n["role"] == role and n["pending_role"] is None
               and n["state"] == "active", 120, f"{node_id} to serve as {role}")


def _under_load(cluster, client, prompts, change) -> list[str]:
    """Stream ``prompts`` at once; make ``change`` while the first streams are mid-way."""
    started: cf.Future = cf.Future()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_stream, client, p, started) for p in prompts]
        started.result(timeout=120)
        change()
        results = [f.result(timeout=300) for f in futures]
    assert [chunks for _, chunks in results] == [NEW_TOKENS] * len(prompts)  # no short stream
    return [text for text, _ in results]


def _kv_idle(cluster: Cluster) -> bool:
    nodes = cluster.nodes()
    return all(n["load"]["running"] == 0 and n["load"]["waiting"] == 0 and n["load"]["routed_in_flight"] == 0
               and n["kv"]["free_tokens"] + n["kv"]["evictable_tokens"] == n["kv"]["total_tokens"] for n in nodes)


def test_two_mixed_nodes_become_prefill_and_mixed_then_prefill_and_decode_and_back_under_load(
        cluster, client, chat_prompts, tokenizer, hf_reference):
    prompts = [chat_prompts[i % 3] + tokenizer.encode(f" Case {i}.") for i in range(STREAMS)]
    want = [tokenizer.decode(hf_reference.greedy(p, NEW_TOKENS), skip_special_tokens=True) for p in prompts]
    before = {n["id"]: n["registered_at"] for n in cluster.nodes()}
    failed_before = cluster.metric('pdc_requests_total{status="error"}')
    steps = [("a", "prefill", ["prefill", "mixed"]), ("b", "decode", ["prefill", "decode"]),
             ("b", "mixed", ["prefill", "mixed"]), ("a", "mixed", ["mixed", "mixed"])]
    for node_id, role, roles in steps:
        texts = _under_load(cluster, client, prompts, lambda: _change_role(cluster, node_id, role))
        assert texts == want, (node_id, role)
        assert sorted(n["role"] for n in cluster.nodes()) == sorted(roles)
        # The cluster as it is now serves as well (1P1D: through the switched prefill node).
        assert _under_load(cluster, client, prompts[:2], lambda: None) == want[:2]
    for (frm, to) in (("mixed", "prefill"), ("mixed", "decode"), ("decode", "mixed"), ("prefill", "mixed")):
        labels = f'from_role="{frm}",outcome="done",to_role="{to}"'
        assert cluster.metric(f"pdc_role_changes_total{{{labels}}}") == 1, (frm, to)
    # The 1P1D phase went through P (local prefill is off: reason local_disabled).
    assert cluster.metric('pdc_route_decisions_total{path="pd",reason="local_disabled"}') >= 2
    # The same processes, never re-registered; nothing failed; no KV held once the streams ended.
    assert {n["id"]: n["registered_at"] for n in cluster.nodes()} == before
    assert all(cluster.procs[name].poll() is None for name in ("a", "b"))
    assert cluster.metric('pdc_requests_total{status="error"}') == failed_before
    wait_until(lambda: _kv_idle(cluster), 30, "every node's KV to be idle")


def test_the_planner_gives_the_prefill_node_to_the_decode_side_when_prompts_get_short(
        cluster, client, tokenizer):
    """The same nodes under a master that plans (restarted on the same port: they register again):
    long prompts with one-token answers keep 1P1D; short prompts with long answers turn P mixed."""
    _change_role(cluster, "a", "prefill")
    _change_role(cluster, "b", "decode")
    cluster.procs["master"].send_signal(signal.SIGTERM)
    cluster.procs["master"].wait(30)
    cluster.start_master(*PLANNER_ARGS)
    wait_until(lambda: {n["id"]: n["role"] for n in cluster.nodes()} == {"a": "prefill", "b": "decode"}, 60,
               "the nodes to register with the planning master")
    long_prompt = tokenizer.encode(" ".join(f"Item {i} weighs {i * 7 % 13} kg." for i in range(60)))
    short_prompt = tokenizer.encode("Count to ten.")

    def serve(prompt: list[int], max_tokens: int, until) -> None:
        """Two clients back to back (the load the planner measures) until ``until()`` holds."""
        def one(i: int) -> None:
            client.completions.create(model=MODEL, prompt=prompt + tokenizer.encode(f" {i}"), temperature=0,
                                      max_tokens=max_tokens, extra_body={"ignore_eos": True})

        i = 0
        with cf.ThreadPoolExecutor(2) as pool:
            while not until():
                list(pool.map(one, (i, i + 1)))
                i += 2

    deadline = time.monotonic() + PLANNER_WINDOW_S + 2  # the window full of long prompts, P kept busy
    serve(long_prompt, 1, lambda: time.monotonic() > deadline)
    assert cluster.metric("pdc_planner_decisions_total") == 0
    assert {n["id"]: n["role"] for n in cluster.nodes()} == {"a": "prefill", "b": "decode"}
    deadline = time.monotonic() + 120
    serve(short_prompt, 24, lambda: cluster.metric("pdc_planner_decisions_total") > 0 or time.monotonic() > deadline)
    # P idles next to D, or D is past its capacity (a CPU decodes slowly): either way P goes.
    moved = {reason: cluster.metric(f'pdc_planner_decisions_total{{from_role="prefill",reason="{reason}",'
                                    f'to_role="mixed"}}') for reason in ("prefill_idle", "decode_short")}
    assert sum(moved.values()) == 1 == cluster.metric("pdc_planner_decisions_total"), moved
    wait_until(lambda: (n := cluster.node("a")) is not None and n["role"] == "mixed" and n["state"] == "active", 60,
               "a to serve as mixed")
    assert "planner: node a prefill -> mixed (" in cluster.log("master")
