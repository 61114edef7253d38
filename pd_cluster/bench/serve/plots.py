"""PNG figures of a sweep, drawn with matplotlib (the optional ``bench`` extra).

Four files: ``latency_vs_rate.png`` (TTFT, TPOT, ITL and E2E p50/p90/p99 against rate),
``goodput_vs_rate.png`` (goodput and throughput against rate, with the share meeting the SLO),
``ttft_cdf.png`` and ``tpot_cdf.png`` (one curve per rate, the SLO as a vertical line).
Rates sit at evenly spaced positions labelled by value, so an ``inf`` rate has a place too.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pd_cluster.bench.serve.config import rate_label
from pd_cluster.bench.serve.runner import SweepResult

logger = logging.getLogger(__name__)

PLOT_FILES: tuple[str, ...] = ("latency_vs_rate.png", "goodput_vs_rate.png", "ttft_cdf.png", "tpot_cdf.png")
MISSING_MATPLOTLIB = "plots need matplotlib: pip install 'pd-cluster[bench]' (or pip install matplotlib)"


def require_matplotlib() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or a RuntimeError that says what to install."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(MISSING_MATPLOTLIB) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(sweep: SweepResult, out_dir: Path) -> list[Path]:
    plt = require_matplotlib()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        _latency_vs_rate(plt, sweep, out_dir / PLOT_FILES[0]),
        _goodput_vs_rate(plt, sweep, out_dir / PLOT_FILES[1]),
        _cdf(plt, sweep, "ttft", "TTFT", sweep.config.slo_ttft, out_dir / PLOT_FILES[2]),
        _cdf(plt, sweep, "tpot", "TPOT", sweep.config.slo_tpot, out_dir / PLOT_FILES[3]),
    ]
    logger.info("wrote %s", ", ".join(str(p) for p in paths))
    return paths


def _rate_axis(ax: Any, sweep: SweepResult) -> list[int]:
    xs = list(range(len(sweep.results)))
    ax.set_xticks(xs, [rate_label(r.metrics.rate) for r in sweep.results])
    ax.set_xlabel("request rate (req/s)")
    return xs


def _title(sweep: SweepResult, what: str) -> str:
    return f"{what}: {sweep.config.workload}, {sweep.model}"


def _latency_vs_rate(plt: Any, sweep: SweepResult, path: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (("ttft", "TTFT (ms)", 1000.0), ("tpot", "TPOT (ms)", 1000.0), ("itl", "ITL (ms)", 1000.0),
              ("e2e", "E2E latency (s)", 1.0))
    for ax, (key, label, scale) in zip(axes.flat, panels):
        xs = _rate_axis(ax, sweep)
        for p in ("p50", "p90", "p99"):
            ys = [getattr(r.metrics, key)[p] for r in sweep.results]
            ax.plot(xs, [y * scale if y is not None else float("nan") for y in ys], marker="o", label=p)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(_title(sweep, "Latency against rate"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _goodput_vs_rate(plt: Any, sweep: SweepResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = _rate_axis(ax, sweep)
    ax.plot(xs, [r.metrics.request_throughput for r in sweep.results], marker="o", label="throughput (req/s)")
    ax.plot(xs, [r.metrics.goodput for r in sweep.results], marker="o", label="goodput (req/s)")
    ax.set_ylabel("requests per second")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    share = ax.twinx()
    share.plot(xs, [100 * r.metrics.slo_attainment for r in sweep.results], color="grey", linestyle="--",
               marker="x", label="meeting SLO (%)")
    share.set_ylabel("meeting SLO (%)")
    share.set_ylim(0, 105)
    lines = ax.get_legend_handles_labels()
    more = share.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="best")
    c = sweep.config
    ax.set_title(_title(sweep, f"Goodput at TTFT <= {c.slo_ttft:g} s, TPOT <= {c.slo_tpot * 1000:g} ms"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _cdf(plt: Any, sweep: SweepResult, key: str, label: str, slo: float, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in sweep.results:
        values = sorted(v * 1000.0 for v in (getattr(rec, key) for rec in r.records if rec.ok) if v is not None)
        if values:
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, ys, where="post", label=f"rate {rate_label(r.metrics.rate)}")
    ax.axvline(slo * 1000.0, color="red", linestyle=":", label=f"SLO {slo * 1000:g} ms")
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(_title(sweep, f"{label} CDF"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
