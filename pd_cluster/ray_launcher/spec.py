"""What ``pd-cluster ray start`` was asked for, and the command lines it implies.

The spec is kept in the cluster-state actor, so ``scale`` starts new nodes exactly like the first
ones without the operator repeating every flag.
"""

from __future__ import annotations

import ssl
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from pd_cluster.engine_flags import NodeEngineOptions
from pd_cluster.tls import check_pair, client_context

Role = Literal["master", "prefill", "decode", "mixed"]
NODE_ROLES: tuple[str, ...] = ("prefill", "decode", "mixed")
#: Roles that take KV from prefill nodes, so they advertise a data-plane address.
DATA_PLANE_ROLES: tuple[str, ...] = ("decode", "mixed")

DEFAULT_NAMESPACE = "pd-cluster"
STATE_ACTOR = "cluster-state"
MASTER_ACTOR = "master"


def master_actor_name(index: int) -> str:
    """``master`` for the first master, ``master-1``, ``master-2``... for its peers."""
    return MASTER_ACTOR if index == 0 else f"{MASTER_ACTOR}-{index}"


def master_index(name: str) -> int | None:
    """The index of a master actor from its name; None for any other actor."""
    if name == MASTER_ACTOR:
        return 0
    prefix, _, index = name.rpartition("-")
    return int(index) if prefix == MASTER_ACTOR and index.isdigit() else None
#: Of a fractional GPU share, what a node's engine may hold; the rest covers its CUDA context.
SHARED_GPU_USABLE = 0.9


class ClusterSpec(NodeEngineOptions):
    """How the master and every node are started and placed, and the engine flags every node gets
    (each None unless given: the node's default)."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(default=DEFAULT_NAMESPACE, min_length=1, description="Ray namespace of every actor")
    model: str = Field(default="default", description='"default" or a model directory present on every Ray node')
    served_model_name: str | None = None
    policy: Literal["cache_aware", "least_load", "round_robin"] = "cache_aware"
    host: str = Field(default="0.0.0.0", description="the master's bind address")
    port: int = Field(default=8000, gt=0, lt=65536, description="the master's port on its Ray node")
    master_workers: int = Field(default=1, ge=1, description="worker processes of each master, behind its port "
                                "(each takes a private port after it)")
    device: str | None = Field(default=None, description="node device; None: cuda with GPUs per node, else cpu")
    gpus_per_node: float = Field(
        default=1.0, ge=0, description="Ray GPUs of each node actor (0 on CPU; 0.5: a P and a D share one GPU)"
    )
    gpu_memory_fraction: float | None = Field(
        default=None, gt=0, le=1,
        description="--gpu-memory-fraction of each node; None: derived from a fractional gpus_per_node",
    )
    cpus_per_node: float = Field(default=1.0, ge=0)
    prefill_tp: int = Field(default=1, ge=1, le=64, description="--tp of each prefill node: its ranks, one GPU each")
    decode_tp: int = Field(default=1, ge=1, le=64, description="--tp of each decode node")
    mixed_tp: int = Field(default=1, ge=1, le=64, description="--tp of each mixed node")
    masters: int = Field(
        default=1, ge=1, le=8,
        description="master actors, peers: every node registers with each; master i listens on port + i",
    )
    master_cpus: float = Field(default=1.0, ge=0)
    master_resource: str | None = Field(
        default=None, description="a custom Ray resource that pins the master (and the state actor), e.g. on the head"
    )
    prefill_resource: str | None = Field(default=None, description="a custom Ray resource each P actor takes 1 of")
    decode_resource: str | None = Field(default=None, description="a custom Ray resource each D actor takes 1 of")
    mixed_resource: str | None = Field(default=None, description="a custom Ray resource each mixed actor takes 1 of")
    drain_timeout_s: float = Field(default=600.0, gt=0)
    max_restarts: int = Field(default=3, ge=0, description="restarts of a crashed process (and of its actor)")
    log_level: str = "INFO"
    node_args: list[str] = Field(default_factory=list, description="extra arguments for every node's command")
    tls_cert: str | None = Field(default=None, description="certificate (PEM) the masters and the decode and mixed "
                                 "nodes' data planes present, a path present on every Ray node; None: no TLS")
    tls_key: str | None = Field(default=None, description="the key of tls_cert, a path on every Ray node")
    tls_ca: str | None = Field(default=None, description="CA (PEM) nodes and the launcher check certificates "
                               "against, a path on every Ray node; None: the system's CAs")
    tls_name: str | None = Field(default=None, description="a name the certificate holds that prefill nodes check "
                                 "data planes against, instead of each decode node's Ray node IP")

    @model_validator(mode="after")
    def _whole_gpus_for_tensor_parallel_nodes(self) -> ClusterSpec:
        if max(self.prefill_tp, self.decode_tp, self.mixed_tp) > 1 and not float(self.gpus_per_node).is_integer():
            raise ValueError(f"a tensor-parallel node takes whole GPUs, one a rank: gpus_per_node must be 0 (CPU) or "
                             f"a whole number with --prefill-tp, --decode-tp or --mixed-tp above 1, not "
                             f"{self.gpus_per_node}")
        return self

    @model_validator(mode="after")
    def _tls_files_together(self) -> ClusterSpec:
        check_pair(None if self.tls_cert is None else Path(self.tls_cert),
                   None if self.tls_key is None else Path(self.tls_key))
        if self.tls_cert is None and (self.tls_ca or self.tls_name):
            raise ValueError("--tls-ca and --tls-name go with --tls-cert and --tls-key (the cluster's certificate)")
        return self

    @property
    def tls(self) -> bool:
        """Whether every link the code encrypts runs on TLS: masters on HTTPS, data planes' control."""
        return self.tls_cert is not None

    def master_url(self, host: str, index: int = 0) -> str:
        """The URL of master ``index`` on the Ray node at ``host`` (an IP)."""
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls else 'http'}://{host}:{self.master_port(index)}"

    def client_tls(self) -> ssl.SSLContext | bool:
        """What the launcher checks a master's certificate with (True: the system's CAs)."""
        return client_context(Path(self.tls_ca) if self.tls_ca else None) if self.tls else True

    def tls_argv(self, role: Role) -> list[str]:
        """The TLS flags of ``role``'s command: the master serves HTTPS with the certificate; nodes check
        it (and the data planes) with the CA; decode and mixed nodes serve their data plane with it."""
        if not self.tls:
            return []
        assert self.tls_cert is not None and self.tls_key is not None
        pair = ["--tls-cert", self.tls_cert, "--tls-key", self.tls_key]
        if role == "master":
            return pair
        argv = (["--tls-ca", self.tls_ca] if self.tls_ca else []) + ["--data-tls"]
        if role in DATA_PLANE_ROLES:
            return argv + pair
        return argv + (["--data-tls-name", self.tls_name] if self.tls_name else [])

    def node_tp(self, role: str) -> int:
        """The tensor parallelism of a role's nodes: how many ranks (GPUs, or processes on CPU) a node runs."""
        if role not in NODE_ROLES:
            raise ValueError(f"not a node role: {role!r}")
        return {"prefill": self.prefill_tp, "decode": self.decode_tp, "mixed": self.mixed_tp}[role]

    def node_gpus(self, role: str) -> float:
        """Ray GPUs of one node of ``role``: ``gpus_per_node`` for each of its ranks."""
        return self.gpus_per_node * self.node_tp(role)

    def node_cpus(self, role: str) -> float:
        """Ray CPUs of one node of ``role``: ``cpus_per_node`` for each of its ranks."""
        return self.cpus_per_node * self.node_tp(role)

    def node_bundle(self, role: str) -> dict[str, float]:
        """The one placement-group bundle of a tensor-parallel node: all its ranks' GPUs and CPUs (and the
        role's custom resource) on one Ray node, since the ranks share peer memory and one process tree.
        Ray refuses zero amounts in a bundle, so they are left out."""
        wanted = {"CPU": self.node_cpus(role), "GPU": self.node_gpus(role), **self.node_resources(role)}
        return {name: amount for name, amount in wanted.items() if amount > 0}

    @property
    def node_device(self) -> str:
        if self.device:
            return self.device
        return "cuda" if self.gpus_per_node > 0 else "cpu"

    @property
    def node_gpu_memory_fraction(self) -> float | None:
        """The share of its GPU a node may fill: with a fractional ``gpus_per_node`` Ray packs several
        nodes on one GPU, so each must size its KV from its share, not from what happens to be free."""
        if self.gpu_memory_fraction is not None:
            return self.gpu_memory_fraction
        if 0 < self.gpus_per_node < 1:
            # Less what a process holds outside torch's allocator (CUDA context), kept per share.
            return round(self.gpus_per_node * SHARED_GPU_USABLE, 4)
        return None

    def node_actor_options(self, role: str) -> dict[str, Any]:
        """Ray resources of a node actor: its GPU share (fractional when P and D share a GPU, one GPU a rank
        when it is tensor parallel) and CPUs."""
        return {"num_cpus": self.node_cpus(role), "num_gpus": self.node_gpus(role),
                "resources": self.node_resources(role)}

    def pin_resources(self) -> dict[str, float]:
        return {self.master_resource: 0.001} if self.master_resource else {}

    def role_resource(self, role: str) -> str | None:
        """The custom Ray resource of a node role, if the operator named one."""
        if role not in NODE_ROLES:
            raise ValueError(f"not a node role: {role!r}")
        return {"prefill": self.prefill_resource, "decode": self.decode_resource,
                "mixed": self.mixed_resource}[role]

    def node_resources(self, role: str) -> dict[str, float]:
        """Custom resources a node actor asks for: keeps each role on the Ray node types meant for it."""
        name = self.role_resource(role)
        return {name: 1.0} if name else {}

    def _base(self) -> list[str]:
        return [sys.executable, "-m", "pd_cluster.cli", "--log-level", self.log_level]

    def master_port(self, index: int = 0) -> int:
        """Master ``index``'s port: masters pinned to one Ray node must not share one."""
        return self.port + index * (self.master_workers + 1 if self.master_workers > 1 else 1)

    def master_argv(self, index: int = 0) -> list[str]:
        argv = self._base() + ["master", "--host", self.host, "--port", str(self.master_port(index)),
                               "--model", self.model, "--policy", self.policy]
        if self.master_workers > 1:
            argv += ["--workers", str(self.master_workers)]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        return argv + self.tls_argv("master")

    def node_argv(self, role: str, node_id: str, master_url: str, node_ip: str) -> list[str]:
        if role not in NODE_ROLES:
            raise ValueError(f"not a node role: {role!r}")
        argv = self._base() + [role, "--master", master_url, "--node-id", node_id, "--model", self.model,
                               "--device", self.node_device, *self.engine_argv(),
                               "--drain-timeout", str(self.drain_timeout_s)]
        if self.node_tp(role) > 1:
            # Ray shows the actor its GPUs as cuda:0 .. cuda:N-1, the devices --tp N takes from cuda.
            argv += ["--tp", str(self.node_tp(role))]
        # A fixed pool (max_total_tokens) leaves nothing to split.
        if not self.max_total_tokens and self.node_gpu_memory_fraction is not None and self.node_device != "cpu":
            argv += ["--gpu-memory-fraction", str(self.node_gpu_memory_fraction)]
        if role in DATA_PLANE_ROLES:
            # Prefill nodes on other machines dial this address; bind the same one.
            argv += ["--data-host", node_ip, "--data-port", "0"]
        return argv + self.tls_argv(role) + list(self.node_args)  # type: ignore[arg-type]
