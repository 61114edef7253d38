"""Entry points of a decode node process (``pd-cluster decode``) and a mixed one (``pd-cluster mixed``)."""

from __future__ import annotations

from decode_node.node import DecodeNode, MixedNode
from pd_cluster.aio import run
from pd_cluster.node.config import NodeSettings


def run_decode_node(settings: NodeSettings) -> None:
    run(DecodeNode(settings).run())


def run_mixed_node(settings: NodeSettings) -> None:
    run(MixedNode(settings).run())
