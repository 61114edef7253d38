"""One request's KV on its way to a decode node, layer by layer, while the prefill forward runs:
sent through the tensor channel (:class:`LayerStream`), or written in place into a decode
node's pool on this host (:class:`DirectWrite`).

The engine thread calls :meth:`LayerStream.capture` after each layer's KV is stored: on a GPU
it queues a copy of that layer's slots into a send buffer on a side stream, behind an event
recorded on the compute stream, and hands the copy's event to the event loop. The loop
(:meth:`LayerStream.send`) sends each layer as soon as its copy is queued; the send waits on
the GPU for that copy only, so layer i travels while later layers compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import torch

import kernels
from pd_cluster.aio import wait_for
from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.transfer import ChannelError, PeerChannel, SharedPool

ReadyEvent = torch.cuda.Event | None
#: How often the event loop looks whether a direct write has landed (it costs microseconds).
_POLL_S = 0.0002


class LayerStream:
    """KV of tokens [start, n_tokens) of one request, zero-padded to ``padded_tokens``, sent in
    groups of ``layers_per_send`` layers (one send each: fewer, larger messages on the link,
    while the copies of the next group run)."""

    def __init__(
        self, request_id: str, start: int, n_tokens: int, padded_tokens: int, pool: KVPool,
        loop: asyncio.AbstractEventLoop, side_stream: torch.cuda.Stream | None, layers_per_send: int = 1,
    ) -> None:
        self.request_id = request_id
        self.start = start
        self.n_tokens = n_tokens
        self.padded_tokens = padded_tokens
        self.pool = pool
        self.num_layers = pool.spec.num_layers
        self.layer_shape = [2, padded_tokens, pool.spec.num_kv_heads, pool.spec.head_dim]
        self.layers_per_send = max(1, min(layers_per_send, self.num_layers))
        self._loop = loop
        self._side = side_stream
        self._ready: asyncio.Queue[tuple[int, ReadyEvent]] = asyncio.Queue()
        self.buffer: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None
        self.first_layer_at: float | None = None

    @property
    def dtype(self) -> str:
        return self.pool.spec.dtype

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: every layer's keys and values of ``padded_tokens`` tokens."""
        return self.padded_tokens * self.pool.spec.bytes_per_token

    # ---- engine thread -----------------------------------------------------------------------

    def begin(self, slots: torch.Tensor) -> None:
        """The step that completes the prompt is about to run; ``slots`` (a device view of the
        request's table row) hold tokens [start, n_tokens) once its inputs are written."""
        self._slots = slots
        shape = (self.num_layers, *self.layer_shape)
        with self._on_side():
            self.buffer = torch.empty(shape, dtype=self.pool.k_cache.dtype, device=self.pool.device)
            self.buffer[:, :, slots.numel() :].zero_()

    def capture(self, layer: int) -> None:
        """Layer ``layer``'s KV is stored (in stream order): queue its copy and announce it."""
        assert self.buffer is not None and self._slots is not None, "begin() first"
        ready: ReadyEvent = None
        if self._side is not None:
            stored = torch.cuda.Event()
            stored.record()
            self._side.wait_event(stored)
        with self._on_side():
            n = self._slots.numel()
            k_cache, v_cache = self.pool.layer(layer)
            torch.index_select(k_cache, 0, self._slots, out=self.buffer[layer, 0, :n])
            torch.index_select(v_cache, 0, self._slots, out=self.buffer[layer, 1, :n])
            if self._side is not None:
                ready = torch.cuda.Event()
                ready.record(self._side)
        self._loop.call_soon_threadsafe(self._ready.put_nowait, (layer, ready))

    def _on_side(self):
        return torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()

    # ---- event loop --------------------------------------------------------------------------

    def fill_from(self, buffer: torch.Tensor) -> None:
        """Stand in for a forward: every layer of ``buffer`` ([L, 2, padded, H, D]) is ready now."""
        self.buffer = buffer
        for layer in range(self.num_layers):
            self._ready.put_nowait((layer, None))

    async def send(self, channel: PeerChannel, left: Callable[[], float]) -> int:
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


class DirectWrite:
    """KV of tokens [start, n_tokens) of one request written straight into the slots D reserved
    in its pool (shared on this host, :mod:`pd_cluster.transfer.ipc`): nothing is sent.

    Layer by layer during the prefill (:meth:`begin`/:meth:`capture`, the same hook as
    :class:`LayerStream`: each layer's copy is queued on a side stream behind the compute
    stream's store of that layer, so it runs while later layers compute), or whole after it
    (:meth:`write_all`). Nothing is queued once the lease's safe end has passed: D may hand
    those slots to another request after it.
    """

    def __init__(
        self, request_id: str, start: int, n_tokens: int, pool: KVPool, target: SharedPool, target_slots: torch.Tensor,
        side_stream: torch.cuda.Stream | None, write_until: float,
    ) -> None:
        if target_slots.numel() != n_tokens - start:
            raise ValueError(f"D reserved {target_slots.numel()} slots for {n_tokens - start} missing tokens")
        self.request_id = request_id
        self.start = start
        self.n_tokens = n_tokens
        self.pool = pool
        self.target = target
        self.target_slots = target_slots
        self.num_layers = pool.spec.num_layers
        self._side = side_stream
        self.write_until = write_until
        self._slots: torch.Tensor | None = None
        self._last: ReadyEvent = None
        self.layers_written = 0
        self.expired = False

    @property
    def tokens(self) -> int:
        return self.n_tokens - self.start

    @property
    def nbytes(self) -> int:
        return self.tokens * self.pool.spec.bytes_per_token

    @property
    def complete(self) -> bool:
        return self.layers_written == self.num_layers and not self.expired

    # ---- engine thread -----------------------------------------------------------------------

    def begin(self, slots: torch.Tensor) -> None:
        self._slots = slots

    def capture(self, layer: int) -> None:
        """Layer ``layer``'s KV is stored (in stream order): queue its copy into D's slots."""
        assert self._slots is not None, "begin() first"
        if self.expired or time.monotonic() >= self.write_until:
            self.expired = True
            return
        if self._side is not None:
            stored = torch.cuda.Event()
            stored.record()
            self._side.wait_event(stored)
        with self._on_side():
            k_cache, v_cache = self.pool.k_cache[layer : layer + 1], self.pool.v_cache[layer : layer + 1]
            kernels.copy_kv_slots(k_cache, v_cache, self._slots, self.target.k_cache[layer : layer + 1],
                                  self.target.v_cache[layer : layer + 1], self.target_slots)
            self._last = self._record(self._side)
        self.layers_written += 1

    def write_all(self, slots: torch.Tensor) -> None:
        """Every layer at once, after the prefill (one launch), on the current stream."""
        if time.monotonic() >= self.write_until:
            self.expired = True
            return
        kernels.copy_kv_slots(self.pool.k_cache, self.pool.v_cache, slots, self.target.k_cache,
                              self.target.v_cache, self.target_slots)
        self._last = self._record(None)
        self.layers_written = self.num_layers

    def _record(self, stream: torch.cuda.Stream | None) -> ReadyEvent:
        if self.pool.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        target = self.target.device
        if target != self.pool.device:
            # Across GPUs the last op of a write (the scatter) runs on the target GPU's stream.
            with torch.cuda.device(target):
                event.record(torch.cuda.current_stream(target))
        elif stream is not None:
            event.record(stream)
        else:
            event.record()
        return event

    def _on_side(self):
        return torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()

    # ---- event loop --------------------------------------------------------------------------

    async def settle(self, timeout: float) -> bool:
        """Wait until every queued write has landed in D's pool; False if not within ``timeout``.
        Before a commit (D reads what it commits), and before a lease is given back on failure
        (D may reuse the slots at once)."""
        give_up = time.monotonic() + timeout
        while self._last is not None and not self._last.query():
            if time.monotonic() >= give_up:
                return False
            await asyncio.sleep(_POLL_S)
        return True
