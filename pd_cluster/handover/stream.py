"""The layer-wise stream: a prompt's KV sent to D layer by layer while its prefill forward runs.

The engine thread calls :meth:`LayerStream.capture` after each layer's KV is stored: on a GPU
it queues a copy of that layer's slots into a send buffer on a side stream, behind an event
recorded on the compute stream, and hands the copy's event to the event loop. The loop
(:meth:`LayerStream.send`) sends each group of layers as soon as its copies are queued; the
send waits on the GPU for those copies only, so layer i travels while later layers compute.

:class:`StreamSender` holds the channel for one exchange from before the prefill to the commit:
``StreamKV``, the layer groups, then ``CommitKV`` (or ``ReleaseLease``) and D's two replies.
"""

from __future__ import annotations

import asyncio
import time

import torch

from pd_cluster.aio import wait_for
from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.handover.errors import HandoverFailed
from pd_cluster.handover.lease import DecodeLease
from pd_cluster.handover.messages import CommitKV, ReleaseLease, Released, StreamKV
from pd_cluster.handover.sender import Deadline, Handed, KVSender, WithHeldSlots
from pd_cluster.handover.side_stream import ReadyEvent, after_compute, on_side
from pd_cluster.kv_spec import KVSpec
from pd_cluster.transfer import ChannelError, DataMessage, PeerChannel


class LayerStream:
    """KV of tokens [start, n_tokens) of one request, zero-padded to ``padded_tokens``, sent in
    groups of ``layers_per_send`` layers (one send each: fewer, larger messages on the link,
    while the copies of the next group run). ``spec``: the KV D expects, every head (by default
    the pool's; a stream filled by :meth:`fill_from` may stand for a pool of part of the heads)."""

    def __init__(
        self, request_id: str, start: int, n_tokens: int, padded_tokens: int, pool: KVPool,
        loop: asyncio.AbstractEventLoop, side_stream: torch.cuda.Stream | None, layers_per_send: int = 1,
        spec: KVSpec | None = None,
    ) -> None:
        #: Tokens [start, n_tokens) of the request's prompt are the ones D lacks.
        self.request_id, self.start, self.n_tokens = request_id, start, n_tokens
        self.padded_tokens = padded_tokens
        self.pool = pool
        self.spec = spec = spec or pool.spec
        self.num_layers = spec.num_layers
        self.layer_shape = [2, padded_tokens, spec.num_kv_heads, spec.row_width]
        self.layers_per_send = max(1, min(layers_per_send, self.num_layers))
        self._loop = loop
        self._side = side_stream
        self._ready: asyncio.Queue[tuple[int, ReadyEvent]] = asyncio.Queue()
        self.buffer: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None
        self.first_layer_at: float | None = None

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: every layer's keys and values of ``padded_tokens`` tokens."""
        return self.padded_tokens * self.spec.bytes_per_token

    # ---- engine thread -----------------------------------------------------------------------

    def begin(self, slots: torch.Tensor) -> None:
        """The step that completes the prompt is about to run; ``slots`` (a device view of the
        request's table row) hold tokens [start, n_tokens) once its inputs are written."""
        self._slots = slots
        shape = (self.num_layers, *self.layer_shape)
        with on_side(self._side):
            self.buffer = torch.empty(shape, dtype=self.pool.k_cache.dtype, device=self.pool.device)
            self.buffer[:, :, slots.numel() :].zero_()

    def capture(self, layer: int) -> None:
        """Layer ``layer``'s KV is stored (in stream order): queue its copy and announce it."""
        assert self.buffer is not None and self._slots is not None, "begin() first"
        assert self.spec.num_kv_heads == self.pool.spec.num_kv_heads, "layer by layer needs a pool of every head"
        ready: ReadyEvent = None
        after_compute(self._side)
        with on_side(self._side):
            n = self._slots.numel()
            # Rows as they move: a quantized row without its alignment padding.
            k_cache, v_cache = (c[..., : self.spec.row_width] for c in self.pool.layer(layer))
            torch.index_select(k_cache, 0, self._slots, out=self.buffer[layer, 0, :n])
            torch.index_select(v_cache, 0, self._slots, out=self.buffer[layer, 1, :n])
            if self._side is not None:
                ready = torch.cuda.Event()
                ready.record(self._side)
        self._loop.call_soon_threadsafe(self._ready.put_nowait, (layer, ready))

    # ---- event loop --------------------------------------------------------------------------

    def fill_from(self, buffer: torch.Tensor) -> None:
        """Stand in for a forward: every layer of ``buffer`` ([L, 2, padded, H, D]) is ready now."""
        self.buffer = buffer
        for layer in range(self.num_layers):
            self._ready.put_nowait((layer, None))

    async def send(self, channel: PeerChannel, left: Deadline) -> int:
        """Send the layers in order, a group as soon as its last copy is queued; returns the bytes sent."""
        sent = 0
        for first in range(0, self.num_layers, self.layers_per_send):
            last = min(first + self.layers_per_send, self.num_layers)
            for expected in range(first, last):
                try:
                    layer, ready = await wait_for(self._ready.get(), left())
                except asyncio.TimeoutError:
                    raise ChannelError(f"layer {expected} of {self.request_id} was never computed") from None
                assert layer == expected and self.buffer is not None
            if self.first_layer_at is None:
                self.first_layer_at = time.monotonic()
            if ready is not None:
                # The channel orders its send after this thread's current stream: make that
                # stream wait for the group's last copy (copies run in order on one side stream).
                torch.cuda.current_stream(self.pool.device).wait_event(ready)
            sent += await channel.send_tensor(self.buffer[first:last], left())
        return sent


class StreamSender(KVSender):
    """Sends a :class:`LayerStream` as the prefill computes it, in one exchange on the channel."""

    def __init__(self, channel: PeerChannel, lease: DecodeLease, stream: LayerStream) -> None:
        super().__init__(channel, lease)
        self.stream = stream
        self.layer_sink = stream
        self._sending: asyncio.Future[int] | None = None
        #: The exchange holds the channel (taken in :meth:`begin`, given back once D replied).
        self._holding = False

    @property
    def nbytes(self) -> int:
        return self.stream.nbytes

    async def begin(self, left: Deadline) -> None:
        """Take the channel, announce the stream and start sending layers as they are captured."""
        try:
            await wait_for(self.channel.exclusive().acquire(), left())
        except asyncio.TimeoutError:
            raise HandoverFailed(f"channel to {self.lease.decode_node_id} stayed busy") from None
        self._holding = True
        stream = self.stream
        await self.channel.send(StreamKV(lease_id=self.lease.lease_id, num_layers=stream.num_layers,
                                         layers_per_send=stream.layers_per_send, layer_shape=stream.layer_shape,
                                         dtype=stream.dtype), left())
        self._sending = asyncio.ensure_future(stream.send(self.channel, left))

    async def commit(self, first_token: int, with_held_slots: WithHeldSlots, left: Deadline) -> Handed:
        return await self._finish(CommitKV(lease_id=self.lease.lease_id, first_token=first_token), left, True)

    async def release(self, left: Deadline) -> Handed:
        return await self._finish(ReleaseLease(lease_id=self.lease.lease_id), left, False)

    async def _finish(self, last: DataMessage, left: Deadline, committed: bool) -> Handed:
        """Once every layer is sent, end the exchange with ``last``; D answers the stream, then ``last``."""
        assert self._sending is not None, "begin() first"
        reported = time.monotonic()
        sent = await self._sending
        visible = time.monotonic() - reported
        await self.channel.send(last, left())
        replies = [await self.channel.receive(left()), await self.channel.receive(left())]
        self._holding = False
        self.channel.exclusive().release()
        seconds = time.monotonic() - (self.stream.first_layer_at or time.monotonic())
        for reply in replies:
            if not isinstance(reply, Released):
                self.check_taken(reply)
        if sent != self.stream.nbytes:
            raise HandoverFailed(f"sent {sent} KV bytes of {self.stream.nbytes}", retryable=False)
        self.settled = True
        return Handed(bytes_sent=sent, seconds=seconds, visible_seconds=visible if committed else None)

    def abandon(self) -> None:
        if self._holding:
            # Half an exchange leaves the two ends out of step: never reuse the channel.
            if self._sending is not None and not self._sending.done():
                self._sending.cancel()
            self.channel.close()
            self._holding = False
            self.channel.exclusive().release()
