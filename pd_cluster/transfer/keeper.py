"""Warm channels ahead of requests: the prefill node's background keeper of its channel pool.

The master lists the decode nodes that take work (``DecodePeers``); :meth:`ChannelKeeper.set_peers`
hands that list over. In the background the keeper then

* dials and warms a channel to each listed node (:meth:`ChannelPool.warm`), so the first request
  to a pair pays no setup; at most ``max_channels`` of them, in an order of its own (rendezvous
  hashing of this node's and the peer's ids), so several prefill nodes spread over many decode
  nodes; it never evicts a channel to make room;
* retries a failed warm-up with exponential backoff while the node stays listed;
* closes the channels to nodes no longer listed (drained, gone) once no request uses them
  (``in_use``: the node's own view of its requests in flight) and they sat idle for
  ``idle_close_s``; before the first list it closes nothing;
* calls ``on_change`` whenever :attr:`~ChannelKeeper.warm_peers` changes, so the node can tell
  the master at once.

Every wait has a deadline: a dial and warm-up within ``warm_timeout``, a periodic re-check every
``check_s`` (a warmed channel whose peer died drops out of :attr:`~ChannelKeeper.warm_peers`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Mapping

from pd_cluster.aio import wait_for
from pd_cluster.transfer.channel_pool import ChannelPool
from pd_cluster.transfer.errors import HandshakeRefused, TransferError

logger = logging.getLogger(__name__)


class ChannelKeeper:
    def __init__(
        self,
        pool: ChannelPool,
        *,
        on_change: Callable[[list[str]], None] | None = None,
        in_use: Callable[[str], bool] | None = None,
        warm_timeout: float = 60.0,
        retry_s: float = 0.5,
        max_backoff_s: float = 15.0,
        check_s: float = 1.0,
        idle_close_s: float = 2.0,
    ) -> None:
        self.pool = pool
        self.on_change = on_change
        self.in_use = in_use
        self.warm_timeout = warm_timeout
        self.retry_s = retry_s
        self.max_backoff_s = max_backoff_s
        self.check_s = check_s
        self.idle_close_s = idle_close_s
        #: Listed decode nodes: node id -> data-plane address; ``listed``: a list arrived.
        self.peers: dict[str, str] = {}
        self.listed = False
        #: Seconds the last successful dial + warm-up took (None before the first).
        self.setup_seconds: float | None = None
        self.failures = 0
        self._warming: dict[str, asyncio.Task] = {}
        self._closing: dict[str, asyncio.Task] = {}
        self._backoff: dict[str, float] = {}
        self._next_try: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._runner: asyncio.Task | None = None
        self._reported: list[str] = []

    # ---- what the node uses -------------------------------------------------------------------

    def start(self) -> None:
        if self._runner is None:
            self._runner = asyncio.create_task(self._run(), name="channel-keeper")

    def set_peers(self, peers: Mapping[str, str]) -> None:
        """The decode nodes to keep warm (node id -> address): the whole list, replacing the last."""
        self.peers = dict(peers)
        self.listed = True
        for node_id in set(self._backoff) - set(self.peers):
            self._backoff.pop(node_id, None)
            self._next_try.pop(node_id, None)
        self._wake.set()

    @property
    def warm_peers(self) -> list[str]:
        """Listed decode nodes with a live channel that was warmed, by node id."""
        warm = []
        for node_id, address in self.peers.items():
            channel = self.pool.peek(address)
            if channel is not None and channel.warmed and channel.alive and channel.peer_node_id == node_id:
                warm.append(node_id)
        return sorted(warm)

    async def close(self, timeout: float = 10.0) -> None:
        """Stop warming and closing (the pool's channels stay: the pool closes them)."""
        tasks = [t for t in (self._runner, *self._warming.values(), *self._closing.values()) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        self._runner = None

    # ---- the loop ------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                self._reconcile()
                self._report()
            except Exception:  # never let the keeper die: requests would go cold
                logger.exception("channel keeper pass failed")
            try:
                await wait_for(self._wake.wait(), self.check_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    def _reconcile(self) -> None:
        listed = set(self.peers.values())
        for address in self.pool.addresses if self.listed else ():
            if address in listed or address in self._closing:
                continue
            if self.in_use is not None and self.in_use(address):
                continue  # a request still talks to it (routed before the node was unlisted)
            self._spawn_close(address)
        warming_addresses = {self.peers.get(node_id) for node_id in self._warming}
        now = time.monotonic()
        for node_id in self._order():
            if node_id in self._warming or now < self._next_try.get(node_id, 0.0):
                continue
            address = self.peers[node_id]
            channel = self.pool.peek(address)
            if channel is not None and channel.warmed and channel.alive:
                continue
            if channel is None:
                # A new channel needs room: never evict one to warm another.
                open_or_dialing = set(self.pool.addresses) | warming_addresses
                if len(open_or_dialing) >= self.pool.max_channels:
                    continue
            warming_addresses.add(address)
            self._warming[node_id] = asyncio.create_task(self._warm(node_id, address), name=f"warm {node_id}")

    def _order(self) -> list[str]:
        """Listed node ids, in this prefill node's rendezvous order."""

        def rank(node_id: str) -> bytes:
            return hashlib.blake2b(f"{self.pool.node_id}|{node_id}".encode(), digest_size=8).digest()

        return sorted(self.peers, key=rank)

    async def _warm(self, node_id: str, address: str) -> None:
        started = time.monotonic()
        try:
            channel = await self.pool.warm(address, self.warm_timeout)
        except asyncio.CancelledError:
            raise
        except (TransferError, OSError, ValueError, asyncio.TimeoutError) as e:
            self.failures += 1
            backoff = self._backoff.get(node_id, self.retry_s / 2) * 2
            if isinstance(e, HandshakeRefused):
                backoff = self.max_backoff_s  # a refusal will not change soon
            backoff = min(backoff, self.max_backoff_s)
            if node_id in self.peers:
                self._backoff[node_id] = backoff
                self._next_try[node_id] = time.monotonic() + backoff
            logger.warning("warming the data-plane channel to %s (%s) failed: %s; retrying in %.1fs",
                           node_id, address, e or type(e).__name__, backoff)
        else:
            self.setup_seconds = time.monotonic() - started
            self._backoff.pop(node_id, None)
            self._next_try.pop(node_id, None)
            if channel.peer_node_id != node_id:
                logger.warning("data-plane address %s of %s answers as %s", address, node_id, channel.peer_node_id)
            else:
                logger.info("data-plane channel to %s (%s) warm over %s in %.2fs", node_id, address,
                            channel.backend, self.setup_seconds)
        finally:
            self._warming.pop(node_id, None)
            self._wake.set()

    def _spawn_close(self, address: str) -> None:
        async def close() -> None:
            try:
                if await self.pool.close_idle(address, self.idle_close_s):
                    logger.info("closed the data-plane channel to %s: no longer listed", address)
                    self._wake.set()
            finally:
                self._closing.pop(address, None)

        self._closing[address] = asyncio.create_task(close(), name=f"close {address}")

    def _report(self) -> None:
        warm = self.warm_peers
        if warm != self._reported:
            self._reported = warm
            if self.on_change is not None:
                try:
                    self.on_change(warm)
                except Exception:
                    logger.exception("channel keeper's change listener failed")
