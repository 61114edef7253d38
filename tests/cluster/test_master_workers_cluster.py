"""A master of two worker processes on one public port (``pd-cluster master --workers 2``): clients
reach both workers through the one port, a node that dials the public address links to each worker,
an operator's change on one worker is applied by the other, a key's concurrency limit holds across
the workers (and a killed worker's share of it is given back), and a worker killed with -9 is
restarted and linked again while the other keeps serving."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal

import httpx
import openai
import pytest

from tests.cluster_harness import ADMIN_TOKEN, Cluster, free_port_run, status_of, wait_until
from tests.reference import CHAT_MESSAGES

MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 8
WORKERS = 2


#: The clients' keys: the tests' usual one without a limit, and one that may run one generation.
KEYS = "unused\nsk-one 1\n"


class WorkersCluster(Cluster):
    def start_master(self, policy: str = "cache_aware") -> None:
        self.worker_base = free_port_run(WORKERS)
        keys = self.log_dir / "api-keys"
        keys.write_text(KEYS)
        self._spawn("master", ["master", "--host", "127.0.0.1", "--port", str(self.port), "--model",
                               str(self.model_dir), "--policy", policy, "--workers", str(WORKERS),
                               "--worker-ports", str(self.worker_base), "--api-keys-file", str(keys)])
        for url in self.worker_urls:
            wait_until(lambda u=url: status_of(u + "/livez") == 200, 90, f"worker {url} to serve")

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.worker_base + i}" for i in range(WORKERS)]

    def nodes_at(self, url: str) -> dict[str, dict]:
        answer = httpx.get(url + "/admin/nodes", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
        return {node["id"]: node for node in answer.json()["data"]}

    def worker_pid(self, index: int) -> int:
        """The pid of worker ``index``'s latest start."""
        return int(re.findall(rf"master worker {index} started \(pid (\d+)\)", self.log("master"))[-1])

    def served_by(self) -> list[int]:
        """Requests each worker logged as served."""
        log = self.log("master")
        return [len(re.findall(rf"worker-{i} master\.requests", log)) for i in range(WORKERS)]


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    c = WorkersCluster(default_model_dir, tmp_path_factory.mktemp("workers-logs"))
    try:
        c.start_master()
        c.start_node("prefill", "p0")
        c.start_node("decode", "d0", "--data-port", "0")
        for url in c.worker_urls:
            wait_until(lambda u=url: {"p0", "d0"} <= set(c.nodes_at(u)), 60, f"both nodes on {url}")
        wait_until(lambda: status_of(c.url + "/health") == 200, 30, "health")
        yield c
    finally:
        c.stop()


def _client(base_url: str, key: str = "unused") -> openai.OpenAI:
    """A client of its own: a connection of its own, which the kernel gives to some worker."""
    return openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def _expected(tokenizer, hf_reference, prompt_ids: list[int]) -> str:
    return tokenizer.decode(hf_reference.greedy(prompt_ids, NEW_TOKENS), skip_special_tokens=True)


def _stream(base_url: str, message: str) -> str:
    with _client(base_url) as client:
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": message}], stream=True, temperature=0,
            max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_streams_through_both_workers_match_transformers(cluster, chat_prompts, tokenizer, hf_reference):
    want = {m: _expected(tokenizer, hf_reference, ids) for m, ids in list(zip(CHAT_MESSAGES, chat_prompts))[:2]}
    sent = 0
    for round_ in range(12):  # each stream a new connection: the kernel spreads them over the workers
        with cf.ThreadPoolExecutor(4) as pool:
            messages = [list(want)[(round_ + i) % len(want)] for i in range(4)]
            for message, text in zip(messages, pool.map(lambda m: _stream(cluster.url, m), messages)):
                assert text == want[message]
        sent += 4
        if all(cluster.served_by()):
            break
    served = wait_until(lambda: sum(cluster.served_by()) == sent and cluster.served_by(), 10, "request lines")
    assert all(served), f"one worker served every request: {served}"
    # /metrics on any worker reports the whole master.
    for url in cluster.worker_urls:
        text = httpx.get(url + "/metrics", timeout=5).text
        assert f'pdc_requests_total{{status="ok"}} {float(sent)}' in text


def test_a_node_dialling_the_public_address_links_to_every_worker(cluster):
    for url in cluster.worker_urls:
        nodes = cluster.nodes_at(url)
        assert nodes["p0"]["state"] == nodes["d0"]["state"] == "active"
    assert "runs 2 workers; linking to each" in cluster.log("d0")


def test_a_killed_worker_is_restarted_and_linked_again_while_the_other_serves(cluster, chat_prompts, tokenizer,
                                                                             hf_reference):
    message = CHAT_MESSAGES[0]
    want = _expected(tokenizer, hf_reference, chat_prompts[0])
    survivor, victim = cluster.worker_urls
    old_pid = cluster.worker_pid(1)
    with cf.ThreadPoolExecutor(3) as pool:
        during = [pool.submit(_stream, survivor, message) for _ in range(6)]
        os.kill(old_pid, signal.SIGKILL)
        assert [f.result() for f in during] == [want] * 6  # the other worker failed none
    wait_until(lambda: cluster.worker_pid(1) != old_pid, 30, "the worker to be restarted")
    wait_until(lambda: status_of(victim + "/livez") == 200, 90, "the restarted worker to serve")
    wait_until(lambda: {"p0", "d0"} <= set(cluster.nodes_at(victim)), 30, "the nodes to link to it again")
    wait_until(lambda: status_of(victim + "/health") == 200, 30, "the restarted worker's health")
    assert _stream(victim, message) == want
    assert _stream(survivor, message) == want


def test_a_keys_limit_holds_across_the_workers_and_a_killed_workers_share_is_given_back(cluster):
    """``sk-one`` may run one generation: while it streams on one worker, the other refuses it
    (429); once the streaming worker is killed, what it ran is no longer counted."""
    first, second = cluster.worker_urls
    holder_pid = cluster.worker_pid(0)
    with _client(first, "sk-one") as holder, _client(second, "sk-one") as other:
        stream = holder.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count on."}],
                                                stream=True, max_tokens=300, extra_body={"ignore_eos": True})
        next(iter(stream))  # the stream runs on the first worker
        with pytest.raises(openai.RateLimitError) as limited:
            other.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert "1 running, this request needs 1, the limit is 1" in limited.value.message
        os.kill(holder_pid, signal.SIGKILL)
        stream.close()

        def admitted() -> bool:
            try:
                other.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            except openai.RateLimitError:
                return False
            return True

        wait_until(admitted, 30, "the killed worker's generation to be given back")
    wait_until(lambda: cluster.worker_pid(0) != holder_pid, 30, "the worker to be restarted")
    wait_until(lambda: status_of(first + "/livez") == 200, 90, "the restarted worker to serve")
    wait_until(lambda: {"p0", "d0"} <= set(cluster.nodes_at(first)), 30, "the nodes to link to it again")
    wait_until(lambda: status_of(first + "/health") == 200, 30, "the restarted worker's health")


def test_an_operator_change_on_one_worker_is_applied_by_every_worker(cluster):
    first, second = cluster.worker_urls
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    removed = httpx.delete(first + "/admin/nodes/d0", headers=auth, timeout=20)
    assert removed.status_code == 200, removed.text
    assert "workers_failed" not in removed.json()
    wait_until(lambda: "d0" not in cluster.nodes_at(second), 10, "d0 removed on the other worker")
    allowed = httpx.post(second + "/admin/nodes/d0/allow", headers=auth, timeout=20)
    assert allowed.status_code == 200, allowed.text
    for url in cluster.worker_urls:  # allowed on both: it joins both again
        wait_until(lambda u=url: "d0" in cluster.nodes_at(u), 30, f"d0 back on {url}")
    drained = httpx.post(second + "/admin/nodes/d0/drain", headers=auth, timeout=20)
    assert drained.status_code == 200, drained.text
    assert cluster.nodes_at(first).get("d0", {"state": "draining"})["state"] == "draining"

