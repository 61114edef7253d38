"""``pd-cluster bench serve``: a serving benchmark against any OpenAI-compatible endpoint.

It measures what a user of the served system feels (TTFT, TPOT, ITL, end-to-end latency,
goodput at an SLO) under a chosen workload and arrival process, the way vLLM's
``benchmark_serving`` defines those numbers, so results compare across servers. Against our
own master it also reads the KV bytes moved per prompt token from ``/metrics``.

Modules, one job each: ``config`` (the run's settings), ``workloads`` (what to send),
``arrivals`` (when), ``client`` (one streamed request, timed), ``server_metrics`` (Prometheus
counters of the endpoint), ``metrics`` (pure summaries of request records), ``runner`` (the
run), ``report`` (table and JSON), ``plots`` (PNG figures, needs matplotlib), ``options``
(the command-line flags).
"""

from pd_cluster.bench.serve.config import ServeBenchConfig
from pd_cluster.bench.serve.records import RequestRecord

__all__ = ["RequestRecord", "ServeBenchConfig"]
