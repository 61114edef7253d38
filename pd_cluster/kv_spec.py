"""The shape of a node's KV cache: what P and D must agree on before moving blocks."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernels.kv_rows import is_quantized, packed_row_bytes, row_bytes

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: Fields a P and a D may differ in: P converts its KV into D's format on the way.
CONVERTIBLE_FIELDS = frozenset({"kv_dtype"})


class KVSpec(BaseModel):
    """Layout of one token's keys and values across all layers."""

    model_config = ConfigDict(frozen=True)

    model: str = Field(description="model name that produced the KV")
    num_layers: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    dtype: str = Field(pattern="^(float32|bfloat16|float16)$")
    block_size: int = Field(default=1, gt=0)
    kv_dtype: str = Field(default="", pattern="^(float32|bfloat16|float16|int8|fp8_e4m3)$",
                          description="what the cache stores: the model dtype, or int8 / fp8_e4m3 values "
                                      "with a float32 scale per token and head (unset: the model dtype)")

    @model_validator(mode="before")
    @classmethod
    def _kv_dtype_defaults_to_dtype(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("kv_dtype"):
            data = {**data, "kv_dtype": data.get("dtype")}
        return data

    @property
    def quantized(self) -> bool:
        return is_quantized(self.kv_dtype)

    @property
    def row_width(self) -> int:
        """Elements of one (token, head) row as a handover moves it: ``head_dim`` values, or a
        quantized row's bytes (values, padding to 4 bytes, scale)."""
        return packed_row_bytes(self.head_dim) if self.quantized else self.head_dim

    @property
    def pool_row_width(self) -> int:
        """Elements of one (token, head) row as a pool stores it: :attr:`row_width`, a quantized
        row padded to 16 bytes for the attention kernels' loads (:mod:`kernels.kv_quant`)."""
        return row_bytes(self.head_dim) if self.quantized else self.head_dim

    @property
    def storage_dtype(self) -> str:
        """The cache tensor's element type (``uint8`` for packed quantized rows)."""
        return "uint8" if self.quantized else self.kv_dtype

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of every layer for one token as a handover moves them (quantized:
        values plus scales)."""
        return 2 * self.num_layers * self.num_kv_heads * self.row_width * self._element_bytes

    @property
    def pool_bytes_per_token(self) -> int:
        """Keys and values of every layer for one token as a pool stores them (quantized: with
        the rows' alignment padding)."""
        return 2 * self.num_layers * self.num_kv_heads * self.pool_row_width * self._element_bytes

    @property
    def _element_bytes(self) -> int:
        return 1 if self.quantized else _DTYPE_BYTES[self.kv_dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def with_kv_dtype(self, kv_dtype: str) -> "KVSpec":
        """The same KV stored as ``kv_dtype``."""
        return self.model_copy(update={"kv_dtype": kv_dtype})

    def mismatch(self, other: "KVSpec") -> list[str]:
        """Names of the fields on which two specs differ in a way no conversion bridges (empty
        when compatible): a P and a D of different KV dtypes pair, P converting."""
        return [name for name in type(self).model_fields
                if name not in CONVERTIBLE_FIELDS and getattr(self, name) != getattr(other, name)]
