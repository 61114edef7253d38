"""Operator API: list nodes, drain one, change one's role, remove one (its id stays refused until allowed). Every call needs ``Authorization: Bearer <PD_ADMIN_TOKEN>``.

In a master of several workers a change is applied by every worker (:mod:`master.worker_fanout`)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from master.auth import bearer_matches
from master.context import MasterContext
from master.errors import APIError, unauthorized
from master.registry import CLOSE_NORMAL, NodeRecord
from master.worker_fanout import FANOUT_HEADER, fan_out
from pd_cluster import protocol

router = APIRouter(prefix="/admin")


def _authorize(request: Request) -> MasterContext:
    ctx: MasterContext = request.app.state.ctx
    if ctx.settings.admin_token is None:
        raise unauthorized("The admin API is disabled: the master has no admin token (PD_ADMIN_TOKEN).")
    if not bearer_matches(request.headers.get("authorization"), ctx.settings.admin_token):
        raise unauthorized("Missing or wrong admin token.")
    return ctx


async def _on_siblings(
    request: Request, ctx: MasterContext, answer: dict[str, Any], body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Repeat an applied change on the sibling workers (unless it came from one); the answer then
    names the workers that did not apply it."""
    if ctx.settings.worker_index is None or request.headers.get(FANOUT_HEADER):
        return answer
    failed = await fan_out(ctx.settings, request.method, request.url.path, request.headers["authorization"], body)
    return {**answer, "workers_failed": failed} if failed else answer


def _unknown(node_id: str) -> APIError:
    return APIError(404, f"No node {node_id!r} is registered.", "invalid_request_error", "node_id", "node_not_found")


def node_view(node: NodeRecord) -> dict[str, Any]:
    status = node.status
    total = node.kv_total
    return {
        "id": node.node_id,
        "role": node.role,
        "state": node.state,
        # The role it is changing to (state "switching"), else None.
        "pending_role": node.pending_role,
        "model": node.info.model,
        "device": node.info.device,
        "data_address": node.info.data_address,
        "registered_at": int(node.registered_at),
        "last_status_age_s": round(time.monotonic() - node.last_status_at, 3),
        "kv_transfer_bytes": node.kv_transfer_bytes,
        "load": {
            "running": status.running,
            "waiting": status.waiting,
            "queued_prefill_tokens": status.queued_prefill_tokens,
            "routed_in_flight": len(node.inflight),
            "generation_tokens_per_s": status.generation_tokens_per_s,
            # Measured by the node; routing prices requests with them (0: not measured yet).
            "prefill_tokens_per_s": status.prefill_tokens_per_s,
            "decode_step_base_s": status.decode_step_base_s,
            "decode_step_per_request_s": status.decode_step_per_request_s,
        },
        "kv": {
            "total_tokens": total,
            "free_tokens": status.free_kv_tokens,
            "evictable_tokens": status.evictable_kv_tokens,
            "used_fraction": round(1.0 - status.free_kv_tokens / total, 4) if total else None,
        },
        "prefix": {
            "hit_tokens": status.prefix_hit_tokens,
            "prompt_tokens": status.prompt_tokens,
            "hit_rate": node.prefix_hit_rate,
            "indexed_blocks": len(node.prefix),
        },
        "data_plane": {
            # P: decode nodes it holds a warmed channel to; D: prefill nodes that warmed one to it.
            "warm_peers": list(status.warm_peers),
            "channel_setup_s": status.channel_setup_s,
        },
        "capacity": node.info.capacity.model_dump(),
        "kv_spec": node.info.kv_spec.model_dump(),
    }


@router.get("/nodes")
async def list_nodes(request: Request) -> dict[str, Any]:
    ctx = _authorize(request)
    nodes = sorted(ctx.registry.nodes.values(), key=lambda n: (n.role, n.node_id))
    return {"object": "list", "data": [node_view(n) for n in nodes], "warm_pairs": ctx.registry.warm_pairs()}


@router.post("/nodes/{node_id}/drain")
async def drain_node(node_id: str, request: Request) -> dict[str, Any]:
    ctx = _authorize(request)
    node = ctx.registry.drain(node_id)
    if node is None:
        raise _unknown(node_id)
    return await _on_siblings(request, ctx, node_view(node))


class RoleChange(BaseModel):
    """Body of ``POST /admin/nodes/{id}/role``."""

    model_config = ConfigDict(extra="forbid")
    role: protocol.Role


@router.post("/nodes/{node_id}/role")
async def set_node_role(node_id: str, change: RoleChange, request: Request) -> dict[str, Any]:
    """Change a node's role while it serves: it takes no new work, finishes what its old role holds,
    keeps its engine (KV pool, prefix cache) and comes back as ``role`` (``pending_role`` until then)."""
    ctx = _authorize(request)
    try:
        node = ctx.registry.set_role(node_id, change.role)
    except ValueError as e:
        raise APIError(409, f"Cannot change the role of {node_id!r}: {e}.", "invalid_request_error", "node_id",
                       "node_draining") from None
    if node is None:
        raise _unknown(node_id)
    return await _on_siblings(request, ctx, node_view(node), change.model_dump())


@router.delete("/nodes/{node_id}")
async def delete_node(node_id: str, request: Request) -> dict[str, Any]:
    ctx = _authorize(request)
    node = ctx.registry.remove(node_id, "removed by an operator", CLOSE_NORMAL, ban=True)
    if node is None:
        raise _unknown(node_id)
    return await _on_siblings(request, ctx, {"id": node_id, "deleted": True, "banned": True})


@router.post("/nodes/{node_id}/allow")
async def allow_node(node_id: str, request: Request) -> dict[str, Any]:
    """Let a node id that an operator removed join again."""
    ctx = _authorize(request)
    if not ctx.registry.allow(node_id):
        raise APIError(404, f"Node id {node_id!r} is not removed.", "invalid_request_error", "node_id", "node_not_banned")
    return await _on_siblings(request, ctx, {"id": node_id, "allowed": True})
