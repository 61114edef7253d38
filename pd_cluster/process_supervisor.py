"""Children that are kept running: each writes its own log, a crash is restarted with backoff, a
stop drains them in order.

A child that exits 0 drained and left: it stays gone. A crash (non-zero exit, killed by a signal)
is restarted with exponential backoff, a bounded number of times per window. Every child gets
``PR_SET_PDEATHSIG=SIGTERM`` (Linux), so if the supervising process is killed its children stop
by themselves.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO

logger = logging.getLogger("pd_cluster.local")

LOG_TAIL_LINES = 20

_PR_SET_PDEATHSIG = 1


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


_PRCTL = _load_prctl()


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that sends the child ``sig`` when the thread that spawned it ends (Linux
    ``PR_SET_PDEATHSIG``; the signal is tied to that thread, so spawn from one that lives as long as
    the parent). None where prctl is missing."""
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def preexec() -> None:  # between fork and exec: prctl was resolved before the fork
        _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return preexec


@dataclass(frozen=True)
class RestartPolicy:
    """Crashes are restarted after ``first_delay_s``, doubling up to ``max_delay_s``, at most
    ``max_restarts`` times within ``window_s``; past that the process stays down."""

    max_restarts: int = 5
    window_s: float = 300.0
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0

    def delay(self, crashes_in_window: int) -> float:
        return min(self.first_delay_s * 2 ** max(crashes_in_window - 1, 0), self.max_delay_s)


@dataclass(frozen=True)
class ProcessSpec:
    """One process the launcher runs and keeps running."""

    name: str
    role: str  # master | prefill | decode
    argv: tuple[str, ...]
    env: Mapping[str, str]
    stop_order: int = 0  # lower stops first: nodes drain while the master still relays their tokens
    clean_exit_is_final: bool = True  # a node exiting 0 drained and left; the master never should


@dataclass
class ManagedProcess:
    spec: ProcessSpec
    log_path: Path
    proc: subprocess.Popen | None = None
    state: str = "new"  # running | restarting | left | exited | failed | stopped
    starts: int = 0
    returncode: int | None = None
    restart_at: float = 0.0
    crashes: deque[float] = field(default_factory=deque)
    echo_offset: int = 0
    echo_partial: bytes = b""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - 64 * 1024, 0))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-lines:]


class Supervisor:
    """Starts processes from their specs, restarts crashes, and stops them in order.

    Everything happens on the calling thread (the main one): children are spawned there, so
    ``PR_SET_PDEATHSIG`` ties them to the launcher's life, not to a helper thread's.
    """

    def __init__(self, specs: Sequence[ProcessSpec], log_dir: Path, policy: RestartPolicy = RestartPolicy(),
                 echo: IO[str] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.policy = policy
        self.echo_to = echo
        self.clock = clock
        self.processes: dict[str, ManagedProcess] = {}
        for spec in specs:
            log_path = self.log_dir / f"{spec.name}.log"
            log_path.write_bytes(b"")  # a fresh log per launcher run; restarts append
            self.processes[spec.name] = ManagedProcess(spec, log_path)

    def start_all(self) -> None:
        for managed in self.processes.values():
            self._spawn(managed)

    def _spawn(self, managed: ManagedProcess) -> None:
        spec = managed.spec
        with open(managed.log_path, "ab") as log:
            stamp = datetime.now().isoformat(timespec="seconds")
            log.write(f"---- {stamp} start {managed.starts + 1} of {spec.name}\n".encode())
            log.flush()
            managed.proc = subprocess.Popen(
                list(spec.argv), env=dict(spec.env), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM),
            )
        managed.starts += 1
        managed.state = "running"
        managed.returncode = None
        if managed.starts == 1:
            logger.debug("%s: started pid %d", spec.name, managed.proc.pid)
        else:
            logger.info("%s: restarted as pid %d", spec.name, managed.proc.pid)

    def poll(self, restart: bool = True) -> list[ManagedProcess]:
        """Reap processes that exited since the last call (returned) and start the crashed ones
        whose backoff has passed. With ``restart`` False an exit is only recorded."""
        now = self.clock()
        exited = []
        for managed in self.processes.values():
            if managed.state == "running" and managed.proc is not None and managed.proc.poll() is not None:
                managed.returncode = managed.proc.returncode
                exited.append(managed)
                if restart:
                    self._after_exit(managed, now)
                else:
                    managed.state = "exited"
            elif managed.state == "restarting" and now >= managed.restart_at:
                try:
                    self._spawn(managed)
                except OSError as e:
                    managed.state = "failed"
                    logger.error("%s: could not be started again: %s", managed.spec.name, e)
        return exited

    def _after_exit(self, managed: ManagedProcess, now: float) -> None:
        name, code = managed.spec.name, managed.returncode
        assert code is not None
        if code == 0 and managed.spec.clean_exit_is_final:
            managed.state = "left"
            logger.info("%s (pid %d) exited cleanly: it drained and left the cluster; not restarting it",
                        name, managed.pid)
            return
        while managed.crashes and now - managed.crashes[0] > self.policy.window_s:
            managed.crashes.popleft()
        tail = "\n".join(f"    {line}" for line in log_tail(managed.log_path))
        if len(managed.crashes) >= self.policy.max_restarts:
            managed.state = "failed"
            logger.error("%s (pid %d) stopped with %s; it crashed %d times within %.0fs, not restarting it again. "
                         "Last lines of %s:\n%s", name, managed.pid, describe_exit(code), len(managed.crashes) + 1,
                         self.policy.window_s, managed.log_path, tail)
            return
        managed.crashes.append(now)
        delay = self.policy.delay(len(managed.crashes))
        managed.state = "restarting"
        managed.restart_at = now + delay
        logger.warning("%s (pid %d) crashed with %s; restart %d/%d in %.0fs. Last lines of %s:\n%s", name,
                       managed.pid, describe_exit(code), len(managed.crashes), self.policy.max_restarts, delay,
                       managed.log_path, tail)

    def stop(self, timeout: float, force: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM each stop group in order (nodes drain, then the master goes), waiting for each
        within ``timeout`` overall; SIGKILL whatever is left at the deadline or once ``force()``."""
        deadline = self.clock() + timeout
        for managed in self.processes.values():
            if managed.state in ("restarting", "new"):
                managed.state = "stopped"
        orders = sorted({m.spec.stop_order for m in self.processes.values()})
        reserve = min(5.0, timeout / 4)  # time kept for the later groups
        for position, order in enumerate(orders):
            group = [m for m in self.processes.values() if m.spec.stop_order == order and m.alive]
            for managed in group:
                self._signal(managed, signal.SIGTERM)
            group_deadline = deadline - reserve * (len(orders) - 1 - position)
            while any(m.alive for m in group) and self.clock() < group_deadline and not force():
                time.sleep(0.05)
            for managed in group:
                if managed.alive:
                    logger.warning("%s (pid %d) did not stop in time: killing it", managed.spec.name, managed.pid)
                    self._signal(managed, signal.SIGKILL)
        for managed in self.processes.values():
            if managed.proc is not None:
                try:
                    managed.proc.wait(10)
                except subprocess.TimeoutExpired:
                    logger.error("%s (pid %d) outlived SIGKILL", managed.spec.name, managed.pid)
            if managed.state == "running":
                managed.state = "stopped"
        self.echo()

    @staticmethod
    def _signal(managed: ManagedProcess, sig: int) -> None:
        try:
            if managed.proc is not None and managed.proc.poll() is None:
                managed.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def echo(self) -> None:
        """Copy what the children wrote since the last call to ``echo``, each line prefixed with its name."""
        if self.echo_to is None:
            return
        width = max(len(name) for name in self.processes)
        for managed in self.processes.values():
            try:
                with open(managed.log_path, "rb") as f:
                    f.seek(managed.echo_offset)
                    data = f.read(1 << 20)
            except OSError:
                continue
            managed.echo_offset += len(data)
            lines = (managed.echo_partial + data).split(b"\n")
            managed.echo_partial = lines.pop()
            for line in lines:
                self.echo_to.write(f"{managed.spec.name:<{width}} | {line.decode('utf-8', errors='replace')}\n")
        self.echo_to.flush()
