"""`pd-cluster local`: master + 1 P + 1 D (or one mixed node) as processes on this machine, stopped by Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from tests.cluster_harness import free_port, wait_until


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("nodes, roles", [
    ((), ["decode", "prefill"]),
    (("--prefill", "0", "--decode", "0", "--mixed", "1"), ["mixed"]),  # the colocated baseline
])
def test_local_cluster_serves_and_ctrl_c_stops_everything(default_model_dir, tmp_path, nodes, roles):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PD_CLUSTER_TOKEN", "PD_ADMIN_TOKEN")}
    env["PD_CLUSTER_HOME"] = str(tmp_path)
    log = open(tmp_path / "local.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pd_cluster.cli", "local", "--port", str(port), "--model", str(default_model_dir),
         "--device", "cpu", "--max-total-tokens", "4096", *nodes],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, (tmp_path / "local.log").read_text()[-3000:]
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 180, "the local cluster to be ready")
        children = _children(proc.pid)
        assert len(children) == 1 + len(roles)  # the master and each node

        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=8
        )
        assert reply.choices[0].message.content

        token_file = tmp_path / "local" / "admin-token"
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        token = token_file.read_text().strip()
        assert token not in (tmp_path / "local.log").read_text()  # never printed
        # /health turns ready with the first node that can serve a whole request (a decode node
        # prefills itself when no prefill node is ready), so the others may still be joining.
        def listed() -> list[str]:
            nodes = httpx.get(url + "/admin/nodes", headers={"Authorization": f"Bearer {token}"}, timeout=5).json()
            return sorted(n["role"] for n in nodes["data"])

        wait_until(lambda: listed() == roles, 120, f"every node ({roles}) to be listed")

        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(60) == 0
        wait_until(lambda: not any(_alive(c) for c in children), 30, "every cluster process to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in _children(proc.pid):
            os.kill(child, signal.SIGKILL)
