"""The work arriving at the master, a second: prompt tokens and output tokens of the requests that
ended in the last ``window_s`` (the planner's load mix). Counted at a request's end, when its
output is known; a request's prompt counts once (its first choice)."""

from __future__ import annotations

import time
from collections import deque

from master.planner import LoadView
from master.relay_request import RelayRequest


class LoadMix:
    def __init__(self, window_s: float, scale: float = 1.0) -> None:
        """``scale``: this process's share of the traffic is 1 / scale (a master of several workers
        each sees its share of the requests)."""
        self.window_s = window_s
        self.scale = scale
        self._ended: deque[tuple[float, int, int]] = deque()
        self._started = time.monotonic()

    def record(self, r: RelayRequest) -> None:
        """A request ended (the relay's ``on_end`` hook)."""
        if r.dispatched:
            self.add(len(r.token_ids) if r.choice_index == 0 else 0, r.completion_tokens)

    def add(self, prompt_tokens: int, output_tokens: int, now: float | None = None) -> None:
        self._ended.append((time.monotonic() if now is None else now, prompt_tokens, output_tokens))

    def view(self, now: float | None = None) -> LoadView:
        now = time.monotonic() if now is None else now
        while self._ended and self._ended[0][0] < now - self.window_s:
            self._ended.popleft()
        span = max(min(self.window_s, now - self._started), 1e-3)
        return LoadView(prompt_tokens_per_s=self.scale * sum(e[1] for e in self._ended) / span,
                        output_tokens_per_s=self.scale * sum(e[2] for e in self._ended) / span)
