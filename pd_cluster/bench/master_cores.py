"""Which cores each process of ``pd-cluster bench master`` runs on.

The masters are what is measured; the synthetic nodes and the load clients only feed and read
them. Sharing cores with them, a master waits for the scheduler between two frames and its
added latency is the host's, not its own. Where Linux allows it (:func:`os.sched_setaffinity`)
each master gets cores of its own (one per worker process), the nodes' processes share a set
after them and the client processes share every core left; the run's JSON records the split.
With too few cores for that, the masters still get theirs and the nodes and clients share the
rest; with fewer still, nothing is pinned and the JSON says why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class CoreSplit:
    """Cores by role (empty lists: not pinned), and a line that says how they were chosen."""

    #: Each master's cores (its supervisor and workers share them).
    masters: list[list[int]] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    clients: list[int] = field(default_factory=list)
    note: str = ""

    @property
    def pinned(self) -> bool:
        return bool(self.masters)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def available_cores() -> list[int]:
    """The cores this process may run on (none where the platform does not say)."""
    getter = getattr(os, "sched_getaffinity", None)
    return sorted(getter(0)) if getter is not None else []


def split_cores(available: list[int], master_workers: list[int], node_procs: int, client_procs: int) -> CoreSplit:
    """Cores for masters of ``master_workers`` processes each, ``node_procs`` node processes and
    ``client_procs`` client processes, out of ``available``."""
    needed = sum(master_workers)
    if not available or needed + 2 > len(available):
        return CoreSplit(note=f"not pinned: {len(available)} cores for {needed} master processes, nodes and clients")
    masters, at = [], 0
    for workers in master_workers:
        masters.append(available[at:at + workers])
        at += workers
    rest = available[at:]
    if node_procs + client_procs <= len(rest):
        nodes, clients = rest[:node_procs], rest[node_procs:]
        note = "each master on its own cores, the nodes and the clients on theirs"
    else:
        nodes = clients = rest
        note = f"each master on its own cores; nodes and clients share {len(rest)} cores"
    return CoreSplit(masters, nodes, clients, note)


def pin(cores: list[int]) -> None:
    """Run this process (and what it starts from now on) on ``cores`` (nothing when empty)."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
