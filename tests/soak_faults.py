"""Soak under faults (not part of the test suite): mixed load on a real loopback cluster for a
while, with a fault injected every few minutes, then a report of errors, hangs and memory growth.

    python -m tests.soak_faults --minutes 30 --fault-every 180 --out soak.json

The cluster is the one of tests/cluster/test_faults_cluster.py (two peer masters, two P, two D). Faults
rotate: kill -9 a P, kill -9 a D, SIGSTOP a D for 8 s, remove a busy D (then allow it back), kill
-9 a master (then start it again). Clients retry a request once on the other master when theirs
is gone, as a client behind a load balancer would.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import logging
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai

from tests.cluster.test_faults_cluster import MODEL, PeerMastersCluster, _client, _restart

logger = logging.getLogger("soak")

FAULTS = ("kill_prefill", "kill_decode", "sigstop_decode", "remove_decode", "kill_master")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Load:
    """Clients sending a mix of chat/completion, streaming/not, short/long requests until stopped."""

    def __init__(self, cluster: PeerMastersCluster, concurrency: int) -> None:
        self.clients = [_client(cluster.url), _client(cluster.url_b)]
        self.concurrency = concurrency
        self.stop = threading.Event()
        self.counts = {"ok": 0, "error": 0, "retried": 0}
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def _one(self, rng: random.Random) -> None:
        first = rng.randrange(2)
        for attempt in range(2):
            client = self.clients[(first + attempt) % 2]
            try:
                max_tokens = rng.choice([8, 32, 96])
                if rng.random() < 0.5:
                    stream = client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"Tell me about {rng.randrange(10**6)}."}],
                        max_tokens=max_tokens, temperature=0, stream=True)
                    finish = [c.choices[0].finish_reason for c in stream if c.choices][-1]
                else:
                    reply = client.completions.create(model=MODEL, prompt=f"Number {rng.randrange(10**6)} is",
                                                      max_tokens=max_tokens, temperature=0)
                    finish = reply.choices[0].finish_reason
                with self.lock:
                    self.counts["ok" if finish in ("stop", "length") else "error"] += 1
                return
            except (openai.APIConnectionError, httpx.HTTPError) as e:
                if attempt == 0:
                    with self.lock:
                        self.counts["retried"] += 1
                    continue
                self._error(e)
            except openai.APIError as e:
                self._error(e)
                return

    def _error(self, e: Exception) -> None:
        with self.lock:
            self.counts["error"] += 1
            if len(self.errors) < 50:
                self.errors.append(f"{type(e).__name__}: {e}")

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            self._one(rng)


def inject(cluster: PeerMastersCluster, fault: str) -> None:
    decodes = [n for n in cluster.nodes() if n["role"] == "decode"]
    busy = max(decodes, key=lambda n: n["load"]["running"])["id"] if decodes else "d0"
    logger.info("fault: %s (%s)", fault, "p0" if fault == "kill_prefill" else "master" if fault == "kill_master" else busy)
    if fault == "kill_prefill":
        cluster.kill("p0")
        _restart(cluster, "p0", "prefill")
    elif fault == "kill_decode":
        cluster.kill(busy)
        _restart(cluster, busy, "decode")
    elif fault == "sigstop_decode":
        pid = cluster.procs[busy].pid
        os.kill(pid, signal.SIGSTOP)
        time.sleep(8.0)  # past the heartbeat timeout: it is evicted
        os.kill(pid, signal.SIGCONT)
    elif fault == "remove_decode":
        cluster.admin("DELETE", f"/admin/nodes/{busy}")
        time.sleep(5.0)
        cluster.admin("POST", f"/admin/nodes/{busy}/allow")
    elif fault == "kill_master":
        cluster.kill("master")
        time.sleep(2.0)
        cluster.start_master()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    parser.add_argument("--fault-every", type=float, default=180.0, help="seconds between two faults")
    parser.add_argument("--concurrency", type=int, default=12, help="clients sending requests at once")
    parser.add_argument("--out", default=None, help="write the JSON report here too")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from pd_cluster.default_model import default_model_path

    cluster = PeerMastersCluster(default_model_path(), Path(tempfile.mkdtemp(prefix="soak-logs-")))
    report: dict = {"minutes": args.minutes, "faults": []}
    try:
        cluster.start_master()
        cluster.start_master_b()
        for role, name in (("prefill", "p0"), ("prefill", "p1"), ("decode", "d0"), ("decode", "d1")):
            cluster.start_peer_node(role, name)
        rss_start = {name: (p.pid, _rss_kib(p.pid)) for name, p in cluster.procs.items()}
        load = Load(cluster, args.concurrency)
        with cf.ThreadPoolExecutor(args.concurrency) as pool:
            for i in range(args.concurrency):
                pool.submit(load.worker, i)
            end = time.monotonic() + args.minutes * 60
            faults = itertools.cycle(FAULTS)
            while time.monotonic() < end:
                time.sleep(min(args.fault_every, max(end - time.monotonic(), 0)))
                if time.monotonic() < end:
                    fault = next(faults)
                    inject(cluster, fault)
                    report["faults"].append(fault)
            load.stop.set()
        # Memory of the processes that lived through the whole run (restarted ones start over).
        report["rss_kib"] = {
            name: {"start": rss_start[name][1], "end": _rss_kib(p.pid)}
            for name, p in cluster.procs.items() if p.poll() is None and rss_start.get(name, (0,))[0] == p.pid
        }
        report.update(requests=load.counts, first_errors=load.errors)
        logger.info("process logs in %s", cluster.log_dir)
    finally:
        cluster.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report.get("requests", {}).get("error", 1) == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
