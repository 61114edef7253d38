"""What rank 0 of a tensor-parallel node tells each other rank it starts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RankSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    dtype: str = Field(pattern="^(float32|bfloat16|float16)$")
    device: str = Field(description="this rank's device: cpu, or cuda:N")
    fused_rows: int | None = None
    load_format: Literal["safetensors", "dummy"] = "safetensors"
    all_reduce_mode: Literal["auto", "nccl", "oneshot"] = "auto"
    quantization: Literal["none", "int8", "fp8", "fp8_mixed"] = "none"
    #: What the KV pool stores: the model dtype (empty), or a quantized kind.
    kv_dtype: Literal["", "int8", "fp8_e4m3"] = ""
    rank: int = Field(ge=1)
    size: int = Field(ge=2)
    store_host: str
    store_port: int = Field(gt=0)
    #: Rank 0's process id: a rank whose parent is gone stops.
    parent_pid: int
    step_timeout_s: float = Field(gt=0)
    #: Longest wait for rank 0's next message (it sends keep-alives more often when idle).
    idle_timeout_s: float = Field(gt=0)
