"""The planner's decision (``--planner slo``): which node, if any, should change role now.

A pure function of one snapshot (:func:`decide`), so every rule is tested without a cluster. It
compares the work arriving (prompt tokens and output tokens a second, :mod:`master.load_mix`)
with what each side can do, from the rates the nodes measure and report
(:mod:`pd_cluster.engine.step_rates`):

* prefill capacity: the prefill nodes' prompt tokens a second;
* decode capacity: each decode or mixed node's output tokens a second at the largest batch whose
  step keeps to the TPOT SLO (its step line ``base + per_request * rows``; without an SLO, its
  batch limit).

Each side's use is its work over its capacity. With hysteresis (a use must pass ``high`` to call
for more capacity, fall under ``low`` to give some back; a node changes role at most once per
``dwell_s``; one change a round), the rules are:

* ``decode_short``: the decode side is over ``high`` and the prefill side would stay under
  ``high`` with one prefill node less: a prefill node goes to the decode side;
* ``prefill_idle``: the prefill side is under ``low`` and less used than the decode side: a
  prefill node goes to the decode side (most clusters serve best with no idle prefill node);
* ``prefill_short``: the prefill side is over ``high`` (with no prefill node: one node's worth of
  prompts would use more than ``high`` of it) and the decode side would stay under ``high`` with
  one node less: a mixed (else a decode) node becomes a prefill node.

A prefill node that leaves the prefill side becomes a decode node while another prefill node
remains, and a mixed node when it is the last (a decode node without a prefill node prefills
everything itself anyway). The decode side always keeps a node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

PlannerReason = Literal["decode_short", "prefill_idle", "prefill_short"]
#: A node's figures before it measured any: prompt tokens a second, decode step seconds (base, per row).
FALLBACK_PREFILL_TOKENS_PER_S = 8000.0
FALLBACK_STEP = (0.010, 0.0002)


@dataclass(frozen=True)
class PlannerConfig:
    """Thresholds of the hysteresis and the SLO decode capacity is measured at."""

    high: float = 0.8
    low: float = 0.3
    dwell_s: float = 60.0
    tpot_s: float | None = None


@dataclass(frozen=True)
class NodeView:
    """What the planner knows of one active node."""

    node_id: str
    role: str
    #: Seconds since it joined or last changed role.
    in_role_s: float
    max_running_requests: int
    prefill_tokens_per_s: float = 0.0
    step_base_s: float = 0.0
    step_per_request_s: float = 0.0
    running: int = 0
    queued_prefill_tokens: int = 0


@dataclass(frozen=True)
class LoadView:
    """The work arriving, a second: prompt tokens (to prefill) and output tokens (to decode)."""

    prompt_tokens_per_s: float
    output_tokens_per_s: float


@dataclass(frozen=True)
class Move:
    node_id: str
    from_role: str
    to_role: str
    reason: PlannerReason
    #: The uses (work / capacity) the decision saw, for the log.
    prefill_use: float
    decode_use: float


def prefill_capacity(node: NodeView) -> float:
    return node.prefill_tokens_per_s if node.prefill_tokens_per_s > 0 else FALLBACK_PREFILL_TOKENS_PER_S


def decode_capacity(node: NodeView, tpot_s: float | None) -> float:
    """Output tokens a second the node decodes at the largest batch whose step keeps to ``tpot_s``."""
    base, per = ((node.step_base_s, node.step_per_request_s)
                 if node.step_base_s + node.step_per_request_s > 0 else FALLBACK_STEP)
    rows = float(node.max_running_requests)
    if tpot_s is not None:
        rows = min(rows, (tpot_s - base) / per if per > 0 else rows)
    if rows < 1:
        return 1.0 / max(base + per, 1e-6)  # even one stream misses the SLO: what one row does
    return rows / max(base + per * rows, 1e-6)


def _use(work: float, capacity: float) -> float:
    return work / capacity if capacity > 0 else (float("inf") if work > 0 else 0.0)


def decide(nodes: Sequence[NodeView], load: LoadView, config: PlannerConfig) -> Move | None:
    """The one role change this round calls for, or None."""
    prefills = [n for n in nodes if n.role == "prefill"]
    decodes = [n for n in nodes if n.role in ("decode", "mixed")]
    if not decodes:
        return None
    p_cap = sum(prefill_capacity(n) for n in prefills)
    d_cap = sum(decode_capacity(n, config.tpot_s) for n in decodes)
    p_use = _use(load.prompt_tokens_per_s, p_cap)
    d_use = _use(load.output_tokens_per_s, d_cap)
    settled = [n for n in nodes if n.in_role_s >= config.dwell_s]

    movable_p = sorted((n for n in prefills if n in settled), key=lambda n: (n.queued_prefill_tokens, n.node_id))
    if movable_p:
        p = movable_p[0]
        to = "decode" if len(prefills) > 1 else "mixed"
        without = _use(load.prompt_tokens_per_s, p_cap - prefill_capacity(p))
        if d_use > config.high and (len(prefills) == 1 or without < config.high):
            return Move(p.node_id, "prefill", to, "decode_short", p_use, d_use)
        if p_use < config.low and p_use < d_use:
            return Move(p.node_id, "prefill", to, "prefill_idle", p_use, d_use)

    movable_d = sorted((n for n in decodes if n in settled),
                       key=lambda n: (n.role != "mixed", n.running, n.node_id))
    if movable_d and len(decodes) > 1:
        d = movable_d[0]
        one_more = prefill_capacity(d)
        p_short = p_use > config.high if prefills else _use(load.prompt_tokens_per_s, one_more) > config.high
        d_after = _use(load.output_tokens_per_s, d_cap - decode_capacity(d, config.tpot_s))
        if p_short and d_after < config.high:
            return Move(d.node_id, d.role, "prefill", "prefill_short", p_use, d_use)
    return None
