"""The quantized KV row's layout in numbers (:mod:`kernels.kv_quant` says what a row holds):
torch-free, so the wire protocol's KV spec, which every process reads, imports neither torch nor
Triton with it."""

from __future__ import annotations

#: The quantized KV kinds (``--kv-cache-dtype``), with the largest magnitude each stores.
QUANT_MAX: dict[str, float] = {"int8": 127.0, "fp8_e4m3": 448.0}
#: How the Triton kernels name each kind (their ``QUANT`` argument); None: the model dtype.
QUANT_CODES: dict[str | None, int] = {None: 0, "int8": 1, "fp8_e4m3": 2}
SCALE_BYTES = 4
#: A stored row's bytes are a multiple of this, the widest load the attention kernels issue.
ROW_ALIGN = 16


def is_quantized(kind: str) -> bool:
    return kind in QUANT_MAX


def scale_offset(head_dim: int) -> int:
    """Where a row's scale starts: after its values padded to 4 bytes."""
    return -(-head_dim // SCALE_BYTES) * SCALE_BYTES


def packed_row_bytes(head_dim: int) -> int:
    """Bytes of a row as a handover moves it: the values padded to 4 bytes, then the scale."""
    return scale_offset(head_dim) + SCALE_BYTES


def row_bytes(head_dim: int) -> int:
    """Bytes of one stored quantized (slot, head) row: :func:`packed_row_bytes` padded to
    :data:`ROW_ALIGN`."""
    return -(-packed_row_bytes(head_dim) // ROW_ALIGN) * ROW_ALIGN
