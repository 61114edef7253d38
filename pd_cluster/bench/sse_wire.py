"""A streamed chat answer read straight off its socket, each read stamped with when its bytes arrived.

The load client of ``pd-cluster bench master`` measures how long a token spent in the master and
on the wire. Stamped when the client's own read returned, that figure also held the client's
queue: a client process holds hundreds of connections, and when a master writes a step's tokens
to many of them at once, the last one's bytes wait in its socket until the client has read (and
parsed) all the others. Where Linux allows it (``SO_TIMESTAMPNS``) each read here carries the
kernel's receive time of its bytes instead: on loopback that is the moment the master's write
delivered them, whatever the client was doing then. Both stamps go with every line (``arrived``,
the kernel's where there is one, and ``read``), so a run shows the client's own share too.

One keep-alive HTTP/1.1 connection is a non-blocking socket read by the loop's reader callback
with ``recvmsg`` (asyncio's transports do not hand over a read's control messages). The parse
waits for the end of the loop's round of reads (``call_soon``), so that a read's stamp does not
wait for the parsing of the reads before it in that round either.
"""

from __future__ import annotations

import asyncio
import platform
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

#: A line of the answer's events, when its bytes arrived (the kernel's stamp, or the read's where
#: there is none) and when the read that completed it returned (``time.monotonic()`` both).
OnLine = Callable[[bytes, float, float], None]

#: ``SO_TIMESTAMPNS`` (and its control message's type) of Linux's generic socket options, which
#: x86-64 and arm64 use; elsewhere reads are stamped when they return.
_SO_TIMESTAMPNS = 35
KERNEL_STAMPS = sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")
_TIMESPEC = struct.Struct("qq")
_ANCILLARY = socket.CMSG_SPACE(_TIMESPEC.size) if KERNEL_STAMPS else 0
_READ_BYTES = 1 << 18
#: What every connection's read lands in before it is copied out (one event loop a process).
_BUFFER = memoryview(bytearray(_READ_BYTES))
_INTO = [_BUFFER]


class WireError(Exception):
    """The response broke the protocol, or the connection closed before the answer ended."""


@dataclass
class Response:
    """One request's answer: its status and headers, then its body lines as they arrive."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    #: A non-streamed (error) body, whole.
    body: bytes = b""


def _kernel_stamp(ancillary: list[tuple[int, int, bytes]]) -> float | None:
    """A read's ``SCM_TIMESTAMPNS`` (the wall clock) on the monotonic clock; None without one."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(data)
            return sec + nsec * 1e-9 - (time.time() - time.monotonic())
    return None


class SSEConnection:
    """One HTTP/1.1 connection; one request at a time (:meth:`request`). Made by :meth:`connect`;
    one made without a socket is fed through :meth:`data_received` alone."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        self.sock = sock
        self.closed = False
        #: Every read so far carried the kernel's receive stamp.
        self.kernel_stamps = sock is not None and KERNEL_STAMPS
        #: Reads not parsed yet, each with its stamps (parsed once the loop's round of reads is done).
        self._reads: list[tuple[bytes, float, float]] = []
        self._buffer = bytearray()
        self._lines = bytearray()
        self._state = "idle"
        self._chunk_left = 0
        self._length_left = 0
        self._on_line: OnLine | None = None
        self._response: Response | None = None
        self._done: asyncio.Future[Response] | None = None
        self._head_seen: asyncio.Future[Response] | None = None

    @classmethod
    async def connect(cls, host: str, port: int) -> SSEConnection:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if KERNEL_STAMPS:
                sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            await loop.sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        conn = cls(sock)
        loop.add_reader(sock.fileno(), conn._readable)
        return conn

    def close(self) -> None:
        """Close the socket (an answer still open fails, as when the server closes it)."""
        sock, self.sock = self.sock, None
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
            self.connection_lost(None)

    # ---- reading -----------------------------------------------------------------------------

    def _readable(self) -> None:
        assert self.sock is not None
        try:
            if KERNEL_STAMPS:  # into one buffer: a fresh one a read would be allocated at its full size
                size, ancillary, _, _ = self.sock.recvmsg_into(_INTO, _ANCILLARY)
            else:
                size, ancillary = self.sock.recv_into(_BUFFER), []
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._abort(WireError(f"the connection broke: {exc}"))
            return
        if not size:
            self.close()
            return
        arrived = _kernel_stamp(ancillary) if KERNEL_STAMPS else None
        if arrived is None:
            self.kernel_stamps = False
        self.data_received(_BUFFER[:size].tobytes(), arrived)

    def connection_lost(self, exc: Exception | None) -> None:
        self._parse_reads()  # what arrived before the close still counts
        self.closed = True
        for fut in (self._head_seen, self._done):
            if fut is not None and not fut.done():
                fut.set_exception(WireError(f"the connection closed mid-answer ({exc})"))
                fut.exception()  # a request cut off at the run's end is awaited by nobody: no log of it

    def data_received(self, data: bytes, arrived: float | None = None) -> None:
        """One read's bytes, ``arrived`` when the kernel received them (None: now, as read)."""
        now = time.monotonic()  # before any parsing: the read stamp of every token in these bytes
        if not self._reads:
            asyncio.get_running_loop().call_soon(self._parse_reads)
        self._reads.append((data, now if arrived is None else arrived, now))

    def _parse_reads(self) -> None:
        """Parse the reads taken since the last call, in order, each with its own stamps."""
        reads, self._reads = self._reads, []
        for data, arrived, read in reads:
            self._buffer += data
            try:
                self._parse(arrived, read)
            except WireError as exc:
                self._abort(exc)
                return

    # ---- one request ----------------------------------------------------------------------------

    def request(self, raw: bytes, on_line: OnLine) -> tuple[asyncio.Future[Response], asyncio.Future[Response]]:
        """Send ``raw`` (a whole HTTP/1.1 request); futures for its head and its end. ``on_line``
        gets each line of a 200 answer's body with the stamp of the read that completed it."""
        assert self._state == "idle" and not self.closed
        loop = asyncio.get_running_loop()
        self._head_seen, self._done = loop.create_future(), loop.create_future()
        self._on_line, self._response, self._state = on_line, Response(), "head"
        if self.sock is not None:
            self._send(raw)
        return self._head_seen, self._done

    def _send(self, raw: bytes) -> None:
        assert self.sock is not None
        try:
            sent = self.sock.send(raw)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._abort(WireError(f"the request could not be sent: {exc}"))
            return
        if sent < len(raw):  # rare (a request is small): the loop sends the rest
            asyncio.ensure_future(asyncio.get_running_loop().sock_sendall(self.sock, raw[sent:]))

    def _abort(self, exc: Exception) -> None:
        self.closed = True
        sock, self.sock = self.sock, None
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
        self.connection_lost(exc)

    def _parse(self, arrived: float, read: float) -> None:
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
                self._body(bytes(self._buffer[:take]), arrived, read)
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
                self._body(bytes(self._buffer[:take]), arrived, read)
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

    def _body(self, data: bytes, arrived: float, read: float) -> None:
        assert self._response is not None and self._on_line is not None
        if self._response.status != 200:
            self._response.body += data
            return
        self._lines += data
        start = 0
        while (end := self._lines.find(b"\n", start)) >= 0:
            if end > start:
                self._on_line(bytes(self._lines[start:end + 1]), arrived, read)
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
