"""Summaries of a run's request records: pure functions, so they can be checked by hand.

Definitions follow vLLM's ``benchmark_serving``: TTFT is the first content chunk minus the
send time; TPOT = (e2e - ttft) / (output_tokens - 1) for requests with more than one output
token; ITL is every gap between content chunks, pooled over requests; E2E is send to last byte.
Goodput counts requests per second that completed within both SLOs (TTFT and TPOT; a request
with one output token has no TPOT and is judged on TTFT alone).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pd_cluster.bench.serve.records import RequestRecord

PERCENTILES: tuple[int, ...] = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Iterable[float]) -> dict[str, float | None]:
    """Mean and the p50/p90/p99 of a sample (``None`` each when it is empty)."""
    sample = list(values)
    doc: dict[str, float | None] = {"mean": sum(sample) / len(sample) if sample else None}
    for p in PERCENTILES:
        doc[f"p{p}"] = percentile(sample, p)
    return doc


def meets_slo(record: RequestRecord, slo_ttft: float, slo_tpot: float) -> bool:
    """Completed, first token within ``slo_ttft`` and (when defined) TPOT within ``slo_tpot``."""
    if not record.ok or record.ttft is None or record.ttft > slo_ttft:
        return False
    tpot = record.tpot
    return tpot is None or tpot <= slo_tpot


def error_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    return dict(Counter(r.error for r in records if r.error is not None))


@dataclass
class RunMetrics:
    """One run (one rate) summarized; latencies in seconds, throughputs per second of ``duration_s``."""

    rate: float | str
    duration_s: float
    num_requests: int
    completed: int
    failed: int
    errors: dict[str, int]
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    prompt_tokens: int
    requested_prompt_tokens: int
    output_tokens: int
    requested_output_tokens: int
    cached_prompt_tokens: int | None
    cached_fraction: float | None
    slo_ttft_s: float
    slo_tpot_s: float
    goodput: float
    slo_attainment: float
    ttft: dict[str, float | None]
    tpot: dict[str, float | None]
    itl: dict[str, float | None]
    e2e: dict[str, float | None]
    kv_transfer_bytes: float | None = None
    kv_bytes_per_prompt_token: float | None = None
    max_concurrency: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], duration_s: float, *, rate: float, slo_ttft: float,
              slo_tpot: float, kv_transfer_bytes: float | None = None,
              max_concurrency: int | None = None) -> RunMetrics:
    """All the numbers of one run from its records, the wall time it took, and the KV bytes moved."""
    done = [r for r in records if r.ok]
    duration = max(duration_s, 1e-9)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    reported = [r.cached_tokens for r in done if r.cached_tokens is not None]
    cached = sum(reported) if reported else None
    good = sum(1 for r in records if meets_slo(r, slo_ttft, slo_tpot))
    per_token = None
    if kv_transfer_bytes is not None and prompt_tokens > 0:
        per_token = kv_transfer_bytes / prompt_tokens
    return RunMetrics(
        rate="inf" if math.isinf(rate) else rate,
        duration_s=duration_s,
        num_requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        errors=error_counts(records),
        request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(prompt_tokens + output_tokens) / duration,
        prompt_tokens=prompt_tokens,
        requested_prompt_tokens=sum(r.requested_prompt_tokens for r in records),
        output_tokens=output_tokens,
        requested_output_tokens=sum(r.requested_output_tokens for r in records),
        cached_prompt_tokens=cached,
        cached_fraction=(cached / prompt_tokens) if cached is not None and prompt_tokens else None,
        slo_ttft_s=slo_ttft,
        slo_tpot_s=slo_tpot,
        goodput=good / duration,
        slo_attainment=good / len(records) if records else 0.0,
        ttft=distribution(r.ttft for r in done if r.ttft is not None),
        tpot=distribution(r.tpot for r in done if r.tpot is not None),
        itl=distribution(gap for r in done for gap in r.itl),
        e2e=distribution(r.e2e for r in done),
        kv_transfer_bytes=kv_transfer_bytes,
        kv_bytes_per_prompt_token=per_token,
        max_concurrency=max_concurrency,
    )
