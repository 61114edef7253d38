"""The decode node's side of the data plane: accept prefill nodes, hand their requests to a handler.

Each accepted connection (over TLS when the server has a context) is authenticated both ways
(:mod:`.handshake`: this node proves it holds the cluster token, then the prefill node does),
gets its own pairwise tensor channel, and then carries request/reply frames: the server reads a
message, awaits ``handler(conn, message)`` and writes the reply it returns (None: no reply).
The handler moves tensors with ``conn.recv_tensor(...)``. A bad frame, a failed handler or a dead channel closes
that one connection, logged; the server keeps serving the others.

On one host the Welcome can also carry handles to D's KV pools (:mod:`.ipc`, one a rank), so P
writes the KV straight into the slots D reserved; ``PeerConnection.shares_kv`` says they were offered. When a
connection ends, ``on_disconnect`` hears of it (D then frees what that peer left reserved).

The transport's own warm-up (:class:`~.handshake.WarmUp`) is answered here, never reaching the
handler: the tensor is received (not counted as KV) and the connection marked ``warmed``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence

import torch

from pd_cluster.aio import wait_for
from pd_cluster.cluster_proof import new_nonce
from pd_cluster.kv_spec import KVSpec
from pd_cluster.transfer.channel import ChannelCounters, HOST_RANK, TensorChannel, TensorSpec, as_dtype
from pd_cluster.transfer.errors import ChannelError, ConnectionClosed, FrameError
from pd_cluster.transfer.framing import MAX_FRAME_BYTES, DataMessage, ErrorReply, FramedStream
from pd_cluster.transfer.handshake import (
    MAX_WARM_UP_BYTES,
    PROTOCOL_VERSION,
    SUPPORTED_DEVICE_TYPES,
    Challenge,
    Hello,
    Join,
    Refused,
    WarmAck,
    WarmUp,
    Welcome,
    check_hello,
    check_join,
    choose_backend,
    device_identity,
    share_pool_with,
    transcript,
)
from pd_cluster.transfer.ipc import KVPoolHandle, PoolOffer, host_identity

logger = logging.getLogger(__name__)


class PeerConnection(ChannelCounters):
    """One connected prefill node as the handler sees it: its identity and the tensor channel."""

    def __init__(self, stream: FramedStream, channel: TensorChannel, peer_node_id: str, shares_kv: bool = False) -> None:
        self.stream = stream
        self.channel = channel
        self.peer_node_id = peer_node_id
        self.peer_address = stream.peer
        #: True once the peer's warm-up tensor arrived through the channel.
        self.warmed = False
        #: True when the peer was handed this node's KV pool (it writes KV in place).
        self.shares_kv = shares_kv

    @property
    def closed(self) -> bool:
        return self.channel.closed or self.stream.peer_gone()

    async def recv_tensor(self, shape: Sequence[int], dtype: torch.dtype | str, timeout: float) -> torch.Tensor:
        """Receive one tensor the peer announced, on this node's device."""
        (tensor,) = await self.channel.recv([(shape, dtype)], timeout)
        return tensor

    async def recv_tensors(self, specs: Sequence[TensorSpec], timeout: float) -> list[torch.Tensor]:
        """Receive several tensors, in the order the peer sent them."""
        return await self.channel.recv(specs, timeout)

    async def recv_into(self, tensors: torch.Tensor | Sequence[torch.Tensor], timeout: float) -> None:
        """Receive straight into existing buffers."""
        await self.channel.recv_into(tensors, timeout)

    async def send_tensor(self, tensors: torch.Tensor | Sequence[torch.Tensor], timeout: float) -> int:
        """Send tensors back to the peer (it must be receiving them); returns bytes sent."""
        return await self.channel.send(tensors, timeout)

    def close(self) -> None:
        self.channel.close()
        self.stream.close()


Handler = Callable[[PeerConnection, DataMessage], Awaitable[DataMessage | None]]


class DataPlaneServer:
    """Accepts prefill nodes on ``host:port`` (port 0: any free port, see :attr:`address`)."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        kv_spec: KVSpec,
        node_id: str,
        device: torch.device | str,
        handler: Handler,
        *,
        handshake_timeout: float = 10.0,
        group_timeout: float = 30.0,
        reply_timeout: float = 10.0,
        idle_timeout: float = 600.0,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        kv_pools: PoolOffer | None = None,
        share_across_gpus: bool = False,
        on_disconnect: Callable[[PeerConnection], None] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if not token:
            raise ValueError("a data-plane server needs a non-empty token")
        self.host = host
        self.port = port
        self._token = token
        self.kv_spec = kv_spec
        self.node_id = node_id
        self.device = torch.device(device)
        if self.device.type not in SUPPORTED_DEVICE_TYPES:
            raise ValueError(f"unsupported device {self.device}; expected one of {SUPPORTED_DEVICE_TYPES}")
        self._device_type, self._device_uuid = device_identity(self.device)
        self._handler = handler
        self.handshake_timeout = handshake_timeout
        self.group_timeout = group_timeout
        self.reply_timeout = reply_timeout
        self.idle_timeout = idle_timeout
        self.max_frame_bytes = max_frame_bytes
        #: The KV pools offered to prefill nodes on this host (None: never offered).
        self.kv_pools = kv_pools
        self.share_across_gpus = share_across_gpus
        self.on_disconnect = on_disconnect
        #: Server-side TLS of the control connections (None: plain TCP).
        self.tls = tls
        self._server: asyncio.Server | None = None
        self._connections: set[PeerConnection] = set()
        self._tasks: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        """``host:port`` with the port actually bound."""
        return f"{self.host}:{self.port}"

    @property
    def connections(self) -> list[PeerConnection]:
        """Connections past the handshake, with a live tensor channel."""
        return [c for c in self._connections if not c.closed]

    @property
    def warmed_peers(self) -> list[str]:
        """Node ids of the prefill nodes with a live connection whose channel they warmed."""
        return sorted({c.peer_node_id for c in self.connections if c.warmed})

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._on_connect, self.host, self.port, ssl=self.tls,
            ssl_handshake_timeout=self.handshake_timeout if self.tls is not None else None,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("data plane of %s listening on %s (%s%s)", self.node_id, self.address, self._device_type,
                    ", TLS" if self.tls is not None else "")

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection and tear down every process group."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        if self._server is not None:
            try:
                await wait_for(self._server.wait_closed(), timeout)
            except asyncio.TimeoutError:
                logger.warning("data plane of %s: connections still closing after %.1fs", self.node_id, timeout)
            self._server = None
        logger.info("data plane of %s stopped", self.node_id)

    # ---- per connection ---------------------------------------------------------------------

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        stream = FramedStream(reader, writer, self.max_frame_bytes)
        conn: PeerConnection | None = None
        try:
            conn = await self._accept(stream)
            if conn is not None:
                self._connections.add(conn)
                await self._serve(conn)
        except asyncio.CancelledError:
            pass  # stop(): the finally below closes everything
        except Exception:
            logger.exception("data-plane connection from %s failed", stream.peer)
        finally:
            if conn is not None:
                conn.close()
                self._connections.discard(conn)
                if self.on_disconnect is not None:
                    try:
                        self.on_disconnect(conn)
                    except Exception:
                        logger.exception("disconnect hook failed for %r", conn.peer_node_id)
                await conn.channel.aclose()
            await stream.aclose()
            self._tasks.discard(task)

    async def _accept(self, stream: FramedStream) -> PeerConnection | None:
        joined = await self._authenticate(stream)
        if joined is None:
            return None
        peer_id, join = joined[0].node_id, joined[1]
        backend = choose_backend(self.device, self._device_uuid, join.device_uuid)
        channel = TensorChannel(self.device, backend, HOST_RANK, self.group_timeout)
        channel.peer_gone = stream.peer_gone
        pools: list[KVPoolHandle] = []
        if self.kv_pools is not None and share_pool_with(join, host_identity(), self._device_uuid,
                                                         self.share_across_gpus):
            try:
                pools = self.kv_pools(join.kv_ipc_kinds)
            except Exception as e:  # the tensor channel still works: share nothing
                logger.warning("could not export the KV pools to %r: %s", peer_id, e)
        try:
            port = await channel.host_store(stream.local_host, self.handshake_timeout)
            welcome = Welcome(node_id=self.node_id, backend=backend, store_port=port, group_timeout_s=self.group_timeout,
                              kv_dtype=self.kv_spec.kv_dtype, kv_pools=pools)
            await stream.send(welcome, self.handshake_timeout)
            await channel.form_group(stream.local_host, self.group_timeout)
        except (ChannelError, OSError, asyncio.TimeoutError) as e:
            channel.close()
            logger.warning("pair group with %s (node %r) failed: %s", stream.peer, peer_id, e or type(e).__name__)
            return None
        except BaseException:
            channel.close()
            raise
        logger.info("prefill node %r connected from %s over %s%s", peer_id, stream.peer, backend,
                    f", sharing {len(pools)} KV pool(s) ({pools[0].kind})" if pools else "")
        return PeerConnection(stream, channel, peer_id, shares_kv=bool(pools))

    async def _authenticate(self, stream: FramedStream) -> tuple[Hello, Join] | None:
        """Hello -> Challenge (this node's proof) -> Join (the dialer's proof), checked; the
        dialer's Hello and Join, or None once it was refused or went away."""
        hello = await self._first_frame(stream, "hello")
        if hello is None:
            return None
        if not isinstance(hello, Hello):
            await self._refuse(stream, f"expected a hello frame, got {hello.type!r}", "?")
            return None
        reason = check_hello(hello)
        if reason is not None:
            await self._refuse(stream, reason, hello.node_id)
            return None
        nonce = new_nonce()
        proofs = transcript(hello, self.node_id, nonce)
        challenge = Challenge(node_id=self.node_id, nonce=nonce, proof=proofs.prove(self._token, "listener"))
        try:
            await stream.send(challenge, self.handshake_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            logger.warning("could not challenge %s (node %r): %s", stream.peer, hello.node_id, e or type(e).__name__)
            return None
        join = await self._first_frame(stream, "join")
        if join is None:
            return None
        if not isinstance(join, Join):
            await self._refuse(stream, f"expected a join frame, got {join.type!r}", hello.node_id)
            return None
        reason = check_join(join, proofs.verify(self._token, "dialer", join.proof), self.kv_spec, self._device_type)
        if reason is not None:
            await self._refuse(stream, reason, hello.node_id)
            return None
        return hello, join

    async def _first_frame(self, stream: FramedStream, what: str) -> DataMessage | None:
        """One handshake frame, or None (logged) when the peer sent garbage, left or stalled."""
        try:
            return await stream.receive(self.handshake_timeout)
        except FrameError as e:
            logger.error("bad handshake frame from %s: %s; closing", stream.peer, e)
            await self._refuse(stream, f"malformed {what} (protocol version {PROTOCOL_VERSION} expected): {e}", "?")
        except ConnectionClosed:
            logger.info("%s closed before the %s", stream.peer, what)
        except OSError as e:
            logger.warning("connection from %s broke before the %s: %s", stream.peer, what, e)
        except asyncio.TimeoutError:
            logger.warning("no %s from %s within %.1fs; closing", what, stream.peer, self.handshake_timeout)
        return None

    async def _refuse(self, stream: FramedStream, reason: str, peer_node_id: str) -> None:
        logger.warning("refused data-plane peer %s (node %r): %s", stream.peer, peer_node_id, reason)
        try:
            await stream.send(Refused(reason=reason), self.handshake_timeout)
        except (OSError, asyncio.TimeoutError):
            pass  # it is being closed anyway

    async def _serve(self, conn: PeerConnection) -> None:
        who = f"{conn.peer_node_id!r} ({conn.peer_address})"
        while True:
            try:
                message = await conn.stream.receive(self.idle_timeout)
            except ConnectionClosed:
                logger.info("prefill node %s disconnected", who)
                return
            except asyncio.TimeoutError:
                logger.info("prefill node %s idle for %.0fs; closing", who, self.idle_timeout)
                return
            except FrameError as e:
                logger.error("bad frame from %s: %s; closing", who, e)
                return
            except OSError as e:
                logger.warning("connection to %s broke: %s", who, e)
                return
            try:
                if isinstance(message, WarmUp):
                    reply = await self._warm_up(conn, message)
                else:
                    reply = await self._handler(conn, message)
            except ChannelError as e:
                logger.warning("tensor channel to %s failed during %r: %s; closing", who, message.type, e)
                return
            except Exception as e:
                logger.exception("handler failed on %r from %s; closing", message.type, who)
                await self._send_quietly(conn, ErrorReply(message=f"{type(e).__name__}: {e}"[:2000]), who)
                return
            if reply is not None and not await self._send_quietly(conn, reply, who):
                return
            if conn.channel.closed:
                logger.warning("tensor channel to %s was torn down; closing", who)
                return

    async def _warm_up(self, conn: PeerConnection, msg: WarmUp) -> WarmAck:
        """Receive the peer's warm-up tensor (bounded in size) and acknowledge it."""
        dtype = as_dtype(msg.dtype)
        numel = 1
        for dim in msg.shape:
            if dim < 0:
                raise ValueError(f"warm-up shape {msg.shape} has a negative dimension")
            numel *= dim
        nbytes = numel * dtype.itemsize
        if nbytes > MAX_WARM_UP_BYTES:
            raise ValueError(f"warm-up of {nbytes} bytes exceeds {MAX_WARM_UP_BYTES}")
        await conn.channel.recv([(msg.shape, dtype)], self.group_timeout, count=False)
        conn.warmed = True
        logger.info("channel from prefill node %r warmed (%d bytes over %s)", conn.peer_node_id, nbytes,
                    conn.channel.backend)
        return WarmAck(bytes=nbytes)

    async def _send_quietly(self, conn: PeerConnection, reply: DataMessage, who: str) -> bool:
        try:
            await conn.stream.send(reply, self.reply_timeout)
            return True
        except (OSError, asyncio.TimeoutError, FrameError) as e:
            logger.warning("could not reply %r to %s: %s", reply.type, who, e or type(e).__name__)
            return False
