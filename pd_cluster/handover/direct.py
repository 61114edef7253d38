"""The in-place write: P on D's host writes a prompt's missing KV straight into D's reserved slots.

D shared its KV pools in the handshake (:mod:`pd_cluster.transfer.ipc`: one a rank, each with
the KV heads it holds) and answered the prefix query with the slots it reserved
(``MatchPrefix.direct``; rank 0 reserves them for every rank, so they are the same in each
pool). P copies the missing tokens' KV into them, each pool getting exactly its own heads,
layer by layer during the prefill (from ``layerwise_min_tokens`` missing tokens on, on a GPU
with its own compute stream) or in one launch a pool after it, waits until the writes have
landed, then sends ``CommitKV`` with ``written_tokens``: nothing goes through the tensor channel,
and a tensor-parallel D's rank 0 broadcasts no KV to its ranks (each already holds its heads).
Where ranks share a KV head (more ranks than KV heads), each of their pools gets it.

A tensor-parallel P (its pools hold part of the heads each) writes in one launch after the
prefill: its ranks' heads gathered to rank 0 (:class:`NodeKV`), then each D rank's heads
scattered into that rank's pool.

A D whose cache stores another KV dtype (P in bf16 for its prefill, D in fp8 for its streams)
is written the same way, its rows converted on the way: each copy gathers P's rows, converts
them (:func:`kernels.convert_kv`, the scales D's own store would compute) and scatters D's rows,
the values and scale of each, into D's pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import torch

import kernels
from pd_cluster.engine.node_kv import NodeKV
from pd_cluster.handover.errors import HandoverFailed
from pd_cluster.handover.lease import DecodeLease
from pd_cluster.handover.messages import CommitKV
from pd_cluster.handover.sender import Deadline, Handed, KVSender, WithHeldSlots, give_back
from pd_cluster.handover.side_stream import ReadyEvent, after_compute, on_side
from pd_cluster.kv_spec import KVSpec
from pd_cluster.transfer import PeerChannel, SharedPool, decode_slots

logger = logging.getLogger(__name__)

#: A direct write stops being queued this long before D's lease on the slots ends.
LEASE_MARGIN_S = 5.0
#: Longest wait for queued direct writes to land (they take milliseconds).
SETTLE_S = 10.0
#: How often the event loop looks whether a direct write has landed (it costs microseconds).
_POLL_S = 0.0002


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class DirectWrite:
    """KV of tokens [start, n_tokens) of one request written straight into the slots D reserved
    in its pools (shared on this host, :mod:`pd_cluster.transfer.ipc`, one a rank): each pool
    gets exactly the KV heads it holds; nothing is sent.

    Layer by layer during the prefill (:meth:`begin`/:meth:`capture`, the same hook as
    :class:`LayerStream`: each layer's copies are queued on a side stream behind the compute
    stream's store of that layer, so they run while later layers compute), or whole after it
    (:meth:`write_all`). Nothing is queued once the lease's safe end has passed: D may hand
    those slots to another request after it.

    ``target``: the KV as D stores it (default P's own); where its KV dtype differs, every copy
    converts P's rows into D's on the way.
    """

    def __init__(
        self, request_id: str, start: int, n_tokens: int, kv: NodeKV, targets: list[SharedPool],
        target_slots: torch.Tensor, side_stream: torch.cuda.Stream | None, write_until: float,
        target: KVSpec | None = None,
    ) -> None:
        if target_slots.numel() != n_tokens - start:
            raise ValueError(f"D reserved {target_slots.numel()} slots for {n_tokens - start} missing tokens")
        if not targets:
            raise ValueError("no pool to write into")
        #: The KV as D stores it; its rows fit every pool (checked here, before a byte is written).
        self.target = target or kv.spec
        storage = getattr(torch, self.target.storage_dtype)
        for pool in targets:
            if pool.k_cache.dtype != storage or pool.k_cache.shape[-1] < self.target.row_width:
                raise ValueError(f"D's pool of {pool.k_cache.dtype} rows of {pool.k_cache.shape[-1]} does not "
                                 f"hold {self.target.kv_dtype} rows of {self.target.row_width}")
        self._convert = self.target.kv_dtype != kv.spec.kv_dtype
        #: Tokens [start, n_tokens) of the request's prompt are the ones D lacks.
        self.request_id, self.start, self.n_tokens = request_id, start, n_tokens
        self.kv = kv
        #: P's pool (layer by layer reads it directly: only where it holds every head).
        self.pool = kv.pool
        #: D's pools, one a rank, each with the heads it holds; the slots are the same in each.
        self.targets = targets
        self._target_slots = {t.device: target_slots.to(t.device) for t in targets}
        self.num_layers = kv.spec.num_layers
        self._side = side_stream
        self.write_until = write_until
        self._slots: torch.Tensor | None = None
        self._last: list[ReadyEvent] = []
        self.layers_written = 0
        self.expired = False

    @property
    def tokens(self) -> int:
        return self.n_tokens - self.start

    @property
    def nbytes(self) -> int:
        """Bytes written into D's pools: each pool's heads (a head two ranks hold, written twice)."""
        spec = self.target
        return sum(self.tokens * spec.bytes_per_token * t.num_heads // spec.num_kv_heads for t in self.targets)

    @property
    def complete(self) -> bool:
        return self.layers_written == self.num_layers and not self.expired

    # ---- engine thread -----------------------------------------------------------------------

    def begin(self, slots: torch.Tensor) -> None:
        self._slots = slots

    def capture(self, layer: int) -> None:
        """Layer ``layer``'s KV is stored (in stream order): queue its copies into D's slots."""
        assert self._slots is not None, "begin() first"
        assert self.kv.whole, "layer by layer needs a pool of every head"
        if self.expired or time.monotonic() >= self.write_until:
            self.expired = True
            return
        after_compute(self._side)
        with on_side(self._side):
            self._copy(self._slots, slice(layer, layer + 1))
            self._last = self._record(self._side)
        self.layers_written += 1

    def write_all(self, slots: torch.Tensor) -> None:
        """Every layer at once, after the prefill (one launch a pool), on the current stream."""
        if time.monotonic() >= self.write_until:
            self.expired = True
            return
        if self.kv.whole:
            self._copy(slots, slice(None))
        else:
            rows = self._as_target(self.kv.gather(slots))  # every head, on P's rank 0
            for target in self.targets:
                part = rows[:, :, :, target.heads].to(target.device, non_blocking=True)
                with _on(target.device):
                    kernels.scatter_kv(part, target.k_cache, target.v_cache, self._target_slots[target.device])
        self._last = self._record(None)
        self.layers_written = self.num_layers

    def _copy(self, slots: torch.Tensor, layers: slice) -> None:
        """Layers ``layers`` of P's pool (every head) at ``slots`` into each of D's pools, its heads only."""
        pool = self.pool
        for target in self.targets:
            src_k, src_v = pool.k_cache[layers, :, target.heads], pool.v_cache[layers, :, target.heads]
            dst_k, dst_v = target.k_cache[layers], target.v_cache[layers]
            dst_slots = self._target_slots[target.device]
            if target.device == pool.device and not self._convert:
                kernels.copy_kv_slots(src_k, src_v, slots, dst_k, dst_v, dst_slots)
                continue
            rows = self._as_target(kernels.gather_kv(src_k, src_v, slots, self.kv.spec.row_width))
            rows = rows.to(target.device, non_blocking=True)
            with _on(target.device):
                kernels.scatter_kv(rows, dst_k, dst_v, dst_slots)

    def _as_target(self, rows: torch.Tensor) -> torch.Tensor:
        """Gathered rows ``[2, L, N, H, W]`` of P's KV dtype as D's rows (where the two differ)."""
        if not self._convert:
            return rows
        spec = self.kv.spec
        return kernels.convert_kv(rows, spec.kv_dtype, self.target.kv_dtype, spec.head_dim)

    def _record(self, stream: torch.cuda.Stream | None) -> list[ReadyEvent]:
        """One event a GPU written on, after the last op queued there."""
        if self.kv.device.type != "cuda":
            return []
        events: list[ReadyEvent] = []
        for target in dict.fromkeys(t.device for t in self.targets):
            event = torch.cuda.Event()
            if target != self.kv.device:
                # Across GPUs the last op of a write (the scatter) runs on the target GPU's stream.
                with torch.cuda.device(target):
                    event.record(torch.cuda.current_stream(target))
            elif stream is not None:
                event.record(stream)
            else:
                event.record()
            events.append(event)
        return events

    # ---- event loop --------------------------------------------------------------------------

    async def settle(self, timeout: float) -> bool:
        """Wait until every queued write has landed in D's pools; False if not within ``timeout``.
        Before a commit (D reads what it commits), and before a lease is given back on failure
        (D may reuse the slots at once)."""
        give_up = time.monotonic() + timeout
        while any(event is not None and not event.query() for event in self._last):
            if time.monotonic() >= give_up:
                return False
            await asyncio.sleep(_POLL_S)
        return True


class DirectSender(KVSender):
    """Writes blocks [hit_blocks, ...) of a prompt of ``n_tokens`` tokens into D's shared pools (one a rank).

    ``layerwise_min_tokens``: write layer by layer during the prefill from this many missing
    tokens on (None: always whole after it); ``target``: the KV as D stores it (another KV dtype:
    converted on the way, :class:`DirectWrite`)."""

    def __init__(
        self, channel: PeerChannel, lease: DecodeLease, request_id: str, n_tokens: int, kv: NodeKV,
        side_stream: torch.cuda.Stream | None, layerwise_min_tokens: int | None, target: KVSpec | None = None,
    ) -> None:
        super().__init__(channel, lease)
        self.target = target
        self.request_id = request_id
        self.n_tokens = n_tokens
        self.kv = kv
        self.side_stream = side_stream
        self.layerwise_min_tokens = layerwise_min_tokens
        self.writer: DirectWrite | None = None
        self._layerwise = False

    @property
    def nbytes(self) -> int:
        assert self.writer is not None, "begin() first"
        return self.writer.nbytes

    async def begin(self, left: Deadline) -> None:
        """Open the write into the slots D reserved (a layer sink when it goes layer by layer)."""
        node = self.lease.decode_node_id
        targets = self.channel.shared_pools
        if self.lease.slots is None or not targets:
            raise HandoverFailed(f"decode node {node} reserved no slots for an in-place write")
        start = self.lease.hit_blocks * self.kv.spec.block_size
        try:
            self.writer = DirectWrite(self.request_id, start, self.n_tokens, self.kv, targets,
                                      decode_slots(self.lease.slots), self.side_stream,
                                      self.lease.ends_at - LEASE_MARGIN_S, self.target)
        except ValueError as e:
            raise HandoverFailed(f"decode node {node}: {e}", retryable=False) from e
        tokens = self.writer.tokens
        self._layerwise = (self.kv.whole and self.layerwise_min_tokens is not None
                           and tokens >= self.layerwise_min_tokens)
        if self._layerwise and tokens:
            self.layer_sink = self.writer

    async def commit(self, first_token: int, with_held_slots: WithHeldSlots, left: Deadline) -> Handed:
        writer = self.writer
        assert writer is not None, "begin() first"
        node = self.lease.decode_node_id
        started = time.monotonic()
        if not self._layerwise and writer.tokens:
            await with_held_slots(self._write_whole)
        elif not writer.tokens:
            writer.layers_written = writer.num_layers
        if not await writer.settle(left()):
            raise HandoverFailed(f"the KV write into {node} did not finish in time")
        visible = time.monotonic() - started
        if not writer.complete:
            raise HandoverFailed(f"the KV lease on {node} ran short before the write")
        ack = await self.channel.request(
            CommitKV(lease_id=self.lease.lease_id, first_token=first_token, written_tokens=writer.tokens), left(),
        )
        seconds = time.monotonic() - started
        self.check_taken(ack)
        self.settled = True
        self.channel.bytes_written += writer.nbytes
        return Handed(bytes_sent=writer.nbytes, seconds=seconds, visible_seconds=visible)

    async def release(self, left: Deadline) -> Handed:
        """Layer-by-layer writes may still be queued when the request ends at its first token:
        they land before D gets its slots back (it may hand them out at once)."""
        if self.writer is not None and not await self.writer.settle(left()):
            raise HandoverFailed(f"the KV write into {self.lease.decode_node_id} did not finish in time")
        return await super().release(left)

    def _write_whole(self, held_slots: torch.Tensor) -> None:
        """Engine thread: the prompt's missing KV into D's slots in one launch."""
        writer = self.writer
        assert writer is not None
        writer.write_all(held_slots[writer.start : writer.n_tokens].to(self.kv.device))

    async def close(self) -> None:
        if self.settled:
            return
        # Nothing may land in D's slots once it can hand them out again.
        if self.writer is not None and not await self.writer.settle(SETTLE_S):
            logger.error("a KV write into %s did not land in %.0f s; its lease runs out instead",
                         self.lease.decode_node_id, SETTLE_S)
        elif self.channel.alive:
            await give_back(self.channel, self.lease.lease_id)
