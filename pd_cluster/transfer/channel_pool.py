"""The prefill node's channels to decode nodes, a bounded pool. :class:`ChannelPool` dials
(:func:`~pd_cluster.transfer.client.dial`) on :meth:`~ChannelPool.get` (a request) or
:meth:`~ChannelPool.warm` (ahead of any request, see :mod:`.keeper`), reuses, forgets channels
that failed, and closes the least recently used one beyond ``max_channels`` (each pair group
holds memory, about 100 MB of GPU memory for NCCL, so open channels must stay bounded).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time

import torch

from pd_cluster.aio import wait_for
from pd_cluster.kv_spec import KVSpec
from pd_cluster.transfer.client import PeerChannel, dial
from pd_cluster.transfer.errors import ChannelError
from pd_cluster.transfer.framing import MAX_FRAME_BYTES
from pd_cluster.transfer.handshake import warm_up_shape

logger = logging.getLogger(__name__)


class ChannelPool:
    """Channels from this prefill node to decode nodes, dialed on first use, LRU-bounded."""

    def __init__(
        self,
        token: str,
        kv_spec: KVSpec,
        node_id: str,
        device: torch.device | str,
        max_channels: int = 8,
        *,
        connect_timeout: float = 10.0,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        kv_ipc: bool = True,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> None:
        if max_channels < 1:
            raise ValueError("max_channels must be at least 1")
        self._token = token
        self.kv_spec = kv_spec
        self.node_id = node_id
        self.device = torch.device(device)
        self.max_channels = max_channels
        self.connect_timeout = connect_timeout
        self.max_frame_bytes = max_frame_bytes
        #: Accept D's KV pool when it is on this host (write in place instead of sending).
        self.kv_ipc = kv_ipc
        #: Client-side TLS of the control connections (None: plain TCP).
        self.tls = tls
        #: The name decode nodes' certificates are checked against (None: each one's host).
        self.server_name = server_name
        self._channels: dict[str, PeerChannel] = {}
        self._dial_locks: dict[str, asyncio.Lock] = {}
        # Totals over every channel this pool ever held, for metrics.
        self._retired_sent = 0
        self._retired_received = 0

    @property
    def addresses(self) -> list[str]:
        """Open channels' addresses, least recently used first (a request counts as a use)."""
        return [c.address for c in sorted(self._channels.values(), key=lambda c: c.last_used)]

    def __len__(self) -> int:
        return len(self._channels)

    def __contains__(self, address: str) -> bool:
        return address in self._channels

    def peek(self, address: str) -> PeerChannel | None:
        """The open channel to ``address`` if any, without dialing or counting a use."""
        return self._channels.get(address)

    @property
    def bytes_sent(self) -> int:
        return self._retired_sent + sum(c.bytes_sent for c in self._channels.values())

    @property
    def bytes_received(self) -> int:
        return self._retired_received + sum(c.bytes_received for c in self._channels.values())

    async def get(self, address: str) -> PeerChannel:
        """The channel to ``address``, dialing it if there is none or the old one died."""
        channel = self._live(address)
        if channel is not None:
            return channel
        lock = self._dial_locks.setdefault(address, asyncio.Lock())
        async with lock:
            channel = self._live(address)  # another caller may have dialed meanwhile
            if channel is not None:
                return channel
            channel = await dial(
                address,
                self._token,
                self.kv_spec,
                self.node_id,
                self.device,
                connect_timeout=self.connect_timeout,
                max_frame_bytes=self.max_frame_bytes,
                on_close=self._forget,
                kv_ipc=self.kv_ipc,
                tls=self.tls,
                server_name=self.server_name,
            )
            self._channels[address] = channel
            await self._evict()
            return channel

    async def warm(self, address: str, timeout: float) -> PeerChannel:
        """The channel to ``address``, dialed if needed and warmed with one block of KV-shaped
        zeros (:meth:`PeerChannel.warm_up`), all within ``timeout`` seconds. Raises like
        :meth:`get`. Warming does not count as a use for the LRU order."""
        deadline = time.monotonic() + timeout
        channel = self._channels.get(address)
        if channel is None or not channel.alive:
            try:
                channel = await wait_for(self.get(address), timeout)
            except asyncio.TimeoutError:
                raise ChannelError(f"dialing {address} took over {timeout:.1f}s") from None
        last_used = channel.last_used
        await channel.warm_up(warm_up_shape(self.kv_spec), self.kv_spec.dtype, max(deadline - time.monotonic(), 0.1))
        channel.last_used = last_used
        return channel

    async def close_idle(self, address: str, idle_s: float) -> bool:
        """Close the channel to ``address`` if it is dead, or if no exchange holds it and it was
        not used for ``idle_s`` seconds; True when it was closed (or there was none)."""
        channel = self._channels.get(address)
        if channel is None:
            return True
        busy = channel.exclusive().locked() or time.monotonic() - channel.last_used < idle_s
        if channel.alive and busy:
            return False
        del self._channels[address]
        self._dial_locks.pop(address, None)
        await channel.aclose()
        return True

    async def close(self) -> None:
        """Close every channel (their process groups included)."""
        channels = list(self._channels.values())
        await asyncio.gather(*(c.aclose() for c in channels), return_exceptions=True)
        self._channels.clear()
        self._dial_locks.clear()

    def _live(self, address: str) -> PeerChannel | None:
        channel = self._channels.get(address)
        if channel is None:
            return None
        if not channel.alive:
            channel.close()  # calls _forget
            self._channels.pop(address, None)
            return None
        channel.last_used = time.monotonic()
        return channel

    def _forget(self, channel: PeerChannel) -> None:
        if self._channels.get(channel.address) is channel:
            del self._channels[channel.address]
        self._retired_sent += channel.bytes_sent
        self._retired_received += channel.bytes_received

    async def _evict(self) -> None:
        while len(self._channels) > self.max_channels:
            # By last use, not by last get(): callers hold channels and use them directly.
            oldest = min(self._channels.values(), key=lambda c: c.last_used)
            address = oldest.address
            del self._channels[address]
            self._dial_locks.pop(address, None)
            logger.info("closing least recently used data-plane channel to %s (max %d)", address, self.max_channels)
            await oldest.aclose()
