"""What ``pd-cluster local`` is asked for, and the node counts it settles on.

The counts are resolved once the GPUs are known: none given, :func:`default_roles` picks by the
number of GPUs; some given, the others keep 1 prefill, 1 decode, 0 mixed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field

from pd_cluster.engine_flags import NodeEngineOptions
from pd_cluster.local_placement import default_roles
from pd_cluster.process_supervisor import RestartPolicy


class LocalOptions(NodeEngineOptions):
    """What ``pd-cluster local`` was asked for: its own options, and the engine flags every node gets
    (each None unless given: the node's default)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = 8000
    #: Node counts of each role; None for all three: :func:`default_roles` picks by the GPUs. Some given,
    #: the others keep 1 prefill, 1 decode, 0 mixed.
    prefill: int | None = None
    decode: int | None = None
    #: Mixed nodes (prefill and decode in one engine: the colocated baseline).
    mixed: int | None = None
    #: The master's local_prefill_max_tokens (None: its default).
    local_prefill_max_tokens: int | None = None
    #: The master's planner (None: its default, off) and latency targets (None: none).
    planner: Literal["off", "slo"] | None = None
    slo_tpot_ms: float | None = None
    slo_ttft_ms: float | None = None
    #: The master's worker processes behind its one port (1: one process).
    master_workers: int = Field(default=1, ge=1)
    #: The master's and every node's model.
    model: str = "default"
    #: Tensor parallelism of each role's nodes (GPUs, or processes on CPU, a node).
    prefill_tp: int = Field(default=1, ge=1)
    decode_tp: int = Field(default=1, ge=1)
    mixed_tp: int = Field(default=1, ge=1)
    #: Where the nodes run: auto, cpu, cuda or cuda:N (the one GPU every node shares).
    device: str = "auto"
    gpus: list[int] | None = None
    policy: str = "cache_aware"
    ready_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0
    log_dir: Path | None = None
    echo_logs: bool = False
    log_level: str = "INFO"
    log_format: str = "text"  # the master's: json makes every line (a request's too) one JSON object
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    #: The master's certificate and key (HTTPS, wss://), also each decode node's on its data plane.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: What every node (and this launcher) checks those certificates against.
    tls_ca: Path | None = None

    def tls_argv(self, role: str) -> list[str]:
        """The TLS flags of one process of this cluster (none without TLS)."""
        if self.tls_cert is None or self.tls_key is None:
            return []
        files = ["--tls-cert", str(self.tls_cert), "--tls-key", str(self.tls_key)]
        if role == "master":
            return files
        ca = ["--tls-ca", str(self.tls_ca)] if self.tls_ca is not None else []
        return ca + (files if role in ("decode", "mixed") else []) + ["--data-tls"]


def with_role_counts(options: LocalOptions, num_gpus: int) -> LocalOptions:
    """``options`` with every node count set: those left out from :func:`default_roles` when none
    was given, else 1 prefill, 1 decode, 0 mixed."""
    given = (options.prefill, options.decode, options.mixed)
    if given == (None, None, None):
        prefill, decode, mixed = default_roles(num_gpus)
    else:
        prefill, decode, mixed = (v if v is not None else d for v, d in zip(given, (1, 1, 0)))
    return options.model_copy(update={"prefill": prefill, "decode": decode, "mixed": mixed})


def role_counts(options: LocalOptions) -> tuple[int, int, int]:
    """(prefill, decode, mixed) of options whose counts are set (:func:`with_role_counts`)."""
    if options.prefill is None or options.decode is None or options.mixed is None:
        raise ValueError("node counts are not resolved yet (with_role_counts)")
    return options.prefill, options.decode, options.mixed
