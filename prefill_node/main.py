"""Entry point of a prefill node process (``pd-cluster prefill``)."""

from __future__ import annotations

from prefill_node.node import PrefillNode
from pd_cluster.aio import run
from pd_cluster.node.config import NodeSettings


def run_prefill_node(settings: NodeSettings) -> None:
    run(PrefillNode(settings).run())
