"""Layer-wise P -> D handover (GPU nodes): P streams each layer's KV while its prefill still runs.

Replaces step 2 of :mod:`pd_cluster.handover_messages` (``PushKV``) after a ``MatchResult``:

1. P -> D ``StreamKV`` before the prefill: the KV of blocks [hit_blocks, n_blocks) follows as
   ``num_layers`` tensors of ``layer_shape`` = [2, tokens, kv_heads, head_dim] (keys, then
   values; a partial last block zero-padded), one per layer, in layer order. D scatters each
   layer into its reserved slots as it lands and answers ``PushAck`` once all have.
2. P -> D ``CommitKV`` with the first token and sampling state, sent as soon as P has them
   (without waiting for the stream's ack): D caches the prompt, joins the request to its batch
   and answers ``PushAck``. Or ``ReleaseLease`` when the request ended at its first token.

The bytes on the wire are the same as ``PushKV``'s: (n_blocks - hit_blocks) x bytes per block.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pd_cluster.transfer import DataMessage


class StreamKV(DataMessage):
    type: Literal["kv.stream"] = "kv.stream"
    lease_id: str
    num_layers: int = Field(gt=0)
    layer_shape: list[int] = Field(min_length=4, max_length=4)
    dtype: str


class CommitKV(DataMessage):
    type: Literal["kv.commit"] = "kv.commit"
    lease_id: str
    first_token: int
    rng_state: str
