"""Nodes that joined the cluster: who they are, what they report, and what the master sent them.

The registry is plain state on the event loop. It decides who may join (the cluster's model and
KV spec), keeps each node's last status and prefix index, and tells its listeners when a node
leaves so that the relay can settle the node's requests. It tells every prefill node which
decode nodes take work (``DecodePeers``) whenever that set changes, and counts the warm pairs:
a prefill node reports the decode nodes it holds a warmed data-plane channel to. Sockets live in :mod:`master.node_ws`;
a node here only has an outbox of frames that its socket's writer drains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

from pydantic import BaseModel

from master.metrics import NODE_STATES, ROLES, MasterMetrics
from master.model_info import ModelInfo
from master.prefix_index import PrefixIndex
from pd_cluster import protocol
from pd_cluster.kv_spec import KVSpec

logger = logging.getLogger(__name__)

#: switching: changing role (no new work; what it holds runs to its end).
NodeState = Literal["active", "draining", "switching"]

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY_VIOLATION = 1008


@dataclass(frozen=True)
class CloseFrame:
    """Outbox item telling the writer to close the socket."""

    code: int
    reason: str


@dataclass(eq=False)
class NodeRecord:
    """One registered node and the master's bookkeeping about it."""

    info: protocol.Register
    outbox: asyncio.Queue
    status: protocol.NodeStatus
    prefix: PrefixIndex
    registered_at: float = field(default_factory=time.time)
    last_status_at: float = field(default_factory=time.monotonic)
    state: NodeState = "active"
    removed: bool = False
    #: KV bytes this node sent (P) or received (D), counted as requests end.
    kv_transfer_bytes: int = 0
    #: D: attempt id -> KV tokens routed here that the node's status does not show yet.
    pending_kv: dict[str, int] = field(default_factory=dict)
    #: D: attempts whose first token arrived; their KV shows from the next status on.
    reported_kv: set[str] = field(default_factory=set)
    #: P: attempt id -> prompt tokens sent here and not yet prefilled.
    pending_prefill: dict[str, int] = field(default_factory=dict)
    #: Attempts (any phase) that involve this node.
    inflight: set[str] = field(default_factory=set)
    #: D: attempts this master ended here; those the node's last status still lists are not load
    #: (a status is up to one report interval old: without this a D that just answered looks busy).
    ended_attempts: set[str] = field(default_factory=set)
    #: Ended attempts this node still reported holding -> when the master last told it to abort.
    stale_aborts: dict[str, float] = field(default_factory=dict)
    #: Frames from this node that could not be parsed (logged sparingly).
    malformed_frames: int = 0
    #: The role it is changing to (state ``switching``), until it answers ``RoleChanged``.
    pending_role: str | None = None
    #: When it joined or last changed role (monotonic).
    role_since: float = field(default_factory=time.monotonic)

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def role(self) -> str:
        return self.info.role

    @property
    def active(self) -> bool:
        return self.state == "active" and not self.removed

    @property
    def warm_peers(self) -> list[str]:
        """P: decode nodes it reports a live, warmed data-plane channel to."""
        return self.status.warm_peers

    def warm_with(self, decode_id: str) -> bool:
        """P: whether its channel to ``decode_id`` is formed and warmed."""
        return decode_id in self.status.warm_peers

    def send(self, message: BaseModel) -> bool:
        """Queue a frame for the node without waiting; False when the node is gone or not reading."""
        if self.removed:
            return False
        try:
            self.outbox.put_nowait(protocol.encode(message))
        except asyncio.QueueFull:
            return False
        return True

    def request_close(self, code: int, reason: str) -> None:
        """Ask the writer to close the socket after the frames already queued."""
        try:
            self.outbox.put_nowait(CloseFrame(code, reason))
        except asyncio.QueueFull:
            # The writer is stuck: drop what it has not sent so the close gets through.
            while not self.outbox.empty():
                self.outbox.get_nowait()
            self.outbox.put_nowait(CloseFrame(code, reason))

    # ---- load, as routing sees it ------------------------------------------------------

    @property
    def kv_total(self) -> int:
        return self.status.total_kv_tokens or self.info.capacity.max_total_tokens

    @property
    def kv_available(self) -> int:
        """KV tokens a new request can take now: free + evictable, less what was routed unseen."""
        return self.status.free_kv_tokens + self.status.evictable_kv_tokens - sum(self.pending_kv.values())

    @property
    def load(self) -> int:
        stale = len(self.ended_attempts.intersection(self.status.request_ids)) if self.ended_attempts else 0
        return max(self.status.running + self.status.waiting - stale, 0) + len(self.pending_kv)

    @property
    def load_ratio(self) -> float:
        return max(self.load, 0) / self.info.capacity.max_running_requests

    @property
    def kv_used_ratio(self) -> float:
        return 1.0 - max(self.kv_available, 0) / max(self.kv_total, 1)

    @property
    def queued_prefill_tokens(self) -> int:
        return self.status.queued_prefill_tokens + sum(self.pending_prefill.values())

    @property
    def prefix_hit_rate(self) -> float | None:
        if self.status.prompt_tokens <= 0:
            return None
        return self.status.prefix_hit_tokens / self.status.prompt_tokens


class Registry:
    """The set of live nodes and the cluster identity they must share.

    The cluster's model name and KV shape come from the master's model directory when it has
    one; the KV dtype and block size (which depend on how nodes run) are pinned by the first
    node to join, and forgotten when the last node leaves. A master without a model directory
    learns all of it from the first node.
    """

    def __init__(self, metrics: MasterMetrics, model: ModelInfo | None, outbox_frames: int = 4096) -> None:
        self.metrics = metrics
        self.model = model
        self.outbox_frames = outbox_frames
        self.nodes: dict[str, NodeRecord] = {}
        self.cluster_spec: KVSpec | None = None
        #: Node ids an operator removed: refused until allowed again (:meth:`allow`).
        self.banned: set[str] = set()
        self.on_removed: list[Callable[[NodeRecord, str], None]] = []
        self.on_capacity: list[Callable[[], None]] = []

    # ---- identity ----------------------------------------------------------------------

    @property
    def model_name(self) -> str | None:
        if self.model is not None:
            return self.model.name
        return self.cluster_spec.model if self.cluster_spec is not None else None

    def refusal(self, msg: protocol.Register) -> str | None:
        """Why a node may not join, or None when it may."""
        if msg.node_id in self.banned:
            return (f"node id {msg.node_id!r} was removed by an operator; it may rejoin after "
                    f"POST /admin/nodes/{msg.node_id}/allow, or under a new id")
        if msg.node_id in self.nodes:
            return f"node id {msg.node_id!r} is already registered"
        if msg.role == "decode" and not msg.data_address:
            return "a decode node must announce its data_address"
        name = self.model_name
        if name is not None and msg.model != name:
            return f"model {msg.model!r} differs from the cluster's {name!r}"
        if msg.kv_spec.model != msg.model:
            return f"kv_spec.model {msg.kv_spec.model!r} differs from model {msg.model!r}"
        if self.model is not None:
            expected = {
                "num_layers": self.model.num_layers,
                "num_kv_heads": self.model.num_kv_heads,
                "head_dim": self.model.head_dim,
            }
            wrong = [key for key, value in expected.items() if getattr(msg.kv_spec, key) != value]
            if wrong:
                return f"KV spec differs from the model's in {', '.join(wrong)}"
        if self.cluster_spec is not None:
            wrong = self.cluster_spec.mismatch(msg.kv_spec)
            if wrong:
                return f"KV spec differs from the cluster's in {', '.join(wrong)}"
        return None

    # ---- membership --------------------------------------------------------------------

    def add(self, msg: protocol.Register) -> NodeRecord:
        """Register a node that passed :meth:`refusal`."""
        if self.cluster_spec is None:
            self.cluster_spec = msg.kv_spec
        capacity = msg.capacity
        status = protocol.NodeStatus(
            free_kv_tokens=capacity.max_total_tokens, total_kv_tokens=capacity.max_total_tokens
        )
        max_blocks = max(1024, 2 * capacity.max_total_tokens // msg.kv_spec.block_size)
        record = NodeRecord(
            info=msg,
            outbox=asyncio.Queue(maxsize=self.outbox_frames),
            status=status,
            prefix=PrefixIndex(max_blocks),
        )
        self.nodes[msg.node_id] = record
        logger.info(
            "node %s joined: role=%s device=%s kv_tokens=%d max_model_len=%d",
            msg.node_id, msg.role, msg.device, capacity.max_total_tokens, capacity.max_model_len,
        )
        self._update_gauge()
        if record.role == "decode":
            self._announce_decodes()
        self._notify_capacity()
        return record

    def remove(
        self, node_id: str, reason: str, code: int = CLOSE_NORMAL, ban: bool = False
    ) -> NodeRecord | None:
        """Forget a node, abort what it holds, close its socket and let listeners settle its
        requests (idempotent). ``ban``: refuse its id until :meth:`allow` (an operator's removal)."""
        record = self.nodes.pop(node_id, None)
        if ban and record is not None:
            self.banned.add(node_id)
        if record is None or record.removed:
            return None
        # Aborts go out before the close frame, while the record still sends: a node that is only
        # cut off (or comes back) must not go on with work the master is settling elsewhere.
        for attempt_id in sorted(record.inflight):
            record.send(protocol.Abort(request_id=attempt_id))
        record.removed = True
        record.request_close(code, reason)
        logger.info("node %s left: %s", node_id, reason)
        if not self.nodes:
            self.cluster_spec = None
        self._update_gauge()
        if record.role == "decode":
            self._announce_decodes()
        for listener in list(self.on_removed):
            try:
                listener(record, reason)
            except Exception:
                logger.exception("settling the requests of node %s failed", node_id)
        self._notify_capacity()
        return record

    def allow(self, node_id: str) -> bool:
        """Let a removed node id join again; False when it was not banned."""
        if node_id not in self.banned:
            return False
        self.banned.discard(node_id)
        logger.info("node id %s may rejoin", node_id)
        return True

    def discard(self, record: NodeRecord, reason: str, code: int = CLOSE_NORMAL) -> None:
        """Remove this very record (not a newer node that reused its id)."""
        if self.nodes.get(record.node_id) is record:
            self.remove(record.node_id, reason, code)

    def drain(self, node_id: str) -> NodeRecord | None:
        """Stop routing to a node and tell it to finish and leave."""
        record = self.nodes.get(node_id)
        if record is None:
            return None
        if record.state != "draining":
            self.mark_draining(record)
            record.send(protocol.Drain())
        return record

    def mark_draining(self, record: NodeRecord) -> None:
        if record.state != "draining":
            record.state = "draining"
            logger.info("node %s is draining", record.node_id)
            self._update_gauge()
            if record.role == "decode":
                self._announce_decodes()

    def set_role(self, node_id: str, role: str) -> NodeRecord | None:
        """Ask a node to change role: no new work reaches it until it answers ``RoleChanged``. Raises
        ValueError when it is draining (it is leaving)."""
        record = self.nodes.get(node_id)
        if record is None:
            return None
        if record.state == "draining":
            raise ValueError(f"node {node_id!r} is draining")
        if role != record.role or record.pending_role is not None:
            self.mark_switching(record, role)
            record.send(protocol.SetRole(role=role))
        return record

    def mark_switching(self, record: NodeRecord, role: str) -> None:
        if record.state == "active":
            record.state = "switching"
            record.pending_role = role
            logger.info("node %s is changing role %s -> %s", record.node_id, record.role, role)
            self._update_gauge()
            if record.role == "decode":
                self._announce_decodes()

    def handle_role_changed(self, record: NodeRecord, msg: protocol.RoleChanged) -> None:
        """The node serves as ``msg.info.role`` now (or, ``failed``, still as before): take its new
        registration and route to it again."""
        old = record.role
        new = msg.info
        if new.node_id != record.node_id or new.kv_spec != record.info.kv_spec:
            raise ValueError("a role change must keep the node's id and KV spec")
        if new.role == "decode" and not new.data_address:
            raise ValueError("a decode node must announce its data_address")
        record.info = new
        record.pending_role = None
        record.role_since = time.monotonic()
        if record.state == "switching":
            record.state = "active"
        if (old == "prefill") != (new.role == "prefill"):
            record.prefix.apply([], [], cleared=True)  # a prefill node reports no KV events
        outcome = "failed" if msg.failed else "done"
        self.metrics.role_changes.labels(from_role=old, to_role=new.role, outcome=outcome).inc()
        if msg.failed:
            logger.warning("node %s could not change role, still %s: %s", record.node_id, new.role, msg.failed)
        else:
            logger.info("node %s changed role %s -> %s", record.node_id, old, new.role)
        self._update_gauge()
        if "decode" in (old, new.role):
            self._announce_decodes()
        self._notify_capacity()

    def get(self, node_id: str | None) -> NodeRecord | None:
        return self.nodes.get(node_id) if node_id is not None else None

    def active(self, role: str) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.role == role and n.active]

    def max_model_len(self) -> int | None:
        """The longest context every active node accepts (capped by the model's), or None if unknown."""
        limits = [n.info.capacity.max_model_len for n in self.nodes.values() if n.active]
        if self.model is not None:
            limits.append(self.model.max_model_len)
        return min(limits) if limits else None

    def warm_pairs(self) -> int:
        """Pairs of an active P and an active D whose channel P reports warm."""
        decodes = {d.node_id for d in self.active("decode")}
        return sum(len(decodes.intersection(p.warm_peers)) for p in self.active("prefill"))

    def decode_peers(self) -> protocol.DecodePeers:
        """The decode nodes that take new work, as a prefill node needs them to form channels."""
        return protocol.DecodePeers(peers=[
            protocol.DecodePeer(node_id=d.node_id, data_address=d.info.data_address or "")
            for d in sorted(self.active("decode"), key=lambda d: d.node_id)
        ])

    def largest_decode_kv(self) -> int | None:
        totals = [n.kv_total for n in self.active("decode") + self.active("mixed")]
        return max(totals) if totals else None

    # ---- reports -----------------------------------------------------------------------

    def handle_status(self, record: NodeRecord, msg: protocol.NodeStatus) -> None:
        warmth_changed = record.role == "prefill" and msg.warm_peers != record.status.warm_peers
        record.status = msg
        record.last_status_at = time.monotonic()
        if record.ended_attempts:
            record.ended_attempts.intersection_update(msg.request_ids)
        if warmth_changed:
            logger.info("prefill node %s: warm channels to %s", record.node_id, ", ".join(msg.warm_peers) or "none")
            self.metrics.warm_channels.set(self.warm_pairs())
        for attempt_id in record.reported_kv:
            record.pending_kv.pop(attempt_id, None)
        record.reported_kv.clear()
        if msg.draining:
            self.mark_draining(record)
        elif msg.switching_to is not None:  # another master asked it
            self.mark_switching(record, msg.switching_to)
        self._notify_capacity()

    def handle_kv_events(self, record: NodeRecord, msg: protocol.KVEvents) -> None:
        record.prefix.apply(msg.stored, msg.evicted, msg.cleared)

    # ---- internals ---------------------------------------------------------------------

    def _notify_capacity(self) -> None:
        for listener in list(self.on_capacity):
            try:
                listener()
            except Exception:
                logger.exception("capacity listener failed")

    def _announce_decodes(self) -> None:
        message = self.decode_peers()
        for record in self.nodes.values():
            if record.role == "prefill":
                record.send(message)

    def _update_gauge(self) -> None:
        counts = {(role, state): 0 for role in ROLES for state in NODE_STATES}
        for record in self.nodes.values():
            counts[(record.role, record.state)] += 1
        for (role, state), count in counts.items():
            self.metrics.nodes.labels(role=role, state=state).set(count)
        self.metrics.warm_channels.set(self.warm_pairs())
