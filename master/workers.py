"""A master of several worker processes behind one public address.

One event loop relays about 25k tokens/s before it is the limit. With ``--workers W`` the master
runs W processes, each a whole master (its own registry from the nodes' reports, relay, routing
and queue) as several masters already are: every worker binds the public port with SO_REUSEPORT,
so the kernel spreads client connections, and a private port of its own where nodes link (a node
that dials the public port is told every worker's URL and links to each) and siblings reach it.
This parent only supervises: it restarts a worker that dies and passes SIGTERM/SIGINT on.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from master.config import MasterSettings
from master.key_counts import KEY_COUNTS_ENV, SharedKeyCounts
from master.metrics import MULTIPROC_DIR_ENV

logger = logging.getLogger(__name__)

#: First wait before a dead worker is started again; doubled while it keeps dying young.
RESTART_DELAY_S = 0.2
MAX_RESTART_DELAY_S = 5.0
#: A worker that lived this long before dying is restarted after the first delay again.
STABLE_AFTER_S = 30.0
#: Grace over the workers' own shutdown timeout before a worker that does not stop is killed.
STOP_SLACK_S = 5.0


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` that other processes may bind too (the kernel spreads
    new connections over them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class WorkerSupervisor:
    """Starts ``settings.workers`` workers (``target(settings)`` in a fresh process each) and
    keeps them running until SIGTERM/SIGINT, which it passes on to them."""

    def __init__(self, settings: MasterSettings, target: Callable[[MasterSettings], None]) -> None:
        self.settings = settings
        self._target = target
        self._spawn = multiprocessing.get_context("spawn")
        self.workers: dict[int, BaseProcess] = {}
        self._started_at: dict[int, float] = {}
        self._delay: dict[int, float] = {}
        self._due: dict[int, float] = {}
        self._stopping = False
        self._key_counts: SharedKeyCounts | None = None

    def _start(self, index: int) -> None:
        settings = self.settings.model_copy(update={"worker_index": index})
        process = self._spawn.Process(target=self._target, args=(settings,), name=f"pd-master-worker-{index}")
        process.start()
        self.workers[index] = process
        self._started_at[index] = time.monotonic()
        logger.info("master worker %d started (pid %s)", index, process.pid)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        logger.info("signal %d: stopping %d master workers", signum, len(self.workers))
        self._stopping = True

    def run(self) -> None:
        """Supervise until a stop signal, then stop every worker (each within its grace)."""
        metrics_dir = tempfile.mkdtemp(prefix="pd-master-metrics-")
        os.environ[MULTIPROC_DIR_ENV] = metrics_dir  # the spawned workers inherit it
        # Per-key limits hold across the workers: they count in one table (master.key_counts).
        self._key_counts = SharedKeyCounts.create(Path(metrics_dir) / "key-counts", self.settings.workers)
        os.environ[KEY_COUNTS_ENV] = str(self._key_counts.path)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for index in range(self.settings.workers):
                self._start(index)
            while not self._stopping:
                self._watch()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop_all()
            os.environ.pop(MULTIPROC_DIR_ENV, None)
            os.environ.pop(KEY_COUNTS_ENV, None)
            if self._key_counts is not None:
                self._key_counts.close()
            shutil.rmtree(metrics_dir, ignore_errors=True)

    def _watch(self) -> None:
        """Wait a little for a worker to die; restart those whose delay is over."""
        now = time.monotonic()
        timeout = min([0.5, *[due - now for due in self._due.values()]])
        sentinels = {p.sentinel: i for i, p in self.workers.items() if i not in self._due}
        for sentinel in wait(list(sentinels), timeout=max(timeout, 0.0)):
            self._died(sentinels[sentinel])  # type: ignore[index]
        now = time.monotonic()
        for index, due in list(self._due.items()):
            if due <= now and not self._stopping:
                del self._due[index]
                self._start(index)

    def _died(self, index: int) -> None:
        from prometheus_client import multiprocess

        process = self.workers[index]
        process.join(0)
        if process.pid is not None:
            multiprocess.mark_process_dead(process.pid)
        if self._key_counts is not None:  # what it ran died with it
            self._key_counts.forget_row(index)
        lived = time.monotonic() - self._started_at[index]
        delay = RESTART_DELAY_S if lived >= STABLE_AFTER_S else min(self._delay.get(index, 0.0) * 2 or
                                                                     RESTART_DELAY_S, MAX_RESTART_DELAY_S)
        self._delay[index] = delay
        self._due[index] = time.monotonic() + delay
        logger.error("master worker %d (pid %s) exited with %s after %.1f s; restarting it in %.1f s",
                     index, process.pid, process.exitcode, lived, delay)

    def _stop_all(self) -> None:
        alive = [p for p in self.workers.values() if p.is_alive()]
        for process in alive:
            if process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown_timeout_s + STOP_SLACK_S
        for process in alive:
            process.join(max(deadline - time.monotonic(), 0.0))
            if process.is_alive():
                logger.warning("master worker pid %s did not stop in time; killing it", process.pid)
                process.kill()
                process.join(STOP_SLACK_S)
