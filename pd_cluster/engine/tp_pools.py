"""A tensor-parallel node's KV pools offered to a prefill node on its host: each rank its own.

A P on D's host writes the KV it hands over straight into D's pools (:mod:`pd_cluster.transfer.ipc`).
At TP > 1 each rank's pool holds only that rank's KV heads and lives in that rank's process, so
each rank exports its own pool, once, when rank 0 asks (:attr:`~pd_cluster.engine.tp_plan.Op.EXPORT_POOLS`:
the kinds wanted go through the node's store, each rank's handles come back the same way). Rank 0
then offers every peer one handle a rank, each naming the heads it holds; P writes each rank's
heads into that rank's pool, at the slots rank 0 reserved (the same slots on every rank), and the
KV never crosses the ranks.
"""

from __future__ import annotations

import torch.distributed as dist
from pydantic import BaseModel, Field

from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.transfer.ipc import KVPoolHandle, export_pool


class RankPools(BaseModel):
    """One rank's answer: its pool in each kind asked for that it could export."""

    handles: list[KVPoolHandle] = Field(default_factory=list)
    #: Why the export stopped early ("" when it did not).
    error: str = ""


def kinds_key(seq: int) -> str:
    return f"kv_pools/{seq}/kinds"


def rank_key(seq: int, rank: int) -> str:
    return f"kv_pools/{seq}/rank{rank}"


def export_rank_pool(pool: KVPool, first_head: int, kinds: list[str]) -> RankPools:
    """``pool`` (KV heads from ``first_head`` on) in each of ``kinds`` this process can export."""
    handles: list[KVPoolHandle] = []
    try:
        for kind in kinds:
            handle = export_pool(pool.k_cache, pool.v_cache, [kind], first_head)
            if handle is not None:
                handles.append(handle)
    except Exception as e:  # the node still serves; P sends through the channel
        return RankPools(handles=handles, error=f"{type(e).__name__}: {e}")
    return RankPools(handles=handles)


def answer_export(store: dist.Store, seq: int, rank: int, pool: KVPool, first_head: int) -> None:
    """A rank other than 0: export ``pool`` in the kinds rank 0 put in the store, answer there."""
    kinds = [kind for kind in store.get(kinds_key(seq)).decode().split(",") if kind]
    store.set(rank_key(seq, rank), export_rank_pool(pool, first_head, kinds).model_dump_json())


class NodePools:
    """What rank 0 offers a peer: its own pool, exported per peer in a kind the peer opens, and
    the other ranks' handles of that kind; nothing when some rank has none of the peer's kinds."""

    def __init__(self, pool: KVPool, first_head: int, ranks: list[RankPools]) -> None:
        self.pool = pool
        self.first_head = first_head
        #: Ranks 1 .. N-1, in order.
        self.ranks = ranks

    def __call__(self, peer_kinds: list[str]) -> list[KVPoolHandle]:
        for kind in peer_kinds:
            others = [next((h for h in rank.handles if h.kind == kind), None) for rank in self.ranks]
            if any(h is None for h in others):
                continue
            own = export_pool(self.pool.k_cache, self.pool.v_cache, [kind], self.first_head)
            if own is not None:
                return [own, *(h for h in others if h is not None)]
        return []

    def missing(self) -> str | None:
        """Why no kind is offered by every rank (None: some kind is)."""
        errors = [f"rank {r}: {rank.error}" for r, rank in enumerate(self.ranks, start=1) if rank.error]
        if errors:
            return "; ".join(errors)
        common = set.intersection(*({h.kind for h in rank.handles} for rank in self.ranks)) if self.ranks else set()
        return None if common else "the ranks exported their pools in no common kind"
