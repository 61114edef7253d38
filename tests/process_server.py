"""The test clusters' masters and nodes (``python -m pd_cluster.cli ...``), started without paying
for their imports each time.

A master or a node spends most of its start importing torch and transformers: about 7 of a node's
10 s on two cores, and the test clusters start some sixty of them. So they are forked from one
server process that imported those third-party libraries once, and nothing of the project. Each
child then does what a fresh ``python -m pd_cluster.cli`` does: its own environment, working
directory, argv, stdin from /dev/null and stdout/stderr into its log file, then runs the
``pd_cluster.cli`` module as ``__main__`` (the project's modules are imported there, under that
environment) and exits through the interpreter's normal shutdown with its exit status. The children
are separate processes (their own pids, signals, exit codes) that talk to each other and to the
tests over real sockets, as before; :class:`ForkedProcess` gives the tests what they use of
:class:`subprocess.Popen`.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

#: What the server imports once: the third-party libraries a master or a node imports.
PRELOAD = ("numpy", "torch", "triton", "triton.language", "safetensors.torch", "tokenizers", "transformers",
           "transformers.models.auto.tokenization_auto", "transformers.models.auto.configuration_auto",
           "transformers.models.llama.configuration_llama", "transformers.tokenization_utils_fast",
           "pydantic", "fastapi", "starlette", "uvicorn", "websockets", "httpx", "prometheus_client", "jinja2")

_HEADER = struct.Struct("!I")


def forkserver_context() -> mp.context.BaseContext:
    """multiprocessing's "forkserver" context, its server preloading :data:`PRELOAD`: for the tests
    whose node processes run a function of theirs (tests/pd_harness.py, tests/transfer/test_transfer.py).
    Each child still imports the project's modules itself, as a "spawn" child does."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _send(sock: socket.socket, message: object) -> None:
    data = pickle.dumps(message)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket) -> object | None:
    """The next message, or None once the other side has closed the connection."""
    header = _read(sock, _HEADER.size)
    return None if header is None else pickle.loads(_read(sock, _HEADER.unpack(header)[0]) or b"")


def _read(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


# ---- the server process ---------------------------------------------------------------------------


def serve(fd: int) -> None:
    """Import :data:`PRELOAD`, then fork a child per request and report its pid and exit status."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    _send(sock, ("ready", os.getpid()))
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _send(sock, ("exit", pid, os.waitstatus_to_exitcode(status)))
        if not readable:
            continue
        request = _recv(sock)
        if request is None:  # the test session is gone; running children live on, as Popen's would
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            sock.close()
            _become(*request)  # returns only by an exception: SystemExit, or what the command raised
        children.add(pid)
        _send(sock, ("started", pid))


def _become(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """In the forked child: set up as ``python -m pd_cluster.cli *argv`` would be, and run it."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(stdin, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(stdin)
    os.close(log)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True,
                                  errors="backslashreplace")
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if env.get("OMP_NUM_THREADS"):  # read when torch loads, which was before the fork
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    import runpy

    sys.argv = ["-m", *argv]
    runpy.run_module("pd_cluster.cli", run_name="__main__", alter_sys=True)
    raise SystemExit(0)


# ---- the test process -----------------------------------------------------------------------------


class ProcessServer:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from tests.process_server import serve; serve(int(sys.argv[1]))",
             str(theirs.fileno())],
            pass_fds=[theirs.fileno()], cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self._sock = ours
        self._requests = threading.Lock()
        self._changed = threading.Condition()
        self._started: list[int] = []
        self.exits: dict[int, int] = {}
        self._closed = False
        threading.Thread(target=self._read, name="process-server", daemon=True).start()
        with self._changed:
            if not self._changed.wait_for(lambda: self._started or self._closed, 300):
                raise TimeoutError("the process server did not start within 300 s")
            if self._closed:
                raise RuntimeError(f"the process server exited ({self._proc.wait()})")
            self._started.clear()  # its own pid, from "ready"

    def _read(self) -> None:
        while True:
            try:
                message = _recv(self._sock)
            except OSError:
                message = None
            with self._changed:
                if message is None:
                    self._closed = True
                elif message[0] == "exit":
                    self.exits[message[1]] = message[2]
                else:
                    self._started.append(message[1])
                self._changed.notify_all()
            if message is None:
                return

    def start(self, argv: list[str], env: dict[str, str], log_path: Path) -> "ForkedProcess":
        with self._requests:
            _send(self._sock, (list(argv), dict(env), os.getcwd(), str(log_path)))
            with self._changed:
                if not self._changed.wait_for(lambda: self._started or self._closed, 60):
                    raise TimeoutError("the process server did not fork within 60 s")
                if not self._started:
                    raise RuntimeError("the process server is gone")
                pid = self._started.pop(0)
        return ForkedProcess(self, pid, argv)

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self.exits or self._closed, timeout)
            return self.exits.get(pid)


_server: ProcessServer | None = None
_server_lock = threading.Lock()


def start(argv: list[str], env: dict[str, str], log_path: Path) -> "ForkedProcess":
    """``python -m pd_cluster.cli *argv`` with ``env``, its output in ``log_path``, forked from the server."""
    global _server
    with _server_lock:
        if _server is None:
            _server = ProcessServer()
    return _server.start(argv, env, log_path)


class ForkedProcess:
    """What the tests use of :class:`subprocess.Popen`, for a child of the process server."""

    def __init__(self, server: ProcessServer, pid: int, args: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = args

    @property
    def returncode(self) -> int | None:
        return self._server.returncode(self.pid, 0)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.returncode(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
