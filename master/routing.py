"""Which prefill node and which decode node serve a request (``--policy``).

Admission comes first and is the same for every policy: a decode node is a candidate only if it
can hold the request's whole KV (prompt + max_tokens) in its free and evictable slots right now,
counting what was routed to it but does not show in its status yet. The policy then chooses among
the candidates:

* ``round_robin``: the next node by id after the last one chosen, per role.
* ``least_load``: D with the fewest running/waiting requests (relative to its capacity), then the
  most free KV; P with the fewest queued prefill tokens.
* ``cache_aware`` (default): D by a score that weighs the bytes of KV a prefix hit saves against
  the D's load and memory pressure, so a D that holds the conversation's history wins unless it
  is saturated; P with the fewest queued prefill tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from master.registry import NodeRecord

#: cache_aware: how much a D's running load (fraction of its max running requests) costs,
#: in units of "whole prompt found in cache".
LOAD_WEIGHT = 0.5
#: cache_aware: how much a D's KV use after taking the request costs, in the same units.
KV_WEIGHT = 0.5


@dataclass
class RouteRequest:
    """What routing needs to know about a request."""

    token_ids: Sequence[int]
    kv_need: int
    _hashes: dict[int, list[int]] = field(default_factory=dict, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    def set_block_hashes(self, block_size: int, hashes: list[int]) -> None:
        self._hashes[block_size] = hashes

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the prompt's full blocks (computed once per block size)."""
        if block_size not in self._hashes:
            from pd_cluster.engine.block_hash import block_hashes

            self._hashes[block_size] = block_hashes(self.token_ids, block_size)
        return self._hashes[block_size]


def admissible_decodes(decodes: Sequence[NodeRecord], kv_need: int) -> list[NodeRecord]:
    """Decode nodes that can take ``kv_need`` KV tokens now without evicting running work."""
    return [d for d in decodes if d.active and d.kv_available >= kv_need]


class RoutingPolicy(ABC):
    name: ClassVar[str]

    def pick_prefill(self, request: RouteRequest, prefills: Sequence[NodeRecord]) -> NodeRecord:
        """P with the least prompt work queued (what it will do before this request)."""
        return min(prefills, key=lambda p: (p.queued_prefill_tokens, len(p.inflight), p.node_id))

    @abstractmethod
    def pick_decode(self, request: RouteRequest, decodes: Sequence[NodeRecord]) -> NodeRecord:
        """One of ``decodes`` (non-empty, all admissible)."""


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._last: dict[str, str] = {}

    def _next(self, role: str, nodes: Sequence[NodeRecord]) -> NodeRecord:
        ordered = sorted(nodes, key=lambda n: n.node_id)
        last = self._last.get(role)
        chosen = next((n for n in ordered if last is None or n.node_id > last), ordered[0])
        self._last[role] = chosen.node_id
        return chosen

    def pick_prefill(self, request: RouteRequest, prefills: Sequence[NodeRecord]) -> NodeRecord:
        return self._next("prefill", prefills)

    def pick_decode(self, request: RouteRequest, decodes: Sequence[NodeRecord]) -> NodeRecord:
        return self._next("decode", decodes)


class LeastLoadPolicy(RoutingPolicy):
    name = "least_load"

    def pick_decode(self, request: RouteRequest, decodes: Sequence[NodeRecord]) -> NodeRecord:
        return min(decodes, key=lambda d: (d.load_ratio, d.kv_used_ratio, d.node_id))


class CacheAwarePolicy(RoutingPolicy):
    name = "cache_aware"

    def hit_tokens(self, request: RouteRequest, decode: NodeRecord) -> int:
        block_size = decode.info.kv_spec.block_size
        if len(decode.prefix) == 0:
            return 0
        blocks = decode.prefix.match(request.block_hashes(block_size))
        return min(blocks * block_size, request.prompt_tokens)

    def score(self, request: RouteRequest, decode: NodeRecord) -> float:
        """Saved transfer (fraction of the prompt's KV bytes) less load and memory-pressure costs.

        A saturated D (load ratio >= 1) gets no credit for hits: its queue would cost more time
        than the transfer saves. The KV term counts only the tokens the D must newly store, so a
        hit also spares its memory.
        """
        bytes_per_token = decode.info.kv_spec.bytes_per_token
        hit = self.hit_tokens(request, decode)
        saved_bytes = hit * bytes_per_token
        prompt_bytes = max(request.prompt_tokens, 1) * bytes_per_token
        load = decode.load_ratio
        benefit = saved_bytes / prompt_bytes if load < 1.0 else 0.0
        free_after = decode.kv_available - (request.kv_need - hit)
        kv_used_after = 1.0 - max(free_after, 0) / max(decode.kv_total, 1)
        return benefit - LOAD_WEIGHT * min(load, 2.0) - KV_WEIGHT * kv_used_after

    def pick_decode(self, request: RouteRequest, decodes: Sequence[NodeRecord]) -> NodeRecord:
        return min(decodes, key=lambda d: (-self.score(request, d), d.load_ratio, d.node_id))


POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobinPolicy, LeastLoadPolicy, CacheAwarePolicy)
}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
