"""Run one cluster process as a child and keep it running: restart on a crash, stop on request.

The child dies with the thread that started it (``PR_SET_PDEATHSIG``), so a killed Ray actor
never leaves a node process behind holding a GPU.
"""

from __future__ import annotations

import collections
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO

from pd_cluster.process_supervisor import die_with_parent

logger = logging.getLogger(__name__)


class ProcessSupervisor:
    """Owns one child process: its output tail, its exit code, restarts after a crash.

    A clean exit (code 0, e.g. a node that drained and left) and any exit after ``stop`` or
    ``terminate`` end supervision; a crash is retried up to ``max_restarts`` times with backoff.
    """

    def __init__(self, argv: Sequence[str], env: dict[str, str], *, name: str, max_restarts: int = 3,
                 tail_lines: int = 400, echo: IO[str] | None = None) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.name = name
        self.max_restarts = max_restarts
        self.restarts = 0
        self._echo = echo if echo is not None else sys.stderr
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._returncode: int | None = None
        self._stopping = False
        self._stop_event = threading.Event()
        self._started = threading.Event()
        self._exited = threading.Event()
        self._spawn_error: OSError | None = None
        self._thread = threading.Thread(target=self._supervise, name=f"supervise-{name}", daemon=True)

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> int:
        """Start the child; returns its pid (raises if it could not be spawned)."""
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"{self.name}: the process did not start within {timeout}s")
        if self._spawn_error is not None:
            raise self._spawn_error
        assert self._proc is not None
        return self._proc.pid

    def terminate(self, timeout: float) -> int | None:
        """SIGTERM (a node drains, the master shuts down) and wait; None if still running."""
        proc = self._mark_stopping()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        code = self.terminate(timeout)
        if code is None:
            with self._lock:
                proc = self._proc
            if proc is not None and proc.poll() is None:
                logger.warning("%s: still running %.0fs after SIGTERM, killing it", self.name, timeout)
                proc.kill()
            code = self.wait_exit(10.0)
        return code

    def wait_exit(self, timeout: float | None) -> int | None:
        """The final exit code once supervision has ended, or None if it has not within ``timeout``."""
        if not self._exited.wait(timeout):
            return None
        return self._returncode

    # ---- state ----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None else None

    @property
    def alive(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def tail(self, lines: int = 50) -> list[str]:
        kept = list(self._tail)
        return kept[-lines:] if lines > 0 else []

    # ---- internals ------------------------------------------------------------------------

    def _mark_stopping(self) -> subprocess.Popen[bytes] | None:
        with self._lock:
            self._stopping = True
            proc = self._proc
        self._stop_event.set()
        return proc

    def _supervise(self) -> None:
        delay = 1.0
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        break
                    try:
                        proc = subprocess.Popen(
                            self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with_parent(signal.SIGKILL),
                        )
                    except OSError as e:
                        self._spawn_error = e
                        logger.error("%s: could not start %s: %s", self.name, self.argv[:4], e)
                        break
                    self._proc = proc
                self._started.set()
                logger.info("%s: started pid %d", self.name, proc.pid)
                pump = threading.Thread(target=self._pump, args=(proc,), name=f"output-{self.name}", daemon=True)
                pump.start()
                code = proc.wait()
                pump.join(timeout=5.0)
                self._returncode = code
                with self._lock:
                    restart = not self._stopping and code != 0 and self.restarts < self.max_restarts
                    if restart:
                        self.restarts += 1
                if not restart:
                    logger.info("%s: exited with code %d", self.name, code)
                    break
                logger.warning("%s: crashed with code %d; restart %d/%d in %.0fs", self.name, code,
                               self.restarts, self.max_restarts, delay)
                if self._stop_event.wait(delay):
                    break
                delay = min(delay * 2, 30.0)
        finally:
            self._exited.set()
            self._started.set()

    def _pump(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", errors="replace")
            self._tail.append(line.rstrip("\n"))
            try:
                self._echo.write(line)
                self._echo.flush()
            except (OSError, ValueError):
                pass
