"""A handover rehearsed on a node's own engine before it serves, through the loopback backend.

One block of zeros goes the way a layer-wise stream arrives from a prefill node: prefix query
and lease, the layer groups scattered into the reserved slots, then the lease given back. The
receiving path's kernels (the scatter of each layer group, a view of its own shape) compile
now instead of on the first long prompt. A receiver of its own counts the rehearsal, so the
node's counters show none of it; the slots go back to the pool and nothing enters the cache.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.worker import EngineWorker
from pd_cluster.handover.lease import reserve
from pd_cluster.handover.loopback import LoopbackLink
from pd_cluster.handover.receiver import DecodeCounters, KVReceiver
from pd_cluster.handover.reservations import Reservations
from pd_cluster.handover.stream import LayerStream, StreamSender
from pd_cluster.protocol import PrefillJob
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REHEARSAL_ID = "handover-rehearsal"


async def rehearse_handover(engine: LLMEngine, worker: EngineWorker, reservations: Reservations,
                            timeout_s: float = 60.0, layers_per_send: int = 4) -> float:
    """Stream one block of KV into ``engine`` and release it; returns the seconds it took.
    Call before the node serves (its engine idle)."""
    started = time.monotonic()
    deadline = started + timeout_s

    def left() -> float:
        return max(deadline - time.monotonic(), 0.0)

    receiver = KVReceiver(engine, worker, reservations, DecodeCounters(), timeout_s)
    link = LoopbackLink(receiver.handle, address="rehearsal", decode_node_id="self", prefill_node_id="self",
                        p_device=engine.device, d_device=engine.device, on_disconnect=receiver.peer_gone)
    spec = engine.kv_spec
    vocab = engine.model_config.vocab_size
    job = PrefillJob(request_id=REHEARSAL_ID, token_ids=[(7 * i + 3) % vocab for i in range(spec.block_size)],
                     sampling=SamplingParams(temperature=0.0, max_tokens=1), decode_node_id="self",
                     decode_address="rehearsal", deadline_s=timeout_s)
    try:
        lease = await reserve(link.channel, job, timeout_s, left)
        stream = LayerStream(REHEARSAL_ID, lease.hit_blocks * spec.block_size, spec.block_size,
                             (1 - lease.hit_blocks) * spec.block_size, engine.pool, asyncio.get_running_loop(), None,
                             layers_per_send, spec=spec)
        sender = StreamSender(link.channel, lease, stream)
        try:
            await sender.begin(left)
            stream.fill_from(torch.zeros((spec.num_layers, *stream.layer_shape), dtype=engine.pool.k_cache.dtype,
                                         device=engine.device))
            await sender.release(left)
        finally:
            sender.abandon()
            await sender.close()
    finally:
        await link.aclose()
    seconds = time.monotonic() - started
    logger.info("rehearsed a handover through the loopback in %.1f ms", seconds * 1e3)
    return seconds
