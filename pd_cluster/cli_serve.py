"""Commands that start cluster processes (master, nodes, a local cluster)."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Registered by pd_cluster.cli; filled in as the roles land."""
