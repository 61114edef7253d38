"""Settings of a prefill or decode node process."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pd_cluster.config import EngineConfig
from pd_cluster.tls import check_pair, client_context, server_context


class NodeSettings(BaseSettings):
    """Env names are the field names with prefix ``PD_`` (``PD_CLUSTER_TOKEN`` for the token)."""

    model_config = SettingsConfigDict(env_prefix="PD_", extra="ignore")

    master: str = Field(description="the masters' HTTP addresses, comma-separated (e.g. http://127.0.0.1:8000); "
                        "the node registers with each, and with every address of a name that resolves to several")
    node_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{__import__('os').getpid()}",
                         min_length=1, max_length=128)
    cluster_token: SecretStr
    engine: EngineConfig = Field(default_factory=EngineConfig)
    data_host: str = Field(default="127.0.0.1", description="decode: address P nodes dial (advertised)")
    data_bind: str | None = Field(default=None, description="decode: bind address (default: data_host)")
    data_port: int = Field(default=0, ge=0, lt=65536, description="decode: data-plane port, 0 = any free")
    status_host: str = "127.0.0.1"
    status_port: int = Field(default=0, ge=0, lt=65536, description="/livez, /readyz, /drain; 0 = off")
    lease_s: float = Field(default=30.0, gt=0, description="how long D holds KV reserved for a P that went quiet")
    max_channels: int = Field(default=8, gt=0, description="prefill: open data-plane channels (LRU beyond)")
    drain_timeout_s: float = Field(default=600.0, gt=0)
    kv_ipc: bool = Field(default=True, description="on one GPU, KV is written in place into D's pool (CUDA IPC) "
                                                   "instead of sent through the tensor channel")
    kv_ipc_across_gpus: bool = Field(default=False, description="decode: also share the pool with P on other GPUs "
                                                                "of this host")
    reconnect_s: float = Field(default=0.1, gt=0, description="first retry delay after losing a master")
    max_reconnect_s: float = Field(default=1.0, gt=0, description="longest retry delay (jittered) to a lost master")
    tls_ca: Path | None = Field(default=None, description="CA file (PEM) that https masters' and TLS decode nodes' "
                                "certificates are checked against (default: the system's CAs)")
    tls_cert: Path | None = Field(default=None, description="decode: certificate (PEM) of its TLS data-plane listener")
    tls_key: Path | None = Field(default=None, description="decode: the key of tls_cert")
    data_tls: bool | None = Field(default=None, description="data-plane control connections over TLS (the KV "
                                  "tensors are not: they go through gloo/NCCL); default: on when tls_ca or "
                                  "tls_cert is given")
    data_tls_name: str | None = Field(default=None, description="prefill: the name decode nodes' data-plane "
                                      "certificates must hold (one certificate for nodes whose addresses are not "
                                      "known ahead, e.g. pods); default: each decode node's data_host")

    @model_validator(mode="after")
    def _tls_pair(self) -> "NodeSettings":
        check_pair(self.tls_cert, self.tls_key)
        return self

    @property
    def data_plane_tls(self) -> bool:
        """Whether this node's data-plane connections are (to be) encrypted."""
        return self.data_tls if self.data_tls is not None else (self.tls_ca is not None or self.tls_cert is not None)

    def data_listener_tls(self) -> ssl.SSLContext | None:
        """A decode node's listener context; raises ValueError when TLS is on without a certificate."""
        if not self.data_plane_tls:
            return None
        if self.tls_cert is None or self.tls_key is None:
            raise ValueError("the data plane is on TLS (--tls-ca or --data-tls) but this decode node has no "
                             "--tls-cert/--tls-key to present")
        return server_context(self.tls_cert, self.tls_key)

    def data_dialer_tls(self) -> ssl.SSLContext | None:
        """A prefill node's context for dialing decode nodes (None: plain TCP)."""
        return client_context(self.tls_ca) if self.data_plane_tls else None

    def master_link_tls(self) -> ssl.SSLContext | None:
        """What a ``https://`` master's certificate is checked with (None: the system's CAs)."""
        return client_context(self.tls_ca) if self.tls_ca is not None else None
