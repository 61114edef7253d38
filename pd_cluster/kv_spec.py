"""The shape of a node's KV cache: what P and D must agree on before moving blocks."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class KVSpec(BaseModel):
    """Layout of one token's keys and values across all layers."""

    model_config = ConfigDict(frozen=True)

    model: str = Field(description="model name that produced the KV")
    num_layers: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    dtype: str = Field(pattern="^(float32|bfloat16|float16)$")
    block_size: int = Field(default=1, gt=0)

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def mismatch(self, other: "KVSpec") -> list[str]:
        """Names of the fields on which two specs differ (empty when compatible)."""
        return [name for name in type(self).model_fields if getattr(self, name) != getattr(other, name)]
