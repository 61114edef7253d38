"""The load client of ``pd-cluster bench master --concurrency``: closed-loop streams in one process.

Each stream sends a chat request, reads its answer to the end and sends the next, until the
run's end; streams start spread over a ramp so they do not move in lockstep. A run's streams are
split over several such processes (one event loop each) so that the client is never what limits
the master. Each stream reads its answers off its own keep-alive connection
(:mod:`pd_cluster.bench.sse_wire`), and a token's arrival is stamped with the kernel's receive time of
the bytes that brought it (where Linux gives one; else when the client's read returned): neither the
client's parsing nor its queue of reads is in the figure. The read's own stamp is kept beside it, to
show the client's share. SSE is parsed
minimally: a chunk's text is found by its ``"content":"`` key, and the synthetic nodes' text is the
time their frame left the node (:mod:`pd_cluster.bench.stamped_nodes`), so each token gives the
time it spent in the master and on the wire after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from array import array
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from urllib.parse import urlsplit

from pd_cluster import aio
from pd_cluster.bench.master_cores import pin
from pd_cluster.bench.sse_wire import SSEConnection, chat_request

_CONTENT = b'"content":"'
_ERROR = b'{"error"'
#: Error messages a process keeps (the count is of all).
_KEPT_ERRORS = 5


@dataclass
class ClientPlan:
    """What one client process runs: its streams (global indices), where they go, and when."""

    urls: list[str]
    streams: list[int]
    total_streams: int
    prompts: list[str]
    model: str
    max_tokens: int
    #: ``time.monotonic()`` the first stream starts at; the others follow over ``ramp_s``.
    start: float
    ramp_s: float
    #: What is measured: tokens and requests from ``window_start`` to ``end`` (monotonic seconds).
    window_start: float
    end: float
    request_timeout_s: float
    #: The cores this process runs on (empty: any).
    cpus: list[int] = field(default_factory=list)


@dataclass
class ClientResult:
    """What one process measured inside the window."""

    tokens: int = 0
    #: Per token: when its bytes arrived (the kernel's receive stamp), less its node's send stamp (seconds).
    added_s: array = field(default_factory=lambda: array("d"))
    #: Per token: when the client's read of its bytes returned, less its node's send stamp (seconds).
    read_added_s: array = field(default_factory=lambda: array("d"))
    #: Every token's arrival carried the kernel's stamp (False: some were stamped at the read).
    kernel_stamps: bool = True
    #: Per request that arrived in the window and got its first token: TTFT (seconds).
    ttft_s: array = field(default_factory=lambda: array("d"))
    #: (master index, request id) of requests sent inside the window.
    requests: list[tuple[int, str]] = field(default_factory=list)
    completed: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    #: CPU seconds this process used inside the window: near the window's length, the client
    #: (not the master) was the limit, and its tokens' added latency is its own.
    cpu_s: float = 0.0

    def fail(self, message: str) -> None:
        self.failed += 1
        if len(self.errors) < _KEPT_ERRORS:
            self.errors.append(message)


def content_of(line: bytes) -> bytes | None:
    """A chunk line's ``content`` string as raw bytes (None when it has none)."""
    at = line.find(_CONTENT)
    if at < 0:
        return None
    at += len(_CONTENT)
    return line[at:line.index(b'"', at)]


class _Streams:
    def __init__(self, plan: ClientPlan) -> None:
        self.plan = plan
        self.result = ClientResult()
        #: Each stream's keep-alive connection, by stream index.
        self.connections: dict[int, tuple[int, SSEConnection]] = {}

    async def stream(self, index: int) -> None:
        plan = self.plan
        await asyncio.sleep(max(0.0, plan.start + plan.ramp_s * index / plan.total_streams - time.monotonic()))
        master, sent = index % len(plan.urls), 0
        try:
            while time.monotonic() < plan.end:
                prompt = plan.prompts[(index + sent * plan.total_streams) % len(plan.prompts)]
                sent += 1
                try:
                    async with asyncio.timeout(plan.request_timeout_s):
                        await self.request(index, master, prompt)
                except Exception as exc:  # a benchmark counts failures; it does not stop on them
                    self._drop(index)
                    self.result.fail(f"{type(exc).__name__}: {exc}"[:300])
        finally:
            self._drop(index)

    async def _connection(self, index: int, master: int) -> SSEConnection:
        held = self.connections.get(index)
        if held is not None and held[0] == master and not held[1].closed:
            return held[1]
        self._drop(index)
        url = urlsplit(self.plan.urls[master])
        if url.scheme != "http" or url.hostname is None:
            raise ValueError(f"the load client speaks plain http only, not {self.plan.urls[master]!r}")
        conn = await SSEConnection.connect(url.hostname, url.port or 80)
        self.connections[index] = (master, conn)
        return conn

    def _drop(self, index: int) -> None:
        held = self.connections.pop(index, None)
        if held is not None:
            held[1].close()

    async def request(self, index: int, master: int, prompt: str) -> None:
        plan, result = self.plan, self.result
        body = {"model": plan.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": plan.max_tokens, "stream": True}
        conn = await self._connection(index, master)
        start = time.monotonic()
        counted = plan.window_start <= start < plan.end
        seen = {"first": True, "ended": False}

        def on_line(line: bytes, now: float, read: float) -> None:  # ``now``: when the line's last bytes arrived
            if seen["ended"]:
                return
            stamp = content_of(line)
            if stamp:
                if plan.window_start <= now < plan.end:
                    sent_at = float(stamp)
                    result.tokens += 1
                    result.added_s.append(now - sent_at)
                    result.read_added_s.append(read - sent_at)
                if seen["first"] and counted:
                    result.ttft_s.append(now - start)
                seen["first"] = False
            elif line.startswith(b"data: [DONE]"):
                result.completed += 1
                seen["ended"] = True
            elif line.startswith(b"data: " + _ERROR):
                result.fail(json.loads(line[6:])["error"].get("message", "error event")[:300])
                seen["ended"] = True

        url = urlsplit(plan.urls[master])
        head, done = conn.request(chat_request(url.netloc, "/v1/chat/completions", json.dumps(body).encode()), on_line)
        response = await head
        if response.status != 200:
            result.fail(f"HTTP {response.status}: {(await done).body[:200]!r}")
            return
        if counted:
            result.requests.append((master, response.headers.get("x-request-id", "")))
        await done
        result.kernel_stamps = result.kernel_stamps and conn.kernel_stamps
        if not seen["ended"]:
            result.fail("the stream ended without [DONE]")


async def _run(plan: ClientPlan) -> ClientResult:
    streams = _Streams(plan)
    tasks = [asyncio.create_task(streams.stream(i)) for i in plan.streams]
    await asyncio.sleep(max(0.0, plan.window_start - time.monotonic()))
    cpu_before = time.process_time()
    await asyncio.sleep(max(0.0, plan.end - time.monotonic()))
    streams.result.cpu_s = time.process_time() - cpu_before
    # Requests still open at the end are cut off: what they sent inside the window counted.
    for task in tasks:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*tasks, return_exceptions=True)
    return streams.result


def client_main(plan: ClientPlan, conn: Connection) -> None:
    """A child process: say it is ready, take the run's (start, window start, end) from ``conn``,
    run ``plan`` and send back its :class:`ClientResult`."""
    pin(plan.cpus)
    conn.send("ready")
    start, window_start, end = conn.recv()
    conn.send(aio.run(_run(replace(plan, start=start, window_start=window_start, end=end))))
