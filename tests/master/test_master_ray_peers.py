"""The Ray launcher starts two peer masters: every node registers with both, and either serves."""

from __future__ import annotations

import socket

# First: it sets up Ray for loopback before Ray is imported, and holds the local Ray fixture.
from tests.deploy.test_ray_launcher import ray_address  # noqa: F401, I001

import httpx
import openai

from pd_cluster.ray_launcher.launcher import RayLauncher
from pd_cluster.ray_launcher.spec import ClusterSpec
from tests.cluster_harness import wait_until

NAMESPACE = "pd-cluster-test-peers"


def _free_port_pair() -> int:
    """A port p with p + 1 free too (master i listens on port + i)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two adjacent free ports")


def test_two_masters_on_ray_both_hold_every_node_and_serve(ray_address, default_model_dir):  # noqa: F811
    port = _free_port_pair()
    spec = ClusterSpec(namespace=NAMESPACE, model=str(default_model_dir), port=port, masters=2, gpus_per_node=0,
                       device="cpu", max_total_tokens=4096, drain_timeout_s=60)
    launcher = RayLauncher(namespace=NAMESPACE, address=ray_address)
    try:
        urls = launcher.start(spec, prefill=1, decode=1, timeout=150).split(",")
        assert urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        assert {"master", "master-1", "prefill-0", "decode-0"} <= set(launcher.actor_names())
        admin = {"Authorization": f"Bearer {launcher.tokens()['admin']}"}
        for url in urls:
            wait_until(lambda u=url: httpx.get(u + "/health", timeout=5).status_code == 200, 60, f"{url} ready")
            nodes = httpx.get(url + "/admin/nodes", headers=admin, timeout=10).json()["data"]
            assert sorted(n["id"] for n in nodes) == ["decode-0", "prefill-0"]
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            model = client.models.list().data[0].id
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, temperature=0)
            assert reply.choices[0].message.content is not None
    finally:
        stopped = launcher.stop(timeout=30)
    assert {"master", "master-1"} <= set(stopped) and not launcher.actor_names()
