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

Every policy prefers warm pairs: a P reports the D nodes it holds a formed and warmed data-plane
channel to, and forming one on a request's path costs seconds (NCCL communicator setup). A cold
pair is still routed to, never refused or queued for: when no pair is warm yet (a D that just
joined), or when every warm pair is overloaded. ``round_robin`` cycles through the warm nodes when
there are any; the scoring policies add a cold pair's cost to its score (:data:`COLD_PAIR_LOAD`,
:data:`COLD_PAIR_SCORE`, :data:`COLD_PAIR_PREFILL_TOKENS`), so a cold D wins only over warm ones
that are busier by more than that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import ClassVar

from master.registry import NodeRecord

#: cache_aware: how much a D's running load (fraction of its max running requests) costs,
#: in units of "whole prompt found in cache".
LOAD_WEIGHT = 0.5
#: cache_aware: how much a D's KV use after taking the request costs, in the same units.
KV_WEIGHT = 0.5
#: least_load: what a D no P holds a warm channel to costs, as extra load (a fraction of its max
#: running requests): a whole batch, so a cold D wins only over warm ones that queue requests.
COLD_PAIR_LOAD = 1.0
#: cache_aware: the same, in its units: as much as a whole prompt found in cache, since forming
#: a channel takes longer than any transfer a hit saves.
COLD_PAIR_SCORE = 1.0
#: Choosing P for a D: a P without a warm channel to that D counts as this many more queued
#: prompt tokens (about what a GPU prefills in the seconds a channel takes to form).
COLD_PAIR_PREFILL_TOKENS = 32768


@dataclass
class RouteRequest:
    """What routing needs to know about a request."""

    token_ids: Sequence[int]
    kv_need: int
    _hashes: dict[int, list[int]] = field(default_factory=dict, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the prompt's full blocks (computed once per block size; the API
        handler computes them off the event loop before routing asks)."""
        if block_size not in self._hashes:
            from pd_cluster.block_hash import block_hashes

            self._hashes[block_size] = block_hashes(self.token_ids, block_size)
        return self._hashes[block_size]


def admissible_decodes(decodes: Sequence[NodeRecord], kv_need: int) -> list[NodeRecord]:
    """Decode nodes that can take ``kv_need`` KV tokens now without evicting running work."""
    return [d for d in decodes if d.active and d.kv_available >= kv_need]


def cold_decodes(prefills: Sequence[NodeRecord], decodes: Sequence[NodeRecord]) -> set[str]:
    """Ids of the decode nodes that none of ``prefills`` holds a warm channel to."""
    return {d.node_id for d in decodes if not any(p.warm_with(d.node_id) for p in prefills)}


class RoutingPolicy(ABC):
    name: ClassVar[str]

    def pick_pair(
        self, request: RouteRequest, prefills: Sequence[NodeRecord], decodes: Sequence[NodeRecord],
        decode: NodeRecord | None = None,
    ) -> tuple[NodeRecord, NodeRecord]:
        """(P, D) for a request: D by the policy, preferring one some P holds a warm channel to,
        then P, preferring one warm with that D. ``decode`` fixes D (a retry that keeps it)."""
        if decode is None:
            decode = self.pick_decode(request, decodes, cold=cold_decodes(prefills, decodes))
        warm = [p for p in prefills if p.warm_with(decode.node_id)]
        return self.pick_prefill(request, prefills, warm=warm), decode

    def pick_prefill(
        self, request: RouteRequest, prefills: Sequence[NodeRecord], warm: Sequence[NodeRecord] | None = None
    ) -> NodeRecord:
        """P with the least prompt work queued (what it will do before this request), counting
        :data:`COLD_PAIR_PREFILL_TOKENS` more for a P outside ``warm`` (None: all are warm)."""

        def cost(p: NodeRecord) -> tuple:
            cold = warm is not None and p not in warm
            return (p.queued_prefill_tokens + (COLD_PAIR_PREFILL_TOKENS if cold else 0), len(p.inflight), p.node_id)

        return min(prefills, key=cost)

    @abstractmethod
    def pick_decode(
        self, request: RouteRequest, decodes: Sequence[NodeRecord], cold: Set[str] = frozenset()
    ) -> NodeRecord:
        """One of ``decodes`` (non-empty, all admissible); those in ``cold`` have no warm channel."""


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

    def pick_prefill(
        self, request: RouteRequest, prefills: Sequence[NodeRecord], warm: Sequence[NodeRecord] | None = None
    ) -> NodeRecord:
        return self._next("prefill", list(warm or prefills))

    def pick_decode(
        self, request: RouteRequest, decodes: Sequence[NodeRecord], cold: Set[str] = frozenset()
    ) -> NodeRecord:
        return self._next("decode", [d for d in decodes if d.node_id not in cold] or decodes)


class LeastLoadPolicy(RoutingPolicy):
    name = "least_load"

    def pick_decode(
        self, request: RouteRequest, decodes: Sequence[NodeRecord], cold: Set[str] = frozenset()
    ) -> NodeRecord:
        def cost(d: NodeRecord) -> tuple:
            return (d.load_ratio + (COLD_PAIR_LOAD if d.node_id in cold else 0.0), d.kv_used_ratio, d.node_id)

        return min(decodes, key=cost)


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

    def pick_decode(
        self, request: RouteRequest, decodes: Sequence[NodeRecord], cold: Set[str] = frozenset()
    ) -> NodeRecord:
        def cost(d: NodeRecord) -> tuple:
            score = self.score(request, d) - (COLD_PAIR_SCORE if d.node_id in cold else 0.0)
            return (-score, d.load_ratio, d.node_id)

        return min(decodes, key=cost)


POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobinPolicy, LeastLoadPolicy, CacheAwarePolicy)
}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
