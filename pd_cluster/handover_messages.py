"""Data-plane messages of the P -> D handover (the meaning layered on pd_cluster.transfer).

1. P -> D ``MatchPrefix``: D pins its cached leading blocks of the prompt, reserves slots for
   the rest under a lease, and answers ``MatchResult`` (hit_blocks).
2. P -> D ``PushKV`` + the tensor of blocks [hit_blocks, n_blocks) (a partial last block is
   sent whole, zero-padded), carrying the first token and sampling state: D scatters the KV,
   caches the prompt, joins the request to its batch, answers ``PushAck``.
   Or ``ReleaseLease`` when the request ended at its first token.
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


class MatchResult(DataMessage):
    type: Literal["kv.match_result"] = "kv.match_result"
    lease_id: str | None = None
    hit_blocks: int = 0
    error: str | None = None
    retryable: bool = True


class PushKV(DataMessage):
    type: Literal["kv.push"] = "kv.push"
    lease_id: str
    shape: list[int]
    dtype: str
    first_token: int
    rng_state: str


class PushAck(DataMessage):
    type: Literal["kv.push_ack"] = "kv.push_ack"
    ok: bool = True
    error: str | None = None


class ReleaseLease(DataMessage):
    type: Literal["kv.release"] = "kv.release"
    lease_id: str


class Released(DataMessage):
    type: Literal["kv.released"] = "kv.released"
    existed: bool
