"""Several masters, none special: a node registers with every master it is given, each master
sees it from the node's own reports, and a restarted master is found again within 2 s."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
from pydantic import BaseModel

from pd_cluster import protocol
from pd_cluster.node.master_links import MasterLinks, master_urls
from tests.master_fakes import CLUSTER_TOKEN, LiveMaster, make_settings, register_msg, wait_until, write_model_dir


class Node:
    """A node's links to its masters, with a recorder for what the masters send."""

    def __init__(self, masters: list[str], node_id: str, role: str) -> None:
        self.received: list[BaseModel] = []
        self.links = MasterLinks(masters, CLUSTER_TOKEN, register_msg(node_id, role), self.status, self.on_message,
                                 resolve_every_s=0.2)
        self.task: asyncio.Task | None = None

    def status(self) -> protocol.NodeStatus:
        return protocol.NodeStatus(free_kv_tokens=4096, total_kv_tokens=4096)

    async def on_message(self, message: BaseModel) -> None:
        self.received.append(message)

    async def __aenter__(self) -> "Node":
        self.task = asyncio.create_task(self.links.run())
        return self

    async def __aexit__(self, *exc) -> None:
        await self.links.close()
        assert self.task is not None
        await asyncio.wait_for(self.task, 15.0)


def _listening_on(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


def test_master_urls_take_a_comma_separated_list():
    assert master_urls("http://a:1, http://b:2,,http://a:1") == ["http://a:1", "http://b:2"]
    assert master_urls(["http://a:1"]) == ["http://a:1"]
    with pytest.raises(ValueError):
        master_urls(" , ")


async def test_a_node_registers_with_every_master_and_job_frames_go_to_their_master(tmp_path: Path):
    model = write_model_dir(tmp_path)
    async with LiveMaster(make_settings(model)) as a, LiveMaster(make_settings(model)) as b:
        async with Node([a.base_url, b.base_url], "p0", "prefill") as p, Node(f"{a.base_url},{b.base_url}", "d0", "decode") as d:
            for master in (a, b):
                await wait_until(lambda m=master: {"p0", "d0"} <= set(m.ctx.registry.nodes), 10.0, "both nodes on both")
            await wait_until(p.links.registered.is_set, 5.0, "the links")
            # A job from master a: P's answer goes to a only (b never heard of the request).
            job = protocol.PrefillJob(request_id="job-a", token_ids=[5, 6], sampling={"max_tokens": 2},
                                      decode_node_id="d0", decode_address="127.0.0.1:1", deadline_s=5.0)
            a.ctx.registry.nodes["p0"].send(job)
            await wait_until(lambda: any(isinstance(m, protocol.PrefillJob) for m in p.received), 5.0, "the job")
            seen: dict[str, list[str]] = {"a": [], "b": []}
            a.ctx.relay.on_kv_transferred = lambda node, msg: seen["a"].append(msg.request_id)  # type: ignore[method-assign]
            b.ctx.relay.on_kv_transferred = lambda node, msg: seen["b"].append(msg.request_id)  # type: ignore[method-assign]
            p.links.send_nowait(protocol.KVTransferred(request_id="job-a", bytes=1, seconds=0.1))
            await wait_until(lambda: seen["a"] == ["job-a"], 5.0, "the frame at master a")
            # A frame of a request the node got no job for (a D's tokens) goes to every master.
            p.links.send_nowait(protocol.KVTransferred(request_id="unknown", bytes=1, seconds=0.1))
            await wait_until(lambda: "unknown" in seen["a"] and "unknown" in seen["b"], 5.0, "the frame at both")
            assert seen["b"] == ["unknown"]


async def test_a_restarted_master_is_found_again_within_two_seconds(tmp_path: Path):
    model = write_model_dir(tmp_path)
    async with LiveMaster(make_settings(model)) as a:
        b = LiveMaster(make_settings(model))
        port = b.port
        await b.__aenter__()
        async with Node([a.base_url, b.base_url], "d0", "decode") as d:
            await wait_until(lambda: "d0" in b.ctx.registry.nodes and "d0" in a.ctx.registry.nodes, 10.0, "joined")
            await b.__aexit__(None, None, None)
            await wait_until(lambda: len([x for x in d.links.agents.values() if x.registered.is_set()]) == 1,
                             10.0, "the link to the stopped master to drop")
            await asyncio.sleep(3.0)  # down for a while: the link's backoff has grown to its cap
            restarted = LiveMaster(make_settings(model))
            restarted._sock.close()
            restarted._sock = _listening_on(port)
            restarted.port, restarted.base_url = port, f"http://127.0.0.1:{port}"
            restarted.ws_url = f"ws://127.0.0.1:{port}{protocol.NODE_WS_PATH}"
            await restarted.__aenter__()
            started = time.monotonic()
            await wait_until(lambda: "d0" in restarted.ctx.registry.nodes, 5.0, "the node back on the restarted master")
            assert time.monotonic() - started < 2.0
            assert "d0" in a.ctx.registry.nodes  # the other master never lost it
            await restarted.__aexit__(None, None, None)


def test_the_ray_launcher_starts_masters_as_peers_on_their_own_ports():
    from pd_cluster.cli import build_parser
    from pd_cluster.ray_launcher.spec import ClusterSpec, master_actor_name, master_index

    spec = ClusterSpec(masters=2, port=9000, gpus_per_node=0)
    names = [master_actor_name(i) for i in range(spec.masters)]
    assert names == ["master", "master-1"] and [master_index(n) for n in names] == [0, 1]
    assert master_index("decode-1") is None and master_index("master-x") is None
    ports = [spec.master_argv(i)[spec.master_argv(i).index("--port") + 1] for i in range(2)]
    assert ports == ["9000", "9001"]
    # Nodes are given every master, comma-separated, and register with each.
    argv = spec.node_argv("decode", "decode-0", "http://10.0.0.1:9000,http://10.0.0.1:9001", "10.0.0.7")
    assert master_urls(argv[argv.index("--master") + 1]) == ["http://10.0.0.1:9000", "http://10.0.0.1:9001"]
    args = build_parser().parse_args(["ray", "start", "--masters", "2"])
    assert args.masters == 2


async def test_a_name_that_resolves_to_several_addresses_is_one_master_per_address(monkeypatch):
    """A headless Service's name resolves to every master pod: the node links to each."""
    answers = {"masters.internal": ["10.0.0.1", "10.0.0.2", "10.0.0.1"], "one.internal": ["10.0.0.9"]}

    async def getaddrinfo(host, port, **kwargs):
        return [(2, 1, 6, "", (address, port)) for address in answers[host]]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    node = Node(["http://masters.internal:8000", "http://one.internal:9000", "http://127.0.0.1:7000"], "d0", "decode")
    assert await node.links._targets() == {
        f"ws://10.0.0.1:8000{protocol.NODE_WS_PATH}", f"ws://10.0.0.2:8000{protocol.NODE_WS_PATH}",
        f"ws://one.internal:9000{protocol.NODE_WS_PATH}", f"ws://127.0.0.1:7000{protocol.NODE_WS_PATH}",
    }


async def test_a_node_that_loses_a_master_is_told_which_one_and_its_request_ids_name_it(tmp_path: Path):
    model = write_model_dir(tmp_path)
    async with LiveMaster(make_settings(model)) as a:
        b = LiveMaster(make_settings(model))
        await b.__aenter__()
        lost: list[str] = []
        async with Node([a.base_url, b.base_url], "d0", "decode") as d:
            d.links.on_master_lost = lost.append
            await wait_until(lambda: "d0" in a.ctx.registry.nodes and "d0" in b.ctx.registry.nodes, 10.0, "joined")
            # Each master names itself in its answer to the registration, which the node reads
            # after the master has listed it.
            ids = {a.ctx.relay.instance_id, b.ctx.relay.instance_id}
            await wait_until(lambda: {x.master_id for x in d.links.agents.values()} == ids, 10.0,
                             "each link to know its master's id")
            assert a.ctx.relay.instance_id in a.ctx.relay.new_request_id("cmpl")
            await b.__aexit__(None, None, None)
            await wait_until(lambda: lost, 10.0, "the lost link to be reported")
            assert lost == [b.ctx.relay.instance_id]


def test_the_workers_count_a_keys_generations_in_one_table(tmp_path: Path):
    """Each worker adds to its own row and checks the column's sum, so a key's limit holds across
    the workers; a dead worker's row is forgotten, and a worker restarted after the keys file
    changed finds the columns by the keys' hashes."""
    from master.key_counts import SharedKeyCounts

    supervisor = SharedKeyCounts.create(tmp_path / "table", workers=2)
    first, second = (SharedKeyCounts(tmp_path / "table", 2, row) for row in (0, 1))
    assert first.try_add("key-a", 2, limit=3) == 0
    assert second.try_add("key-a", 2, limit=3) is None  # 2 + 2 > 3, though the second worker runs none
    assert second.try_add("key-a", 1, limit=3) == 2 and first.running("key-a") == 3
    assert second.try_add("key-b", 5, limit=None) == 0 and first.running("key-b") == 5  # a column of its own
    supervisor.forget_row(0)  # the first worker died: its two generations died with it
    assert second.running("key-a") == 1
    restarted = SharedKeyCounts(tmp_path / "table", 2, 0)
    assert restarted.running("key-b") == 5 and restarted.try_add("key-a", 2, limit=3) == 1
    restarted.sub("key-a", 2)
    second.sub("key-a", 1)
    assert first.running("key-a") == 0
    for table in (supervisor, first, second, restarted):
        table.close()
    with pytest.raises(ValueError, match="not a key-count table for 3 workers"):
        SharedKeyCounts(tmp_path / "table", 3, 0)


def test_several_workers_take_per_key_limits(tmp_path: Path):
    from master.app import api_keys_from
    from master.config import MasterSettings

    keys = tmp_path / "keys"
    keys.write_text("key-a 3\n")
    assert api_keys_from(MasterSettings(cluster_token="t", workers=2, api_keys_file=keys)).limit_of("key-a") == 3
    assert MasterSettings(cluster_token="t", workers=2, max_concurrent_per_key=2).max_concurrent_per_key == 2
    assert MasterSettings(cluster_token="t", port=9000, workers=3).worker_port(2) == 9003
