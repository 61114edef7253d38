"""Entry point of a decode node process (``pd-cluster decode``)."""

from __future__ import annotations

import asyncio

from decode_node.node import DecodeNode
from pd_cluster.node.config import NodeSettings


def run_decode_node(settings: NodeSettings) -> None:
    asyncio.run(DecodeNode(settings).run())
