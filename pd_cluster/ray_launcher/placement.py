"""Placement groups of tensor-parallel nodes: a node of N ranks reserves its N GPUs at once.

One bundle holding every rank's GPUs and CPUs, placed STRICT_PACK, so the ranks share a host (their
all-reduce and KV handover go over peer memory) and the reservation is all or nothing: a node never
starts with part of its GPUs while another takes the rest. The group is detached and named after
the cluster's namespace and the node, so a later ``scale`` or ``stop`` (a fresh Ray driver) finds
and removes it with the node.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pd_cluster.ray_launcher.spec import ClusterSpec

logger = logging.getLogger(__name__)

STRATEGY = "STRICT_PACK"


def group_name(namespace: str, node: str) -> str:
    """The placement group's name: Ray names groups per driver namespace, so the cluster's goes in it."""
    return f"{namespace}/{node}"


def reserve_node(spec: ClusterSpec, role: str, node: str) -> dict[str, Any]:
    """Actor options placing a node of ``role`` into a placement group of its own (empty for one rank:
    the actor's own resources are then the whole reservation)."""
    if spec.node_tp(role) == 1:
        return {}
    group = placement_group([spec.node_bundle(role)], strategy=STRATEGY, name=group_name(spec.namespace, node),
                            lifetime="detached")
    logger.info("%s: reserving %s on one Ray node", node, spec.node_bundle(role))
    # Ranks the node's process starts are its children, not Ray tasks: nothing to capture.
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=0, placement_group_capture_child_tasks=False)}


def release_nodes(namespace: str, nodes: list[str] | None = None) -> list[str]:
    """Remove the placement groups of ``nodes`` (None: every one of the cluster); returns their names."""
    prefix = group_name(namespace, "")
    wanted = None if nodes is None else {group_name(namespace, n) for n in nodes}
    removed = []
    for group_id, info in placement_group_table().items():
        name = info.get("name") or ""
        if info.get("state") == "REMOVED" or not name.startswith(prefix):
            continue
        if wanted is not None and name not in wanted:
            continue
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group_id)))
        removed.append(name)
    return removed
