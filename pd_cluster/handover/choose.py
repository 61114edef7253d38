"""Which path a prompt's KV takes to D: chosen per request from the pair and the missing tokens.

- D shares its pool with this host: written in place (:mod:`.direct`; converted on the way where
  D stores another KV dtype), layer by layer during the prefill from
  ``direct_layerwise_min_tokens`` missing tokens on, else in one launch after it.
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
import math
from dataclasses import dataclass, replace

import torch

from pd_cluster.engine.node_kv import NodeKV
from pd_cluster.handover.direct import DirectSender
from pd_cluster.handover.lease import DecodeLease
from pd_cluster.handover.push import PushSender
from pd_cluster.handover.sender import KVSender
from pd_cluster.handover.stream import LayerStream, StreamSender
from pd_cluster.transfer import PeerChannel


@dataclass(frozen=True)
class SendOptions:
    """How a prefill node sends KV (read per request: a node may change them while it serves)."""

    layerwise: bool
    layerwise_min_tokens: int
    layers_per_send: int
    #: In place, layer by layer from this many missing tokens on; None: always whole after the
    #: prefill (layer by layer needs a compute stream of its own).
    direct_layerwise_min_tokens: int | None


def choose_sender(
    channel: PeerChannel, lease: DecodeLease, request_id: str, n_tokens: int, kv: NodeKV,
    side_stream: torch.cuda.Stream | None, options: SendOptions,
) -> KVSender:
    """The sender of the missing KV of a prompt of ``n_tokens`` tokens, over ``channel``."""
    if not kv.whole:  # no layer-wise path (its node says so once, at start)
        options = replace(options, layerwise=False, direct_layerwise_min_tokens=None)
    target = kv.spec.with_kv_dtype(channel.peer_kv_dtype or kv.spec.kv_dtype)
    if channel.shared_pools:
        # Written in place, converted on the way where D stores another KV dtype.
        return DirectSender(channel, lease, request_id, n_tokens, kv, side_stream, options.direct_layerwise_min_tokens,
                            target)
    if target.kv_dtype != kv.spec.kv_dtype:
        # D stores another KV dtype: the blocks are converted after the gather, then pushed whole.
        return PushSender(channel, lease, n_tokens, kv, target)
    block_size = kv.spec.block_size
    send_blocks = math.ceil(n_tokens / block_size) - lease.hit_blocks
    if options.layerwise and send_blocks > 0 and send_blocks * block_size >= options.layerwise_min_tokens:
        stream = LayerStream(request_id, lease.hit_blocks * block_size, n_tokens, send_blocks * block_size, kv.pool,
                             asyncio.get_running_loop(), side_stream, options.layers_per_send)
        return StreamSender(channel, lease, stream)
    return PushSender(channel, lease, n_tokens, kv)
