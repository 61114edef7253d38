"""Which path a prompt's KV takes to D: chosen per request from the pair and the missing tokens.

- D shares its pool with this host: written in place (:mod:`.direct`), layer by layer during
  the prefill from ``direct_layerwise_min_tokens`` missing tokens on, else in one launch after it.
- Otherwise through the tensor channel: layer by layer while the prefill runs (:mod:`.stream`)
  when ``layerwise`` and from ``layerwise_min_tokens`` tokens to send on, else in one push after
  the first token (:mod:`.push`).

The thresholds are measured (see ``prefill_node.service``): a path is taken only where it hides time.

A tensor-parallel P sends whole after the prefill (its ranks' heads gathered once,
:class:`~pd_cluster.engine.node_kv.NodeKV`): layer by layer would need a gather of every layer
during the forward, so both layer-wise paths are off there.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from dataclasses import dataclass

import torch

from pd_cluster.engine.node_kv import NodeKV
from pd_cluster.handover.direct import DirectSender
from pd_cluster.handover.lease import DecodeLease
from pd_cluster.handover.push import PushSender
from pd_cluster.handover.sender import KVSender
from pd_cluster.handover.stream import LayerStream, StreamSender
from pd_cluster.transfer import PeerChannel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SendOptions:
    """How a prefill node sends KV (read per request: a node may change them while it serves)."""

    layerwise: bool
    layerwise_min_tokens: int
    layers_per_send: int
    #: In place, layer by layer from this many missing tokens on; None: always whole after the
    #: prefill (layer by layer needs a compute stream of its own).
    direct_layerwise_min_tokens: int | None


@functools.cache
def _say_whole_only() -> None:
    logger.info("tensor parallel: KV goes to decode nodes whole after the prefill (no layer-wise sends)")


def whole_only(options: SendOptions) -> SendOptions:
    """``options`` for a tensor-parallel P: no layer-wise path (said once in the log)."""
    if options.layerwise or options.direct_layerwise_min_tokens is not None:
        _say_whole_only()
    return SendOptions(layerwise=False, layerwise_min_tokens=options.layerwise_min_tokens,
                       layers_per_send=options.layers_per_send, direct_layerwise_min_tokens=None)


def choose_sender(
    channel: PeerChannel, lease: DecodeLease, request_id: str, n_tokens: int, kv: NodeKV,
    side_stream: torch.cuda.Stream | None, options: SendOptions,
) -> KVSender:
    """The sender of the missing KV of a prompt of ``n_tokens`` tokens, over ``channel``."""
    if not kv.whole:
        options = whole_only(options)
    if channel.shared_pool is not None:
        return DirectSender(channel, lease, request_id, n_tokens, kv, side_stream, options.direct_layerwise_min_tokens)
    block_size = kv.spec.block_size
    send_blocks = math.ceil(n_tokens / block_size) - lease.hit_blocks
    if options.layerwise and send_blocks > 0 and send_blocks * block_size >= options.layerwise_min_tokens:
        stream = LayerStream(request_id, lease.hit_blocks * block_size, n_tokens, send_blocks * block_size, kv.pool,
                             asyncio.get_running_loop(), side_stream, options.layers_per_send)
        return StreamSender(channel, lease, stream)
    return PushSender(channel, lease, n_tokens, kv)
