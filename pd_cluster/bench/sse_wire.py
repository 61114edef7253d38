"""A streamed chat answer read straight off its socket, each read stamped as its bytes arrive.

The load client of ``pd-cluster bench master`` measures how long a token spent in the master and
on the wire. Stamped after an HTTP library parsed the chunk, that figure also held the client's
own parse queue: a client process reading thousands of tokens a second adds its backlog to every
token. Here one keep-alive HTTP/1.1 connection is an ``asyncio.Protocol``: ``data_received``
takes ``time.monotonic()`` first, before any parsing, and every token found in those bytes gets
that stamp, so a token's time is when its bytes reached the client's socket buffer and the event
loop read them. The chunked body is then decoded and split into SSE lines here.

The parse itself waits for the end of the loop's round of reads (``call_soon``): a client process
holds hundreds of connections, and when a master writes a step's tokens to many of them at once
the loop reads them in one round. Parsed at once, each read would wait for the parsing of all
the reads before it in that round, and the last connection's stamp would carry the client's own
queue. Deferred, every read of the round is stamped first, each at the cost of a copy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

#: A line of the answer's events and the time the read that completed it arrived.
OnLine = Callable[[bytes, float], None]


class WireError(Exception):
    """The response broke the protocol, or the connection closed before the answer ended."""


@dataclass
class Response:
    """One request's answer: its status and headers, then its body lines as they arrive."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    #: A non-streamed (error) body, whole.
    body: bytes = b""


class SSEConnection(asyncio.Protocol):
    """One HTTP/1.1 connection; one request at a time (:meth:`request`)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        #: Reads not parsed yet, each with its stamp (parsed once the loop's round of reads is done).
        self._reads: list[tuple[bytes, float]] = []
        self._buffer = bytearray()
        self._lines = bytearray()
        self._state = "idle"
        self._chunk_left = 0
        self._length_left = 0
        self._on_line: OnLine | None = None
        self._response: Response | None = None
        self._done: asyncio.Future[Response] | None = None
        self._head_seen: asyncio.Future[Response] | None = None

    # ---- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._parse_reads()  # what arrived before the close still counts
        self.closed = True
        for fut in (self._head_seen, self._done):
            if fut is not None and not fut.done():
                fut.set_exception(WireError(f"the connection closed mid-answer ({exc})"))
                fut.exception()  # a request cut off at the run's end is awaited by nobody: no log of it

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()  # before any parsing: the stamp of every token in these bytes
        if not self._reads:
            asyncio.get_running_loop().call_soon(self._parse_reads)
        self._reads.append((data, now))

    def _parse_reads(self) -> None:
        """Parse the reads taken since the last call, in order, each with its own stamp."""
        reads, self._reads = self._reads, []
        for data, now in reads:
            self._buffer += data
            try:
                self._parse(now)
            except WireError as exc:
                self._abort(exc)
                return

    # ---- one request ----------------------------------------------------------------------------

    def request(self, raw: bytes, on_line: OnLine) -> tuple[asyncio.Future[Response], asyncio.Future[Response]]:
        """Send ``raw`` (a whole HTTP/1.1 request); futures for its head and its end. ``on_line``
        gets each line of a 200 answer's body with the stamp of the read that completed it."""
        assert self.transport is not None and self._state == "idle" and not self.closed
        loop = asyncio.get_running_loop()
        self._head_seen, self._done = loop.create_future(), loop.create_future()
        self._on_line, self._response, self._state = on_line, Response(), "head"
        self.transport.write(raw)
        return self._head_seen, self._done

    def _abort(self, exc: Exception) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        self.connection_lost(exc)

    def _parse(self, now: float) -> None:
        while True:
            if self._state == "head":
                if not self._read_head():
                    return
            elif self._state == "chunk-size":
                end = self._buffer.find(b"\r\n")
                if end < 0:
                    return
                try:
                    self._chunk_left = int(bytes(self._buffer[:end]).split(b";")[0], 16)
                except ValueError:
                    raise WireError(f"bad chunk size line {bytes(self._buffer[:end])[:40]!r}") from None
                del self._buffer[:end + 2]
                self._state = "chunk" if self._chunk_left else "trailer"
            elif self._state == "chunk":
                if not self._buffer:
                    return
                take = min(self._chunk_left, len(self._buffer))
                self._body(bytes(self._buffer[:take]), now)
                del self._buffer[:take]
                self._chunk_left -= take
                if not self._chunk_left:
                    self._state = "chunk-end"
            elif self._state == "chunk-end":
                if len(self._buffer) < 2:
                    return
                del self._buffer[:2]
                self._state = "chunk-size"
            elif self._state == "trailer":
                end = self._buffer.find(b"\r\n")
                if end < 0:
                    return
                del self._buffer[:end + 2]
                if end == 0:
                    self._finish()
            elif self._state == "length":
                take = min(self._length_left, len(self._buffer))
                self._body(bytes(self._buffer[:take]), now)
                del self._buffer[:take]
                self._length_left -= take
                if not self._length_left:
                    self._finish()
                elif not self._buffer:
                    return
            else:
                if self._buffer:
                    raise WireError("bytes arrived with no request waiting")
                return

    def _read_head(self) -> bool:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
        del self._buffer[:end + 4]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise WireError(f"bad status line {lines[0][:80]!r}")
        assert self._response is not None
        self._response.status = int(parts[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self._response.headers[name.strip().lower()] = value.strip()
        headers = self._response.headers
        if headers.get("transfer-encoding", "").lower() == "chunked":
            self._state = "chunk-size"
        else:
            self._length_left = int(headers.get("content-length", "0"))
            self._state = "length" if self._length_left else "idle"
        if self._head_seen is not None and not self._head_seen.done():
            self._head_seen.set_result(self._response)
        if self._state == "idle":
            self._finish()
        return True

    def _body(self, data: bytes, now: float) -> None:
        assert self._response is not None and self._on_line is not None
        if self._response.status != 200:
            self._response.body += data
            return
        self._lines += data
        start = 0
        while (end := self._lines.find(b"\n", start)) >= 0:
            if end > start:
                self._on_line(bytes(self._lines[start:end + 1]), now)
            start = end + 1
        del self._lines[:start]

    def _finish(self) -> None:
        self._state = "idle"
        self._lines.clear()
        if self._response is not None and self._response.headers.get("connection", "").lower() == "close":
            self.closed = True
        if self._done is not None and not self._done.done():
            assert self._response is not None
            self._done.set_result(self._response)


def chat_request(host: str, path: str, body: bytes) -> bytes:
    """A keep-alive HTTP/1.1 POST of a JSON ``body``."""
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body
