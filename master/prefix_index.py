"""An approximate picture of which prompt prefixes a node holds in its KV cache.

Nodes announce blocks entering and leaving their radix cache as chained block hashes
(:mod:`pd_cluster.block_hash`); because each hash covers all tokens before its block,
the number of a prompt's leading hashes found here is the length of the prefix the node can
reuse. The picture may lag the node by one status interval, which routing tolerates. The set is
bounded (least recently stored first out) so a node that never reports evictions cannot grow it
without limit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, max_blocks: int) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def apply(self, stored: Iterable[int] = (), evicted: Iterable[int] = (), cleared: bool = False) -> None:
        """Fold one KVEvents frame in: ``cleared`` first, then evictions, then new blocks."""
        if cleared:
            self._blocks.clear()
        for block_hash in evicted:
            self._blocks.pop(block_hash, None)
        for block_hash in stored:
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def match(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks of a prompt (given as its chained hashes) held here."""
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in self._blocks:
                break
            hits += 1
        return hits
