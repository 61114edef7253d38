"""P <-> D data-plane messages: the KV handover (the meaning layered on :mod:`pd_cluster.transfer`).

P sends through one :class:`~pd_cluster.handover.sender.KVSender` per path (:mod:`.push`,
:mod:`.stream`, :mod:`.direct`); D answers with :mod:`.receiver` and :mod:`.reservations`.

1. P -> D ``MatchPrefix``: D pins its cached leading blocks of the prompt, reserves slots for
   the rest under a lease, and answers ``MatchResult`` (hit_blocks).
2. The KV of blocks [hit_blocks, n_blocks) moves one of two ways (a partial last block is sent
   whole, zero-padded); the bytes on the wire are the same: (n_blocks - hit_blocks) x bytes per block.

   Whole (push): P -> D ``PushKV`` + the tensor of those blocks, carrying the first token: D
   scatters the KV, caches the prompt, joins the request to its batch, answers ``PushAck``.
   No sampling state travels: a request's random stream is a function of its seed and the
   output position, so D continues it at position 1.

   Layer by layer (stream, GPU nodes: P sends each layer's KV while its prefill still runs):

   a. P -> D ``StreamKV`` before the prefill: the KV follows in layer order, in groups of
      ``layers_per_send`` layers (the last group may be smaller), each group one tensor of
      [layers in the group] + ``layer_shape``, ``layer_shape`` = [2, tokens, kv_heads, head_dim]
      (keys, then values). D scatters each layer into its reserved slots as it lands and answers
      ``PushAck`` once all have.
   b. P -> D ``CommitKV`` with the first token, sent as soon as P has them
      (without waiting for the stream's ack): D caches the prompt, joins the request to its
      batch and answers ``PushAck``.

   In place (P and D on one host, D shared its KV pool in the handshake, ``MatchPrefix.direct``):
   ``MatchResult.slots`` lists D's reserved slots; P writes the missing tokens' KV straight into
   them (no padding, nothing on the wire; layer by layer during the prefill, or whole after it),
   waits until the writes are done, then sends ``CommitKV`` with ``written_tokens``. D never
   hands those slots to anyone else before the commit, a release, or the lease's end; a P that
   disconnects loses its leases after a short grace.

   Every way, ``ReleaseLease`` instead when the request ended at its first token (``Released``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pd_cluster.sampling_params import SamplingParams
from pd_cluster.transfer import DataMessage


class MatchPrefix(DataMessage):
    type: Literal["kv.match"] = "kv.match"
    request_id: str = Field(min_length=1, max_length=256)
    token_ids: list[int]
    sampling: SamplingParams
    lease_s: float = Field(gt=0, le=3600)
    direct: bool = Field(default=False, description="P writes into D's shared pool: answer the reserved slots")


class MatchResult(DataMessage):
    type: Literal["kv.match_result"] = "kv.match_result"
    lease_id: str | None = None
    hit_blocks: int = 0
    slots: str | None = Field(default=None, description="base64 int64 slots reserved for the missing tokens")
    error: str | None = None
    retryable: bool = True
    busy: bool = Field(default=False, description="refused for want of room (rows or KV), not for a fault")


# ---- whole push --------------------------------------------------------------------------


class PushKV(DataMessage):
    type: Literal["kv.push"] = "kv.push"
    lease_id: str
    shape: list[int]
    dtype: str
    first_token: int


class PushAck(DataMessage):
    type: Literal["kv.push_ack"] = "kv.push_ack"
    ok: bool = True
    error: str | None = None


# ---- layer-wise stream -------------------------------------------------------------------


class StreamKV(DataMessage):
    type: Literal["kv.stream"] = "kv.stream"
    lease_id: str
    num_layers: int = Field(gt=0)
    layer_shape: list[int] = Field(min_length=4, max_length=4)
    dtype: str
    layers_per_send: int = Field(default=1, ge=1, le=1024)


class CommitKV(DataMessage):
    type: Literal["kv.commit"] = "kv.commit"
    lease_id: str
    first_token: int
    written_tokens: int | None = Field(default=None, ge=0, description="in place: tokens P wrote into D's pool")


# ---- early end ---------------------------------------------------------------------------


class ReleaseLease(DataMessage):
    type: Literal["kv.release"] = "kv.release"
    lease_id: str


class Released(DataMessage):
    type: Literal["kv.released"] = "kv.released"
    existed: bool
