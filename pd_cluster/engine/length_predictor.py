"""Predicts how many more tokens a request will produce, from the lengths of recent ones.

Admission sizes a batch by its peak future KV need; assuming every request runs to
``max_tokens`` wastes most of the pool, so (as in Past-Future scheduling) the engine uses a
high quantile of recently finished output lengths instead and preempts when one runs longer.
"""

from __future__ import annotations

from collections import deque


class OutputLengthPredictor:
    def __init__(self, window: int = 512, quantile: float = 0.9, min_samples: int = 16) -> None:
        self._lengths: deque[int] = deque(maxlen=window)
        self._quantile = quantile
        self._min_samples = min_samples
        self._cached: int | None = None

    def observe(self, output_len: int) -> None:
        self._lengths.append(output_len)
        self._cached = None

    def _predicted_total(self) -> int | None:
        if len(self._lengths) < self._min_samples:
            return None
        if self._cached is None:
            ordered = sorted(self._lengths)
            self._cached = ordered[min(len(ordered) - 1, int(self._quantile * len(ordered)))]
        return self._cached

    def remaining(self, generated: int, max_tokens: int, ignore_eos: bool) -> int:
        """Expected further output tokens (at least 1 while the request can still grow)."""
        hard_left = max(max_tokens - generated, 0)
        predicted = None if ignore_eos else self._predicted_total()
        if predicted is None or hard_left == 0:
            return hard_left
        return min(hard_left, max(predicted - generated, 1))
