"""Which part of a model one rank of a tensor-parallel node holds.

KV heads are split into contiguous near-equal runs (rank ``r`` of ``N`` takes heads
``[r*H//N, (r+1)*H//N)``), and each rank takes the query heads of its KV heads, so every rank's
attention is complete for its heads and only the output projection sums over ranks. A split that
leaves a rank no KV head instead replicates: with ``N`` a multiple of ``H``, ``N/H`` ranks share
each KV head and split its query heads. The MLP's intermediate dimension splits the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_cluster.model.config import ModelConfig


@dataclass(frozen=True)
class HeadRange:
    """Heads ``[start, start + count)``."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of a node of ``size`` ranks."""

    rank: int = 0
    size: int = 1

    @property
    def whole(self) -> bool:
        return self.size == 1

    def check(self, config: ModelConfig) -> None:
        """Raise ValueError naming why ``config`` cannot be split over this many ranks."""
        n, kv, q = self.size, config.num_kv_heads, config.num_heads
        if n < 1 or not 0 <= self.rank < n:
            raise ValueError(f"tensor parallel rank {self.rank} of {n} is out of range")
        if n > 1 and config.moe is not None:
            raise ValueError(f"tp {n}: a mixture-of-experts model ({config.model_type}) is served at tp 1 "
                             "(its experts are not split over ranks)")
        if n > kv:
            if n % kv:
                raise ValueError(f"tp {n} exceeds the model's {kv} KV heads and is not a multiple of them")
            if (q // kv) % (n // kv):
                raise ValueError(f"tp {n}: the {q // kv} query heads of each KV head do not split over "
                                 f"{n // kv} ranks")
        if config.intermediate_size < n:
            raise ValueError(f"tp {n} exceeds the model's intermediate size {config.intermediate_size}")

    def kv_heads(self, config: ModelConfig) -> HeadRange:
        """The KV heads this rank stores and attends with."""
        n, kv = self.size, config.num_kv_heads
        if n <= kv:
            start = self.rank * kv // n
            return HeadRange(start, (self.rank + 1) * kv // n - start)
        return HeadRange(self.rank // (n // kv), 1)

    def q_heads(self, config: ModelConfig) -> HeadRange:
        """The query heads this rank computes: those of its KV heads (or its share of them)."""
        group = config.num_heads // config.num_kv_heads
        kv = self.kv_heads(config)
        if self.size <= config.num_kv_heads:
            return HeadRange(kv.start * group, kv.count * group)
        sharing = self.size // config.num_kv_heads
        per_rank = group // sharing
        return HeadRange(kv.start * group + (self.rank % sharing) * per_rank, per_rank)

    def intermediate(self, config: ModelConfig) -> HeadRange:
        """This rank's columns of the MLP's intermediate dimension."""
        size, n = config.intermediate_size, self.size
        start = self.rank * size // n
        return HeadRange(start, (self.rank + 1) * size // n - start)
