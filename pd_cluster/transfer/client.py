"""The prefill node's side of the data plane: dial a decode node, prove both ways, open its channel.

A :class:`PeerChannel` is one authenticated control connection plus its tensor channel to one
decode node, and, when D shares its KV pool with this host (:mod:`.ipc`), the opened pool
(:attr:`PeerChannel.shared_pools`) that P writes KV into directly. The bounded pool of them is
:mod:`.channel_pool`'s.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

import torch

from pd_cluster.aio import wait_for
from pd_cluster.cluster_proof import new_nonce
from pd_cluster.kv_spec import KVSpec
from pd_cluster.transfer.channel import ChannelCounters, TensorChannel, TensorSpec, as_dtype
from pd_cluster.transfer.errors import (
    ChannelError,
    ConnectionClosed,
    FrameError,
    HandshakeRefused,
    RemoteError,
)
from pd_cluster.transfer.framing import MAX_FRAME_BYTES, DataMessage, ErrorReply, FramedStream
from pd_cluster.transfer.handshake import (
    AUTH_FAILED,
    SUPPORTED_DEVICE_TYPES,
    Challenge,
    Hello,
    Join,
    Refused,
    WarmAck,
    WarmUp,
    Welcome,
    device_identity,
    transcript,
)
from pd_cluster.transfer.ipc import KVPoolHandle, SharedPool, host_identity, missing_heads, open_pool, openable_kinds

logger = logging.getLogger(__name__)

#: Rank of the prefill node in its pair group (the decode node hosts the store as rank 0).
DIALER_RANK = 1


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad data-plane address {address!r}; expected host:port")
    return host.strip("[]"), int(port)


class PeerChannel(ChannelCounters):
    """One prefill -> decode channel: request/reply frames and tensor moves, one exchange at a time.

    :meth:`request` is the whole exchange (message, optional tensors, reply) under the channel
    lock. For finer steps (announce, then send layer by layer while compute goes on, then read
    the reply) hold :meth:`exclusive` and call :meth:`send`, :meth:`send_tensor` and
    :meth:`receive`. Any transport failure raises :class:`ChannelError` and closes the channel.
    """

    def __init__(
        self, address: str, stream: FramedStream, channel: TensorChannel, peer_node_id: str,
        on_close: Callable[["PeerChannel"], None] | None = None, shared_pools: list[SharedPool] | None = None,
        peer_kv_dtype: str = "",
    ) -> None:
        self.address = address
        self.peer_node_id = peer_node_id
        self.stream = stream
        self.channel = channel
        self.last_used = time.monotonic()
        self._lock = asyncio.Lock()
        self._on_close = on_close
        self._closed = False
        #: True once a warm-up moved a tensor through the pair and the peer acknowledged it.
        self.warmed = False
        #: D's key and value caches opened in place (same host), one pool a rank with the KV
        #: heads it holds; empty: the KV goes through the tensor channel.
        self.shared_pools: list[SharedPool] = list(shared_pools or [])
        #: What D's KV cache stores (its join answer; empty: as this node's): KV is sent in it.
        self.peer_kv_dtype = peer_kv_dtype
        #: KV bytes written straight into D's pools.
        self.bytes_written = 0

    @property
    def transport(self) -> str:
        """How KV reaches D: ``ipc`` (written into its pool in place) or the tensor channel's backend."""
        return "ipc" if self.shared_pools else self.channel.backend

    @property
    def bytes_sent(self) -> int:
        return self.channel.bytes_sent + self.bytes_written

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def alive(self) -> bool:
        """Usable: not closed by us, its group intact and the peer has not hung up."""
        return not self._closed and not self.channel.closed and not self.stream.peer_gone()

    def exclusive(self) -> asyncio.Lock:
        """``async with channel.exclusive():`` to compose one exchange from the raw steps."""
        return self._lock

    async def request(
        self, message: DataMessage, timeout: float, tensors: torch.Tensor | Sequence[torch.Tensor] | None = None
    ) -> DataMessage:
        """Send ``message`` (then ``tensors``, if any) and return the peer's reply; one deadline
        covers the whole exchange."""
        deadline = time.monotonic() + timeout
        try:
            await wait_for(self._lock.acquire(), timeout)
        except asyncio.TimeoutError:
            raise ChannelError(f"channel to {self.address} busy for {timeout:.1f}s") from None
        try:
            await self.send(message, _left(deadline))
            if tensors is not None:
                await self.send_tensor(tensors, _left(deadline))
            return await self.receive(_left(deadline))
        except (ChannelError, asyncio.CancelledError):
            # Half an exchange leaves the two ends out of step: never reuse the channel.
            self.close()
            raise
        finally:
            self._lock.release()

    async def warm_up(self, shape: Sequence[int], dtype: torch.dtype | str, timeout: float) -> int:
        """Move one tensor of zeros (``shape``, ``dtype``) to the peer and wait for its ack, so
        the pair's transport has done a real transfer before the first KV push; returns its
        bytes (not counted in :attr:`bytes_sent`). Idempotent: a warm channel returns 0."""
        deadline = time.monotonic() + timeout
        try:
            await wait_for(self._lock.acquire(), timeout)
        except asyncio.TimeoutError:
            raise ChannelError(f"channel to {self.address} busy for {timeout:.1f}s") from None
        try:
            if self.warmed:
                return 0
            dtype_name = str(dtype).removeprefix("torch.")
            await self.send(WarmUp(shape=list(shape), dtype=dtype_name), _left(deadline))
            self._check_open()
            tensor = torch.zeros(tuple(shape), dtype=as_dtype(dtype), device=self.channel.device)
            try:
                sent = await self.channel.send(tensor, _left(deadline), count=False)
            except ChannelError as e:
                self._fail("sending the warm-up tensor", e)
            reply = await self.receive(_left(deadline))
            if not isinstance(reply, WarmAck) or reply.bytes != sent:
                self._fail("warming up", ChannelError(f"peer answered the warm-up with {reply!r}"))
            self.warmed = True
            return sent
        except (ChannelError, asyncio.CancelledError):
            self.close()  # half a warm-up leaves the two ends out of step
            raise
        finally:
            self._lock.release()

    async def send(self, message: DataMessage, timeout: float) -> None:
        """Write one frame (hold :meth:`exclusive` around a multi-step exchange)."""
        self._check_open()
        try:
            await self.stream.send(message, timeout)
        except FrameError:
            raise  # ours was too large: a caller bug, the connection is still fine
        except (OSError, asyncio.TimeoutError) as e:
            self._fail(f"sending {message.type!r}", e)
        finally:
            self.last_used = time.monotonic()

    async def receive(self, timeout: float) -> DataMessage:
        """Read the peer's next frame; an :class:`ErrorReply` raises :class:`RemoteError`."""
        self._check_open()
        try:
            reply = await self.stream.receive(timeout)
        except (OSError, asyncio.TimeoutError, ConnectionClosed, FrameError) as e:
            self._fail("waiting for the reply", e)
        finally:
            self.last_used = time.monotonic()
        if isinstance(reply, ErrorReply):
            self.close()  # the peer closes after an error reply
            raise RemoteError(f"{self.peer_node_id} ({self.address}): {reply.message}")
        return reply

    async def send_tensor(self, tensors: torch.Tensor | Sequence[torch.Tensor], timeout: float) -> int:
        """Send one tensor or a list (for example one per layer), in order; returns bytes sent."""
        self._check_open()
        try:
            return await self.channel.send(tensors, timeout)
        except ChannelError as e:
            self._fail("sending tensors", e)
        finally:
            self.last_used = time.monotonic()

    async def recv_tensor(self, shape: Sequence[int], dtype: torch.dtype | str, timeout: float) -> torch.Tensor:
        (tensor,) = await self.recv_tensors([(shape, dtype)], timeout)
        return tensor

    async def recv_tensors(self, specs: Sequence[TensorSpec], timeout: float) -> list[torch.Tensor]:
        self._check_open()
        try:
            return await self.channel.recv(specs, timeout)
        except ChannelError as e:
            self._fail("receiving tensors", e)
        finally:
            self.last_used = time.monotonic()

    def close(self) -> None:
        """Tear down now: the process group is aborted and the socket closed."""
        if self._closed:
            return
        self._closed = True
        self.channel.close()
        self.stream.close()
        logger.info("closed data-plane channel to %s (%s)", self.peer_node_id, self.address)
        if self._on_close is not None:
            self._on_close(self)

    async def aclose(self, grace: float = 5.0) -> None:
        """Close once an exchange in flight finishes (or after ``grace`` seconds)."""
        try:
            await wait_for(self._lock.acquire(), grace)
            self._lock.release()
        except asyncio.TimeoutError:
            logger.warning("closing channel to %s with an exchange still in flight", self.address)
        self.close()
        await self.channel.aclose()
        await self.stream.aclose()

    def _check_open(self) -> None:
        if not self.alive:
            raise ChannelError(f"channel to {self.address} is closed")

    def _fail(self, what: str, error: BaseException) -> NoReturn:
        self.close()
        detail = str(error) or type(error).__name__
        logger.warning("data-plane channel to %s failed while %s: %s", self.address, what, detail)
        if isinstance(error, ChannelError):
            raise error
        raise ChannelError(f"{what} on channel to {self.address} failed: {detail}") from error


_Answer = TypeVar("_Answer", bound=DataMessage)


async def _exchange(stream: FramedStream, message: DataMessage, answer: type[_Answer], address: str,
                    timeout: float) -> _Answer:
    """One handshake step: send ``message``, read D's answer; a Refused raises HandshakeRefused."""
    await stream.send(message, timeout)
    reply = await stream.receive(timeout)
    if isinstance(reply, Refused):
        raise HandshakeRefused(reply.reason)
    if not isinstance(reply, answer):
        raise ChannelError(f"{address} answered the {message.type!r} with {reply.type!r}")
    return reply


def _left(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise ChannelError("request deadline passed")
    return remaining


async def dial(
    address: str,
    token: str,
    kv_spec: KVSpec,
    node_id: str,
    device: torch.device | str,
    *,
    connect_timeout: float = 10.0,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    on_close: Callable[[PeerChannel], None] | None = None,
    kv_ipc: bool = True,
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
) -> PeerChannel:
    """Connect (over TLS with ``tls``), authenticate both ways and form the pair group with the
    decode node at ``address``. Its certificate must name ``server_name`` when given (one name
    for every decode node, where their addresses are not known when certificates are made), else
    the host of ``address``.

    Raises :class:`HandshakeRefused` when D says no or cannot prove it holds the cluster token,
    :class:`ChannelError` when it cannot be reached or the group cannot be formed in time.
    """
    device = torch.device(device)
    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(f"unsupported device {device}; expected one of {SUPPORTED_DEVICE_TYPES}")
    host, port = split_address(address)
    try:
        reader, writer = await wait_for(
            asyncio.open_connection(host, port, ssl=tls, ssl_handshake_timeout=connect_timeout if tls else None,
                                    server_hostname=server_name if tls is not None and server_name else None),
            connect_timeout)
    except (OSError, asyncio.TimeoutError) as e:  # ssl.SSLError (an unverified certificate) is an OSError
        raise ChannelError(f"cannot connect to {address}: {e or type(e).__name__}") from e
    stream = FramedStream(reader, writer, max_frame_bytes)
    channel: TensorChannel | None = None
    try:
        proof = await _prove_both_ways(stream, address, token, node_id, connect_timeout)
        device_type, device_uuid = device_identity(device)
        join = Join(proof=proof, kv_spec=kv_spec, device_type=device_type, device_uuid=device_uuid,
                    host_id=host_identity() if kv_ipc else None, kv_ipc_kinds=openable_kinds(device) if kv_ipc else [])
        answer = await _exchange(stream, join, Welcome, address, connect_timeout)
        channel = TensorChannel(device, answer.backend, DIALER_RANK, answer.group_timeout_s)
        channel.peer_gone = stream.peer_gone
        await channel.join_store(host, answer.store_port, connect_timeout)
        await channel.form_group(stream.local_host, answer.group_timeout_s)
    except HandshakeRefused as e:
        logger.error("data-plane handshake with %s refused: %s", address, e.reason)
        await stream.aclose()
        raise
    except BaseException as e:
        if channel is not None:
            channel.close()
        await stream.aclose()
        if isinstance(e, (OSError, asyncio.TimeoutError, ConnectionClosed, FrameError)):
            raise ChannelError(f"handshake with {address} failed: {e or type(e).__name__}") from e
        raise
    shared_pools = open_pools(answer.kv_pools, kv_spec.num_kv_heads, answer.node_id)
    logger.info("data-plane channel to %s (%s) open over %s%s%s", answer.node_id, address, channel.backend,
                " (control over TLS)" if tls is not None else "",
                f", writing into its {len(shared_pools)} KV pool(s) ({answer.kv_pools[0].kind})" if shared_pools else "")
    return PeerChannel(address, stream, channel, answer.node_id, on_close, shared_pools,
                       answer.kv_dtype or kv_spec.kv_dtype)


def open_pools(handles: list[KVPoolHandle], num_kv_heads: int, node_id: str) -> list[SharedPool]:
    """D's pools opened, one a rank; none (the tensor channel carries the KV) when one of them
    cannot be opened or they do not hold every KV head between them."""
    if not handles:
        return []
    reason = missing_heads([(h.first_head, h.num_heads) for h in handles], num_kv_heads)
    pools: list[SharedPool] = []
    for rank, handle in enumerate(handles):
        if reason is not None:
            break
        try:
            pools.append(open_pool(handle))
        except Exception as e:
            reason = f"rank {rank}'s ({handle.kind}): {e}"
    if reason is not None:
        logger.warning("not writing into the KV pools of %s in place (%s); the KV goes through the channel",
                       node_id, reason)
        return []
    return pools


async def _prove_both_ways(stream: FramedStream, address: str, token: str, node_id: str, timeout: float) -> str:
    """Send Hello, check D's proof, and return this node's own proof for the Join. A D that
    cannot prove it holds the token is sent nothing more: :class:`HandshakeRefused` (it is not
    a decode node of this cluster)."""
    hello = Hello(node_id=node_id, nonce=new_nonce())
    challenge = await _exchange(stream, hello, Challenge, address, timeout)
    proofs = transcript(hello, challenge.node_id, challenge.nonce)
    if not proofs.verify(token, "listener", challenge.proof):
        raise HandshakeRefused(f"the peer at {address} (calling itself {challenge.node_id!r}) could not prove it "
                               f"holds the cluster token; {AUTH_FAILED}")
    return proofs.prove(token, "dialer")
