"""A streamed response's ASGI ``send``, driven at once by whoever holds its next bytes.

A relayed token used to wake its stream's task, which then walked its iterators down to
``send``: with a decode node's step handing a master hundreds of tokens at once, those wake-ups
were most of the master's CPU a token and queued the last stream of a step behind all the
others. The node's frame handler now writes a token's event itself, through :meth:`DirectSend.write`.

``send`` is a coroutine function; on a connection whose socket takes the bytes it finishes
without suspending (uvicorn writes to its transport and returns), so stepping it once sends the
bytes. When it does suspend (the client does not read and the transport is paused) or raises,
what is left is kept and finished, or raised, by :meth:`DirectSend.settle` in the stream's own
task, before that task writes anything else: the order of a stream's bytes and the existing
backpressure (the stream's later tokens wait in its request's buffer) stay as they were.

Under uvicorn's httptools server (the master's), a body write whose connection takes it at once
skips even that step: the chunk goes to the connection's transport as that server's ``send``
writes it (:class:`_ChunkedWrite`); the coroutine, a frame of every token, was a tenth of the
master's CPU a relayed token. Whatever that ``send`` would not write straight away (a paused or
closed connection, a response not started or ended) still goes through it.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Coroutine

from starlette.types import Send

#: The module of the server's ``send`` whose chunked writes :class:`_ChunkedWrite` repeats.
_HTTPTOOLS_CYCLE = "uvicorn.protocols.http.httptools_impl"


class _ChunkedWrite:
    """A body write as uvicorn's httptools ``send`` makes it (a chunk of the chunked encoding to
    its transport), taken only where that ``send`` would do exactly that without suspending."""

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle
        #: The response is started, chunked and not a HEAD's: none of that changes once true.
        self.chunking = False

    @classmethod
    def of(cls, send: Send) -> _ChunkedWrite | None:
        cycle = getattr(send, "__self__", None)
        if type(cycle).__module__ != _HTTPTOOLS_CYCLE or getattr(send, "__name__", "") != "send":
            return None
        if not all(hasattr(cycle, name) for name in ("transport", "flow", "disconnected", "response_started",
                                                      "response_complete", "chunked_encoding", "scope")):
            return None
        return cls(cycle)

    def write(self, body: bytes) -> bool:
        """Write ``body`` as one chunk; False (nothing written) where ``send`` must take it."""
        cycle = self.cycle
        if cycle.disconnected or cycle.flow.write_paused or cycle.response_complete or not body:
            return False
        if not self.chunking:
            if not cycle.response_started or cycle.chunked_encoding is not True or cycle.scope["method"] == "HEAD":
                return False
            self.chunking = True
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True


class _Resumed:
    """Awaits the rest of a coroutine that was stepped outside any task and suspended on
    ``waiting`` (what it yielded): yields what it yields, and passes in what the awaiting task
    sends or throws, as ``await`` of the coroutine itself would have."""

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting: Any) -> None:
        self.coro = coro
        self.waiting = waiting

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, waiting = self.coro, self.waiting
        while True:
            try:
                sent = yield waiting
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - a cancellation goes on into the send
                try:
                    waiting = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
                continue
            try:
                waiting = coro.send(sent)
            except StopIteration as stop:
                return stop.value


class DirectSend:
    """One streamed response's body writes, taken from outside its task (see the module's text).

    Unbound until the response has sent its head (:meth:`bind`); :attr:`busy` while a write it
    took is unfinished, when nothing else may be written until the stream's task settles it."""

    def __init__(self) -> None:
        self._send: Send | None = None
        self._chunked: _ChunkedWrite | None = None
        #: What is left of the last write: (its coroutine, what it waits on), or what it raised.
        self._pending: tuple[Coroutine[Any, Any, Any], Any] | BaseException | None = None

    def bind(self, send: Send) -> None:
        self._send = send
        self._chunked = _ChunkedWrite.of(send)

    @property
    def ready(self) -> bool:
        """A write may be taken now: bound, and nothing left of the last one."""
        return self._send is not None and self._pending is None

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def write(self, body: bytes) -> None:
        """Send ``body`` now as far as the connection allows (only when :attr:`ready`)."""
        assert self._send is not None and self._pending is None
        chunked = self._chunked
        if chunked is not None and chunked.write(body):
            return
        coro = self._send({"type": "http.response.body", "body": body, "more_body": True})
        try:
            waiting = coro.send(None)
        except StopIteration:
            return
        except Exception as exc:  # raised in the stream's task by settle, as its own send would
            self._pending = exc
            return
        self._pending = (coro, waiting)

    async def settle(self) -> None:
        """Finish what is left of the last write, or raise what it raised (in the caller's task)."""
        pending = self._pending
        if pending is None:
            return
        try:
            if isinstance(pending, BaseException):
                raise pending
            await _Resumed(*pending)
        finally:
            self._pending = None

    def discard(self) -> None:
        """The response ends without settling: close what is left of the last write."""
        pending, self._pending = self._pending, None
        if pending is not None and not isinstance(pending, BaseException):
            pending[0].close()
