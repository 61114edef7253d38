"""Chained hashes of KV blocks: the names under which nodes announce, and the master looks up, cached prefixes.

A block's hash covers every token before it (through its parent's hash), so equal hashes mean
equal prefixes, not merely equal blocks. The encoding is fixed (blake2b, 8-byte digest, tokens as
little-endian int32, the parent as little-endian uint64) so that every process computes the
same numbers.

At token-level blocks (``block_size`` 1, the default) a prompt has one hash a token, about half a
microsecond each: 1.5 ms for a 1.5k-token chat turn, on the master's critical path. A later turn
repeats its conversation's earlier prompt, so :class:`BlockHashMemo` keeps the chains of recent
prompts in fixed runs of blocks and recomputes only the runs that changed.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence

_MASK64 = (1 << 64) - 1
_TOKEN_BYTES = 4
_DIGEST_BYTES = 8


def _full_blocks_bytes(token_ids: Sequence[int], block_size: int) -> bytes:
    """The full blocks' tokens as little-endian int32 bytes (a trailing partial block dropped)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    tokens = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
    n_full = len(tokens) // block_size * block_size
    return struct.pack(f"<{n_full}i", *tokens[:n_full])


def _chain_digests(parent: int, data: bytes, step: int) -> bytes:
    """The chain over ``data``'s blocks of ``step`` bytes, as concatenated little-endian digests
    (a digest is its hash's little-endian bytes, so it feeds the next block as it is)."""
    blake2b = hashlib.blake2b
    digest = (parent & _MASK64).to_bytes(_DIGEST_BYTES, "little")
    digests = []
    for start in range(0, len(data), step):
        digest = blake2b(digest + data[start : start + step], digest_size=_DIGEST_BYTES).digest()
        digests.append(digest)
    return b"".join(digests)


def _as_ints(digests: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(digests) // _DIGEST_BYTES}Q", digests))


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """Chained hash of each FULL block: ``h_i = H(h_{i-1}, tokens of block i)``, ``h_{-1} = parent``.

    A trailing partial block gets no hash. Hashes are unsigned 64-bit ints.
    """
    data = _full_blocks_bytes(token_ids, block_size)
    return _as_ints(_chain_digests(parent, data, block_size * _TOKEN_BYTES)) if data else []


class BlockHashMemo:
    """:func:`block_hashes` of whole prompts (parent 0), remembering recent chains.

    A prompt's blocks are taken in runs of ``run_blocks`` from its start; a run is looked up by
    the hash before it and its tokens, so a prompt that shares a prefix with a recent one
    recomputes only the runs from where they part. At most ``max_runs`` runs are kept (least
    recently used first out); shared by threads.
    """

    def __init__(self, run_blocks: int = 32, max_runs: int = 32768) -> None:
        if run_blocks <= 0 or max_runs <= 0:
            raise ValueError("run_blocks and max_runs must be positive")
        self.run_blocks = run_blocks
        self.max_runs = max_runs
        self._runs: OrderedDict[tuple[int, bytes], bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._runs)

    def block_hashes(self, token_ids: Sequence[int], block_size: int) -> list[int]:
        data = _full_blocks_bytes(token_ids, block_size)
        step = block_size * _TOKEN_BYTES
        run_bytes = step * self.run_blocks
        parts: list[bytes] = []
        parent = 0
        for start in range(0, len(data), run_bytes):
            run = data[start : start + run_bytes]
            key = (parent, run)
            with self._lock:
                digests = self._runs.get(key)
                if digests is not None:
                    self._runs.move_to_end(key)
                    self.hits += 1
            if digests is None:
                digests = _chain_digests(parent, run, step)
                with self._lock:
                    self.misses += 1
                    self._runs[key] = digests
                    while len(self._runs) > self.max_runs:
                        self._runs.popitem(last=False)
            parts.append(digests)
            parent = int.from_bytes(digests[-_DIGEST_BYTES:], "little")
        return _as_ints(b"".join(parts))
