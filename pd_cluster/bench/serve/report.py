"""The results a person reads (a plain-text table) and the one a program reads (a JSON document)."""

from __future__ import annotations

import datetime as dt
import json
import platform
from pathlib import Path
from typing import Any

from pd_cluster.bench.serve.config import rate_label
from pd_cluster.bench.serve.metrics import RunMetrics
from pd_cluster.bench.serve.runner import SweepResult

_COLUMNS = (
    ("rate", "rate"), ("done", "done/sent"), ("rps", "req/s"), ("tps", "out tok/s"), ("goodput", "goodput"),
    ("slo", "SLO ok"), ("ttft", "TTFT p50/p90/p99 ms"), ("tpot", "TPOT p50/p90/p99 ms"),
    ("itl", "ITL p50/p90/p99 ms"), ("e2e", "E2E p50/p90/p99 s"), ("cached", "cached"), ("kv", "KV B/prompt tok"),
)


def _ms(dist: dict[str, float | None], scale: float = 1000.0, digits: int = 0) -> str:
    values = [dist.get(k) for k in ("p50", "p90", "p99")]
    if any(v is None for v in values):
        return "-"
    return "/".join(f"{v * scale:.{digits}f}" for v in values)  # type: ignore[operator]


def _row(m: RunMetrics) -> dict[str, str]:
    return {
        "rate": rate_label(m.rate),
        "done": f"{m.completed}/{m.num_requests}",
        "rps": f"{m.request_throughput:.2f}",
        "tps": f"{m.output_throughput:.1f}",
        "goodput": f"{m.goodput:.2f}",
        "slo": f"{m.slo_attainment:.0%}",
        "ttft": _ms(m.ttft),
        "tpot": _ms(m.tpot, digits=1),
        "itl": _ms(m.itl, digits=1),
        "e2e": _ms(m.e2e, scale=1.0, digits=2),
        "cached": "-" if m.cached_fraction is None else f"{m.cached_fraction:.0%}",
        "kv": "-" if m.kv_bytes_per_prompt_token is None else f"{m.kv_bytes_per_prompt_token:,.0f}",
    }


def format_table(sweep: SweepResult) -> str:
    """One row per rate, then any errors by kind; goodput in req/s at the SLO in the header."""
    c = sweep.config
    rows = [{key: title for key, title in _COLUMNS}] + [_row(r.metrics) for r in sweep.results]
    widths = {key: max(len(row[key]) for row in rows) for key, _ in _COLUMNS}
    lines = [
        f"Serving benchmark: {c.workload} workload, model {sweep.model} at {c.base_url} "
        f"(SLO: TTFT <= {c.slo_ttft:g} s, TPOT <= {c.slo_tpot * 1000:g} ms; goodput in req/s)",
    ]
    for i, row in enumerate(rows):
        lines.append("  ".join(row[key].rjust(widths[key]) for key, _ in _COLUMNS))
        if i == 0:
            lines.append("  ".join("-" * widths[key] for key, _ in _COLUMNS))
    for r in sweep.results:
        if r.metrics.errors:
            kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(r.metrics.errors.items()))
            lines.append(f"errors at rate {rate_label(r.metrics.rate)}: {kinds}")
    return "\n".join(lines) + "\n"


def results_document(sweep: SweepResult) -> dict[str, Any]:
    """Config, then one result per rate (with its request records when ``save_requests``)."""
    from pd_cluster import __version__ as version

    results = []
    for r in sweep.results:
        doc = r.metrics.to_json()
        if sweep.config.save_requests:
            doc["requests"] = [rec.to_json() for rec in r.records]
        results.append(doc)
    return {
        "benchmark": "pd-cluster bench serve",
        "pd_cluster_version": version,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "model": sweep.model,
        "tokenizer": sweep.tokenizer,
        "config": sweep.config.to_json(),
        "results": results,
    }


def write_json(sweep: SweepResult, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results_document(sweep), indent=2) + "\n")
    return path
