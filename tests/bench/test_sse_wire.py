"""The load client's wire reader: a chunked SSE answer split anywhere gives back its lines, each
stamped when the bytes that completed it arrived (the kernel's receive stamp on Linux, before the
read returned) and when that read returned (before any parsing), and the connection is kept for
the next request. A real socket on loopback; the server writes one piece at a time and waits
until the client has read it."""

from __future__ import annotations

import asyncio
import time

from pd_cluster.bench.sse_wire import KERNEL_STAMPS, SSEConnection, chat_request

EVENTS = [b'data: {"choices":[{"delta":{"content":"1.5"}}]}\n\n', b'data: {"choices":[{"delta":{"content":"2"}}]}\n\n',
          b"data: [DONE]\n\n"]


def chunked(payload: bytes, sizes: list[int]) -> bytes:
    out, at = b"", 0
    for size in sizes:
        out += f"{size:x}\r\n".encode() + payload[at:at + size] + b"\r\n"
        at += size
    return out + b"0\r\n\r\n"


class CountedReads(SSEConnection):
    def __init__(self, sock=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(sock)
        self.reads = 0

    def data_received(self, data: bytes, arrived: float | None = None) -> None:
        super().data_received(data, arrived)
        self.reads += 1


async def _until(condition, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the client did not read in time"
        await asyncio.sleep(0.001)


async def test_a_chunked_answer_split_anywhere_gives_its_lines_stamped_at_the_read_that_completed_them():
    payload = b"".join(EVENTS)
    body = chunked(payload, [10, len(EVENTS[0]) - 10 + 5, len(payload) - len(EVENTS[0]) - 5])
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-request-id: abc\r\ntransfer-encoding: chunked\r\n\r\n"
    wire = head + body
    # cut points: inside the head, inside a chunk-size line, just after the first line, inside the
    # second, and the rest with the end
    cuts = [20, len(head) + 2, wire.index(b"]}\n") + 3, wire.index(b'"2"'), len(wire)]
    holder: dict[str, CountedReads] = {}
    written_at: list[float] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):  # two requests on one connection
            request_head = await reader.readuntil(b"\r\n\r\n")
            length = int(request_head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            at = 0
            for cut in cuts:
                before = holder["conn"].reads
                writer.write(wire[at:cut])
                written_at.append(time.monotonic())
                await writer.drain()
                await _until(lambda: holder["conn"].reads > before)
                at = cut
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        conn = await CountedReads.connect("127.0.0.1", port)
        holder["conn"] = conn
        assert conn.kernel_stamps == KERNEL_STAMPS
        for _ in range(2):
            lines: list[tuple[bytes, float, float]] = []
            handled_at: list[float] = []

            def on_line(line: bytes, arrived: float, read: float) -> None:
                lines.append((line, arrived, read))
                handled_at.append(time.monotonic())

            written_at.clear()
            head_seen, done = conn.request(chat_request(f"127.0.0.1:{port}", "/v1/chat/completions", b"{}"), on_line)
            response = await head_seen
            assert response.status == 200 and response.headers["x-request-id"] == "abc"
            await asyncio.wait_for(done, 5.0)
            assert [line for line, _, _ in lines] == [e.rstrip(b"\n") + b"\n" for e in EVENTS]
            # the first line ends in the third piece, the other two in the fifth (one read, one stamp):
            # arrived before the server's clock read after its write, read after it was written
            slack = 2e-3 if KERNEL_STAMPS else 0.0  # two clocks read apart for the kernel's stamp
            assert written_at[1] - slack <= lines[0][1] <= written_at[2] + slack and lines[0][1] <= lines[0][2]
            assert written_at[2] <= lines[0][2] <= handled_at[0] and lines[0][2] < written_at[3]
            assert written_at[3] - slack <= lines[1][1] == lines[2][1] <= written_at[4] + slack
            assert written_at[4] <= lines[1][2] == lines[2][2] <= handled_at[1]
            if KERNEL_STAMPS:  # the kernel's stamp is not the read's
                assert lines[0][1] < lines[0][2]
        assert not conn.closed
        conn.close()
    finally:
        server.close()


async def test_an_error_answer_gives_its_status_and_body():
    body = b'{"error":{"message":"no"}}'

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        conn = await SSEConnection.connect("127.0.0.1", port)
        head_seen, done = conn.request(chat_request("x", "/v1/chat/completions", b""), lambda line, arrived, read: None)
        assert (await head_seen).status == 429
        assert (await asyncio.wait_for(done, 5.0)).body == body
        conn.close()
    finally:
        server.close()


async def test_reads_of_one_round_are_all_stamped_before_any_is_parsed():
    """Two connections read in the same round: the second's stamp does not wait for the first's
    (slow) line handler."""
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    stamps: dict[str, float] = {}
    handled: dict[str, float] = {}
    conns = {}
    for name in ("a", "b"):
        conn = SSEConnection()  # no socket: fed its reads below

        def on_line(line: bytes, arrived: float, read: float, name: str = name) -> None:
            stamps[name] = read
            busy_until = time.monotonic() + 0.02
            while time.monotonic() < busy_until:
                pass
            handled[name] = time.monotonic()

        conn.request(chat_request("x", "/", b"{}"), on_line)
        conns[name] = conn
    for conn in conns.values():  # one round of reads
        conn.data_received(head + chunked(EVENTS[0], [len(EVENTS[0])])[:-5])
    assert not stamps  # nothing parsed inside the reads
    await _until(lambda: len(handled) == 2)
    assert stamps["b"] < handled["a"] and stamps["b"] - stamps["a"] < 0.01
