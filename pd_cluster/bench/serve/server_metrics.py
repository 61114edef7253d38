"""Counters read from the endpoint's Prometheus ``/metrics``, where it has one.

Our master counts the KV bytes P sent to D (``pdc_kv_transfer_bytes_total``); the delta over a
run divided by the prompt tokens sent is the data-plane cost of a prompt token, the number
prefix reuse should push down. Other servers lack the series, and the value is then ``None``.
"""

from __future__ import annotations

import logging

import httpx

logger = logging.getLogger(__name__)

KV_TRANSFER_BYTES = "pdc_kv_transfer_bytes_total"
_SCRAPE_TIMEOUT_S = 10.0


def parse_counter(text: str, name: str) -> float | None:
    """Sum of a series over its label sets in Prometheus text format; ``None`` when absent."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head == name or head.startswith(name + "{"):
            try:
                total += float(value)
            except ValueError:
                continue
            seen = True
    return total if seen else None


async def scrape_counter(http: httpx.AsyncClient, base_url: str, name: str,
                         headers: dict[str, str] | None = None) -> float | None:
    """The counter's current value, or ``None`` when the server has no ``/metrics`` or no such series."""
    try:
        response = await http.get(base_url + "/metrics", headers=headers or {}, timeout=_SCRAPE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        logger.info("no /metrics at %s (%s): server-side counters left out", base_url, type(exc).__name__)
        return None
    if response.status_code != 200:
        return None
    return parse_counter(response.text, name)
