"""Settings of the master service, read from arguments or ``PD_*`` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from master.route_cost import Slo
from pd_cluster import protocol
from pd_cluster.tls import check_pair

PolicyName = Literal["round_robin", "least_load", "cache_aware"]


class MasterSettings(BaseSettings):
    """Everything the master needs to start; env names are the field names with prefix ``PD_``.

    The cluster token (``PD_CLUSTER_TOKEN``) is required: nodes prove with it that they belong to
    the cluster, and a master that made one up could never be joined. The admin token
    (``PD_ADMIN_TOKEN``) is optional; without it the admin API answers 401 to every call. A token
    set to the empty string (or only whitespace) stops the master at start: it would open what it guards.
    """

    model_config = SettingsConfigDict(env_prefix="PD_", extra="ignore")

    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, lt=65536)
    tls_cert: Path | None = Field(default=None, description="certificate (PEM, with its chain): serve HTTPS and "
                                  "wss:// for clients and nodes alike")
    tls_key: Path | None = Field(default=None, description="the key of tls_cert")
    model: str = Field(default="default", description='"default" or a Hugging Face model directory')
    served_model_name: str | None = Field(
        default=None, description="name clients put in `model`; default: the model's own name"
    )
    policy: PolicyName = "cache_aware"
    cluster_token: SecretStr | None = None
    admin_token: SecretStr | None = None
    #: Read-only: opens the status page (/status) and nothing else; the admin token opens it too.
    status_token: SecretStr | None = None
    api_keys: list[SecretStr] = Field(default_factory=list, description="keys clients must send; none: open API")
    api_keys_file: Path | None = Field(default=None, description="more keys, one a line: KEY [MAX_CONCURRENT]")
    max_concurrent_per_key: int | None = Field(
        default=None, gt=0, description="generations one API key may run at once, each prompt x n (or best_of) of a "
        "request counting one (a key's own limit in the file wins)"
    )

    max_model_len: int | None = Field(default=None, gt=0, description="cap on context length; default: nodes' and model's")
    request_timeout_s: float = Field(default=600.0, gt=0, description="end-to-end deadline of one request")
    queue_size: int = Field(
        default=256, ge=0, description="requests waiting for KV capacity; past it: 429 with Retry-After; 0: none wait"
    )
    queue_timeout_s: float = Field(default=30.0, gt=0, description="longest wait in the admission queue")
    max_attempts: int = Field(default=3, ge=1, description="tries of one request across node failures")
    stale_after_s: float = Field(
        default=5.0, ge=0, description="a node still holding an attempt this long after it ended is told to abort "
        "it (a prefill job may take a moment to notice that its decode node finished the request)",
    )
    handoff_timeout_s: float = Field(
        default=30.0, gt=0, description="longest time from P's first token to the KV reaching D; past it the "
        "request is re-run on another pair (P is stuck or gone)",
    )
    retry_after_s: int = Field(default=1, ge=0, description="Retry-After of 429/503 answers")
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    body_timeout_s: float = Field(default=60.0, gt=0, description="longest upload of one request body")

    heartbeat_timeout_s: float = Field(default=protocol.HEARTBEAT_TIMEOUT_S, gt=0)
    register_timeout_s: float = Field(default=10.0, gt=0, description="wait for a new socket's Register frame")
    node_send_timeout_s: float = Field(default=10.0, gt=0, description="a node that takes longer to read a frame is dropped")
    node_outbox_frames: int = Field(default=4096, gt=0, description="frames queued for a node before it is dropped")

    local_prefill_max_tokens: int = Field(
        default=4096, ge=0,
        description="the most prompt tokens a decode node may prefill itself (those its prefix cache lacks), a "
        "cap: within it the cache_aware policy weighs the prefill node's queue, the transfer and the handover "
        "against the decode node's queue and the slowdown of its running streams (against --slo-tpot-ms); "
        "least_load and round_robin prefill locally up to 512 of it; 0: every request goes through a prefill "
        "node while one is ready",
    )
    slo_tpot_ms: float | None = Field(
        default=None, gt=0, description="the time per output token streams are served to (ms): a decode node "
        "prefills a request itself only while its running streams stay under it, and the planner weighs "
        "decode capacity against it; default: none (every second a local prefill takes from the streams counts)",
    )
    slo_ttft_ms: float | None = Field(
        default=None, gt=0, description="the time to the first token requests are served to (ms): the planner "
        "weighs prefill capacity against it; default: none",
    )
    planner: Literal["off", "slo"] = Field(
        default="off", description="slo: move nodes between prefill and decode roles as the load mix and the "
        "nodes' measured rates call for (see docs/architecture.md); off: roles change only when an operator asks",
    )
    planner_interval_s: float = Field(default=5.0, gt=0, description="seconds between the planner's rounds")
    planner_window_s: float = Field(default=30.0, gt=0, description="the load mix is the requests of this many "
                                    "last seconds")
    planner_dwell_s: float = Field(default=60.0, ge=0, description="a node keeps a role at least this long "
                                   "before the planner moves it again")
    planner_high: float = Field(default=0.8, gt=0, description="a side (prefill, decode) used more than this "
                                "share of its capacity calls for a node")
    planner_low: float = Field(default=0.3, ge=0, description="a prefill side used less than this gives a node "
                               "to the decode side")
    first_token_via: Literal["prefill", "decode"] = Field(
        default="prefill",
        description="who delivers the first token: P as soon as its prefill samples it (lower TTFT, see "
        "docs/architecture.md), or D with its first decoded tokens (measurement of the alternative)",
    )

    shutdown_timeout_s: float = Field(default=30.0, gt=0, description="grace for open requests on shutdown")
    log_level: str = "info"
    log_format: Literal["text", "json"] = Field(
        default="text", description="json: every log line one JSON object (a request's fields at its top level)"
    )
    access_log: bool = False

    workers: int = Field(
        default=1, ge=1, le=256, description="master processes behind the one public port (SO_REUSEPORT): each a "
        "whole master (registry, relay, queue) that every node links to; 1: one process",
    )
    worker_ports: int | None = Field(
        default=None, gt=0, lt=65536, description="first private port of the workers (nodes and sibling workers "
        "reach worker i on it + i); default: port + 1",
    )
    advertise_host: str | None = Field(
        default=None, description="host name the workers' private URLs carry in the answer to a node's "
        "registration; default: the host the node dialled",
    )
    #: Set by the supervisor in each worker: its index (None: the master runs as one process).
    worker_index: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _tls_pair(self) -> "MasterSettings":
        check_pair(self.tls_cert, self.tls_key)
        return self

    @model_validator(mode="after")
    def _worker_limits(self) -> "MasterSettings":
        """Several workers share one public port, so it must be a fixed one."""
        if self.workers > 1 and self.port == 0:
            raise ValueError("workers > 1 need a fixed port (port 0 picks one per process)")
        return self

    @property
    def slo(self) -> Slo:
        """The latency targets in seconds."""
        return Slo(ttft_s=None if self.slo_ttft_ms is None else self.slo_ttft_ms / 1000,
                   tpot_s=None if self.slo_tpot_ms is None else self.slo_tpot_ms / 1000)

    def worker_port(self, index: int) -> int:
        """The private port of worker ``index`` (node links and sibling calls)."""
        return (self.worker_ports if self.worker_ports is not None else self.port + 1) + index

    def worker_urls(self, host: str, scheme: str) -> list[str]:
        """Every worker's private URL, reached through ``host`` (or the advertised host)."""
        host = self.advertise_host or host
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return [f"{scheme}://{host}:{self.worker_port(i)}" for i in range(self.workers)]
