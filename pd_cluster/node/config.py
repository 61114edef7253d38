"""Settings of a prefill or decode node process."""

from __future__ import annotations

import socket

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from pd_cluster.config import EngineConfig


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
