"""Where a request runs (``--policy``): on a (P, D) pair, or whole on one node (D's local prefill,
or a mixed node), and which nodes.

Admission comes first and is the same for every policy: a decode (or mixed) node is a candidate
only if its batch has a free row (``max_running_requests``) and it can hold the request's whole KV
(prompt + max_tokens) in its free and evictable slots right now, counting what was routed to it
but does not show in its status yet (:mod:`master.decode_room`). With no candidate the request
waits in the admission queue: a full decode node is backpressure, never a failure.

Then the path (:meth:`RoutingPolicy.plan`). A mixed node always serves the request whole. On a
decode node, a request whose missing prompt tokens (the prompt less D's prefix hit) are at most
``local_prefill_max_tokens`` (a cap) may be prefilled on D itself: it saves P's queue, the transfer
and the handover, but holds up D's running streams. ``cache_aware`` decides it from the route cost:
P's queued work, the transfer and the handover against D's own queue and the slowdown its streams
would take against their TPOT SLO (:meth:`master.route_cost.CostModel.local_slowdown_s`); a P whose
queue outgrows what D can absorb without breaking the SLO still gets the work. The policies that do
not price (``least_load``, ``round_robin``) prefill locally only the misses of at most
:data:`SHORT_MISS_TOKENS` (and the cap). With no P ready, every request is prefilled where it
decodes. Each decision is counted with its reason (``pdc_route_decisions_total``).

The policies choose among the candidates:

* ``cache_aware`` (default): the option with the least time the request would wait and compute
  there, in seconds (:mod:`master.route_cost`): queued and own prefill at the node's measured
  rate, KV transfer at the measured link rate, handover, decode steps at the batch the request
  joins and the wait for a place in it. A prefix hit counts only as the prefill and transfer time
  it saves, so a shared chat template does not outweigh a busy node.
* ``least_load``: D (or mixed) with the fewest running/waiting requests (relative to its
  capacity), then the most free KV; P with the fewest queued prefill tokens.
* ``round_robin``: the next node by id after the last one chosen, per role.

Every policy prefers warm pairs: a P reports the decode nodes it holds a formed and warmed
data-plane channel to, and forming one on a request's path costs seconds (NCCL communicator
setup). A cold pair is still routed to, never refused or queued for. ``round_robin`` cycles
through the warm nodes when there are any; ``least_load`` adds :data:`COLD_PAIR_LOAD`;
``cache_aware`` adds the channel's setup time as P reported it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from master.decode_room import HeldOff, has_room
from master.registry import NodeRecord
from master.route_cost import DEFAULT_CHANNEL_SETUP_S, CostModel, LinkRate, Rates, Slo

#: least_load: what a D no P holds a warm channel to costs, as extra load (a fraction of its max
#: running requests): a whole batch, so a cold D wins only over warm ones that queue requests.
COLD_PAIR_LOAD = 1.0
#: Choosing P for a D (least_load, round_robin): a P without a warm channel to that D counts as
#: this many more queued prompt tokens (about what a GPU prefills in the seconds a channel takes).
COLD_PAIR_PREFILL_TOKENS = 32768
#: least_load, round_robin: the longest miss they let a decode node prefill itself (they do not
#: price D's streams' slowdown, so they keep to misses too short to hold those streams up much).
SHORT_MISS_TOKENS = 512

@dataclass
class RouteRequest:
    """What routing needs to know about a request."""

    token_ids: Sequence[int]
    kv_need: int
    _hashes: dict[int, list[int]] = field(default_factory=dict, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def max_tokens(self) -> int:
        return max(self.kv_need - len(self.token_ids), 1)

    def remember_hashes(self, block_size: int, hashes: list[int]) -> None:
        """Block hashes computed elsewhere (with the prompt's encoding, off the event loop)."""
        self._hashes[block_size] = hashes

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the prompt's full blocks (computed once per block size; the API
        handler computes them off the event loop before routing asks)."""
        if block_size not in self._hashes:
            from pd_cluster.block_hash import block_hashes

            self._hashes[block_size] = block_hashes(self.token_ids, block_size)
        return self._hashes[block_size]


def admissible_decodes(
    decodes: Sequence[NodeRecord], kv_need: int, held_off: HeldOff | None = None
) -> list[NodeRecord]:
    """Decode (and mixed) nodes with a free row in their batch and ``kv_need`` KV tokens now
    (without evicting running work), and not held off since their last report."""
    return [d for d in decodes if has_room(d, kv_need, held_off)]


def cold_decodes(prefills: Sequence[NodeRecord], decodes: Sequence[NodeRecord]) -> set[str]:
    """Ids of the decode nodes that none of ``prefills`` holds a warm channel to (mixed nodes
    need no channel: never cold)."""
    return {d.node_id for d in decodes
            if d.role == "decode" and not any(p.warm_with(d.node_id) for p in prefills)}


def hit_tokens(request: RouteRequest, node: NodeRecord) -> int:
    """Leading prompt tokens whose KV ``node`` holds, by its reported prefix index."""
    if len(node.prefix) == 0:
        return 0
    block_size = node.info.kv_spec.block_size
    blocks = node.prefix.match(request.block_hashes(block_size))
    return min(blocks * block_size, request.prompt_tokens)


Path = Literal["pd", "local"]
#: Why a path was taken (the label of ``pdc_route_decisions_total``).
#: short_miss: D prefills it (within the cap, and for cache_aware priced cheaper than P -> D);
#: long_miss: over the cap; pd_faster: priced cheaper through P; tpot_slo: D's streams would break
#: their TPOT SLO; local_disabled: a cap of 0.
Reason = Literal["mixed", "no_prefill", "short_miss", "long_miss", "pd_faster", "tpot_slo", "local_disabled"]


@dataclass(frozen=True)
class Plan:
    """Where one attempt runs: ``pd`` (``prefill`` then ``decode``) or ``local`` (whole on ``decode``)."""

    path: Path
    decode: NodeRecord
    prefill: NodeRecord | None
    reason: Reason
    hit_tokens: int
    #: cache_aware: the seconds it priced the chosen option at.
    cost_s: float | None = None


def local_reason(node: NodeRecord, miss: int, prefills: Sequence[NodeRecord], local_max: int) -> Reason | None:
    """Why ``node`` prefills this request itself, or None when it goes through a P."""
    if node.role == "mixed":
        return "mixed"
    if not prefills:
        return "no_prefill"
    if miss <= local_max and local_max > 0:
        return "short_miss"
    return None


class RoutingPolicy(ABC):
    name: ClassVar[str]

    def __init__(self, slo: Slo = Slo()) -> None:
        #: KV transfer rate the master saw (the relay feeds it P's reports).
        self.link = LinkRate()
        self.slo = slo

    def local_cap(self, local_max: int) -> int:
        """The longest miss a decode node may prefill itself under this policy."""
        return min(local_max, SHORT_MISS_TOKENS)

    def plan(
        self, request: RouteRequest, prefills: Sequence[NodeRecord], decodes: Sequence[NodeRecord],
        local_max: int, decode: NodeRecord | None = None,
    ) -> Plan:
        """The path and nodes of one attempt. ``decodes``: admissible decode and mixed nodes (non-empty);
        ``decode`` fixes the node that decodes (a retry that keeps it)."""
        if decode is None:
            decode = self.pick_decode(request, decodes, cold=cold_decodes(prefills, decodes))
        hit = hit_tokens(request, decode)
        reason = local_reason(decode, request.prompt_tokens - hit, prefills, self.local_cap(local_max))
        if reason is not None:
            return Plan("local", decode, None, reason, hit)
        warm = [p for p in prefills if p.warm_with(decode.node_id)]
        return Plan("pd", decode, self.pick_prefill(request, prefills, warm=warm),
                    "long_miss" if local_max > 0 else "local_disabled", hit)

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

    def __init__(self, slo: Slo = Slo()) -> None:
        super().__init__(slo)
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
    """Least time: every option (local prefill on each candidate, each P -> D pair) priced in
    seconds by :class:`master.route_cost.CostModel`."""

    name = "cache_aware"

    def hit_tokens(self, request: RouteRequest, decode: NodeRecord) -> int:
        return hit_tokens(request, decode)

    def local_cap(self, local_max: int) -> int:
        return local_max

    def _costs(self, prefills: Sequence[NodeRecord], decodes: Sequence[NodeRecord]) -> CostModel:
        return CostModel(Rates.of([*prefills, *decodes]), self.link, self.slo)

    def _best_prefill(
        self, costs: CostModel, request: RouteRequest, prefills: Sequence[NodeRecord], decode: NodeRecord, miss: int
    ) -> tuple[float, NodeRecord]:
        priced = [
            (costs.remote_prefill_s(p, decode, request.prompt_tokens, miss, p.warm_with(decode.node_id)), p)
            for p in prefills
        ]
        return min(priced, key=lambda item: (item[0], len(item[1].inflight), item[1].node_id))

    def _options(
        self, costs: CostModel, request: RouteRequest, prefills: Sequence[NodeRecord], d: NodeRecord, local_max: int
    ) -> list[tuple[float, Plan]]:
        """Every way ``d`` can serve the request, priced: its own prefill (a mixed node, no P ready,
        or a decode node within the cap whose streams keep to their TPOT SLO) and each P -> D."""
        hit = hit_tokens(request, d)
        miss = request.prompt_tokens - hit
        decode_s = costs.decode_s(d, request.max_tokens)
        options: list[tuple[float, Plan]] = []
        reason = local_reason(d, miss, prefills, local_max)
        why: Reason = "long_miss" if local_max > 0 else "local_disabled"
        if reason is not None:
            local_s = costs.local_prefill_s(d, miss) + decode_s
            if reason == "short_miss":
                local_s += costs.local_slowdown_s(d, miss, request.max_tokens)
            if local_s < float("inf"):
                options.append((local_s, Plan("local", d, None, reason, hit, local_s)))
                why = "pd_faster"
            else:
                why = "tpot_slo"
        if d.role == "decode" and prefills:
            remote_s, p = self._best_prefill(costs, request, prefills, d, miss)
            remote_s += decode_s
            options.append((remote_s, Plan("pd", d, p, why, hit, remote_s)))
        return options

    def plan(
        self, request: RouteRequest, prefills: Sequence[NodeRecord], decodes: Sequence[NodeRecord],
        local_max: int, decode: NodeRecord | None = None,
    ) -> Plan:
        costs = self._costs(prefills, decodes)
        best: tuple[float, float, str, Plan] | None = None
        for d in [decode] if decode is not None else decodes:
            for cost, option in self._options(costs, request, prefills, d, local_max):
                key = (cost, d.load_ratio, d.node_id, option)
                if best is None or key[:3] < best[:3]:
                    best = key
        assert best is not None, "plan needs a candidate"
        return best[3]

    def pick_decode(
        self, request: RouteRequest, decodes: Sequence[NodeRecord], cold: Set[str] = frozenset()
    ) -> NodeRecord:
        """The node where the request's decode, plus the prefill and transfer its missing tokens
        need (at that node's rate), takes the least time; a node in ``cold`` adds a channel's setup."""
        costs = self._costs([], decodes)

        def cost(d: NodeRecord) -> tuple:
            miss = request.prompt_tokens - hit_tokens(request, d)
            seconds = (costs.decode_s(d, request.max_tokens) + miss / costs.prefill_rate(d)
                       + miss * d.info.kv_spec.bytes_per_token / self.link.value
                       + (DEFAULT_CHANNEL_SETUP_S if d.node_id in cold else 0.0))
            return (seconds, d.load_ratio, d.node_id)

        return min(decodes, key=cost)

    def pick_pair(
        self, request: RouteRequest, prefills: Sequence[NodeRecord], decodes: Sequence[NodeRecord],
        decode: NodeRecord | None = None,
    ) -> tuple[NodeRecord, NodeRecord]:
        """(P, D) by the least time over every pair (a P -> D path only)."""
        plan = self.plan(request, prefills, [d for d in decodes if d.role == "decode"], local_max=0, decode=decode)
        assert plan.prefill is not None
        return plan.prefill, plan.decode


POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobinPolicy, LeastLoadPolicy, CacheAwarePolicy)
}


def make_policy(name: str, slo: Slo = Slo()) -> RoutingPolicy:
    try:
        return POLICIES[name](slo)
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
