"""Prometheus metrics of one master app, in a registry of its own (several apps can share a process).

A master of several workers runs prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``,
set by the supervisor): each worker's /metrics then reports the sum over all workers, and the node
gauges (every worker sees the same nodes) the most recent value any worker set.
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

#: The environment variable that turns prometheus_client's multiprocess mode on.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_GC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

ROLES = ("prefill", "decode", "mixed")
NODE_STATES = ("active", "draining", "switching")
CONTENT_TYPE = CONTENT_TYPE_LATEST


#: ``pdc_requests_total`` status of a request answered with an HTTP error before or instead of
#: being served (a served request's status is its outcome: ok, error, aborted, timeout...).
_STATUS_OF_HTTP = {401: "unauthorized", 408: "timeout", 413: "too_large", 429: "rate_limited",
                   503: "unavailable", 504: "timeout"}


def status_of_http(code: int) -> str:
    """The ``pdc_requests_total`` status for an answer with HTTP status ``code``."""
    if code in _STATUS_OF_HTTP:
        return _STATUS_OF_HTTP[code]
    return "invalid" if 400 <= code < 500 else "error"


class MasterMetrics:
    """The ``pdc_*`` series. ``requests_total`` counts every generation request once, by status:
    ok, error, aborted, timeout, unavailable, invalid (400/404), unauthorized (401), too_large
    (413), rate_limited (429)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_total = Counter("pdc_requests_total", "Requests by outcome", ["status"], registry=r)
        self.rejected_requests = Counter(
            "pdc_rejected_requests_total", "Requests answered with an error without being served, by HTTP status "
            "and reason (the error's code, else its type: model_not_found, not_found, invalid_api_key, "
            "context_length_exceeded, invalid_request_error...)", ["status", "reason"], registry=r,
        )
        self.time_to_first_token = Histogram(
            "pdc_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.time_per_output_token = Histogram(
            "pdc_time_per_output_token_seconds", "Mean gap between output tokens after the first",
            buckets=_TOKEN_BUCKETS, registry=r,
        )
        self.e2e_latency = Histogram(
            "pdc_e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("pdc_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.generation_tokens = Counter("pdc_generation_tokens", "Generated tokens", registry=r)
        self.prefix_hit_tokens = Counter(
            "pdc_prefix_hit_tokens", "Prompt tokens whose KV a decode node already held", registry=r
        )
        self.kv_transfer_bytes = Counter("pdc_kv_transfer_bytes", "KV bytes sent from P to D", registry=r)
        self.kv_transfer_seconds = Histogram(
            "pdc_kv_transfer_seconds", "Time of one request's KV transfer", buckets=_TRANSFER_BUCKETS, registry=r
        )
        self.migrations = Counter(
            "pdc_stream_migrations", "Streams continued on another pair after their node was lost", registry=r
        )
        self.route_decisions = Counter(
            "pdc_route_decisions_total", "Dispatches by path (pd: a prefill node then a decode node; local: "
            "prefilled where it decodes) and reason", ["path", "reason"], registry=r,
        )
        self.queue_wait = Histogram(
            "pdc_queue_wait_seconds", "One wait of a request in the admission queue, by why it waited: decode_full "
            "(every decode node's batch was full), kv_full, decode_refused (a decode node refused its lease), rerun "
            "(after a fault), behind_queue (behind earlier requests)", ["reason"], buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_refusals = Counter(
            "pdc_decode_refusals_total", "Leases a decode node refused for want of room (the request waited "
            "again; no attempt counted)", registry=r,
        )
        self.nodes = Gauge("pdc_nodes", "Registered nodes", ["role", "state"], registry=r,
                           multiprocess_mode="mostrecent")
        self.warm_channels = Gauge(
            "pdc_warm_channels", "Pairs of an active prefill and decode node whose data-plane channel is warm",
            registry=r, multiprocess_mode="mostrecent",
        )
        self.role_changes = Counter(
            "pdc_role_changes_total", "Nodes that changed role while serving, by old and new role and outcome "
            "(done, or failed: the node stayed what it was)", ["from_role", "to_role", "outcome"], registry=r,
        )
        self.planner_decisions = Counter(
            "pdc_planner_decisions_total", "Role changes the planner made, by old and new role and why",
            ["from_role", "to_role", "reason"], registry=r,
        )
        self.gc_pause = Histogram(
            "pdc_gc_pause_seconds", "Garbage collections of the master process by generation (each one stops "
            "its event loop: every stream's next token waits)", ["generation"], buckets=_GC_BUCKETS, registry=r,
        )
        self.gc_frozen_objects = Gauge(
            "pdc_gc_frozen_objects", "Objects of the start-up frozen out of garbage collection (a master process's)",
            registry=r, multiprocess_mode="max",
        )
        #: Collectors that read live state (the registry's nodes): rendered by this process alone.
        self._live: list[Collector] = []
        for role in ROLES:
            for state in NODE_STATES:
                self.nodes.labels(role=role, state=state).set(0)

    def add_live(self, collector: Collector) -> None:
        """Serve ``collector`` (one that reads this process's state) with the metrics."""
        self.registry.register(collector)
        self._live.append(collector)

    def render(self) -> bytes:
        if not os.environ.get(MULTIPROC_DIR_ENV):
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged)
        for collector in self._live:
            merged.register(collector)
        return generate_latest(merged)
