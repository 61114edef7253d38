"""A real cluster on loopback for tests: master and nodes started through the CLI."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests import process_server
from tests.process_server import ForkedProcess
from tests.tls_files import TLSFiles

CLUSTER_TOKEN = "e2e-cluster-token"
ADMIN_TOKEN = "e2e-admin-token"
#: Start masters and nodes as fresh interpreters instead of forking them from the process server.
FRESH_PROCESSES = os.environ.get("PD_TESTS_FRESH_PROCESSES") == "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free ports, below the kernel's ephemeral range: a port
    after one the kernel handed out is likely to be handed to someone's outgoing connection next,
    which would take a master worker's private port before it binds it."""
    import random

    low, _ = _ephemeral_range()
    top = low - count if low > 20000 + count else 65536 - count
    for _ in range(200):
        base = random.randrange(20000, top)
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no run of {count} free ports")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Cluster:
    model_dir: Path
    log_dir: Path
    port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen | ForkedProcess] = field(default_factory=dict)
    node_args: tuple[str, ...] = ("--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096")
    #: The master's ``local_prefill_max_tokens``: 0 sends every request through a P (the tests of
    #: the P -> D path); tests of D-local prefill and mixed nodes set it.
    local_prefill_max_tokens: int = 0
    #: The master serves HTTPS with these, the nodes check it (and decode nodes' data planes) with their CA.
    tls: TLSFiles | None = None
    #: More environment for every process (``PD_*`` settings of the master or the nodes).
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """What this harness's own requests check the master's certificate with."""
        return ssl.create_default_context(cafile=str(self.tls.ca)) if self.tls else True

    def tls_args(self, role: str) -> list[str]:
        if self.tls is None:
            return []
        files = ["--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key)]
        return files if role == "master" else ["--tls-ca", str(self.tls.ca), *(files if role != "prefill" else [])]

    def env(self, token: str = CLUSTER_TOKEN) -> dict[str, str]:
        # One compute thread a process: the nodes share the runner's cores, and torch's default (a
        # thread per core in each of them) oversubscribes two cores into spinning (a third slower).
        return {**os.environ, "PD_CLUSTER_TOKEN": token, "PD_ADMIN_TOKEN": ADMIN_TOKEN, "PYTHONUNBUFFERED": "1",
                "PD_LOCAL_PREFILL_MAX_TOKENS": str(self.local_prefill_max_tokens), "OMP_NUM_THREADS": "1",
                **self.extra_env}

    def _spawn(self, name: str, args: list[str], token: str = CLUSTER_TOKEN) -> subprocess.Popen | ForkedProcess:
        """``python -m pd_cluster.cli *args``, forked from the process server (tests/process_server.py:
        the same command without re-importing torch and transformers), or a fresh interpreter with
        PD_TESTS_FRESH_PROCESSES=1."""
        if FRESH_PROCESSES:
            log = open(self.log_dir / f"{name}.log", "wb")
            proc = subprocess.Popen([sys.executable, "-m", "pd_cluster.cli", *args], env=self.env(token),
                                    stdout=log, stderr=subprocess.STDOUT)
        else:
            proc = process_server.start(args, self.env(token), self.log_dir / f"{name}.log")
        self.procs[name] = proc
        return proc

    def start_master(self, *extra: str, policy: str = "cache_aware") -> None:
        self._spawn("master", ["master", "--host", "127.0.0.1", "--port", str(self.port), "--model",
                               str(self.model_dir), "--policy", policy, *self.tls_args("master"), *extra])
        wait_until(lambda: self._get("/livez") == 200, 60, "the master to serve")

    def start_node(self, role: str, name: str, *extra: str, token: str = CLUSTER_TOKEN,
                   model: Path | None = None, wait: bool = True, tls: bool = True) -> subprocess.Popen | ForkedProcess:
        args = [role, "--master", self.url, "--node-id", name, "--model", str(model or self.model_dir),
                *self.node_args, *(self.tls_args(role) if tls else []), *extra]
        proc = self._spawn(name, args, token)
        if wait:
            wait_until(lambda: self.node(name) is not None or proc.poll() is not None, 120, f"{name} to join")
            assert proc.poll() is None, f"{name} exited: {self.log(name)[-2000:]}"
        return proc

    def _get(self, path: str, **kw) -> int:
        try:
            return httpx.get(self.url + path, timeout=5, verify=self.verify, **kw).status_code
        except httpx.HTTPError:
            return 0

    def health(self) -> tuple[int, dict]:
        """/health's status code and body ((0, {}) while the master does not answer)."""
        try:
            response = httpx.get(self.url + "/health", timeout=5, verify=self.verify)
        except httpx.HTTPError:
            return 0, {}
        return response.status_code, response.json()

    def warm_peers(self, name: str) -> list[str] | None:
        """What node ``name`` last reported as warm data-plane peers (None: not registered)."""
        node = self.node(name)
        return None if node is None else node["data_plane"]["warm_peers"]

    def admin(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        return httpx.request(method, self.url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10,
                             verify=self.verify, json=body)

    def nodes(self) -> list[dict]:
        return self.admin("GET", "/admin/nodes").json()["data"]

    def node(self, name: str) -> dict | None:
        return next((n for n in self.nodes() if n["id"] == name), None)

    def metric(self, name: str) -> float:
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=5, verify=self.verify).text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                head, value = line.rsplit(" ", 1)
                if head == name or head.startswith(name + "{"):
                    total += float(value)
        return total

    def log(self, name: str) -> str:
        """What ``name`` logged so far ("" until its process, forked a moment ago, opens its log)."""
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in self.procs.values():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def status_of(url: str) -> int:
    """The HTTP status ``url`` answers a GET with (0: no answer)."""
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


class TwoMastersCluster(Cluster):
    """Two peer masters (``master`` and ``master-b``); every node started with
    :meth:`start_peer_node` registers with both."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        super().__init__(model_dir, log_dir)
        self.port_b = free_port()

    @property
    def url_b(self) -> str:
        return f"http://127.0.0.1:{self.port_b}"

    def start_master_b(self) -> None:
        self._spawn("master-b", ["master", "--host", "127.0.0.1", "--port", str(self.port_b), "--model",
                                 str(self.model_dir)])
        wait_until(lambda: status_of(self.url_b + "/livez") == 200, 60, "master b to serve")

    def start_peer_node(self, role: str, name: str, *extra: str) -> subprocess.Popen | ForkedProcess:
        args = [role, "--master", f"{self.url},{self.url_b}", "--node-id", name, "--model", str(self.model_dir),
                *self.node_args, *extra]
        proc = self._spawn(name, args)
        wait_until(lambda: self.node(name) is not None or proc.poll() is not None, 120, f"{name} to join")
        assert proc.poll() is None, f"{name} exited: {self.log(name)[-2000:]}"
        return proc

    def nodes_at(self, url: str) -> list[dict]:
        response = httpx.get(url + "/admin/nodes", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
        return response.json()["data"]
