"""A stream moved to another node inside a character, on a real cluster on loopback (master, a
prefill and two decode nodes as real processes, the official openai client, the default model).

The switch point is chosen: the prompt is long, so P still holds the request (pushing its KV)
when its first token reaches the client, and P is frozen (SIGSTOP) right then. Its decode node
has nothing yet; it is killed (kill -9) and the stream moves to the other one after 1 token. That
token is the first of an emoji's three, so P held its bytes back. The client's text is what an
uninterrupted run gives.
"""

from __future__ import annotations

import os
import re
import signal

import openai
import pytest

from tests.cluster.test_faults_cluster import _busy, _kv_idle, _rest
from tests.cluster_harness import CLUSTER_TOKEN, Cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 12
#: Generous bound on any one request here: a hung request fails the test instead of blocking it.
REQUEST_TIMEOUT_S = 120.0


class PatientCluster(Cluster):
    """A master that loses a node only when its socket closes: a frozen node keeps its requests
    (no missed heartbeats, no handover deadline, and D's lease on its KV outlasts a slow prefill
    on busy cores)."""

    def env(self, token: str = CLUSTER_TOKEN) -> dict[str, str]:
        return {**super().env(token), "PD_HEARTBEAT_TIMEOUT_S": "300", "PD_HANDOFF_TIMEOUT_S": "300"}


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    c = PatientCluster(default_model_dir, tmp_path_factory.mktemp("migration-text"))
    try:
        c.start_master()
        c.start_node("prefill", "p0")
        c.start_node("decode", "d0", "--lease-s", "300")
        c.start_node("decode", "d1", "--lease-s", "300")
        wait_until(lambda: c.health()[0] == 200 and sorted(c.warm_peers("p0") or []) == ["d0", "d1"], 60,
                   "p0 warm to both decode nodes")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)


def _prompt() -> str:
    """Long enough (1,136 tokens) that P's KV push outlasts its first token's way to the client;
    the default model goes on with the emoji it ends with, each three tokens long."""
    filler = " ".join(f"Item {i}: the north gate opened at {i % 12} and the bell rang {i % 5} times." for i in range(55))
    return filler + "\n\n" + "🎉🚀😀" * 4


def _greedy() -> dict:
    return {"model": MODEL, "prompt": _prompt(), "temperature": 0, "max_tokens": MAX_TOKENS,
            "extra_body": {"ignore_eos": True}}


def test_a_stream_moved_inside_a_character_shows_the_uninterrupted_text(cluster, client):
    migrations = cluster.metric("pdc_stream_migrations_total")
    prefill = cluster.procs["p0"]
    chunks = iter(client.completions.create(stream=True, logprobs=0, **_greedy()))  # nothing cached yet
    first = next(c for c in chunks if c.choices)
    os.kill(prefill.pid, signal.SIGSTOP)  # P holds the request between its first token and the handover
    try:
        assert _busy(cluster, "prefill") == ["p0"], "the handover was over before P froze; lengthen the prompt"
        (victim,) = _busy(cluster, "decode")
        # P's first token reached the client; its character is unfinished, so no text yet.
        assert first.choices[0].text == "" and len(first.choices[0].logprobs.tokens) == 1
        cluster.kill(victim)  # the stream moves after 1 token, to the other decode node
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    text, finish = _rest(chunks)
    assert re.search(r"migrating the stream of \S+ after 1 tokens", cluster.log("master"))
    assert cluster.metric("pdc_stream_migrations_total") == migrations + 1
    reply = client.completions.create(**_greedy())
    assert (text, finish) == (reply.choices[0].text, "length") and "🎉" in text
    wait_until(lambda: len(nodes := cluster.nodes()) == 2 and _kv_idle(nodes), 60, "the nodes left back to idle")
