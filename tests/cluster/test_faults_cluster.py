"""Faults as production has them, on a real cluster on loopback: two peer masters, two prefill and
two decode nodes as real processes, the official openai client, the real default model.

Each test breaks one thing (kill -9 a P between its first token and the KV handover; kill -9 or
SIGSTOP a D mid-stream; remove a busy D; kill a master under load and start it again) and holds
the same line: no request hangs, every stream finishes with what an uninterrupted greedy run
produces (its tokens migrate to another pair), and every node's KV goes back to idle.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import httpx
import openai
import pytest

from tests.cluster_harness import CLUSTER_TOKEN, Cluster, TwoMastersCluster, status_of, wait_until

MODEL = "SmolLM2-135M-Instruct"
#: Generous bound on any one request here: a hung request fails the test instead of blocking it.
REQUEST_TIMEOUT_S = 120.0


class PeerMastersCluster(TwoMastersCluster):
    """Two masters (``master`` and ``master-b``); every node registers with both."""

    def env(self, token: str = CLUSTER_TOKEN) -> dict[str, str]:
        # Faster eviction of a frozen node and of a stalled handover than production's defaults.
        return {**super().env(token), "PD_HEARTBEAT_TIMEOUT_S": "3", "PD_HANDOFF_TIMEOUT_S": "20"}


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    c = PeerMastersCluster(default_model_dir, tmp_path_factory.mktemp("fault-logs"))
    try:
        c.start_master()
        c.start_master_b()
        for role, name in (("prefill", "p0"), ("prefill", "p1"), ("decode", "d0"), ("decode", "d1")):
            c.start_peer_node(role, name)
        for url in (c.url, c.url_b):
            wait_until(lambda u=url: status_of(u + "/health") == 200 and len(c.nodes_at(u)) == 4, 60, "both masters ready")
        yield c
    finally:
        c.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return _client(cluster.url)


@pytest.fixture(scope="module")
def long_prompt(tokenizer) -> list[int]:
    """A prompt long enough that P's KV push takes a while after its first token."""
    text = " ".join(f"Item {i}: the north gate opened at {i % 12} and the bell rang {i % 5} times." for i in range(80))
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 1200
    return ids[:1200]


def _greedy(max_tokens: int) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, "extra_body": {"ignore_eos": True}}


def _uninterrupted(client: openai.OpenAI, prompt: list[int] | str, max_tokens: int) -> str:
    reply = client.completions.create(model=MODEL, prompt=prompt, **_greedy(max_tokens))
    assert reply.choices[0].finish_reason == "length"
    return reply.choices[0].text


def _pid(cluster: Cluster, name: str) -> int:
    return cluster.procs[name].pid


def _busy(cluster: Cluster, role: str) -> list[str]:
    """Nodes of ``role`` that the master counts as holding a request of its own."""
    return [n["id"] for n in cluster.nodes() if n["role"] == role and n["load"]["routed_in_flight"]]


def _kv_idle(nodes: list[dict]) -> bool:
    """No request left anywhere and every KV slot free or only cached (evictable)."""
    for n in nodes:
        kv, load = n["kv"], n["load"]
        if load["running"] or load["waiting"] or load["routed_in_flight"] or load["queued_prefill_tokens"]:
            return False
        if n["role"] == "decode" and kv["free_tokens"] + kv["evictable_tokens"] != kv["total_tokens"]:
            return False
    return True


def _assert_kv_idle(cluster: PeerMastersCluster, timeout: float = 60.0) -> None:
    for url in (cluster.url, cluster.url_b):
        wait_until(lambda u=url: len(cluster.nodes_at(u)) == 4 and _kv_idle(cluster.nodes_at(u)), timeout,
                   f"every node's KV back to idle (as {url} sees it)")


def _restart(cluster: PeerMastersCluster, name: str, role: str) -> None:
    proc = cluster.procs[name]
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    for url in (cluster.url, cluster.url_b):
        wait_until(lambda u=url: all(n["id"] != name for n in cluster.nodes_at(u)), 30, f"{name} to be gone")
    cluster.start_peer_node(role, name)
    wait_until(lambda: all(len(cluster.nodes_at(u)) == 4 for u in (cluster.url, cluster.url_b)), 60, "4 nodes back")


def _stream(client: openai.OpenAI, prompt, max_tokens: int):
    return iter(client.completions.create(model=MODEL, prompt=prompt, stream=True, **_greedy(max_tokens)))


def _rest(chunks) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_prefill_killed_between_first_token_and_handover_is_rerun(cluster, client, long_prompt):
    pids = {name: _pid(cluster, name) for name in ("p0", "p1")}
    chunks = _stream(client, long_prompt, 24)  # no node has it cached: P pushes all of its KV
    first = next(chunks)
    for pid in pids.values():  # freeze both prefill nodes the moment the first token is out
        os.kill(pid, signal.SIGSTOP)
    try:
        owners = _busy(cluster, "prefill")
        assert len(owners) == 1, f"the first token came out after the handover ({owners}); lengthen the prompt"
        victim = owners[0]
    finally:
        for name, pid in pids.items():
            if not owners or name != owners[0]:
                os.kill(pid, signal.SIGCONT)
    cluster.kill(victim)  # kill -9 while it holds the request between first token and handover
    text, finish = _rest(chunks)
    assert first.choices[0].text + text == _uninterrupted(client, long_prompt, 24) and finish == "length"
    assert f"prefill node {victim} was lost" in cluster.log("master")
    _restart(cluster, victim, "prefill")
    _assert_kv_idle(cluster)


@pytest.mark.parametrize("fault", ["kill", "sigstop", "admin_remove"])
def test_decode_lost_mid_stream_migrates_and_matches_an_uninterrupted_run(cluster, client, fault):
    prompt = f"Tell me a long story about a lighthouse keeper ({fault})."
    want = _uninterrupted(client, prompt, 40)
    chunks = _stream(client, prompt, 40)
    head = ""
    while len(head) < 20:  # tokens have reached the client
        chunk = next(chunks)
        head += chunk.choices[0].text if chunk.choices else ""
    (victim,) = _busy(cluster, "decode")
    migrations = cluster.metric("pdc_stream_migrations_total")
    if fault == "kill":
        cluster.kill(victim)
    elif fault == "sigstop":
        os.kill(_pid(cluster, victim), signal.SIGSTOP)
    else:
        assert cluster.admin("DELETE", f"/admin/nodes/{victim}").status_code == 200
    started = time.monotonic()
    text, finish = _rest(chunks)
    assert head + text == want and finish == "length"  # the client saw a pause, not an error
    assert time.monotonic() - started < 30
    assert cluster.metric("pdc_stream_migrations_total") == migrations + 1
    if fault == "sigstop":
        os.kill(_pid(cluster, victim), signal.SIGCONT)  # it comes back and drops what it held
        wait_until(lambda: cluster.node(victim) is not None, 30, f"{victim} to rejoin after SIGCONT")
        assert "missed heartbeats" in cluster.log("master")
    elif fault == "admin_remove":
        time.sleep(3.0)  # long enough for several reconnect attempts
        assert cluster.node(victim) is None and cluster.procs[victim].poll() is None  # refused, still running
        assert cluster.admin("POST", f"/admin/nodes/{victim}/allow").status_code == 200
        # master-b never removed it: it stayed there, and now rejoins master a too.
        wait_until(lambda: cluster.node(victim) is not None, 30, f"{victim} to rejoin once allowed")
    else:
        _restart(cluster, victim, "decode")
    _assert_kv_idle(cluster)


def test_many_streams_survive_a_decode_killed_under_load(cluster, client, chat_prompts):
    def ask(i: int) -> tuple[str, str | None]:
        prompt = chat_prompts[i % len(chat_prompts)] + [13] * (i % 3)
        return _rest(_stream(client, prompt, 48))

    with cf.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(ask, i) for i in range(12)]
        wait_until(lambda: sum(n["load"]["running"] for n in cluster.nodes() if n["role"] == "decode") >= 4, 60,
                   "streams decoding")
        busiest = max((n for n in cluster.nodes() if n["role"] == "decode"), key=lambda n: n["load"]["running"])
        cluster.kill(busiest["id"])
        results = [f.result(timeout=REQUEST_TIMEOUT_S) for f in futures]  # 0 hung
    assert all(finish == "length" for _, finish in results), results  # 0 failed
    assert cluster.metric('pdc_requests_total{status="error"}') == 0
    _restart(cluster, busiest["id"], "decode")
    _assert_kv_idle(cluster)


def test_a_killed_master_fails_over_to_its_peer_and_is_found_again_when_restarted(cluster, client):
    client_b = _client(cluster.url_b)
    prompts = [f"Write a short poem about the number {i}." for i in range(8)]

    def ask(i: int) -> str:
        """A client that retries on the other master when its master is gone."""
        for attempt, c in enumerate((client, client_b) if i % 2 == 0 else (client_b, client)):
            try:
                return _rest(_stream(c, prompts[i], 32))[1] or "none"
            except (openai.APIConnectionError, openai.APIStatusError, httpx.HTTPError):
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, i) for i in range(8)]
        wait_until(lambda: sum(n["load"]["running"] for n in cluster.nodes() if n["role"] == "decode") >= 2, 60,
                   "requests in flight on both masters")
        cluster.kill("master")  # kill -9, with requests in flight on it
        # Its requests die with it on the nodes too, instead of decoding on for nobody.
        wait_until(lambda: any("aborting its" in cluster.log(d) for d in ("d0", "d1")), 10,
                   "a decode node to drop the dead master's requests")
        results = [f.result(timeout=REQUEST_TIMEOUT_S) for f in futures]
    assert results == ["length"] * 8
    # The surviving master kept the whole registry and routes on.
    assert len(cluster.nodes_at(cluster.url_b)) == 4
    assert _uninterrupted(client_b, "Name a color.", 8)
    # Started again on the same address, it is found by every node (their re-dial backoff is
    # capped at 1 s; the deadline leaves room for a loaded machine).
    cluster.start_master()
    wait_until(lambda: len(cluster.nodes()) == 4, 30, "all nodes back on the restarted master", interval=0.05)
    wait_until(lambda: status_of(cluster.url + "/health") == 200, 30, "the restarted master ready")
    assert _uninterrupted(client, "Name a color.", 8)
    _assert_kv_idle(cluster)
