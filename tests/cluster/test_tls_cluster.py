"""A cluster with TLS on: the master serves HTTPS and wss://, decode nodes' data planes take TLS
control connections, nodes check both against the CA, and a node without the CA cannot join."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.cluster_harness import Cluster, wait_until
from tests.tls_files import make_tls_files

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    tls = make_tls_files(tmp_path_factory.mktemp("tls"))
    c = Cluster(default_model_dir, tmp_path_factory.mktemp("tls-cluster-logs"), tls=tls)
    try:
        c.start_master()
        c.start_node("decode", "d0")
        c.start_node("prefill", "p0")
        wait_until(lambda: c.warm_peers("p0") == ["d0"], 60, "p0 to warm its TLS channel to d0")
        yield c
    finally:
        c.stop()


def test_a_request_goes_through_the_master_over_https_and_p_to_d_over_tls(cluster):
    assert cluster.url.startswith("https://")
    with httpx.Client(verify=cluster.verify) as http:
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                               http_client=http)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                               temperature=0, max_tokens=8)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
    assert cluster.metric("pdc_kv_transfer_bytes_total") > 0  # prefilled on p0, handed to d0
    assert "(cpu, TLS)" in cluster.log("d0")  # its data plane listens for TLS only
    assert "control over TLS" in cluster.log("p0")
    with pytest.raises(httpx.HTTPError):  # no plain HTTP next to it
        httpx.get(cluster.url.replace("https://", "http://") + "/health", timeout=5)


def test_a_node_without_the_ca_cannot_join(cluster):
    node = cluster.start_node("prefill", "p-no-ca", wait=False, tls=False)
    try:
        wait_until(lambda: "CERTIFICATE_VERIFY_FAILED" in cluster.log("p-no-ca") or node.poll() is not None, 120,
                   "the node to fail to check the master's certificate")
        assert node.poll() is None  # it keeps knocking: a master with a good certificate may come
        assert cluster.node("p-no-ca") is None
    finally:
        node.kill()
        node.wait(10)
