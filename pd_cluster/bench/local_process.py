"""``pd-cluster local`` as a benchmark or a test starts it: a child process waited for until every
node serves, its launcher's log and placement table read, stopped as operators stop it; and what
the master reports of each node's capacity.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from pd_cluster.local_cluster import admin_token_path

logger = logging.getLogger(__name__)


class LocalClusterProcess:
    """``pd-cluster local`` as a child process, stopped with SIGTERM (its documented stop)."""

    def __init__(self, args: list[str], log_path: Path, port: int, env: dict[str, str] | None = None,
                 log_dir: Path | None = None) -> None:
        #: Where the launcher writes each process's log (``--log-dir``); None: its default.
        self.log_dir = log_dir
        self.args = args + (["--log-dir", str(log_dir)] if log_dir is not None else [])
        self.env = env
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    def start(self, timeout: float) -> float:
        log = open(self.log_path, "wb")
        started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "pd_cluster.cli", "local", *self.args],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        deadline = started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pd-cluster local exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                # The launcher says it serves once every one of its nodes is active (/health is ok earlier:
                # a decode node alone can serve).
                if (httpx.get(self.url + "/health", timeout=2).status_code == 200
                        and READY_LINE in self.log_path.read_text(errors="replace")):
                    self.ready_s = time.monotonic() - started
                    return self.ready_s
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"pd-cluster local not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def wait_for_line(self, marker: str, timeout: float) -> str:
        """The launcher's log once it holds ``marker`` (the placement table follows readiness)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            if marker in text:
                return text
            time.sleep(0.5)
        return self.log_path.read_text(errors="replace")

    def master_log(self) -> str:
        """The master's own log (its request lines), when the launcher was given a log directory."""
        path = self.log_dir / "master.log" if self.log_dir is not None else None
        return path.read_text(errors="replace") if path is not None and path.is_file() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 90.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)


PLACEMENT_HEADER = ("NODE", "ROLE", "GPU")
#: What ``pd-cluster local`` prints once all its nodes are active.
READY_LINE = "pd-cluster is serving at"


def placement_table(log: str) -> str:
    """The launcher's placement table: the block of lines from its ``NODE ROLE GPU ...`` header."""
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if tuple(line.split()[:3]) == PLACEMENT_HEADER), None)
    if start is None:
        return ""
    block = []
    for line in lines[start:]:
        if block and not line.strip():
            break
        block.append(line)
    return "\n".join(block)


def node_capacities(url: str) -> list[dict[str, Any]]:
    """Each node's role and capacity (batch limit, KV tokens) as the master reports them, read with
    the admin token ``pd-cluster local`` keeps; empty when it cannot be read."""
    try:
        token = admin_token_path().read_text().strip()
        answer = httpx.get(url + "/admin/nodes", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        answer.raise_for_status()
    except (OSError, httpx.HTTPError) as e:
        logger.warning("node capacities not read: %s", type(e).__name__)
        return []
    return [{"id": n["id"], "role": n["role"], "capacity": n["capacity"], "kv_total_tokens": n["kv"]["total_tokens"]}
            for n in answer.json()["data"]]
