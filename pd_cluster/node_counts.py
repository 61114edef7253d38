"""The node counts a cluster can serve with, one rule for every launcher (``pd-cluster local``,
the Ray launcher): a prefill node alone cannot answer, it hands its requests to a decode node."""

from __future__ import annotations


def node_count_problem(prefill: int, decode: int, mixed: int) -> str | None:
    """Why a cluster of these counts could not serve, or None when it can."""
    if min(prefill, decode, mixed) < 0:
        return "node counts cannot be negative"
    if decode < 1 and mixed < 1:
        return ("a cluster needs a decode node or a mixed node (a prefill node alone cannot serve: it hands its "
                "requests to a decode node)")
    if prefill and not decode:
        return "prefill nodes need a decode node to hand their requests to (--decode)"
    return None
