"""Chained hashes of KV blocks: the names under which nodes announce, and the master looks up, cached prefixes.

A block's hash covers every token before it (through its parent's hash), so equal hashes mean
equal prefixes, not merely equal blocks. The encoding is fixed (blake2b, 8-byte digest, tokens as
little-endian int32, the parent as little-endian uint64) so that every process computes the
same numbers.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_MASK64 = (1 << 64) - 1
_TOKEN_BYTES = 4


def _hash_block(parent: int, block: bytes) -> int:
    digest = hashlib.blake2b((parent & _MASK64).to_bytes(8, "little") + block, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """Chained hash of each FULL block: ``h_i = H(h_{i-1}, tokens of block i)``, ``h_{-1} = parent``.

    A trailing partial block gets no hash. Hashes are unsigned 64-bit ints.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    tokens = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
    n_full = len(tokens) // block_size * block_size
    if n_full == 0:
        return []
    data = struct.pack(f"<{n_full}i", *tokens[:n_full])
    step = block_size * _TOKEN_BYTES
    hashes: list[int] = []
    h = parent
    for start in range(0, len(data), step):
        h = _hash_block(h, data[start : start + step])
        hashes.append(h)
    return hashes
