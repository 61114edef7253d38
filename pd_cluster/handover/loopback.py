"""The loopback backend: a prefill node's channel and a decode node's receiver in one process.

No sockets and no process group: a :class:`LoopbackLink` joins the two ends the handover uses
(a :class:`~pd_cluster.transfer.PeerChannel` on P's side, a
:class:`~pd_cluster.transfer.PeerConnection` on D's) through in-memory pipes. Frames are
delivered as the message objects themselves; a tensor sent is copied tensor to tensor into
what the receiver takes it into, and the send returns once it has been (as a send over a pair
group returns once it is matched). D's side serves the frames to a handler, normally
``KVReceiver.handle``, one at a time and in order, as the data-plane server does; when P closes
its channel, D hears of it (``on_disconnect``). Every wait keeps its deadline.

Tests run every sender and the receiver through it, and a node can rehearse a handover on its
own engine before it serves (:mod:`.rehearsal`). A decode node's pools handed to the link
(``shared_pools``, one a rank) make P write in place, as pools shared over CUDA IPC do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from pd_cluster.aio import wait_for
from pd_cluster.engine.node_kv import NodeKV
from pd_cluster.handover.receiver import KVReceiver
from pd_cluster.transfer import (
    ChannelError,
    ConnectionClosed,
    DataMessage,
    ErrorReply,
    Handler,
    PeerChannel,
    PeerConnection,
    SharedPool,
)
from pd_cluster.transfer.channel import TensorSpec, as_dtype
from pd_cluster.transfer.ipc import open_pool, openable_kinds

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: How long D's side of a link waits for P's next frame before it closes the link (as the
#: data-plane server closes an idle connection).
IDLE_TIMEOUT_S = 600.0


class LoopbackFrames:
    """One end of an in-memory control connection (what a framed socket is to a real channel)."""

    def __init__(self, name: str) -> None:
        self.peer = name
        self.local_host = "127.0.0.1"
        self._inbox: asyncio.Queue[DataMessage | None] = asyncio.Queue()
        self.other: LoopbackFrames | None = None
        self.closed = False

    async def send(self, message: DataMessage, timeout: float | None) -> None:
        if self.peer_gone() or self.other is None:
            raise ConnectionResetError("the loopback connection is closed")
        self.other._inbox.put_nowait(message)

    async def receive(self, timeout: float | None) -> DataMessage:
        message = await wait_for(self._inbox.get(), timeout)
        if message is None:
            self._inbox.put_nowait(None)  # every later read fails the same way
            raise ConnectionClosed("the loopback connection was closed")
        return message

    def peer_gone(self) -> bool:
        return self.closed or (self.other is not None and self.other.closed)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._inbox.put_nowait(None)
        if self.other is not None:
            self.other._inbox.put_nowait(None)

    async def aclose(self, timeout: float = 1.0) -> None:
        self.close()


@dataclass
class _Parcel:
    tensor: torch.Tensor
    taken: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class LoopbackTensors:
    """One end of an in-memory tensor channel on ``device`` (what a pair group is to a real one)."""

    backend = "loopback"

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.other: LoopbackTensors | None = None
        self._inbox: asyncio.Queue[_Parcel | None] = asyncio.Queue()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, tensors: torch.Tensor | Sequence[torch.Tensor], timeout: float, *, count: bool = True) -> int:
        """Hand each tensor to the other end and wait until it was copied out; returns the bytes."""
        batch = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        deadline = time.monotonic() + timeout
        sent = 0
        for tensor in batch:
            if self._closed or self.other is None or self.other.closed:
                raise ChannelError("loopback channel closed")
            parcel = _Parcel(tensor)
            self.other._inbox.put_nowait(parcel)
            await self._wait(parcel.taken, deadline, "sending a tensor")
            nbytes = tensor.numel() * tensor.element_size()
            sent += nbytes
            if count:
                self.bytes_sent += nbytes
        return sent

    async def recv_into(self, tensors: torch.Tensor | Sequence[torch.Tensor], timeout: float, *,
                        count: bool = True) -> None:
        """Copy the next tensors sent into ``tensors``, in order (their shapes and dtypes must match)."""
        batch = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        deadline = time.monotonic() + timeout
        for target in batch:
            parcel = await self._wait(self._inbox.get(), deadline, "receiving a tensor")
            if parcel is None:
                self._inbox.put_nowait(None)
                raise ChannelError("loopback peer hung up")
            if parcel.tensor.shape != target.shape or parcel.tensor.dtype != target.dtype:
                if not parcel.taken.done():
                    parcel.taken.set_exception(ChannelError("the receiver expected another tensor"))
                self.close()
                raise ChannelError(f"received {list(parcel.tensor.shape)} {parcel.tensor.dtype} where "
                                   f"{list(target.shape)} {target.dtype} was expected; channel torn down")
            target.copy_(parcel.tensor)
            if not parcel.taken.done():
                parcel.taken.set_result(None)
            if count:
                self.bytes_received += target.numel() * target.element_size()

    async def recv(self, specs: Sequence[TensorSpec], timeout: float, *, count: bool = True) -> list[torch.Tensor]:
        out = [torch.empty(tuple(shape), dtype=as_dtype(dtype), device=self.device) for shape, dtype in specs]
        await self.recv_into(out, timeout, count=count)
        return out

    def close(self) -> None:
        """Fail what waits on either end: tensors not taken yet, and receives of the other end."""
        if self._closed:
            return
        self._closed = True
        while not self._inbox.empty():
            parcel = self._inbox.get_nowait()
            if parcel is not None and not parcel.taken.done():
                parcel.taken.set_exception(ChannelError("loopback receiver closed"))
        self._inbox.put_nowait(None)
        if self.other is not None:
            self.other._inbox.put_nowait(None)

    async def aclose(self, timeout: float = 5.0) -> None:
        self.close()

    async def _wait(self, awaitable: Awaitable[T], deadline: float, what: str) -> T:
        """``awaitable`` by ``deadline`` (monotonic), or the channel is torn down."""
        try:
            return await wait_for(awaitable, max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            self.close()
            raise ChannelError(f"{what} did not finish before its deadline; channel torn down") from None


class LoopbackLink:
    """P's :attr:`channel` to D and D's :attr:`connection` from P, joined in this process; D's
    side serves P's frames to ``handler`` until either end closes."""

    def __init__(
        self, handler: Handler, *, address: str, decode_node_id: str, prefill_node_id: str,
        p_device: torch.device | str, d_device: torch.device | str, shared_pools: list[SharedPool] | None = None,
        on_disconnect: Callable[[PeerConnection], None] | None = None, peer_kv_dtype: str = "",
    ) -> None:
        p_frames, d_frames = LoopbackFrames(decode_node_id), LoopbackFrames(prefill_node_id)
        p_frames.other, d_frames.other = d_frames, p_frames
        p_tensors, d_tensors = LoopbackTensors(p_device), LoopbackTensors(d_device)
        p_tensors.other, d_tensors.other = d_tensors, p_tensors
        # The in-memory ends have the methods of a framed socket and of a pair group.
        self.channel = PeerChannel(address, p_frames, p_tensors, decode_node_id,  # type: ignore[arg-type]
                                   shared_pools=shared_pools, peer_kv_dtype=peer_kv_dtype)
        self.connection = PeerConnection(d_frames, d_tensors, prefill_node_id,  # type: ignore[arg-type]
                                         shares_kv=bool(shared_pools))
        self._handler = handler
        self._on_disconnect = on_disconnect
        self._serving = asyncio.create_task(self._serve(), name=f"loopback-{decode_node_id}")

    async def _serve(self) -> None:
        conn = self.connection
        try:
            while True:
                try:
                    message = await conn.stream.receive(IDLE_TIMEOUT_S)
                except (ConnectionClosed, asyncio.TimeoutError):
                    return
                try:
                    reply = await self._handler(conn, message)
                except ChannelError as e:
                    logger.warning("loopback channel failed during %r: %s; closing", message.type, e)
                    return
                except Exception as e:
                    logger.exception("handler failed on %r over a loopback link; closing", message.type)
                    reply = ErrorReply(message=f"{type(e).__name__}: {e}"[:2000])
                if reply is not None:
                    await conn.stream.send(reply, None)
                if isinstance(reply, ErrorReply) or conn.channel.closed:
                    return
        except OSError as e:  # P closed its end before the reply
            logger.info("loopback link to %r closed: %s", conn.peer_node_id, e)
        finally:
            conn.close()
            if self._on_disconnect is not None:
                self._on_disconnect(conn)

    async def aclose(self, timeout: float = 5.0) -> None:
        """Close P's end and wait (bounded) until D's side has stopped serving."""
        self.channel.close()
        await asyncio.wait([self._serving], timeout=timeout)


def shared_pools(node_kv: NodeKV, device: torch.device) -> list[SharedPool]:
    """A decode node's pools as a P in this process writes into them: rank 0's tensors as they
    are, the other ranks' opened from their handles."""
    pool = node_kv.pool
    if node_kv.whole:
        return [SharedPool(pool.k_cache, pool.v_cache)]
    try:
        handles = node_kv.pool_offer(openable_kinds(device))(openable_kinds(device))
    except (TimeoutError, RuntimeError) as e:
        raise ValueError(f"a tensor-parallel decode engine's pools cannot be shared: {e}") from e
    if not handles:
        raise ValueError("a tensor-parallel decode engine's pools cannot be shared: no kind offered here")
    return [SharedPool(pool.k_cache, pool.v_cache, handles[0].first_head), *(open_pool(h) for h in handles[1:])]


class LoopbackChannels:
    """Decode nodes' receivers reached over loopback links, by address: where a prefill service
    finds its channel to D instead of dialing one (``PrefillService(channels=...)``). A link
    that was closed (a failed exchange) is formed again on the next :meth:`get`, as a pool redials."""

    def __init__(self, prefill_node_id: str, device: torch.device | str) -> None:
        self.prefill_node_id = prefill_node_id
        self.device = torch.device(device)
        self._routes: dict[str, Callable[[], LoopbackLink]] = {}
        self._links: dict[str, LoopbackLink] = {}

    def add(self, address: str, receiver: KVReceiver, decode_node_id: str, *, share_pool: bool = False) -> None:
        """Route ``address`` to ``receiver``; ``share_pool``: P writes into its engine's pools in
        place (at TP > 1 the other ranks' pools, in their own processes, opened from the handles
        they export in a kind offered here: ValueError when there is none)."""
        pool = receiver.engine.pool
        shared = shared_pools(receiver.engine.node_kv, self.device) if share_pool else None

        def link() -> LoopbackLink:
            return LoopbackLink(receiver.handle, address=address, decode_node_id=decode_node_id,
                                prefill_node_id=self.prefill_node_id, p_device=self.device, d_device=pool.device,
                                shared_pools=shared, on_disconnect=receiver.peer_gone,
                                peer_kv_dtype=receiver.engine.kv_spec.kv_dtype)

        self._routes[address] = link

    async def get(self, address: str) -> PeerChannel:
        link = self._links.get(address)
        if link is None or not link.channel.alive:
            route = self._routes.get(address)
            if route is None:
                raise ChannelError(f"no loopback route to {address}")
            link = self._links[address] = route()
        return link.channel

    def peek(self, address: str) -> PeerChannel | None:
        link = self._links.get(address)
        return None if link is None else link.channel

    async def close(self) -> None:
        links = list(self._links.values())
        self._links.clear()
        await asyncio.gather(*(link.aclose() for link in links))
