"""One structured log line per request, the X-Request-Id answer header, and the id in the nodes' logs.

A real master (with ``--log-format json``) and one P and one D on loopback, the official openai
client; the lines are read back from the processes' log files.
"""

from __future__ import annotations

import json
import logging
import re
import time

import httpx
import openai
import pytest

from master.errors import APIError
from master.relay_attempt import Attempt, attempt_id_of
from master.relay_request import RelayRequest
from master.request_log import JSONFormatter, RequestLog
from master.routing import RouteRequest
from pd_cluster import protocol
from pd_cluster.sampling_params import SamplingParams
from tests.cluster_harness import Cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def cluster(served_cluster) -> Cluster:
    return served_cluster  # its master runs with --log-format json


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def request_line(cluster: Cluster, request_id: str, event: str = "request") -> dict:
    """The master's JSON log line of ``event`` naming ``request_id`` (waits for it: it is written
    as the request ends)."""

    def find() -> dict | None:
        for line in cluster.log("master").splitlines():
            if request_id in line and f'"event": "{event}"' in line:
                return json.loads(line)
        return None

    return wait_until(find, 30, f"the {event} line of {request_id}")


def test_every_request_ends_in_one_json_line_with_its_route_tokens_and_latency(cluster, client):
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": "client-id-42"},
    )
    reply = raw.parse()
    assert raw.headers["x-request-id"] == "client-id-42"  # echoed: a proxy in front follows its own id

    line = request_line(cluster, reply.id)
    assert line["level"] == "info" and line["logger"] == "master.requests"
    assert line["client_request_id"] == "client-id-42"
    assert (line["prefill"], line["decode"], line["attempts"]) == ("p0", "d0", 1)
    assert (line["path"], line["route_reason"]) == ("pd", "local_disabled")
    assert line["routing"].startswith("cache_aware; P -> D (local disabled); priced ")
    assert "; warm pair; D held " in line["routing"]
    assert line["prompt_tokens"] == reply.usage.prompt_tokens
    assert line["completion_tokens"] == reply.usage.completion_tokens == 6
    assert line["cached_tokens"] == reply.usage.prompt_tokens_details.cached_tokens
    assert line["transferred_tokens"] == line["prompt_tokens"] - line["decode_hit_tokens"]
    assert line["transfer_bytes"] > 0
    assert 0 < line["ttft_s"] < line["e2e_s"] and line["tpot_s"] > 0
    # TTFT's parts: the master's (to dispatch) and P's (job to first token) fit inside it, one after the other.
    assert 0 < line["dispatch_s"] and 0 < line["node_ttft_s"]
    assert line["dispatch_s"] + line["node_ttft_s"] < line["ttft_s"]
    # P's share in turn: its prefix query to D, then its engine's prefill, one after the other.
    assert 0 < line["prefix_query_s"] and 0 < line["prefill_s"]
    assert line["prefix_query_s"] + line["prefill_s"] < line["node_ttft_s"]
    assert (line["outcome"], line["finish_reason"], line["error"], line["stream"]) == ("ok", "length", None, False)

    # The same prompt again, streamed: D holds its prefix now, so less KV moves.
    with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,
        extra_headers={"X-Request-Id": "client-stream-7"},
    ) as response:
        assert response.headers["x-request-id"] == "client-stream-7"
        chunks = list(response.parse())
    again = request_line(cluster, chunks[0].id)
    assert again["stream"] is True and again["client_request_id"] == "client-stream-7"
    assert again["decode_hit_tokens"] > 0
    assert again["transferred_tokens"] < line["transferred_tokens"]
    assert f"D held {again['decode_hit_tokens']}/{again['prompt_tokens']} prompt tokens" in again["routing"]

    # The id reached both nodes' logs: where the job started on P (beside the client's) and where it ended on D.
    wait_until(lambda: f"request {reply.id}: prefill job" in cluster.log("p0"), 10, "P's line")
    p_line = next(line for line in cluster.log("p0").splitlines() if f"request {reply.id}: prefill job" in line)
    assert "client request id client-id-42" in p_line
    wait_until(lambda: f"request {reply.id}: finished (length)" in cluster.log("d0"), 10, "D's line")

    # Without one, the answer carries the master's own id: the one its line and the nodes' carry.
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="One, two,", max_tokens=2)
    assert raw.headers["x-request-id"] == raw.parse().id
    assert request_line(cluster, raw.parse().id)["client_request_id"] is None


def test_json_log_format_makes_every_master_line_json(cluster, client):
    client.completions.create(model=MODEL, prompt="One, two,", max_tokens=2)
    lines = [line for line in cluster.log("master").splitlines() if line.strip()]
    assert len(lines) > 3
    docs = [json.loads(line) for line in lines]  # raises on any plain-text line
    assert all({"time", "level", "logger"} <= doc.keys() for doc in docs)
    assert any(doc.get("message", "").startswith("node d0 joined") for doc in docs)


def rejected_line(cluster: Cluster, client_request_id: str) -> dict:
    """The master's JSON line of the rejected request sent with ``client_request_id``."""
    return request_line(cluster, client_request_id, "rejected")


def rejected_counts(cluster: Cluster) -> dict[tuple[str, str], float]:
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    found = re.findall(r'pdc_rejected_requests_total\{reason="(\w+)",status="(\d+)"\} (\S+)', text)
    return {(reason, status): float(count) for reason, status, count in found}


def test_rejected_requests_leave_a_line_naming_the_reason_and_a_count(cluster, client):
    before = rejected_counts(cluster)
    # A 400: a field of the wrong type, refused before anything is served.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-3,
                                  extra_headers={"X-Request-Id": "client-bad-400"})
    line = rejected_line(cluster, "client-bad-400")
    assert line["logger"] == "master.requests" and line["level"] == "info"
    assert (line["status"], line["error_type"], line["param"]) == (400, "invalid_request_error", "temperature")
    assert line["reason"] == "invalid_request_error" and "temperature" in line["message"]
    assert (line["method"], line["path"]) == ("POST", "/v1/completions")
    assert line["key"] is None  # the cluster needs no key

    # A 404: a model the cluster does not serve.
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2,
                                  extra_headers={"X-Request-Id": "client-model-404"})
    line = rejected_line(cluster, "client-model-404")
    assert (line["status"], line["reason"], line["param"]) == (404, "model_not_found", "model")

    # A 404 of a route that does not exist, without an X-Request-Id: still a line, and no id answered.
    response = httpx.post(cluster.url + "/v1/no-such-route", json={}, timeout=10,
                          headers={"X-Request-Id": "client-route-404"})
    assert response.status_code == 404
    line = rejected_line(cluster, "client-route-404")
    assert (line["status"], line["reason"], line["path"]) == (404, "not_found", "/v1/no-such-route")
    response = httpx.post(cluster.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
    assert response.status_code == 404 and "x-request-id" not in response.headers

    after = rejected_counts(cluster)
    for reason, count in {("model_not_found", "404"): 2, ("not_found", "404"): 1, ("invalid_request_error", "400"): 1}.items():
        assert after[reason] - before.get(reason, 0) == count, reason
    # A served request is the request log's, not a rejection.
    assert not any('"event": "rejected"' in line and '"status": 200' in line
                   for line in cluster.log("master").splitlines())


# ---- the line's content, without a cluster ---------------------------------------------------------


class _NoNodes:
    cluster_spec = None

    def get(self, node_id):
        return None


def _request(attempt: int = 1, prefill_id: str | None = None, decode_id: str | None = None,
             first_token: protocol.FirstToken | None = None, dispatched_at: float = 100.0,
             node_ttft_s: float | None = None, **fields) -> RelayRequest:
    """An ended request whose last attempt (its ``attempt``-th) ran on ``prefill_id`` -> ``decode_id``."""
    r = RelayRequest(request_id="cmpl-1", token_ids=list(range(10)), sampling=SamplingParams(max_tokens=4),
                     stream=False, arrival=100.0, deadline=200.0, route=RouteRequest(list(range(10)), 14))
    if decode_id is not None:
        r.current = Attempt(number=attempt, attempt_id=attempt_id_of(r.request_id, attempt), decode_id=decode_id,
                            prefill_id=prefill_id, plan=None, dispatched_at=dispatched_at, first_token_seen=True,
                            handed_over=True, ended=True, first_token=first_token, node_ttft_s=node_ttft_s)
    for key, value in fields.items():
        setattr(r, key, value)
    return r


def test_a_failed_retried_request_says_why(caplog):
    log = RequestLog(_NoNodes(), "least_load")
    r = _request(attempt=3, prefill_id="p1", decode_id="d1", excluded={"p0", "d0"},
                 outcome="unavailable", finish_reason="error", finished_at=101.5, client_request_id="abc",
                 failure=APIError(503, "The request failed on 3 attempts; try again later.", "server_error", None,
                                  None))
    with caplog.at_level(logging.INFO, logger="master.requests"):
        record = log.record(r)
    assert record.routing == "least_load; attempt 3 after d0, p0"
    assert (record.outcome, record.error, record.ttft_s, record.e2e_s) == (
        "unavailable", "The request failed on 3 attempts; try again later.", None, 1.5)
    assert record.transferred_tokens == 0 and record.transfer_bytes == 0
    [logged] = caplog.records
    assert logged.levelno == logging.WARNING
    text = logged.getMessage()
    assert text.startswith("request request_id=cmpl-1 client_request_id=abc outcome=unavailable")
    assert 'error="The request failed on 3 attempts; try again later."' in text
    doc = json.loads(JSONFormatter().format(logged))
    assert doc["event"] == "request" and doc["request_id"] == "cmpl-1" and doc["attempts"] == 3
    assert list(log.recent) == [record]


def test_token_counts_come_from_the_first_token_report():
    first = protocol.FirstToken(request_id="cmpl-1", token_id=5, cached_tokens_prefill=4, hit_blocks_decode=6,
                                transfer_bytes=4096, node_ttft_s=0.125, prefix_query_s=0.015625, prefill_s=0.0625)
    r = _request(prefill_id="p0", decode_id="d0", first_token=first, cached_tokens=4,
                 outcome="ok", finish_reason="stop", first_token_at=100.25, finished_at=101.25,
                 output_ids=[1, 2, 3, 4, 5], dispatched_at=100.0625, node_ttft_s=0.125)
    record = RequestLog(_NoNodes(), "cache_aware").build(r)
    assert (record.decode_hit_tokens, record.transferred_tokens, record.transfer_bytes) == (6, 4, 4096)
    assert (record.ttft_s, record.tpot_s, record.e2e_s) == (0.25, 0.25, 1.25)
    assert (record.dispatch_s, record.node_ttft_s) == (0.0625, 0.125)
    assert (record.prefix_query_s, record.prefill_s) == (0.015625, 0.0625)
    assert record.routing == "cache_aware; D held 6/10 prompt tokens"
    assert time.time() - record.ended_at < 5


def test_pd_cluster_local_passes_the_log_format_to_its_master():
    from pd_cluster.cli import build_parser
    from pd_cluster.local_cluster import LocalCluster, LocalOptions

    assert build_parser().parse_args(["local"]).log_format == "text"
    args = build_parser().parse_args(["local", "--log-format", "json", "--device", "cpu"])
    cluster = LocalCluster(LocalOptions(device="cpu", log_format=args.log_format))
    master = next(s for s in cluster.process_specs("cluster-token", "admin-token") if s.name == "master")
    argv = list(master.argv)
    assert argv[argv.index("--log-format") + 1] == "json"
