"""Overload on a real cluster on loopback: two peer masters, two prefill nodes and one decode node
capped at one running request, as real processes, with the official openai client.

A full decode node is backpressure, never a failure: a request waits in its master's queue until
D has a free row, a lease D refuses (its master's view of D was one report old) sends the request
back to wait without counting an attempt, and a master whose queue is full answers 429 with
Retry-After before accepting anything it could not finish.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
import threading

import httpx
import openai
import pytest

from master.request_log import parse_text_line
from tests.cluster_harness import CLUSTER_TOKEN, TwoMastersCluster, status_of, wait_until
from tests.reference import CHAT_MESSAGES

MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 24
#: The admission queue of each master: a third request to a master with one running and two
#: waiting is answered 429.
QUEUE_SIZE = 2


class OverloadCluster(TwoMastersCluster):
    """Masters ``master`` and ``master-b``, each with a small admission queue; every node registers with both."""

    def env(self, token: str = CLUSTER_TOKEN) -> dict[str, str]:
        return {**super().env(token), "PD_QUEUE_SIZE": str(QUEUE_SIZE), "PD_QUEUE_TIMEOUT_S": "120"}

    def metric_at(self, url: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
                   if line.startswith(name) and (line.startswith(name + " ") or line.startswith(name + "{")))

    def request_lines(self, master: str) -> list[dict[str, str]]:
        return [fields for line in self.log(master).splitlines() if (fields := parse_text_line(line)) is not None]


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    c = OverloadCluster(default_model_dir, tmp_path_factory.mktemp("overload-logs"))
    try:
        c.start_master()
        c.start_master_b()
        c.start_peer_node("prefill", "p0")
        c.start_peer_node("prefill", "p1")
        c.start_peer_node("decode", "d0", "--max-running-requests", "1")
        for url in (c.url, c.url_b):
            wait_until(lambda u=url: status_of(u + "/health") == 200, 60, "both masters ready")
        yield c
    finally:
        c.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _stream(url: str, message: str) -> tuple[str, str | None]:
    """One greedy streamed chat answer: its text and its last finish reason."""
    stream = _client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": message}], stream=True, temperature=0,
        max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


def _expected(tokenizer, hf_reference, prompt_ids: list[int]) -> str:
    return tokenizer.decode(hf_reference.greedy(prompt_ids, NEW_TOKENS), skip_special_tokens=True)


def test_decode_node_reports_its_batch_limit(cluster):
    assert cluster.node("d0")["capacity"]["max_running_requests"] == 1


def test_a_refused_lease_waits_and_completes_with_its_attempts_unchanged(cluster, chat_prompts, tokenizer,
                                                                         hf_reference):
    """Each master sees D idle in its last report and sends it a request: D (held still until both
    jobs wait on its data plane) leases one and refuses the other; the refused one waits for D's
    row and completes on its first counted attempt."""
    cases = list(zip(CHAT_MESSAGES, chat_prompts))[:2]
    refusals_before = sum(cluster.metric_at(u, "pdc_decode_refusals_total") for u in (cluster.url, cluster.url_b))
    routed_before = [cluster.metric_at(u, "pdc_route_decisions_total") for u in (cluster.url, cluster.url_b)]
    decode = cluster.procs["d0"]
    decode.send_signal(signal.SIGSTOP)
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(_stream, url, message) for url, (message, _) in zip((cluster.url, cluster.url_b),
                                                                                       cases)]
            wait_until(lambda: all(cluster.metric_at(u, "pdc_route_decisions_total") > before
                                   for u, before in zip((cluster.url, cluster.url_b), routed_before)),
                       30, "both masters to dispatch to the stopped decode node")
            decode.send_signal(signal.SIGCONT)
            answers = [f.result(timeout=120) for f in futures]
    finally:
        decode.send_signal(signal.SIGCONT)
    for (text, finish), (_, prompt_ids) in zip(answers, cases):
        assert finish == "length" and text == _expected(tokenizer, hf_reference, prompt_ids)
    refusals = sum(cluster.metric_at(u, "pdc_decode_refusals_total") for u in (cluster.url, cluster.url_b))
    assert refusals > refusals_before
    lines = [cluster.request_lines("master")[-1], cluster.request_lines("master-b")[-1]]
    assert all(line["outcome"] == "ok" and line["attempts"] == "1" for line in lines), lines
    refused = [line for line in lines if int(line["refusals"]) >= 1]
    assert refused and all(line["wait_reason"] == "decode_refused" and float(line["queue_wait_s"]) > 0
                           for line in refused), lines


def test_a_full_queue_answers_429_and_every_accepted_request_completes(cluster, chat_prompts, tokenizer,
                                                                       hf_reference):
    """Eight requests at once to one master, D taking one at a time: one runs, QUEUE_SIZE wait, the
    rest are refused at the door with 429 and Retry-After; every accepted stream finishes whole."""
    message, prompt_ids = CHAT_MESSAGES[0], chat_prompts[0]
    want = _expected(tokenizer, hf_reference, prompt_ids)
    start = threading.Barrier(8)

    def one() -> tuple[str, str | None] | openai.RateLimitError:
        start.wait(30)
        try:
            return _stream(cluster.url, message)
        except openai.RateLimitError as e:
            return e

    with cf.ThreadPoolExecutor(8) as pool:
        results = [f.result(timeout=180) for f in [pool.submit(one) for _ in range(8)]]
    accepted = [r for r in results if not isinstance(r, openai.RateLimitError)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert refused and len(accepted) >= 1 + QUEUE_SIZE
    assert all(e.status_code == 429 and e.response.headers.get("retry-after") == "1" for e in refused)
    assert all(r == (want, "length") for r in accepted)
