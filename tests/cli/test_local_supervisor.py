"""`pd-cluster local` supervises: a drained node stays gone, a crash is restarted, signals stop it all.

The first tests drive the supervisor with tiny stand-in processes; the rest run the real command
(master + nodes with the default model on CPU) the way a background, non-interactive shell starts
it: in its own session with SIGINT ignored.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from pd_cluster.local_cluster import ProcessSpec, RestartPolicy, Supervisor
from tests.cluster_harness import free_port, wait_until

FAST = RestartPolicy(max_restarts=2, window_s=60, first_delay_s=0.05, max_delay_s=0.2)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def _stub(name: str, code: str, role: str = "decode", **kw) -> ProcessSpec:
    return ProcessSpec(name, role, (sys.executable, "-c", textwrap.dedent(code)), dict(os.environ), **kw)


def _poll_until(supervisor: Supervisor, predicate, timeout: float, what: str) -> None:
    def step():
        supervisor.poll()
        return predicate()

    wait_until(step, timeout, what, interval=0.02)


# ---- the supervisor, with stand-in processes ------------------------------------------------------


def test_a_crash_is_restarted_with_backoff_a_bounded_number_of_times(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pd_cluster.local")
    supervisor = Supervisor([_stub("decode-0", "print('up', flush=True); raise SystemExit(3)")], tmp_path, FAST)
    supervisor.start_all()
    crashing = supervisor.processes["decode-0"]
    _poll_until(supervisor, lambda: crashing.state == "failed", 30, "the restarts to run out")
    assert crashing.starts == 3  # the first start and two restarts
    assert crashing.returncode == 3
    log = crashing.log_path.read_text()
    assert log.count("up\n") == 3 and log.count("---- ") == 3  # one log across restarts
    assert "crashed with exit code 3; restart 1/2" in caplog.text
    assert "crashed 3 times within 60s, not restarting it again" in caplog.text
    assert "    up" in caplog.text  # the last lines of its log come with the report


def test_a_node_that_exits_cleanly_left_and_is_not_restarted_but_the_master_is(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pd_cluster.local")
    supervisor = Supervisor([
        _stub("decode-0", "pass"),
        _stub("master", "import time; time.sleep(0.1)", role="master", clean_exit_is_final=False),
    ], tmp_path, FAST)
    supervisor.start_all()
    node, master = supervisor.processes["decode-0"], supervisor.processes["master"]
    _poll_until(supervisor, lambda: node.state == "left" and master.starts >= 2, 30, "the exits to be handled")
    assert node.starts == 1
    assert "decode-0" in caplog.text and "drained and left the cluster; not restarting it" in caplog.text
    supervisor.stop(5)


def test_stop_drains_nodes_before_the_master_and_kills_what_ignores_sigterm(tmp_path):
    record = tmp_path / "stopped"
    polite = f"""
        import signal, sys, time
        def leave(*_):
            with open({str(record)!r}, "a") as f:
                f.write(sys.argv[1] + "\\n")
            raise SystemExit(0)
        signal.signal(signal.SIGTERM, leave)
        print("ready", flush=True)
        while True:
            time.sleep(0.05)
    """
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
               "time.sleep(60)"
    specs = [
        ProcessSpec("master", "master", (sys.executable, "-c", textwrap.dedent(polite), "master"), dict(os.environ),
                    stop_order=1, clean_exit_is_final=False),
        ProcessSpec("decode-0", "decode", (sys.executable, "-c", textwrap.dedent(polite), "decode-0"),
                    dict(os.environ)),
        _stub("prefill-0", stubborn, role="prefill"),
    ]
    supervisor = Supervisor(specs, tmp_path / "logs", FAST)
    supervisor.start_all()
    wait_until(lambda: all("ready" in m.log_path.read_text() for m in supervisor.processes.values()), 30,
               "every stand-in to start")
    pids = [m.pid for m in supervisor.processes.values()]
    started = time.monotonic()
    supervisor.stop(timeout=4)
    assert time.monotonic() - started < 10
    assert record.read_text().split() == ["decode-0", "master"]  # nodes first, then the master
    assert supervisor.processes["prefill-0"].proc.returncode == -signal.SIGKILL
    assert not any(_alive(pid) for pid in pids)


def test_children_stop_when_the_supervising_process_is_killed(tmp_path):
    launcher = textwrap.dedent(f"""
        import os, sys, time
        from pd_cluster.local_cluster import ProcessSpec, Supervisor
        child = ProcessSpec("decode-0", "decode", (sys.executable, "-c", "import time; time.sleep(120)"),
                            dict(os.environ))
        supervisor = Supervisor([child], {str(tmp_path)!r})
        supervisor.start_all()
        print(supervisor.processes["decode-0"].pid, flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        child = int(proc.stdout.readline())
        assert _alive(child)
        proc.kill()
        proc.wait(10)
        wait_until(lambda: not _alive(child), 10, "the orphaned child to stop by itself")
    finally:
        proc.kill()


# ---- the real command -------------------------------------------------------------------------------


class LocalRun:
    """``pd-cluster local`` started like a background job of a non-interactive shell."""

    def __init__(self, model_dir: Path, home: Path, *extra: str) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k not in ("PD_CLUSTER_TOKEN", "PD_ADMIN_TOKEN")}
        env["PD_CLUSTER_HOME"] = str(home)
        self.log_path = home / "local.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pd_cluster.cli", "local", "--port", str(self.port), "--model", str(model_dir),
             "--device", "cpu", "--max-total-tokens", "4096", "--stop-timeout", "30", *extra],
            env=env, stdin=subprocess.DEVNULL, stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
        self.known_pids: set[int] = set()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, nodes: int) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, self.log()[-4000:]
            return "pd-cluster is serving" in self.log() and len(self.children()) == nodes + 1

        wait_until(ready, 240, "the local cluster to serve")

    def children(self) -> dict[str, int]:
        """Process name (master, prefill-0, ...) -> pid, among the launcher's children."""
        out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(self.proc.pid)], capture_output=True,
                             text=True).stdout
        found = {}
        for line in out.splitlines():
            pid, _, args = line.strip().partition(" ")
            words = args.split()
            name = words[words.index("--node-id") + 1] if "--node-id" in words else (
                "master" if " master " in f" {args} " else None)
            if name:
                found[name] = int(pid)
        self.known_pids.update(found.values())
        return found

    def admin(self, method: str, path: str) -> httpx.Response:
        token = (self.home / "local" / "admin-token").read_text().strip()
        return httpx.request(method, self.url + path, headers={"Authorization": f"Bearer {token}"}, timeout=10)

    def nodes(self) -> dict[str, dict]:
        try:
            response = self.admin("GET", "/admin/nodes")
        except httpx.HTTPError:
            return {}
        return {n["id"]: n for n in response.json()["data"]} if response.status_code == 200 else {}

    def kill_everything(self) -> None:
        for pid in [self.proc.pid, *self.known_pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Traffic:
    """A client thread sending small chat requests back to back until stopped."""

    def __init__(self, url: str) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                reply = self.client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": f"Count to {self.ok % 7}"}],
                    max_tokens=4,
                )
                assert reply.choices[0].message.content is not None
                self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure counts
                self.errors.append(repr(e))

    def wait_for(self, more: int, timeout: float) -> None:
        target = self.ok + more
        wait_until(lambda: self.ok >= target or self.errors, timeout, f"{more} more requests to succeed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(180)


@pytest.mark.timeout(900)
def test_drain_delete_and_crash_keep_the_cluster_serving_and_sigterm_stops_it(default_model_dir, tmp_path):
    run = LocalRun(default_model_dir, tmp_path, "--prefill", "1", "--decode", "2")
    try:
        run.wait_ready(nodes=3)
        table = run.log()
        for name in ("prefill-0", "decode-0", "decode-1"):
            assert name in table and "4096" in table  # the placement table, with KV slots per node
        assert str(tmp_path / "local" / "logs") in table
        assert "4096" in (tmp_path / "local" / "logs" / "decode-1.log").read_text()  # its own log file
        before = run.children()
        traffic = Traffic(run.url)
        traffic.wait_for(3, 120)

        # An operator drains decode-0: it finishes its requests, leaves and exits 0; the rest serve on.
        assert run.admin("POST", "/admin/nodes/decode-0/drain").status_code == 200
        wait_until(lambda: "decode-0" not in run.children(), 120, "decode-0 to drain and exit")
        wait_until(lambda: "decode-0" not in run.nodes(), 30, "decode-0 to leave the registry")
        traffic.wait_for(3, 120)
        traffic.stop()
        assert traffic.errors == [] and traffic.ok >= 6
        assert run.proc.poll() is None
        assert "decode-0" not in run.children()  # not restarted: it left on purpose
        assert "drained and left the cluster; not restarting it" in run.log()

        # Removing decode-1 through the admin API is no crash either: the process lives on, its
        # id refused while it keeps knocking, and it rejoins once an operator allows it.
        address = run.nodes()["decode-1"]["data_address"]
        assert run.admin("DELETE", "/admin/nodes/decode-1").json()["deleted"] is True
        d1_log = tmp_path / "local" / "logs" / "decode-1.log"
        wait_until(lambda: "removed by an operator" in d1_log.read_text(), 60, "decode-1 to be refused")
        assert "decode-1" not in run.nodes()
        assert run.admin("POST", "/admin/nodes/decode-1/allow").json()["allowed"] is True
        wait_until(lambda: "decode-1" in run.nodes(), 60, "decode-1 to register again")
        assert run.children()["decode-1"] == before["decode-1"]

        # A crash (kill -9) is restarted: a new process registers and serves.
        os.kill(before["decode-1"], signal.SIGKILL)
        wait_until(lambda: run.children().get("decode-1") not in (None, before["decode-1"]), 60,
                   "decode-1 to be restarted")
        wait_until(lambda: run.nodes().get("decode-1", {}).get("data_address") not in (None, address), 180,
                   "the new decode-1 to register")
        wait_until(lambda: httpx.get(run.url + "/health", timeout=5).status_code == 200, 60, "the cluster to serve")
        reply = traffic.client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert reply.choices[0].message.content is not None
        assert "decode-1 (pid %d) crashed with killed by SIGKILL; restart 1/5" % before["decode-1"] in run.log()

        # SIGTERM: the nodes drain, the master stops, the launcher exits 0 and leaves nothing behind.
        children = list(run.children().values())
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(60) == 0
        wait_until(lambda: not any(_alive(pid) for pid in children), 10, "every child to be gone")
    finally:
        run.kill_everything()


@pytest.mark.timeout(600)
def test_children_of_a_killed_launcher_stop_by_themselves(default_model_dir, tmp_path):
    run = LocalRun(default_model_dir, tmp_path)
    try:
        run.wait_ready(nodes=2)
        children = list(run.children().values())
        assert len(children) == 3
        run.proc.kill()  # kill -9: no chance to clean up
        run.proc.wait(10)
        wait_until(lambda: not any(_alive(pid) for pid in children), 60, "the orphans to stop by themselves")
    finally:
        run.kill_everything()
