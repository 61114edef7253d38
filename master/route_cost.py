"""What serving a request on a node would cost, in seconds: the one unit routing compares.

Every figure comes from what the nodes measure and report (``NodeStatus.prefill_tokens_per_s``,
``decode_step_base_s`` / ``decode_step_per_request_s``) and from the KV transfers the master
sees (:class:`LinkRate`); until a node has measured itself, the mean of the nodes that have is
used, and before any has, the defaults below. A node's own figure counts only where it differs
from that mean by more than :data:`LIKE_NODES_BAND`: like nodes measure a few percent apart from
one moment to the next, and over a request's hundreds of decode steps that jitter would outweigh
the prefill and transfer a prefix hit saves (a conversation would hop from the node holding its
history to an idle twin). A prefix hit counts only as the prefill and the transfer it saves.

* local prefill on D (or a mixed node): its queued local prompt tokens plus this request's missing
  ones, at its prefill rate;
* P -> D: P's queued prompt tokens plus this request's, at P's rate; the missing tokens' KV bytes
  at the link rate; the handover (a commit and D's first step); a channel still to be formed;
* on D, either way: the request's decode steps at the batch it joins
  (base + per_request * (load + 1)), and, past D's batch limit, the wait for a place in it;
* a local prefill on a decode node also slows the streams D is running (its prefill chunks share
  their steps): :meth:`CostModel.local_slowdown_s` prices the seconds they lose against their TPOT
  SLO, so D absorbs prefills while its streams have room under the SLO and P gets the work once
  they have none, however long P's queue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from master.registry import NodeRecord

#: Until any node has measured its prefill: prompt tokens per second.
DEFAULT_PREFILL_TOKENS_PER_S = 8000.0
#: Until any node has measured its decode step: seconds at no batch, and what a request adds.
DEFAULT_STEP_BASE_S = 0.010
DEFAULT_STEP_PER_REQUEST_S = 0.0002
#: Until a transfer has been seen: KV bytes per second between P and D.
DEFAULT_LINK_BYTES_PER_S = 5e9
#: A channel P has not formed yet (when P has not reported how long its last one took).
DEFAULT_CHANNEL_SETUP_S = 2.0
#: Output tokens a request is priced for: its max_tokens, but no more than this (most stop earlier).
OUTPUT_TOKENS_CAP = 256
#: Weight of a new transfer's rate in the running mean.
LINK_RATE_WEIGHT = 0.1
#: A node's measured rate within this fraction of the cluster's mean is priced at the mean.
LIKE_NODES_BAND = 0.15


@dataclass(frozen=True)
class Slo:
    """The latency targets the master serves to (``--slo-ttft-ms``, ``--slo-tpot-ms``); None: no target."""

    ttft_s: float | None = None
    tpot_s: float | None = None


class LinkRate:
    """Mean KV transfer rate the master saw (P's ``KVTransferred``: bytes and seconds)."""

    def __init__(self) -> None:
        self.bytes_per_s: float | None = None

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        self.bytes_per_s = rate if self.bytes_per_s is None else (
            (1 - LINK_RATE_WEIGHT) * self.bytes_per_s + LINK_RATE_WEIGHT * rate)

    @property
    def value(self) -> float:
        return self.bytes_per_s or DEFAULT_LINK_BYTES_PER_S


@dataclass(frozen=True)
class Rates:
    """The cluster's measured means, the fallback for a node that has not measured itself yet."""

    prefill_tokens_per_s: float
    step_base_s: float
    step_per_request_s: float

    @classmethod
    def of(cls, nodes: Sequence[NodeRecord]) -> Rates:
        """Means over ``nodes``: prefill rates of every role, decode lines of the nodes that decode
        (a prefill node's one-token steps, of fully cached prompts, are no decode line)."""
        prefill = [n.status.prefill_tokens_per_s for n in nodes if n.status.prefill_tokens_per_s > 0]
        steps = [n.status for n in nodes
                 if n.role != "prefill" and n.status.decode_step_base_s + n.status.decode_step_per_request_s > 0]
        return cls(
            prefill_tokens_per_s=sum(prefill) / len(prefill) if prefill else DEFAULT_PREFILL_TOKENS_PER_S,
            step_base_s=sum(s.decode_step_base_s for s in steps) / len(steps) if steps else DEFAULT_STEP_BASE_S,
            step_per_request_s=(sum(s.decode_step_per_request_s for s in steps) / len(steps) if steps
                                else DEFAULT_STEP_PER_REQUEST_S),
        )


def like_nodes(own: float, mean: float) -> float:
    """``own`` (a node's measured figure; 0 when not measured yet), or ``mean`` where the two are
    within :data:`LIKE_NODES_BAND` of each other or ``own`` is unknown."""
    if own <= 0 or abs(own - mean) <= LIKE_NODES_BAND * mean:
        return mean
    return own


class CostModel:
    """Seconds a request would spend on each candidate, from one snapshot of the nodes."""

    def __init__(self, rates: Rates, link: LinkRate, slo: Slo = Slo()) -> None:
        self.rates = rates
        self.link = link
        self.slo = slo

    def prefill_rate(self, node: NodeRecord) -> float:
        return like_nodes(node.status.prefill_tokens_per_s, self.rates.prefill_tokens_per_s)

    def step_s(self, node: NodeRecord, rows: int) -> float:
        """A decode step's time on ``node`` with ``rows`` requests in the batch."""
        s = node.status
        mean = self.rates.step_base_s + self.rates.step_per_request_s * rows
        if s.decode_step_base_s + s.decode_step_per_request_s > 0:
            return like_nodes(s.decode_step_base_s + s.decode_step_per_request_s * rows, mean)
        return mean

    def decode_s(self, node: NodeRecord, max_tokens: int) -> float:
        """The request's decode on ``node``: its steps at the batch it joins, and past the node's
        batch limit the wait for a place (requests ahead leave at the rate the batch finishes them)."""
        out = max(min(max_tokens, OUTPUT_TOKENS_CAP), 1)
        limit = node.info.capacity.max_running_requests
        rows = max(node.load, 0) + 1
        steps = out * self.step_s(node, min(rows, limit))
        over = rows - limit
        wait = over * out * self.step_s(node, limit) / limit if over > 0 else 0.0
        return steps + wait

    def local_prefill_s(self, node: NodeRecord, miss_tokens: int) -> float:
        """Prefill on the node that decodes (D or mixed), behind its queued local prefills."""
        return (node.queued_prefill_tokens + miss_tokens) / self.prefill_rate(node)

    def local_slowdown_s(self, node: NodeRecord, miss_tokens: int, max_tokens: int) -> float:
        """What a local prefill of ``miss_tokens`` on ``node`` costs the streams it runs, in seconds:
        each of them loses the prefill's time. Without a TPOT SLO all those seconds count; with one,
        they count by how much of the streams' headroom under the SLO the node's prefills use (the
        streams' remaining output priced like this request's), and past the headroom the prefill
        would break the SLO: infinite, P takes it."""
        streams = max(node.load, 0)
        if streams == 0:
            return 0.0
        rate = self.prefill_rate(node)
        lost = streams * miss_tokens / rate
        if self.slo.tpot_s is None:
            return lost
        out = max(min(max_tokens, OUTPUT_TOKENS_CAP), 1)
        headroom_s = (self.slo.tpot_s - self.step_s(node, streams + 1)) * out
        stall_s = (node.queued_prefill_tokens + miss_tokens) / rate
        if headroom_s <= 0 or stall_s > headroom_s:
            return math.inf
        return lost * stall_s / headroom_s

    def remote_prefill_s(
        self, prefill: NodeRecord, decode: NodeRecord, prompt_tokens: int, miss_tokens: int, warm: bool
    ) -> float:
        """P's queue and this prompt's prefill, the missing KV's transfer, the handover, and a
        channel still to be formed."""
        # P's own prefix cache is not reported: priced as if it held nothing (an upper bound).
        compute = (prefill.queued_prefill_tokens + prompt_tokens) / self.prefill_rate(prefill)
        transfer = miss_tokens * decode.info.kv_spec.bytes_per_token / self.link.value
        handover = self.step_s(decode, max(decode.load, 0) + 1)
        setup = 0.0 if warm else (prefill.status.channel_setup_s or DEFAULT_CHANNEL_SETUP_S)
        return compute + transfer + handover + setup
