"""Warm from the first request: master, P and D as real processes on loopback.

A prefill node forms and warms its data-plane channel to every decode node the master lists
before any request arrives; the master reports the warm pairs (/health, /admin/nodes, metrics)
and says it is ready only once one exists. (Time to first token is a GPU measurement: not here.)
"""

from __future__ import annotations

import httpx
import pytest

from tests.cluster_harness import Cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    c = Cluster(default_model_dir, tmp_path_factory.mktemp("warm-channel-logs"))
    try:
        c.start_master()
        c.start_node("prefill", "p0")
        c.start_node("decode", "d0", "--data-port", "0")
        yield c
    finally:
        c.stop()


def test_the_channel_is_formed_and_warmed_before_any_request(cluster):
    wait_until(lambda: cluster.health()[0] == 200, 60, "the master to be ready")
    assert cluster.health()[1] == {"status": "ok", "prefill_nodes": 1, "decode_nodes": 1, "mixed_nodes": 0, "warm_pairs": 1}
    # P reports the warm channel; D's data-plane server reports the accepted, warmed one.
    assert cluster.warm_peers("p0") == ["d0"]
    wait_until(lambda: cluster.warm_peers("d0") == ["p0"], 10, "d0 to report the warmed channel")
    p0 = cluster.node("p0")
    assert p0["data_plane"]["channel_setup_s"] is not None
    assert cluster.admin("GET", "/admin/nodes").json()["warm_pairs"] == 1
    assert cluster.metric("pdc_warm_channels") == 1
    assert cluster.metric("pdc_requests_total") == 0  # no request formed it
    assert "data-plane channel to d0" in cluster.log("p0") and "warm over gloo in" in cluster.log("p0")
    assert "channel from prefill node 'p0' warmed" in cluster.log("d0")
    # Both engines ran their warm-up forward before joining.
    for name in ("p0", "d0"):
        assert "engine warmed up" in cluster.log(name)

    # The first request goes through the warm pair, on the channel already there.
    response = httpx.post(cluster.url + "/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert cluster.log("p0").count("data-plane channel to d0 (") == 2  # opened and warmed, once
    assert cluster.log("p0").count(" open over gloo") == 1


def test_a_decode_node_that_joins_later_is_warmed_and_one_that_leaves_is_closed(cluster):
    wait_until(lambda: cluster.health()[0] == 200, 60, "the master to be ready")
    cluster.start_node("decode", "d1", "--data-port", "0")
    wait_until(lambda: cluster.warm_peers("p0") == ["d0", "d1"], 60, "p0 to warm its channel to d1")
    wait_until(lambda: cluster.warm_peers("d1") == ["p0"], 10, "d1 to report the warmed channel")
    assert cluster.health()[1]["warm_pairs"] == 2
    wait_until(lambda: cluster.metric("pdc_warm_channels") == 2, 5, "the gauge")

    # d1 drains and leaves: the master stops listing it and p0 closes its channel.
    assert cluster.admin("POST", "/admin/nodes/d1/drain").status_code == 200
    wait_until(lambda: cluster.warm_peers("p0") == ["d0"], 30, "p0 to drop d1")
    wait_until(lambda: "closed the data-plane channel to" in cluster.log("p0"), 30, "p0 to close d1's channel")
    assert "closed data-plane channel to d1" in cluster.log("p0")
    assert "closed data-plane channel to d0" not in cluster.log("p0")
    wait_until(lambda: cluster.node("d1") is None, 60, "d1 to leave")
    assert cluster.health() == (200, {"status": "ok", "prefill_nodes": 1, "decode_nodes": 1, "mixed_nodes": 0, "warm_pairs": 1})
