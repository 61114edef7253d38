"""`pd-cluster nodes` and `pd-cluster status` against a real `pd-cluster local` cluster on CPU.

The commands find the master's admin token where `pd-cluster local` left it (PD_CLUSTER_HOME),
as an operator on that machine would, and list, watch, drain and remove real nodes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from pd_cluster.admin_cli import format_age, format_bytes, histogram_quantile, node_row
from tests.cluster_harness import free_port, wait_until

MODEL = "SmolLM2-135M-Instruct"


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PD_CLUSTER_TOKEN", "PD_ADMIN_TOKEN", "PD_MASTER_URL")}
    # Every request through a P, so the transfer counters this file reads have bytes to count.
    return {**env, "PD_CLUSTER_HOME": str(home), "PD_LOCAL_PREFILL_MAX_TOKENS": "0", **extra}


class LocalCluster:
    """`pd-cluster local` as a child process, and the admin commands run against it."""

    def __init__(self, home: Path, model_dir: Path, prefill: int, decode: int) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = home / "local.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pd_cluster.cli", "local", "--port", str(self.port), "--model", str(model_dir),
             "--device", "cpu", "--max-total-tokens", "4096", "--prefill", str(prefill), "--decode", str(decode)],
            env=_env(home), stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
        )

    def healthy(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def cli(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pd_cluster.cli", *args], env=_env(self.home, **env),
                              capture_output=True, text=True, timeout=120)

    def nodes_json(self) -> dict[str, dict]:
        done = self.cli("nodes", "list", "--master", self.url, "--json")
        assert done.returncode == 0, done.stderr
        return {n["id"]: n for n in json.loads(done.stdout)["data"]}

    def master_log(self) -> str:
        return (self.home / "local" / "logs" / "master.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def local(default_model_dir, tmp_path_factory):
    cluster = LocalCluster(tmp_path_factory.mktemp("pd-home"), default_model_dir, prefill=2, decode=1)
    try:
        wait_until(cluster.healthy, 240, "the local cluster to be ready")
        wait_until(lambda: len(cluster.nodes_json()) == 3, 60, "all three nodes to register")
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for _ in range(2):  # the second one finds the first one's prefix on D
            reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                                   max_tokens=4, temperature=0)
            assert reply.choices[0].message.content
        yield cluster
    finally:
        cluster.stop()


def test_nodes_list_shows_every_node_as_a_table_and_as_json(local):
    done = local.cli("nodes", "list", "--master", local.url)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no log line per HTTP call: it would break `watch`'s redraw in a terminal
    lines = done.stdout.splitlines()
    header = lines[0].split()
    for column in ("ID", "ROLE", "STATE", "DEVICE", "LOAD", "KV", "USE", "PREFIX", "HIT", "MOVED", "WARM", "AGE"):
        assert column in header
    rows = {line.split()[0]: line for line in lines[1:] if line.strip()}
    assert set(rows) == {"prefill-0", "prefill-1", "decode-0"}
    assert all(" active " in row and " cpu " in row for row in rows.values())

    nodes = local.nodes_json()
    assert sorted(n["role"] for n in nodes.values()) == ["decode", "prefill", "prefill"]
    decode = nodes["decode-0"]
    assert decode["kv"]["total_tokens"] == 4096
    assert decode["prefix"]["hit_rate"] > 0  # the second chat reused the first one's prompt
    assert decode["kv_transfer_bytes"] > 0  # bytes that reached it
    assert sum(nodes[p]["kv_transfer_bytes"] for p in ("prefill-0", "prefill-1")) == decode["kv_transfer_bytes"]
    assert set(decode["data_plane"]["warm_peers"]) == {"prefill-0", "prefill-1"}


def test_nodes_without_an_action_lists_them_from_the_environment(local):
    done = subprocess.run([sys.executable, "-m", "pd_cluster.cli", "nodes"], capture_output=True, text=True,
                          timeout=60, env=_env(local.home, PD_MASTER_URL=local.url))
    assert done.returncode == 0, done.stderr
    assert "decode-0" in done.stdout and "prefill-1" in done.stdout


def test_status_summarizes_traffic_latency_and_nodes(local):
    done = local.cli("status", "--master", local.url, "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["health"]["status"] == "ok" and status["health"]["warm_pairs"] == 2
    summary = status["summary"]
    assert summary["requests"]["ok"] >= 2
    assert 0 < summary["ttft_s"]["p50"] <= summary["ttft_s"]["p99"]
    assert summary["prompt_tokens"] > 0 and summary["generation_tokens"] >= 8
    assert summary["kv_transfer_bytes"] > 0
    assert {n["id"] for n in status["nodes"]} == {"prefill-0", "prefill-1", "decode-0"}

    text = local.cli("status", "--master", local.url)
    assert text.returncode == 0, text.stderr
    assert "serving" in text.stdout and "TTFT p50" in text.stdout and "decode-0" in text.stdout


def test_watch_refreshes_the_table(local):
    done = local.cli("nodes", "watch", "--master", local.url, "--json", "--interval", "0.2", "--count", "3")
    assert done.returncode == 0, done.stderr
    documents = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(documents) == 3
    assert all(len(doc["data"]) == 3 for doc in documents)

    live = local.cli("status", "--watch", "--master", local.url, "--interval", "0.2", "--count", "2")
    assert live.returncode == 0, live.stderr
    assert "prefill-0" in live.stdout


def test_wrong_token_and_unknown_node_are_explained(local):
    refused = local.cli("nodes", "list", "--master", local.url, PD_ADMIN_TOKEN="not-the-token")
    assert refused.returncode == 1
    assert "refused the admin token" in refused.stderr

    unknown = local.cli("nodes", "drain", "no-such-node", "--master", local.url)
    assert unknown.returncode == 1
    assert "no-such-node" in unknown.stderr

    nowhere = local.cli("status", "--master", f"http://127.0.0.1:{free_port()}")
    assert nowhere.returncode == 1 and "cannot reach the master" in nowhere.stderr


def test_set_role_changes_a_node_in_place_and_back(local):
    pid_before = local.nodes_json()["prefill-1"]["registered_at"]
    done = local.cli("nodes", "set-role", "prefill-1", "mixed", "--wait", "--wait-timeout", "120",
                     "--master", local.url)
    assert done.returncode == 0, done.stderr
    assert "prefill-1 serves as mixed" in done.stdout
    node = local.nodes_json()["prefill-1"]
    assert (node["role"], node["state"], node["pending_role"], node["registered_at"]) == (
        "mixed", "active", None, pid_before)
    assert local.healthy()
    back = local.cli("nodes", "set-role", "prefill-1", "prefill", "--wait", "--master", local.url, "--json")
    assert back.returncode == 0, back.stderr
    assert json.loads(back.stdout)["role"] == "prefill"
    unknown = local.cli("nodes", "set-role", "nope", "mixed", "--master", local.url)
    assert unknown.returncode == 1 and "nope" in unknown.stderr


def test_drain_takes_a_node_out_and_it_leaves(local):
    done = local.cli("nodes", "drain", "prefill-1", "--wait", "--wait-timeout", "60", "--master", local.url)
    assert done.returncode == 0, done.stderr
    assert "prefill-1 is draining" in done.stdout
    assert set(local.nodes_json()) == {"prefill-0", "decode-0"}
    assert local.healthy()  # still serving with the other pair


def test_remove_drops_a_node_at_once_and_allow_lets_its_id_back(local):
    joins = local.master_log().count("node prefill-0 joined")
    assert joins >= 1
    done = local.cli("nodes", "remove", "prefill-0", "--master", local.url, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert (doc["id"], doc["deleted"]) == ("prefill-0", True)
    token = (local.home / "local" / "admin-token").read_text().strip()
    listed = httpx.get(local.url + "/admin/nodes", timeout=5, headers={"Authorization": f"Bearer {token}"})
    assert "prefill-0" not in {n["id"] for n in listed.json()["data"]}  # gone at once
    assert "node prefill-0 left: removed by an operator" in local.master_log()

    allowed = local.cli("nodes", "allow", "prefill-0", "--master", local.url)
    assert allowed.returncode == 0, allowed.stderr
    assert "prefill-0 may join again" in allowed.stdout
    again = local.cli("nodes", "allow", "prefill-0", "--master", local.url)
    assert again.returncode == 1 and "is not removed" in again.stderr


# ---- formatting, without a cluster --------------------------------------------------------------


def test_formatting_helpers():
    assert format_bytes(None) == "-" and format_bytes(512) == "512 B" and format_bytes(3 * 2**20) == "3.0 MiB"
    assert [format_age(s) for s in (5, 125, 7300, 90000)] == ["5s", "2m05s", "2h01m", "1d01h"]
    buckets = [(0.1, 0.0), (0.2, 50.0), (0.4, 100.0), (float("inf"), 100.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.2)
    assert histogram_quantile(buckets, 0.75) == pytest.approx(0.3)
    assert histogram_quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None
    row = node_row({"id": "d", "role": "decode", "state": "draining", "device": "cpu", "registered_at": 100,
                    "load": {"running": 2, "waiting": 1}, "kv": {"used_fraction": 0.25, "total_tokens": 64},
                    "prefix": {"hit_rate": 0.5}, "data_plane": {"warm_peers": ["p"]}, "kv_transfer_bytes": 2048},
                   now=161)
    assert row == ("d", "decode", "draining", "cpu", "2 run / 1 wait", "25% of 64", "50%", "2.0 KiB", "p", "1m01s")
    limited = node_row({"id": "d", "load": {"running": 3, "waiting": 0}, "capacity": {"max_running_requests": 256}},
                       now=0)
    assert limited[4] == "3/256 run / 0 wait"
    switching = node_row({"id": "p", "role": "prefill", "pending_role": "mixed", "state": "switching"}, now=0)
    assert switching[1:3] == ("prefill -> mixed", "switching")
