"""Length-prefixed JSON frames of pydantic messages over an asyncio stream.

A frame is a 4-byte big-endian length followed by that many bytes of JSON: one
:class:`DataMessage`. Messages register themselves by their ``type`` when their class is
defined, so the nodes add their own (match prefix, push KV, commit) without touching this
module. The reader enforces the size bound before reading the body, and every read and write
takes a timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticUndefined

from pd_cluster.aio import wait_for
from pd_cluster.transfer.errors import ConnectionClosed, FrameError, FrameTooLarge

logger = logging.getLogger(__name__)

#: Largest frame either side accepts; tensors never travel in frames.
MAX_FRAME_BYTES = 4 * 1024 * 1024
_HEADER = struct.Struct("!I")

_REGISTRY: dict[str, type["DataMessage"]] = {}


class DataMessage(BaseModel):
    """Base of every data-plane message; a subclass with a literal ``type`` default registers.

    Example::

        class MatchPrefix(DataMessage):
            type: Literal["match_prefix"] = "match_prefix"
            token_ids: list[int]

    Types starting with ``dp.`` belong to the transport itself.
    """

    model_config = ConfigDict(extra="forbid")
    type: str

    registry: ClassVar[dict[str, type["DataMessage"]]] = _REGISTRY

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        name = cls.model_fields["type"].default
        if name is PydanticUndefined or not isinstance(name, str):
            return  # an abstract intermediate class
        known = _REGISTRY.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"message type {name!r} is already used by {known.__module__}.{known.__qualname__}")
        _REGISTRY[name] = cls


class ErrorReply(DataMessage):
    """The peer's handler raised; the connection is closed after this frame."""

    type: Literal["dp.error"] = "dp.error"
    message: str


def _summarize(error: ValidationError) -> str:
    # Locations and messages only: input values may hold the cluster token.
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in error.errors(include_input=False))


def decode_message(payload: bytes) -> DataMessage:
    """Parse one frame's body into its registered message class; raise FrameError otherwise."""
    try:
        obj = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FrameError(f"invalid JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise FrameError("frame is not an object with a string 'type'")
    cls = _REGISTRY.get(obj["type"])
    if cls is None:
        raise FrameError(f"unknown message type {obj['type'][:64]!r}")
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        raise FrameError(f"invalid {obj['type']!r} message: {_summarize(e)}") from None


def encode_message(message: DataMessage, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Serialize a message into a whole frame (header included)."""
    if type(message).model_fields["type"].default is PydanticUndefined:
        raise TypeError(f"{type(message).__name__} has no registered type")
    body = message.model_dump_json().encode()
    if len(body) > max_bytes:
        raise FrameTooLarge(f"{message.type!r} message of {len(body)} bytes exceeds {max_bytes}")
    return _HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, timeout: float | None, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Read one frame's body; the size bound is checked before the body is read."""

    async def _read() -> bytes:
        try:
            header = await reader.readexactly(_HEADER.size)
        except asyncio.IncompleteReadError as e:
            if e.partial:
                raise FrameError("connection closed inside a frame header") from None
            raise ConnectionClosed("peer closed the connection") from None
        (size,) = _HEADER.unpack(header)
        if size > max_bytes:
            raise FrameTooLarge(f"frame of {size} bytes exceeds {max_bytes}")
        try:
            return await reader.readexactly(size)
        except asyncio.IncompleteReadError:
            raise FrameError("connection closed inside a frame") from None

    return await wait_for(_read(), timeout)


def enable_keepalive(sock: socket.socket | None) -> None:
    """Let the kernel notice a peer host that vanished without closing its socket."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError as e:  # not a TCP socket (tests may use others)
        logger.debug("keepalive not set: %s", e)


class FramedStream:
    """One control connection: send and receive whole messages, each with a deadline."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame_bytes: int = MAX_FRAME_BYTES
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.max_frame_bytes = max_frame_bytes
        enable_keepalive(writer.get_extra_info("socket"))
        peer = writer.get_extra_info("peername")
        local = writer.get_extra_info("sockname")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        #: Local address of this connection: the interface the tensor channel should use too.
        self.local_host: str = local[0] if isinstance(local, tuple) else "127.0.0.1"

    async def send(self, message: DataMessage, timeout: float | None) -> None:
        self.writer.write(encode_message(message, self.max_frame_bytes))
        await wait_for(self.writer.drain(), timeout)

    async def receive(self, timeout: float | None) -> DataMessage:
        return decode_message(await read_frame(self.reader, timeout, self.max_frame_bytes))

    def peer_gone(self) -> bool:
        """The peer hung up, the connection broke, or we closed it (checked without reading)."""
        return self.reader.at_eof() or self.reader.exception() is not None or self.writer.is_closing()

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()

    async def aclose(self, timeout: float = 1.0) -> None:
        self.close()
        try:
            await wait_for(self.writer.wait_closed(), timeout)
        except (OSError, asyncio.TimeoutError):
            pass
