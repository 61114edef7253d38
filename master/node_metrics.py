"""Per-node series for Prometheus, read from the node registry when /metrics is scraped.

A collector rather than labelled gauges: a node that left has no series at the next scrape
(nothing to forget to clear), and the values are the nodes' latest status reports as the admin
API shows them. ``node`` and ``role`` label every series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from master.registry import NodeRecord, Registry

_LABELS = ["node", "role"]

#: name -> (help, value of one node; None: no sample for that node)
_GAUGES: dict[str, tuple[str, Callable[[NodeRecord], float | None]]] = {
    "pdc_node_running_requests": ("Requests in the node's running batch", lambda n: n.status.running),
    "pdc_node_waiting_requests": ("Requests queued on the node", lambda n: n.status.waiting),
    "pdc_node_queued_prefill_tokens": (
        "Prompt tokens queued for prefill (P)", lambda n: n.status.queued_prefill_tokens
    ),
    "pdc_node_kv_total_tokens": ("KV slots of the node", lambda n: n.kv_total),
    "pdc_node_kv_free_tokens": ("Free KV slots", lambda n: n.status.free_kv_tokens),
    "pdc_node_kv_used_ratio": (
        "Share of the node's KV slots in use",
        lambda n: 1.0 - n.status.free_kv_tokens / n.kv_total if n.kv_total else None,
    ),
    "pdc_node_prefix_hit_ratio": (
        "Share of the node's prompt tokens found in its prefix cache", lambda n: n.prefix_hit_rate
    ),
    "pdc_node_generation_tokens_per_second": (
        "Tokens the node generates per second", lambda n: n.status.generation_tokens_per_s
    ),
    "pdc_node_warm_peers": (
        "Peers holding a warm data-plane channel with the node", lambda n: len(n.status.warm_peers)
    ),
    "pdc_node_draining": ("1 while the node drains", lambda n: 0.0 if n.active else 1.0),
}


class NodeCollector(Collector):
    """``pdc_node_*`` gauges and ``pdc_node_kv_transfer_bytes_total`` of every registered node."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def describe(self) -> list:
        return []  # names known only at collection; keeps registration free of a first collect

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        nodes = sorted(self.registry.nodes.values(), key=lambda n: n.node_id)
        for name, (text, value_of) in _GAUGES.items():
            family = GaugeMetricFamily(name, text, labels=_LABELS)
            for node in nodes:
                value = value_of(node)
                if value is not None:
                    family.add_metric([node.node_id, node.role], float(value))
            yield family
        moved = CounterMetricFamily(
            "pdc_node_kv_transfer_bytes", "KV bytes the node sent (P) or received (D)", labels=_LABELS
        )
        for node in nodes:
            moved.add_metric([node.node_id, node.role], float(node.kv_transfer_bytes))
        yield moved
